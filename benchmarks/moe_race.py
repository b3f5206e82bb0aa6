"""The mixture-of-experts race: a small MoE GPT on 4 ranks as 2 nodes of 2 at 50 Mbit between the nodes.

    flock /tmp/acco_heavy.lock python benchmarks/moe_race.py

The model is the quickstart's byte-level GPT (``examples/gpt.py``) with every block's MLP replaced by DeepSpeed's
``deepspeed.moe.layer.MoE``: 8 experts (each the block's MLP), top-2, ``ep_size`` 2, so the expert-parallel
all-to-all stays inside a node and each expert group's rails cross the link. The loss adds 0.01 x the gates'
load-balancing loss while training; validation reads the cross-entropy alone. Data: the standard library's
source, as every race of the project. The cluster harness runs it (``cluster_runs.Bench``: namespaces, a tbf
veth pair, one core per node, ``train_worker.py``'s loop and counters); each rank runs this file, which
hands ``train_worker.main`` the MoE GPT and adds its peak RSS to the rank's after-destroy record.

Rows, in one invocation: stock ZeRO-1 on the unlimited link (the compute-only limit: it trains the token budget,
and its final validation loss x 1.01 is the target), then at 50 Mbit stock ZeRO-1 (the same budget), and the
``RACE`` rows (``--modes`` picks others of ``MODES``), each until its committed model reaches the target or a
time cap: acco; Streaming DiLoCo, H=4, 2 fragments, τ=1, α=0.5, its outer all-reduce int8, the outer step the
plain mean (outer_lr 1, no momentum: "mean"); sparseloco, H=2, 512 of every 4,096 entries at 2 bits. Per row: training time to the target (start-up and evaluations excluded), that over the limit,
bytes per inner step across the link (the larger node's veth tx counter over the training loop), peak RSS per
rank. Writes ``benchmarks/results/moe_race.{json,md}`` and the run records in
``benchmarks/results/cluster_runs_moe_race.jsonl``.
"""

import argparse
import json
import os
import resource
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE), str(ROOT / "examples")]

EXPERTS, TOP_K, EP, L_AUX = 8, 2, 2, 0.01
STOCK = "ZeRO-1 (stock)"
# label -> train_worker.py flags (replica_group_size 2, one node, is added for the local-SGD modes); --local_sgd
# takes acco.local_sgd keys train_worker.py has no flag for. Beside the race's rows, the settings compared with
# them (docs/benchmarks/moe.md).
MODES = {
    STOCK: ["--mode", "zero1"],
    "acco": ["--mode", "acco", "--accumulation", "fixed"],
    "Streaming DiLoCo H=8 F=2 τ=1 int8": ["--mode", "diloco", "--sync_every", "8", "--fragments", "2",
                                          "--fragment_sync_delay", "1", "--fragment_update_alpha", "0.5",
                                          "--compression", "int8"],
    "sparseloco H=2": ["--mode", "sparseloco", "--sync_every", "2"],
    "Streaming DiLoCo H=4 F=2 τ=1 int8": ["--mode", "diloco", "--sync_every", "4", "--fragments", "2",
                                          "--fragment_sync_delay", "1", "--fragment_update_alpha", "0.5",
                                          "--compression", "int8"],
    "Streaming DiLoCo H=2 F=2 τ=0 int8": ["--mode", "diloco", "--sync_every", "2", "--fragments", "2",
                                          "--compression", "int8"],
    "sparseloco H=2 top 256": ["--mode", "sparseloco", "--sync_every", "2", "--local_sgd", '{"topk": 256}'],
    "sparseloco H=1 top 256": ["--mode", "sparseloco", "--sync_every", "1", "--local_sgd", '{"topk": 256}'],
    "sparseloco H=2 top 512": ["--mode", "sparseloco", "--sync_every", "2", "--local_sgd", '{"topk": 512}'],
    "sparseloco H=4 top 512": ["--mode", "sparseloco", "--sync_every", "4", "--local_sgd", '{"topk": 512}'],
    "Streaming DiLoCo H=4 F=2 τ=1 int8 mean": ["--mode", "diloco", "--sync_every", "4", "--fragments", "2",
                                               "--fragment_sync_delay", "1", "--fragment_update_alpha", "0.5",
                                               "--compression", "int8", "--local_sgd",
                                               '{"outer_lr": 1.0, "outer_momentum": 0.0, "nesterov": false}'],
}
RACE = ["acco", "Streaming DiLoCo H=4 F=2 τ=1 int8 mean", "sparseloco H=2 top 512"]  # the rows after stock's
MODEL_FLAGS = ["--n_layer", "2", "--n_head", "4", "--n_embd", "64"]


def moe_gpt(n_layer, n_head, n_embd, block_size):
    """``examples/gpt.py``'s GPT with an ``MoE`` of ``EXPERTS`` copies of the block's MLP in every block."""
    import torch
    from deepspeed.moe.layer import MoE
    from gpt import GPT

    class MoEMLP(torch.nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.moe = MoE(n_embd, mlp, num_experts=EXPERTS, ep_size=EP, k=TOP_K, capacity_factor=1.25,
                           eval_capacity_factor=2.0, noisy_gate_policy=None, use_rts=False)
            self.l_aux = None

        def forward(self, x):
            out, self.l_aux, _ = self.moe(x)
            return out

    class MoEGPT(GPT):
        def __init__(self):
            super().__init__(n_layer, n_head, n_embd, block_size)
            for block in self.blocks:  # initialised like the dense MLP (GPT._init) before it is copied
                block.mlp = MoEMLP(block.mlp)

        def forward(self, idx, targets=None):
            loss = super().forward(idx, targets)
            if targets is None or not self.training:
                return loss
            return loss + L_AUX * sum(block.mlp.l_aux for block in self.blocks)

    return MoEGPT()


def rank_main():
    """One rank: ``train_worker.main`` on the MoE GPT; then its peak RSS joins its after-destroy record."""
    import train_worker
    groups = train_worker.param_groups

    def named_groups(model, weight_decay):  # DeepSpeed splits named groups into dense and expert groups
        return [dict(g, name=f"group{i}") for i, g in enumerate(groups(model, weight_decay))]

    train_worker.GPT, train_worker.param_groups = moe_gpt, named_groups
    if "--local_sgd" in sys.argv:  # acco.local_sgd keys train_worker.py has no flag for (sparseloco's topk)
        at = sys.argv.index("--local_sgd")
        keys = json.loads(sys.argv[at + 1])
        del sys.argv[at:at + 2]
        initialize = train_worker.acco_ds.initialize

        def with_keys(*args, config, **kwargs):
            config["acco"]["local_sgd"].update(keys)
            return initialize(*args, config=config, **kwargs)

        train_worker.acco_ds.initialize = with_keys
    train_worker.main()
    results = sys.argv[sys.argv.index("--results") + 1]
    rank = int(os.environ["RANK"])
    path = Path(f"{results}.rank{rank}")
    record = json.loads(path.read_text()) if path.exists() else {"rank": rank}
    record["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    path.write_text(json.dumps(record))


def model_words():
    """The race's model in numbers (built here without process groups: DeepSpeed makes them at initialize)."""
    model = moe_gpt(*(int(v) for v in MODEL_FLAGS[1::2]), 128)
    local = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
    dense = sum(p.numel() for p in model.parameters()) - local
    n_layer = int(MODEL_FLAGS[1])
    return (f"MoE GPT {(dense + EP * local) / 1e6:.2f}M parameters ({dense:,} dense, {EP * local:,} in "
            f"{n_layer} x {EXPERTS} experts; {dense + local * TOP_K // (EXPERTS // EP):,} active per token, top-"
            f"{TOP_K}; each rank holds {dense + local:,}: ep_size {EP})")


def first_reach(history, target):
    return next(((p["time"], p["tokens"]) for p in history if p["val_loss"] <= target), None)


def row_of(run, target, limit_s, cap_s=None):
    rec, reach = run["_record"], first_reach(run["history"], target)
    rss = sorted(run.get("after_destroy") or [], key=lambda d: d["rank"])
    return {"bandwidth": rec["bandwidth"], "mode": rec["mode"], "time_to_target_s": reach and reach[0],
            "tokens_to_target": reach and reach[1], "vs_limit": reach and reach[0] / limit_s,
            "inter_mb_per_step": rec["row"].get("inter_mb_per_step"), "steps": rec["row"]["steps"],
            "step_time_s": rec["row"]["step_time_s"], "final_val_loss": rec["row"]["final_val_loss"],
            "peak_rss_mb": [d.get("peak_rss_mb") for d in rss], "time_cap_s": cap_s,
            "rank_commands": rec["rank_commands"], "history": run["history"]}


def table(rows, target, limit_s):
    lines = [f"| link | mode | time to {target:.4f} (s) | vs compute-only limit | tokens to target | s/step | "
             "MB/step across the link | peak RSS per rank (MB) | final val loss |", "|---" * 9 + "|"]
    for r in rows:
        reach = "not reached" + (f" (cap {r['time_cap_s']:.0f} s)" if r["time_cap_s"] else "") \
            if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}"
        lines.append(f"| {r['bandwidth']} | {r['mode']} | {reach} | "
                     f"{'–' if r['vs_limit'] is None else format(r['vs_limit'], '.2f') + 'x'} | "
                     f"{'–' if r['tokens_to_target'] is None else format(int(r['tokens_to_target']), ',')} | "
                     f"{r['step_time_s']:.3f} | {r['inter_mb_per_step']:.3f} | "
                     f"{' / '.join(f'{m:.0f}' for m in r['peak_rss_mb'] if m is not None)} | "
                     f"{r['final_val_loss']:.4f} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=128, help="stock's token budget in inner steps of 4,096 tokens")
    p.add_argument("--bandwidth", default="50mbit")
    p.add_argument("--modes", type=lambda s: s.split(","), default=RACE)
    p.add_argument("--eval_interval", type=int, default=4, help="inner steps between validations")
    p.add_argument("--eval_batches", type=int, default=16)
    p.add_argument("--ratio", type=float, default=1.01, help="target = ratio x stock's final validation loss")
    p.add_argument("--cap", type=float, default=2.0, help="time cap = this x stock's training time (unlimited)")
    p.add_argument("--run_timeout", type=float, default=400)
    args = p.parse_args()
    import cluster_runs as crun
    import harness
    reason = harness.namespaces_unavailable()
    if reason:
        raise SystemExit(f"cannot emulate 2 nodes: {reason}")
    crun.TRAIN = Path(__file__).resolve()  # each rank runs rank_main (train_worker's loop, the MoE GPT)
    crun.MODES.update(MODES)
    tokens = args.steps * crun.TWONODE_MICRO_BS * crun.TWONODE_GAS * 4 * crun.BLOCK
    base = {"steps": args.steps, "warmup": 2, "eval_interval": args.eval_interval, "eval_batches": args.eval_batches,
            "tokens": tokens, "extra": list(MODEL_FLAGS)}
    command = shlex.join(["python", "benchmarks/moe_race.py"] + sys.argv[1:])
    harness.interrupt_on_signals()
    started = time.time()
    bench_args = argparse.Namespace(command="moe_race", layout="twonode", run_timeout=args.run_timeout,
                                    steps=args.steps, warmup=2)
    with crun.Bench(bench_args) as h:
        limit_run = h.run("unlimited", STOCK, base, tag="moe_race")
        target = round(limit_run["final_val_loss"] * args.ratio, 4)
        limit = first_reach(limit_run["history"], target)
        cap = args.cap * limit_run["train_time_s"]
        runs = [limit_run, h.run(args.bandwidth, STOCK, base, tag="moe_race")]
        stop = ["--target_loss", f"{target:.4f}", "--time_cap_s", f"{cap:.1f}"]
        for mode in args.modes:
            runs.append(h.run(args.bandwidth, mode, dict(base, tokens=20 * tokens, extra=base["extra"] + stop),
                              tag="moe_race"))
    took = time.time() - started
    rows = [row_of(r, target, limit[0], None if r["_record"]["mode"] == STOCK else cap) for r in runs]
    best = min((r for r in rows[2:] if r["vs_limit"] is not None), key=lambda r: r["vs_limit"], default=None)
    lines = [model_words() + ".", "", f"Target {target:.4f} = {args.ratio:g} x stock ZeRO-1's final validation loss "
             f"{limit_run['final_val_loss']:.4f} after {tokens:,} tokens on the unlimited link; compute-only limit: "
             f"stock reaches it there in {limit[0]:.1f} s. Time cap of the racing rows: {cap:.0f} s.", ""]
    lines += table(rows, target, limit[0])
    verdict = ("no racing row reached the target" if best is None else
               f"best mode {best['mode']} at {args.bandwidth}: {best['vs_limit']:.2f}x the compute-only limit "
               f"(goal 1.3x: {'met' if best['vs_limit'] <= 1.3 else 'missed'})")
    lines += ["", verdict, "", f"Command: `{command}` ({took / 60:.1f} min)."]
    text = "\n".join(lines)
    print("\n" + text)
    out = crun.RESULTS / "moe_race"
    out.with_suffix(".md").write_text(text + "\n")
    json.dump({"command": command, "took_s": took, "target": target, "limit_s": limit[0], "cap_s": cap,
               "rows": rows, "verdict": verdict, "model": {"flags": MODEL_FLAGS, "experts": EXPERTS, "top_k": TOP_K,
                                                          "ep_size": EP, "l_aux": L_AUX}},
              open(out.with_suffix(".json"), "w"), indent=1)


if __name__ == "__main__":
    if "--deepspeed_config" in sys.argv:
        rank_main()
    else:
        main()
