"""One rank of a torch-host test (acco_ds.torch, no DeepSpeed): runs the scenarios in spec.json as a plain
PyTorch loop and saves what it saw to result{rank}.pt. Started by tests/dist.py with worker=this file."""

import copy
import gc
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import common


def flat(model) -> torch.Tensor:
    """Every parameter (full tensors, also under FSDP2), in ``parameters()`` order, as one float64 vector."""
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return torch.cat([t.detach().reshape(-1).double() for t in parts])


def build(spec, rank):
    import acco_ds.torch
    model = common.make_model(spec.get("seed", 0), spec.get("model", "tiny"))
    if spec.get("dtype") == "bf16":
        model = model.to(torch.bfloat16)
    if spec.get("fsdp"):
        from torch.distributed.fsdp import fully_shard
        mesh = acco_ds.torch.replica_mesh(spec["fsdp"]) if not spec.get("mesh_2d") else \
            torch.distributed.device_mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        layers = model.layers if hasattr(model, "layers") else [model.fc1, model.fc2]
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = common.reference_optimizer(spec.get("optimizer", "AdamW"), spec.get("groups"))(model)
    return acco_ds.torch.initialize(model, optimizer, spec["config"])


def zero_ddp(spec, rank):
    """The stock PyTorch baseline of mode sync: DDP averaging + ZeroRedundancyOptimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(common.make_model(spec.get("seed", 0), spec.get("model", "tiny")))
    a = common.ADAM
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=a["lr"],
                                        betas=a["betas"], eps=a["eps"], weight_decay=a["weight_decay"])
    gas, out, micro = spec["config"]["gradient_accumulation_steps"], {"params": []}, 0
    for _ in range(spec["steps"]):
        for _ in range(gas):
            (common.loss_fn(model, common.micro_batch(rank, micro)) / gas).backward()  # through DDP
            micro += 1
        optimizer.step()
        optimizer.zero_grad()
        out["params"].append(flat(model.module))
    return out


def run(spec, rank, world):
    import acco_ds.torch
    if spec.get("zero_ddp"):
        return zero_ddp(spec, rank)
    try:
        model, optimizer = build(spec, rank)
    except (ValueError, TypeError) as err:
        if spec.get("expect_error"):
            return {"error": str(err)}
        raise
    gas = spec["config"]["gradient_accumulation_steps"]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, common.lr_factor) if spec.get("lr_schedule") else None
    out, micro, start = {"params": [], "committed": [], "losses": []}, 0, 0
    if spec.get("load"):
        if spec.get("load_error"):  # a checkpoint every rank must refuse: what each said
            try:
                acco_ds.torch.load(spec["load"], model, optimizer, **spec.get("load_kwargs", {}))
            except Exception as err:  # noqa: BLE001 - the test reads the message
                optimizer.close()
                return {"load_error": f"{type(err).__name__}: {err}"}
            raise AssertionError("the checkpoint loaded")
        client = acco_ds.torch.load(spec["load"], model, optimizer, **spec.get("load_kwargs", {}))
        if spec.get("export_shards"):  # this rank's pieces right after the load
            masters = getattr(optimizer, "master_shards", None) or getattr(optimizer, "locals", None)
            out["loaded"] = {"masters": [m.detach().clone() for m in masters], "params": flat(model),
                             "inner": copy.deepcopy(optimizer.inner.state_dict()), "outer": optimizer.outer.state_dict()}
            with optimizer.committed_weights():
                out["loaded"]["committed"] = flat(model)
        micro, start = client["micro"], client["step"]
        if scheduler is not None:
            scheduler.load_state_dict(client["scheduler"])
    clock = {"t": 0.0} if spec.get("fake_clock") else None
    if clock is not None:  # A-EDiT's period timer: this rank's micro-batch costs fake_clock[rank] seconds
        optimizer.outer.set_clock(lambda: clock["t"])
    until_syncs, step = spec.get("until_syncs"), start
    # A-EDiT: replicas run different step counts, so the loop ends on the syncs, which every rank agrees on
    while optimizer.acco_syncs < until_syncs if until_syncs else step < spec["steps"]:
        for _ in range(spec.get("backward_per_step", gas)):
            loss = common.loss_fn(model, common.micro_batch(rank, micro))
            if spec.get("nan_at_micro") == micro and rank == 0:
                loss = loss * float("nan")
            micro += 1
            (loss / gas).backward()
            out["losses"].append(float(loss.detach()))
            if clock is not None:
                clock["t"] += spec["fake_clock"][rank]
        try:
            optimizer.step()
        except ValueError as err:
            if spec.get("expect_error"):
                return {"error": str(err)}
            raise
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        optimizer.outer.wait()  # edit: the replica weights land during the next forward
        out["params"].append(flat(model))  # compute weights (the replica's, in the local-SGD modes)
        with optimizer.committed_weights():
            out["committed"].append(flat(model))
        out["steps_seen"] = out.get("steps_seen", []) + [optimizer.global_steps]
        step += 1
        if spec.get("save_at") == step:
            acco_ds.torch.save(spec["save"], model, optimizer, client_state={
                "micro": micro, "step": step, "scheduler": scheduler.state_dict() if scheduler else None})
    if spec.get("inspect"):  # eval() forward passes run on the committed weights, training ones do not
        x = common.micro_batch(0, 0)[0]
        compute = flat(model)
        with torch.no_grad():
            model.eval()
            out["eval_out"] = model(x)
            model.train()
            out["train_out"] = model(x)
            with optimizer.committed_weights():
                out["committed_out"] = model(x)
        out["compute_kept"] = torch.equal(compute, flat(model))
        out["state_dict"] = torch.cat([t.full_tensor().reshape(-1).double() if hasattr(t, "full_tensor") else
                                       t.reshape(-1).double() for t in model.state_dict().values()])
    if spec.get("finalize"):
        out["finalized"] = acco_ds.torch.finalize(model, optimizer)
        out["final_params"] = flat(model)
    out["global_steps"], out["skipped_steps"], out["micro"] = optimizer.global_steps, optimizer.skipped_steps, micro
    stats = optimizer.acco_stats()
    out["stats"] = {k: v for k, v in stats.items() if k not in ("last_rounds", "sync_history")}
    out["sync_history"], out["syncs"] = stats.get("sync_history"), optimizer.acco_syncs
    out["report"] = optimizer.acco_report()
    out["deepspeed_imported"] = any(m == "deepspeed" or m.startswith("deepspeed.") for m in sys.modules)
    optimizer.close()
    return out


def main():
    spec = json.load(open(sys.argv[1]))
    outdir = sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=spec.get("pg_timeout", 60)))
    results = [run(dict(spec, **r), rank, world) for r in spec.get("runs", [{}])]
    torch.save(results, os.path.join(outdir, f"result{rank}.pt"))
    # Free every model, optimizer and DDP reducer (hooks make reference cycles) before the process groups
    # go: left to interpreter teardown, gloo aborted a finished rank now and then (SIGABRT, as in workers.py).
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
