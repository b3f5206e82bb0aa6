"""A checkpoint loaded into another layout: the host-free core of a resharding load.

A checkpoint holds, per data-parallel rank, that rank's *pieces*: per parameter group (a flat buffer of
``n`` elements) its fp32 master partition and the inner optimizer's state over it ({key: tensor of the
partition's size | scalar}), and the rounds' state (``rounds.state``) with the outer loop's. Loaded with
another data-parallel size, ``replica_group_size`` or number of replicas, each rank needs its pieces in the
new layout. Each host reads its own files into pieces; this module maps them:

* ``Layout``: how ``n`` elements split over the ranks of a ZeRO group. ZeRO-1's rule (both hosts' flat
  buffers): pad to ``padded_numel(n, W) = ceil(n / 2W) * 2W``, rank r owns ``[rP, (r+1)P)``. FSDP2's
  ``Shard(0)``: each rank owns ``ceil(rows / W)`` rows of one parameter. Reassembling is concatenating the
  old pieces and keeping the first ``n`` elements; the new piece is a slice of that, padded with zeros.
* ``Plan``: the old and new layouts of one rank, which old ranks it reads, what it drops and what it
  cannot carry (said once, in the host's warning: ``message``).
* ``reshard_rounds``: the new rank's rounds state. The committed weights never change: the round modes
  keep the weights the host loaded (the committed iterate), and the round in flight (accumulated
  gradients, an estimate's kept shard, a finished estimate) is dropped: rounds restart with a start-up
  round. Compression residuals are per rank and per layout: dropped. The local-SGD modes take each new
  replica g's compute weights from old replica ``g mod R_old``, and the outer loop reshards its own state
  (``OuterLoop.reshard_state``: anchor and outer momentum from old replica 0, period position kept).
"""

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch

from ..algorithms.rounds import COMMIT
from .rounds.buffers import padded_numel


@dataclass(frozen=True)
class Layout:
    """``n`` elements over the ranks of a group: rank r holds ``[starts[r], starts[r] + sizes[r])``, the
    part of it at or past ``n`` being padding."""
    n: int
    starts: tuple
    sizes: tuple

    @classmethod
    def zero(cls, n: int, ways: int) -> "Layout":
        """ZeRO-1's flat partitions (the DeepSpeed host's and the plain-module host's)."""
        P = padded_numel(n, ways) // ways
        return cls(int(n), tuple(r * P for r in range(ways)), (P,) * ways)

    @classmethod
    def dim0(cls, shape: Sequence[int], ways: int) -> "Layout":
        """FSDP2's ``Shard(0)`` of one parameter: ``ceil(rows / ways)`` rows per rank, no padding."""
        rows, row = (int(shape[0]), math.prod(shape[1:])) if len(shape) else (1, 1)
        c = -(-rows // ways)
        bounds = [min(r * c, rows) * row for r in range(ways + 1)]
        return cls(rows * row, tuple(bounds[:-1]), tuple(b - a for a, b in zip(bounds, bounds[1:])))

    @property
    def ways(self) -> int:
        return len(self.starts)

    def take(self, pieces: Sequence[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the reassembled ``n`` (zeros past ``n``) from the ``ways`` pieces, each
        saved whole or without its padding. Raises ``ValueError`` for pieces of another layout or model."""
        if len(pieces) != self.ways:
            raise ValueError(f"{len(pieces)} saved pieces for a layout of {self.ways} ranks")
        flat = [p.reshape(-1) for p in pieces]
        out = torch.zeros(hi - lo, dtype=flat[0].dtype)
        for r, (start, size, piece) in enumerate(zip(self.starts, self.sizes, flat)):
            if piece.numel() not in (size, max(0, min(size, self.n - start))):
                raise ValueError(f"a saved piece of rank {r} has {piece.numel()} elements where this model's "
                                 f"layout gives {size}: the checkpoint was saved with another model")
            a, b = max(lo, start), min(hi, start + piece.numel(), self.n)
            if a < b:
                out[a - lo:b - lo].copy_(piece[a - start:b - start])
        return out

    def repartition(self, pieces: Sequence[torch.Tensor], new: "Layout", rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``new`` (padding included) from this layout's ``pieces``."""
        if new.n != self.n:
            raise ValueError(f"a group of {self.n} elements cannot become one of {new.n}")
        return self.take(pieces, new.starts[rank], new.starts[rank] + new.sizes[rank])


class Plan:
    """One rank's resharding load: old layout (``old_world`` ranks in replicas of ``old_k``; the round
    modes have one replica of all ranks) to the new one, this rank being ``rank`` of ``new_world``.

    ``layouts(ways)``: the ``Layout`` of every group split ``ways`` ways. New replica g (``replica``) takes
    its inner state from old replica ``source = g mod R_old`` (``mapped_ranks``); what every replica holds
    alike (the anchor, the outer momentum) comes from old replica 0 (``first_ranks``). ``strides[i]``: group
    i's ``ep_size`` (None: every group dense), which an expert group keeps across the load."""

    def __init__(self, *, old_world: int, old_k: int, new_world: int, new_k: int, rank: int,
                 layouts: Callable[[int], List[Layout]], local: bool, strides: Optional[Sequence[int]] = None):
        if old_world % old_k or new_world % new_k:
            raise ValueError(f"a replica of {old_k} (saved) or {new_k} (now) ranks does not divide the world")
        self.old_world, self.old_k, self.new_world, self.new_k, self.local = old_world, old_k, new_world, new_k, local
        self.old_replicas, self.new_replicas = old_world // old_k, new_world // new_k
        self.replica, self.shard = divmod(rank, new_k)
        self.source = self.replica % self.old_replicas
        self.strides = tuple(strides) if strides is not None else (1,) * len(layouts(new_k))
        if any(old_k % e or new_k % e for e in self.strides):
            raise ValueError(f"an expert-parallel size of {max(self.strides)} does not divide a replica of {old_k} "
                             f"(saved) or {new_k} (now) ranks")
        self.old, self.new = self._layouts(layouts, old_k), self._layouts(layouts, new_k)
        self.dropped: List[str] = []
        self.not_carried: List[str] = []
        self.changed: List[str] = []

    @property
    def mapped_ranks(self) -> List[int]:
        return list(range(self.source * self.old_k, (self.source + 1) * self.old_k))

    @property
    def first_ranks(self) -> List[int]:
        return list(range(self.old_k))

    def _layouts(self, layouts, k: int) -> List[Layout]:
        """Per group, its layout in a replica of ``k`` ranks: an expert group of stride e over k / e ranks."""
        per_ways = {e: layouts(k // e) for e in set(self.strides)}
        return [per_ways[e][i] for i, e in enumerate(self.strides)]

    def _part(self, i: int, values: Sequence) -> tuple:
        """Group ``i``'s old pieces (one per old rank of a replica) that make it, and this rank's index in its
        new partition. An expert group of stride e (its ``ep_size``) is partitioned over the ranks at one
        position of every expert-parallel run of e consecutive ranks: those at this rank's position."""
        e = self.strides[i]
        return values[self.shard % e::e], self.shard // e

    def piece(self, per_rank: Sequence[Sequence[torch.Tensor]]) -> List[torch.Tensor]:
        """Per group, this rank's piece from one old replica's pieces (``per_rank[shard][group]``)."""
        out = []
        for i, (old, new) in enumerate(zip(self.old, self.new)):
            pieces, shard = self._part(i, [r[i] for r in per_rank])
            out.append(old.repartition(pieces, new, shard))
        return out

    def inner_state(self, per_rank: Sequence[Sequence[dict]]) -> List[dict]:
        """Per group, the inner optimizer's state for this rank: tensors over the partition (dim >= 1) are
        repartitioned, scalars (the step count, the same on every rank of a replica) copied."""
        out = []
        for i, (old, new) in enumerate(zip(self.old, self.new)):
            states, shard = self._part(i, [r[i] for r in per_rank])
            keys = set(states[0])
            if any(set(s) != keys for s in states):
                raise ValueError(f"the inner optimizer's state of group {i} has other keys on other ranks")
            mine = {}
            for key in states[0]:
                values = [s[key] for s in states]
                tensor = torch.is_tensor(values[0]) and values[0].dim() > 0
                mine[key] = old.repartition(values, new, shard) if tensor else values[0]
            out.append(mine)
        return out

    def words(self) -> str:
        def one(world, k, replicas):
            return f"{replicas} replicas x {_count(k, 'rank')}" if self.local else _count(world, "data-parallel rank")
        return f"from {one(self.old_world, self.old_k, self.old_replicas)} to " \
               f"{one(self.new_world, self.new_k, self.new_replicas)}"

    def message(self, where: str) -> str:
        """The one warning of a resharding load (the host prints it on rank 0)."""
        if self.local:
            rule = (f"the anchor and the outer momentum (the same in every replica) come from old replica 0, "
                    f"re-partitioned over {_count(self.new_k, 'rank')} per replica; the period position is kept; "
                    f"new replica g takes its weights, fp32 master and inner optimizer moments from old replica g "
                    f"mod {self.old_replicas}")
        else:
            rule = ("the fp32 master weights and the optimizer moments are re-partitioned by ZeRO-1's rule; the "
                    "committed weights are the saved ones")
        if max(self.strides) > 1:
            rule += ("; each expert group (its ep_size kept) is regathered over its old expert-data-parallel group "
                     "and re-split over the new one")
        text = f"ACCO: resharded the checkpoint in {where} {self.words()}: {rule}."
        if self.changed:
            text += " Changed: " + "; ".join(self.changed) + "."
        if self.dropped:
            text += " Dropped: " + "; ".join(self.dropped) + "."
        return text + " Not carried: " + "; ".join(self.not_carried + [
            "per-rank random state (acco_ds checkpoints hold none: seed dropout and the data order yourself)"]) + "."


def reshard_rounds(plan: Plan, first: List[Optional[dict]], mine: List[Optional[dict]], outer,
                   round_mode: str, gradient_accumulation_steps: int) -> dict:
    """This rank's rounds state (``rounds.state``'s keys, marked ``"resharded"``) from old replica 0's
    (``first``) and the mapped replica's (``mine``) states, one per old rank (None: saved without ACCO).
    ``outer``: this run's outer loop, which reshards its own state."""
    a0 = mine[0]
    if a0 is not None:
        saved = a0["schedule"]["mode"]
        if saved != round_mode:
            raise ValueError(f"checkpoint was saved with ACCO mode={saved!r} but this run has {round_mode!r}: "
                             f"resume in the same mode, or load only the module weights (load_optimizer_states=False)")
        if not plan.local and a0.get("outer") is not None:
            raise ValueError("this checkpoint was saved in a local-SGD mode (it holds replicas and an outer state) "
                             "but this run is a round mode: resume in the same mode, or load only the module "
                             "weights (load_optimizer_states=False)")
        _note_in_flight(plan, mine)
        saved_gas = a0["gradient_accumulation_steps"]
        if saved_gas != gradient_accumulation_steps:  # nothing carried depends on it: the rounds restart
            plan.changed.append(f"gradient_accumulation_steps {saved_gas} -> {gradient_accumulation_steps}")
    elif not plan.local:
        plan.dropped.append("nothing in flight: the checkpoint holds no ACCO state (saved without ACCO)")
    return {
        "resharded": plan.words(), "world_size": plan.new_k, "rank": plan.shard,
        "gradient_accumulation_steps": gradient_accumulation_steps,
        "compute_part": plan.piece([a["compute_part"] for a in mine]) if plan.local else None,
        "outer": outer.reshard_state([a and a.get("outer") for a in first], [a and a.get("outer") for a in mine],
                                     plan) if plan.local else None,
        "host_counters": a0.get("host_counters") if a0 else None,
    }


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "es" if word.endswith("h") else "s")


def _note_in_flight(plan: Plan, states: List[dict]) -> None:
    """Name what the rounds held in flight at the save, which a resharding load drops."""
    a0 = states[0]
    parts = []
    if any(a["local_micro"] for a in states):
        parts.append(f"{_count(a0['local_micro'], 'accumulated micro-batch')} of the unfinished "
                     + ("inner step" if plan.local else "round"))
    if a0["kept_count"]:
        parts.append("the estimate round's kept gradient shard")
    if a0["pending"] is not None and a0["pending"]["op"] != COMMIT:
        parts.append("a finished estimate whose weights were not installed yet")
    if parts or not plan.local:
        plan.dropped.append((", ".join(parts) if parts else "no round was in flight") +
                            ("; rounds restart with a start-up round at the committed weights" if not plan.local else ""))
    if any(r is not None for a in states for r in a.get("residuals") or []):
        plan.dropped.append("the rounds' compression error-feedback residuals (per rank and per layout; they "
                            "restart at zero)")


__all__ = ["Layout", "Plan", "reshard_rounds"]
