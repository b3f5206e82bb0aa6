"""acco_ds: ACCO ("Accumulate While You Communicate") for DeepSpeed.

Use it like ``deepspeed.initialize``::

    import acco_ds
    engine, optimizer, _, lr_scheduler = acco_ds.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")

with ``"acco": {"enabled": true}`` in the DeepSpeed config, or call
``acco_ds.patch()`` once so that every ``deepspeed.initialize`` in the process
(Hugging Face Trainer/Accelerate, Megatron-DeepSpeed) builds the ACCO engine
when the config asks for it.
"""

import contextlib
import threading

__version__ = "0.1.0"

_lock = threading.RLock()
_original_initialize = None  # deepspeed.initialize before patch()


def _resolve_config(args, config, config_params):
    """The DeepSpeed config as a dict, from any of the places initialize accepts it."""
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    if config is None:
        config = config_params
    if config is None and args is not None:
        config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    return load_ds_config(config)


def acco_enabled(config: dict) -> bool:
    from .config import parse_acco_config
    return parse_acco_config(config).enabled


@contextlib.contextmanager
def _acco_engine_class():
    """Make ``deepspeed.initialize`` instantiate ``ACCOEngine``: it looks up the
    module-level name ``DeepSpeedEngine`` at call time."""
    import deepspeed
    from .engine import ACCOEngine
    with _lock:
        saved = deepspeed.DeepSpeedEngine
        deepspeed.DeepSpeedEngine = ACCOEngine
        try:
            yield
        finally:
            deepspeed.DeepSpeedEngine = saved


def _check_supported(model, config: dict) -> None:
    from deepspeed.pipe import PipelineModule
    if isinstance(model, PipelineModule):
        raise ValueError("ACCO does not support pipeline parallelism (the model is a PipelineModule): build the "
                         "model without PipelineModule (Megatron-DeepSpeed: pass --no-pipeline-parallel), or "
                         'set "acco": {"enabled": false}')
    if (config.get("hybrid_engine") or {}).get("enabled"):
        raise ValueError('ACCO does not support the DeepSpeed hybrid engine: set "hybrid_engine": {"enabled": '
                         'false} or "acco": {"enabled": false}')


def _initialize(ds_initialize, args=None, model=None, *rest, **kwargs):
    config = _resolve_config(args, kwargs.get("config"), kwargs.get("config_params"))
    if not acco_enabled(config):
        return ds_initialize(args, model, *rest, **kwargs)
    _check_supported(model, config)
    with _acco_engine_class():
        return ds_initialize(args, model, *rest, **kwargs)


def initialize(args=None, model=None, *rest, **kwargs):
    """``deepspeed.initialize`` with ACCO when the config has ``"acco": {"enabled": true}``.

    Takes and returns exactly what ``deepspeed.initialize`` takes and returns
    (``engine, optimizer, training_dataloader, lr_scheduler``). The config may
    come as ``config``, ``config_params`` or ``args.deepspeed_config``.
    """
    import deepspeed
    return _initialize(_original_initialize or deepspeed.initialize, args, model, *rest, **kwargs)


def patch() -> None:
    """Route every later ``deepspeed.initialize`` call through ACCO (idempotent).

    Configs without an enabled ``"acco"`` block get stock DeepSpeed.
    """
    import deepspeed
    global _original_initialize
    with _lock:
        if _original_initialize is not None:
            return
        _original_initialize = deepspeed.initialize

        def initialize_with_acco(args=None, model=None, *rest, **kwargs):
            return _initialize(_original_initialize, args, model, *rest, **kwargs)

        initialize_with_acco.__doc__ = _original_initialize.__doc__
        initialize_with_acco.__wrapped__ = _original_initialize
        initialize_with_acco._acco_patch = True
        deepspeed.initialize = initialize_with_acco
        try:  # DeepSpeed's own CPU op build must not hang a start either
            from .ops.builder import guard_deepspeed_shm_op
            guard_deepspeed_shm_op()
        except Exception:  # noqa: BLE001 - a DeepSpeed without that op: nothing to guard
            pass


def unpatch() -> None:
    """Undo ``patch()``."""
    import deepspeed
    global _original_initialize
    with _lock:
        if _original_initialize is None:
            return
        deepspeed.initialize = _original_initialize
        _original_initialize = None


def is_patched() -> bool:
    return _original_initialize is not None


def estimate_memory(*args, **kwargs) -> dict:
    """Model-state bytes per rank, stock ZeRO-1 vs ACCO: see ``acco_ds.memory.estimate_memory``."""
    from .memory import estimate_memory as estimate
    return estimate(*args, **kwargs)


__all__ = ["initialize", "patch", "unpatch", "is_patched", "acco_enabled", "estimate_memory", "__version__"]
