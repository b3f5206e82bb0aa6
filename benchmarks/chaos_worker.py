"""One rank of the chaos benchmark (benchmarks/chaos.py): the GPT of examples/train_gpt.py (its model, data
and evaluation, imported from there), trained until the global model has ``--syncs`` outer syncs, with what
a supervisor that kills and relaunches it needs.

    REPLICA_GROUP_ID=0 deepspeed --num_gpus 1 benchmarks/chaos_worker.py --deepspeed_config ft.json \
        --syncs 30 --record run/rec
    deepspeed --num_gpus 3 benchmarks/chaos_worker.py --deepspeed_config diloco.json --syncs 30 \
        --record run/rec --save_every_syncs 4 --ckpt run/ckpt

What it adds to the example:

* ``--record PREFIX``: one JSON line per committed sync in ``PREFIX.r<replica or rank>.jsonl`` (appended, so
  a killed process leaves what it had committed): wall time, the global model's sync count, the inner steps
  this replica put into that sync (its steps since its last committed sync: a discarded sync's steps go
  into the next one, as the outer loop does), the validation loss of the committed model every
  ``--eval_every`` syncs, and the fault-tolerance figures of ``engine.acco_stats()``. A ``start`` line after
  the join (or the load) and an ``end`` line with a SHA-256 of the committed weights.
* ``--save_every_syncs N --ckpt DIR``: ``save_checkpoint`` every N syncs; a launch that finds ``DIR/latest``
  loads it first (the restart-all baseline).
* ``--record``'s ``start`` line also says where a (re)launched process's time went, as wall-clock stamps:
  the process's start (``proc_start``), the end of its imports (``t_imported``), the engine build's start and
  end (``t_build``, ``t_engine``: the join's quorum wait and heal happen inside it, and the counters
  ``quorum_wait_s`` and ``heal_s`` say how long), and the launcher's start (``launcher_start``: the oldest
  ancestor process of this rank inside the launch). A ``stepped`` line follows the first inner step.
  ``benchmarks/chaos_phases.py`` turns them into a table.
* Data resumes at the replica's position: micro-batch ``global_steps x gradient_accumulation_steps`` (0 for
  a fresh start; after a load or a heal the steps the replica, or the one it healed from, had taken).
"""

import time

T_MAIN = time.time()  # before any import: what follows is the imports' cost

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from train_gpt import GPT, Batches, add_model_args, evaluate, load_corpus, param_groups  # noqa: E402

import deepspeed  # noqa: E402
from harness import skip_deepspeed_shm_op  # noqa: E402

import acco_ds  # noqa: E402

skip_deepspeed_shm_op()  # DeepSpeed's inference-only op: no JIT build (or wait on one) at every relaunch
T_IMPORTED = time.time()

FT_KEYS = ("syncs_discarded", "heals", "heal_s", "heal_bytes", "quorum_wait_s", "quorums", "participants_min",
           "participants_mean", "participants_max", "outer_comm_s", "outer_wait_s", "early_syncs")


def committed_digest(engine) -> str:
    """SHA-256 of the committed weights (the global model), in parameter order."""
    h = hashlib.sha256()
    with engine.acco_committed_weights():
        for name, p in engine.module.named_parameters():
            h.update(name.encode())
            h.update(p.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()


def started_at(pid) -> float:
    """A process's start as a wall-clock time, to the kernel's clock tick: /proc's start time (since boot)
    against CLOCK_BOOTTIME. psutil's ``create_time`` adds a boot time rounded to the second, which put a
    process's start up to a second off the ``time.time()`` stamps it is compared with."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
    return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))


def process_times() -> dict:
    """This process's start and its launcher's (the oldest ancestor of this launch that is the ``deepspeed``
    runner or its launch.py; this process when started directly or forked by acco_ds.cli.warm), as wall-clock
    times."""
    me = psutil.Process()
    ancestors = [p for p in me.parents() if p.create_time() > me.create_time() - 120]  # this launch's own
    launcher = [p for p in ancestors if any("deepspeed" in a or "torchrun" in a or "torch.distributed.run" in a
                                            for a in p.cmdline()[:3])]
    start = started_at(me.pid)
    return {"proc_start": start, "t_main": T_MAIN, "t_imported": T_IMPORTED,
            "launcher_start": min(started_at(p.pid) for p in launcher) if launcher else start}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_rank", type=int, default=0, help="set by the deepspeed launcher")
    parser.add_argument("--syncs", type=int, required=True, help="train until the global model has this many")
    parser.add_argument("--record", required=True, help="path prefix of the JSON-lines records")
    parser.add_argument("--eval_every", type=int, default=2, help="syncs between validations")
    parser.add_argument("--eval_batches", type=int, default=4)
    parser.add_argument("--save_every_syncs", type=int, default=0, help="save_checkpoint every N syncs (0: never)")
    parser.add_argument("--ckpt", default=None, help="checkpoint folder (loaded at start when it has 'latest')")
    parser.add_argument("--seed", type=int, default=1234)
    add_model_args(parser)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    ft = "fault_tolerance" in config.get("acco", {})
    replica = int(os.environ.get("REPLICA_GROUP_ID", 0)) if ft else 0
    me = replica * world + rank  # this rank among all replicas' ranks (seeds its data, names its record)

    torch.manual_seed(args.seed)
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size)
    weight_decay = config.get("optimizer", {}).get("params", {}).get("weight_decay", 0.0)
    t_build = time.time()
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=param_groups(model, weight_decay),
                                         config=config)  # a fault-tolerant replica joins (and heals) here
    t_engine = time.time()
    if args.ckpt and (Path(args.ckpt) / "latest").exists():
        engine.load_checkpoint(args.ckpt)
    device, gas = engine.device, engine.gradient_accumulation_steps()
    train = Batches(data[:split], args.block_size, engine.train_micro_batch_size_per_gpu(), seed=args.seed + 1 + me)
    val = Batches(data[split:], args.block_size, engine.train_micro_batch_size_per_gpu(), seed=args.seed)
    micro = engine.global_steps * gas

    out = open(f"{args.record}.r{me}.jsonl", "a")

    def write(event, **fields):
        stats = engine.acco_stats()
        line = {"event": event, "t": time.time(), "pid": os.getpid(), "replica": me, "sync": engine.acco_syncs,
                "global_steps": engine.global_steps, **{k: stats[k] for k in FT_KEYS if k in stats}, **fields}
        out.write(json.dumps(line) + "\n")
        out.flush()

    write("start", val=evaluate(engine, val, args.eval_batches, device), t_build=t_build, t_engine=t_engine,
          **process_times())
    steps_since, losses, stepped = 0, [], False
    while engine.acco_syncs < args.syncs:
        x, y = train.get(micro)
        before, syncs_before = engine.global_steps, engine.acco_syncs
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        micro += 1
        losses.append(loss.item())
        if not stepped:
            stepped = True
            write("stepped")
        if engine.global_steps == before:
            continue
        steps_since += 1
        sync = engine.acco_syncs
        if sync == syncs_before:
            continue
        fields = {"steps": steps_since, "train_loss": sum(losses[-gas:]) / gas}
        steps_since = 0
        if sync % args.eval_every == 0 or sync >= args.syncs:
            fields["val"] = evaluate(engine, val, args.eval_batches, device)
        write("sync", **fields)
        if args.save_every_syncs and sync % args.save_every_syncs == 0:
            engine.save_checkpoint(args.ckpt, tag=f"sync{sync}")
            write("saved")
    write("end", digest=committed_digest(engine))
    engine.destroy()


if __name__ == "__main__":
    main()
