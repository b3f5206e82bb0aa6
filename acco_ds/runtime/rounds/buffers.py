"""The flat buffers ACCO adds to ZeRO-1, and their memory plan.

Stock ZeRO-1 holds, per rank, the model parameters (``bit16_groups_flat``,
bN bytes for N parameters of b bytes), their gradients (``param.grad``, in
the gradient accumulation dtype) and a 1/W shard of the fp32 master weights
and optimizer state. ACCO needs, at the same time during a round:

* the compute parameters (ZeRO-1's own flat buffer, not counted here);
* an accumulator for this round's gradients (replaces ``param.grad``: each
  parameter's gradient is added into it by a post-accumulate-grad hook and
  freed at once, so no full set of autograd gradients lives beside it);
* the previous round's gradients being reduce-scattered, and then the
  all-gathered next parameters. These share one *communication buffer*:
  the reduce-scatter reads it, and only afterwards the all-gather writes
  the new parameters over it (the authors' in-place trick).

When a round ends the gathered parameters are copied into the compute
parameters, and the accumulator's gradients move to the communication side:
by swapping the two buffers' roles when the accumulator already has the
communication dtype, else by a cast into the communication buffer. Either
way the accumulator starts the next round zeroed.

Per parameter group of ``numel`` elements (padded like ZeRO-1) and
``partition`` = numel / W elements per rank:

    accumulator     numel x size(grad_accum_dtype)
    communication   numel x max(size(communication_data_type), size(model dtype))
    reduced         partition x size(communication_data_type)   reduce-scatter output
                    (none for fp32: the reduce-scatter writes the shard directly)
    shard           partition x 4                                 fp32 gradient for the update
    kept            partition x size(communication_data_type)     the estimate round's reduced
                                                                  gradient, kept for the real round

Stock ZeRO-1 has an fp32 gradient partition (4N/W) where ACCO has ``shard``.
So with the model dtype used for accumulation and communication (DeepSpeed's
defaults) ACCO adds one model-sized buffer (bN) plus 4N/W to ZeRO-1, and
``grad_accum_dtype="fp32"`` on a 16-bit model adds 4N + 4N/W.

Without overlap (``sync`` rounds, the local-SGD modes' inner steps) the
compute side is idle while the job runs, so no communication buffer is
needed: the reduce-scatter reads the accumulator itself (zeroed once read)
and the all-gather writes straight into the compute parameters
(``params``). Only an accumulator whose dtype differs from the
communication dtype needs a cast buffer (numel x size(communication dtype)).
These modes then cost what stock ZeRO-1 costs.
"""

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from ..dtypes import size as _size


def padded_numel(n: int, world_size: int) -> int:
    """ZeRO-1 pads each flat group so it splits into equal, aligned partitions (both hosts' flat buffers)."""
    align = 2 * world_size
    return -(-int(n) // align) * align


def plan_bytes(numel: int, partition: int, model_dtype: torch.dtype, accum_dtype: torch.dtype,
               comm_dtype: torch.dtype, keep_shard: bool = True, overlap: bool = True,
               compression: Optional["RoundCompression"] = None) -> Dict[str, int]:
    """Bytes of each buffer ``FlatBuffers`` allocates for one group (the
    memory plan; ``acco_ds.memory`` and the tests use the same function).
    ``keep_shard``: the mode has estimate rounds (``acco``) and so a kept shard;
    ``overlap``: communication overlaps compute (``acco``, ``dpu``); ``compression``: compressed rounds."""
    if overlap:
        communication = numel * max(_size(comm_dtype), _size(model_dtype))
    else:  # a cast buffer only when the accumulator is not already in the communication dtype
        communication = 0 if accum_dtype == comm_dtype else numel * _size(comm_dtype)
    plan = {
        "accumulator": numel * _size(accum_dtype),
        "communication": communication,
        "reduced": 0 if comm_dtype == torch.float32 else partition * _size(comm_dtype),
        "shards": partition * (4 + (_size(comm_dtype) if keep_shard else 0)),
    }
    if compression is not None:
        # The reduce-scatter writes the fp32 shard directly, the kept shard is fp32; without overlap the
        # update needs its own target (the all-gather sends target - parameters).
        plan["reduced"] = 0
        plan["shards"] = partition * (4 + (4 if keep_shard else 0)) + (0 if overlap else partition * _size(model_dtype))
        plan["residuals"] = compression.residual_elems(partition) * compression.residual_size
    return plan


@dataclass
class RoundCompression:
    """Compressed rounds (``runtime.comm.compression``): ``peers`` ranks in the quantized step (the group, or the
    rail of a node-aware layout), residuals in ``residual_dtype`` (None: no error feedback)."""
    peers: int
    residual_dtype: Optional[torch.dtype]

    @property
    def residual_size(self) -> int:
        return 0 if self.residual_dtype is None else _size(self.residual_dtype)

    def residual_elems(self, partition: int) -> int:
        return 0 if self.residual_dtype is None else (self.peers - 1) * partition


@dataclass
class FlatBuffers:
    """ACCO's buffers for one ZeRO-1 parameter group (see the module docstring)."""

    numel: int
    partition: int
    world_size: int
    model_dtype: torch.dtype
    accum_dtype: torch.dtype
    comm_dtype: torch.dtype
    device: torch.device
    keep_shard: bool = True  # acco mode: estimate rounds keep their reduced shard
    params: Optional[torch.Tensor] = None  # no overlap: the compute parameters, which the all-gather writes
    compression: Optional[RoundCompression] = None  # compressed rounds: fp32 reduce output, residuals, target

    def __post_init__(self):
        if self.numel != self.partition * self.world_size:
            raise ValueError(f"flat buffer of {self.numel} elements does not split into {self.world_size} "
                             f"partitions of {self.partition}")
        # Only the accumulator must start zeroed; every other buffer is written before it is read, and
        # torch.empty leaves the pages untouched (no resident memory) until the first round uses them.
        empty = lambda n, dtype: torch.empty(n, dtype=dtype, device=self.device)  # noqa: E731
        self.acc = torch.zeros(self.numel, dtype=self.accum_dtype, device=self.device)
        if self.params is None:
            # The communication buffer holds numel elements of the wider of the two dtypes it is read as.
            wide = self.comm_dtype if _size(self.comm_dtype) >= _size(self.model_dtype) else self.model_dtype
            self.comm = empty(self.numel, wide)
        else:  # no overlap: reduce-scatter from the accumulator (or a cast of it), gather into the parameters
            self.comm = empty(0 if self.accum_dtype == self.comm_dtype else self.numel, self.comm_dtype)
        c = self.compression
        fp32_reduce = self.comm_dtype == torch.float32 or c is not None  # compressed: summed in fp32
        self._reduced = None if fp32_reduce else empty(self.partition, self.comm_dtype)
        self.shard = empty(self.partition, torch.float32)
        self.kept = torch.zeros(self.partition if self.keep_shard else 0,
                                dtype=torch.float32 if c is not None else self.comm_dtype, device=self.device)
        # Error-feedback residuals of the reduce-scatter (one row per other rank of the quantized step), and
        # without overlap the update's target (the all-gather sends target - parameters, in place).
        self.residual = None if c is None or c.residual_dtype is None else \
            torch.zeros(c.residual_elems(self.partition), dtype=c.residual_dtype, device=self.device)
        self.target = empty(self.partition, self.model_dtype) if c is not None and self.params is not None else None
        self.kept_scale = 1.0  # what ``kept`` is multiplied by to give the fp32 gradient sum
        self.swap_roles = self.params is None and self.accum_dtype == self.comm_dtype == self.comm.dtype

    @staticmethod
    def _as(buf: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of ``buf`` reinterpreted as ``dtype``."""
        if buf.dtype == dtype:
            return buf[:numel]
        return buf.view(torch.uint8)[:numel * _size(dtype)].view(dtype)

    @property
    def reduced(self) -> torch.Tensor:
        """Reduce-scatter output (this rank's summed partition), communication dtype."""
        return self.shard if self._reduced is None else self._reduced

    @property
    def send(self) -> torch.Tensor:
        """Reduce-scatter input: the previous round's gradients, communication dtype."""
        if self.params is not None and self.comm.numel() == 0:
            return self.acc
        return self._as(self.comm, self.comm_dtype, self.numel)

    @property
    def gathered(self) -> torch.Tensor:
        """All-gather output: the next parameters, model dtype (same storage as ``send``; without overlap,
        the compute parameters themselves)."""
        if self.params is not None:
            return self.params
        return self._as(self.comm, self.model_dtype, self.numel)

    def install(self, params: torch.Tensor) -> None:
        """The gathered parameters become the compute parameters (nothing to copy without overlap)."""
        if self.params is None:
            params.copy_(self.gathered)

    def spare(self) -> torch.Tensor:
        """A flat model-dtype buffer the compute side does not use between rounds: the communication
        buffer, or without overlap a new one (freed when the caller drops it)."""
        if self.params is None:
            return self.gathered
        return torch.empty(self.numel, dtype=self.model_dtype, device=self.device)

    def gathered_part(self, rank: int) -> torch.Tensor:
        return self.gathered.narrow(0, rank * self.partition, self.partition)

    def update_out(self, rank: int) -> torch.Tensor:
        """Where the update writes this rank's new parameters (the all-gather reads them there)."""
        return self.target if self.target is not None else self.gathered_part(rank)

    def hand_over(self) -> None:
        """Move the accumulated gradients to the communication side and zero
        the accumulator for the next round. Call after the gathered
        parameters were installed (this overwrites them). Without overlap and
        without a cast, the job reads the accumulator itself and ``sent()``
        zeroes it afterwards."""
        if self.send is self.acc:
            return
        if self.swap_roles:
            self.acc, self.comm = self.comm, self.acc
        else:
            self.send.copy_(self.acc)
        self.acc.zero_()

    def sent(self) -> None:
        """The reduce-scatter has read ``send``: an accumulator it read directly starts the next round zeroed."""
        if self.send is self.acc:
            self.acc.zero_()

    def nbytes(self) -> Dict[str, int]:
        """Bytes actually allocated, in ``plan_bytes``' terms."""
        b = lambda t: t.numel() * t.element_size()  # noqa: E731
        out = {"accumulator": b(self.acc), "communication": b(self.comm),
               "reduced": 0 if self._reduced is None else b(self._reduced),
               "shards": b(self.shard) + b(self.kept) + (0 if self.target is None else b(self.target))}
        if self.compression is not None:
            out["residuals"] = 0 if self.residual is None else b(self.residual)
        return out


def allocated_bytes(buffers) -> Dict[str, int]:
    """Bytes allocated by a list of ``FlatBuffers``, by buffer, and their ``total``."""
    out: Dict[str, int] = {}
    for buf in buffers:
        for key, n in buf.nbytes().items():
            out[key] = out.get(key, 0) + n
    out["total"] = sum(out.values())
    return out


__all__ = ["FlatBuffers", "RoundCompression", "padded_numel", "plan_bytes", "allocated_bytes"]
