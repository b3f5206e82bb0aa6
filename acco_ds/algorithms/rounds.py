"""The round schedule of ACCO, DPU and synchronous ZeRO-1, as pure logic.

Training proceeds in *rounds*. During a round the compute side accumulates
micro-batch gradients at the current parameters while the communication side
works on the gradients of the previous round: reduce-scatter, a sharded
optimizer update (``peek`` or ``commit``), all-gather of the new parameters.
When both sides are done the gathered parameters become the compute
parameters and the fresh gradients go to the communication side.

``acco``  (k = gradient_accumulation_steps / 2 micro-batches per round)::

    round     compute (k micro-batches at)      communication
    startup   θ0                                -
    E_t       θ_t                               θ̃_{t+1} = Peek(θ_t, g(θ̃_t)),  keep the reduced shard
    R_t       θ̃_{t+1}                           θ_{t+1} = Opt(θ_t, g(θ̃_t ∪ θ_t)): kept shard + new one

``dpu`` (2k per round): startup at θ0, then every round commits the previous
round's gradient, ``θ_{t+1} = Opt(θ_t, g(θ_{t-1}))``, while computing at θ_t.

``sync`` (2k per round): compute, then communicate and commit the same
round's gradient with nothing overlapped (stock ZeRO-1).

Nothing here touches tensors or threads; the engine asks the schedule what
the current round is and when it may end.
"""

from dataclasses import dataclass
from typing import Optional

STARTUP, ESTIMATE, REAL, DELAYED, SYNC = "startup", "estimate", "real", "delayed", "sync"
PEEK, COMMIT = "peek", "commit"


def overlaps(mode: str) -> bool:
    """Does ``mode``'s communication run while the compute side works? (``acco``, ``dpu``; not ``sync``, nor a
    local-SGD mode's inner steps, which are ``sync`` rounds.)"""
    return mode in ("acco", "dpu")


def keeps_shard(mode: str) -> bool:
    """Does ``mode`` have estimate rounds, whose reduced shard the real round adds back? (``acco``.)"""
    return mode == "acco"


@dataclass(frozen=True)
class Round:
    index: int
    kind: str
    """startup | estimate | real | delayed | sync"""
    comm: Optional[str]
    """What the communication side does during this round: None, "peek" or
    "commit". It works on the gradients accumulated in the previous round,
    except in ``sync`` mode where it runs after this round's compute on this
    round's gradients."""
    min_micro: int
    max_micro: int
    add_kept_shard: bool = False
    """The reduced shard kept from the previous (estimate) round is added."""
    keep_shard: bool = False
    """The reduced shard is kept for the next round (estimate rounds)."""

    @property
    def overlapped(self) -> bool:
        return self.comm is not None and self.kind != SYNC

    @property
    def commits(self) -> bool:
        return self.comm == COMMIT


class RoundSchedule:
    """Sequence of rounds for one mode.

    Args:
        mode: ``acco`` | ``dpu`` | ``sync``.
        min_micro: micro-batches per worker per round (exact in fixed
            accumulation, a minimum in adaptive accumulation).
        max_micro: upper bound per round (adaptive accumulation; equal to
            ``min_micro`` in fixed accumulation).

    The config (``acco_ds.config``) decides these numbers and rejects
    impossible combinations; the schedule only sequences rounds.
    """

    def __init__(self, mode: str, min_micro: int, max_micro: Optional[int] = None):
        if mode not in ("acco", "dpu", "sync"):
            raise ValueError(f"unknown round mode {mode!r}")
        self.mode = mode
        self.min_micro = min_micro
        self.max_micro = max(max_micro or min_micro, min_micro)
        self.index = 0
        self.current = self._round(0)

    @property
    def overlaps(self) -> bool:
        """Communication runs while the compute side works (not in ``sync``)."""
        return overlaps(self.mode)

    @property
    def adaptive(self) -> bool:
        return self.max_micro > self.min_micro

    def _round(self, i: int) -> Round:
        lo, hi = self.min_micro, self.max_micro
        if self.mode == "sync":
            return Round(i, SYNC, COMMIT, lo, lo)
        if i == 0:
            # Nothing to communicate yet, so nothing to wait for: accumulate the minimum.
            return Round(0, STARTUP, None, lo, lo)
        if self.mode == "dpu":
            return Round(i, DELAYED, COMMIT, lo, hi)
        if i % 2 == 1:
            return Round(i, ESTIMATE, PEEK, lo, hi, keep_shard=True)
        return Round(i, REAL, COMMIT, lo, hi, add_kept_shard=True)

    def may_end(self, micro_batches: int, comm_done: bool) -> bool:
        """Whether the current round can end after ``micro_batches`` local
        micro-batches, given whether its communication has finished.

        In fixed accumulation a round ends after exactly ``min_micro``
        micro-batches (the caller then waits for the communication). In
        adaptive accumulation it ends at the first micro-batch past the minimum
        at which the communication is done, or at the maximum.
        """
        r = self.current
        if micro_batches < r.min_micro:
            return False
        if micro_batches >= r.max_micro or not r.overlapped:
            return True
        return comm_done

    def advance(self) -> Round:
        self.index += 1
        self.current = self._round(self.index)
        return self.current

    def committed_steps(self, rounds_completed: int) -> int:
        """Committed optimizer steps after ``rounds_completed`` whole rounds."""
        if self.mode == "sync":
            return rounds_completed
        if self.mode == "dpu":
            return max(rounds_completed - 1, 0)
        return max(rounds_completed - 1, 0) // 2

    def state_dict(self) -> dict:
        return {"mode": self.mode, "index": self.index, "min_micro": self.min_micro, "max_micro": self.max_micro}

    def load_state_dict(self, sd: dict) -> None:
        mine = self.state_dict()
        for key in ("mode", "min_micro", "max_micro"):
            if sd[key] != mine[key]:
                raise ValueError(f"checkpoint was saved with ACCO {key}={sd[key]!r} but this run has {mine[key]!r}: "
                                 f"resume with the same acco block and gradient_accumulation_steps")
        self.index = int(sd["index"])
        self.current = self._round(self.index)
