"""The GPT-2-shaped model and the data of ``gpu_check.py`` (and of its local-SGD ranks, ``gpu_local_sgd.py``):
the standard library's own source as bytes, fixed random windows, pre-LN blocks with a tied head."""

import glob
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TINY_SHAPE = dict(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=256)
GPT2_SMALL = dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)


def load_corpus(max_bytes):
    """The standard library's own .py files, sorted by path, as bytes (no download)."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True)):
        if "site-packages" not in path:
            data += Path(path).read_bytes()
        if len(data) >= max_bytes:
            break
    return torch.frombuffer(data[:max_bytes], dtype=torch.uint8).long()


def batch(data, i, micro, block_size, device, seed=1_000_003):
    """Micro-batch ``i``: the same ``micro`` windows of ``block_size`` tokens in every run."""
    g = torch.Generator().manual_seed(seed + i)
    starts = torch.randint(len(data) - block_size - 1, (micro, ), generator=g).tolist()
    x = torch.stack([data[s:s + block_size] for s in starts])
    y = torch.stack([data[s + 1:s + 1 + block_size] for s in starts])
    return x.to(device), y.to(device)


class Block(nn.Module):
    """A pre-LN block; with ``moe`` (``deepspeed.moe.layer.MoE`` keywords: num_experts, ep_size, k) its MLP is
    a DeepSpeed mixture of experts whose load-balancing loss ``l_aux`` the block keeps for the model's loss."""

    def __init__(self, n_embd, n_head, moe=None):
        super().__init__()
        self.n_head, self.ln1, self.ln2 = n_head, nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))
        self.l_aux = None
        if moe is not None:
            from deepspeed.moe.layer import MoE
            self.mlp = MoE(n_embd, self.mlp, **moe)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
                   for t in self.qkv(self.ln1(x)).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        if not isinstance(self.mlp, nn.Sequential):
            out, self.l_aux, _ = self.mlp(self.ln2(x))
            return x + out
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-2 shaped: token + position embeddings, pre-LN blocks, tied output head; returns the loss."""

    def __init__(self, n_layer, n_head, n_embd, block_size, vocab_size, moe=None, aux_weight=0.01):
        super().__init__()
        self.aux_weight = aux_weight
        self.tok, self.pos = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, moe) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear) and mod.bias is not None:  # an MoE gate has none
                nn.init.zeros_(mod.bias)

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.t()
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        aux = [b.l_aux for b in self.blocks if b.l_aux is not None]
        return loss + self.aux_weight * sum(aux) if aux else loss


class StepProfiler:
    """``torch.profiler`` over micro-batches ``[start, stop)`` of a run; ``tables()`` gives the top ops by self
    device time and by self CPU time (where a mode's time goes next to stock's)."""

    def __init__(self, start, stop, cuda, rows=25):
        self.start, self.stop, self.cuda, self.rows, self.prof = start, stop, cuda, rows, None

    def step(self, i):
        from torch.profiler import ProfilerActivity, profile
        if i == self.start:
            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self.prof = profile(activities=acts)
            self.prof.__enter__()
        elif i == self.stop:
            self.close()

    def close(self):
        if self.prof is not None and not getattr(self, "closed", False):
            self.closed = True
            if self.cuda:
                torch.cuda.synchronize()
            self.prof.__exit__(None, None, None)

    def tables(self):
        if self.prof is None:
            return None
        ka = self.prof.key_averages()
        keys = (["self_device_time_total"] if self.cuda else []) + ["self_cpu_time_total"]
        return {k: ka.table(sort_by=k, row_limit=self.rows, max_name_column_width=60) for k in keys}
