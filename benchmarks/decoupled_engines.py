"""Which messaging engine carries the syncer of ``"mode": "decoupled"``, and what encryption itself costs here.

Engines, on loopback: ZeroMQ with CURVE (``pyzmq``) against gRPC with TLS (``grpcio``, a self-signed certificate
made with the ``openssl`` command), both encrypted, and each in clear (ZeroMQ NULL, gRPC insecure). One round trip
= the client sends ``--mb`` MiB of raw bytes and the server sends the same bytes back (what a learner's exchange
moves: Δ up, θ_g down), client and server in two processes; median of ``--repeats`` after one warm-up. ZeroMQ
sends them as one multipart message in frames of ``--chunk-mb`` MiB; gRPC as one message (unary call) and as a
bidirectional stream of 1 MiB messages, each echoed as it arrives.

The floor, in one process on one core: encrypt and decrypt the same 2 x ``--mb`` MiB (up and down) in 1 MiB
pieces with AES-256-GCM (OpenSSL through the ``ssl`` module: TLS 1.3 records between two memory BIOs, copies in
and out included; and libsodium's ``crypto_aead_aes256gcm``) and with libsodium's ``crypto_box`` (XSalsa20-Poly1305,
the cipher of CurveZMQ; the libsodium that pyzmq's libzmq is linked to, through ``ctypes``); next to a 2-rank gloo
all-reduce of the same bytes (torch), measured before and after the engines. Two processes on two cores can at
best split that cipher work in half: the floor of an encrypted exchange here is half the one-core time.

``grpcio`` is optional (its rows are left out when it is not installed: ``pip install grpcio``). Writes
``benchmarks/results/decoupled_engines_ciphers.{json,md}`` (``--out``).

    python benchmarks/decoupled_engines.py [--mb 64] [--repeats 5] [--chunk-mb 1]
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


CHUNK = [0]  # zmq: frames of this many bytes; grpc: a stream of messages of this many bytes (0: one message)


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
    stream = grpc.stream_stream_rpc_method_handler(lambda reqs, ctx: reqs, request_deserializer=None,
                                                   response_serializer=None)  # each message back as it arrives
    server = grpc.server(futures.ThreadPoolExecutor(2), options=OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("acco.Syncer", {"Echo": echo,
                                                                                          "Stream": stream})])
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
    step = CHUNK[0]
    if step:  # a bidirectional stream of messages of ``step`` bytes
        call = channel.stream_stream("/acco.Syncer/Stream")
        pieces = [payload[i:i + step] for i in range(0, len(payload), step)]
        rtt = lambda: sum(len(m) for m in call(iter(pieces), timeout=120))  # noqa: E731
    else:  # one message
        call = channel.unary_unary("/acco.Syncer/Echo")
        rtt = lambda: len(call(payload, timeout=120))  # noqa: E731
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        assert rtt() == len(payload)
        if i:
            times.append(time.perf_counter() - t0)
    channel.close()
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


# ---------------------------------------------------------------- the floor: the ciphers alone, one process
PIECE = 1 << 20  # the floor's pieces: 1 MiB, the syncer's frames


def tls_pair(tmp):
    """A TLS 1.3 client and server joined by memory BIOs, handshake done: (client, server, their four BIOs)."""
    import ssl
    key, crt = os.path.join(tmp, "key.pem"), os.path.join(tmp, "crt.pem")
    if not os.path.exists(crt):
        grpc_creds(tmp)
    sctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    sctx.load_cert_chain(crt, key)
    cctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    cctx.load_verify_locations(crt)
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    client = cctx.wrap_bio(c_in, c_out, server_hostname="localhost")
    server = sctx.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        done = 0
        for end in (client, server):
            try:
                end.do_handshake()
                done += 1
            except ssl.SSLWantReadError:
                pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if done == 2:
            return client, server, (c_out, s_in), (s_out, c_in)
    raise RuntimeError("the TLS handshake in memory did not finish")


def tls_floor(payload, repeats, tmp):
    """Seconds to send ``payload`` through TLS (client to server) and back (server to client), in memory, in 1 MiB
    writes; and the cipher the handshake chose."""
    import ssl
    client, server, up, down = tls_pair(tmp)
    buf = bytearray(PIECE)

    def one_way(src, dst, bios, data):
        out, into = bios
        for i in range(0, len(data), PIECE):
            piece = memoryview(data)[i:i + PIECE]
            n = src.write(piece)
            assert n == len(piece)
            into.write(out.read())
            got = 0
            while got < n:
                try:
                    got += dst.read(n - got, memoryview(buf)[got:])
                except ssl.SSLWantReadError:
                    raise RuntimeError("a TLS record did not arrive whole") from None

    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        one_way(client, server, up, payload)
        one_way(server, client, down, payload)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), client.cipher()[0]


def sodium():
    """libsodium: the copy pyzmq's libzmq is linked to, else the system's."""
    import ctypes
    import ctypes.util
    import glob
    import zmq
    here = glob.glob(os.path.join(os.path.dirname(zmq.__file__), os.pardir, "pyzmq.libs", "libsodium*"))
    path = here[0] if here else ctypes.util.find_library("sodium")
    if path is None:
        return None
    lib = ctypes.CDLL(path)
    assert lib.sodium_init() >= 0
    lib.sodium_version_string.restype = ctypes.c_char_p
    return lib


def sodium_floor(lib, cipher, payload, repeats):
    """Seconds to encrypt and decrypt ``payload`` twice (up and down) in 1 MiB pieces with libsodium's ``cipher``:
    "box" (crypto_box_easy_afternm: XSalsa20-Poly1305 under a precomputed Curve25519 key, as CurveZMQ seals each
    frame) or "aes" (crypto_aead_aes256gcm)."""
    import ctypes
    key, nonce = ctypes.create_string_buffer(32), ctypes.create_string_buffer(24)
    if cipher == "box":
        pk, sk = ctypes.create_string_buffer(32), ctypes.create_string_buffer(32)
        assert lib.crypto_box_keypair(pk, sk) == 0 and lib.crypto_box_beforenm(key, pk, sk) == 0
    else:
        assert lib.crypto_aead_aes256gcm_is_available() == 1, "no AES-NI: libsodium has no AES-256-GCM here"
        lib.randombytes_buf(key, 32)
    box, plain, clen = ctypes.create_string_buffer(PIECE + 16), ctypes.create_string_buffer(PIECE), ctypes.c_ulonglong()
    src = (ctypes.c_char * len(payload)).from_buffer_copy(payload)

    def seal_open(i, n):
        lib.sodium_increment(nonce, 24)
        at = ctypes.byref(src, i)
        if cipher == "box":
            assert lib.crypto_box_easy_afternm(box, at, ctypes.c_ulonglong(n), nonce, key) == 0
            return lib.crypto_box_open_easy_afternm(plain, box, ctypes.c_ulonglong(n + 16), nonce, key)
        assert lib.crypto_aead_aes256gcm_encrypt(box, ctypes.byref(clen), at, ctypes.c_ulonglong(n), None,
                                                 ctypes.c_ulonglong(0), None, nonce, key) == 0
        return lib.crypto_aead_aes256gcm_decrypt(plain, None, None, box, clen, None, ctypes.c_ulonglong(0), nonce,
                                                 key)

    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(2):  # up, then down
            for i in range(0, len(payload), PIECE):
                assert seal_open(i, min(PIECE, len(payload) - i)) == 0
        if r:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gloo_allreduce(mb, repeats):
    """Seconds of a 2-rank gloo all-reduce of ``mb`` MiB of fp32 (``decoupled_wire``'s)."""
    sys.path.insert(0, str(HERE))
    from decoupled_wire import allreduce_times
    return allreduce_times(int(mb * (1 << 20)) // 4, repeats)


def floors(mb, repeats, tmp):
    payload = os.urandom(int(mb * (1 << 20)))
    rows = []
    s, name = tls_floor(payload, repeats, tmp)
    rows.append({"cipher": f"AES-256-GCM, OpenSSL TLS 1.3 records in memory ({name})", "one_core_s": s})
    lib = sodium()
    if lib is not None:
        version = lib.sodium_version_string().decode()
        if lib.crypto_aead_aes256gcm_is_available():
            rows.append({"cipher": f"AES-256-GCM, libsodium {version}",
                         "one_core_s": sodium_floor(lib, "aes", payload, repeats)})
        rows.append({"cipher": f"XSalsa20-Poly1305 crypto_box (CurveZMQ's), libsodium {version}",
                     "one_core_s": sodium_floor(lib, "box", payload, repeats)})
    for r in rows:
        r["load"] = os.getloadavg()[0]
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk-mb", type=float, nargs="+", default=[1], help="zmq: frames of this size (0: one)")
    ap.add_argument("--out", default=str(HERE / "results" / "decoupled_engines_ciphers"))
    args = ap.parse_args(argv)
    try:
        import grpc
    except ImportError:
        grpc = None
        print("grpcio is not installed: the gRPC rows are left out (pip install grpcio)", flush=True)
    rows, gloo = [], gloo_allreduce(args.mb, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("zmq", secure, c) for c in args.chunk_mb for secure in (True, False)]
        if grpc is not None:
            runs += [("grpc", secure, c) for c in (1, 0) for secure in (True, False)]
        for engine, secure, chunk in runs:
            CHUNK[0] = int(chunk * (1 << 20))
            s = measure(engine, secure, args.mb, args.repeats, tmp)
            rows.append({"engine": engine, "encrypted": secure, "chunk_mb": chunk, "round_trip_s": s,
                         "gb_s": 2 * args.mb / 1024 / s, "load": os.getloadavg()[0]})
            print(rows[-1], flush=True)
        cipher_rows = floors(args.mb, args.repeats, tmp)
    gloo += gloo_allreduce(args.mb, args.repeats)
    allreduce = statistics.median(gloo)
    for r in rows:
        r["x_allreduce"] = r["round_trip_s"] / allreduce
    for r in cipher_rows:
        r["two_cores_s"] = r["one_core_s"] / 2
        r["x_allreduce"] = r["two_cores_s"] / allreduce
        print(r, flush=True)
    text = render(rows, cipher_rows, gloo, args, argv, grpc)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows, "ciphers": cipher_rows,
                                                    "allreduce_s": gloo}, indent=1))
    out.with_suffix(".md").write_text(text)
    return 0


def cpu() -> str:
    with open("/proc/cpuinfo") as f:
        info = f.read()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((set(line.split(":", 1)[1].split()) for line in info.splitlines() if line.startswith("flags")), set())
    return f"{model} ({', '.join(f for f in ('aes', 'vaes', 'avx2', 'avx512f') if f in flags) or 'no AES-NI'})"


def render(rows, cipher_rows, gloo, args, argv, grpc) -> str:
    import zmq
    allreduce = statistics.median(gloo)
    md = ["# Messaging engines for the decoupled syncer, and the cost of encryption\n",
          f"Command: `python benchmarks/decoupled_engines.py {' '.join(argv or sys.argv[1:])}` "
          f"({time.strftime('%Y-%m-%d %H:%M')}), {os.cpu_count()} cores, {platform.machine()}, {cpu()}, loopback, "
          f"Python {platform.python_version()}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), grpcio "
          f"{grpc.__version__ if grpc else 'not installed'}. One round trip: {args.mb:g} MiB of raw bytes to a server "
          f"process and back, median of {args.repeats}. The 2-rank gloo all-reduce of the same bytes: median "
          f"{allreduce:.4f} s ({args.repeats} before the engines, {args.repeats} after: "
          f"{statistics.median(gloo[:args.repeats]):.4f} / {statistics.median(gloo[args.repeats:]):.4f} s).\n",
          "| engine | encryption | messages | round trip (s) | GB/s (up + down) | / all-reduce | load average after |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        how = ("one message" if not r["chunk_mb"] else
               f"frames of {r['chunk_mb']:g} MiB" if r["engine"] == "zmq" else f"a stream of {r['chunk_mb']:g} MiB")
        enc = ("CURVE" if r["engine"] == "zmq" else "TLS") if r["encrypted"] else "none"
        md.append(f"| {r['engine']} | {enc} | {how} | {r['round_trip_s']:.4f} | {r['gb_s']:.2f} | "
                  f"{r['x_allreduce']:.2f} | {r['load']:.1f} |")
    md += ["", f"The floor: {args.mb:g} MiB encrypted and decrypted twice (up and down) in pieces of 1 MiB, one "
               "process, one core; two cores at best halve it.\n",
           "| cipher | one core (s) | two cores, at best (s) | two cores / all-reduce | load average after |",
           "|---|---|---|---|---|"]
    md += [f"| {r['cipher']} | {r['one_core_s']:.4f} | {r['two_cores_s']:.4f} | {r['x_allreduce']:.2f} | "
           f"{r['load']:.1f} |" for r in cipher_rows]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
