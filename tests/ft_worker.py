"""One rank of one replica in a fault-tolerance test (started by tests/ft.py, directly or under torchrun):
``spec["host"]`` "deepspeed" (default) or "torch" (``acco_ds.torch``, a plain module, or FSDP2 with
``spec["fsdp"]``), an ``acco.fault_tolerance`` block, trained until ``spec["syncs"]`` outer syncs (or
``spec["steps"]`` inner steps); writes its progress after every sync and what it saw to
``<name>.rank<r>.pt``.

Fault injection: ``die_at_micro`` (SIGKILL of every rank of this replica before that micro-batch, i.e.
mid-period; only in a first start: a launcher that restarts the rank, ``acco_ds.cli.warm``, says which start it is
in ``TORCHELASTIC_RESTART_COUNT``). ``<name>.rank<r>.pt`` also says which modules were imported before this
script's own imports (``preloaded``: what a warm launcher had imported) and this process's id. The test
steers a running replica through ``<workdir>/control.json``: ``{"die": {name: n}}`` kills this replica in the sync it runs once it has ``n`` syncs, after the quorum formed (the others are
in the all-reduce, which fails under them), ``{"stop_at_syncs": n}`` ends training at ``n`` syncs."""

import json
import os
import signal
import sys
import time
from datetime import timedelta

PRELOADED = sorted(m for m in ("torch", "deepspeed", "acco_ds", "torchft") if m in sys.modules)  # before ours
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

import torch
import torch.distributed as dist

import common


class DeepSpeedHost:
    def __init__(self, spec):
        import deepspeed

        import acco_ds
        from workers import flat, read_weights
        deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
        model = common.make_model(spec.get("seed", 0), spec.get("model", "tiny"))
        self.engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=model.parameters(),
                                                  config=spec["config"])
        self.outer, self.flat, self.read = self.engine.optimizer.outer, flat, read_weights

    def step(self, batches) -> None:
        for batch in batches:  # a round may end (and commit) in any backward
            self.engine.backward(common.loss_fn(self.engine, batch))
            self.engine.step()

    def weights(self):
        return self.flat(self.engine.module), self.read(self.engine)

    def finish(self):
        self.engine.acco_finalize()
        final = self.read(self.engine)
        e = self.engine
        out = {"final": final, "global_steps": e.global_steps, "acco_syncs": e.acco_syncs,
               "stats": {k: v for k, v in e.acco_stats().items() if k != "last_rounds"}, "report": e.acco_report()}
        e.destroy()
        return out


class TorchHost:
    def __init__(self, spec):
        import acco_ds.torch
        from torch_workers import flat
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        model = common.make_model(spec.get("seed", 0), spec.get("model", "tiny"))
        if spec.get("fsdp"):
            from torch.distributed.fsdp import fully_shard
            mesh = acco_ds.torch.replica_mesh(dist.get_world_size())
            for layer in model.layers if hasattr(model, "layers") else [model.fc1, model.fc2]:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = common.reference_optimizer("AdamW")(model)
        self.model, self.optimizer = acco_ds.torch.initialize(model, optimizer, spec["config"])
        self.outer, self.flat, self.gas = self.optimizer.outer, flat, spec["config"]["gradient_accumulation_steps"]
        self.engine = self.optimizer  # global_steps and acco_syncs, as on the engine

    def step(self, batches) -> None:
        for batch in batches:
            (common.loss_fn(self.model, batch) / self.gas).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def weights(self):
        with self.optimizer.committed_weights():
            committed = self.flat(self.model)
        return self.flat(self.model), committed

    def finish(self):
        import acco_ds.torch
        o = self.optimizer
        acco_ds.torch.finalize(self.model, o)
        with o.committed_weights():
            final = self.flat(self.model)
        out = {"final": final, "global_steps": o.global_steps, "acco_syncs": o.acco_syncs,
               "stats": {k: v for k, v in o.acco_stats().items() if k != "last_rounds"}, "report": o.acco_report()}
        o.close()
        return out


def main():
    spec, workdir, name = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    replica = int(os.environ["REPLICA_GROUP_ID"])
    host = (TorchHost if spec.get("host") == "torch" else DeepSpeedHost)(spec)
    engine, outer = host.engine, host.outer
    out = {"params": [], "committed": [], "syncs": [], "steps_at_join": engine.global_steps,
           "syncs_at_join": engine.acco_syncs, "quorums": [], "preloaded": PRELOADED, "pid": os.getpid(),
           "restart": RESTART}
    blocking = outer._blocking_sync
    average = outer.transport.average

    def observed_sync():  # what each blocking sync did to the anchor (a discarded one must leave it alone)
        before = [t.clone() for t in outer.anchor]
        committed = blocking()
        out["quorums"].append({"committed": committed, "participants": outer.transport.participants,
                               "anchor_before": before, "anchor_after": [t.clone() for t in outer.anchor]})
        return committed

    def control() -> dict:
        try:
            with open(os.path.join(workdir, "control.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def die_if_told():
        die = control().get("die", {}).get(name)
        if die is not None and engine.acco_syncs >= die:  # in the quorum, the others in its all-reduce
            os.kill(os.getpid(), signal.SIGKILL)

    def dying_average(tensors, keys=None, weight=1.0, side=False):
        die_if_told()
        return average(tensors, keys, weight, side)

    outer._blocking_sync = observed_sync
    outer.transport.average = dying_average
    if hasattr(outer, "_sparse_sync"):  # sparseloco: its syncs gather payloads, and keep error buffers
        sparse_sync, gather = outer._sparse_sync, outer.transport.gather

        def observed_sparse_sync(join=False):
            before, errors = [t.clone() for t in outer.anchor], [t.clone() for t in outer.error]
            committed = sparse_sync(join)
            out["quorums"].append({"committed": committed, "participants": outer.transport.participants,
                                   "join": join, "anchor_before": before,
                                   "anchor_after": [t.clone() for t in outer.anchor], "error_before": errors,
                                   "error_after": [t.clone() for t in outer.error]})
            return committed

        def dying_gather(mine, weight=1.0):
            die_if_told()
            return gather(mine, weight)

        outer._sparse_sync, outer.transport.gather = observed_sparse_sync, dying_gather
    data_rank = replica * world + rank
    micro, last_syncs = 0, engine.acco_syncs
    gas = spec["config"]["gradient_accumulation_steps"]

    def write_progress():
        path = os.path.join(workdir, f"{name}.rank{rank}.progress.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"syncs": engine.acco_syncs, "global_steps": engine.global_steps, "time": time.time(),
                       "restart": RESTART}, f)
        os.replace(path + ".tmp", path)

    def more():
        if "syncs" in spec:
            return engine.acco_syncs < control().get("stop_at_syncs", spec["syncs"])
        return engine.global_steps < spec["steps"]

    write_progress()
    while more():
        if spec.get("die_at_micro") is not None and micro >= spec["die_at_micro"] and RESTART == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        before = engine.global_steps
        host.step([common.micro_batch(data_rank, micro + i) for i in range(gas)])
        micro += gas
        time.sleep(spec.get("sleep_per_step", 0.0))
        if engine.global_steps == before:
            continue
        params, committed = host.weights()
        out["params"].append(params)
        out["committed"].append(committed)
        if engine.acco_syncs != last_syncs:
            last_syncs = engine.acco_syncs
            out["syncs"].append({"syncs": last_syncs, "time": time.time(), "global_steps": engine.global_steps,
                                 "participants": outer.transport.participants})
            write_progress()
    out.update(host.finish(), micro=micro)
    torch.save(out, os.path.join(workdir, f"{name}.rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
