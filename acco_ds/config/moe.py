"""The modes that train models with mixture-of-experts layers (DeepSpeed's ``deepspeed.moe.layer.MoE``): those
whose every collective knows an expert group's own partition (docs/moe.md). The rest, and the layouts experts
cannot run on, are refused by name in the rulebook (``acco_ds.config.rulebook``)."""

MOE_MODES = ("acco", "dpu", "sync", "diloco", "co2", "edit", "sparseloco", "decoupled")

__all__ = ["MOE_MODES"]
