"""Bytes on the wire per outer sync: sparseloco (packed, and zlib-coded) against fp32 diloco at the same period.

    python benchmarks/sparse_bytes.py [--sync_every 4] [--steps 16] [--modes "diloco,sparseloco packed,sparseloco"]

Needs root: two network namespaces joined by a veth pair (``harness.Network``, no bandwidth limit: the bytes do
not depend on the rate), one gloo CPU rank in each, bound to its end of the link. The two ranks are two replicas
of one rank (``replica_group_size`` 1), so the inner steps send nothing across the link and every byte on it
belongs to the outer syncs (and the few of start-up and of the end's finalize, counted too). Each rank reads its
veth ``tx_bytes`` before the first step and after ``acco_finalize``; bytes per sync = that difference over the
syncs, TCP/IP headers and ACKs included.

Model: an MLP 512-1024-512 (1,050,112 fp32 parameters, 4 tensors), AdamW, micro-batch 32 of a fixed random
regression, DeepSpeed ZeRO-1 inside each replica. Modes: ``diloco`` (fp32 all-reduce of the pseudo-gradient),
``sparseloco packed`` (``entropy_coding`` null: indices at 12 bits), ``sparseloco`` (the defaults: zlib where it
pays), and ``sparseloco fp32 values`` (``value_bits`` null, a reference point); on request ``sparseloco
overlap=N`` (the all-gather behind the next N inner steps). The two sparseloco codings are lossless, so their
final losses and weights are equal bit for bit; the script checks it. ``--rate`` puts a ``tbf`` limit on the link
(``harness.Network.limit``) and each row then also says how long the inner steps took and how long the compute
side waited for the outer syncs (``outer_wait_s``): timings want the machine to themselves. Results (JSON):
``benchmarks/results/sparse_bytes.json``.
"""

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402

MODES = {"diloco": {"mode": "diloco"},
         "sparseloco packed": {"mode": "sparseloco", "local_sgd": {"entropy_coding": None}},
         "sparseloco": {"mode": "sparseloco"},
         "sparseloco fp32 values": {"mode": "sparseloco", "local_sgd": {"value_bits": None}},
         "sparseloco overlap=1": {"mode": "sparseloco", "local_sgd": {"overlap": 1}},
         "sparseloco overlap=2": {"mode": "sparseloco", "local_sgd": {"overlap": 2}},
         "sparseloco overlap=3": {"mode": "sparseloco", "local_sgd": {"overlap": 3}}}
DEFAULT_MODES = "diloco,sparseloco packed,sparseloco,sparseloco fp32 values"


def worker(args):
    import torch
    harness.skip_deepspeed_shm_op()
    import acco_ds
    spec = MODES[args.mode]
    acco = {"enabled": True, "mode": spec["mode"], "kernels": args.kernels,
            "local_sgd": {"sync_every": args.sync_every, "replica_group_size": 1, **spec.get("local_sgd", {})}}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "acco": acco}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 512))
    engine, _, _, _ = acco_ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(1 + rank)  # each replica its own data
    target = torch.nn.Linear(512, 512)
    before = harness.link_tx_bytes()[0]
    start = time.perf_counter()
    loss = None
    for _ in range(args.steps):
        x = torch.randn(args.batch, 512, generator=g)
        with torch.no_grad():
            y = torch.tanh(target(x))
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
    train_s = time.perf_counter() - start  # the inner steps and the syncs (and gathers) they waited for
    stats = engine.acco_stats()
    engine.acco_finalize()
    sent = harness.link_tx_bytes()[0] - before
    weights = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    Path(args.out).write_text(json.dumps({
        "tx_bytes": sent, "syncs": stats["syncs"], "final_loss": float(loss),
        "weights_sha256": hashlib.sha256(weights.numpy().tobytes()).hexdigest(),
        "params": weights.numel(), "sparse_payload_bytes": stats.get("sparse_payload_bytes"),
        "sparse_wire_bytes": stats.get("sparse_wire_bytes"), "outer_bytes": stats.get("outer_bytes"),
        "train_s": train_s, "outer_wait_s": stats.get("outer_wait_s"), "outer_comm_s": stats.get("outer_comm_s")}))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sync_every", type=int, default=4)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--modes", default=DEFAULT_MODES, help=f"of: {', '.join(MODES)}")
    p.add_argument("--rate", default=None, help="a tbf limit on both ends of the link (1mbit, 10mbit); default none")
    p.add_argument("--batch", type=int, default=32, help="micro-batch (a larger one makes an inner step longer)")
    p.add_argument("--kernels", default="auto", help="acco.kernels (the payload is the same bit for bit)")
    p.add_argument("--json", default=str(HERE / "results/sparse_bytes.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if harness.namespaces_unavailable():
        sys.exit(f"run as root: it creates network namespaces and a veth pair ({harness.namespaces_unavailable()})")
    harness.interrupt_on_signals()
    rows = []
    with tempfile.TemporaryDirectory(prefix="acco_sb_") as tmp, harness.Network("sb") as net:
        if args.rate:
            net.limit(args.rate)
        for mode in args.modes.split(","):
            port = harness.free_port()
            env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")])}
            outs = [f"{tmp}/{mode.replace(' ', '_')}_rank{r}.json" for r in range(2)]
            cmds = [({**harness.rank_env(r, 2, port, net), **env},
                     net.wrap(r, [sys.executable, __file__, "--worker", "--mode", mode, "--sync_every",
                                  str(args.sync_every), "--steps", str(args.steps), "--kernels", args.kernels,
                                  "--batch", str(args.batch), "--out", outs[r]]))
                    for r in range(2)]
            with harness.RankSet(cmds, f"{tmp}/{mode.replace(' ', '_')}", mode) as rs:
                rs.finish(timeout=600)
            ranks = [json.loads(Path(o).read_text()) for o in outs]
            per_sync = [r["tx_bytes"] / r["syncs"] for r in ranks]
            rows.append({"mode": mode, "tx_bytes_per_sync_per_rank": per_sync, "ranks": ranks})
    dense = max(rows[[r["mode"] for r in rows].index("diloco")]["tx_bytes_per_sync_per_rank"]) \
        if any(r["mode"] == "diloco" for r in rows) else None
    print(f"MLP 512-1024-512 ({rows[0]['ranks'][0]['params']:,} parameters), 2 replicas of 1 rank on a veth pair, "
          f"H = {args.sync_every}, {args.steps} inner steps; veth tx bytes per sync per rank (max of the two)")
    for row in rows:
        worst = max(row["tx_bytes_per_sync_per_rank"])
        row["vs_diloco_fp32"] = dense / worst if dense else None
        r0 = row["ranks"][0]
        ratio = f"{dense / worst:7.1f}x fewer than diloco fp32" if dense else ""
        print(f"  {row['mode']:24s} {worst:12,.0f} B/sync  {ratio}   final loss {r0['final_loss']:.6f}   payload {r0['sparse_payload_bytes']} packed / "
              f"{r0['sparse_wire_bytes']} sent at the last sync   train {max(r['train_s'] for r in row['ranks']):.2f} s, "
              f"waited {max(r['outer_wait_s'] for r in row['ranks']):.2f} s for the outer syncs")
    same = {r["mode"]: r["ranks"][0]["weights_sha256"] for r in rows if r["mode"] in ("sparseloco", "sparseloco packed")}
    if len(same) == 2:
        print(f"  sparseloco packed and zlib-coded end on the same weights, bit for bit: {len(set(same.values())) == 1}")
    command = "python benchmarks/sparse_bytes.py" + "".join(
        f" --{k} {v!r}" if k == "modes" else f" --{k} {v}" for k, v in
        (("sync_every", args.sync_every), ("steps", args.steps), ("modes", args.modes), ("kernels", args.kernels),
         ("rate", args.rate), ("batch", args.batch)) if v != p.get_default(k))
    import torch
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"command": command, "torch": torch.__version__, "sync_every": args.sync_every,
                                           "steps": args.steps, "rate": args.rate, "batch": args.batch, "rows": rows},
                                          indent=1) + "\n")


if __name__ == "__main__":
    main()
