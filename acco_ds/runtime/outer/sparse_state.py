"""sparseloco's checkpoints: the error buffers (rank state, in the masters' layout), the sparse settings and an
overlapped sync's average in flight; resharding by the replica mapping rule (docs/sparseloco.md, "Checkpoints and
resharding")."""

from typing import Optional

import torch


class SparseCheckpoints:
    """What ``SparseLoCo`` saves and loads (a mixin over ``LocalSGD``'s state)."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd.update(error=[e.clone() for e in self.error], sparse=self._settings(), flight=self.flight_state())
        return sd

    def _settings(self) -> dict:
        return {"chunk": self.chunk, "topk": self.topk, "value_bits": self.bits, "error_decay": self.decay}

    def check_kind(self, sd: dict) -> None:
        saved = sd.get("sparse")
        if saved is None:
            raise ValueError(f"this checkpoint was saved by another local-SGD mode than sparseloco (no error-feedback "
                             f"buffers): resume it with its own mode, or load only the module weights "
                             f"(load_checkpoint(..., load_optimizer_states=False, load_lr_scheduler_states=False))")
        changed = {k: (v, self._settings()[k]) for k, v in saved.items() if k != "error_decay" and v != self._settings()[k]}
        if changed:
            key, (old, new) = next(iter(changed.items()))
            raise ValueError(f"this sparseloco checkpoint was saved with acco.local_sgd.{key}={old} but this run has "
                             f"{new}: its error-feedback buffers hold what that layout left out. Resume with "
                             f"{key}={old}, or load only the module weights (load_optimizer_states=False)")

    @torch.no_grad()
    def load_state_dict(self, sd: Optional[dict]) -> None:
        super().load_state_dict(sd)
        for dst, src in zip(self.error, sd["error"]):
            dst.copy_(src)
        self.load_flight(sd.get("flight"))

    def reshard_state(self, first: list, mine: list, plan) -> dict:
        """The anchor from old replica 0; the error buffers from the mapped old replica (they are per replica,
        the replica mapping rule), re-partitioned like the masters; the period position kept."""
        if first[0] is None:
            self.load_state_dict(None)  # raises: saved without a local-SGD mode
        self.check_kind(first[0])
        if any(s.get("flight") for s in mine):
            raise ValueError("this sparseloco checkpoint was saved while an overlapped sync was in flight "
                             "(acco.local_sgd.overlap): it resumes on its own layout only. Resume it there, or save "
                             "at least overlap inner steps after a sync to reshard")
        return {"schedule": mine[0]["schedule"], "replicas": self.groups.replicas, "k": self.groups.k,
                "anchor": plan.piece([s["anchor"] for s in first]), "momentum": [], "residuals": None,
                "error": plan.piece([s["error"] for s in mine]), "sparse": first[0]["sparse"]}

    @torch.no_grad()
    def restart(self) -> None:
        super().restart()
        self.load_flight(None)
        for e in self.error:
            e.zero_()


__all__ = ["SparseCheckpoints"]
