"""The ``"acco"`` block of a DeepSpeed JSON config.

Example::

    "acco": {"enabled": true, "mode": "acco", "accumulation": "fixed"}

The model follows DeepSpeed's own config models (``runtime/zero/config.py``):
a ``DeepSpeedConfigModel`` (pydantic 2, unknown keys rejected, ``"auto"``
treated as "use the default"), one documented field per key.
"""

from typing import Literal, Optional

import torch
from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, StrictBool, ValidationError, model_validator

ACCO_KEY = "acco"


class _Documented(DeepSpeedConfigModel):
    """A config model whose field docstrings become the fields' descriptions."""
    model_config = ConfigDict(use_attribute_docstrings=True)


class ACCOEmulationConfig(_Documented):
    """Benchmark and test hooks that emulate a slow network or slow workers.

    Never use these for real training: they only add sleeps. Every benchmark
    row that uses them says so.
    """

    comm_delay_s: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    """Extra seconds the communication side sleeps in every round before it
    starts, on every rank (emulates a slow network)."""

    slow_rank: int = -1
    """Data-parallel rank whose compute is slowed (-1: none)."""

    slow_factor: float = Field(1.0, ge=1.0, allow_inf_nan=False)
    """On ``slow_rank``, every micro-batch takes this many times as long: after
    each backward the rank sleeps ``(slow_factor - 1) x`` the measured time of
    that forward+backward."""


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

    mode: Literal["acco", "dpu", "sync"] = "acco"
    """``acco``: two rounds per optimizer step, the first estimates the next
    parameters with a Peek of the optimizer (delay compensation), the second
    commits; communication of each half-batch hides behind the compute of the
    next. ``dpu``: delayed parameter update, the paper's baseline: the step uses
    the gradient of the previous batch. ``sync``: plain ZeRO-1 (no overlap),
    for A/B comparisons; numerically equal to stock DeepSpeed ZeRO-1."""

    accumulation: Literal["fixed", "adaptive"] = "fixed"
    """``fixed``: every round accumulates exactly its configured number of
    micro-batches (``gradient_accumulation_steps / 2`` in ``acco`` mode,
    ``gradient_accumulation_steps`` otherwise) and waits for the communication
    if it is slower; deterministic. ``adaptive``: that number is a minimum;
    while the round's communication is still in flight the worker keeps
    accumulating, up to ``max_micro_batches_per_round``. Each worker's count is
    reduced with its gradients, so the gradient stays the exact mean over all
    micro-batches."""

    max_micro_batches_per_round: Optional[int] = Field(None, ge=1)
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

    emulation: ACCOEmulationConfig = Field(default_factory=ACCOEmulationConfig)
    """Benchmark/test only: see ``ACCOEmulationConfig``."""

    @model_validator(mode="after")
    def _check_adaptive(self):
        if self.mode == "sync" and self.accumulation == "adaptive":
            raise ValueError('acco.accumulation="adaptive" needs an overlapping mode: '
                             'set acco.mode to "acco" or "dpu", or use accumulation="fixed" with mode="sync"')
        return self

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


def _unknown_keys(model, block: dict, prefix: str) -> list:
    """One message per key of ``block`` (and of its nested config objects) that ``model`` does not know."""
    lines = []
    for key, value in block.items():
        field = model.model_fields.get(key) if isinstance(key, str) else None
        if field is None:
            known = ", ".join(model.model_fields)
            lines.append(f'unknown key "{prefix}.{key}" (misspelled?). Known keys: {known}')
        elif isinstance(value, dict) and isinstance(field.annotation, type) \
                and issubclass(field.annotation, DeepSpeedConfigModel):
            lines += _unknown_keys(field.annotation, value, f"{prefix}.{key}")
    return lines


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
    # Unknown keys are found here, not by pydantic alone: DeepSpeedConfigModel drops every key whose
    # value is "auto" before validation and takes a key "strict" as its own argument, so both would
    # slip through, and a non-string key would raise TypeError.
    unknown = _unknown_keys(ACCOConfig, block, "acco")
    if unknown:
        raise ValueError("Invalid \"acco\" block in the DeepSpeed config:\n  " + "\n  ".join(unknown))
    try:
        return ACCOConfig(**block)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            key = "acco." + ".".join(str(p) for p in e["loc"]) if e["loc"] else "acco"
            if e["type"] == "extra_forbidden":
                known = ", ".join(ACCOConfig.model_fields)
                lines.append(f'unknown key "{key}" (misspelled?). Known keys: {known}')
            else:
                hint = ": write true or false (a JSON boolean)" if e["type"].startswith("bool") else ""
                lines.append(f'"{key}": {e["msg"]} (got {e.get("input")!r}){hint}')
        raise ValueError("Invalid \"acco\" block in the DeepSpeed config:\n  " + "\n  ".join(lines)) from None


def check_before_initialize(model, mpu=None, ds_config: Optional[dict] = None) -> None:
    """Reject what ACCO cannot train before ``deepspeed.initialize`` builds
    anything: engines other than ``DeepSpeedEngine`` (pipeline, hybrid),
    MoE, model parallelism."""
    from deepspeed.moe.utils import has_moe_layers
    from deepspeed.pipe import PipelineModule
    problems = []
    if ((ds_config or {}).get("hybrid_engine") or {}).get("enabled"):
        problems.append('the hybrid engine is not supported by ACCO: set "hybrid_engine": {"enabled": false} or '
                        '"acco": {"enabled": false}')
    if isinstance(model, PipelineModule):
        problems.append("pipeline parallelism (the model is a PipelineModule, DeepSpeed's PipelineEngine) is not "
                        "supported by ACCO: build the model without PipelineModule (Megatron-DeepSpeed: pass "
                        '--no-pipeline-parallel), or set "acco": {"enabled": false}')
    if isinstance(model, torch.nn.Module) and has_moe_layers(model)[0]:
        problems.append('ACCO does not support MoE layers (expert parallel groups): train without MoE or set '
                        '"acco": {"enabled": false}')
    if mpu is not None and mpu.get_model_parallel_world_size() > 1:
        problems.append(f"ACCO does not support tensor/model parallelism yet (model parallel size "
                        f"{mpu.get_model_parallel_world_size()}): use a model parallel size of 1 (Megatron-DeepSpeed: "
                        f'--tensor-model-parallel-size 1), or set "acco": {{"enabled": false}}')
    _raise(problems)


def check_deepspeed_config(acco: ACCOConfig, ds_config, *, client_optimizer: bool = False) -> None:
    """Reject DeepSpeed settings that ACCO cannot run with, naming the fix.

    ``ds_config`` is DeepSpeed's parsed ``DeepSpeedConfig``; called before the
    engine builds its optimizer. Every rule of that kind lives here.
    """
    problems = []
    stage = int(ds_config.zero_optimization_stage)
    if stage != 1:
        problems.append(f'ACCO shards optimizer states like ZeRO stage 1, but zero_optimization.stage is {stage}: '
                        f'set "zero_optimization": {{"stage": 1}}')
    gas = ds_config.gradient_accumulation_steps
    if acco.mode == "acco" and gas % 2 != 0:
        problems.append(f'acco.mode="acco" splits every optimizer step into two rounds of '
                        f'gradient_accumulation_steps/2 micro-batches, so gradient_accumulation_steps must be even '
                        f'(got {gas}): set it to {gas + 1 if gas > 1 else 2} or use acco.mode="dpu"/"sync"')
    if acco.accumulation == "adaptive":
        low = acco.micro_batches_per_round(gas)
        high = acco.max_micro_batches(gas)
        if high < low:
            problems.append(f"acco.max_micro_batches_per_round ({high}) is below the minimum of {low} micro-batches "
                            f"per round implied by gradient_accumulation_steps={gas}: raise it to at least {low}")
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
    _raise(problems)


def _raise(problems) -> None:
    if problems:
        raise ValueError("ACCO cannot run with this DeepSpeed config:\n  - " + "\n  - ".join(problems))


def checkpoint_mismatch(what: str, saved, now) -> ValueError:
    """The error for resuming an ACCO checkpoint under a different ``what``
    (data-parallel world size, gradient_accumulation_steps): its in-flight
    rounds are per rank and hold that many micro-batches."""
    return ValueError(f"this ACCO checkpoint was saved with {what}={saved} but this run has {now}: its in-flight "
                      f"gradients are per rank and per round. Resume with {what}={saved}, or load only the module "
                      f"weights (load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False))")
