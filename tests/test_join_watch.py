"""Early joins (``fault_tolerance.join: "early"``): the watch that reads torchft's lighthouse, and the period
schedule that ends a period for a joiner. Against a real ``torchft_lighthouse``: replicas stand in as torchft's
own lighthouse client, so the page read is the one the engine reads."""

import subprocess
import threading
import time
from datetime import timedelta

import pytest

from acco_ds.algorithms.periods import PeriodSchedule
from acco_ds.runtime.outer.join_watch import JoinWatch, parse_status
from dist import free_port
from ft import LIGHTHOUSE

pytest.importorskip("torchft")


@pytest.fixture
def lighthouse():
    port = free_port()
    proc = subprocess.Popen([LIGHTHOUSE, "--min_replicas", "1", "--bind", f"[::]:{port}", "--join_timeout_ms", "200",
                             "--heartbeat_timeout_ms", "3000"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def status(url):
    import urllib.request
    with urllib.request.urlopen(url + "/status", timeout=5) as reply:
        return parse_status(reply.read().decode())


def wait_for(predicate, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_the_watch_sees_a_joiner_waiting_and_nothing_in_steady_state(lighthouse):
    """Replica A forms a quorum alone. B heartbeating is not yet a waiting joiner; B asking for a quorum (which
    the lighthouse holds until A comes) is. A's own next quorum takes B in, after which nothing is waiting;
    a reset forgets what was seen."""
    from torchft._torchft import LighthouseClient
    wait_for(lambda: _reachable(lighthouse), "the lighthouse")
    a, b = (LighthouseClient(lighthouse, timedelta(seconds=5)) for _ in range(2))
    a.quorum("a:1", timedelta(seconds=10))
    s = status(lighthouse)
    assert (s.waiting, s.members, s.alive) == (0, {"a:1"}, {"a:1"}) and not s.joiner_waiting
    watch = JoinWatch(lighthouse, 0.05)
    try:
        b.heartbeat("b:2")
        s = status(lighthouse)
        assert s.joiners == {"b:2"} and not s.joiner_waiting, "alive but not asking: no joiner waits yet"
        time.sleep(0.3)
        assert not watch.seen and watch.reads > 0
        joined = {}
        t = threading.Thread(target=lambda: joined.update(q=b.quorum("b:2", timedelta(seconds=20))))
        t.start()
        wait_for(lambda: status(lighthouse).joiner_waiting, "B to wait for a quorum")
        wait_for(lambda: watch.seen, "the watch to see B waiting")
        a.quorum("a:1", timedelta(seconds=10))  # A's (early) sync: B is in it
        t.join(10)
        assert sorted(p.replica_id for p in joined["q"].participants) == ["a:1", "b:2"]
        watch.reset()
        assert not watch.seen
        s = status(lighthouse)
        assert s.members == {"a:1", "b:2"} and s.waiting == 0 and not s.joiner_waiting
        time.sleep(0.3)
        assert not watch.seen, "after the quorum nobody waits"
        # Nobody heartbeats any more: past the lighthouse's 3 s heartbeat timeout both are listed as old.
        wait_for(lambda: not status(lighthouse).alive, "the heartbeats to age", timeout=6)
        assert status(lighthouse).members == {"a:1", "b:2"}
    finally:
        watch.close()


def _reachable(url):
    try:
        return status(url) is not None
    except OSError:
        return False


@pytest.mark.parametrize("code", [200, 404])
def test_a_page_that_is_not_torchfts_turns_the_watch_off(code):
    """A server that answers /status with another page, or with 404, is not torchft's lighthouse: one line
    says early joins are off, and the watch stops reading."""
    import http.server

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(code)
            self.end_headers()
            self.wfile.write(b"<html>a dashboard of something else</html>")

        def log_message(self, *args):
            pass

    assert parse_status("<html>a dashboard of something else</html>") is None
    lines = []
    server = http.server.HTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        watch = JoinWatch(f"http://127.0.0.1:{server.server_port}", 0.05, say=lines.append)
        wait_for(lambda: lines, "the watch to give up")
        watch.close()
    finally:
        server.shutdown()
        server.server_close()
    assert len(lines) == 1 and "does not read like torchft's" in lines[0] and "early joins are off" in lines[0]
    assert not watch.seen and watch.reads == 0


def test_a_period_ends_early_for_a_joiner_and_the_next_one_is_whole():
    s = PeriodSchedule("diloco", 4)
    assert s.after_inner_step() is None
    sync = s.after_inner_step(end_now=True)
    assert (sync.period, sync.steps, sync.early, sync.blocking) == (0, 2, True, True)
    assert [s.after_inner_step() for _ in range(3)] == [None] * 3
    sync = s.after_inner_step(end_now=True)  # the scheduled end: not early
    assert (sync.period, sync.steps, sync.early) == (1, 4, False)
    co2 = PeriodSchedule("co2", 3)
    first = co2.after_inner_step(end_now=True)
    assert first.send and not first.wait_previous and first.early and first.steps == 1
    assert co2.after_inner_step(end_now=True).wait_previous  # in flight from the early end
