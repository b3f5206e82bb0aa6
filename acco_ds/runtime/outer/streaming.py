"""Streaming DiLoCo: ``diloco`` with the model split into fragments that sync at staggered steps.

With F fragments and H = ``sync_every``, a window is h = H / F inner steps. Window w (counted from 0)
belongs to fragment f = w mod F (round-robin from fragment 0); with s the inner step inside the window
(1..h):

* at s = h − τ (prepare): δ_f = g_f − θ_f on this rank's part of the fragment (g_f: the fragment's last
  global values, initially the starting weights; θ_f: the replica's current values), and the mean over
  replicas starts. With τ > 0 it runs on the outer communication thread while the inner steps go on;
* at s = h (sync): wait for that fragment only; the outer optimizer (SGD with Nesterov momentum, one
  momentum per fragment) steps g_f with the mean, g_f ← g_f'; the replica's fragment becomes
  ``lerp(g_f', θ_f, α) = g_f' + α (θ_f − g_f')`` (θ_f: its values now, τ steps past δ_f).

Each fragment syncs every H inner steps; F = 1, τ = 0, α = 0 is DiLoCo (the host then builds
``diloco.DiLoCo`` itself). Parameter j (element offset o_j in the flat buffers, N elements in all)
belongs to fragment ⌊F o_j / N⌋, so a fragment is a contiguous range of each flat buffer and, on this
rank, a slice of each master shard. The anchor g and the momentum are sharded like the master weights
(8N/k bytes per rank for k ranks per replica, not per fragment); one fragment's δ is in flight at a time.
Users read every fragment's g_f (``committed_flats``), as in DiLoCo.

Mixture of experts: the offsets run over this rank's groups, dense first, then its expert groups (each
partitioned over its expert-data-parallel ranks inside the replica), so a fragment may hold a slice of an
expert group. The ranks that hold the same expert shard in every replica (the expert group's rails) are the
ranks at this rank's place in every replica: its outer group, which carries a fragment's dense and expert
slices in one all-reduce.
"""

import itertools
import time
from typing import List, Optional, Tuple

import torch

from .diloco import DiLoCo, fragments_mismatch
from .interface import ReplicaGroups, Shards


def fragment_slices(shards: Shards, groups: ReplicaGroups, fragments: int) -> List[List[Tuple[int, int, int]]]:
    """Per fragment, the (group, lo, hi) slices of this rank's master shards it covers (shard coordinates), each
    group cut at this rank's partition index in it (an expert group's own, inside the replica).
    Raises ``ValueError`` for a fragment without parameters."""
    sizes = [[p.numel() for p, _ in group] for group in shards.params]
    total = sum(sum(s) for s in sizes)
    out: List[List[Tuple[int, int, int]]] = [[] for _ in range(fragments)]
    counts = [0] * fragments
    offset = 0
    for i, group in enumerate(shards.params):
        P, rank = shards.partition[i], shards.gather_at(i, groups)[0]
        lo_shard, hi_shard = rank * P, (rank + 1) * P
        ranges = {}
        for (p, start), n in zip(group, sizes[i]):
            f = fragments * offset // total
            counts[f] += 1
            a, b = ranges.get(f, (start, start + n))
            ranges[f] = (min(a, start), max(b, start + n))
            offset += n
        for f, (a, b) in sorted(ranges.items()):
            lo, hi = max(a, lo_shard), min(b, hi_shard)
            if lo < hi:
                out[f].append((i, lo - lo_shard, hi - lo_shard))
    empty = [f for f in range(fragments) if counts[f] == 0]
    if empty:
        starts = [0, *itertools.accumulate(n for s in sizes for n in s)][:-1]
        fits = max(F for F in range(1, fragments) if len({F * o // total for o in starts}) == F)
        raise ValueError(f"acco.local_sgd.fragments = {fragments}: fragment {empty[0]} gets no parameter (a fragment "
                         f"holds the parameters whose first element falls in its 1/{fragments} of the model's "
                         f"{total:,} elements, and one parameter spans it). Use fewer fragments: {fits} is the most "
                         f"below {fragments} that gives every fragment a parameter of this model")
    return out


class StreamingDiLoCo(DiLoCo):
    """The outer loop of mode ``diloco`` with ``fragments``/``fragment_sync_delay``/``fragment_update_alpha``.

    Args: as ``LocalSGD``. A joiner takes part in the next fragment sync (every ``sync_every / F`` steps).
    """

    joins_early = False

    def __init__(self, acco, shards: Shards, groups: ReplicaGroups):
        ls = acco.local_sgd
        self.F, self.tau, self.alpha = ls.fragments, ls.fragment_sync_delay, ls.fragment_update_alpha
        super().__init__(acco, shards, groups)
        self.h = ls.sync_every // self.F
        self.slices = fragment_slices(shards, groups, self.F)
        self.step = 0  # inner steps since the start (or the last restart)
        self.pending: Optional[dict] = None  # {"fragment", "delta", "received"} of the prepared fragment
        self.fragment_comm_s, self.fragment_wait_s = [0.0] * self.F, [0.0] * self.F
        self.fragment_syncs, self.fragment_bytes = [0] * self.F, [0] * self.F  # bytes: payload to its all-reduces
        self.prepared_at = [0] * self.F  # inner step of each fragment's last δ
        self.fragment_base = [0] * self.F  # inner step of the δ of each fragment's last committed sync

    @property
    def overlapped(self) -> bool:
        return self.tau > 0  # the prepared all-reduce runs on its own thread while inner steps go on

    @property
    def syncs(self) -> int:
        return sum(self.fragment_syncs)

    # ------------------------------------------------------------------ schedule
    def _window(self, step: int) -> Tuple[int, int]:
        """(fragment, step inside its window, 1..h) of inner step ``step`` (1-based)."""
        w = (step - 1) // self.h
        return w % self.F, step - w * self.h

    def after_inner_step(self) -> None:
        self.step += 1
        f, s = self._window(self.step)
        if s == self.h - self.tau:
            self._prepare(f)
        if s == self.h:
            self._sync_fragment(f, self.alpha)

    def _parts(self, tensors, f: int):
        return [tensors[i][lo:hi] for i, lo, hi in self.slices[f]]

    @torch.no_grad()
    def _prepare(self, f: int) -> None:
        """δ_f = g_f − θ_f into one buffer; start its mean over the replicas (blocking when τ = 0)."""
        self.begin_sync()  # (replicas that come and go: the quorum)
        parts = [g - t for g, t in zip(self._parts(self.anchor, f), self._parts(self.shards.masters, f))]
        delta = torch.cat(parts) if parts else self.anchor[0].new_zeros(0)
        self.pending = {"fragment": f, "delta": delta, "received": True}
        self.prepared_at[f] = self.step
        if not parts and not self.transport.fault_tolerant:  # nor does any rank of its outer group hold any
            return
        key = [("fragment", f)]  # its own error-feedback residual under compression
        weight = self.merge_weight()
        if self.tau == 0:
            before = self.outer_bytes
            seconds = self.transport.average([delta], key, weight)
            self._count(f, seconds, seconds, self.outer_bytes - before)
        else:
            self.pending.update(received=False, bytes_before=self.outer_bytes)
            self.transport.average_async([delta], key, weight)

    def merge_weight(self) -> float:
        """merge "tokens": a fragment's pseudo-gradient covers the steps since its last committed sync."""
        weight = super().merge_weight()
        if weight == 0.0 or self.fault_tolerance is None or self.fault_tolerance.merge != "tokens":
            return weight
        return float(self.step - self.fragment_base[self.pending["fragment"]])

    def _receive(self) -> None:
        """Wait for the prepared fragment's mean (the compute side's wait is counted)."""
        if self.pending is None or self.pending["received"]:
            return
        t0 = time.perf_counter()
        seconds = self.transport.collect()
        self._count(self.pending["fragment"], seconds, time.perf_counter() - t0,
                    self.outer_bytes - self.pending.pop("bytes_before"))
        self.pending["received"] = True

    def _count(self, f: int, comm_s: float, wait_s: float, sent: int) -> None:
        """Fragment ``f``'s all-reduce took ``comm_s`` and sent ``sent`` bytes, the compute side waited
        ``wait_s`` (the times also in the loop's totals)."""
        self.fragment_comm_s[f] += comm_s
        self.fragment_wait_s[f] += wait_s
        self.fragment_bytes[f] += sent
        self.outer_comm_s += comm_s
        self.outer_wait_s += wait_s

    def _prepare_blocking(self, f: int) -> None:
        tau, self.tau = self.tau, 0
        try:
            self._prepare(f)
        finally:
            self.tau = tau

    @torch.no_grad()
    def _sync_fragment(self, f: int, alpha: float) -> None:
        if self.pending is None:  # its prepared mean was dropped by a resharding load: prepare it now
            self._prepare_blocking(f)
        self._receive()
        pending, self.pending = self.pending, None
        assert pending is not None and pending["fragment"] == f, "streaming schedule out of step"
        if pending.get("joined") or not self.transport.commit():  # synced at the join, or discarded
            return
        mean, start = pending["delta"], 0
        for x, m, theta in zip(self._parts(self.anchor, f), self._parts(self.momentum, f),
                               self._parts(self.shards.masters, f)):
            n = x.numel()
            self._outer_one(x, m, mean[start:start + n])
            start += n
            theta.copy_(torch.lerp(x, theta, alpha) if alpha else x)
        self.fragment_syncs[f] += 1
        self.fragment_base[f] = self.prepared_at[f]
        self._install(self.shards.masters)

    # ----------------------------------------------- replicas that come and go
    def _join_fragment(self) -> int:
        """The fragment the replicas present are preparing (fragment 0 before the first inner step)."""
        return self._window(self.step)[0] if self.step else 0

    def join_tensors(self):
        f = self._join_fragment()
        return [torch.zeros(sum(hi - lo for _, lo, hi in self.slices[f]), dtype=self.anchor[0].dtype,
                            device=self.anchor[0].device)]

    @torch.no_grad()
    def after_join(self, mean) -> None:
        """The joining sync was the others' prepared fragment: take its outer step now (the others take it
        τ steps later, with the same result) and skip that fragment's sync in this window."""
        f, start = self._join_fragment(), 0
        if self.transport.contributed:
            for x, m in zip(self._parts(self.anchor, f), self._parts(self.momentum, f)):
                self._outer_one(x, m, mean[0][start:start + x.numel()])
                start += x.numel()
            self.fragment_syncs[f] += 1
            self.fragment_base[f] = self.step
        self.pending = {"fragment": f, "joined": True, "received": True} \
            if self.transport.contributed and self.tau > 0 else None
        self._install(self.anchor)
        self.unsent_steps = 0

    def loop_state(self) -> dict:
        return {**super().loop_state(), "step": self.step, "prepared_at": list(self.prepared_at),
                "fragment_syncs": list(self.fragment_syncs), "fragment_base": list(self.fragment_base)}

    def load_loop_state(self, state: dict) -> None:
        super().load_loop_state(state)
        self.step, self.pending = state["step"], None
        for name in ("prepared_at", "fragment_syncs", "fragment_base"):
            setattr(self, name, list(state[name]))

    # ------------------------------------------------------------- lifecycle
    @torch.no_grad()
    def finalize(self) -> None:
        """Leave every replica on one model: the prepared fragment syncs, then every fragment with inner
        steps since its last δ syncs once more, blocking, and every replica takes the global values."""
        if self.pending is not None:
            self._sync_fragment(self.pending["fragment"], self.alpha)
        for f in range(self.F):
            if self.prepared_at[f] < self.step:
                self._prepare_blocking(f)
                self._sync_fragment(f, 0.0)
        for x, theta in zip(self.anchor, self.shards.masters):
            theta.copy_(x)
        self._install(self.shards.masters)

    def settle(self) -> None:
        self._receive()  # a prepared fragment is kept as received: its sync applies it

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["streaming"] = {"step": self.step, "fragments": self.F, "fragment_sync_delay": self.tau,
                           "prepared_at": list(self.prepared_at),
                           "fragment_syncs": list(self.fragment_syncs),
                           "fragment_base": list(self.fragment_base),
                           "pending": None if self.pending is None or self.pending.get("joined") else {
                               "fragment": self.pending["fragment"], "delta": self.pending["delta"].clone()}}
        return sd

    def check_kind(self, sd: dict) -> None:
        streaming = sd.get("streaming")
        if streaming is None:
            raise fragments_mismatch("plain DiLoCo (no Streaming DiLoCo keys)",
                                     f"fragments={self.F}, fragment_sync_delay={self.tau}")
        if streaming["fragments"] != self.F:
            raise fragments_mismatch(f"acco.local_sgd.fragments={streaming['fragments']}", str(self.F))
        if streaming.get("fragment_sync_delay", self.tau) != self.tau:
            raise fragments_mismatch(f"acco.local_sgd.fragment_sync_delay={streaming['fragment_sync_delay']}",
                                     f"fragment_sync_delay={self.tau}")

    @torch.no_grad()
    def load_state_dict(self, sd: Optional[dict]) -> None:
        super().load_state_dict(sd)
        streaming = sd["streaming"]
        self.step = streaming["step"]
        self.prepared_at = list(streaming["prepared_at"])
        self.fragment_syncs = list(streaming["fragment_syncs"])
        self.fragment_base = list(streaming.get("fragment_base", streaming["prepared_at"]))
        p = streaming["pending"]
        self.pending = None if p is None else {"fragment": p["fragment"], "delta": p["delta"].clone(),
                                               "received": True}

    def reshard_state(self, first, mine, plan) -> dict:
        sd = super().reshard_state(first, mine, plan)
        streaming = dict(mine[0]["streaming"], pending=None, prepared_at=list(mine[0]["streaming"]["prepared_at"]))
        pending = mine[0]["streaming"]["pending"]
        if pending is not None:  # the old replicas' mean: the fragment is prepared again, blocking, at its sync
            streaming["prepared_at"][pending["fragment"]] = -1  # no δ kept since its last sync (finalize)
            plan.dropped.append(f"fragment {pending['fragment']}'s prepared pseudo-gradient mean (prepared again, "
                                f"blocking, at its sync)")
        sd["streaming"] = streaming
        return sd

    def restart(self) -> None:
        super().restart()
        self.step, self.pending, self.prepared_at, self.fragment_base = 0, None, [0] * self.F, [0] * self.F

    # ---------------------------------------------------------- observability
    def banner(self) -> str:
        return (super().banner() + f" streaming: {self.F} fragments, a sync every {self.h} steps, "
                                   f"fragment_sync_delay={self.tau} fragment_update_alpha={self.alpha:g}")

    def stats(self) -> dict:
        out = super().stats()
        hidden = [max(0.0, 1.0 - w / c) if c > 0 else None for w, c in zip(self.fragment_wait_s, self.fragment_comm_s)]
        out.update(syncs=sum(self.fragment_syncs), fragments=self.F, fragment_sync_delay=self.tau,
                   fragment_update_alpha=self.alpha, fragment_syncs=list(self.fragment_syncs),
                   fragment_outer_bytes=list(self.fragment_bytes), fragment_outer_comm_s=list(self.fragment_comm_s),
                   fragment_outer_wait_s=list(self.fragment_wait_s), fragment_hidden_fraction=hidden)
        return out

    def report(self) -> List[Tuple[str, str]]:
        s = self.stats()
        lines = [line for line in super().report() if line[0] != "outer syncs"]
        hidden = s["outer_hidden_fraction"]
        overlap = ("blocking (fragment_sync_delay 0): nothing hidden" if self.tau == 0 else
                   "n/a" if hidden is None else f"{100 * hidden:.0f}% hidden behind compute")
        lines.append(("outer syncs", f"{s['syncs']} fragment syncs, {s['outer_bytes'] / 2**20:.2f} MiB sent by this "
                                     f"rank (payload), outer communication {s['outer_comm_s']:.2f} s, {overlap} "
                                     f"(waited {s['outer_wait_s']:.2f} s)"))
        per = [f"#{f}: {n} syncs {b / 2**20:.2f} MiB {w:.2f}/{c:.2f} s waited"
               for f, (n, b, w, c) in enumerate(zip(self.fragment_syncs, self.fragment_bytes, self.fragment_wait_s,
                                                   self.fragment_comm_s))]
        lines.append(("fragments", f"{self.F} fragments, a sync every {self.h} inner steps, τ={self.tau}, "
                                   f"α={self.alpha:g}; " + ", ".join(per)))
        return lines


def build(acco, shards: Shards, groups: ReplicaGroups):
    """Mode ``diloco``'s outer loop: Streaming DiLoCo when its keys ask for it, else plain DiLoCo."""
    if acco.local_sgd is not None and acco.local_sgd.streaming:
        return StreamingDiLoCo(acco, shards, groups)
    return DiLoCo(acco, shards, groups)


__all__ = ["StreamingDiLoCo", "fragment_slices", "build"]
