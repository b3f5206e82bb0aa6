"""What moving a tensor-parallel learner's partition into the syncer's parts of the unsplit model costs one rank
(``decoupled/canonical.TPRelayout``): ``to_syncer`` (Δ into the parts this rank holds) and ``from_syncer`` (θ_g
back into its partition), in one process. The layout is a Megatron GPT block stack of hidden size 4096 at
tensor-parallel size 8 and data-parallel size 1 (per layer: QKV and the first MLP weight split along dimension 0,
the attention output and the second MLP weight along dimension 1, one run per row; biases of the row-parallel
layers and the layer norms replicated), ``--layers`` layers, a syncer of 8 shards; the rank is slot 0 of 8. The
all-to-all is a stand-in that fills what the rank receives (no other rank runs), so the time is the rank's own
packing and unpacking: its copies. Appends one line per run to ``benchmarks/results/decoupled_relayout.jsonl``
(the commit it measured) and prints the table of every line.

    python benchmarks/decoupled_relayout.py [--layers 4] [--repeats 3]
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]
from acco_ds.runtime.outer.decoupled import canonical  # noqa: E402
from acco_ds.runtime.outer.decoupled.canonical import TPRelayout, canonical_model, split_params  # noqa: E402
from acco_ds.runtime.outer.decoupled.layout import Parts, part_width  # noqa: E402

RESULTS = HERE / "results" / "decoupled_relayout.jsonl"


def megatron_layer(h: int, tp: int):
    """One GPT layer's parameters on a tensor-parallel rank: ``(local shape, split dim or None)``."""
    return [((h,), None), ((h,), None), ((3 * h // tp, h), 0), ((3 * h // tp,), 0), ((h, h // tp), 1), ((h,), None),
            ((h,), None), ((h,), None), ((4 * h // tp, h), 0), ((4 * h // tp,), 0), ((h, 4 * h // tp), 1),
            ((h,), None)]


def params(layers: int, h: int, tp: int):
    out, at = [], 0
    for _ in range(layers):
        for shape, dim in megatron_layer(h, tp):
            p = torch.empty(shape, device="meta")  # shape only: no storage
            if dim is not None:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
            out.append((p, at))
            at += p.numel()
    return [out], at


def measure(layers: int, repeats: int, h: int = 4096, tp: int = 8, shards: int = 8) -> dict:
    group, local = params(layers, h, tp)
    specs, why = split_params(group, tp)
    assert why == "", why
    sizes, _ = canonical_model(specs, tp)
    mine, syncer = Parts((local,), (part_width(local, 1),), 1), Parts.syncer(sizes, shards)
    canonical.tdist.all_to_all_single = lambda recv, send, *a, **k: recv.fill_(1.0)  # this rank alone
    t0 = time.perf_counter()
    relayout = TPRelayout(specs, tp, 1, 0, mine, syncer, None, list(range(tp)))
    build_s = time.perf_counter() - t0
    runs = sum(len(r) for r in relayout.send_delta) + sum(len(r) for r in relayout.recv_delta)
    flat = torch.randn(mine.numel)
    to_s, from_s = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parts = relayout.to_syncer(flat)
        t1 = time.perf_counter()
        relayout.from_syncer(parts)
        to_s.append(t1 - t0)
        from_s.append(time.perf_counter() - t1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True,
                            text=True).stdout.strip()
    if subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "acco_ds/runtime/outer/decoupled"], cwd=HERE.parent).returncode:
        commit += " with changes"  # the relayout differs from the commit
    return {"commit": commit, "layers": layers, "hidden": h, "tp": tp, "shards": shards, "rank_elements": local,
            "runs": runs, "build_s": build_s, "to_syncer_s": statistics.median(to_s),
            "from_syncer_s": statistics.median(from_s), "repeats": repeats, "torch": torch.__version__,
            "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)"}


def table(rows) -> str:
    lines = ["| commit | layers | rank elements | Δ runs (sent + taken) | build s | to_syncer s | from_syncer s |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['commit']} | {r['layers']} | {r['rank_elements']:,} | {r['runs']:,} | {r['build_s']:.3f} | "
              f"{r['to_syncer_s']:.3f} | {r['from_syncer_s']:.3f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    row = measure(args.layers, args.repeats)
    with open(RESULTS, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(table([json.loads(line) for line in RESULTS.read_text().splitlines()]))


if __name__ == "__main__":
    main()
