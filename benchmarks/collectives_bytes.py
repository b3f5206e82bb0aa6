"""Bytes each rank sends for one 16 MiB reduce-scatter / all-to-all / all-gather on gloo.

    sudo .venv/bin/python benchmarks/collectives_bytes.py [--mib 16] [--repeat 3]

Needs root: creates two network namespaces joined by a veth pair
(``harness.Network``, no bandwidth limit), runs one gloo rank in each (``ip
netns exec``, GLOO_SOCKET_IFNAME=the veth), and reads each rank's
``/sys/class/net/<veth>/statistics/tx_bytes`` before and after every
collective. The namespaces (and with them the veth pair) are deleted at the
end, also on error, Ctrl-C or SIGTERM (``--cleanup`` removes those of a
SIGKILLed run). Loopback is not used: its counters are shared by all ranks.

The counts include TCP/IP headers and ACKs (a few per cent); a barrier's own
traffic, measured the same way, is subtracted. The optimum for a
reduce-scatter, all-to-all or all-gather of a B-byte buffer on W ranks is
(W-1)/W * B per rank. Results: benchmarks/results/collectives_bytes.json.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
OPS = ["barrier", "torch reduce_scatter_tensor", "acco_ds.runtime.comm.collectives.reduce_scatter", "all_to_all_single",
       "all_gather_into_tensor"]


# ------------------------------------------------------------------ one rank
def worker(args):
    import torch
    import torch.distributed as tdist

    from acco_ds.runtime.comm.collectives import reduce_scatter
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    numel = args.mib * (1 << 20) // 4
    buf = torch.randn(numel)
    shard = torch.empty(numel // world)
    full = torch.empty(numel)
    native_rs = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    native_ag = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    ops = {
        "barrier": lambda: None,
        "torch reduce_scatter_tensor": lambda: native_rs(shard, buf, op=tdist.ReduceOp.SUM),
        "acco_ds.runtime.comm.collectives.reduce_scatter": lambda: reduce_scatter(shard, buf, None),
        "all_to_all_single": lambda: tdist.all_to_all_single(full, buf),
        "all_gather_into_tensor": lambda: native_ag(full, shard),
    }
    results = {}
    for name in OPS:
        sent, secs = [], []
        for _ in range(args.repeat):
            tdist.barrier()
            time.sleep(0.2)  # let the barrier's packets and ACKs leave
            before = harness.link_tx_bytes()[0]
            start = time.perf_counter()
            ops[name]()
            secs.append(time.perf_counter() - start)
            tdist.barrier()
            time.sleep(0.2)
            sent.append(harness.link_tx_bytes()[0] - before)
        results[name] = {"tx_bytes": sent, "seconds": secs}
    ours, ref = torch.empty_like(shard), torch.empty_like(shard)
    reduce_scatter(ours, buf, None)
    native_rs(ref, buf, op=tdist.ReduceOp.SUM)
    results["reduce_scatter_equals_torch"] = torch.equal(ours, ref)  # W = 2: bit for bit
    tdist.destroy_process_group()
    Path(args.out).write_text(json.dumps(results))


# ------------------------------------------------------------------- driver
def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=16, help="buffer size in MiB (fp32)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=str(ROOT / "benchmarks/results/collectives_bytes.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--cleanup", action="store_true", help="remove the namespaces of a SIGKILLed run, and exit")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if harness.namespaces_unavailable():
        sys.exit(f"run as root: it creates network namespaces and a veth pair ({harness.namespaces_unavailable()})")
    if args.cleanup:
        print("removed:", ", ".join(harness.cleanup_leftovers()) or "nothing to remove")
        return
    world = 2
    harness.interrupt_on_signals()  # Ctrl-C, SIGTERM: the with blocks kill the ranks and remove the namespaces
    with tempfile.TemporaryDirectory(prefix="acco_cb_") as tmp, harness.Network("cb") as net:
        port = harness.free_port()
        env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        cmds = [({**harness.rank_env(rank, world, port, net), **env},
                 net.wrap(rank, [sys.executable, __file__, "--worker", "--mib", str(args.mib), "--repeat",
                                 str(args.repeat), "--out", f"{tmp}/rank{rank}.json"]))
                for rank in range(world)]
        with harness.RankSet(cmds, tmp, "collectives") as rs:
            rs.finish(timeout=600)
        ranks = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(world)]

    buffer_bytes = args.mib << 20
    optimum = (world - 1) * buffer_bytes // world
    barrier = [statistics.median(r["barrier"]["tx_bytes"]) for r in ranks]
    rows = []
    for name in OPS[1:]:
        sent = [statistics.median(r[name]["tx_bytes"]) - b for r, b in zip(ranks, barrier)]
        secs = max(statistics.median(r[name]["seconds"]) for r in ranks)
        rows.append({"op": name, "tx_bytes_per_rank": sent, "optimum_bytes": optimum,
                     "ratio_to_optimum": [s / optimum for s in sent], "seconds": secs})
    command = "sudo .venv/bin/python benchmarks/collectives_bytes.py" + (
        f" --mib {args.mib}" if args.mib != 16 else "") + (f" --repeat {args.repeat}" if args.repeat != 3 else "")
    import torch
    result = {"command": command, "world_size": world, "buffer_bytes": buffer_bytes, "dtype": "float32",
              "backend": "gloo over a veth pair between two network namespaces", "torch": torch.__version__,
              "barrier_tx_bytes_subtracted": barrier, "rows": rows,
              "acco_reduce_scatter_equals_torch_bitwise": all(r["reduce_scatter_equals_torch"] for r in ranks),
              "raw": ranks}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    print(f"{args.mib} MiB fp32 buffer, {world} gloo ranks over veth; bytes sent per rank (tx_bytes, median of "
          f"{args.repeat}, minus a barrier's {barrier})")
    print(f"| {'collective':36s} | {'rank 0 MB':>9s} | {'rank 1 MB':>9s} | {'optimum MB':>10s} | {'ratio':>5s} | "
          f"{'time s':>6s} |")
    print(f"|{'-' * 38}|{'-' * 11}|{'-' * 11}|{'-' * 12}|{'-' * 7}|{'-' * 8}|")
    for row in rows:
        s = row["tx_bytes_per_rank"]
        print(f"| {row['op']:36s} | {s[0] / 1e6:9.2f} | {s[1] / 1e6:9.2f} | {optimum / 1e6:10.2f} | "
              f"{max(row['ratio_to_optimum']):5.2f} | {row['seconds']:6.3f} |")
    print(f"(MB = 10^6 bytes; optimum = (W-1)/W * {buffer_bytes} bytes; acco reduce_scatter == torch's bit for bit: "
          f"{result['acco_reduce_scatter_equals_torch_bitwise']})  -> {args.json}")


if __name__ == "__main__":
    main()
