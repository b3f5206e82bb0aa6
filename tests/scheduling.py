"""Which test each xdist worker runs next: both cores busy, never crowded.

``make test`` starts one worker more than the machine has cores. A multi-process (``slow``) test spends part of
its time waiting (ranks meeting, a deliberate silence, a process starting), and two of them at once leave both
cores idle in those moments. The extra worker fills them with single-process tests, under three rules:

- at most ``cores`` workers hold multi-process tests at any time, as with one worker per core;
- the ``alone`` group goes out once no multi-process test is left to hand out (its lock in ``conftest.py`` then
  waits for those still running), and beside it at most ``cores - 1`` workers hold single-process tests;
- while multi-process tests are left, single-process tests worth the ``alone`` group's time per core beside it
  are kept back, so the group does not end up running next to an idle core.

Everything else is xdist's ``loadgroup``: the queue in collection order (longest first within each kind,
``conftest.py``), one group per worker, and a worker runs a test only once it holds the next one (it needs the
next item for teardown), so a worker holding one test is waiting, not running.

The workers write each test's kind to a file named after the run (``write_kinds``) while they collect; the
controller reads it when it hands out the first tests. Without it every test counts as multi-process.
"""

import json
import os
import tempfile
from pathlib import Path

from xdist.scheduler import LoadGroupScheduling

SLOW, ALONE, REST = 0, 1, 2


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


class CoreScheduling(LoadGroupScheduling):
    """xdist's ``loadgroup`` with the rules above; ``cores`` is the number of cores the tests may use and
    ``seconds`` the tests' wall times (``tests/durations.json``), by node id without the group."""

    def __init__(self, config, log=None, *, cores: int, seconds: dict, default_s: dict, kinds: dict | None = None):
        super().__init__(config, log)
        self.cores = max(1, cores)
        self.seconds, self.default_s = seconds, default_s
        self.kinds = kinds  # read from the workers' file at the first hand-out when None
        self._units: dict = {}  # scope -> (kind, seconds)
        self._left = self._left_s = None  # units and seconds of each kind still queued

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
            kind, seconds = self._info(scope)
            self._left[kind] -= 1
            self._left_s[kind] -= seconds
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    def _kind(self, nodeid: str) -> int:
        return self.kinds.get(key(nodeid), SLOW) if self.kinds is not None else SLOW

    def _info(self, scope: str) -> tuple:
        """A queued unit's kind (its most demanding test's) and its tests' seconds, computed once."""
        if scope not in self._units:
            unit = self.workqueue[scope]
            kinds = [self._kind(nodeid) for nodeid in unit]
            seconds = sum(self.seconds.get(key(n), self.default_s[k]) for n, k in zip(unit, kinds))
            self._units[scope] = (min(kinds), seconds)
        return self._units[scope]

    def _held(self, node) -> set:
        """Kinds of the tests a worker holds and has not finished."""
        return {self._kind(n) for unit in self.assigned_work.get(node, {}).values() for n, done in unit.items()
                if not done}

    def _pick(self, node):
        """The first unit in the queue this worker may take now, or None."""
        if self._left is None:  # the whole queue, at the first hand-out
            self._left, self._left_s = [0, 0, 0], [0.0, 0.0, 0.0]
            for scope in self.workqueue:
                kind, seconds = self._info(scope)
                self._left[kind] += 1
                self._left_s[kind] += seconds
        held = {other: self._held(other) for other in self.nodes}
        mine = held.get(node, set())
        may_slow = SLOW in mine or sum(SLOW in kinds for kinds in held.values()) < self.cores
        alone_holder = next((other for other, kinds in held.items() if ALONE in kinds), None)
        slow_left = self._left[SLOW] > 0
        for scope in self.workqueue:
            kind, seconds = self._info(scope)
            if kind == SLOW and may_slow:
                return scope
            if kind == ALONE and not slow_left:
                return scope
            if kind != REST:
                continue
            if alone_holder is not None and alone_holder is not node:
                beside = sum(REST in kinds for other, kinds in held.items() if other is not alone_holder)
                if REST not in mine and beside >= self.cores - 1:
                    return None
            elif slow_left and self._left_s[REST] - seconds < (self.cores - 1) * self._left_s[ALONE]:
                return None
            return scope
        return None
