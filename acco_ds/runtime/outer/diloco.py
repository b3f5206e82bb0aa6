"""DiLoCo: blocking syncs.

Every replica starts period t at the anchor ``x_t``, runs ``H`` inner steps
(``sync_every``), then ``δ̄_t``, the mean over replicas of ``δ = x_t − θ``
(where the period started minus where it ended), is all-reduced on the main
thread, ``x_{t+1} = OuterOpt(x_t, δ̄_t)`` (Nesterov SGD by default), and every
replica continues from ``x_{t+1}``. Streaming DiLoCo (``streaming.py``) is the
same loop with the model split into fragments that sync at staggered steps.
"""

import torch

from .base import LocalSGD


def fragments_mismatch(saved: str, now: str) -> ValueError:
    """A checkpoint of another fragment layout: ``saved`` and ``now`` say which, in the config's words."""
    return ValueError(f"this diloco checkpoint was saved with {saved} but this run has {now}: its position in the "
                      f"fragment windows and its in-flight pseudo-gradient belong to that layout. Resume with the "
                      f"same fragments and fragment_sync_delay, or load only the module weights (load_checkpoint(..., "
                      f"load_optimizer_states=False, load_lr_scheduler_states=False)): the outer loop then starts "
                      f"over from them")


class DiLoCo(LocalSGD):
    """The outer loop of mode ``diloco`` (see the module docstring). Args: as ``LocalSGD``."""

    @torch.no_grad()
    def _sync(self, sync) -> None:
        self._blocking_sync()

    def check_kind(self, sd: dict) -> None:
        streaming = sd.get("streaming")
        if streaming is None:
            return
        F = streaming["fragments"]
        if F == 1:  # streaming only by its delay or alpha
            raise fragments_mismatch("Streaming DiLoCo's keys (fragments=1, its delay or alpha set)", "plain DiLoCo")
        raise fragments_mismatch(f"acco.local_sgd.fragments={F}", "1")


__all__ = ["DiLoCo", "fragments_mismatch"]
