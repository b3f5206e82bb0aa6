"""sparseloco with ``acco.local_sgd.overlap`` = N > 0: the sparse all-gather runs behind the next N inner steps.

The rule (docs/design/outer-loops.md, "sparseloco overlapped"), for each replica r at the sync that ends a period
(inner step t), with x the anchor, θ_r the replica's weights and e_r its error buffer:

1. as the blocking sync: e_r ← β e_r + (x − θ_r); per chunk the top-k of |e_r|, q_r its levels, e_r[kept] −= q_r
   (the residual is in place at once); the replica remembers θ_sent = θ_r;
2. the payloads' all-gather starts on the outer communication thread, and the replica trains on from θ_r (the
   new anchor is not known yet);
3. after inner step t + N it waits for the gather, and with avg = (Σ_r q_r) / R::

       x ← x − outer_lr · avg;   θ_r ← θ_r + (x − θ_sent)

   the new anchor plus what this replica learned in the N overlapped steps (they are not thrown away: the next
   sync's δ = x − θ_r holds them, so every inner step is sent exactly once).

N < ``sync_every``, so a gather lands before the next sync starts. N = 0 is not this path: it is the blocking
sync, bit for bit. The end of training (``finalize``) lands a gather in flight at once (with no inner step since
its sync, every replica takes the anchor), then runs the blocking sync, so every replica ends on the anchor. A
checkpoint taken while a gather is in flight waits for it and saves the average with the steps left before it
lands, so a resume lands it at the same step. The float64 simulator of this rule is
``acco_ds.testing.sparseloco.simulate_sparseloco(overlap=N)``.

Runs in a fixed fleet on one host's data-parallel (ZeRO-1, FSDP2) and expert layouts; tensor parallelism and
replicas that come and go are refused by name (their syncs gather on the main thread).
"""

import time
from typing import List, Optional

import torch
import torch.distributed as tdist

from ...ops import sparse_codec


class SparseOverlap:
    """The overlapped sync of ``SparseLoCo`` (a mixin: it uses the loop's plans, buffers and exchanges)."""

    flight: Optional[dict] = None  # {"left": steps before it lands, "sent": θ_sent, "avg": per group, or None}

    @staticmethod
    def check_overlap(acco, groups) -> None:
        """Refuse what the overlapped sync does not run with, by name (before anything is built)."""
        overlap = acco.local_sgd.overlap if acco.local_sgd is not None else 0
        if not overlap:
            return
        if acco.fault_tolerance is not None:
            raise ValueError("acco.local_sgd.overlap cannot be used with acco.fault_tolerance: a sync of replicas "
                             "that come and go must commit before training goes on. Set overlap to 0")
        if groups.tensor_parallel > 1:
            raise ValueError("acco.local_sgd.overlap cannot be used with tensor parallelism yet (its sync assembles "
                             "whole tensors across the replica). Set overlap to 0, or train without an mpu")

    # ------------------------------------------------------------------ the three phases
    @torch.no_grad()
    def start_flight(self) -> None:
        """Phase 1 and the start of 2: pack every group (residuals in place), start the gather."""
        start = time.perf_counter()
        for i, (x, master, e) in enumerate(zip(self.anchor, self.shards.masters, self.error)):
            e.mul_(self.decay).add_(x - master)
            self.refuse_non_finite(e, i)
        wires = [self._pack_group(plan, e, peers) for plan, e, peers in zip(self.plans, self.error, self.peers)]
        self.wire_bytes = sum(w.numel() for w in wires if w is not None)
        self.flight = {"left": self.overlap, "sent": [m.clone() for m in self.shards.masters], "avg": None}
        group = self.groups.outer_side
        self.transport.worker.submit(lambda: [None if w is None else _gather_bytes(w, group) for w in wires])
        self.residual_norm = self.error_norm()
        self.outer_comm_s += time.perf_counter() - start
        self.outer_wait_s += time.perf_counter() - start

    def _pack_group(self, plan, e: torch.Tensor, peers) -> Optional[torch.Tensor]:
        """Pack this rank's chunks of one group; straddling chunks' residuals go back to their ranks now.
        Returns the encoded payload (None: no chunks here)."""
        tails = self._exchange(plan, [e[:plan.head]] if plan.head else [], [n for _, n in plan.tails], peers)
        ext = torch.cat([e, *tails]) if tails else e
        wire = None
        if plan.chunks:
            payload = self.kernels.sparse_pack(ext[plan.own_lo:plan.own_hi], plan.offsets, topk=self.topk,
                                               value_bits=self.bits)
            wire = sparse_codec.encode(payload, plan.offsets, topk=self.topk, value_bits=self.bits,
                                       coding=self.coding)
        if tails:
            e.copy_(ext[:plan.partition])
        back, at = [], plan.partition
        for _, n in plan.tails:
            back.append(ext[at:at + n].clone())
            at += n
        head = self._exchange(plan, back, [plan.head] if plan.head else [], peers, reverse=True)
        if head:
            e[:plan.head].copy_(head[0])
        return wire

    @torch.no_grad()
    def collect_flight(self) -> None:
        """The end of phase 2: wait for the gather, average, hand straddling chunks' averages back."""
        f = self.flight
        if f is None or f["avg"] is not None:
            return
        t0 = time.perf_counter()
        gathered = self.transport.worker.wait()
        self.outer_wait_s += time.perf_counter() - t0
        f["avg"] = [self._average_group(plan, g, peers) for plan, g, peers in zip(self.plans, gathered, self.peers)]
        self.note_state(f["sent"] + f["avg"])  # the peak: θ_sent and the average beside the anchor and error
        # what this rank handed to the gathers: its length (8 bytes) and its bytes padded to the longest
        self.transport.bytes += sum(8 + max(b.numel() for b in g) for g in gathered if g is not None)
        self.outer_comm_s += time.perf_counter() - t0

    def _average_group(self, plan, gathered, peers) -> torch.Tensor:
        """This rank's partition of the average of one group from the gathered payloads."""
        avg = self.error[0].new_zeros(plan.extended if plan.chunks else plan.partition)
        if plan.chunks:
            payloads = [sparse_codec.decode(w, plan.offsets, topk=self.topk, value_bits=self.bits,
                                            device=avg.device) for w in gathered]
            self.kernels.sparse_average(avg[plan.own_lo:plan.own_hi], plan.offsets, payloads, [1.0] * len(payloads),
                                        topk=self.topk, value_bits=self.bits)
        back, at = [], plan.partition
        for _, n in plan.tails:
            back.append(avg[at:at + n].clone())
            at += n
        head = self._exchange(plan, back, [plan.head] if plan.head else [], peers, reverse=True)
        avg = avg[:plan.partition]
        if head:
            avg[:plan.head].copy_(head[0])
        return avg

    @torch.no_grad()
    def land_flight(self) -> None:
        """Phase 3: x ← x − outer_lr · avg; θ ← θ + (x − θ_sent); install."""
        self.collect_flight()
        f, self.flight = self.flight, None
        for x, master, avg, sent in zip(self.anchor, self.shards.masters, f["avg"], f["sent"]):
            x.sub_(avg, alpha=self.settings["outer_lr"])
            master.add_(x - sent)
        self._install(self.shards.masters)

    def count_flight(self) -> None:
        """After an inner step: land the gather in flight once its N steps have passed."""
        if self.flight is not None:
            self.flight["left"] -= 1
            if self.flight["left"] <= 0:
                self.land_flight()

    # ------------------------------------------------------------------ checkpoints
    def flight_state(self) -> Optional[dict]:
        if self.flight is None:
            return None
        self.collect_flight()
        f = self.flight
        return {"left": f["left"], "sent": [t.clone() for t in f["sent"]], "avg": [t.clone() for t in f["avg"]]}

    def load_flight(self, saved: Optional[dict]) -> None:
        if self.flight is not None and self.transport.worker is not None and self.transport.worker.busy:
            self.transport.worker.wait()
        self.flight = None if saved is None else {"left": saved["left"], "sent": [t.clone() for t in saved["sent"]],
                                                  "avg": [t.clone() for t in saved["avg"]]}
        if self.flight is not None:
            self.note_state(self.flight["sent"] + self.flight["avg"])


def _gather_bytes(wire: torch.Tensor, group) -> List[torch.Tensor]:
    """Every replica's ``wire`` over ``group``, in replica order: their lengths first, then the bytes padded to
    the longest (an all-gather moves equal sizes)."""
    n = tdist.get_world_size(group)
    mine = torch.tensor([wire.numel()], dtype=torch.int64, device=wire.device)
    sizes = [torch.empty_like(mine) for _ in range(n)]
    tdist.all_gather(sizes, mine, group=group)
    sizes = [int(s) for s in sizes]
    padded = torch.cat([wire, wire.new_zeros(max(sizes) - wire.numel())])
    out = [torch.empty_like(padded) for _ in range(n)]
    tdist.all_gather(out, padded, group=group)
    return [buf[:s] for buf, s in zip(out, sizes)]


__all__ = ["SparseOverlap"]
