"""The suite's scheduler (``tests/scheduling.py``) driven by simulated xdist workers.

A simulated worker behaves as xdist's does: it runs a test only once it holds the next one (or was told to shut
down), and reports each test as it ends. The machine lock of ``conftest.py`` is modelled too: an ``alone`` test
never runs beside a multi-process one."""

import heapq
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from scheduling import ALONE, REST, SLOW, CoreScheduling, is_filler


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
    sched = CoreScheduling(config, cores=cores, kinds=kinds)
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
            ran.append(SimpleNamespace(when=now, kind=kind, filler=is_filler(node.gateway.id, cores), name=ids[
                node.queue[0]], beside=sorted(kinds[ids[i].split("@")[0]] for i in running.values()), core_beside=sorted(
                kinds[ids[i].split("@")[0]] for n, i in running.items() if not is_filler(n.gateway.id, cores))))
            heapq.heappush(ends, (now + seconds[ids[node.queue[0]].split("@")[0]], node.gateway.id, node))
        held_slow_max = max(held_slow_max, sum(any(kinds[ids[i].split("@")[0]] == SLOW for i in node.queue)
                                               for node in nodes))
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
    assert sorted(r.name.split("::")[1].split("@")[0] for r in run.ran) == sorted(name for name, _, _ in named), \
        "a test was never run, or twice: the workers waited for each other"
    assert not run.sched.workqueue and all(node.shutting_down and not node.queue for node in run.nodes)
    assert run.held_slow_max <= cores
    for r in run.ran:
        assert r.beside.count(SLOW) <= cores
        assert not r.filler or r.kind == REST
        if ALONE in r.beside:
            assert SLOW not in r.beside and r.core_beside.count(REST) <= cores - 1


def test_the_filler_runs_the_shortest_single_process_tests_beside_two_multi_process_ones():
    tests = [(f"slow_{i}", SLOW, 10.0) for i in range(6)] + [("alone_0", ALONE, 4.0), ("alone_1", ALONE, 4.0)]
    tests += [(f"rest_{i}", REST, 1.0 + (40 - i) / 10) for i in range(40)]  # longest first, as conftest orders
    run = simulate(tests, workers=3, cores=2)
    filler = [r for r in run.ran if r.filler]
    assert [r.name for r in filler[:3]] == ["t.py::rest_39", "t.py::rest_38", "t.py::rest_37"]
    assert any(r.beside.count(SLOW) == 2 and REST in r.beside for r in filler)
    assert max(r.beside.count(SLOW) for r in run.ran) == 2
    core = [r for r in run.ran if not r.filler]
    assert [r.name for r in core[:6]] == [f"t.py::slow_{i}" for i in range(6)]
    beside_alone = [r for r in run.ran if ALONE in r.beside]
    assert beside_alone and all(r.core_beside.count(REST) <= 1 for r in beside_alone)
    two = simulate(tests, workers=2, cores=2)
    assert run.end < two.end
