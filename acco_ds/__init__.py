"""acco_ds: ACCO ("Accumulate While You Communicate") for DeepSpeed.

Use it like ``deepspeed.initialize``::

    import acco_ds
    engine, optimizer, _, lr_scheduler = acco_ds.initialize(
        model=model, model_parameters=model.parameters(), config="ds_config.json")

with ``"acco": {"enabled": true}`` in the DeepSpeed config, or call
``acco_ds.patch()`` once so that every ``deepspeed.initialize`` in the process
(Hugging Face Trainer/Accelerate, Megatron-DeepSpeed) builds the ACCO engine
when the config asks for it. Installing the package arms that patch at start-up
(``acco_ds_autopatch.pth``; ``ACCO_DS_AUTOPATCH=0`` opts out).

Without DeepSpeed, ``acco_ds.torch`` runs the same modes from a plain PyTorch
loop under ``torchrun`` (and the local-SGD modes on FSDP2)::

    model, optimizer = acco_ds.torch.initialize(model, optimizer, "config.json")

Layout: ``algorithms`` (pure schedules), ``runtime`` (buffers, communication
thread, collectives, updates, jobs, the rounds every host drives), ``deepspeed``
(the only code that touches DeepSpeed internals), ``torch`` (the host without
DeepSpeed), ``ops`` (kernels), ``testing`` (the simulator).
"""

__version__ = "0.2.0"


def acco_enabled(config: dict) -> bool:
    """Whether a DeepSpeed config dict turns ACCO on."""
    from .config import parse_acco_config
    return parse_acco_config(config).enabled


def initialize(args=None, model=None, *rest, **kwargs):
    """``deepspeed.initialize`` with ACCO when the config has ``"acco": {"enabled": true}``.

    Takes and returns exactly what ``deepspeed.initialize`` takes and returns
    (``engine, optimizer, training_dataloader, lr_scheduler``). The config may
    come as ``config``, ``config_params`` or ``args.deepspeed_config``.
    """
    from .deepspeed.initialize import initialize_with, original_initialize
    return initialize_with(original_initialize(), args, model, *rest, **kwargs)


def patch() -> None:
    """Route every later ``deepspeed.initialize`` call through ACCO (idempotent).

    Configs without an enabled ``"acco"`` block get stock DeepSpeed.
    """
    from .deepspeed.initialize import patch as _patch
    _patch()


def unpatch() -> None:
    """Undo ``patch()``."""
    from .deepspeed.initialize import unpatch as _unpatch
    _unpatch()


def is_patched() -> bool:
    import sys
    mod = sys.modules.get(__name__ + ".deepspeed.initialize")
    return mod is not None and mod.is_patched()


def estimate_memory(*args, **kwargs) -> dict:
    """Model-state bytes per rank, stock ZeRO-1 vs ACCO: see ``acco_ds.memory.estimate_memory``."""
    from .memory import estimate_memory as estimate
    return estimate(*args, **kwargs)


__all__ = ["initialize", "patch", "unpatch", "is_patched", "acco_enabled", "estimate_memory", "__version__"]
