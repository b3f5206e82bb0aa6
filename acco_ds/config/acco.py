"""The ``"acco"`` block of a DeepSpeed JSON config.

Example::

    "acco": {"enabled": true, "mode": "acco", "accumulation": "fixed"}

The model follows DeepSpeed's own config models (``runtime/zero/config.py``):
pydantic 2 with ``DeepSpeedConfigModel``'s settings (unknown keys rejected), one
documented field per key. It imports no DeepSpeed: the torch host reads the same block.
"""

from typing import Literal, Optional

from pydantic import Field, StrictBool, StrictInt, ValidationError, model_validator

from .fault_tolerance import FaultToleranceConfig
from .moe import MOE_MODES  # noqa: F401 - re-exported
from .rulebook import refusals, replica_group_size
from .decoupled import check_decoupled
from .local_sgd import (EDIT_ONLY, LOCAL_SGD_MODES, ACCOEmulationConfig, CollectivesConfig, CompressionConfig,
                        LocalSGDConfig, _Documented, unknown_keys)

ACCO_KEY = "acco"


class ACCOConfig(_Documented):
    """Settings of ACCO ("Accumulate While You Communicate", arXiv 2406.02613).

    Precision is set by DeepSpeed's own keys, not here: gradients accumulate in
    ``data_types.grad_accum_dtype`` (default: the model dtype, as stock ZeRO-1)
    and are reduce-scattered in ``communication_data_type`` (default: the model
    dtype); the update sums them in fp32. ACCO then needs one model-sized
    buffer beyond stock ZeRO-1 (4N more with fp32 accumulation on a 16-bit
    model): see ``acco_ds.memory``.
    """

    enabled: StrictBool = False
    """Train with ACCO. ``false`` (or no block) gives stock DeepSpeed. A JSON
    boolean only: ``"yes"``, ``"on"`` or ``1`` are rejected, so a typo never
    turns ACCO on or off silently."""

    mode: Literal["acco", "dpu", "sync", "diloco", "co2", "edit", "sparseloco", "decoupled"] = "acco"
    """``acco``: two rounds per optimizer step, the first estimates the next
    parameters with a Peek of the optimizer (delay compensation), the second
    commits; communication of each half-batch hides behind the compute of the
    next. ``dpu``: delayed parameter update, the paper's baseline: the step uses
    the gradient of the previous batch. ``sync``: plain ZeRO-1 (no overlap),
    for A/B comparisons; numerically equal to stock DeepSpeed ZeRO-1.
    ``diloco``, ``co2``, ``edit``: the local-SGD family (docs/design/outer-loops.md), set
    up by ``local_sgd``; ``edit`` with ``local_sgd.sync_time_s`` is A-EDiT. ``sparseloco``: DiLoCo's
    periods with sparse outer communication (top-k per chunk, 2-bit values, error feedback; docs/sparseloco.md).
    ``decoupled``: learners that never wait for each other, merged by a syncer (docs/decoupled.md)."""

    accumulation: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: every round accumulates exactly its configured number of
    micro-batches (``gradient_accumulation_steps / 2`` in ``acco`` mode,
    ``gradient_accumulation_steps`` otherwise) and waits for the communication
    if it is slower; deterministic. ``adaptive``: that number is a minimum;
    while the round's communication is still in flight the worker keeps
    accumulating, up to ``max_micro_batches_per_round``. Each worker's count is
    reduced with its gradients, so the gradient stays the exact mean over all
    micro-batches."""

    max_micro_batches_per_round: Optional[StrictInt] = Field(None, ge=1)
    """Upper bound of micro-batches per round in ``adaptive`` accumulation.
    Default: 4 x the minimum."""

    kernels: Literal["auto", "torch", "native"] = "auto"
    """Implementation of the fused Adam update (Peek and commit): ``native``
    (C++/CUDA ops, an error if they do not build), ``torch`` (pure PyTorch),
    ``auto`` (native when it loads, else torch with one log line)."""

    timeout_s: float = Field(1800.0, gt=0.0, allow_inf_nan=False)
    """Timeout of the communication side's process group. If another rank
    fails, every rank raises an error within about this time instead of
    hanging."""

    local_sgd: Optional[LocalSGDConfig] = None
    """Settings of the local-SGD modes (``diloco``, ``co2``, ``edit``): see ``LocalSGDConfig``."""

    collectives: CollectivesConfig = Field(default_factory=CollectivesConfig)
    """Node-aware or flat round collectives: see ``CollectivesConfig``."""

    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    """Quantized communication with error feedback (off by default): see ``CompressionConfig``."""

    fault_tolerance: Optional[FaultToleranceConfig] = None
    """Replicas that come and go (local-SGD modes, torchft): see ``FaultToleranceConfig``."""

    emulation: ACCOEmulationConfig = Field(default_factory=ACCOEmulationConfig)
    """Benchmark/test only: see ``ACCOEmulationConfig``."""

    @property
    def local(self) -> bool:
        """A local-SGD mode (``diloco``, ``co2``, ``edit``, ``sparseloco``)."""
        return self.mode in LOCAL_SGD_MODES

    @property
    def outer(self) -> dict:
        """The resolved outer settings of a local-SGD mode."""
        return (self.local_sgd or LocalSGDConfig()).resolved(self.mode)

    @model_validator(mode="after")
    def _check_local_sgd(self):
        if self.local_sgd is not None and not self.local:
            raise ValueError(f'acco.local_sgd configures the local-SGD modes ({", ".join(LOCAL_SGD_MODES)}) but '
                             f'acco.mode is "{self.mode}": remove acco.local_sgd or set acco.mode to "diloco"/"co2"/'
                             f'"edit"/"sparseloco"')
        if self.local:
            acco_only = [k for k in ("accumulation", "max_micro_batches_per_round") if k in self.model_fields_set]
            if acco_only:
                raise ValueError(f'acco.{acco_only[0]} belongs to the ACCO round modes (acco, dpu, sync), not to '
                                 f'acco.mode="{self.mode}": remove it (inner steps accumulate '
                                 f'gradient_accumulation_steps micro-batches, as ZeRO-1 does)')
            ls = self.local_sgd
            if self.mode != "co2" and ls is not None:
                for key in ("staleness_penalty", "outer_momentum_clip"):
                    if getattr(ls, key) is not None:
                        raise ValueError(f'acco.local_sgd.{key} applies to mode "co2" (its stale pseudo-gradient), '
                                         f'not to mode "{self.mode}": remove it or set acco.mode to "co2"')
            if self.mode != "edit" and ls is not None:
                for key in EDIT_ONLY:
                    if key in ls.model_fields_set:
                        raise ValueError(f'acco.local_sgd.{key} is EDiT\'s pseudo-gradient penalty / A-EDiT timing: it '
                                         f'applies to mode "edit", not to mode "{self.mode}": remove it or set '
                                         f'acco.mode to "edit"')
            if ls is not None:
                ls.check_streaming(self.mode)
                ls.check_sparse(self.mode)
            if ls is not None and ls.sync_time_s is not None and "sync_every" in ls.model_fields_set:
                raise ValueError("acco.local_sgd.sync_time_s (A-EDiT: periods end on wall time) and "
                                 "acco.local_sgd.sync_every (periods of a fixed step count) exclude each other: "
                                 "remove one of them")
        check_decoupled(self)
        return self

    @model_validator(mode="after")
    def _check_compression(self):
        self.compression.check(self.mode, self.local)
        if self.fault_tolerance is not None:
            self.fault_tolerance.check(self)
        return self

    @model_validator(mode="after")
    def _check_adaptive(self):
        if self.mode == "sync" and self.accumulation == "adaptive":
            raise ValueError('acco.accumulation="adaptive" needs an overlapping mode: '
                             'set acco.mode to "acco" or "dpu", or use accumulation="fixed" with mode="sync"')
        return self

    def round_mode(self) -> str:
        """The round schedule that drives the ZeRO-1 steps: local-SGD inner steps are ``sync`` rounds."""
        return "sync" if self.local else self.mode

    def micro_batches_per_round(self, gradient_accumulation_steps: int) -> int:
        """Minimum (and, in fixed accumulation, exact) micro-batches per round."""
        if self.mode == "acco":
            return gradient_accumulation_steps // 2
        return gradient_accumulation_steps

    def max_micro_batches(self, gradient_accumulation_steps: int) -> int:
        low = self.micro_batches_per_round(gradient_accumulation_steps)
        if self.accumulation == "fixed":
            return low
        return self.max_micro_batches_per_round or 4 * low


def parse_acco_config(ds_config: dict) -> ACCOConfig:
    """Read the ``"acco"`` block of a DeepSpeed config dict (absent: disabled).

    Raises ``ValueError`` that names the key and the accepted values.
    """
    block = ds_config.get(ACCO_KEY, None) if isinstance(ds_config, dict) else None
    if block is None:
        return ACCOConfig()
    if not isinstance(block, dict):
        raise ValueError(f'DeepSpeed config key "acco" must be an object such as '
                         f'{{"enabled": true, "mode": "acco"}}, got {type(block).__name__}: {block!r}')
    # Unknown keys are found here, not by pydantic alone, so that every unknown key of every nested block
    # is named in one error, and a non-string key does not raise TypeError.
    unknown = unknown_keys(ACCOConfig, block, "acco")
    if unknown:
        raise ValueError("Invalid \"acco\" block in the DeepSpeed config:\n  " + "\n  ".join(unknown))
    try:
        return ACCOConfig(**block)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            # a list item is named by its key and position: "acco.compression.apply_to" (item 0)
            names = ".".join(["acco", *(str(p) for p in e["loc"] if not isinstance(p, int))])
            where = f'"{names}"' + "".join(f" (item {p})" for p in e["loc"] if isinstance(p, int))
            if e["type"] == "extra_forbidden":
                known = ", ".join(ACCOConfig.model_fields)
                lines.append(f'unknown key {where} (misspelled?). Known keys: {known}')
            else:
                hint = (": write true or false (a JSON boolean)" if e["type"].startswith("bool") else
                        ": write a whole number such as 4 (a JSON integer, not a string, a float or a boolean)"
                        if e["type"].startswith("int") else "")
                lines.append(f'{where}: {e["msg"]} (got {e.get("input")!r}){hint}')
        raise ValueError("Invalid \"acco\" block in the DeepSpeed config:\n  " + "\n  ".join(lines)) from None


def check_deepspeed_config(acco: ACCOConfig, ds_config, layout, *, client_optimizer: bool = False) -> None:
    """Reject DeepSpeed settings that ACCO cannot run with, and every refusal of the rulebook on ``layout``
    (``acco_ds.config.rulebook.Layout``), naming the fix.

    ``ds_config`` is DeepSpeed's parsed ``DeepSpeedConfig``; called before the
    engine builds its optimizer (the host first checks that DeepSpeed set every attribute read here:
    ``acco_ds.deepspeed.compat.check_instance``). The rules on DeepSpeed's own keys live here.
    """
    problems = []
    stage = int(ds_config.zero_optimization_stage)
    if stage != 1:
        problems.append(f'ACCO shards optimizer states like ZeRO stage 1, but zero_optimization.stage is {stage}: '
                        f'set "zero_optimization": {{"stage": 1}}')
    problems += refusals(acco, layout)
    zc = ds_config.zero_config
    if zc.offload_optimizer is not None and getattr(zc.offload_optimizer.device, "value", zc.offload_optimizer.device) != "none":
        problems.append("zero_optimization.offload_optimizer is not supported by ACCO (the optimizer runs on the "
                        "communication side thread): remove offload_optimizer")
    if zc.zenflow is not None:
        problems.append("ZenFlow and ACCO both replace the ZeRO-1 update: remove zero_optimization.zenflow")
    if not ds_config.managed_gradient_accumulation:
        problems.append("ACCO drives gradient accumulation itself: remove managed_gradient_accumulation=false "
                        "from the DeepSpeed config")
    if not client_optimizer and ds_config.optimizer_name is None:
        problems.append('ACCO needs an optimizer: add "optimizer": {"type": "AdamW", "params": {...}} to the '
                        'DeepSpeed config or pass optimizer= to initialize')
    problems += _muon_rules(acco, ds_config, layout)
    if problems:
        raise ValueError("ACCO cannot run with this DeepSpeed config:\n  - " + "\n  - ".join(problems))


def _muon_rules(acco: ACCOConfig, ds_config, layout) -> list:
    """Muon (``acco_ds.runtime.outer.inner_muon``) is the inner optimizer of a local-SGD mode whose replica is
    one rank: its inner step needs every weight matrix whole, and it has no Peek."""
    if str(ds_config.optimizer_name).lower() != "muon":
        return []
    out = []
    if acco.mode not in LOCAL_SGD_MODES or acco.mode == "decoupled":
        out.append(f'optimizer "Muon" runs as the inner optimizer of diloco, co2, edit and sparseloco, not in mode '
                   f'"{acco.mode}": use "AdamW" there, or set "acco": {{"mode": "diloco", ...}}')
    elif replica_group_size(acco, layout) != 1:
        out.append(f'optimizer "Muon" needs every weight matrix whole on its rank, but a replica is '
                   f'{replica_group_size(acco, layout)} ranks whose ZeRO-1 partitions cut the matrices: set '
                   f'"local_sgd": {{"replica_group_size": 1}}')
    if (ds_config.optimizer_params or {}).get("per_head_muon"):
        out.append('per_head_muon is not supported by acco_ds\'s Muon (each matrix is orthogonalized whole): '
                   'remove "per_head_muon" from the optimizer params')
    return out


def checkpoint_mismatch(what: str, saved, now, replicas: bool = False) -> ValueError:
    """The error for resuming an ACCO checkpoint under a different ``what`` (data-parallel world size,
    gradient_accumulation_steps, replica layout). Round modes: the in-flight rounds are per rank and hold
    that many micro-batches. ``replicas`` (local-SGD modes): each rank's replica state and the outer state
    are sharded over the replica group."""
    weights_only = "load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False)"
    reshard = ("another world size or replica_group_size is resharded when the whole checkpoint folder is "
               "loaded (engine.load_checkpoint, acco_ds.torch.load)")
    if replicas:
        return ValueError(
            f"this local-SGD checkpoint was saved with {what}={saved} but this run has {now}. It holds, per rank, "
            f"that rank's replica (its weights and its shard of the inner optimizer state, split over the "
            f"replica_group_size ranks of its replica), the outer state (anchor, outer momentum) sharded the same "
            f"way, and the position in the period. Resume with {what}={saved} ({reshard}), or load only the module "
            f"weights, which are the committed global model ({weights_only}); the inner and outer optimizer states "
            f"then start afresh")
    return ValueError(f"this ACCO checkpoint was saved with {what}={saved} but this run has {now}: its in-flight "
                      f"gradients are per rank and per round. Resume with {what}={saved} ({reshard}), or load only "
                      f"the module weights ({weights_only})")


__all__ = ["ACCO_KEY", "ACCOConfig", "parse_acco_config", "check_deepspeed_config", "MOE_MODES", "checkpoint_mismatch"]
