"""Which messaging engine carries the syncer of ``"mode": "decoupled"``: ZeroMQ with CURVE (``pyzmq``) against gRPC
with TLS (``grpcio``, a self-signed certificate made with the ``openssl`` command), both encrypted, on loopback.
One round trip = the client sends ``--mb`` MiB of raw bytes and the server sends the same bytes back (what a
learner's exchange moves: Δ up, θ_g down), client and server in two processes; median of ``--repeats`` after one
warm-up. Also each in clear (ZeroMQ NULL, gRPC insecure), to show what encryption costs. Needs only ``pyzmq`` and
``grpcio`` (no torch): run it in any environment that has them. Writes
``benchmarks/results/decoupled_engines.{json,md}``.

    python benchmarks/decoupled_engines.py [--mb 64] [--repeats 5]
"""

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zmq_keys():
    import zmq
    return zmq.curve_keypair(), zmq.curve_keypair()


def zmq_server(port, keys, ready):
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if keys:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys[0][1])
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and len(frames[1]) == 0:
            break
        sock.send_multipart(frames, copy=False)


CHUNK = [0]  # zmq: payload frames of this many bytes (0: one frame); set from --chunk-mb


def zmq_client(port, keys, payload, repeats):
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    if keys:
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys[0][0])
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys[1][0])
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys[1][1])
    sock.connect(f"tcp://127.0.0.1:{port}")
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        view, step = memoryview(payload), CHUNK[0] or len(payload)
        sock.send_multipart([view[i:i + step] for i in range(0, len(view), step)], copy=False)
        back = sock.recv_multipart(copy=False)
        assert sum(len(f) for f in back) == len(payload)
        if i:
            times.append(time.perf_counter() - t0)
    sock.send(b"")
    return times


def grpc_creds(tmp):
    key, crt = os.path.join(tmp, "key.pem"), os.path.join(tmp, "crt.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", key, "-out", crt, "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return open(key, "rb").read(), open(crt, "rb").read()


OPTIONS = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]


def grpc_server(port, creds, ready):
    import grpc
    echo = grpc.unary_unary_rpc_method_handler(lambda req, ctx: req, request_deserializer=None,
                                               response_serializer=None)
    server = grpc.server(futures.ThreadPoolExecutor(2), options=OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("acco.Syncer", {"Echo": echo})])
    if creds:
        server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([(creds[0], creds[1])]))
    else:
        server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    ready.set()
    server.wait_for_termination()


def grpc_client(port, creds, payload, repeats):
    import grpc
    channel = grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(creds[1]), options=OPTIONS) \
        if creds else grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS)
    echo = channel.unary_unary("/acco.Syncer/Echo")
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        back = echo(payload, timeout=120)
        assert len(back) == len(payload)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def measure(engine, secure, mb, repeats, tmp):
    port, ready = free_port(), mp.Event()
    if engine == "zmq":
        server, client, creds = zmq_server, zmq_client, zmq_keys() if secure else None
    else:
        server, client, creds = grpc_server, grpc_client, grpc_creds(tmp) if secure else None
    proc = mp.get_context("fork").Process(target=server, args=(port, creds, ready), daemon=True)
    proc.start()
    ready.wait(30)
    payload = os.urandom(int(mb * (1 << 20)))
    try:
        return statistics.median(client(port, creds, payload, repeats))
    finally:
        proc.terminate()
        proc.join(10)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-mb", type=float, nargs="+", default=[0, 8], help="zmq: frames of this size (0: one)")
    ap.add_argument("--out", default=str(HERE / "results" / "decoupled_engines"))
    args = ap.parse_args(argv)
    import grpc
    import zmq
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("zmq", secure, c) for c in args.chunk_mb for secure in (True, False)]
        for engine, secure, chunk in runs + [("grpc", True, 0), ("grpc", False, 0)]:
            CHUNK[0] = int(chunk * (1 << 20))
            s = measure(engine, secure, args.mb, args.repeats, tmp)
            rows.append({"engine": engine, "encrypted": secure, "chunk_mb": chunk, "round_trip_s": s,
                         "gb_s": 2 * args.mb / 1024 / s, "load": os.getloadavg()[0]})
            print(rows[-1], flush=True)
    md = ["# Messaging engines for the decoupled syncer\n",
          f"Command: `python benchmarks/decoupled_engines.py {' '.join(argv or sys.argv[1:])}` "
          f"({time.strftime('%Y-%m-%d %H:%M')}), {os.cpu_count()} cores, loopback, Python {platform.python_version()}, "
          f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), grpcio {grpc.__version__}. One round trip: "
          f"{args.mb:g} MiB of raw bytes to a server process and back, median of {args.repeats}.\n",
          "| engine | encryption | frames | round trip (s) | GB/s (up + down) | load average after |",
          "|---|---|---|---|---|---|"]
    md += [f"| {r['engine']} | {('CURVE' if r['engine'] == 'zmq' else 'TLS') if r['encrypted'] else 'none'} | "
           f"{'one' if not r['chunk_mb'] else '%g MiB' % r['chunk_mb']} | {r['round_trip_s']:.4f} | "
           f"{r['gb_s']:.2f} | {r['load']:.1f} |" for r in rows]
    text = "\n".join(md) + "\n"
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
