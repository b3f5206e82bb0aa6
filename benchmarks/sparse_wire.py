"""Bytes per chunk of sparseloco's payload under each index coding, and what the coding costs in time.

    python benchmarks/sparse_wire.py [--numel 1048576] [--time_numel 67108864]

In one process, no network: an error-feedback-like buffer (normal values of log-normal sizes, seed 0) is cut
into chunks of 4096, the top 64 of each kept at 2 bits (``reference.sparse_pack``), and the payload is counted
as 16-bit indices (the format before packing), packed at 12 bits (``sparse_codec``, coding null), and through
entropy coders: zlib (levels 1, 6, 9) on the index gaps as two byte planes, on the packed 12-bit indices and on
the gaps as uint16; lzma and bz2 on the gap planes; zstandard (levels 3, 19) when it is installed; a Rice code
of the gaps (k = 5, written by hand, the bound of a simple custom coder); and the information bound
log2 C(4096, 64) bits. Values (2-bit codes) and scales through zlib as well. Then ``sparse_codec.encode`` /
``decode`` timed on ``--time_numel`` elements. Results: ``benchmarks/results/sparse_wire.json``.
"""

import argparse
import bz2
import json
import lzma
import math
import sys
import time
import zlib
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from acco_ds.ops import reference as R  # noqa: E402
from acco_ds.ops import sparse_codec as C  # noqa: E402

CHUNK, TOPK, BITS = 4096, 64, 2


def buffer(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, generator=g) * torch.exp(0.5 * torch.randn(n, generator=g))


def streams(n: int) -> dict:
    """Bytes per chunk of each part under each coding."""
    offsets = R.chunk_offsets([n], CHUNK)
    indices, values, scales = R.sparse_pack(buffer(n), offsets, topk=TOPK, value_bits=BITS)
    chunks = offsets.numel() - 1
    i = indices.to(torch.int64).view(chunks, TOPK)
    gaps = torch.cat([i[:, :1], i[:, 1:] - i[:, :-1] - 1], 1).flatten()
    planes = torch.cat([gaps & 0xFF, gaps >> 8]).to(torch.uint8).numpy().tobytes()
    packed = C.pack_indices(indices, offsets, TOPK).numpy().tobytes()
    u16 = gaps.to(torch.int16).numpy().tobytes()
    v, s = values.numpy().tobytes(), scales.numpy().tobytes()
    index = {"16-bit": 2 * indices.numel(), "packed 12-bit": len(packed),
             "zlib-1 gap planes": len(zlib.compress(planes, 1)), "zlib-6 gap planes": len(zlib.compress(planes, 6)),
             "zlib-9 gap planes": len(zlib.compress(planes, 9)), "zlib-6 packed 12-bit": len(zlib.compress(packed, 6)),
             "zlib-6 gaps uint16": len(zlib.compress(u16, 6)), "lzma gap planes": len(lzma.compress(planes)),
             "bz2 gap planes": len(bz2.compress(planes)),
             "Rice k=5 (hand-written)": math.ceil(sum(6 + (g >> 5) for g in gaps.tolist()) / 8),
             "information bound log2 C(4096, 64)": (math.lgamma(CHUNK + 1) - math.lgamma(TOPK + 1)
                                                    - math.lgamma(CHUNK - TOPK + 1)) / math.log(2) / 8 * chunks}
    try:
        import zstandard
        for level in (3, 19):
            index[f"zstd-{level} gap planes"] = len(zstandard.ZstdCompressor(level=level).compress(planes))
    except ImportError:
        pass
    rest = {"values packed": len(v), "values zlib-6": len(zlib.compress(v, 6)), "scales": len(s),
            "scales zlib-6": len(zlib.compress(s, 6))}
    wire = {c or "packed": C.encode((indices, values, scales), offsets, topk=TOPK, value_bits=BITS,
                                    coding=c).numel() for c in (None, "zlib")}
    per = {k: round(x / chunks, 2) for k, x in {**index, **rest}.items()}
    return {"chunks": chunks, "index_bytes_per_chunk": {k: per[k] for k in index},
            "other_bytes_per_chunk": {k: per[k] for k in rest},
            "encode_bytes_per_chunk": {k: round(x / chunks, 2) for k, x in wire.items()},
            "ratio_to_fp32": {k: round(4 * n / x, 1) for k, x in wire.items()}}


def timings(n: int, repeats: int = 3) -> dict:
    offsets = R.chunk_offsets([n], CHUNK)
    payload = R.sparse_pack(buffer(n), offsets, topk=TOPK, value_bits=BITS)
    out = {}
    for coding in (None, "zlib"):
        enc, dec = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            wire = C.encode(payload, offsets, topk=TOPK, value_bits=BITS, coding=coding)
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            back = C.decode(wire, offsets, topk=TOPK, value_bits=BITS)
            dec.append(time.perf_counter() - t)
        assert all(torch.equal(a, b) for a, b in zip(back, payload))
        out[coding or "packed"] = {"encode_s": round(min(enc), 3), "decode_s": round(min(dec), 3),
                                   "bytes": wire.numel()}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--time_numel", type=int, default=64 << 20)
    p.add_argument("--json", default=str(HERE / "results/sparse_wire.json"))
    args = p.parse_args()
    result = {"command": " ".join(["python benchmarks/sparse_wire.py"] + sys.argv[1:]), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "streams": streams(args.numel),
              "timings": {"numel": args.time_numel, **timings(args.time_numel)}}
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
