"""One rank of one replica in a fault-tolerance test (started by tests/ft.py): DeepSpeed with an
``acco.fault_tolerance`` block, trained until ``spec["syncs"]`` outer syncs (or ``spec["steps"]`` inner
steps); writes its progress after every sync and what it saw to ``<name>.rank<r>.pt``.

Fault injection: ``die_at_micro`` (SIGKILL of every rank of this replica before that micro-batch, i.e.
mid-period). The test steers a running replica through ``<workdir>/control.json``: ``{"die": {name: n}}``
kills this replica in the sync it runs once it has ``n`` syncs, after the quorum formed (the others are
in the all-reduce, which fails under them), ``{"stop_at_syncs": n}`` ends training at ``n`` syncs."""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch

import common
from workers import flat, read_weights


def main():
    spec, workdir, name = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    replica = int(os.environ["REPLICA_GROUP_ID"])
    import deepspeed

    import acco_ds
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=60))
    model = common.make_model(spec.get("seed", 0), spec.get("model", "tiny"))
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=model.parameters(), config=spec["config"])
    outer = engine.optimizer.outer
    out = {"params": [], "committed": [], "syncs": [], "steps_at_join": engine.global_steps,
           "syncs_at_join": engine.acco_syncs, "quorums": []}
    blocking = outer._blocking_sync
    average = outer.transport.average

    def observed_sync():  # what each sync did to the anchor (the test checks a discarded one left it alone)
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

    def dying_average(tensors, keys=None, weight=1.0, side=False):
        die = control().get("die", {}).get(name)
        if die is not None and engine.acco_syncs >= die:  # in the quorum, the others in its all-reduce
            os.kill(os.getpid(), signal.SIGKILL)
        return average(tensors, keys, weight, side)

    outer._blocking_sync = observed_sync
    outer.transport.average = dying_average
    data_rank = replica * world + rank
    micro, last_syncs = 0, engine.acco_syncs

    def write_progress():
        path = os.path.join(workdir, f"{name}.rank{rank}.progress.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"syncs": engine.acco_syncs, "global_steps": engine.global_steps, "time": time.time()}, f)
        os.replace(path + ".tmp", path)

    def more():
        if "syncs" in spec:
            return engine.acco_syncs < control().get("stop_at_syncs", spec["syncs"])
        return engine.global_steps < spec["steps"]

    write_progress()

    while more():
        if spec.get("die_at_micro") == micro:
            os.kill(os.getpid(), signal.SIGKILL)
        before = engine.global_steps
        loss = common.loss_fn(engine, common.micro_batch(data_rank, micro))
        engine.backward(loss)
        engine.step()
        micro += 1
        time.sleep(spec.get("sleep_per_micro", 0.0))
        if engine.global_steps == before:
            continue
        out["params"].append(flat(engine.module))
        out["committed"].append(read_weights(engine))
        if engine.acco_syncs != last_syncs:
            last_syncs = engine.acco_syncs
            out["syncs"].append({"syncs": last_syncs, "time": time.time(), "global_steps": engine.global_steps,
                                 "participants": outer.transport.participants})
            write_progress()
    engine.acco_finalize()
    out["final"] = read_weights(engine)
    out["global_steps"], out["acco_syncs"], out["micro"] = engine.global_steps, engine.acco_syncs, micro
    out["stats"] = {k: v for k, v in engine.acco_stats().items() if k != "last_rounds"}
    out["report"] = engine.acco_report()
    torch.save(out, os.path.join(workdir, f"{name}.rank{rank}.pt"))
    engine.destroy()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
