"""The syncer's model for learners of different tensor-parallel and pipeline sizes: the *canonical* (unsplit) model.

A learner of tensor-parallel size ``tp`` and pipeline size ``pp`` (no experts) whose split parameters all carry
Megatron's attributes (``tensor_model_parallel`` True, ``partition_dim`` set, ``partition_stride`` 1; a parameter
without ``tensor_model_parallel`` is replicated over the tensor-parallel group) maps onto the model of both sizes 1:
every parameter at its full shape, in the order and groups of its flat buffers, end to end; parameter group ``g`` of
that model is every stage's (unsplit) group ``g`` one after the other, in stage order (what a one-stage
``PipelineModule`` of the same layers with the same parameter groups holds). The syncer cuts that model into its
``S`` parts (``layout.Parts``), as it cuts a learner of both sizes 1, so learners of tensor-parallel sizes 1, 2, 4 ...
and of pipeline sizes 1, 2 ... of one model say the same name at HELLO (``canonical_name``: its elements and a
checksum of its group sizes and shapes) and share a syncer. A weight tied across stages (DeepSpeed's
``TiedLayerSpec``: ``ds_pipe_replicated`` on its later copies) is on two stages, and the unsplit model holds it
once: such a learner does not map (nor one whose stages have different numbers of groups).

Tensor-parallel rank ``t`` holds, of a parameter split along dimension ``d``, one run of ``inner`` contiguous
elements per index of the dimensions before ``d`` (``d`` = 0: one run; ``d`` = 1: one per row), at canonical offset
``c + q * inner * tp + t * inner``, shifted by the stages before its own (``stage_model``): rows end to end in its
partition, ``tp * inner`` apart in the unsplit model (``tp_runs``: one strided block per parameter). Its
data-parallel rank ``j`` holds the block's rows inside its ZeRO-1 partition, cut where the syncer's parts are cut
(``clip``, ``rank_runs``): whole rows stay one block, copied at once through a strided view; only a row cut by a
partition or part edge becomes pieces of its own. The learner's whole world (``tp × pp × dp`` ranks; model-parallel position ``m = stage tp + t``,
DeepSpeed's order; slot ``s = j + k m``) moves its Δ into the syncer's parts, and θ_g back, with one all-to-all over
its world group (``TPRelayout``): syncer part ``i`` is sent and received by slot ``i mod (tp pp k)``. A replicated
parameter's Δ leaves from tensor-parallel rank 0 only; its θ_g reaches every tensor-parallel rank. Each element
crosses to the syncer once either way; no rank ever holds more of the model than its partition and the parts it
sends.
"""


import math
import zlib
from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as tdist

from ...comm import lifetime
from .layout import Parts

ATTRIBUTES = "tensor_model_parallel True, partition_dim 0 or 1 and partition_stride 1, as Megatron's layers set them"


def split_params(params, tp: int) -> Tuple[Optional[list], str]:
    """Per parameter group, per parameter in flat-buffer order: ``(local offset, local shape, split dim or None)``.
    ``params``: ``Shards.params``. Returns ``(specs, "")``, or ``(None, why)`` when a parameter cannot be mapped
    onto the unsplit model."""
    specs = []
    for g, group in enumerate(params):
        rows, end = [], 0
        for p, offset in sorted(group, key=lambda po: po[1]):
            where = f"parameter {len(rows)} of group {g} (shape {list(p.shape)})"
            dim = None
            if getattr(p, "ds_pipe_replicated", False):
                return None, (f"{where} is a copy of a weight tied across pipeline stages (DeepSpeed's TiedLayerSpec): "
                              f"the stages hold it twice, the unsplit model once")
            if tp > 1 and getattr(p, "tensor_model_parallel", False):
                dim = getattr(p, "partition_dim", None)
                if dim not in (0, 1) or dim >= p.dim():
                    return None, f"{where} is tensor_model_parallel with partition_dim {dim}, not 0 or 1"
                if getattr(p, "partition_stride", 1) != 1:
                    return None, f"{where} has partition_stride {p.partition_stride}, not 1"
            if offset != end:
                return None, f"{where} starts at {offset} of its flat buffer, not right after the one before ({end})"
            rows.append((offset, tuple(p.shape), dim))
            end = offset + p.numel()
        specs.append(rows)
    return specs, ""


def full_shape(shape: Sequence[int], dim: Optional[int], tp: int) -> Tuple[int, ...]:
    return tuple(n * tp if d == dim else n for d, n in enumerate(shape))


def canonical_model(specs, tp: int) -> Tuple[List[int], List[List[Tuple[int, ...]]]]:
    """The unsplit model's group sizes and parameter shapes."""
    shapes = [[full_shape(shape, dim, tp) for _, shape, dim in rows] for rows in specs]
    return [sum(math.prod(s) for s in group) for group in shapes], shapes


def stage_model(stages, tp: int):
    """The unsplit model of a learner whose pipeline stages have ``stages`` (``split_params`` of each stage's
    tensor-parallel rank 0, in stage order): ``(sizes, shapes, shifts, "")``, ``shifts[stage][g]`` the elements of
    group ``g`` in the stages before; or ``(None, None, None, why)`` when the stages cannot be concatenated."""
    models = [canonical_model(specs, tp) for specs in stages]
    counts = [len(sizes) for sizes, _ in models]
    if len(set(counts)) > 1:
        return None, None, None, (f"its pipeline stages have {counts} parameter groups: group g of the unsplit model "
                                  f"is every stage's group g, so every stage needs the same groups")
    groups = range(counts[0] if counts else 0)
    sizes = [sum(m[0][g] for m in models) for g in groups]
    shapes = [[shape for m in models for shape in m[1][g]] for g in groups]
    shifts = [[sum(m[0][g] for m in models[:st]) for g in groups] for st in range(len(models))]
    return sizes, shapes, shifts, ""


def canonical_name(sizes, shapes) -> str:
    """What a learner that maps onto the unsplit model says at HELLO (``config.decoupled.layout_name``'s form):
    any data-parallel, tensor-parallel and pipeline size (``dp0.tp0.pp0``), no experts, the unsplit model's
    elements and a checksum of its group sizes and parameter shapes."""
    text = ",".join(map(str, sizes)) + "|" + ";".join("x".join(map(str, s)) for group in shapes for s in group)
    return f"dp0.tp0.pp0.ep1.n{sum(sizes)}.g{zlib.crc32(text.encode()):08x}"


def tp_runs(rows, tp: int, t: int, shift: int = 0) -> List[Tuple[int, int, int, int, int, bool]]:
    """Tensor-parallel rank ``t``'s runs of one group, one per parameter: ``(local offset, canonical offset, length,
    count, canonical stride, replicated)``: ``count`` runs of ``length`` elements, end to end locally and ``stride``
    apart in the unsplit model (a parameter split along dimension 1: one per row), in local order (``shift``: the
    group's elements in the stages before this one)."""
    out, c = [], shift
    for offset, shape, dim in rows:
        n = math.prod(shape)
        if dim is None:
            out.append((offset, c, n, 1, n, True))
        else:
            outer, inner = math.prod(shape[:dim]), math.prod(shape[dim:])
            out.append((offset, c + t * inner, inner, outer, tp * inner, False))
        c += n * (tp if dim is not None else 1)
    return out


def clip(a0: int, c0: int, n: int, count: int, stride: int, lo: int, hi: int, W: int) -> List[Tuple[int, ...]]:
    """The pieces of ``tp_runs``' run ``(a0, c0, n, count, stride)`` inside the local range ``[lo, hi)``, cut where
    the syncer's parts of ``W`` elements are cut: ``(local offset, part, offset in part, length, count)``. Rows whole
    in both stay blocks of one copy each; a row cut by an edge is split into pieces of one row."""
    out, q = [], max(0, (lo - a0) // n) if n and lo > a0 else 0
    while n and q < count:
        a, c = a0 + q * n, c0 + q * stride
        if a >= hi:
            break
        i = c // W
        if a >= lo and a + n <= hi and c + n <= (i + 1) * W:  # whole rows, up to an edge
            m = min(count, (hi - a0) // n, ((i + 1) * W - n - c0) // stride + 1) - q
            out.append((a, i, c - i * W, n, m))
            q += m
            continue
        x, y = max(a, lo), min(a + n, hi)
        c += x - a
        while x < y:
            i = c // W
            m = min(y - x, (i + 1) * W - c)
            out.append((x, i, c - i * W, m, 1))
            x, c = x + m, c + m
        q += 1
    return out


def rank_runs(specs, tp: int, t: int, j: int, mine: Parts, syncer: Parts,
              shift: Optional[Sequence[int]] = None) -> List[Tuple[int, int, int, int, int, int, bool]]:
    """The runs of the rank at tensor-parallel rank ``t`` and data-parallel rank ``j`` (``mine``: its stage's
    partitions, ``syncer``: the syncer's parts of the unsplit model, ``shift``: ``stage_model``'s of its stage):
    ``(offset in its partition, syncer part, offset in that part, length, count, stride in that part,
    replicated)``, ``count`` rows of ``length`` elements (end to end in the partition), sorted by syncer part and
    offset."""
    out = []
    for g, rows in enumerate(specs):
        w, W = mine.widths[g], syncer.widths[g]
        lo, hi = j * w, (j + 1) * w
        for local, canon, n, count, stride, rep in tp_runs(rows, tp, t, shift[g] if shift else 0):
            out.extend((mine.offset(g) + a - lo, i, syncer.offset(g) + po, m, rows_, stride, rep)
                       for a, i, po, m, rows_ in clip(local, canon, n, count, stride, lo, hi, W))
    out.sort(key=lambda r: (r[1], r[2]))
    return out


def learner_world(replica: int, slot: int, timeout_s: float, info=None) -> Tuple[object, List[int], list]:
    """A group of this learner's whole world (every rank of the launch calls it: it creates every learner's), each
    slot's rank in it and each slot's ``info`` (gathered once, over the launch)."""
    pairs: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(pairs, (replica, slot, info))
    lists = [[r for r, p in enumerate(pairs) if p[0] == learner] for learner in sorted({p[0] for p in pairs})]
    group = lifetime.new_subgroups(lists, timedelta(seconds=timeout_s))
    mine = next(ranks for ranks in lists if tdist.get_rank() in ranks)
    rank_of, infos = [0] * len(mine), [None] * len(mine)
    for r, g in enumerate(mine):
        rank_of[pairs[g][1]], infos[pairs[g][1]] = r, pairs[g][2]
    return group, rank_of, infos


class TPRelayout:
    """``layout.Relayout`` for a learner mapped onto the unsplit model (see the module docstring). ``specs``:
    ``split_params``; ``tp``, ``k``: the learner's sizes; ``slot``: this rank's (``j + k m``); ``mine``: its
    partitions; ``syncer``: the syncer's parts of the unsplit model; ``group``, ``rank_of``: ``learner_world``;
    ``layouts``: per model-parallel position ``m``, its ``(specs, mine, shift)`` (``stage_model``'s shift of its
    stage); left out, ``tp`` positions of one stage that all hold ``specs`` and ``mine``."""

    def __init__(self, specs, tp: int, k: int, slot: int, mine: Parts, syncer: Parts, group, rank_of,
                 device="cpu", layouts=None):
        self.mine, self.syncer, self.group, self.rank_of = mine, syncer, group, rank_of
        self.device, self.same = torch.device(device), False
        layouts = layouts or [(specs, mine, None)] * tp
        world = self.world = len(layouts) * k
        self.owned = [i for i in range(syncer.count) if i % world == slot]
        own = set(self.owned)

        def runs_of(s):  # slot s: data-parallel rank s mod k at position m = s div k, tensor-parallel rank m mod tp
            specs_m, mine_m, shift = layouts[s // k]
            return rank_runs(specs_m, tp, s // k % tp, s % k, mine_m, syncer, shift)

        def tp_copy(s):  # a replicated parameter's Δ leaves from tensor-parallel rank 0 only
            return s // k % tp != 0
        mine_runs = runs_of(slot)
        # Δ: what this rank sends to each slot, and what it takes from each
        self.send_delta = [[(so, n * c) for so, i, _, n, c, _, rep in mine_runs
                            if i % world == s and not (rep and tp_copy(slot))] for s in range(world)]
        self.recv_delta, self.send_theta = [], []
        for s in range(world):
            runs = [(i, po, n, c, st, rep) for _, i, po, n, c, st, rep in runs_of(s) if i in own]
            self.recv_delta.append([(i, po, n, c, st) for i, po, n, c, st, rep in runs if not (rep and tp_copy(s))])
            self.send_theta.append([(i, po, n, c, st) for i, po, n, c, st, _ in runs])
        # θ_g: every run of this rank's partition, from the slot that holds its part
        self.recv_theta = [[(so, n * c) for so, i, _, n, c, _, _ in mine_runs if i % world == s]
                           for s in range(world)]

    def _exchange(self, pieces: List[List[torch.Tensor]], counts: List[int], dtype) -> Tuple[torch.Tensor, list]:
        """Send ``pieces[s]`` to slot ``s``; receive ``counts[s]`` elements from each slot. Returns the received
        elements end to end and where each slot's start."""
        order = sorted(range(self.world), key=lambda s: self.rank_of[s])  # slots in group-rank order
        empty = torch.empty(0, dtype=dtype, device=self.device)
        send = torch.cat([t.to(self.device, dtype).reshape(-1) for s in order for t in pieces[s]] or [empty])
        recv = torch.empty(sum(counts), dtype=dtype, device=self.device)
        tdist.all_to_all_single(recv, send, [counts[s] for s in order],
                                [sum(t.numel() for t in pieces[s]) for s in order], group=self.group)
        start, at = [0] * self.world, 0
        for s in order:
            start[s], at = at, at + counts[s]
        return recv, start

    def to_syncer(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """This rank's partition (``mine.numel`` elements) → the syncer parts it holds (zero padding). A
        collective over the learner's world."""
        pieces = [[flat[so:so + n] for so, n in runs] for runs in self.send_delta]
        counts = [sum(n * c for _, _, n, c, _ in runs) for runs in self.recv_delta]
        recv, start = self._exchange(pieces, counts, flat.dtype)
        slices = {i: recv.new_zeros(self.syncer.numel) for i in self.owned}
        for s, runs in enumerate(self.recv_delta):
            at = start[s]
            for i, po, n, c, st in runs:  # c rows of n elements, st apart: one strided copy
                slices[i].as_strided((c, n), (st, 1), po).copy_(recv[at:at + n * c].view(c, n))
                at += n * c
        return [slices[i] for i in self.owned]

    def from_syncer(self, slices: List[torch.Tensor]) -> torch.Tensor:
        """The syncer parts this rank holds (``owned`` order) → this rank's partition (``mine.numel`` fp32 elements
        on ``device``, its padding zero). A collective over the learner's world."""
        held = {i: t.contiguous() for i, t in zip(self.owned, slices)}
        pieces = [[held[i].as_strided((c, n), (st, 1), held[i].storage_offset() + po) for i, po, n, c, st in runs]
                  for runs in self.send_theta]
        counts = [sum(n for _, n in runs) for runs in self.recv_theta]
        recv, start = self._exchange(pieces, counts, torch.float32)
        flat = torch.zeros(self.mine.numel, dtype=torch.float32, device=self.device)
        for s, runs in enumerate(self.recv_theta):
            at = start[s]
            for so, n in runs:
                flat[so:so + n].copy_(recv[at:at + n])
                at += n
        return flat


__all__ = ["ATTRIBUTES", "TPRelayout", "canonical_model", "canonical_name", "clip", "learner_world", "rank_runs",
           "split_params", "stage_model", "tp_runs"]
