"""Per-round statistics: what each round did and how long each side took.

The engine reads them (``acco_stats()``, progress lines, monitor events);
nothing here feeds back into training.
"""

from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import List, Optional

from .job import CommResult, Phases


@dataclass
class RoundStats:
    index: int
    kind: str
    micro_batches: int  # local
    compute_s: float  # time on the compute side, excluding waiting
    wait_s: float  # time the compute side waited for the communication
    comm_s: float  # duration of the communication job of this round
    global_micro: Optional[int] = None
    worker_micro: Optional[List[int]] = None


class RoundLog:
    """The last rounds and running totals."""

    def __init__(self, maxlen: int = 10000):
        self.history = deque(maxlen=maxlen)
        self.totals = {"rounds": 0, "micro_batches": 0, "compute_s": 0.0, "wait_s": 0.0, "comm_s": 0.0}
        self.totals.update({f.name + "_s": 0.0 for f in fields(Phases)})

    def record(self, index: int, kind: str, micro: int, elapsed_s: float, wait_s: float,
               result: Optional[CommResult], counts_previous: bool) -> None:
        """One finished round. ``counts_previous``: the job reduced the previous
        round's gradients (every mode but sync), so its counts belong there."""
        stats = RoundStats(index, kind, micro, elapsed_s - wait_s, wait_s, result.comm_s if result else 0.0)
        target = (self.history[-1] if self.history else None) if counts_previous else stats
        if result is not None and target is not None:
            target.worker_micro = result.worker_micro
            target.global_micro = sum(result.worker_micro)
        self.history.append(stats)
        if result is not None:
            for key, value in asdict(result.phases).items():
                self.totals[key + "_s"] += value
        for key, value in (("rounds", 1), ("micro_batches", micro), ("compute_s", stats.compute_s),
                           ("wait_s", wait_s), ("comm_s", stats.comm_s)):
            self.totals[key] += value

    def summary(self) -> dict:
        t = dict(self.totals)
        # Only communication that overlaps compute can be hidden (sync mode hides nothing by design).
        t["hidden_comm_fraction"] = max(0.0, 1.0 - t["wait_s"] / t["comm_s"]) if t["comm_s"] > 0 else None
        t["mean_micro_per_round"] = t["micro_batches"] / t["rounds"] if t["rounds"] else None
        t["last_rounds"] = [asdict(s) for s in list(self.history)[-8:]]
        return t


__all__ = ["RoundStats", "RoundLog"]
