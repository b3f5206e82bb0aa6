"""The suite runs on both cores: ``make test`` starts two pytest-xdist workers (``-n 2 --dist loadgroup``).

Order. Tests start longest first (their wall times in a parallel run are kept in ``tests/durations.json``), so
that the run ends on short tests on both workers instead of one long test beside an idle core. Multi-process
(``slow``) tests go first, then the ``alone`` tests, then the single-process rest.

Tests marked ``alone`` (timing bounds of a few seconds that other multi-process load would stretch) form one
xdist group, run one after another by one worker, while the other worker runs the single-process tests. An
``alone`` test holds an exclusive lock, every ``slow`` test a shared one, so an ``alone`` test never overlaps a
multi-process test; a turnstile in front of the shared lock lets a waiting ``alone`` test in as soon as the
other worker's current test ends. Single-process tests take no lock: one process on one core leaves the other
core to the ``alone`` test. Ports (``dist.free_port``) come from a block of the worker's own, temporary folders
from pytest's ``tmp_path``, which is per worker too.

``ACCO_DS_STORE_DURATIONS=1 make test`` rewrites ``tests/durations.json`` from the run.

One ninja. The venv's ``bin`` goes first on ``PATH`` for the whole run, so every JIT build of an op (DeepSpeed's
shared-memory op at each rank's ``init_distributed``) runs the venv's ninja: a system ninja of another version
keeps another ``.ninja_log`` format, and each switch between the two rebuilt the op from scratch (about a minute
of CPU, inside whichever test met it first).

Compiled modules kept. ``PYTHONDONTWRITEBYTECODE`` is taken out of the run's environment: with it, every process
the suite starts (ranks, launchers, examples) compiled acco_ds, the tests and the examples from source again,
about 0.1 s of CPU each; without it they share the ``__pycache__`` folders (ignored by git).

Every process's CPU time counted. A process whose parent ends first (a rank whose launcher was killed, a
daemon a test leaves behind) is reparented to the nearest *subreaper* above it, or to init, which reaps it
where no one counts its CPU time: GNU ``time`` over ``make test`` then undercounts what the run used. Each
process that runs tests makes itself a subreaper (``PR_SET_CHILD_SUBREAPER``), and reaps the orphans it
inherited at the session's end, so their time adds to its own children's and reaches ``make``. An orphan still
running then is a leftover process: it is named on stderr and reaped when it ends, within ``ORPHAN_WAIT_S``."""

import ctypes
import fcntl
import json
import os
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
VENV_BIN = str(Path(sys.executable).parent)
UNKNOWN_SLOW_S, UNKNOWN_FAST_S = 10.0, 0.5  # a test not in the table yet: a typical one of its kind
PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
ORPHAN_WAIT_S = 10.0


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
    """Hold this run's machine lock: exclusive for an ``alone`` test, shared for a multi-process one."""
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
    """Under xdist: the machine lock around each ``alone`` or ``slow`` test (setup, call and teardown)."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    alone = request.node.get_closest_marker("alone") is not None
    if not run or not (alone or request.node.get_closest_marker("slow")):
        yield
        return
    with machine_share(run, alone):
        yield


def _key(nodeid: str) -> str:
    return nodeid.split("@")[0]  # xdist appends "@group" under --dist loadgroup


def pytest_configure(config):
    """The venv's ``bin`` first on ``PATH`` (its ninja for every JIT build), and compiled modules kept, in this
    process and what it starts."""
    if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        sys.dont_write_bytecode = False
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != VENV_BIN:
        os.environ["PATH"] = os.pathsep.join([VENV_BIN, path]) if path else VENV_BIN
    if _runs_tests(config) and sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _runs_tests(config) -> bool:
    """An xdist worker, or a run without workers (the xdist controller only hands tests out)."""
    return bool(os.environ.get("PYTEST_XDIST_WORKER")) or not getattr(config.option, "numprocesses", None)


def _reap_orphans() -> None:
    """Reap the children left at the session's end: orphans this subreaper inherited (its own children, the fork
    servers, are reaped already), so that their CPU time counts in this process's children's. Those still running
    are waited for a while, then named (multiprocessing's resource tracker ends with this process: not waited)."""
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return  # none left
        running = [c for c in _children() if "resource_tracker" not in c]
        if not running:
            return
        if time.monotonic() > deadline:
            sys.stderr.write(f"processes left running after the tests: {'; '.join(running)}\n")
            return  # left to init
        time.sleep(0.05)


def _children() -> list:
    """This process's running children, as "pid: command line"."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if entry.name.isdigit() and int(fields[1]) == os.getpid() and fields[0] != "Z":
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{entry.name}: {command[:200]}")
        except (OSError, IndexError, ValueError):
            continue
    return found


def pytest_itemcollected(item):
    """The ``alone`` tests form one xdist group (marked at collection, before xdist reads the groups)."""
    if item.get_closest_marker("alone"):
        item.add_marker(pytest.mark.xdist_group("alone"))


def pytest_collection_modifyitems(config, items):
    """Order: ``slow`` tests, the ``alone`` group, the rest; longest first within each. Both workers collect in
    this order (xdist checks that they agree)."""
    seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}

    def order(item):
        kind = 1 if item.get_closest_marker("alone") else 0 if item.get_closest_marker("slow") else 2
        default = UNKNOWN_FAST_S if kind == 2 else UNKNOWN_SLOW_S
        return kind, -seconds.get(_key(item.nodeid), default)
    items.sort(key=order)


_took: dict = {}


def pytest_runtest_logreport(report):
    """Each test's wall time (setup, call and teardown), for ``ACCO_DS_STORE_DURATIONS``."""
    _took[_key(report.nodeid)] = _took.get(_key(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    dist = sys.modules.get("dist")  # tests/dist.py, if this process launched ranks
    if dist is not None:
        dist.stop_forkserver()  # reaped here, so that its ranks' CPU time counts for the run
    if _runs_tests(session.config) and sys.platform == "linux":
        _reap_orphans()
    if os.environ.get("ACCO_DS_STORE_DURATIONS") != "1" or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    table = {nodeid: round(s, 1) for nodeid, s in sorted(_took.items()) if s >= 0.5}
    DURATIONS.write_text(json.dumps(table, indent=0, sort_keys=True) + "\n")
