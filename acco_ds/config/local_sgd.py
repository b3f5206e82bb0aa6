"""The nested blocks of ``"acco"``: ``local_sgd`` (the local-SGD family's settings: DiLoCo, CO2, EDiT),
``collectives`` (node-aware or flat round collectives), ``compression`` (quantized communication) and
``emulation`` (benchmark hooks).

Kept apart from ``acco.py`` (``acco_ds.config`` re-exports every name here) so each module stays readable;
``ACCOConfig``'s validators check how these keys combine with ``acco.mode``.
"""

import typing
from typing import List, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from .decoupled import DecoupledKeys


class _Documented(BaseModel):
    """A config model whose field docstrings become the fields' descriptions, with the settings of DeepSpeed's
    ``DeepSpeedConfigModel`` (unknown keys rejected, defaults and assignments validated) on plain pydantic, so
    the config is read without DeepSpeed (the torch host never imports it)."""
    model_config = ConfigDict(use_attribute_docstrings=True, validate_default=True, validate_assignment=True,
                              use_enum_values=True, populate_by_name=True, extra="forbid",
                              arbitrary_types_allowed=True, protected_namespaces=())


LOCAL_SGD_MODES = ("diloco", "co2", "edit", "sparseloco", "decoupled")
ROUND_MODES = ("acco", "dpu", "sync")

# Outer-optimizer defaults per mode (DiLoCo's paper; CO2's released code).
OUTER_DEFAULTS = {"diloco": {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True},
                  "co2": {"outer_lr": 1.0, "outer_momentum": 0.5, "nesterov": False},
                  "edit": {"outer_lr": 0.7, "outer_momentum": 0.8, "nesterov": True},
                  "sparseloco": {"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": False},  # error feedback, no momentum
                  "decoupled": {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True}}  # its syncer: DiLoCo's
EDIT_ONLY = ("sync_time_s", "pseudo_grad_clip", "weighting", "anomaly")
STREAMING = ("fragments", "fragment_sync_delay", "fragment_update_alpha")  # diloco only
SPARSE = ("chunk", "topk", "error_decay", "value_bits", "entropy_coding", "overlap")  # sparseloco only


class AnomalyConfig(_Documented):
    """``edit`` only: EDiT's anomaly elimination. Each replica's pseudo-gradient norm is tracked (plain
    mean and variance over the first ``warmup_syncs`` syncs, then exponentially weighted); a replica
    whose norm's z-score exceeds ``threshold`` contributes zero that period."""

    enabled: StrictBool = False
    """Drop anomalous replicas from the average (they still restart from the new global model)."""

    ewma_alpha: float = Field(0.02, gt=0.0, le=1.0, allow_inf_nan=False)
    """Weight of the newest norm in the exponentially weighted mean and variance."""

    warmup_syncs: StrictInt = Field(10, ge=2)
    """Syncs that only gather statistics before any replica can be flagged."""

    threshold: float = Field(3.0, gt=0.0, allow_inf_nan=False)
    """z-score above which a replica's norm is anomalous."""


class LocalSGDConfig(_Documented, DecoupledKeys):
    """The local-SGD family (DiLoCo, CO2, EDiT, SparseLoCo): replicas train alone for ``sync_every``
    inner steps, then their pseudo-gradients are averaged into an outer step."""

    sync_every: StrictInt = Field(20, ge=1)
    """Inner steps per period (H): a replica syncs with the others every this many optimizer steps."""

    sync_time_s: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    """``edit`` only: A-EDiT. A replica group syncs once this many seconds of wall time passed since the
    last sync, whatever its step count; each replica's pseudo-gradient is weighted by its inner steps in
    the period. ``sync_every`` must then be left out. End the training loop on the sync count
    (``engine.acco_syncs``), which every rank agrees on, not on a step count."""

    pseudo_grad_clip: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    """``edit`` only: clip the averaged pseudo-gradient to this global norm,
    ``δ̄ · min(1, c / (‖δ̄‖ + 1e-6))``."""

    weighting: Literal["mean", "norm"] = "mean"
    """``edit`` only: ``mean`` averages the replicas; ``norm`` weights replica i by softmax(−‖δ‖)_i."""

    anomaly: AnomalyConfig = Field(default_factory=AnomalyConfig)
    """``edit`` only: anomaly elimination, see ``AnomalyConfig``."""

    replica_group_size: Optional[StrictInt] = Field(None, ge=1)
    """Ranks per replica group (k); inside a group every inner step is ZeRO-1 over the group's links.
    Left out (the default): the ranks per node, ``LOCAL_WORLD_SIZE``. Must divide the data-parallel
    world size and leave at least two replicas."""

    outer_lr: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    """Outer learning rate (η; α in CO2). Default: 0.7 in ``diloco`` and ``edit``, 1.0 in ``co2`` and
    ``sparseloco``."""

    outer_momentum: Optional[float] = Field(None, ge=0.0, lt=1.0, allow_inf_nan=False)
    """Outer momentum (μ; β in CO2). Default: 0.9 in ``diloco``, 0.8 in ``edit``, 0.5 in ``co2``."""

    nesterov: Optional[StrictBool] = None
    """Nesterov outer momentum (torch's SGD). Default: true in ``diloco`` and ``edit``, false (heavy
    ball) in ``co2``."""

    staleness_penalty: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    """``co2`` only: λ, the pseudo-gradient enters the momentum as δ̄/λ (default 1)."""

    outer_momentum_clip: Optional[float] = Field(None, gt=0.0, allow_inf_nan=False)
    """``co2`` only: clamp the outer momentum element-wise to [-c, c] (default: no clipping)."""

    fragments: StrictInt = Field(1, ge=1)
    """``diloco`` only: Streaming DiLoCo. The model is split into this many fragments (F) by element
    offset; one fragment syncs every ``sync_every / fragments`` inner steps, round-robin, so each fragment
    syncs every ``sync_every`` steps and the peak outer traffic falls F-fold. Must divide ``sync_every``."""

    fragment_sync_delay: StrictInt = Field(0, ge=0)
    """``diloco`` only: τ. A fragment's all-reduce starts τ inner steps before its sync, on the outer
    communication thread, and the inner steps go on meanwhile. Must be below ``sync_every / fragments``."""

    fragment_update_alpha: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    """``diloco`` only: α. At a sync the replica's fragment becomes ``g' + α (θ_local − g')`` (g': the
    fragment's new global values, θ_local: the replica's own): 0 takes the global values, 1 keeps the
    local ones."""

    chunk: StrictInt = Field(4096, ge=1, description="``sparseloco`` only: elements per chunk. Each parameter "
                             "tensor, flattened, is cut into chunks of this many elements (its last one may be "
                             "shorter); at most 65536. Indices travel at ceil(log2 chunk) bits (12 for 4096).")

    topk: StrictInt = Field(64, ge=1, description="``sparseloco`` only: entries of largest magnitude kept per chunk "
                            "(density topk / chunk). At most chunk.")

    error_decay: float = Field(0.95, ge=0.0, lt=1.0, allow_inf_nan=False,
                               description="``sparseloco`` only: β, the error-feedback buffer becomes "
                               "β e + δ at every sync before the top-k; in [0, 1).")

    value_bits: Optional[Literal[2, 4, 8]] = Field(2, description="``sparseloco`` only: bits per kept value (2, 4 "
                                                   "or 8 levels codes with one fp32 scale per chunk), or null "
                                                   "to send the kept values in fp32.")

    entropy_coding: Optional[Literal["zlib"]] = Field("zlib", description="``sparseloco`` only: \"zlib\" sends "
                                                      "each payload zlib-coded (index gaps, codes, scales) when "
                                                      "that is smaller; null: the packed payload. Lossless.")

    overlap: StrictInt = Field(0, ge=0, description="``sparseloco`` only: N, inner steps the sparse all-gather runs "
                               "behind; it lands after N more steps, keeping their progress. 0: the blocking sync. "
                               "Below sync_every.")

    def check_sparse(self, mode: str) -> None:
        """SparseLoCo's keys: sparseloco only; topk <= chunk <= 65536; no outer momentum."""
        given = [k for k in SPARSE if k in self.model_fields_set]
        if mode != "sparseloco" and given:
            raise ValueError(f'acco.local_sgd.{given[0]} is SparseLoCo\'s: it applies to mode "sparseloco", not to '
                             f'mode "{mode}": remove it or set acco.mode to "sparseloco"')
        if mode != "sparseloco":
            return
        for key in ("outer_momentum", "nesterov"):
            if getattr(self, key) is not None:
                raise ValueError(f'acco.local_sgd.{key} does not apply to mode "sparseloco": its error-feedback '
                                 f'buffer (error_decay) replaces the outer momentum and the outer step is plain '
                                 f'averaged descent with outer_lr. Remove {key}')
        if self.chunk > 65536:
            raise ValueError(f"acco.local_sgd.chunk ({self.chunk}) must be at most 65536: each kept entry's index "
                             f"inside its chunk travels in <= 16 bits. Use a chunk of at most 65536 (default 4096)")
        if self.topk > self.chunk:
            raise ValueError(f"acco.local_sgd.topk ({self.topk}) must be at most acco.local_sgd.chunk "
                             f"({self.chunk}): it is the number of entries kept per chunk. Lower topk or raise chunk")
        if self.overlap and self.overlap >= (self.sync_every or 0):
            raise ValueError(f"acco.local_sgd.overlap ({self.overlap}) must be below sync_every "
                             f"({self.sync_every}): a sync's all-gather lands before the next sync starts. "
                             f"Lower overlap")

    @property
    def streaming(self) -> bool:
        """Streaming DiLoCo keys away from plain DiLoCo's values."""
        return (self.fragments, self.fragment_sync_delay, self.fragment_update_alpha) != (1, 0, 0.0)

    def check_streaming(self, mode: str) -> None:
        """Streaming DiLoCo's keys: diloco only, F divides H, τ < H / F."""
        given = [k for k in STREAMING if k in self.model_fields_set]
        if mode != "diloco" and given:
            raise ValueError(f'acco.local_sgd.{given[0]} is Streaming DiLoCo\'s: it applies to mode "diloco", not '
                             f'to mode "{mode}": remove it or set acco.mode to "diloco"')
        if self.sync_every % self.fragments:
            raise ValueError(f"acco.local_sgd.fragments ({self.fragments}) must divide acco.local_sgd.sync_every "
                             f"({self.sync_every}): one fragment syncs every sync_every / fragments inner steps. Use "
                             f"a divisor of {self.sync_every}, or a sync_every that is a multiple of {self.fragments}")
        window = self.sync_every // self.fragments
        if self.fragment_sync_delay >= window:
            raise ValueError(f"acco.local_sgd.fragment_sync_delay ({self.fragment_sync_delay}) must be below "
                             f"sync_every / fragments = {window}: a fragment's all-reduce starts that many steps "
                             f"before its sync, inside its own window. Use at most {window - 1}")

    def resolved(self, mode: str) -> dict:
        """The outer settings of ``mode``, defaults filled in."""
        out = {k: (getattr(self, k) if getattr(self, k) is not None else v) for k, v in OUTER_DEFAULTS[mode].items()}
        out["staleness_penalty"] = self.staleness_penalty if self.staleness_penalty is not None else 1.0
        out["outer_momentum_clip"] = self.outer_momentum_clip
        return out


class ACCOEmulationConfig(_Documented):
    """Benchmark and test hooks that emulate a slow network or slow workers.

    Never use these for real training: they only add sleeps. Every benchmark
    row that uses them says so.
    """

    comm_delay_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Extra seconds the communication side sleeps in every round before it
    starts, on every rank (emulates a slow network)."""

    slow_rank: StrictInt = -1
    """Global rank whose compute is slowed (-1: none)."""

    slow_factor: float = Field(1.0, ge=1.0, allow_inf_nan=False)
    """On ``slow_rank``, every micro-batch takes this many times as long: after
    each backward the rank sleeps ``(slow_factor - 1) x`` the measured time of
    that forward+backward."""


class CollectivesConfig(_Documented):
    """How the reduce-scatter and all-gather of every round (and of the local-SGD inner steps) run over
    the network. ZeRO-1's partition of each rank is the same in every layout, so checkpoints are too."""

    layout: Literal["auto", "flat", "hierarchical"] = "auto"
    """``flat``: one collective over the whole ZeRO-1 group. ``hierarchical``: node-aware, first inside
    each node, then across nodes over rails of ranks with the same local index, so only (R-1)/R of the
    buffer crosses between nodes per collective (R nodes), the minimum. ``auto``: hierarchical when the
    group spans more than one node with more than one rank on each, else flat."""

    ranks_per_node: Optional[StrictInt] = Field(None, ge=1)
    """Ranks on each node; rank r is on node r // ranks_per_node, as launchers number them. Left out (the
    default): ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (the ``deepspeed`` launcher), else
    the whole world on one node. ``local_sgd.replica_group_size`` defaults to the same number."""


class CompressionConfig(_Documented):
    """Block-quantized communication with error feedback (off by default; off, every result is bit-identical
    to uncompressed runs). Each block of ``block_size`` elements is sent as one fp32 scale (max|x| / qmax)
    and one byte per value: about 0.25x the bytes of fp32 and 0.5x of bf16 at the default block size."""

    dtype: Optional[Literal["int8", "fp8"]] = None
    """``int8`` (qmax 127) or ``fp8`` (e4m3, qmax 448); null: no compression."""

    block_size: StrictInt = Field(256, ge=8, le=1 << 20)
    """Elements per fp32 scale. Smaller blocks quantize more finely and send more scales."""

    error_feedback: StrictBool = True
    """Keep what each quantized send left out (a residual per rank) and add it to the next send of the
    same buffer region, so quantization errors do not accumulate. Residuals are checkpointed."""

    residual_dtype: Literal["fp32", "bf16"] = "fp32"
    """Dtype of the error-feedback residuals (bf16 halves their memory)."""

    apply_to: Optional[List[Literal["rounds", "outer"]]] = Field(None, min_length=1)
    """What to compress. ``rounds``: the reduce-scatter and all-gather of every round (acco, dpu, sync and
    the local-SGD inner steps; with a node-aware layout only the step across nodes). ``outer``: the
    local-SGD outer all-reduce of the pseudo-gradient (diloco, co2, edit); listed, also the up-link
    of each pseudo-gradient to the syncer (decoupled). Default (``"auto"``): each of
    them whose group spans more than one node (see ``collectives.ranks_per_node``); what stays inside a
    node keeps full precision. List an entry to compress it wherever it runs."""

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def applies_to(self, what: str, crosses_nodes: bool = True) -> bool:
        """Is ``what`` ("rounds" | "outer") compressed, for a group that does (not) span nodes?"""
        if not self.enabled:
            return False
        return crosses_nodes if self.apply_to is None else what in self.apply_to

    def check(self, mode: str, local: bool) -> None:
        """How these keys combine with each other and with ``acco.mode`` (a local-SGD mode or not)."""
        if not self.enabled:
            stray = sorted(self.model_fields_set - {"dtype"})
            if stray:
                raise ValueError(f'acco.compression.{stray[0]} has no effect without acco.compression.dtype: set '
                                 f'"dtype" to "int8" or "fp8", or remove acco.compression.{stray[0]}')
            return
        if self.apply_to is not None and len(set(self.apply_to)) != len(self.apply_to):
            raise ValueError(f"acco.compression.apply_to lists an entry twice ({self.apply_to}): list each of "
                             f'"rounds", "outer" at most once')
        if not local and self.apply_to is not None and "outer" in self.apply_to:
            raise ValueError(f'acco.compression.apply_to "outer" compresses the local-SGD outer all-reduce, but '
                             f'acco.mode is "{mode}" (no outer loop): use "apply_to": ["rounds"] or a mode '
                             f'"diloco"/"co2"/"edit"')
        if mode == "sparseloco" and self.apply_to is not None and "outer" in self.apply_to:
            raise ValueError('acco.compression.apply_to "outer" cannot be used with acco.mode "sparseloco": its outer '
                             'communication is its own compression (top-k per chunk, value_bits, error feedback). '
                             'Use "apply_to": ["rounds"] to compress only the inner steps, or remove apply_to')
        if "residual_dtype" in self.model_fields_set and not self.error_feedback:
            raise ValueError("acco.compression.residual_dtype sets the dtype of the error-feedback residuals, but "
                             "acco.compression.error_feedback is false: remove residual_dtype or enable "
                             "error_feedback")


def ranks_per_node(acco, world_size: int) -> int:
    """The configured ``collectives.ranks_per_node``, or the launcher's ranks per node, or ``world_size``."""
    import os
    n = acco.collectives.ranks_per_node
    if n is None:  # torchrun sets LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE
        n = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or world_size
    return int(n)


def spans_nodes(ranks, acco, world_size: int) -> bool:
    """Are the global ``ranks`` on more than one node (rank r is on node r // ranks_per_node)?"""
    per_node = ranks_per_node(acco, world_size)
    return len({r // per_node for r in ranks}) > 1


def collectives_layout(acco, world_size: int) -> str:
    """``flat`` or ``hierarchical``: the layout asked for, with ``auto`` resolved (more than one node of
    more than one rank: hierarchical). ``world_size``: all ranks (nodes are counted in global ranks)."""
    if acco.collectives.layout != "auto":
        return acco.collectives.layout
    n = ranks_per_node(acco, world_size)
    return "hierarchical" if 1 < n < world_size and world_size % n == 0 else "flat"


def unknown_keys(model, block: dict, prefix: str) -> list:
    """One message per key of ``block`` (and of its nested config objects) that ``model`` does not know."""
    lines = []
    for key, value in block.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            known = ", ".join(model.model_fields)
            lines.append(f'unknown key "{prefix}.{key}" (misspelled?). Known keys: {known}')
        elif isinstance(value, dict):
            nested = [t for t in (field.annotation, *typing.get_args(field.annotation))
                      if isinstance(t, type) and issubclass(t, _Documented)]
            if nested:
                lines += unknown_keys(nested[0], value, f"{prefix}.{key}")
    return lines


__all__ = ["LocalSGDConfig", "AnomalyConfig", "CollectivesConfig", "CompressionConfig", "ACCOEmulationConfig",
           "LOCAL_SGD_MODES", "ROUND_MODES", "OUTER_DEFAULTS", "EDIT_ONLY", "STREAMING", "ranks_per_node", "spans_nodes",
           "collectives_layout", "unknown_keys"]
