"""FSDPLocalSGD: the local-SGD modes (diloco, Streaming DiLoCo, co2, edit) on FSDP2 models, torchft's layout.

Each replica's ``k`` ranks shard the model with FSDP2 (``fully_shard``) on a
1D mesh of their own (``acco_ds.torch.replica_mesh(k)``); inner steps are
plain FSDP2 steps of the user's optimizer inside the replica. The outer loop
(``runtime.outer``: one class per mode) runs every period on the local shards
(DTensor local tensors: this rank's fp32 piece of each parameter, which the
inner optimizer steps and FSDP2 gathers from) over cross-replica groups of the
ranks that hold the same shards. So the anchor, the outer momentum and what is
in flight are sharded like FSDP2's parameters: 8N/k bytes (diloco) beyond
FSDP2 itself, nothing gathered.

Not a 2D ("replicate", "shard") mesh: FSDP2's native HSDP all-reduces every
backward across the replicas, and no public switch avoids it, so the replicas
would never drift apart (docs/design/hosts.md). ACCO and dpu are refused
on FSDP2 for the reason written there too.

Committed weights (the anchor) are shown by copying them into the local
shards and back (one shard-sized buffer while shown): ``model.state_dict()``
returns copies of them, and ``eval()`` forward passes run on them.
"""

import contextlib
import copy
from typing import List

import torch
import torch.distributed as tdist

from ..runtime.comm import lifetime
from ..runtime.outer.interface import OuterLoopHost, Shards, build_outer_loop
from .settings import HostSettings

FORMAT = "acco_ds.torch/fsdp2/1"


class FSDPLocalSGD(OuterLoopHost, torch.optim.Optimizer):
    """The optimizer ``acco_ds.torch.initialize`` returns for an FSDP2 model in a local-SGD mode.

    Args:
        model: the FSDP2 model (``fully_shard`` on a ``replica_mesh``).
        optimizer: the user's torch optimizer over its (DTensor) parameters; it keeps stepping them.
        params: the optimizer's parameters, checked (``initialize``); ``settings``: the parsed config;
        groups: ``outer_loop.make_groups``' result.
    """

    def __init__(self, model, optimizer: torch.optim.Optimizer, params: List[torch.nn.Parameter],
                 settings: HostSettings, groups):
        self.acco, self.inner, self.module, self.groups = settings.acco, optimizer, model, groups
        self.gradient_accumulation_steps = settings.gradient_accumulation_steps
        self.clip = settings.gradient_clipping
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.param_groups, self.state = optimizer.param_groups, optimizer.state  # one set of groups: no copy
        self.params = params
        # One "group" per parameter: the local shard is contiguous, and ranks of an outer group hold
        # equal pieces of it (same mesh size, same FSDP2 chunking). Detached: plain storage views.
        self.locals = [p.to_local().detach().view(-1) for p in params]
        for t in self.locals:  # every replica starts from replica 0's weights
            tdist.broadcast(t, src=groups.outer_ranks[0], group=groups.outer_main)
        shards = Shards(self.locals, None, lambda: None, [[(p, 0)] for p in params], host_state=self._heal_state,
                        load_host_state=self._load_heal_state)
        self.outer = build_outer_loop(self.acco, shards, groups)
        self.global_steps = 0
        self.skipped_steps = 0
        self._saved = None  # the compute shards while the committed ones are shown
        self._depth = 0
        self._eval_view = False
        self._hooks = [
            model.register_forward_pre_hook(self._before_forward, prepend=True),  # before FSDP2 gathers
            model.register_state_dict_pre_hook(lambda *_: self._show()),
            model.register_state_dict_post_hook(lambda *args: self._state_dict_copies(*args)),
        ]
        if tdist.get_rank() == 0:
            print(f"[acco_ds] acco_ds.torch (FSDP2): mode={self.acco.mode} {self.outer.banner()} "
                  f"inner=FSDP2 step over {groups.k} ranks", flush=True)
        self.outer.join()  # replicas that come and go (acco.fault_tolerance) join the others here

    # ------------------------------------------------------------ the loop
    def step(self, closure=None):
        """One inner step (the user's optimizer on the local shards), then the outer loop's clock."""
        if closure is not None:
            raise RuntimeError("acco_ds.torch: optimizer.step(closure) is not supported; call backward() "
                               "yourself, then step()")
        self._restore()
        self.outer.wait()  # edit: the sync in flight writes the shards this step updates
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip if self.clip > 0 else float("inf"))
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if grads and torch.isfinite(torch.tensor(norm)):
            self.inner.step()
        else:
            self.skipped_steps += 1
            if tdist.get_rank() == 0:
                print(f"[acco_ds] non-finite gradient norm {norm}: inner step {self.global_steps + 1} is skipped "
                      f"on this replica; check the learning rate, data and gradient_clipping", flush=True)
        self.global_steps += 1
        self.outer.after_inner_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    # ------------------------------------------------- what users read
    def _before_forward(self, module, args) -> None:
        if module.training and self._eval_view:
            self._eval_view = False
            self._restore(one=True)
        elif not module.training and not self._eval_view:
            self._show()
            self._eval_view = True
        if self._depth == 0:
            self.outer.wait()  # edit: the layer-wise sync lands before the next forward reads the shards

    @torch.no_grad()
    def _show(self) -> None:
        """Copy the committed shards (the anchor) into the local shards; nests."""
        self._depth += 1
        if self._depth > 1:
            return
        self.outer.before_read()
        committed = self.outer.committed_flats()
        self._saved = [t.clone() for t in self.locals]
        for dst, src in zip(self.locals, committed):
            dst.copy_(src)
        _reshard(self.module)  # FSDP2 gathers the shown shards at the next forward

    @torch.no_grad()
    def _restore(self, one: bool = False) -> None:
        if self._depth == 0:
            return
        self._depth = self._depth - 1 if one else 0
        if self._depth == 0:
            for dst, src in zip(self.locals, self._saved):
                dst.copy_(src)
            self._saved = None
            _reshard(self.module)

    def _state_dict_copies(self, module, state_dict, prefix, local_metadata) -> None:
        # The returned tensors share the shards' storage, which gets the compute weights back: copy them.
        for key, value in state_dict.items():
            if isinstance(value, torch.Tensor):
                state_dict[key] = value.detach().clone()
        self._restore(one=True)

    @contextlib.contextmanager
    def committed_weights(self):
        """Within this block the local shards hold the committed weights (the anchor)."""
        self._show()
        try:
            yield
        finally:
            self._restore(one=True)

    def finalize(self) -> bool:
        """The last period's sync: every replica ends on one model (the anchor)."""
        self._restore()
        self._eval_view = False
        syncs = self.outer.syncs
        self.outer.finalize()
        return self.outer.syncs > syncs

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """This rank's part: its local shards (the replica's weights), the inner optimizer state on them,
        the outer loop's state and the counters (one file per rank)."""
        self._restore()
        self.outer.before_read()
        inner = self._inner_state()
        return {"format": FORMAT, "world_size": tdist.get_world_size(), "rank": tdist.get_rank(),
                "shards": [t.clone() for t in self.locals], "inner": inner, "outer": self.outer.state_dict(),
                "global_steps": self.global_steps, "skipped_steps": self.skipped_steps}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            raise ValueError("acco_ds.torch: this is not an FSDP2 acco_ds.torch optimizer state: load what "
                             "optimizer.state_dict() or acco_ds.torch.save wrote for an FSDP2 model")
        self._restore()
        outer = state_dict["outer"]
        if (outer["replicas"], outer["k"]) == (self.groups.replicas, self.groups.k) and \
                [t.numel() for t in state_dict["shards"]] != [t.numel() for t in self.locals]:
            raise ValueError("acco_ds.torch: the checkpoint's local shards have other sizes: it was saved with "
                             "another model")
        for dst, src in zip(self.locals, state_dict["shards"]):
            dst.copy_(src)
        self.outer.load_state_dict(outer)  # after the shards, as it reads them; refuses another replica layout
        self._load_inner(state_dict["inner"])
        self.global_steps, self.skipped_steps = state_dict["global_steps"], state_dict["skipped_steps"]
        _reshard(self.module)

    def _inner_state(self) -> dict:
        """The inner optimizer's state with each DTensor as its local tensor (this rank's piece)."""
        inner = self.inner.state_dict()
        inner["state"] = {i: {k: _local(v) for k, v in s.items()} for i, s in inner["state"].items()}
        return inner

    def _load_inner(self, saved: dict) -> None:
        inner = dict(saved)
        inner["state"] = {i: {k: _distributed(v, self.params[int(i)]) for k, v in s.items()}
                          for i, s in inner["state"].items()}
        groups = self.param_groups
        self.inner.load_state_dict(inner)  # (it makes new group dicts: keep the ones schedulers hold)
        for mine, loaded in zip(groups, self.inner.param_groups):
            mine.update(loaded)
        self.inner.param_groups, self.state = groups, self.inner.state

    def _heal_state(self) -> dict:
        """What a replica that heals from this one takes from this rank (``acco.fault_tolerance``): copies of
        the inner optimizer's state over this rank's shards and the counters."""
        return copy.deepcopy({"inner": self._inner_state(), "global_steps": self.global_steps,
                              "skipped_steps": self.skipped_steps})

    def _load_heal_state(self, state: dict) -> None:
        self._load_inner(state["inner"])
        self.global_steps, self.skipped_steps = state["global_steps"], state["skipped_steps"]

    def weights_changed(self) -> None:
        """The module's weights were replaced: the outer loop starts over from them."""
        self._restore()
        self.outer.restart()

    # -------------------------------------------------------- observability
    def acco_stats(self) -> dict:
        return dict(self.outer.stats(), mode=self.acco.mode, global_steps=self.global_steps,
                    skipped_steps=self.skipped_steps)

    def acco_report(self) -> list:
        return [("inner steps", f"{self.global_steps} FSDP2 steps on this rank's replica of {self.groups.k} "
                                f"ranks")] + self.outer.report()

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.outer.close()
        lifetime.release(self, getattr(self, "acco_groups", []))  # made by acco_ds.torch.initialize


def _local(value):
    """A DTensor optimizer state saved as its local tensor (tagged), anything else as it is."""
    if hasattr(value, "to_local"):
        return {"dtensor_local": value.to_local().clone()}
    return value


def _distributed(value, param):
    if isinstance(value, dict) and "dtensor_local" in value:
        from torch.distributed.tensor import DTensor
        return DTensor.from_local(value["dtensor_local"], param.device_mesh, param.placements, shape=param.shape,
                                  stride=param.stride(), run_check=False)
    return value


def _reshard(model) -> None:
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


__all__ = ["FSDPLocalSGD"]
