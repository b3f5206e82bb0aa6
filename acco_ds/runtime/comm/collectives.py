"""Flat-buffer collectives that send the optimal number of bytes on every backend.

Why: on gloo, ``torch.distributed.reduce_scatter_tensor`` is an all-reduce of
the whole input followed by a copy of this rank's slice. A ring all-reduce
sends 2(W-1)/W of the buffer per rank, twice what a reduce-scatter needs
((W-1)/W): a 16 MB buffer on 2 ranks sends 16 MB per rank instead of 8 MB.
NCCL's reduce-scatter, and gloo's all-to-all and all-gather, are already
optimal.

* :func:`reduce_scatter` -- native on NCCL (and every backend but gloo); on
  gloo a chunked all-to-all: for each chunk of the partition, each rank packs
  the slices the other ranks own into a small send buffer, one
  ``all_to_all_single`` exchanges them, and each rank sums what it received
  into ``output``. Every byte of another rank's partition crosses the network
  once: (W-1)/W of the input per rank. Extra memory: two buffers of
  (W-1) * chunk_elems elements, whatever the input size.
* :func:`all_gather` -- ``all_gather_into_tensor`` (``all_gather_single`` on
  torch releases that renamed it), in place when ``input`` is this rank's
  slice of ``output``.

Node-aware (hierarchical) versions, when ``group`` is a :class:`NodeLayout`:
a group of ``W = R k`` ranks on ``R`` nodes of ``k`` ranks, group rank
``r = n k + i`` being local rank ``i`` of node ``n``. Rank ``r`` still owns
chunk ``r`` of the flat buffer (ZeRO-1's partition does not change, so
checkpoints are the same as with flat collectives). Reduce-scatter:

1. inside the node, for each node ``n'``: reduce-scatter the ``k`` chunks
   ``n' k .. n' k + k - 1``, so local rank ``i`` holds the node's sum of
   chunk ``n' k + i`` (``R`` calls, contiguous input, no permutation copy);
2. across nodes, over the *rail* of ranks with local index ``i``:
   reduce-scatter those ``R`` node sums, so rank ``r`` gets chunk ``r``
   summed over every rank.

All-gather runs the two steps in reverse (rail, then ``R`` intra-node
all-gathers straight into the output). Only step 2 crosses nodes: each node
sends ``(R-1)/R`` of the buffer across the cut per collective, the minimum,
where a flat all-to-all or ring crosses it on every edge. Extra memory: one
buffer of ``N/k`` elements. Sum order: within each node in local-rank order,
then over nodes in node order; the owner computes its chunk and the
all-gather copies it, so every rank holds the same bits.
"""

from dataclasses import dataclass
from datetime import timedelta
from typing import List, Optional

import torch
import torch.distributed as tdist

from . import lifetime

__all__ = ["reduce_scatter", "all_gather", "all_gather_part", "NodeLayout", "node_layout", "DEFAULT_CHUNK_ELEMS"]

# torch >= 2.13 may rename the flat-tensor collectives; keep working on either name.
_native_reduce_scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
_native_all_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor

# Elements of one chunk of the partition (256 KiB of fp32): small enough that the
# staging buffers stay small and that a slow, shaped link is kept busy (measured on
# a 50 Mbit tbf link, 1.7 MB per rank: 1<<16 -> 245 ms, 1<<18 -> 399 ms, one chunk
# -> 502 ms, against 301 ms for gloo's all-gather of the same bytes), large enough
# that gloo's per-message latency stays small.
DEFAULT_CHUNK_ELEMS = 1 << 16


class _Completed:
    """What an ``async_op=True`` call of the synchronous gloo path returns:
    the work is already done, ``wait()`` returns at once."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _is_gloo(group, device: torch.device) -> bool:
    """Whether ``group`` runs collectives on tensors of ``device`` with gloo.
    Handles plain backends ("gloo", "nccl") and per-device ones
    ("cpu:gloo,cuda:nccl")."""
    backend = str(tdist.get_backend(group)).lower()
    if ":" in backend:
        per_device = dict(item.split(":", 1) for item in backend.split(","))
        return per_device.get(device.type) == "gloo"
    return backend == "gloo"


@dataclass
class NodeLayout:
    """A process group cut into ``nodes`` nodes of ``per_node`` ranks (group rank ``n * per_node + i`` is
    local rank ``i`` of node ``n``): pass it as the ``group`` of :func:`reduce_scatter` and
    :func:`all_gather` for the node-aware versions. ``node``: this rank's intra-node group; ``rail``: the
    ranks with this rank's local index on every node; ``flat``: the whole group (for other collectives)."""
    nodes: int
    per_node: int
    node: object
    rail: object
    flat: object

    def __str__(self):
        return f"hierarchical ({self.nodes} nodes x {self.per_node} ranks)"


def node_layout(all_groups: List[List[int]], ranks_per_node: int, flat=None,
                timeout_s: float = 1800.0) -> Optional[NodeLayout]:
    """Create the intra-node and rail groups of every group in ``all_groups`` (lists of global ranks, the
    same list on every rank: this is collective over the default group) and return this rank's layout, or
    None when its group lies on one node or has one rank per node (flat collectives are optimal then).
    A rank's node is ``global_rank // ranks_per_node``, as the ``deepspeed`` and ``torchrun`` launchers
    number ranks node by node. ``flat``: this rank's group itself, kept as ``NodeLayout.flat``."""
    me, timeout, mine = tdist.get_rank(), timedelta(seconds=timeout_s), None
    for ranks in all_groups:
        ranks = sorted(ranks)
        by_node = {}
        for r in ranks:
            by_node.setdefault(r // ranks_per_node, []).append(r)
        nodes = list(by_node.values())
        per_node = len(nodes[0])
        if len(nodes) < 2 or per_node < 2 or any(len(n) != per_node for n in nodes):
            continue  # one node, one rank per node, or uneven nodes: this group stays flat
        made_nodes = [lifetime.new_group(n, timeout) for n in nodes]  # every rank creates every group
        rails = [[n[i] for n in nodes] for i in range(per_node)]
        made_rails = [lifetime.new_group(rail, timeout) for rail in rails]
        if me in ranks:
            n = next(j for j, members in enumerate(nodes) if me in members)
            mine = NodeLayout(len(nodes), per_node, made_nodes[n], made_rails[nodes[n].index(me)], flat)
    return mine


def _hierarchical_reduce_scatter(output: torch.Tensor, input: torch.Tensor, layout: NodeLayout, chunk_elems: int):
    P, R, k = output.numel(), layout.nodes, layout.per_node
    if input.numel() != R * k * P:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {R * k} * {P}")
    rows = input.view(R, k * P)  # row n: the chunks of node n's ranks
    node_sums = input.new_empty(R * P)
    for n in range(R):
        reduce_scatter(node_sums[n * P:(n + 1) * P], rows[n], layout.node, chunk_elems=chunk_elems)
    reduce_scatter(output.view(-1), node_sums, layout.rail, chunk_elems=chunk_elems)


def _hierarchical_all_gather(output: torch.Tensor, input: torch.Tensor, layout: NodeLayout) -> None:
    P, R, k = input.numel(), layout.nodes, layout.per_node
    gathered = input.new_empty(R * P)  # gathered[n]: the chunk of local rank i on node n
    all_gather(gathered, input.reshape(-1), layout.rail)
    flat_out = output.view(-1)
    for n in range(R):
        all_gather(flat_out[n * k * P:(n + 1) * k * P], gathered[n * P:(n + 1) * P], layout.node)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None, *, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                   async_op: bool = False):
    """``output = sum over ranks r of input_r[rank*P:(rank+1)*P]``, with
    ``P = output.numel()`` and ``rank`` this process's rank in ``group``; the
    same contract as ``reduce_scatter_tensor(output, input, op=SUM)``.

    Args:
        output: contiguous tensor of P elements; it must not overlap ``input``.
        input: contiguous tensor of W*P elements (W = size of ``group``), same
            dtype as ``output``. It is not modified, so it may be the buffer a
            later all-gather writes into.
        group: process group (``None``: the default group).
        chunk_elems: gloo only: elements of the partition exchanged per
            all-to-all; the extra memory is 2 * (W-1) * chunk_elems elements.
        async_op: on backends other than gloo, returns torch's work handle. On
            gloo the call is synchronous (it returns when ``output`` is ready)
            and returns an already-completed handle whose ``wait()`` returns
            at once; with ``async_op=False`` it returns ``None``.

    Sum order on gloo: rank order, ``((x_0 + x_1) + x_2) + ... + x_{W-1}``,
    each addition in the dtype of the tensors (bf16/fp16 additions round to
    that dtype after each step, as gloo's own sum does), identical on every
    rank and for every chunk. torch's ``reduce_scatter_tensor`` on gloo is an
    all-reduce whose order follows gloo's ring segmentation (it depends on the
    rank and on the buffer size, not on rank order; measured on torch 2.13
    it is bit for bit ``all_reduce`` of the whole input followed by a slice,
    and for bf16 it also adds in bf16, rounding after each addition).
    Hence: for W = 2 the results equal torch's bit for bit (a sum of two is
    order independent);
    for W >= 3 they are equal for exactly representable sums (e.g. small
    integers) and may differ in the last bits for random floats.
    """
    if isinstance(group, NodeLayout):  # node-aware: see the module docstring
        _hierarchical_reduce_scatter(output, input, group, chunk_elems)
        return _Completed() if async_op else None
    world = tdist.get_world_size(group)
    if not _is_gloo(group, input.device):
        return _native_reduce_scatter(output, input, op=tdist.ReduceOp.SUM, group=group, async_op=async_op)
    numel = output.numel()
    if input.numel() != world * numel:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, expected {world} * {numel}")
    if input.dtype != output.dtype:
        raise ValueError(f"reduce_scatter: dtypes differ ({input.dtype} vs {output.dtype})")
    if not (input.is_contiguous() and output.is_contiguous()):
        raise ValueError("reduce_scatter: input and output must be contiguous")
    if chunk_elems < 1:
        raise ValueError("reduce_scatter: chunk_elems must be positive")
    rank = tdist.get_rank(group)
    rows = input.view(world, numel)  # rows[r]: the part of this rank's input that rank r owns
    out = output.view(-1)
    if world == 1 or numel == 0:
        out.copy_(rows[0])
        return _Completed() if async_op else None

    n = min(chunk_elems, numel)
    send_buf = input.new_empty((world - 1) * n)
    recv_buf = input.new_empty((world - 1) * n)
    for start in range(0, numel, n):
        m = min(n, numel - start)
        send = send_buf[:(world - 1) * m].view(world - 1, m)
        recv = recv_buf[:(world - 1) * m].view(world - 1, m)
        # Row i of send/recv is for/from rank i, skipping this rank: nothing is sent to oneself.
        send[:rank].copy_(rows[:rank, start:start + m])
        send[rank:].copy_(rows[rank + 1:, start:start + m])
        splits = [0 if r == rank else m for r in range(world)]
        tdist.all_to_all_single(recv.view(-1), send.view(-1), splits, splits, group=group)
        # Sum in rank order 0..W-1; this rank's own slice comes straight from input.
        parts = [rows[rank, start:start + m] if r == rank else recv[r if r < rank else r - 1] for r in range(world)]
        o = out[start:start + m]
        torch.add(parts[0], parts[1], out=o)
        for part in parts[2:]:
            o.add_(part)
    return _Completed() if async_op else None


def all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """``output[r*P:(r+1)*P] = input_r`` for every rank r (P = input.numel()),
    torch's ``all_gather_into_tensor``. ``input`` may be this rank's slice of
    ``output`` (in-place all-gather); that works on gloo and NCCL. Returns
    torch's work handle with ``async_op=True``, else ``None`` (a :class:`NodeLayout`
    group: synchronous, an already-completed handle)."""
    if isinstance(group, NodeLayout):
        _hierarchical_all_gather(output, input, group)
        return _Completed() if async_op else None
    return _native_all_gather(output, input, group=group, async_op=async_op)


def all_gather_part(output: torch.Tensor, part: torch.Tensor, rank: int, group=None) -> None:
    """Write ``part`` into this rank's slot of the flat ``output`` (slot ``rank``, ``part.numel()``
    elements) and gather every other rank's slot into ``output``, in place."""
    mine = output.narrow(0, rank * part.numel(), part.numel())
    mine.copy_(part)
    all_gather(output, mine, group)
