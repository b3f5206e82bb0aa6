"""Early joins (``acco.fault_tolerance.join: "early"``): live replicas notice a replica waiting to join.

A new or relaunched replica can only heal at a quorum, and the live replicas meet the lighthouse only at
their syncs, so without help it waits up to a whole period. Rank 0 of each live replica therefore reads the
lighthouse's status page every ``join_poll_s`` on a thread of its own. When some replica is waiting for a
quorum and a replica outside the last quorum is alive, a joiner is waiting: the loop then ends its period
at its next inner step (every rank of the replica takes rank 0's answer, ``JoinsAndHeals.joiner_waiting``),
and the sync that follows heals the joiner.

Why this condition:

* the lighthouse forgets who waits once a quorum forms, so between two syncs a waiting replica is someone
  who was not in the last quorum, or a live replica already at its next scheduled sync;
* requiring also a live replica outside the last quorum tells the two apart: in steady state every live
  replica is in the last quorum, so the schedule is untouched and a run without failures equals the
  simulator;
* what was read before this replica's last quorum formed is thrown away (``reset`` bumps a generation), so
  a joiner that took part in that quorum cannot end the next period.

The page is torchft's own dashboard (``/status``, torchft 0.2): counts in its "participants healthy"
bracket, the last quorum's members in ``<b>`` tags, one ``heartbeat`` item per replica. A page that does not
read like that turns the early join off with one line saying so; joiners then wait for the next sync.
"""

import re
import threading
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional, Set

_WAITING = re.compile(r"\[(\d+)/(\d+) participants healthy\]")
_MEMBER = re.compile(r"<b>\s*([^<]+?)\s*</b>")
_HEARTBEAT = re.compile(r'<li class="heartbeat\s*(old)?\s*">\s*(\S+): seen')


@dataclass(frozen=True)
class LighthouseStatus:
    """What the lighthouse's status page says: replicas waiting for a quorum (healthy), the last quorum's
    members, the replicas heartbeating within the lighthouse's heartbeat timeout."""
    waiting: int
    members: frozenset
    alive: frozenset

    @property
    def joiners(self) -> Set[str]:
        """Alive replicas that were not in the last quorum."""
        return set(self.alive - self.members)

    @property
    def joiner_waiting(self) -> bool:
        return self.waiting > 0 and bool(self.joiners)


def parse_status(html: str) -> Optional[LighthouseStatus]:
    """The status page's figures, or None when it does not read like torchft's."""
    waiting = _WAITING.search(html)
    head, sep, beats = html.partition("<h2>Heartbeats</h2>")
    if waiting is None or not sep:
        return None
    _, _, quorum = head.partition("<h3>Previous Quorum</h3>")
    members = frozenset(_MEMBER.findall(quorum))
    alive = frozenset(rid for old, rid in _HEARTBEAT.findall(beats) if not old)
    return LighthouseStatus(int(waiting.group(1)), members, alive)


class JoinWatch:
    """Reads ``<lighthouse>/status`` every ``poll_s`` seconds; ``seen`` once a joiner waits (module docstring).

    Args:
        lighthouse: the lighthouse's http(s) URL.
        poll_s: seconds between two reads.
        say: prints one line (the page cannot be read as torchft's).
    """

    def __init__(self, lighthouse: str, poll_s: float, say=print):
        self.url, self.poll_s, self.say = lighthouse.rstrip("/") + "/status", poll_s, say
        self.reads = 0  # pages read
        self._lock = threading.Lock()
        self._generation = 0
        self._seen = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="acco_ds-join-watch", daemon=True)
        self._thread.start()

    @property
    def seen(self) -> bool:
        return self._seen

    def reset(self) -> None:
        """A quorum just formed: forget what was read before it."""
        with self._lock:
            self._generation += 1
            self._seen = False

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            with self._lock:
                generation = self._generation
            try:
                with urllib.request.urlopen(self.url, timeout=max(self.poll_s, 2.0)) as reply:
                    html = reply.read().decode("utf-8", "replace")
            except urllib.error.HTTPError as err:  # it answers, but has no such page: not torchft's dashboard
                html = "" if err.code == 404 else None
            except OSError:  # the lighthouse is away for a moment; the quorum itself reports a lasting loss
                html = None
            if html is None:
                continue
            status = parse_status(html)
            if status is None:
                self.say(f"[acco_ds] the lighthouse's status page at {self.url} does not read like torchft's "
                         f"0.2 dashboard: early joins are off, a joiner waits for the next sync")
                return
            self.reads += 1
            with self._lock:
                if status.joiner_waiting and generation == self._generation:
                    self._seen = True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.poll_s + 5.0)


__all__ = ["JoinWatch", "LighthouseStatus", "parse_status"]
