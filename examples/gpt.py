"""The byte-level GPT and its data, shared by every script that trains it: the DeepSpeed example
(``train_gpt.py``), the PyTorch/FSDP2 example (``fsdp2_train_gpt.py``) and the benchmark workers. No
DeepSpeed here, so the torch host's scripts import it too.

The corpus needs no download: the ``.py`` files of the running Python's standard library, read as bytes (a
256-token vocabulary); the last 10% is held out for validation.
"""

import glob
import math
import os
import sysconfig

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------- data


def load_corpus(max_bytes: int = 8_000_000) -> torch.Tensor:
    """The standard library's .py files, sorted by path, concatenated as bytes (uint8: 1 byte a token in
    memory; ``Batches`` makes the windows it draws int64)."""
    root = sysconfig.get_paths()["stdlib"]
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        if "site-packages" in path:
            continue
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data, dtype=torch.uint8)[:max_bytes].clone()


class Batches:
    """Random windows of the corpus; micro-batch ``i`` of rank ``r`` is the same on every run."""

    def __init__(self, data: torch.Tensor, block_size: int, batch_size: int, seed: int):
        self.data, self.block_size, self.batch_size, self.seed = data, block_size, batch_size, seed

    def get(self, i: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        starts = torch.randint(len(self.data) - self.block_size - 1, (self.batch_size, ), generator=g)
        x = torch.stack([self.data[s:s + self.block_size] for s in starts.tolist()]).long()
        y = torch.stack([self.data[s + 1:s + 1 + self.block_size] for s in starts.tolist()]).long()
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


def warmup_cosine(warmup_num_steps=1000, total_num_steps=10000, cos_min_ratio=0.0001, warmup_min_ratio=0.0,
                  warmup_type="log", **_):
    """DeepSpeed's WarmupCosineLR as a LambdaLR factor of the optimizer steps taken (DeepSpeed's
    last_batch_iteration is that count minus 1)."""
    warmup = max(2, warmup_num_steps)

    def ratio(steps):
        it = steps - 1
        if it < 0:
            return 0.0
        if it < warmup:
            r = math.log(it + 1) / math.log(warmup) if warmup_type == "log" else it / warmup
            return warmup_min_ratio + r * (1 - warmup_min_ratio)
        progress = min(1.0, (it - warmup + 1) / max(1, total_num_steps - warmup))
        return max(0.0, cos_min_ratio + (1 - cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    return ratio


@torch.no_grad()
def evaluate(model, batches, n_batches, device="cpu"):
    """Mean loss over held-out batches 0..n-1, split across ranks (torch.distributed). Every rank runs the
    same number of forwards (FSDP2's gathers are collective). ``model.eval()``: on the torch host the
    forward passes see the committed weights."""
    import torch.distributed as dist
    model.eval()
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.zeros(2, device=device)
    for i in range(rank, math.ceil(n_batches / world) * world, world):
        x, y = batches.get(i % n_batches)
        loss = float(model(x.to(device), y.to(device)))
        if i < n_batches:
            total += torch.tensor([loss, 1.0], device=device)
    dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def add_model_args(parser) -> None:
    """The model and corpus flags every script training this GPT takes (the quickstart's 0.84M-parameter
    defaults); build it with ``GPT(args.n_layer, args.n_head, args.n_embd, args.block_size)``."""
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--corpus_bytes", type=int, default=8_000_000)


__all__ = ["load_corpus", "Batches", "Block", "GPT", "param_groups", "warmup_cosine", "evaluate", "add_model_args"]
