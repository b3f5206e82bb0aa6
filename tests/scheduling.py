"""Which test each xdist worker runs next: both cores busy, never crowded.

``make test`` starts one worker more than the machine has cores. A multi-process (``slow``) test spends part of
its time waiting (ranks meeting, a deliberate silence, a process starting), and with one worker per core those
moments leave cores idle. The extra worker, the *filler*, fills them:

- it runs single-process tests only, shortest first (from the end of the queue), at the lowest CPU priority
  (``start_worker``): it gets a core when the others leave one idle, and costs the other tests next to nothing
  when they do not;
- the other workers, one per core, take the queue in collection order as ``loadgroup`` does (multi-process
  tests longest first, then the ``alone`` group, then single-process tests longest first; ``conftest.py``): at
  most one multi-process test per core runs at a time, and the ``alone`` group (its lock in ``conftest.py``
  waits for the multi-process tests still running) has at most ``cores - 1`` of them beside it.

A worker runs a test only once it holds the next one (it needs the next item for teardown), so a worker holding
one test is waiting, not running: every test that ends lets each worker ask again.

The workers write each test's kind to a file named after the run (``write_kinds``) while they collect; the
controller reads it when it hands out the first tests. Without it every test counts as multi-process.
"""

import json
import os
import sys
import tempfile
from pathlib import Path

from xdist.scheduler import LoadGroupScheduling

SLOW, ALONE, REST = 0, 1, 2
FILLER_NICE = 19


def kind_of(item) -> int:
    return ALONE if item.get_closest_marker("alone") else SLOW if item.get_closest_marker("slow") else REST


def key(nodeid: str) -> str:
    return nodeid.split("@")[0]  # xdist appends "@group" under --dist loadgroup


def kinds_path(run: str) -> Path:
    return Path(tempfile.gettempdir()) / f"acco_ds_tests_{run}.kinds.json"


def write_kinds(run: str, items) -> None:
    """Called by each worker at collection: the kinds of the tests it collected, for the controller."""
    path = kinds_path(run)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({key(item.nodeid): kind_of(item) for item in items}))
    os.replace(tmp, path)  # both workers write the same table: whichever lands last is whole


def cores() -> int:
    return len(os.sched_getaffinity(0))


def is_filler(worker: str, cores: int) -> bool:
    """Workers gw0 .. gw(cores - 1) take every kind of test; those above are fillers."""
    return int(worker.removeprefix("gw")) >= cores


def start_worker(worker: str) -> None:
    """In each worker at its start: a filler takes the lowest CPU priority, for itself and what it starts. Linux
    shares the CPU between sessions first (autogroups), so a nice value alone would only rank the filler among
    the processes of its own session: the filler opens a session of its own, whose group it nices, and its
    processes run under ``SCHED_IDLE`` (they get a core no other runnable process wants)."""
    if not is_filler(worker, cores()):
        return
    os.nice(FILLER_NICE)
    if sys.platform != "linux":
        return
    try:
        os.setsid()
        Path("/proc/self/autogroup").write_text(str(FILLER_NICE))
    except OSError:
        pass  # no autogroups (or already a session leader): the nice value and SCHED_IDLE still apply
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


class CoreScheduling(LoadGroupScheduling):
    """xdist's ``loadgroup`` with a filler (the rules above); ``cores``: the cores the tests may use."""

    def __init__(self, config, log=None, *, cores: int, kinds: dict | None = None):
        super().__init__(config, log)
        self.cores = max(1, cores)
        self.kinds = kinds  # read from the workers' file at the first hand-out when None

    def schedule(self) -> None:
        if self.kinds is None and self.nodes:
            path = kinds_path(self.nodes[0].workerinput["testrunuid"])
            self.kinds = json.loads(path.read_text()) if path.exists() else {}
        super().schedule()

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        for other in self.nodes:  # a test that ended may let another worker take what it could not
            if other is not node:
                self._reschedule(other)

    def _reschedule(self, node) -> None:
        if node.shutting_down:
            return
        if not self.workqueue:
            node.shutdown()
            return
        if self._pending_of(self.assigned_work.get(node, {})) < 2:
            self._assign_work_unit(node)

    def _assign_work_unit(self, node) -> None:
        scope = self._pick(node)
        if scope is not None:
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    def _kind(self, nodeid: str) -> int:
        return self.kinds.get(key(nodeid), SLOW) if self.kinds is not None else SLOW

    def _pick(self, node):
        """The unit of the queue this worker may take now, or None."""
        if not is_filler(node.gateway.id, self.cores):
            return next(iter(self.workqueue))
        return next((scope for scope in reversed(self.workqueue)
                     if all(self._kind(nodeid) == REST for nodeid in self.workqueue[scope])), None)
