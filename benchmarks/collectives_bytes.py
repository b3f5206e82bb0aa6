"""Bytes each rank sends for one 16 MiB reduce-scatter / all-to-all / all-gather on gloo.

    sudo .venv/bin/python benchmarks/collectives_bytes.py [--mib 16] [--repeat 3]

Needs root: creates two network namespaces (acco_cb0, acco_cb1) joined by a
veth pair (acco_cbv0 10.77.0.1/24 <-> acco_cbv1 10.77.0.2/24), runs one gloo
rank in each (``ip netns exec``, GLOO_SOCKET_IFNAME=the veth), and reads each
rank's ``/sys/class/net/<veth>/statistics/tx_bytes`` before and after every
collective. The namespaces (and with them the veth pair) are deleted at the
end, also on error or Ctrl-C. Loopback is not used: its counters are shared
by all ranks.

The counts include TCP/IP headers and ACKs (a few per cent); a barrier's own
traffic, measured the same way, is subtracted. The optimum for a
reduce-scatter, all-to-all or all-gather of a B-byte buffer on W ranks is
(W-1)/W * B per rank. Results: benchmarks/results/collectives_bytes.json.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NS = ["acco_cb0", "acco_cb1"]
VETH = ["acco_cbv0", "acco_cbv1"]
ADDR = ["10.77.0.1", "10.77.0.2"]
PORT = 29577
OPS = ["barrier", "torch reduce_scatter_tensor", "acco_ds.collectives.reduce_scatter", "all_to_all_single",
       "all_gather_into_tensor"]


# ------------------------------------------------------------------ one rank
def worker(args):
    import torch
    import torch.distributed as tdist

    from acco_ds.collectives import reduce_scatter
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    counter = Path(f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes")
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
        "acco_ds.collectives.reduce_scatter": lambda: reduce_scatter(shard, buf, None),
        "all_to_all_single": lambda: tdist.all_to_all_single(full, buf),
        "all_gather_into_tensor": lambda: native_ag(full, shard),
    }
    results = {}
    for name in OPS:
        sent, secs = [], []
        for _ in range(args.repeat):
            tdist.barrier()
            time.sleep(0.2)  # let the barrier's packets and ACKs leave
            before = int(counter.read_text())
            start = time.perf_counter()
            ops[name]()
            secs.append(time.perf_counter() - start)
            tdist.barrier()
            time.sleep(0.2)
            sent.append(int(counter.read_text()) - before)
        results[name] = {"tx_bytes": sent, "seconds": secs}
    ours, ref = torch.empty_like(shard), torch.empty_like(shard)
    reduce_scatter(ours, buf, None)
    native_rs(ref, buf, op=tdist.ReduceOp.SUM)
    results["reduce_scatter_equals_torch"] = torch.equal(ours, ref)  # W = 2: bit for bit
    tdist.destroy_process_group()
    Path(args.out).write_text(json.dumps(results))


# ------------------------------------------------------------------- driver
def sh(*cmd, check=True):
    return subprocess.run(list(cmd), check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def teardown():
    for ns in NS:
        sh("ip", "netns", "del", ns, check=False)  # also deletes the veth end inside it


def setup():
    teardown()  # leftovers of an interrupted run of this script
    for ns in NS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", VETH[0], "netns", NS[0], "type", "veth", "peer", "name", VETH[1], "netns", NS[1])
    for ns, veth, addr in zip(NS, VETH, ADDR):
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        sh("ip", "-n", ns, "link", "set", veth, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=16, help="buffer size in MiB (fp32)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", default=str(ROOT / "benchmarks/results/collectives_bytes.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        sys.exit("run as root: it creates network namespaces and a veth pair")
    world = 2
    # Ctrl-C (KeyboardInterrupt, even where SIGINT was inherited as ignored) and SIGTERM (SystemExit) both
    # unwind through the finally block below, which deletes the namespaces.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    procs = []
    with tempfile.TemporaryDirectory(prefix="acco_cb_") as tmp:
        try:
            setup()
            env = dict(os.environ, MASTER_ADDR=ADDR[0], MASTER_PORT=str(PORT), WORLD_SIZE=str(world),
                       OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            for rank in range(world):
                cmd = ["ip", "netns", "exec", NS[rank], sys.executable, __file__, "--worker", "--mib", str(args.mib),
                       "--repeat", str(args.repeat), "--out", f"{tmp}/rank{rank}.json"]
                procs.append(subprocess.Popen(cmd, env={**env, "RANK": str(rank), "GLOO_SOCKET_IFNAME": VETH[rank]}))
            for proc in procs:
                if proc.wait(timeout=600):
                    raise SystemExit(f"a rank failed (exit code {proc.returncode})")
            ranks = [json.loads(Path(f"{tmp}/rank{r}.json").read_text()) for r in range(world)]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            teardown()

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
