"""A hand-written tensor-parallel model and a minimal Megatron-style ``mpu``, for 4 ranks as DP=2 x TP=2.

``FullNet`` is the unsplit model (the simulator's); ``TPNet`` holds this rank's shards of it: a
column-parallel first layer (rows of the weight and of its bias), a row-parallel second layer (columns
of the weight; its output is all-reduced over the tensor-parallel group) and a replicated bias."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 16


class FullNet(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def make_full(seed=0):
    torch.manual_seed(seed)
    return FullNet()


class FakeMPU:
    """Ranks r = dp * tp_size + tp: tensor-parallel groups of consecutive ranks, data-parallel across them."""

    def __init__(self, tp_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        self.tp_size, self.dp_size = tp_size, world // tp_size
        self.tp_rank, self.dp_rank = rank % tp_size, rank // tp_size
        self.tp_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(d * tp_size, (d + 1) * tp_size)) for d in range(self.dp_size)])
        self.dp_group, _ = dist.new_subgroups_by_enumeration(
            [list(range(t, world, tp_size)) for t in range(tp_size)])

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_tensor_model_parallel_src_rank(self):
        return dist.get_rank() - self.tp_rank

    def get_data_parallel_rank(self):
        return self.dp_rank

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_data_parallel_group(self):
        return self.dp_group

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_pipeline_model_parallel_rank(self):
        return 0


class _ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's reduce-from-model-parallel region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPNet(nn.Module):

    def __init__(self, mpu: FakeMPU, seed=0):
        super().__init__()
        full, t, n = make_full(seed), mpu.tp_rank, HIDDEN // mpu.tp_size
        self.group = mpu.tp_group
        self.w1 = nn.Parameter(full.fc1.weight.detach()[t * n:(t + 1) * n].clone())
        self.b1 = nn.Parameter(full.fc1.bias.detach()[t * n:(t + 1) * n].clone())
        self.w2 = nn.Parameter(full.fc2.weight.detach()[:, t * n:(t + 1) * n].clone())
        self.b2 = nn.Parameter(full.fc2.bias.detach().clone())  # replicated
        for p, dim in ((self.w1, 0), (self.b1, 0), (self.w2, 1)):  # Megatron's attributes of a split tensor
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.w1, self.b1))
        return _ReduceFromTensorParallel.apply(F.linear(h, self.w2), self.group) + self.b2


def assemble(shards):
    """The unsplit model's flat parameters from the TP ranks' flat shards (fc1.w, fc1.b, fc2.w, fc2.b)."""
    n = HIDDEN // len(shards)
    parts = []
    for s in shards:
        w1, b1, w2, b2 = torch.split(s, [n * 7, n, 3 * n, 3])
        parts.append((w1.view(n, 7), b1, w2.view(3, n), b2))
    w1 = torch.cat([p[0] for p in parts])
    b1 = torch.cat([p[1] for p in parts])
    w2 = torch.cat([p[2] for p in parts], dim=1)
    assert all(torch.equal(p[3], parts[0][3]) for p in parts), "the replicated bias differs across TP ranks"
    return torch.cat([w1.reshape(-1), b1, w2.reshape(-1), parts[0][3]])
