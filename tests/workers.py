"""One rank of a multi-process test: runs the scenario in spec.json and saves
what it saw to result{rank}.pt. Started by tests/dist.py."""

import json
import os
import sys
from datetime import timedelta

import torch

import common


class IncrementLR:
    """A Megatron-style scheduler: ``step(increment=samples)``."""

    def __init__(self, optimizer, samples_per_step):
        self.optimizer, self.samples_per_step, self.samples = optimizer, samples_per_step, 0
        self.base = [g["lr"] for g in optimizer.param_groups]
        self._apply()

    def _apply(self):
        factor = common.lr_factor(self.samples // self.samples_per_step)
        for g, base in zip(self.optimizer.param_groups, self.base):
            g["lr"] = base * factor

    def step(self, increment):
        self.samples += increment
        self._apply()

    def state_dict(self):
        return {"samples": self.samples}

    def load_state_dict(self, sd):
        self.samples = sd["samples"]
        self._apply()

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]


def tied_layers():
    """A pipeline with a weight tied across its first and last stage (Megatron's tied word embeddings)."""
    import torch.nn.functional as F
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    return [LayerSpec(torch.nn.Linear, 7, 8), TiedLayerSpec("tied", torch.nn.Linear, 8, 8, bias=False),
            LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, 8, 8),
            TiedLayerSpec("tied", torch.nn.Linear, 8, 8, bias=False, forward_fn=lambda m, x: F.linear(x, m.weight.t())),
            LayerSpec(torch.nn.Linear, 8, 3)]


def flat(module):
    return torch.cat([p.detach().float().reshape(-1) for p in module.parameters()]).clone()


def read_weights(engine):
    """What a user reads: ``module.state_dict()`` (the committed weights under ACCO), flattened."""
    return torch.cat([t.detach().float().reshape(-1) for t in engine.module.state_dict().values()])


def read_everything(engine, spec, rank, micro, out):
    """What users read mid-training: state_dict, an evaluation with a collective, a checkpoint."""
    import torch.distributed as dist
    state = read_weights(engine)
    seen = {"micro": micro, "global_steps": engine.global_steps, "state_dict": state}  # after the read commits
    engine.eval()
    with torch.no_grad():
        val = torch.tensor([float(common.loss_fn(engine, common.micro_batch(rank, 99_999)))])
    dist.all_reduce(val)
    engine.train()
    seen["val_loss"] = float(val) / dist.get_world_size()
    if spec.get("save") and len(out.setdefault("reads", [])) == spec.get("save_at_read", 0):
        engine.save_checkpoint(spec["save"], client_state={"micro": micro})
        seen["saved"] = True
    out.setdefault("reads", []).append(seen)


def shards(engine):
    """This rank's pieces after a load: fp32 masters, inner optimizer state, compute weights, outer state."""
    opt = engine.optimizer
    inner = [{k: v.clone() if torch.is_tensor(v) else v for k, v in opt.optimizer.state[m].items()}
             for m in opt.single_partition_of_fp32_groups]
    return {"masters": [m.detach().clone() for m in opt.single_partition_of_fp32_groups], "inner": inner,
            "compute": flat(engine.module), "outer": opt.outer.state_dict()}


def run(spec, rank, world):
    import deepspeed

    import acco_ds
    os.environ.update(spec.get("env", {}))  # a learner launched on its own: ACCO_LEARNER_ID
    data_rank = rank
    if spec.get("tp"):  # tensor parallelism with a Megatron-style mpu: data comes by data-parallel rank
        import tp
        mpu = tp.FakeMPU(spec["tp"])
        model, data_rank = tp.TPNet(mpu, spec.get("seed", 0)), mpu.get_data_parallel_rank()
    else:
        model = common.make_model(spec.get("seed", 0), spec.get("model", "tiny"))
    if spec.get("pipe"):  # DeepSpeed's pipeline engine (Megatron-DeepSpeed's default), spec["pipe"] stages
        from deepspeed.pipe import PipelineModule
        layers = tied_layers() if spec.get("tied") else [model.fc1, torch.nn.Tanh(), model.fc2]
        model = PipelineModule(layers=layers, num_stages=int(spec["pipe"]), partition_method="type:Linear",
                               loss_fn=lambda out, y: ((out.float() - y)**2).mean(), base_seed=spec.get("seed", 0))
    if spec.get("dtype") == "bf16":
        model = model.to(torch.bfloat16)
    if spec.get("dtype") == "fp16":
        # DeepSpeed refuses fp16 on its CPU accelerator; torch computes it fine, and the
        # loss-scaling logic under test is device independent.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
        model = model.to(torch.float16)
    params = common.param_groups(model) if spec.get("groups") else model.parameters()
    kwargs = {"mpu": mpu} if spec.get("tp") else {}
    if spec.get("client_optimizer"):
        kwargs["optimizer"] = common.reference_optimizer(spec["client_optimizer"], spec.get("groups"))(model)
    drive = spec.get("drive", "a")
    config = spec["config"]
    gas = config["gradient_accumulation_steps"]
    gbs = gas * common.MICRO_BATCH * world
    if spec.get("lr_schedule"):
        if drive == "megatron":
            kwargs["lr_scheduler"] = lambda opt: IncrementLR(opt, gbs)
        else:
            kwargs["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, common.lr_factor)
    init = acco_ds.initialize if spec.get("use_acco_initialize", True) else deepspeed.initialize
    for mode, factory in spec.get("outer_loops", {}).items():  # an outer algorithm from outside the package
        from acco_ds.runtime.outer.interface import register_outer_loop
        register_outer_loop(mode, factory)
    key = spec.get("config_key", "config")
    if spec.get("init_error"):  # a config every rank must refuse at initialize: what each said
        try:
            init(model=model, model_parameters=params, **{key: config}, **kwargs)
        except Exception as err:  # noqa: BLE001 - the refusal is the result
            return {"init_error": f"{type(err).__name__}: {err}"}
        raise AssertionError("initialize accepted a config it must refuse")
    engine, _, _, _ = init(model=model, model_parameters=params, **{key: config}, **kwargs)
    layout = None
    if int(spec.get("pipe", 0)) > 1:  # each stage's ranks read the data of their data-parallel rank
        data_rank = engine.grid.get_data_parallel_id()
        layout = {"stage": engine.stage_id, "dp": data_rank}
    data_rank += spec.get("data_rank_offset", 0)  # a launch that is one learner among others: their data follows

    out = {"params": [], "norms": [], "losses": [], "applied": [], "layout": layout}
    micro = 0
    clock = {"t": 0.0} if spec.get("fake_clock") else None
    if clock is not None:
        engine.optimizer.outer.set_clock(lambda: clock["t"])
    if spec.get("load"):
        position = None
        if spec.get("until_syncs"):  # A-EDiT: every rank consumed its own number of micro-batches
            position = json.load(open(os.path.join(spec["load"], f"position{rank}.json")))
            clock["t"] = position[1]  # before the load: it restarts the period timer from this clock
        if spec.get("load_error"):  # a checkpoint every rank must refuse: what each said
            try:
                engine.load_checkpoint(spec["load"], **spec.get("load_kwargs", {}))
            except Exception as err:  # noqa: BLE001 - the test reads the message
                engine.destroy()
                return {"load_error": f"{type(err).__name__}: {err}"}
            raise AssertionError("the checkpoint loaded")
        _, client = engine.load_checkpoint(spec["load"], **spec.get("load_kwargs", {}))
        micro = client["micro"] if position is None else position[0]
        spec["start_step"] = engine.global_steps
        out["loaded"] = {"global_steps": engine.global_steps, "params": read_weights(engine)}
        if spec.get("export_shards"):
            out["loaded"].update(shards(engine))
    target = spec["steps"]
    last = engine.global_steps

    def record():
        nonlocal last
        # Pipeline: read the committed weights at every batch end (ACCO's compute weights may be an
        # estimate there); the read commits a finished step at once, so read before comparing steps.
        seen = read_weights(engine) if spec.get("pipe") else None
        if hasattr(engine, "optimizer") and hasattr(engine.optimizer, "outer"):
            engine.optimizer.outer.wait()  # edit: the replica weights land during the next forward
        if engine.global_steps != last and len(out["params"]) < target - spec.get("start_step", 0):
            out["params"].append(seen if seen is not None else flat(engine.module))
            out["norms"].append(engine.get_global_grad_norm())
            if spec.get("record_committed"):  # what users read: the anchor in local-SGD modes
                out.setdefault("committed", []).append(read_weights(engine))
        last = engine.global_steps

    def one_micro_batch():
        nonlocal micro
        if clock is not None:  # A-EDiT's injected clock: this rank's micro-batch costs fake_clock[rank] seconds
            clock["t"] += spec["fake_clock"][rank]
        loss = common.loss_fn(engine, common.spiked_batch(data_rank, micro, spec.get("spike")))
        if spec.get("raise_at_micro") == micro and spec.get("raise_rank") == rank:
            raise RuntimeError("deliberate failure on this rank")
        if spec.get("nan_at_micro") == micro and rank == 0:
            loss = loss * float("nan")
        if spec.get("loss_mult"):
            loss = loss * spec["loss_mult"]
        if spec.get("overflow_at_micro") == micro and rank == 0:
            loss = loss * 1e30  # fp16 gradients overflow to inf
        micro += 1
        if drive == "torch":
            loss.backward()
        elif drive == "hf":  # Hugging Face Trainer divides the loss itself and says so
            engine.backward(loss / gas, scale_wrt_gas=False)
        else:
            engine.backward(loss)
        out["losses"].append(float(loss))
        record()

    limit = spec.get("max_micro", 10_000)

    def pipe_batches():  # train_batch() pulls gradient_accumulation_steps micro-batches from this iterator
        nonlocal micro
        while True:
            item = common.micro_batch(data_rank, micro)
            micro += 1  # before the yield: the count is what was consumed (saved in checkpoints)
            yield item

    batches = pipe_batches() if spec.get("pipe") else None
    reached = None

    def more():
        nonlocal reached
        if spec.get("until_syncs"):  # A-EDiT: replicas run different step counts; syncs agree
            if engine.acco_syncs < spec["until_syncs"]:
                return True
            reached = micro if reached is None else reached  # then extra_micro more, mid-period
            return micro - reached < spec.get("extra_micro", 0)
        return engine.global_steps < target

    adaptive = (config.get("acco") or {}).get("accumulation") == "adaptive"

    def keep_going():
        if adaptive and micro % gas:  # ranks agree on global_steps at step boundaries (they align there)
            return micro < limit
        return more() and micro < limit

    while keep_going():
        if spec.get("pipe"):
            out["losses"].append(float(engine.train_batch(data_iter=batches)))
            record()
            out["applied"].append(engine.was_step_applied())
        elif drive in ("a", "torch"):
            one_micro_batch()
            engine.step()
            record()  # stock DeepSpeed updates in step(), ACCO when a round ends in backward
            if spec.get("read_every") and micro % spec["read_every"] == 0:
                read_everything(engine, spec, rank, micro, out)
        else:  # Accelerate / HF Trainer / Megatron: boundary set explicitly, step() once per gas micro-batches
            if drive == "megatron":
                engine.set_train_batch_size(gbs)
            for j in range(gas):
                engine.set_gradient_accumulation_boundary(is_boundary=(j == gas - 1))
                one_micro_batch()
            if drive == "megatron":
                engine.step(lr_kwargs={"increment": gbs})
            else:
                engine.step()
            record()
            out["applied"].append(engine.was_step_applied())
            engine.zero_grad()
            if spec.get("inspect"):  # what a user reads at an iteration boundary
                seen = {"state_dict": read_weights(engine).clone(),
                        "global_steps": engine.global_steps}
                engine.eval()
                seen["eval"] = flat(engine.module)
                engine.train()
                seen["compute"] = flat(engine.module)
                seen["global_steps_after"] = engine.global_steps
                out.setdefault("inspect", []).append(seen)
    if spec.get("save") and not spec.get("read_every"):
        engine.save_checkpoint(spec["save"], client_state={"micro": micro})
        if spec.get("until_syncs"):
            json.dump([micro, clock and clock["t"]], open(os.path.join(spec["save"], f"position{rank}.json"), "w"))
        out["saved_global_steps"] = engine.global_steps
    if spec.get("finalize"):
        out["finalize_committed"] = engine.acco_finalize()
        out["final_params"] = flat(engine.module)
    if drive == "megatron":
        try:
            engine.set_train_batch_size(2 * gbs)  # batch-size ramp-up is not supported
        except ValueError as err:
            out["batch_size_error"] = str(err)
    out["global_steps"] = engine.global_steps
    out["micro"] = micro
    if spec.get("tied"):  # this stage's copy of the tied weight
        out["tied"] = next(w for w, _ in engine.module.get_tied_weights_and_groups()).detach().clone()
    if hasattr(engine, "acco_stats"):
        stats = engine.acco_stats()
        out["stats"] = {k: v for k, v in stats.items() if k != "last_rounds"}
        out["report"] = engine.acco_report()
        out["round_counts"] = [(h.kind, h.worker_micro) for h in engine.optimizer.log.history]
        out["buffer_bytes"] = engine.optimizer.buffer_bytes()
        out["group_numels"] = [f.numel() for f in engine.optimizer.bit16_groups_flat]
        out["optimizer_class"] = type(engine.optimizer).__name__
        out["collectives"] = str(engine.optimizer.layout or "flat")
    out["lr"] = engine.get_lr()
    out["loss_scale"] = float(getattr(engine.optimizer, "loss_scale", 1.0))
    out["skipped_steps"] = engine.skipped_steps
    engine.destroy()
    return out


def main():
    spec = json.load(open(sys.argv[1]))
    outdir = sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    audit = None
    if spec.get("device_audit"):  # would every collective of acco_ds be valid on NCCL? (tests/device_audit.py)
        import device_audit
        audit = device_audit.install()
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=spec.get("pg_timeout", 60)))
    results = [run(dict(spec, **r), rank, world) for r in spec.get("runs", [{}])]
    if audit is not None:
        audit.uninstall()
        results.append({"device_audit": audit.report()})
    torch.save(results, os.path.join(outdir, f"result{rank}.pt"))
    # Tear the process groups down before the interpreter does: left to interpreter exit, gloo's threads
    # were destroyed out of order now and then ("terminate called without an active exception", SIGABRT
    # after the results were written; seen about once in five launches of the residual-resume test).
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
