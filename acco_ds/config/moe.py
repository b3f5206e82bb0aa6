"""The rules for models with mixture-of-experts layers (DeepSpeed's ``deepspeed.moe.layer.MoE``): which modes
train them, and what is refused by name (docs/moe.md)."""

from typing import Optional

# Mixture of experts (DeepSpeed's ``deepspeed.moe.layer.MoE``): the modes whose every collective knows an expert
# group's own partition (docs/moe.md). The others are refused by name until they do.
MOE_MODES = ("acco", "dpu", "sync", "diloco", "co2", "edit", "sparseloco")


def moe_problems(acco: Optional["ACCOConfig"], pipeline_stages: int = 1) -> list:  # noqa: F821 - acco.ACCOConfig
    """What keeps ``acco`` from training a model with MoE layers: one message per problem, naming the fix."""
    if acco is None:
        return []
    problems = []
    if pipeline_stages > 1:
        problems.append(f"ACCO does not support MoE layers in a pipeline of {pipeline_stages} stages yet: train the "
                        f'MoE model without pipeline parallelism, or set "acco": {{"enabled": false}}')
    if acco.mode not in MOE_MODES:
        problems.append(f'acco.mode="{acco.mode}" does not support MoE layers (expert parallel groups) yet: its '
                        f'outer loop partitions every parameter group over the whole replica. Use one of '
                        f'{", ".join(MOE_MODES)} with MoE, or set "acco": {{"enabled": false}}')
    # acco.fault_tolerance heals expert shards rank by rank: rank i of every replica holds the same experts.
    return problems


__all__ = ["MOE_MODES", "moe_problems"]
