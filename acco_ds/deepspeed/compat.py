"""Every DeepSpeed internal acco_ds relies on, named once and checked at start-up.

DeepSpeed has no extension API for a ZeRO optimizer or an engine: ACCO
subclasses ``DeepSpeedEngine`` and ``DeepSpeedZeroOptimizer``, overrides some
of their private methods and reads attributes their constructors set. A
release that renames one of these would otherwise fail deep inside a training
run (an ``AttributeError`` in a backward hook, a checkpoint written under the
wrong name). Here each such name is listed with the reason acco_ds needs it,
and checked:

* module-level names (classes, functions, constants) when this module is
  imported, which every DeepSpeed-facing module of acco_ds does first: they
  import these names from here, never from ``deepspeed`` directly;
* methods acco_ds overrides or calls, with the parameters it passes, on the
  classes, at the same time;
* instance attributes on the built engine, optimizer and config
  (``check_instance``), right after DeepSpeed's constructor ran.

A missing or changed name raises ``DeepSpeedIncompatible``, which names it,
says what acco_ds needs it for, and gives the DeepSpeed range acco_ds is
tested with (``SUPPORTED``). A DeepSpeed outside that range that still has
every name is used, after one warning.

No other module of acco_ds imports ``deepspeed`` (``tests/test_compat.py``
checks this, and that every DeepSpeed attribute the glue touches is listed).
"""

import importlib
import inspect
import logging
import warnings
from typing import Dict, Iterable, Optional, Tuple

SUPPORTED = ">=0.19,<0.20"
_LOW, _HIGH = (0, 19), (0, 20)

_log = logging.getLogger("acco_ds")


class DeepSpeedIncompatible(RuntimeError):
    """The installed DeepSpeed lacks (or changed) an internal acco_ds relies on."""


def package():
    """The public ``deepspeed`` package. A function, defined before anything here imports DeepSpeed:
    the autopatch hook patches ``deepspeed.initialize`` while ``deepspeed`` is first imported, which may
    be from this module's own import below."""
    import deepspeed
    return deepspeed


def comm_torch():
    """``deepspeed.comm.torch``, whose ``build_shm_op`` ``patch()`` wraps (see ``package``)."""
    return importlib.import_module("deepspeed.comm.torch")


def _incompatible(name: str, why: str, problem: str) -> DeepSpeedIncompatible:
    import deepspeed
    version = getattr(deepspeed, "__version__", "unknown")
    return DeepSpeedIncompatible(
        f"acco_ds cannot run on DeepSpeed {version}: {name} {problem}. acco_ds uses it {why}. acco_ds is "
        f"tested with deepspeed{SUPPORTED}: install a DeepSpeed in that range "
        f"(pip install 'deepspeed{SUPPORTED}')")


# ---------------------------------------------------------------- module-level names
# (module, name, why). Each is imported here and re-exported under its own name.
IMPORTS: Tuple[Tuple[str, str, str], ...] = (
    ("deepspeed", "initialize", "as the function acco_ds.patch() wraps"),
    ("deepspeed", "DeepSpeedEngine", "as the name deepspeed.initialize instantiates (swapped for ACCOEngine "
     "during the call)"),
    ("deepspeed", "PipelineEngine", "as the name deepspeed.initialize instantiates for a PipelineModule"),
    ("deepspeed", "comm", "for the data-parallel rank of checkpoint file names (deepspeed.comm)"),
    ("deepspeed.utils", "logger", "for log lines in DeepSpeed's format"),
    ("deepspeed.utils", "log_dist", "for rank-0 log lines"),
    ("deepspeed.accelerator", "get_accelerator", "to build DeepSpeed's own CPU op under a bounded lock"),
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "as the base class of ACCOEngine"),
    ("deepspeed.runtime.engine", "DeepSpeedZeroOptimizer", "as the module-level name _configure_zero_optimizer "
     "instantiates (swapped for ACCOZeroOptimizer during the call)"),
    ("deepspeed.runtime.engine", "BFLOAT16", "to keep bf16 + fp32 accumulation on ZeRO-1 (stock sends it to "
     "BF16_Optimizer)"),
    ("deepspeed.runtime.engine", "ZERO_OPTIMIZATION", "as the optimizer kind ZeRO-1 is built from"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine", "as the base class of ACCOPipelineEngine"),
    ("deepspeed.runtime.pipe", "schedule", "for the pipeline schedule's instructions the rounds follow "
     "(TrainSchedule, BackwardPass, ReduceTiedGrads, ReduceGrads, OptimizerStep)"),
    ("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer", "as the base class of the ACCO "
     "ZeRO-1 optimizer"),
    ("deepspeed.runtime.zero.utils", "ZeRORuntimeException", "to recognise ZeRO's own checkpoint errors"),
    *(("deepspeed.checkpoint.constants", key, "to read and write ZeRO checkpoint files (a resharding load)")
      for key in ("OPTIMIZER_STATE_DICT", "BASE_OPTIMIZER_STATE", "SINGLE_PARTITION_OF_FP32_GROUPS", "GROUP_PADDINGS",
                  "PARAM_ALIGNMENT_PADDINGS", "PARTITION_COUNT", "PARAM_SLICE_MAPPINGS")),
    *((module, name, "as a plain data type a ZeRO checkpoint file holds, built by a resharding load's safe "
       "torch.load(weights_only=True)") for module, name in (
        ("deepspeed.runtime.zero.config", "ZeroStageEnum"), ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
        ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
        ("deepspeed.utils.tensor_fragment", "fragment_address"))),
    ("deepspeed.runtime.tensor_parallel.init_utils", "load_ds_config", "to read the config from any place "
     "deepspeed.initialize accepts it"),
    ("deepspeed.runtime.utils", "is_model_parallel_parameter", "to tell tensor-parallel slices from "
     "replicated parameters"),
    ("deepspeed.runtime.config", "DeepSpeedConfig", "to check acco-ds plan's --config as DeepSpeed would"),
    ("deepspeed.moe.utils", "has_moe_layers", "to refuse MoE models before anything is built"),
    ("deepspeed.pipe", "PipelineModule", "to tell pipeline models apart before anything is built"),
    ("deepspeed.ops.adam", "FusedAdam", "to run the fused Peek for DeepSpeed's own Adam"),
    ("deepspeed.ops.op_builder.builder", "OpBuilder", "as the base of the native op builders"),
    ("deepspeed.ops.op_builder.builder", "CUDAOpBuilder", "as the base of the CUDA op builder"),
    ("deepspeed.ops.op_builder.cpu.builder", "CPUOpBuilder", "as the base of the CPU op builder"),
    ("deepspeed.comm.torch", "build_shm_op", "to bound DeepSpeed's own CPU op build (patch() wraps it, "
     "unpatch() restores it)"),
    ("deepspeed.env_report", "main", "for `acco-ds report --deepspeed`"),
)

# (class, method, parameters acco_ds passes or receives after self (None: not checked), why)
METHODS: Tuple[Tuple[str, str, Optional[Tuple[str, ...]], str], ...] = (
    ("DeepSpeedEngine", "_configure_zero_optimizer", ("optimizer",), "overridden to build the ACCO optimizer"),
    ("DeepSpeedEngine", "_do_optimizer_sanity_check", ("basic_optimizer",), "overridden to keep bf16 on ZeRO-1"),
    ("DeepSpeedEngine", "_backward_epilogue", (), "overridden: rounds end after a backward"),
    ("DeepSpeedEngine", "_take_model_step", ("lr_kwargs",), "overridden: updates happen when rounds end"),
    ("DeepSpeedEngine", "allreduce_gradients", ("bucket_size",), "overridden: gradients travel in rounds"),
    ("DeepSpeedEngine", "_get_zero_ckpt_name", ("checkpoints_path", "tag"), "overridden: files named by "
     "data-parallel rank under an outer loop"),
    ("DeepSpeedEngine", "_get_all_zero_checkpoint_names", ("load_dir", "tag", "bf16_mode"), "overridden: a "
     "replica reads its own ranks' files"),
    ("DeepSpeedEngine", "_get_rank_zero_ckpt_name", ("checkpoints_path", "tag", "mp_rank", "dp_rank",
                                                      "bf16_mode"), "to name a rank's ZeRO checkpoint file"),
    ("DeepSpeedEngine", "_load_zero_checkpoint", ("load_dir", "tag", "load_optimizer_states"), "overridden: a "
     "checkpoint of another data-parallel size or replica layout is resharded"),
    ("DeepSpeedEngine", "load_universal_checkpoint", (), "to leave universal checkpoints to DeepSpeed's own load"),
    ("DeepSpeedEngine", "zero_load_from_fp32_weights", (), "to load a resharded checkpoint as stock would"),
    ("DeepSpeedEngine", "_stop_timers", ("timer_names",), "to keep DeepSpeed's backward timers"),
    ("DeepSpeedEngine", "_report_progress", ("step",), "for DeepSpeed's progress line"),
    ("DeepSpeedEngine", "set_train_batch_size", ("train_batch_size",), "overridden: rounds follow the new size"),
    ("DeepSpeedEngine", "save_checkpoint", ("save_dir",), "overridden to add ACCO's state"),
    ("DeepSpeedEngine", "load_checkpoint", ("load_dir",), "overridden to restore ACCO's state"),
    ("DeepSpeedEngine", "bfloat16_enabled", (), "to name bf16 checkpoint files"),
    ("DeepSpeedEngine", "zero_optimization_stage", (), "to check ZeRO stage 1"),
    ("DeepSpeedEngine", "train_batch_size", (), "for the per-step sample count"),
    ("DeepSpeedEngine", "train_micro_batch_size_per_gpu", (), "for the per-micro-batch sample count"),
    ("DeepSpeedEngine", "destroy", (), "overridden to finalize and close ACCO's threads"),
    ("DeepSpeedZeroOptimizer", "create_gradient_handling_hooks", (), "overridden: gradients go to ACCO's "
     "accumulator"),
    ("DeepSpeedZeroOptimizer", "backward_epilogue", None, "overridden: no stock gradient reduction"),
    ("DeepSpeedZeroOptimizer", "exit_backward", (), "called after each backward, as stock does"),
    ("DeepSpeedZeroOptimizer", "_restore_from_bit16_weights", (), "overridden: a weights-only load restarts "
     "rounds and the outer loop"),
    ("DeepSpeedZeroOptimizer", "_lazy_init_hp_params_optimizer_state", (), "after the first committed update, "
     "as stock step() does"),
    ("DeepSpeedZeroOptimizer", "state_dict", (), "extended with ACCO's state"),
    ("DeepSpeedZeroOptimizer", "load_state_dict", ("state_dict_list", "load_optimizer_states",
                                                   "load_from_fp32_weights", "checkpoint_folder"),
     "extended to restore ACCO's state"),
    ("DeepSpeedZeroOptimizer", "destroy", (), "extended to close ACCO's threads"),
    ("DeepSpeedZeroOptimizer", "loss_scale", None, "the current loss scale (a property)"),
    ("PipelineEngine", "_INSTRUCTION_MAP", None, "extended: rounds follow the schedule's backward passes and "
     "reductions (the map holds plain functions, so a subclass method would not be called)"),
    ("PipelineEngine", "_train_schedule", (), "overridden: acco runs two pipeline flushes per step"),
    ("PipelineEngine", "_exec_backward_pass", ("buffer_id",), "wrapped: beyond one stage every stage counts a "
     "micro-batch after its backward"),
    ("PipelineEngine", "_exec_reduce_tied_grads", (), "replaced beyond one stage: tied gradients are summed in "
     "ACCO's accumulator"),
    ("PipelineEngine", "_exec_reduce_grads", (), "replaced beyond one stage: the round ends there"),
    ("TrainSchedule", "num_pipe_buffers", (), "the schedule interface TwoFlushSchedule implements"),
    ("PipelineEngine", "is_last_stage", (), "the loss stage"),
    ("PipelineModule", "get_tied_weights_and_groups", (), "the tied weights whose gradients ACCO sums across "
     "stages"),
    ("OpBuilder", "_loaded_ops", None, "to share loaded ops with DeepSpeed's cache"),
    ("OpBuilder", "jit_load", ("verbose",), "to JIT-build the native ops"),
    ("OpBuilder", "absolute_name", (), "overridden: the AOT module's name"),
    ("OpBuilder", "include_paths", (), "overridden: csrc/"),
    ("OpBuilder", "sources", (), "overridden: csrc/ sources"),
    ("CPUOpBuilder", "cxx_args", (), "extended: exact-rounding flags"),
    ("CUDAOpBuilder", "nvcc_args", (), "filtered: no --use_fast_math"),
    ("CUDAOpBuilder", "is_compatible", ("verbose",), "extended: no CUDA build without a GPU unless asked"),
)

from .attributes import INSTANCE_ATTRIBUTES  # noqa: E402 - the attribute list, checked below


def _installed_version() -> Tuple[int, int]:
    import deepspeed
    parts = str(getattr(deepspeed, "__version__", "0.0")).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


def _resolve(module: str, name: str, why: str):
    try:
        mod = importlib.import_module(module)
    except ImportError as err:
        raise _incompatible(f"module {module}", why, f"cannot be imported ({err})") from err
    if not hasattr(mod, name):
        raise _incompatible(f"{module}.{name}", why, "does not exist")
    return getattr(mod, name)


def _check_method(cls, name: str, params: Optional[Tuple[str, ...]], why: str) -> None:
    qualified = f"{cls.__name__}.{name}"
    if not hasattr(cls, name):
        raise _incompatible(qualified, why, "does not exist")
    if params is None:
        return
    member = getattr(cls, name)
    try:
        signature = inspect.signature(member)
    except (TypeError, ValueError):
        return  # a builtin: nothing to compare
    if any(p.kind == p.VAR_POSITIONAL for p in signature.parameters.values()) and \
            len(signature.parameters) <= 2:
        return  # a decorator's (*args, **kwargs) wrapper: nothing to compare
    have = [p.name for p in signature.parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][1:]  # after self
    if tuple(have[:len(params)]) != tuple(params):
        raise _incompatible(qualified, why, f"takes ({', '.join(have)}) where acco_ds passes "
                            f"({', '.join(params)})")


def defer_muon_compile() -> None:
    """DeepSpeed's Muon module applies ``torch.compile`` to three functions when it is imported, and ZeRO's
    optimizer checks import it whatever the optimizer: ``torch._dynamo``'s import (~2.4 s CPU) on every rank.
    Compile them on first call instead (``acco_ds._lazy_dynamo``). Only before that module is imported, and only
    while ``runtime.compiler.compile()`` still takes no argument (the decorator factory it uses)."""
    from .._lazy_dynamo import compile_on_first_call, imported
    if imported("deepspeed.runtime.zero.muon.original_muon"):
        return
    from deepspeed.runtime import compiler
    if getattr(getattr(compiler, "compile", None), "__code__", None) is not None and \
            compiler.compile.__code__.co_argcount == 0:
        compiler.compile = lambda: compile_on_first_call


def mend_autoep_recorder_registry() -> None:
    """DeepSpeed 0.19's AutoEP presets (``module_inject/auto_ep_presets/base.py``) call ``registry.get(key,
    default)`` on transformers' output-recorder registry (``transformers.utils.output_capturing``), whose
    ``get`` takes no default from transformers 5.24 on: every AutoEP ``initialize`` raises ``TypeError``. Give
    that ``get`` an optional default for string keys, only on DeepSpeed 0.19 and only where the call fails;
    idempotent. Called by ``initialize`` for a config whose ``expert_parallel`` block is enabled."""
    if not getattr(package(), "__version__", "").startswith("0.19."):
        return
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return
    registry = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry is None or getattr(registry.get, "_acco_mend", False):
        return
    original = registry.get
    try:
        original(registry(), "key", None)
        return  # this transformers takes the default: nothing to mend
    except TypeError:
        pass

    def get(self, key, *default):
        return dict.get(self, key, *default) if isinstance(key, str) else original(self, key)
    get._acco_mend = True
    registry.get = get


def check_deepspeed() -> Dict[str, object]:
    """Resolve every listed module-level name and method; returns the names.
    Raises ``DeepSpeedIncompatible`` naming the first one missing or changed."""
    resolved: Dict[Tuple[str, str], object] = {}
    for module, name, why in IMPORTS:
        resolved[(module, name)] = _resolve(module, name, why)
    classes = {
        "DeepSpeedEngine": resolved[("deepspeed.runtime.engine", "DeepSpeedEngine")],
        "DeepSpeedZeroOptimizer": resolved[("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")],
        "OpBuilder": resolved[("deepspeed.ops.op_builder.builder", "OpBuilder")],
        "CPUOpBuilder": resolved[("deepspeed.ops.op_builder.cpu.builder", "CPUOpBuilder")],
        "CUDAOpBuilder": resolved[("deepspeed.ops.op_builder.builder", "CUDAOpBuilder")],
        "PipelineEngine": resolved[("deepspeed.runtime.pipe.engine", "PipelineEngine")],
        "PipelineModule": resolved[("deepspeed.pipe", "PipelineModule")],
        "TrainSchedule": resolved[("deepspeed.runtime.pipe", "schedule")].TrainSchedule,
    }
    for owner, name, params, why in METHODS:
        _check_method(classes[owner], name, params, why)
    if not _LOW <= _installed_version() < _HIGH:
        import deepspeed
        warnings.warn(f"acco_ds is tested with deepspeed{SUPPORTED}; DeepSpeed {deepspeed.__version__} has "
                      "every internal acco_ds uses, so it runs, untested", RuntimeWarning, stacklevel=2)
    return resolved


def check_instance(obj, kind: str, names: Optional[Iterable[str]] = None) -> None:
    """Check that a built DeepSpeed object (``kind`` in ``INSTANCE_ATTRIBUTES``)
    has the attributes acco_ds reads (all of them, or ``names``)."""
    wanted = set(names) if names is not None else None
    for name, why in INSTANCE_ATTRIBUTES[kind]:
        if (wanted is None or name in wanted) and not hasattr(obj, name):
            raise _incompatible(f"{kind}.{name}", f"for {why}", "is not set by its constructor")


_resolved = check_deepspeed()

comm = _resolved[("deepspeed", "comm")]
logger = _resolved[("deepspeed.utils", "logger")]
log_dist = _resolved[("deepspeed.utils", "log_dist")]
get_accelerator = _resolved[("deepspeed.accelerator", "get_accelerator")]
ds_engine = importlib.import_module("deepspeed.runtime.engine")  # module whose DeepSpeedZeroOptimizer is swapped
DeepSpeedEngine = _resolved[("deepspeed.runtime.engine", "DeepSpeedEngine")]
BFLOAT16 = _resolved[("deepspeed.runtime.engine", "BFLOAT16")]
ZERO_OPTIMIZATION = _resolved[("deepspeed.runtime.engine", "ZERO_OPTIMIZATION")]
PipelineEngine = _resolved[("deepspeed.runtime.pipe.engine", "PipelineEngine")]
pipe_schedule = _resolved[("deepspeed.runtime.pipe", "schedule")]
DeepSpeedZeroOptimizer = _resolved[("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer")]
ZeRORuntimeException = _resolved[("deepspeed.runtime.zero.utils", "ZeRORuntimeException")]
(OPTIMIZER_STATE_DICT, BASE_OPTIMIZER_STATE, SINGLE_PARTITION_OF_FP32_GROUPS, GROUP_PADDINGS, PARAM_ALIGNMENT_PADDINGS,
 PARTITION_COUNT, PARAM_SLICE_MAPPINGS) = (_resolved[(m, k)] for m, k, _ in IMPORTS if m == "deepspeed.checkpoint.constants")
ZERO_FILE_TYPES = tuple(_resolved[(m, k)] for m, k, why in IMPORTS if why.startswith("as a plain data type"))
load_ds_config = _resolved[("deepspeed.runtime.tensor_parallel.init_utils", "load_ds_config")]
is_model_parallel_parameter = _resolved[("deepspeed.runtime.utils", "is_model_parallel_parameter")]
DeepSpeedConfig = _resolved[("deepspeed.runtime.config", "DeepSpeedConfig")]
has_moe_layers = _resolved[("deepspeed.moe.utils", "has_moe_layers")]
PipelineModule = _resolved[("deepspeed.pipe", "PipelineModule")]
FusedAdam = _resolved[("deepspeed.ops.adam", "FusedAdam")]
OpBuilder = _resolved[("deepspeed.ops.op_builder.builder", "OpBuilder")]
CUDAOpBuilder = _resolved[("deepspeed.ops.op_builder.builder", "CUDAOpBuilder")]
CPUOpBuilder = _resolved[("deepspeed.ops.op_builder.cpu.builder", "CPUOpBuilder")]
env_report = _resolved[("deepspeed.env_report", "main")]


def fused_adamw(optimizer) -> Optional[bool]:
    """None unless ``optimizer`` is DeepSpeed's ``FusedAdam``; then whether it runs in AdamW mode
    (its ``adam_w_mode``), for the runtime's fused Peek (``runtime.rounds.update``)."""
    if type(optimizer) is not FusedAdam:
        return None
    if not hasattr(optimizer, "adam_w_mode"):
        raise _incompatible("FusedAdam.adam_w_mode", "to tell Adam from AdamW in the fused Peek",
                            "is not set by its constructor")
    return bool(optimizer.adam_w_mode)
