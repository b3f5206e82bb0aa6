"""The suite's scheduler (``tests/scheduling.py``) driven by simulated xdist workers.

A simulated worker behaves as xdist's does: it runs a test only once it holds the next one (or was told to shut
down), and reports each test as it ends. The machine lock of ``conftest.py`` is modelled too: an ``alone`` test
never runs beside a multi-process one."""

import heapq
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from scheduling import ALONE, REST, SLOW, CoreScheduling


class Worker:
    def __init__(self, name: str):
        self.gateway = SimpleNamespace(id=name)
        self.workerinput = {"testrunuid": "simulated"}
        self.shutting_down = False
        self.queue: list = []

    def send_runtest_some(self, indices):
        self.queue.extend(indices)

    def shutdown(self):
        self.shutting_down = True


def simulate(tests, workers: int, cores: int):
    """Run ``tests`` (nodeid, kind, seconds), ordered as conftest orders them; returns the run's events."""
    ids = [f"t.py::{name}@alone" if kind == ALONE else f"t.py::{name}" for name, kind, _ in tests]
    kinds = {f"t.py::{name}": kind for name, kind, _ in tests}
    seconds = {f"t.py::{name}": s for name, _, s in tests}
    config = SimpleNamespace(getvalue=lambda name: [f"{workers}*popen"], option=SimpleNamespace(loadscopereorder=False))
    sched = CoreScheduling(config, cores=cores, seconds=seconds, default_s={SLOW: 1, ALONE: 1, REST: 1}, kinds=kinds)
    nodes = [Worker(f"gw{i}") for i in range(workers)]
    for node in nodes:
        sched.add_node(node)
    for node in nodes:
        sched.add_node_collection(node, ids)
    sched.schedule()
    now, ends, running, ran, held_slow_max = 0.0, [], {}, [], 0
    while True:
        for node in nodes:  # start what may start
            if node in running or not node.queue or (len(node.queue) < 2 and not node.shutting_down):
                continue
            kind = kinds[ids[node.queue[0]].split("@")[0]]
            others = {kinds[ids[i].split("@")[0]] for i in running.values()}
            if (kind == ALONE and SLOW in others) or (kind == SLOW and ALONE in others):
                continue  # the machine lock
            running[node] = node.queue[0]
            ran.append((now, kind, sorted(kinds[ids[i].split("@")[0]] for i in running.values())))
            heapq.heappush(ends, (now + seconds[ids[node.queue[0]].split("@")[0]], node.gateway.id, node))
        held_slow_max = max(held_slow_max, sum(SLOW in sched._held(node) for node in nodes))
        if not ends:
            break
        now, _, node = heapq.heappop(ends)
        index = running.pop(node)
        node.queue.pop(0)
        sched.mark_test_complete(node, index)
    return SimpleNamespace(ran=ran, nodes=nodes, sched=sched, held_slow_max=held_slow_max, end=now)


tests_strategy = st.lists(st.tuples(st.sampled_from([SLOW, ALONE, REST]), st.floats(0.1, 20)), min_size=1,
                          max_size=60)


@settings(max_examples=60, deadline=None)
@given(tests=tests_strategy, cores=st.integers(1, 4), extra=st.integers(0, 2))
def test_every_test_runs_once_and_the_cores_are_never_crowded(tests, cores, extra):
    named = sorted(((f"test_{i}", kind, s) for i, (kind, s) in enumerate(tests)), key=lambda t: (t[1], -t[2]))
    run = simulate(named, workers=cores + extra, cores=cores)
    assert len(run.ran) == len(named), "a test was never run: the workers waited for each other"
    assert not run.sched.workqueue and all(node.shutting_down and not node.queue for node in run.nodes)
    assert run.held_slow_max <= cores
    for _, kind, beside in run.ran:
        assert beside.count(SLOW) <= cores
        if ALONE in beside:
            assert SLOW not in beside and beside.count(REST) <= cores - 1


def test_the_extra_worker_runs_single_process_tests_beside_two_multi_process_ones():
    tests = [(f"slow_{i}", SLOW, 10.0) for i in range(6)] + [("alone_0", ALONE, 4.0), ("alone_1", ALONE, 4.0)]
    tests += [(f"rest_{i}", REST, 1.0) for i in range(40)]
    run = simulate(tests, workers=3, cores=2)
    slow_phase = [beside for when, _, beside in run.ran if when < 30]
    assert max(beside.count(SLOW) for beside in slow_phase) == 2
    assert any(beside.count(SLOW) == 2 and REST in beside for beside in slow_phase)
    beside_alone = [beside for _, _, beside in run.ran if ALONE in beside]
    assert beside_alone and all(beside.count(REST) <= 1 for beside in beside_alone)
    # kept back for the alone group: single-process tests still run beside it
    assert any(REST in beside for beside in beside_alone)
    # two workers alone: the slow tests (60 s over two) plus the group (8 s) and the rest beside it
    two = simulate(tests, workers=2, cores=2)
    assert run.end < two.end
