"""Model factories for ``acco-ds plan --measure`` in tests: ``MODULE:FACTORY`` returns ``(module, batch)``."""

import torch
from torch import nn


def tiny():
    """A two-layer MLP and a fixed batch of 16 (its output is not a scalar: the plan takes its mean square)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8)), (torch.randn(16, 32),)
