"""ACCOOptimizer: every mode for a plain (replicated) module under ``torchrun``, no DeepSpeed.

The user's loop stays a PyTorch loop::

    for step in range(steps):
        for micro in range(gradient_accumulation_steps):
            (loss_fn(model, batch) / gradient_accumulation_steps).backward()
        optimizer.step()
        optimizer.zero_grad()

``initialize`` lays each param group of the user's optimizer out as one flat,
padded buffer (the parameters become views into it, as in ZeRO-1), keeps
this rank's fp32 master partition of it, and rebinds the user's optimizer to
that partition, so its state is sharded across the ranks of the ZeRO group
(all ranks in the round modes, one replica's ``k`` ranks in the local-SGD
modes) like ``ZeroRedundancyOptimizer``. Rounds run as on the DeepSpeed host
(``runtime.rounds.driver``): a post-accumulate-grad hook adds every gradient into the
flat accumulator and frees it; at the end of each backward (an autograd
callback, as DDP ends its reductions) the micro-batch is counted and a due
round ends. ``optimizer.step()`` therefore applies nothing itself: it checks
that the loop ran ``gradient_accumulation_steps`` backward passes and marks
the step. The learning rate and other hyperparameters of the returned
optimizer's ``param_groups`` (what an LR scheduler changes) reach the update
when the next round's job starts, on the main thread.
"""

import contextlib
from typing import List

import torch
import torch.distributed as tdist

from ..runtime.rounds.buffers import padded_numel
from ..runtime.rounds.driver import RoundDriver
from ..runtime.comm import lifetime
from ..runtime.comm.groups import crosses_nodes, node_layout, side_group
from ..runtime.rounds.job import CommResult
from ..runtime.rounds.state import check_state, load_state, save_state
from ..runtime.rounds.stats import banner, report_lines, round_stats
from .settings import HostSettings

FORMAT = "acco_ds.torch/replicated/1"


def flatten(groups: List[List[torch.nn.Parameter]], ways: int):
    """One flat buffer per group, padded as the DeepSpeed host pads (``buffers.padded_numel``: equal
    partitions, so the same blocks are quantized on both hosts); the parameters become views into it, with
    rank 0's values everywhere (every rank starts from the same weights, as under DDP)."""
    flats, params = [], []
    for group in groups:
        numel = sum(p.numel() for p in group)
        flat = torch.zeros(padded_numel(numel, ways), dtype=group[0].dtype, device=group[0].device)
        entries, offset = [], 0
        for p in group:
            part = flat.narrow(0, offset, p.numel())
            part.copy_(p.detach().reshape(-1))
            p.data = part.view(p.shape)
            entries.append((p, offset))
            offset += p.numel()
        tdist.broadcast(flat, src=0)
        flats.append(flat)
        params.append(entries)
    return flats, params


class ACCOOptimizer(RoundDriver, torch.optim.Optimizer):
    """The optimizer ``acco_ds.torch.initialize`` returns for a plain module (see the module docstring).

    Args:
        model: the module (its parameters become views of the flat buffers).
        optimizer: a fresh torch optimizer over ``model``'s parameters; rebound to the master partitions.
        groups: the optimizer's param groups' parameters, checked (``initialize``).
        settings: the parsed config; ``replica_groups``: ``outer_loop.make_groups``' result (local-SGD).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups, settings: HostSettings,
                 replica_groups=None):
        acco = self.acco = settings.acco
        self.gradient_accumulation_steps = settings.gradient_accumulation_steps
        zero = replica_groups.replica_main if replica_groups is not None else tdist.group.WORLD
        side = replica_groups.replica_side if replica_groups is not None else side_group(zero, acco.timeout_s)
        ways, rank = tdist.get_world_size(zero), tdist.get_rank(zero)
        flats, params = flatten(groups, ways)
        masters = [flat.narrow(0, rank * (flat.numel() // ways), flat.numel() // ways).float().clone()
                   for flat in flats]
        public = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(ps)}
                  for g, ps in zip(optimizer.param_groups, groups)]
        for g, master in zip(optimizer.param_groups, masters):
            g["params"] = [master]  # the user's optimizer now steps this rank's fp32 partition only
        self.inner = optimizer
        torch.optim.Optimizer.__init__(self, public, optimizer.defaults)
        self.dtype = flats[0].dtype
        self.setup_rounds(flats=flats, masters=masters, optimizer=optimizer, params=params, group=zero, side=side,
                          layout=node_layout(zero, side, acco), crosses_nodes=crosses_nodes(zero, acco),
                          replica_groups=replica_groups, accum_dtype=settings.accum_dtype or self.dtype,
                          comm_dtype=settings.comm_dtype or self.dtype, clip=settings.gradient_clipping, jit=False)
        self.global_steps = 0  # committed optimizer steps (inner steps in the local-SGD modes)
        self.skipped_steps = 0  # of which skipped for non-finite gradients
        self._micro_since_step = 0
        self._callback_queued = False
        self._eval_view = False
        self.module = model
        self.outer.attach(model)
        self._module_hooks = [
            model.register_state_dict_pre_hook(lambda *_: self._show()),
            model.register_state_dict_post_hook(lambda *_: self.view.restore(all_levels=False)),
            model.register_load_state_dict_pre_hook(lambda *_: self.drop_in_flight()),
            model.register_load_state_dict_post_hook(lambda *_: self.weights_changed()),
            model.register_forward_pre_hook(self._before_forward),
        ]
        if tdist.get_rank() == 0:
            print(f"[acco_ds] {banner(acco, self, host='acco_ds.torch')}", flush=True)
        self.outer.join()  # replicas that come and go (acco.fault_tolerance) join the others here

    # ----------------------------------------------------- the driver's hooks
    def counters(self) -> dict:
        return {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps}

    def load_counters(self, counters: dict) -> None:
        self.global_steps, self.skipped_steps = counters["global_steps"], counters["skipped_steps"]
    def _accumulate(self, group: int, offset: int, param: torch.Tensor) -> None:
        super()._accumulate(group, offset, param)
        if not self._callback_queued:  # count the micro-batch once this backward has finished
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._callback_queued = False
        self._micro_since_step += 1
        self.count_micro_batch()
        if self.round_may_end():
            self._end_round()

    def _end_round(self) -> None:
        self.finish_round()
        self._count_commits()  # before the next job reads the learning rate
        self.start_round()

    def _count_commits(self) -> None:
        for result in self.take_commits():
            if not result.finite:
                self.skipped_steps += 1
            self.global_steps += 1
            self.outer.after_inner_step()

    def after_result(self, rnd, result: CommResult) -> None:
        if result.commits and not result.finite and self.rank == 0:
            print(f"[acco_ds] non-finite gradients in the step committed by round {rnd.index}: the update is "
                  f"skipped on every rank; check the learning rate, data and gradient_clipping", flush=True)

    def before_job(self) -> None:
        """The hyperparameters of the public param groups (an LR scheduler's changes) reach the update."""
        for public, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in public.items() if k != "params"})

    # ------------------------------------------------------------ the loop
    @torch.no_grad()
    def step(self, closure=None):
        """Mark the end of a step: updates were applied as their rounds ended (in backward)."""
        if closure is not None:
            raise RuntimeError("acco_ds.torch: optimizer.step(closure) is not supported: gradients are "
                               "accumulated in rounds, so the closure's backward cannot be re-run; call "
                               "backward() yourself, then step()")
        gas = self.gradient_accumulation_steps
        if not self.schedule.adaptive and self._micro_since_step != gas:
            raise ValueError(f"acco_ds.torch: optimizer.step() after {self._micro_since_step} backward passes, "
                             f"but the config has gradient_accumulation_steps={gas}: run that many backward() "
                             f"calls (each loss divided by it) per step(), or set gradient_accumulation_steps to "
                             f"the number your loop runs")
        self._micro_since_step = 0
        if self.schedule.adaptive:  # a user collective between steps finds no rank waiting on a peer
            self.align_rounds(self._end_round)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The accumulation hooks have already freed every gradient: nothing is left to zero.
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    # ------------------------------------------------- what users read
    def _before_forward(self, module, args) -> None:
        """``eval()`` forward passes see the committed weights, training ones the compute weights."""
        if module.training and self._eval_view:
            self.view.restore(all_levels=False)
            self._eval_view = False
        elif not module.training and not self._eval_view:
            self._show()
            self._eval_view = True

    def _show(self) -> None:
        if self.view.depth == 0 and self.schedule.adaptive:
            self.align_rounds(self._end_round)  # a rank a round behind ends it (collective)
        self.show_committed()
        self._count_commits()

    @contextlib.contextmanager
    def committed_weights(self):
        """Within this block the module's parameters are the committed weights (matching ``global_steps``),
        also mid-round where the compute side holds an estimate or a replica. Collective: every rank."""
        self._show()
        try:
            yield
        finally:
            self.view.restore(all_levels=False)

    def finalize(self) -> bool:
        """Commit every accumulated gradient and install the committed weights (local-SGD: the last
        sync): after N steps, N optimizer steps. Returns whether a step was committed."""
        self._eval_view = False
        steps = self.global_steps
        self.commit_everything(self._end_round)
        self._count_commits()
        return self.global_steps > steps

    # ---------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer state over its master partition, the masters, the rounds
        in flight, the outer loop and the counters (one file per rank, like DeepSpeed's ZeRO files)."""
        self.drain()
        return {"format": FORMAT, "inner": self.inner.state_dict(), "masters": [m.clone() for m in self.master_shards],
                "rounds": save_state(self), "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
            raise ValueError("acco_ds.torch: this is not an acco_ds.torch optimizer state (a plain torch optimizer's "
                             "state_dict cannot be split into ACCO's shards): load what optimizer.state_dict() or "
                             "acco_ds.torch.save wrote")
        check_state(self, state_dict["rounds"])
        self.outer.before_read()
        self.drop_in_flight()
        self.inner.load_state_dict(state_dict["inner"])
        for master, saved in zip(self.master_shards, state_dict["masters"]):
            master.copy_(saved)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        self.reset_rounds()
        load_state(self, state_dict["rounds"])
        self.global_steps, self.skipped_steps = state_dict["global_steps"], state_dict["skipped_steps"]
        self._micro_since_step = 0  # saved between steps

    @torch.no_grad()
    def weights_changed(self) -> None:
        """The module's weights were replaced (``model.load_state_dict``): the masters take them, rounds
        restart, and the outer loop starts over from them."""
        self.drop_in_flight()
        for flat, master in zip(self.compute_flats, self.master_shards):
            master.copy_(flat.narrow(0, self.rank * master.numel(), master.numel()))
        self.reset_rounds()
        self.outer.restart()

    # -------------------------------------------------------- observability
    def acco_stats(self) -> dict:
        return dict(round_stats(self), global_steps=self.global_steps, skipped_steps=self.skipped_steps)

    def acco_report(self) -> list:
        """The mode's lines of a run summary, ``(label, text)`` pairs."""
        return report_lines(self)

    def close(self) -> None:
        for h in self._module_hooks:
            h.remove()
        self._module_hooks = []
        self.close_rounds()
        lifetime.release(self, getattr(self, "acco_groups", []))  # made by acco_ds.torch.initialize


__all__ = ["ACCOOptimizer", "flatten"]
