"""Per-round statistics: what each round did and how long each side took.

The hosts read them (``acco_stats()``, progress lines, monitor events, the
summary lines of ``report_lines``); nothing here feeds back into training.
"""

from collections import deque
from dataclasses import asdict, dataclass, fields
from typing import List, Optional, Tuple

from ..comm.compression import describe
from ..dtypes import dtype_name
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


def round_stats(opt) -> dict:
    """The figures of a ``RoundDriver``'s rounds (``acco_stats()``), with its outer loop's."""
    out = dict(opt.log.summary(), mode=opt.acco.mode, accumulation=opt.acco.accumulation,
               kernels=opt.kernels.name, optimizer_update=opt.update.name, buffer_bytes=opt.buffer_bytes(),
               compression=None if opt.codec is None else str(opt.codec),
               compressed_bytes=None if opt.codec is None else opt.codec.sent_bytes)
    out.update(opt.outer.stats())
    return out


def banner(acco, opt, host: str = "ACCO engine") -> str:
    """The one start-up line rank 0 prints (``host``: who trains)."""
    outer = opt.outer.banner()
    if outer:  # inner steps are plain ZeRO-1 steps of gradient_accumulation_steps micro-batches
        words = f"{outer} inner=ZeRO-1 step of {opt.schedule.min_micro} micro-batches/rank"
    else:
        words = (f"accumulation={acco.accumulation} micro-batches/round={opt.schedule.min_micro}"
                 f"{'' if opt.schedule.max_micro == opt.schedule.min_micro else f'..{opt.schedule.max_micro}'} "
                 f"world_size={opt.world_size}")
    words += f" collectives={opt.layout or 'flat'} compression=[{_compression(acco, opt)}]"
    return (f"{host}: mode={acco.mode} {words} model={dtype_name(opt.dtype)} "
            f"grad_accum={dtype_name(opt.accum_dtype)} communication={dtype_name(opt.comm_dtype)} "
            f"kernels={opt.kernels.name} update={opt.update.name} "
            f"extra buffers={opt.buffer_bytes()['total'] / 2**20:.1f} MiB/rank")


def _compression(acco, opt) -> str:
    outer = opt.outer.stats().get("outer_compression") is not None
    return describe(acco.compression, acco.local, rounds=opt.codec is not None, outer=outer,
                    decoupled=acco.mode == "decoupled")


def round_words(s: dict) -> str:
    hidden = s["hidden_comm_fraction"]
    return (f"rounds={s['rounds']} micro-batches/round={s['mean_micro_per_round']:.2f} "
            f"compute={s['compute_s']:.2f}s comm={s['comm_s']:.2f}s waited={s['wait_s']:.2f}s "
            f"hidden={'n/a' if hidden is None else f'{100 * hidden:.0f}%'}")


def report_lines(opt) -> List[Tuple[str, str]]:
    """The mode's lines of a run summary, ``(label, text)``: an outer loop's own, or ACCO's rounds."""
    outer = opt.outer.report()
    s = opt.log.summary()
    lines = [] if opt.codec is None else [
        ("compression", f"rounds {opt.codec}: {opt.codec.sent_bytes / 2**20:.2f} MiB sent by this rank "
                        f"(payload, scales included)")]
    if outer:
        inner = (f"{s['rounds']} inner steps on this rank, ZeRO-1 communication {s['comm_s']:.2f} s "
                 f"(not overlapped); kernels={opt.kernels.name}, update={opt.update.name}")
        return [("inner steps", inner)] + lines + outer
    hidden = "n/a" if s["hidden_comm_fraction"] is None else f"{100 * s['hidden_comm_fraction']:.0f}%"
    return [("ACCO rounds", f"{s['rounds']} rounds, {s['mean_micro_per_round'] or 0:.2f} micro-batches/round, "
                            f"communication {s['comm_s']:.2f} s of which {hidden} hidden behind compute "
                            f"(compute waited {s['wait_s']:.2f} s); kernels={opt.kernels.name}, "
                            f"update={opt.update.name}")] + lines


__all__ = ["RoundStats", "RoundLog", "round_stats", "banner", "round_words", "report_lines"]
