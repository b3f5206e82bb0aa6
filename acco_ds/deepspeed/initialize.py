"""``deepspeed.initialize`` with ACCO: the engine swap and the patch.

``deepspeed.initialize`` has no engine registry: it instantiates the
module-level name ``DeepSpeedEngine`` (``PipelineEngine`` for a
``PipelineModule``). Swapping those names for ``ACCOEngine`` and
``ACCOPipelineEngine`` during the call reuses all of initialize's logic for every caller (plain
scripts, Hugging Face Trainer/Accelerate, Megatron-DeepSpeed).
"""

import contextlib
import inspect
import logging
import os
import threading

logger = logging.getLogger("acco_ds")

_lock = threading.RLock()
_original_initialize = None  # deepspeed.initialize before patch()


def resolve_config(args, config, config_params) -> dict:
    """The DeepSpeed config as a dict, from any of the places initialize accepts it."""
    from .compat import load_ds_config
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    return load_ds_config(config)


@contextlib.contextmanager
def _acco_engine_class():
    from .compat import package
    deepspeed = package()
    from .engine import ACCOEngine
    from .pipeline import ACCOPipelineEngine
    with _lock:
        saved = deepspeed.DeepSpeedEngine, deepspeed.PipelineEngine
        deepspeed.DeepSpeedEngine, deepspeed.PipelineEngine = ACCOEngine, ACCOPipelineEngine
        try:
            yield
        finally:
            deepspeed.DeepSpeedEngine, deepspeed.PipelineEngine = saved


def check_before_initialize(model, mpu=None, ds_config=None, acco=None) -> None:
    """Reject what ACCO cannot train before ``deepspeed.initialize`` builds anything: the rulebook
    (``acco_ds.config.rulebook``) judges the block on the layout DeepSpeed's classes tell (pipeline stages,
    tensor-parallel size, MoE layers, the sequence-parallel size of the config or the ``mpu``)."""
    from ..config.rulebook import check
    from .compat import PipelineModule, check_instance
    from .layout import launch_layout
    if isinstance(model, PipelineModule):
        check_instance(model, "PipelineModule")
    check(acco, launch_layout(model, mpu, ds_config), ds_config)


def initialize_with(ds_initialize, args=None, model=None, *rest, **kwargs):
    """Call ``ds_initialize`` (the original ``deepspeed.initialize``), with the
    ACCO engine when the config enables it."""
    from ..config import parse_acco_config  # lazy: the autopatch runs inside `import deepspeed`
    config = resolve_config(args, kwargs.get("config"), kwargs.get("config_params"))
    if (config.get("expert_parallel") or {}).get("enabled"):
        from .compat import mend_autoep_recorder_registry
        mend_autoep_recorder_registry()  # stock DeepSpeed's AutoEP with transformers >= 5.24
    acco = parse_acco_config(config)
    if not acco.enabled:
        return ds_initialize(args, model, *rest, **kwargs)
    try:
        mpu = inspect.signature(ds_initialize).bind_partial(args, model, *rest, **kwargs).arguments.get("mpu")
    except TypeError:
        mpu = kwargs.get("mpu")
    check_before_initialize(model, mpu, config, acco)
    from .._lazy_dynamo import defer_optimizer
    from .compat import defer_muon_compile
    defer_optimizer()  # the optimizer DeepSpeed builds and ZeRO's checks would import torch._dynamo (~2.4 s CPU)
    defer_muon_compile()
    with _acco_engine_class():
        return ds_initialize(args, model, *rest, **kwargs)


def original_initialize():
    from .compat import package
    deepspeed = package()
    return _original_initialize or deepspeed.initialize


def patch() -> None:
    """Route every later ``deepspeed.initialize`` call through ACCO (idempotent)."""
    from .compat import package
    deepspeed = package()
    global _original_initialize
    with _lock:
        if _original_initialize is not None:
            return
        _original_initialize = deepspeed.initialize

        def initialize_with_acco(args=None, model=None, *rest, **kwargs):
            return initialize_with(_original_initialize, args, model, *rest, **kwargs)

        initialize_with_acco.__doc__ = _original_initialize.__doc__
        initialize_with_acco.__wrapped__ = _original_initialize
        initialize_with_acco._acco_patch = True
        deepspeed.initialize = initialize_with_acco
        try:  # DeepSpeed's own CPU op build must not hang a start either
            guard_deepspeed_shm_op()
        except Exception:  # noqa: BLE001 - a DeepSpeed without that op: nothing to guard
            pass


def guard_deepspeed_shm_op() -> None:
    """Make DeepSpeed's own CPU op build unable to hang, like ours.

    DeepSpeed's CPU backend JIT-builds its shared-memory collective op in every
    process that initializes ``deepspeed.comm`` (``deepspeed.comm.torch.build_shm_op``);
    a process killed during that build hangs every later start on the same
    ``FileBaton`` lock. Wrapped here: stale locks are cleared, the wait is
    bounded, and on a timeout DeepSpeed goes on without the op (it accepts None,
    as it does where the op is not compatible) after one warning. Idempotent."""
    from ..ops.builder import JitBuildLock, JitLockTimeout, bounded_torch_baton
    from .compat import comm_torch
    ds_torch = comm_torch()
    original = ds_torch.build_shm_op
    if getattr(original, "_acco_guarded", False):
        return

    def build_shm_op():
        from .compat import get_accelerator
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None:
            return original()
        try:
            JitBuildLock.for_op(builder.name).wait()
            with bounded_torch_baton():
                op = original()
        except JitLockTimeout as err:
            logger.warning(f"acco_ds: DeepSpeed's shared-memory op is not loaded ({err}); DeepSpeed runs without it")
            return None
        init = getattr(op, "initialize", None)
        if init is not None and not getattr(init, "_acco_unlinks", False):
            op.initialize = _unlinking_initialize(op.initialize)
        return op

    build_shm_op._acco_guarded = True
    build_shm_op.__wrapped__ = original
    ds_torch.build_shm_op = build_shm_op


def _unlinking_initialize(initialize):
    """DeepSpeed's shared-memory op creates one 69 MB file per rank in /dev/shm
    (``deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>``) and
    never unlinks it, so every launch on a new port leaves RAM-backed files behind
    (a test suite: gigabytes). Once every rank has mapped every other's buffer (a
    barrier after ``initialize``), each rank unlinks its own name: the mappings stay
    valid until the processes exit, and the memory goes back to the system then,
    killed processes included."""
    def wrapped(world_size, rank):
        initialize(world_size, rank)
        import torch.distributed as dist
        if int(os.environ.get("LOCAL_SIZE", 0)) != world_size or not dist.is_initialized():
            return  # the op made no buffer (not every rank on this host); same answer on every rank
        dist.barrier()
        name = "_".join(["deepspeed_allreduce_buffer", str(os.getuid()), os.environ.get("MASTER_ADDR", ""),
                         os.environ.get("MASTER_PORT", ""), str(rank)])
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass  # another naming or place (a DeepSpeed other than 0.19's): nothing of ours to remove

    wrapped._acco_unlinks = True
    return wrapped


def unpatch() -> None:
    from .compat import package
    deepspeed = package()
    global _original_initialize
    with _lock:
        if _original_initialize is None:
            return
        deepspeed.initialize = _original_initialize
        _original_initialize = None
        _unguard_deepspeed_shm_op()


def _unguard_deepspeed_shm_op() -> None:
    """Give DeepSpeed its own ``build_shm_op`` back (``patch()`` wrapped it)."""
    from .compat import comm_torch
    ds_torch = comm_torch()
    wrapped = ds_torch.build_shm_op
    if getattr(wrapped, "_acco_guarded", False):
        ds_torch.build_shm_op = wrapped.__wrapped__


def is_patched() -> bool:
    return _original_initialize is not None
