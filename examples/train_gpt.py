"""Train a small GPT with ACCO, on the Python standard library's own source code.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config configs/acco_cpu.json

Read it top to bottom: data, model, training loop. The only ACCO-specific
lines are ``acco_ds.initialize`` (instead of ``deepspeed.initialize``) and the
``"acco"`` block in the JSON config; everything else is a plain DeepSpeed
script (forward, ``engine.backward``, ``engine.step`` every micro-batch).

The corpus needs no download: the ``.py`` files of the running Python's
standard library, read as bytes (a 256-token vocabulary). The last 10% is
held out for validation.
"""

import argparse
import glob
import json
import math
import os
import resource
import sys
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # run from a checkout
import deepspeed  # noqa: E402

import acco_ds  # noqa: E402

# ----------------------------------------------------------------------------- data


def load_corpus(max_bytes: int = 8_000_000) -> torch.Tensor:
    """The standard library's .py files, sorted by path, concatenated as bytes."""
    root = sysconfig.get_paths()["stdlib"]
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in path:
            continue
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


class Batches:
    """Random windows of the corpus; micro-batch ``i`` of rank ``r`` is the same on every run."""

    def __init__(self, data: torch.Tensor, block_size: int, batch_size: int, seed: int):
        self.data, self.block_size, self.batch_size, self.seed = data, block_size, batch_size, seed

    def get(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        starts = torch.randint(len(self.data) - self.block_size - 1, (self.batch_size, ), generator=g)
        x = torch.stack([self.data[s:s + self.block_size] for s in starts.tolist()])
        y = torch.stack([self.data[s + 1:s + 1 + self.block_size] for s in starts.tolist()])
        return x, y


# ---------------------------------------------------------------------------- model


class Block(nn.Module):

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A byte-level GPT: token + position embeddings, n_layer blocks, tied output head."""

    def __init__(self, n_layer=4, n_head=4, n_embd=128, block_size=128, vocab_size=256):
        super().__init__()
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, n_embd)
        self.pos = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.t()
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def param_groups(model, weight_decay):
    """Weight decay on matrices only, as GPT recipes do."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ------------------------------------------------------------------------- training


@torch.no_grad()
def evaluate(engine, batches, n_batches, device):
    """Mean validation loss over fixed batches, split across ranks."""
    engine.eval()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    total = torch.zeros(2, device=device)
    for i in range(rank, n_batches, world):
        x, y = batches.get(i)
        total += torch.tensor([float(engine(x.to(device), y.to(device))), 1.0], device=device)
    deepspeed.comm.all_reduce(total)
    engine.train()
    return (total[0] / total[1]).item()


def link_tx_bytes():
    """(bytes sent, TCP segments retransmitted) so far on the interface gloo uses (GLOO_SOCKET_IFNAME),
    from the kernel's counters (this network namespace's); None when gloo is not bound to one interface.
    Benchmarks read bytes on the wire from here."""
    path = f"/sys/class/net/{os.environ.get('GLOO_SOCKET_IFNAME', '')}/statistics/tx_bytes"
    if not os.environ.get("GLOO_SOCKET_IFNAME") or not os.path.exists(path):
        return None
    with open(path) as f:
        sent = int(f.read())
    with open("/proc/net/snmp") as f:
        tcp = [line.split() for line in f if line.startswith("Tcp:")]
    return sent, int(tcp[1][tcp[0].index("RetransSegs")])


def acco_totals(engine):
    """Cumulative ACCO round figures (None for a stock engine)."""
    if not hasattr(engine, "acco_stats"):
        return None
    s = engine.acco_stats()
    return {k: s[k] for k in ("rounds", "micro_batches", "compute_s", "wait_s", "comm_s", "reduce_scatter_s",
                              "stats_allreduce_s", "update_s", "all_gather_s")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    parser.add_argument("--steps", type=int, default=30, help="committed optimizer steps")
    parser.add_argument("--tokens", type=int, default=0, help="stop after this many training tokens (overrides --steps)")
    parser.add_argument("--mode", choices=["acco", "dpu", "sync", "zero1"], default=None,
                        help="override the config's acco.mode; zero1 removes the acco block (stock DeepSpeed)")
    parser.add_argument("--accumulation", choices=["fixed", "adaptive"], default=None)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--corpus_bytes", type=int, default=8_000_000)
    parser.add_argument("--eval_interval", type=int, default=10, help="committed steps between validations")
    parser.add_argument("--eval_batches", type=int, default=8)
    parser.add_argument("--warmup_steps", type=int, default=0, help="steps excluded from the throughput figures")
    parser.add_argument("--slow_rank", type=int, default=-1, help="benchmark only: slow this rank's compute")
    parser.add_argument("--slow_factor", type=float, default=1.0)
    parser.add_argument("--results", default=None, help="write a JSON summary here (rank 0)")
    parser.add_argument("--seed", type=int, default=1234)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    if args.mode == "zero1":
        config.pop("acco", None)
    elif args.mode or args.accumulation or (args.slow_factor > 1 and "acco" in config):
        config.setdefault("acco", {"enabled": True})
        if args.mode:
            config["acco"]["mode"] = args.mode
        if args.accumulation:
            config["acco"]["accumulation"] = args.accumulation
        if args.slow_factor > 1:
            config["acco"]["emulation"] = {"slow_rank": args.slow_rank, "slow_factor": args.slow_factor}
    args.deepspeed_config = None  # the dict below is the config now

    torch.manual_seed(args.seed)
    data = load_corpus(args.corpus_bytes)
    split = int(0.9 * len(data))
    model = GPT(args.n_layer, args.n_head, args.n_embd, args.block_size)
    opt_params = config.get("optimizer", {}).get("params", {})
    engine, _, _, _ = acco_ds.initialize(args=args, model=model,
                                         model_parameters=param_groups(model, opt_params.get("weight_decay", 0.0)),
                                         config=config)
    device = engine.device
    micro_bs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    train = Batches(data[:split], args.block_size, micro_bs, seed=args.seed + 1 + rank)
    val = Batches(data[split:], args.block_size, micro_bs, seed=args.seed)
    tokens_per_step = micro_bs * gas * world * args.block_size
    steps = math.ceil(args.tokens / tokens_per_step) if args.tokens else args.steps
    acco_cfg = config.get("acco", {})
    label = acco_cfg.get("mode", "acco") + "/" + acco_cfg.get("accumulation", "fixed") \
        if acco_cfg.get("enabled") else "stock ZeRO-1"
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"GPT {n_params / 1e6:.2f}M params | {label} | {world} ranks | micro-batch {micro_bs} x "
              f"{gas} accumulation | {tokens_per_step} tokens/step | {steps} steps | corpus {len(data) / 1e6:.1f}MB "
              f"of stdlib source", flush=True)

    history = [{"step": 0, "tokens": 0, "time": 0.0, "val_loss": evaluate(engine, val, args.eval_batches, device)}]
    bar = None
    if rank == 0:
        try:
            from tqdm import tqdm
            bar = tqdm(total=steps, unit="step", dynamic_ncols=True)
        except ImportError:
            pass
    # Benchmark only: stock DeepSpeed has no ACCO emulation block, so slow its rank here, the same way.
    slow_here = args.slow_factor > 1 and rank == args.slow_rank and not acco_cfg.get("enabled")
    micro, losses, eval_time = 0, [], 0.0
    start = time.perf_counter()
    warm = {"time": start, "step": 0, "samples": 0, "stats": None, "tx": link_tx_bytes()}
    end = warm
    while engine.global_steps < steps:
        x, y = train.get(micro)
        before = engine.global_steps
        t0 = time.perf_counter()
        loss = engine(x.to(device), y.to(device))
        engine.backward(loss)  # with ACCO, a round may end here and commit a step
        if slow_here:
            time.sleep((args.slow_factor - 1) * (time.perf_counter() - t0))
        engine.step()
        micro += 1
        losses.append(loss.item())
        if engine.global_steps == before:
            continue
        # A step was committed: the module holds the new parameters.
        first_after_warmup = args.warmup_steps and warm["step"] == 0 and engine.global_steps >= args.warmup_steps
        if first_after_warmup or engine.global_steps >= steps:
            # The measured window runs from commit to commit (a final evaluation, which waits for the round
            # already in flight and may commit it, stays outside).
            mark = {"time": time.perf_counter() - eval_time, "step": engine.global_steps,
                    "samples": engine.global_samples, "stats": acco_totals(engine), "tx": link_tx_bytes()}
            if first_after_warmup:
                warm = mark
            end = mark
        elapsed = time.perf_counter() - start - eval_time
        tokens = engine.global_steps * tokens_per_step
        train_loss = sum(losses[-2 * gas:]) / len(losses[-2 * gas:])
        if engine.global_steps % args.eval_interval == 0 or engine.global_steps == steps:
            t0 = time.perf_counter()
            history.append({"step": engine.global_steps, "tokens": tokens, "time": elapsed,
                            "val_loss": evaluate(engine, val, args.eval_batches, device), "train_loss": train_loss})
            eval_time += time.perf_counter() - t0
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens / elapsed:,.0f}")
    elapsed = end["time"] - start
    measured = end["time"] - warm["time"]
    measured_steps = end["step"] - warm["step"]
    if bar is not None:
        bar.close()

    summary = {
        "label": label, "world_size": world, "steps": end["step"], "tokens": end["step"] * tokens_per_step,
        "train_time_s": elapsed, "tokens_per_s": end["step"] * tokens_per_step / elapsed,
        "samples_per_s": end["samples"] / elapsed, "step_time_s": elapsed / max(end["step"], 1),
        "first_loss": history[0]["val_loss"], "final_val_loss": history[-1]["val_loss"],
        "final_train_loss": sum(losses[-2 * gas:]) / len(losses[-2 * gas:]), "history": history,
        "micro_batches": micro, "skipped_steps": engine.skipped_steps,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        # Throughput after --warmup_steps (all steps when 0).
        "measured_steps": measured_steps, "measured_time_s": measured,
        "measured_samples_per_s": (end["samples"] - warm["samples"]) / measured,
        "measured_step_time_s": measured / max(measured_steps, 1),
    }
    if end["tx"] is not None:  # bytes this rank sent on gloo's interface over the measured steps
        sent = torch.tensor([float(a - b) for a, b in zip(end["tx"], warm["tx"])], dtype=torch.float64,
                            device=device)
        gathered = [torch.zeros_like(sent) for _ in range(world)]
        deepspeed.comm.all_gather(gathered, sent)
        summary["measured_tx_bytes_per_rank"] = [int(t[0].item()) for t in gathered]
        summary["measured_tcp_retransmits_per_rank"] = [int(t[1].item()) for t in gathered]
    if hasattr(engine, "acco_stats"):
        stats = engine.acco_stats()
        stats.pop("last_rounds", None)
        shares = torch.tensor([micro], dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(shares) for _ in range(world)]
        deepspeed.comm.all_gather(gathered, shares)
        stats["micro_batches_per_rank"] = [int(t.item()) for t in gathered]
        if warm["stats"] is not None:
            stats["measured"] = {k: end["stats"][k] - warm["stats"][k] for k in end["stats"]}
        summary["acco"] = stats
    if rank == 0:
        print("\n==== summary ====")
        print(f"run            : {label} on {world} ranks ({device})")
        print(f"steps / tokens : {summary['steps']} / {summary['tokens']:,}")
        print(f"time           : {elapsed:.1f} s  ({summary['tokens_per_s']:,.0f} tokens/s, "
              f"{summary['step_time_s']:.3f} s/step)")
        print(f"peak memory    : {summary['peak_rss_mb']:.0f} MB resident on rank 0")
        print(f"val loss       : {summary['first_loss']:.3f} -> {summary['final_val_loss']:.3f} "
              f"(train {summary['final_train_loss']:.3f}; ln(256) = {math.log(256):.3f} is chance)")
        if "acco" in summary:
            s = summary["acco"]
            hidden = "n/a" if s["hidden_comm_fraction"] is None else f"{100 * s['hidden_comm_fraction']:.0f}%"
            print(f"ACCO rounds    : {s['rounds']} rounds, {s['mean_micro_per_round']:.2f} micro-batches/round, "
                  f"communication {s['comm_s']:.2f} s of which {hidden} hidden behind compute "
                  f"(compute waited {s['wait_s']:.2f} s)")
            print(f"micro-batches  : per rank {s['micro_batches_per_rank']}; kernels={s['kernels']}, "
                  f"update={s['optimizer_update']}")
        if args.results:
            os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
            with open(args.results, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"results        : {args.results}")
    engine.destroy()


if __name__ == "__main__":
    main()
