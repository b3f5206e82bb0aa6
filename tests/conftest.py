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


# The longest tests of a parallel run (40 s and more each in `make test`, docs/testing.md): started first, so
# that none of them begins when only short tests are left to run beside it. A renamed test falls back to the
# multi-process tests' order; nothing else depends on this list.
LONGEST = ("test_exit.py::test_four_rank_diloco_launches_all_exit_zero",
           "test_edit.py::test_edit_resume_is_exact_with_the_detector_state",
           "test_examples_cleanup.py::test_the_fault_tolerance_example_leaves_nothing_running",
           "test_edit.py::test_edit_matches_the_simulator_with_each_penalty_option",
           "test_torch_host.py::test_a_checkpoint_of_another_layout_is_resharded_and_a_weights_only_load",
           "test_docs.py::test_example_launch_runs_as_written",
           "test_stress_reads.py::test_adaptive_reads_never_hang_under_load",
           "test_faults.py::test_checkpoint_from_other_settings",
           "test_gpu_check.py::test_gpu_check_cpu_dry_run")


def pytest_collection_modifyitems(config, items):
    """The longest tests first, then the other multi-process (``slow``) ones, then the rest: a worker that ends
    its last long test has short ones left to fill the time while the other worker ends its own, instead of one
    long test running alone at the end. Both workers collect in this order (xdist checks that they agree)."""
    def order(item):
        name = item.nodeid.split("/")[-1].split("[")[0]
        return (0, LONGEST.index(name)) if name in LONGEST else (1 if item.get_closest_marker("slow") else 2, 0)
    items.sort(key=order)
