"""The suite runs on both cores: ``make test`` starts two pytest-xdist workers (``-n 2 --dist loadgroup``).

Tests marked ``alone`` (timing, bandwidth, network namespaces: they need the machine to themselves) hold an
exclusive lock while they run; every other test holds a shared one. A turnstile in front of the shared lock
lets a waiting ``alone`` test in as soon as the other worker's current test ends, so it never waits behind a
queue of them. Ports (``dist.free_port``) come from a block of the worker's own; temporary folders from
pytest's ``tmp_path``, which is per worker too."""

import fcntl
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a+") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def machine_share(run: str, alone: bool):
    """Hold this run's machine lock: exclusive for an ``alone`` test, shared for the rest."""
    folder = Path(tempfile.gettempdir())
    turnstile, machine = (folder / f"acco_ds_tests_{run}.{name}" for name in ("turnstile", "lock"))
    if alone:
        with _flock(turnstile, fcntl.LOCK_EX), _flock(machine, fcntl.LOCK_EX):
            yield
        return
    with _flock(turnstile, fcntl.LOCK_EX):
        f = open(machine, "a+")
        fcntl.flock(f, fcntl.LOCK_SH)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


@pytest.fixture(autouse=True)
def _one_machine(request):
    """Under xdist: the machine lock around each test (setup, call and teardown)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    with machine_share(run, request.node.get_closest_marker("alone") is not None):
        yield


def pytest_collection_modifyitems(config, items):
    """Multi-process (``slow``) tests first: a worker that ends its last long test has the short ones left to
    fill the time while the other worker ends its own, instead of one long test running alone at the end.
    Both workers collect in this order (xdist checks that they agree)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
