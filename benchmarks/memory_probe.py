"""Where the memory goes: stock ZeRO-1 vs ACCO on a model-states workload, with attribution.

    python benchmarks/memory_probe.py [--dtype fp32] [--steps 4] [--fix norm64,...] [--out FILE]

Workload (issue 19, item 7): about 21M parameters in a few large layers (embedding 4096x1024 and
four 1024<->4096 linears, the embedding tied as the output head), micro-batch 2 x 8 tokens,
gradient accumulation 2, 2 ranks (gloo, DS_ACCELERATOR=cpu), AdamW. Activations are tiny, so the
peak is model states plus whatever the optimizer allocates.

Each rank records, at phases (after initialize, after the first backward, after the first
``engine.step()``, after the first committed optimizer step, at the end):

* current RSS (``/proc/self/statm``) and peak RSS (``ru_maxrss``);
* tensor bytes: every live tensor found by ``gc`` (unique storages) and the part that hangs off
  named attributes of the ZeRO optimizer (``bit16_groups_flat``, ``single_partition_of_fp32_groups``,
  ``averaged_gradients``, optimizer state, ACCO's ``buffers[i].acc`` ...), plus ``param.grad``;
* the peak-RSS increments per micro-step (forward / backward / step), which locate the peak.

``--fix`` applies prototype changes by monkeypatching (see ``FIXES``) so their effect can be
measured before they go into the package. ``benchmarks/memory.py --workload states`` runs the
same workload without the attribution detail.
"""

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 2**20


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _storage_key(t):
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except Exception:  # noqa: BLE001 - meta tensors and the like
        return None


def live_tensor_bytes() -> int:
    """Bytes of all unique CPU storages reachable as tensors through gc."""
    import torch
    seen = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                k = _storage_key(obj)
                if k is not None and k[0]:
                    seen[k[0]] = max(seen.get(k[0], 0), k[1])
        except Exception:  # noqa: BLE001
            continue
    return sum(seen.values())


def _tensors_in(obj, path, out, depth=0):
    import torch
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        out.append((path, obj))
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            _tensors_in(x, f"{path}[{i}]", out, depth + 1)
    elif isinstance(obj, dict):
        for k, x in list(obj.items()):
            key = k if isinstance(k, (str, int)) else type(k).__name__
            _tensors_in(x, f"{path}[{key}]", out, depth + 1)
    elif hasattr(obj, "__dataclass_fields__") or type(obj).__name__ in ("GradPartitionBufferGroup", "IPGBucket"):
        for k, x in list(vars(obj).items()):
            _tensors_in(x, f"{path}.{k}", out, depth + 1)


def attribute(engine) -> dict:
    """Bytes per named attribute of the ZeRO optimizer (unique storages, first name wins), param.grad."""
    opt = engine.optimizer
    found = []
    order = ["bit16_groups_flat", "single_partition_of_fp32_groups", "buffers"]
    names = order + sorted(k for k in vars(opt) if k not in order)
    for k in names:
        if k in ("param_dict", "bit16_groups", "round_robin_bit16_groups", "params_in_partition",
                 "params_not_in_partition", "parallel_partitioned_bit16_groups", "round_robin_bit16_meta"):
            continue  # views of bit16_groups_flat / the module parameters
        _tensors_in(getattr(opt, k, None), k, found)
    inner = opt.optimizer
    for p, st in inner.state.items():
        for k, v in st.items():
            _tensors_in(v, f"optimizer.state.{k}", found)
    for i, p in enumerate(engine.module.parameters()):
        if p.grad is not None:
            found.append((f"param.grad", p.grad))
        if getattr(p, "grad_accum", None) is not None:
            found.append((f"param.grad_accum", p.grad_accum))
    seen, rows = set(), {}
    for path, t in found:
        k = _storage_key(t)
        if k is None or not k[0] or k[0] in seen or t.device.type != "cpu":
            continue
        seen.add(k[0])
        label = path.split("[")[0] if not path.startswith("buffers") else "buffers." + path.split(".", 1)[-1]
        if path.startswith("optimizer.state") or path.startswith("param."):
            label = path
        rows[label] = rows.get(label, 0) + k[1]
    return rows


# ----------------------------------------------------------------- prototype fixes (monkeypatches)
def fix_norm64():
    """The ACCO job's ``torch.linalg.vector_norm(shard, dtype=torch.float64)`` casts the whole fp32 shard
    to a float64 temporary (8N/W bytes) before reducing. Compute it in chunks of 1M elements instead."""
    import torch
    original = torch.linalg.vector_norm
    chunk = 1 << 20

    def vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None, out=None):
        if (dtype == torch.float64 and x.dtype != torch.float64 and ord == 2 and dim is None and out is None
                and x.dim() == 1 and x.numel() > chunk):
            sq = sum(original(c, dtype=torch.float64)**2 for c in x.split(chunk))
            return sq.sqrt()
        return original(x, ord, dim, keepdim, dtype=dtype, out=out)

    torch.linalg.vector_norm = vector_norm


def fix_mmap():
    """Not a code change: glibc's dynamic mmap threshold. Tested by the env var in the driver."""


def _acco_module(*names):
    import importlib
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(names)


TRACE = []  # (what, thread, rss before, rss after, peak increase) of traced calls


def fix_trace():
    """Not a fix: record the peak-RSS increase and RSS change of each step of the communication job."""
    import threading

    import torch
    coll = _acco_module("acco_ds.runtime.comm.collectives", "acco_ds.runtime.collectives", "acco_ds.collectives")
    upd = _acco_module("acco_ds.runtime.rounds.update", "acco_ds.runtime.update", "acco_ds.update")

    def traced(what, fn):
        def wrapper(*a, **k):
            r0, p0 = rss_bytes(), peak_bytes()
            try:
                return fn(*a, **k)
            finally:
                TRACE.append((what, threading.current_thread().name, r0, rss_bytes(), peak_bytes() - p0))
        return wrapper

    coll.reduce_scatter = traced("reduce_scatter", coll.reduce_scatter)
    coll.all_gather = traced("all_gather", coll.all_gather)
    upd.ShardUpdate.__call__ = traced("update (Peek/commit)", upd.ShardUpdate.__call__)
    torch.linalg.vector_norm = traced("vector_norm", torch.linalg.vector_norm)


FIXES = {"norm64": fix_norm64, "trace": fix_trace}


# ----------------------------------------------------------------------------------- rank worker
def build_model():
    import torch

    class StatesHeavy(torch.nn.Module):
        """Embedding 4096x1024 (tied output head) and four 1024<->4096 linears: ~21M parameters."""

        def __init__(self, vocab=4096, d=1024, hidden=4096):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, d)
            self.l1, self.l2 = torch.nn.Linear(d, hidden, bias=False), torch.nn.Linear(hidden, d, bias=False)
            self.l3, self.l4 = torch.nn.Linear(d, hidden, bias=False), torch.nn.Linear(hidden, d, bias=False)

        def forward(self, x):
            h = self.emb(x)
            h = h + self.l2(torch.relu(self.l1(h)))
            h = h + self.l4(torch.relu(self.l3(h)))
            logits = h.float() @ self.emb.weight.float().t()
            return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                                                     x[:, 1:].reshape(-1))

    return StatesHeavy()


def config(dtype, acco, gas=2, micro=2):
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
    }
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    compress = None
    if isinstance(acco, str) and acco.endswith("+int8"):  # compressed rounds (one machine: name what to compress)
        acco, compress = acco[:-len("+int8")], {"dtype": "int8", "apply_to": ["rounds"]}
        acco = True if acco == "acco" else acco
    if acco is True:
        cfg["acco"] = {"enabled": True, "mode": "acco", "accumulation": "fixed", "kernels": "auto"}
    elif acco in ("dpu", "sync"):  # the other round modes
        cfg["acco"] = {"enabled": True, "mode": acco, "accumulation": "fixed", "kernels": "auto"}
    elif acco:  # a mode name of the local-SGD family with its replica group size: "diloco:2"
        mode, k = acco.split(":")
        cfg["acco"] = {"enabled": True, "mode": mode, "local_sgd": {"sync_every": 2, "replica_group_size": int(k)}}
    if compress:
        cfg["acco"]["compression"] = compress
    return cfg


def worker(args):
    for name in filter(None, args.fix.split(",")):
        FIXES[name]()
    import torch
    torch.set_num_threads(1)
    import deepspeed

    import acco_ds

    phases, micro_log = {}, []

    def mark(name, engine=None, detail=True):
        gc.collect()
        row = {"rss": rss_bytes(), "peak": peak_bytes()}
        if detail:
            row["tensors"] = live_tensor_bytes()
            if engine is not None:
                row["attributed"] = attribute(engine)
        phases[name] = row

    mark("start", detail=False)
    torch.manual_seed(0)
    model = build_model()
    if args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    mark("model built", detail=False)
    cfg = config(args.dtype, True if args.mode == "acco" else (args.mode if args.mode != "stock" else None))
    init = deepspeed.initialize if args.mode == "stock" else acco_ds.initialize
    engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=cfg)
    mark("after initialize", engine)
    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    micro, first_commit = 0, False
    while engine.global_steps < args.steps and micro < 100:
        x = torch.randint(0, 4096, (2, 8), generator=g)
        before = peak_bytes()
        loss = engine(x)
        after_fwd = peak_bytes()
        engine.backward(loss)
        after_bwd = peak_bytes()
        if micro == 0:
            mark("after first backward", engine)
        engine.step()
        after_step = peak_bytes()
        micro_log.append({"micro": micro, "global_steps": engine.global_steps, "fwd": after_fwd - before,
                          "bwd": after_bwd - after_fwd, "step": after_step - after_bwd, "peak": after_step,
                          "rss": rss_bytes()})
        if micro == 0:
            mark("after first step()", engine)
        if engine.global_steps >= 1 and not first_commit:
            first_commit = True
            mark("after first optimizer step", engine)
        micro += 1
    if hasattr(engine.optimizer, "drain"):
        engine.optimizer.drain()
    time.sleep(0.2)
    mark("end", engine)
    out = {"rank": torch.distributed.get_rank(), "mode": args.mode, "dtype": args.dtype, "n_params": n,
           "phases": phases, "micro": micro_log, "fix": args.fix, "torch": torch.__version__, "trace": TRACE[:200],
           "buffer_bytes": engine.optimizer.buffer_bytes() if hasattr(engine.optimizer, "buffer_bytes") else None}
    with open(f"{args.out}.rank{out['rank']}.json", "w") as f:
        json.dump(out, f)


# ------------------------------------------------------------------------------------- driver
def launch(mode, dtype, steps, fix, port, tmp, extra_env=None, world=2):
    """Run ``worker`` on ``world`` ranks; returns the per-rank result dicts."""
    out = os.path.join(tmp, f"{mode}_{dtype}_{fix or 'none'}_{port}")
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
                   OMP_NUM_THREADS="1", **(extra_env or {}))
        cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--dtype", dtype, "--steps", str(steps),
               "--fix", fix, "--out", out]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=900)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"{mode} {dtype} failed:\n" + "\n".join(log[-3000:] for log in logs))
    return [json.load(open(f"{out}.rank{r}.json")) for r in range(world)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="acco", help='acco, dpu, sync, stock, or a local-SGD mode and k: "diloco:2"')
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--fix", default="", help=f"comma-separated prototype fixes: {', '.join(FIXES)}")
    p.add_argument("--malloc", default="", help="extra env for the ranks, e.g. MALLOC_MMAP_THRESHOLD_=131072")
    p.add_argument("--port", type=int, default=29671)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    tmp = tempfile.mkdtemp(prefix="acco_memprobe_")
    extra = dict(kv.split("=", 1) for kv in args.malloc.split(",") if kv)
    stock = launch("stock", args.dtype, args.steps, "", args.port, tmp, extra)
    acco = launch("acco", args.dtype, args.steps, args.fix, args.port + 1, tmp, extra)
    n, b = stock[0]["n_params"], 4 if args.dtype == "fp32" else 2
    print(f"\nworkload: {n / 1e6:.2f}M params, {args.dtype}, bN = {b * n / MB:.1f} MB, 2 ranks; fix={args.fix!r} "
          f"malloc={args.malloc!r}")
    print(f"| phase (rank 0) | stock RSS | stock peak | ACCO RSS | ACCO peak | peak ACCO-stock | "
          f"tensors stock | tensors ACCO |")
    print("|---|---|---|---|---|---|---|---|")
    for ph in acco[0]["phases"]:
        s, a = stock[0]["phases"].get(ph), acco[0]["phases"][ph]
        if s is None:
            continue
        ts, ta = s.get("tensors"), a.get("tensors")
        print(f"| {ph} | {s['rss'] / MB:.0f} | {s['peak'] / MB:.0f} | {a['rss'] / MB:.0f} | {a['peak'] / MB:.0f} | "
              f"{(a['peak'] - s['peak']) / MB:+.0f} | {'' if ts is None else f'{ts / MB:.0f}'} | "
              f"{'' if ta is None else f'{ta / MB:.0f}'} |")
    for r in range(2):
        print(f"rank {r}: peak stock {stock[r]['phases']['end']['peak'] / MB:.0f} MB, ACCO "
              f"{acco[r]['phases']['end']['peak'] / MB:.0f} MB, ACCO - stock "
              f"{(acco[r]['phases']['end']['peak'] - stock[r]['phases']['end']['peak']) / MB:+.0f} MB "
              f"(target <= 1.5 bN + 64 = {(1.5 * b * n) / MB + 64:.0f} MB)")
    for label, res in (("stock", stock), ("ACCO", acco)):
        print(f"\n{label} rank 0, peak-RSS increments per micro-step (MB):")
        for m in res[0]["micro"]:
            print(f"  micro {m['micro']} (global_steps {m['global_steps']}): fwd +{m['fwd'] / MB:.0f} "
                  f"bwd +{m['bwd'] / MB:.0f} step +{m['step'] / MB:.0f} -> peak {m['peak'] / MB:.0f}, "
                  f"rss {m['rss'] / MB:.0f}")
    for label, res in (("stock", stock), ("ACCO", acco)):
        if res[0].get("trace"):
            print(f"\n{label} rank 0, traced calls (first 24): what, thread, RSS before -> after, peak increase (MB)")
            for what, thread, r0, r1, dp in res[0]["trace"][:24]:
                print(f"  {what:<22} {thread:<12} {r0 / MB:6.0f} -> {r1 / MB:6.0f}   peak +{dp / MB:.0f}")
    for ph in ("after initialize", "after first optimizer step", "end"):
        print(f"\nattributed tensor bytes at '{ph}' (rank 0, MB):")
        keys = sorted(set(stock[0]["phases"][ph].get("attributed", {}))
                      | set(acco[0]["phases"][ph].get("attributed", {})))
        for k in keys:
            sv = stock[0]["phases"][ph]["attributed"].get(k, 0)
            av = acco[0]["phases"][ph]["attributed"].get(k, 0)
            if sv or av:
                print(f"  {k:<45} stock {sv / MB:8.1f}   ACCO {av / MB:8.1f}")
    if args.out:
        json.dump({"stock": stock, "acco": acco, "args": vars(args)}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    sys.exit(main())
