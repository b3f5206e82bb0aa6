"""What the wire of ``"mode": "decoupled"`` costs: one learner's exchange with a syncer shard (Δ up, ACK, READY,
θ_g down: the merge with K = 1 and no grace window) against a gloo all-reduce of the same tensor between two
processes (what ``diloco``'s outer step sends), on loopback, for several model sizes. The exchange runs on the
ZeroMQ transport with CURVE encryption from a secret file (``--auth-file``), and once without a secret (loopback
only) to show what encryption costs; with Δ in fp32 and with the int8 up-link (blocks of 256 with error
feedback, quantized by the learner inside the timed exchange). The up-link bytes of one exchange: the frames as
sent (header, name, payload) and, as root, on the wire: the learner in one network namespace, the shard in
another, joined by a veth pair (``harness.Network``), the learner's end's ``tx_bytes`` counter read from the
DELTA's send to its ACK (TCP/IP and CURVE framing included; the namespaces are removed at the end). The shard
runs as its own process (``python -m acco_ds.runtime.outer.decoupled.syncer``), as in training. Writes
``benchmarks/results/decoupled_wire.{json,md}``.

    python benchmarks/decoupled_wire.py [--sizes-mb 1 16 64] [--repeats 5]
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
from acco_ds.runtime.outer.decoupled import transport, wire  # noqa: E402
from acco_ds.runtime.outer.decoupled.link import Link  # noqa: E402

SETTINGS = json.dumps(dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True, merge="tokens", staleness="none",
                           nesterov_delay=1))


def uplink(dtype: str):
    from acco_ds import ops
    from acco_ds.runtime.comm.compression import Codec, OuterCompression
    from acco_ds.runtime.outer.decoupled.link import Uplink
    return Uplink(None if dtype == "fp32" else
                  OuterCompression(Codec(dtype, 256, ops.load_kernels("auto", torch.device("cpu"))), torch.float32))


def start_shard(tmp: str, host: str, auth_file, wrap=lambda cmd: cmd):
    port_file = os.path.join(tmp, "port")
    cmd = [sys.executable, "-m", "acco_ds.runtime.outer.decoupled.syncer", "--settings", SETTINGS, "--grace-s", "0",
           "--host", host, "--port-file", port_file, "--learners", "1"]
    if auth_file:
        cmd += ["--auth-file", auth_file]
    proc = subprocess.Popen(wrap(cmd), env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    while not os.path.exists(port_file):
        if proc.poll() is not None:
            raise RuntimeError("the shard exited at start")
        time.sleep(0.05)
    return proc, int(open(port_file).read())


def exchanges(link: Link, numel: int, dtype: str, repeats: int, counter=None):
    """HELLO, INIT, then ``repeats`` + 1 exchanges; per exchange (the first warms up) its seconds and the bytes
    ``counter()`` grew by from the DELTA's send to its ACK. A θ_g lost on the way is asked for again, as a learner
    does (``resends`` counts it)."""
    link.open(30)
    link.send(link.mine("INIT", name="theta", tensor=torch.zeros(numel)))
    up, delta, times, counted = uplink(dtype), torch.randn(numel) * 1e-3, [], []
    for v in range(repeats + 1):
        t0 = time.perf_counter()
        before = counter() if counter else 0
        msg = up.message(delta, learner=0, incarnation=1, base=v, tokens=1, steps=1)
        link.send(msg)
        link.recv("ACK")
        if counter:
            counted.append(counter() - before)
        link.send(link.mine("READY", base=v, tokens=1, steps=1))
        link.waiting_base = v
        while True:
            try:
                link.recv_params(numel)
                break
            except wire.Closed:
                link.resends += 1
                link.reopen(time.monotonic() + 60, RuntimeError("lost"))
                link.send(msg)
                link.send(link.mine("READY", base=v, tokens=1, steps=1))
        link.waiting_base = None
        if v:
            times.append(time.perf_counter() - t0)
    link.done()
    return times, counted


def veth_worker(args) -> None:
    counter = Path(f"/sys/class/net/{args.dev}/statistics/tx_bytes")
    link = Link((args.host, args.port), 0, 1, 0, 60, 1 << 40, transport.load_keys(args.auth_file))
    link.resends = 0
    _, counted = exchanges(link, args.numel, args.dtype, args.repeats, lambda: int(counter.read_text()))
    Path(args.out).write_text(json.dumps(counted[1:]))


def veth_bytes(numel: int, dtype: str, repeats: int, auth_file: str):
    """Median veth bytes of one DELTA (None where namespaces cannot be made: not root)."""
    import harness
    if harness.namespaces_unavailable():
        return None
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    with tempfile.TemporaryDirectory(prefix="acco_wire_veth_") as tmp, harness.Network("dw") as net:
        shard, port = start_shard(tmp, net.addrs[1], auth_file, lambda cmd: net.wrap(1, cmd))
        out = os.path.join(tmp, "bytes.json")
        subprocess.run(net.wrap(0, [sys.executable, __file__, "--veth-worker", "--numel", str(numel), "--dtype", dtype,
                                    "--host", net.addrs[1], "--port", str(port), "--dev", net.dev[0],
                                    "--repeats", str(repeats), "--out", out, "--auth-file", auth_file]),
                       env=env, check=True, timeout=600)
        shard.wait(60)
        return statistics.median(json.loads(Path(out).read_text()))


def exchange_times(numel: int, repeats: int, dtype: str = "fp32", auth_file=None):
    """Seconds of each exchange, and the bytes of one DELTA message (its frames)."""
    with tempfile.TemporaryDirectory(prefix="acco_wire_") as tmp:
        proc, port = start_shard(tmp, "127.0.0.1", auth_file)
        link = Link(("127.0.0.1", port), 0, 1, 0, 60, 1 << 40, transport.load_keys(auth_file))
        link.resends = 0
        try:
            times, _ = exchanges(link, numel, dtype, repeats)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
    if link.resends:
        print(f"{link.resends} θ_g lost on the way and asked for again", flush=True)
    return times, link.delta_bytes // (repeats + 1)


def _allreduce_rank(rank, numel, repeats, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    t = torch.randn(numel)
    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if i:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(times)
    dist.destroy_process_group()


def allreduce_times(numel: int, repeats: int, attempts: int = 3) -> list:
    """Seconds of each all-reduce; a rendezvous port taken meanwhile by another process is tried again."""
    import queue
    import socket
    ctx = mp.get_context("spawn")
    for _ in range(attempts):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        q = ctx.Queue()
        procs = [ctx.Process(target=_allreduce_rank, args=(r, numel, repeats, port, q)) for r in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                times = q.get(timeout=1)
                for p in procs:
                    p.join(60)
                return times
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        for p in procs:
            p.kill()
            p.join()
    raise RuntimeError(f"the gloo all-reduce did not run in {attempts} attempts")


def _echo(port_q, secret) -> None:
    """A ROUTER that sends every message back as it came (the floor's other end)."""
    import zmq
    keys = None if secret is None else transport.Keys(secret)
    ctx = zmq.Context()
    sock, port = transport.server(ctx, keys, "127.0.0.1", 0, 1 << 40)
    guard = transport.Guard(ctx, keys, sock, 4)
    guard.start()
    port_q.put(port)
    while True:
        frames = sock.recv_multipart(copy=False)
        if frames[1].bytes == b"end":
            break
        sock.send_multipart(frames, copy=False)
    guard.close()
    sock.close(0)
    ctx.term()


def zmq_floor(numel: int, repeats: int, secret=None) -> list:
    """Seconds of the tensor's bytes there and back between two processes over ZeroMQ alone, in the wire's frames
    (``wire.CHUNK``) and with its socket options, with CURVE (``secret``) or in clear: no Python on the way, no
    outer step; what the exchange cannot go below."""
    import zmq
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_echo, args=(q, secret))
    proc.start()
    port = q.get(timeout=120)
    keys = None if secret is None else transport.Keys(secret)
    zctx = zmq.Context()
    sock = transport.client(zctx, keys, "127.0.0.1", port, 1 << 40, 60)
    transport.handshake(sock, transport.endpoint("127.0.0.1", port), 60, "the echo", keys is not None)
    frames = wire.encode(wire.Message("PARAMS", name="theta", tensor=torch.randn(numel)))
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        sock.send_multipart(frames, copy=False)
        sock.recv_multipart(copy=False)
        if i:
            times.append(time.perf_counter() - t0)
    sock.send(b"end")
    proc.join(60)
    sock.close(0)
    zctx.term()
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "decoupled_wire"))
    for name, kind in (("--numel", int), ("--dtype", str), ("--host", str), ("--port", int), ("--dev", str),
                       ("--auth-file", str)):
        ap.add_argument(name, type=kind, help=argparse.SUPPRESS)
    ap.add_argument("--veth-worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.veth_worker:
        return veth_worker(args)
    secret_dir = tempfile.mkdtemp(prefix="acco_wire_secret_")
    auth = os.path.join(secret_dir, "syncer.key")
    transport.make_secret(auth)
    rows = []
    for mb in args.sizes_mb:
        numel = int(mb * (1 << 20) / 4)
        times, fp32_bytes = exchange_times(numel, args.repeats, auth_file=auth)
        clear, _ = exchange_times(numel, args.repeats)
        times8, int8_bytes = exchange_times(numel, args.repeats, "int8", auth_file=auth)
        ex, ar = statistics.median(times), statistics.median(allreduce_times(numel, args.repeats))
        floor = statistics.median(zmq_floor(numel, args.repeats, secret=open(auth, "rb").read()))
        rows.append({"fp32_mb": mb, "exchange_s": ex, "exchange_clear_s": statistics.median(clear),
                     "zmq_curve_s": floor, "zmq_clear_s": statistics.median(zmq_floor(numel, args.repeats)),
                     "allreduce_s": ar, "ratio": ex / ar, "exchange_gb_s": 2 * mb / 1024 / ex,
                     "exchange_int8_s": statistics.median(times8),
                     "uplink_bytes_fp32": fp32_bytes, "uplink_bytes_int8": int8_bytes,
                     "veth_bytes_fp32": veth_bytes(numel, "fp32", args.repeats, auth),
                     "veth_bytes_int8": veth_bytes(numel, "int8", args.repeats, auth)})
        print(rows[-1], flush=True)
    os.remove(auth)
    os.rmdir(secret_dir)
    text = render(rows, args, argv)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    out.with_suffix(".md").write_text(text)
    return 0


def render(rows, args, argv) -> str:
    md = ["# The decoupled wire against a gloo all-reduce\n",
          f"Command: `python benchmarks/decoupled_wire.py {' '.join(argv or sys.argv[1:])}` "
          f"({time.strftime('%Y-%m-%d %H:%M')}), {os.cpu_count()} cores, loopback, Python "
          f"{platform.python_version()}, torch {torch.__version__}. Exchange: Δ up, ACK, READY, θ_g down with the "
          f"shard's outer step in between (K = 1, no grace window), on ZeroMQ with CURVE encryption (a secret file), "
          f"median of {args.repeats}; the same without a secret (NULL mechanism, clear, loopback only). All-reduce: "
          f"gloo, 2 processes, the same fp32 tensor, median of {args.repeats}.\n",
          "| fp32 tensor (MiB) | exchange, CURVE (s) | exchange, clear (s) | ZeroMQ alone there and back, CURVE / "
          "clear (s) | gloo all-reduce, 2 ranks (s) | exchange CURVE / all-reduce | ZeroMQ CURVE alone / all-reduce | "
          "exchange GB/s (up + down) | exchange, int8 up-link, CURVE (s) | up-link bytes per exchange, fp32 / int8 "
          "(ratio) | on the veth, fp32 / int8 (ratio) |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    md += [f"| {r['fp32_mb']:g} | {r['exchange_s']:.4f} | {r['exchange_clear_s']:.4f} | {r['zmq_curve_s']:.4f} / "
           f"{r['zmq_clear_s']:.4f} | {r['allreduce_s']:.4f} | {r['ratio']:.2f} | "
           f"{r['zmq_curve_s'] / r['allreduce_s']:.2f} | "
           f"{r['exchange_gb_s']:.2f} | {r['exchange_int8_s']:.4f} | {r['uplink_bytes_fp32']:,} / "
           f"{r['uplink_bytes_int8']:,} ({r['uplink_bytes_int8'] / r['uplink_bytes_fp32']:.3f}) | "
           + (f"{r['veth_bytes_fp32']:,.0f} / {r['veth_bytes_int8']:,.0f} "
              f"({r['veth_bytes_int8'] / r['veth_bytes_fp32']:.3f}) |" if r["veth_bytes_fp32"] else "(not root) |")
           for r in rows]
    md.append("\nThe exchange moves the tensor twice (up and down) and runs the outer step on the shard; an "
              "all-reduce of 2 ranks moves it about once each way. Framing: an 84-byte header frame with the name per "
              "message, then the payload in frames of "
              f"{wire.CHUNK >> 20} MiB. ZeroMQ alone: the same frames sent to a process that sends them back, "
              "no Python on the way and no outer step (the floor of the exchange on this transport).\n")
    return "\n".join(md)


if __name__ == "__main__":
    raise SystemExit(main())
