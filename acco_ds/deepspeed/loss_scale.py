"""DeepSpeed's loss scaler, once per committed ACCO step: a round's gradients may have been computed at a
scale the scaler has lowered since (the pipeline runs one round ahead), which must not count twice."""

from ..runtime.rounds.job import CommResult
from .compat import logger


def account_loss_scale(opt, rnd, result: CommResult) -> None:
    """Update the loss scaler for one committed step (and say why a step was skipped)."""
    if result.finite:
        if opt.dynamic_loss_scale:
            opt.loss_scaler.update_scale(False)
        return
    why = "check the learning rate, data and gradient_clipping"
    if opt.dynamic_loss_scale:
        before = opt.loss_scale
        if result.overflow_scale > before:
            # Computed at a scale the scaler has lowered since (the pipeline runs one round ahead):
            # lowering it again would count one overflow twice.
            why = f"part of it was computed at loss scale {result.overflow_scale:g}, since lowered to {before:g}"
        else:
            opt.loss_scaler.update_scale(True)
            why = (f"loss scale lowered from {before:g} to {opt.loss_scale:g}" if opt.loss_scale < before else
                   f"loss scale kept at {before:g} (fp16.hysteresis: lowered after more overflows)")
    logger.warning(f"ACCO: non-finite gradients in the step committed by round {rnd.index} (rank {opt.rank}); "
                   f"the update is skipped on every rank: {why}")


__all__ = ["account_loss_scale"]
