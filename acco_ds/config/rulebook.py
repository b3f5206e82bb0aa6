"""The rulebook: every combination of an ``"acco"`` block and a layout that acco_ds refuses, each with its message.

``refusals(acco, layout)`` answers for one block on one ``Layout`` (the global world and the ranks per node;
tensor, pipeline and expert-parallel sizes; whether the model has experts; micro-batches per step; the host).
Both hosts call it before they build anything (``acco_ds.deepspeed.initialize``, ``acco_ds.torch.initialize``),
and ``acco-ds plan`` calls it for every row it prints, so the plan never recommends what ``initialize`` refuses.
Nothing here reads the environment: a host reads ``LOCAL_WORLD_SIZE`` once (``Layout.launch``), the plan passes
its own fleet, and inside or outside a launch the same layout gets the same answer.

The rules are the functions of ``RULES``; the first line of each docstring is listed on the plan's page
(``python -m acco_ds.config.reference`` writes it). Rules that need a live engine stay with the engine, which
checks them when it builds the piece they are about:

- a tensor-parallel parameter without Megatron's ``partition_dim`` under sparseloco (``runtime/outer/sparse_tp.py``);
- a Streaming DiLoCo fragment that gets no parameter (``runtime/outer/streaming.py``);
- an expert-parallel group that crosses a replica, outside DeepSpeed's default expert layout (``deepspeed/moe.py``);
- decoupled learners of another model, tensor, pipeline or expert-parallel size on one syncer (the first
  learner's holds; a shard refuses another at HELLO: ``runtime/outer/decoupled/handlers.py``,
  ``config/decoupled.shape_refusal``), and a syncer whose shard count does not suit a learner
  (``runtime/outer/decoupled/connect.py``);
- a checkpoint saved on another layout, mode or ``ep_size`` (``deepspeed/checkpoint.py``, ``runtime/reshard.py``);
- the torch host's model and optimizer themselves (``acco_ds/torch/__init__.py``);
- DeepSpeed's own settings beside the block (ZeRO stage, offload, ZenFlow: ``check_deepspeed_config``).
"""

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .decoupled import learner_launch_size
from .local_sgd import ROUND_MODES
from .moe import MOE_MODES

HOSTS = ("deepspeed", "torch", "fsdp2")


@dataclass(frozen=True)
class Layout:
    """Where a block runs: ``world`` ranks in all, ``ranks_per_node`` of them per node (None: one node), each
    model copy ``tp`` x ``pp`` ranks; ``moe``: the model has expert layers, of ``ep_sizes`` (one per expert
    group); ``micro_batches``: ``gradient_accumulation_steps`` (None: not known yet, its rules wait);
    ``host``: ``deepspeed``, ``torch`` (a plain module) or ``fsdp2``."""
    world: int
    ranks_per_node: Optional[int] = None
    tp: int = 1
    pp: int = 1
    moe: bool = False
    ep_sizes: Tuple[int, ...] = ()
    micro_batches: Optional[int] = None
    host: str = "deepspeed"
    sequence_parallel: int = 1

    def __post_init__(self):
        if self.host not in HOSTS:
            raise ValueError(f"Layout.host must be one of {', '.join(HOSTS)}, got {self.host!r}")
        if min(self.world, self.tp, self.pp, self.sequence_parallel) < 1:
            raise ValueError(f"Layout: world {self.world}, tp {self.tp}, pp {self.pp} and sequence parallel "
                             f"{self.sequence_parallel} must be at least 1")

    @classmethod
    def launch(cls, world: int, **facts) -> "Layout":
        """The layout of this launch: the launcher's ranks per node (``LOCAL_WORLD_SIZE`` from torchrun,
        ``LOCAL_SIZE`` from the ``deepspeed`` launcher), else one node."""
        n = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")
        return cls(world=world, ranks_per_node=int(n) if n else None, **facts)

    @property
    def model_parallel(self) -> int:
        return self.tp * self.pp * self.sequence_parallel

    @property
    def dp_world(self) -> int:
        """Data-parallel ranks: the world over the ranks of one model copy (DeepSpeed refuses a world they do
        not divide, in its own words)."""
        return max(1, self.world // self.model_parallel)


def node_size(acco, layout: Layout) -> int:
    """Ranks per node: ``acco.collectives.ranks_per_node``, else the layout's, else the whole world."""
    return int(acco.collectives.ranks_per_node or layout.ranks_per_node or layout.world)


def replica_group_size(acco, layout: Layout) -> int:
    """k, data-parallel ranks per replica: ``local_sgd.replica_group_size``; with ``fault_tolerance``, or a
    decoupled launch that names its syncer, the whole data-parallel world (one launch, one replica); else the
    data-parallel ranks of one node (a replica is a node; a model copy larger than a node is a replica)."""
    k = acco.local_sgd.replica_group_size if acco.local_sgd is not None else None
    if acco.fault_tolerance is not None:
        return layout.dp_world
    if k is not None:
        return int(k)
    return learner_launch_size(acco, layout.dp_world) or max(1, node_size(acco, layout) // layout.model_parallel)


def _round_rules(acco, layout: Layout) -> List[str]:
    """acco needs an even number of micro-batches per step; adaptive accumulation's maximum is at least its
    minimum."""
    gas, out = layout.micro_batches, []
    if gas is None:
        return out
    if acco.mode == "acco" and gas % 2:
        out.append(f'acco.mode="acco" splits every optimizer step into two rounds of gradient_accumulation_steps/2 '
                   f'micro-batches, so gradient_accumulation_steps must be even (got {gas}): set it to '
                   f'{gas + 1 if gas > 1 else 2} or use acco.mode="dpu"/"sync"')
    if acco.accumulation == "adaptive" and acco.max_micro_batches(gas) < acco.micro_batches_per_round(gas):
        low = acco.micro_batches_per_round(gas)
        out.append(f"acco.max_micro_batches_per_round ({acco.max_micro_batches(gas)}) is below the minimum of {low} "
                   f"micro-batches per round implied by gradient_accumulation_steps={gas}: raise it to at least {low}")
    return out


def _replica_rules(acco, layout: Layout) -> List[str]:
    """A local-SGD mode needs replicas that divide the data-parallel world, at least two of them (decoupled: a
    launch may be one learner); with fault tolerance one launch is one replica."""
    if acco.mode in ROUND_MODES:
        return []
    w = layout.dp_world
    k = acco.local_sgd.replica_group_size if acco.local_sgd is not None else None
    if acco.fault_tolerance is not None:
        return [] if k in (None, w) else [
            f"acco.local_sgd.replica_group_size is {k} but with acco.fault_tolerance one launch is one replica, "
            f"of all its {w} data-parallel rank(s): remove replica_group_size (or set it to {w}) and start one "
            f"launch per replica"]
    k = replica_group_size(acco, layout)
    how = "acco.local_sgd.replica_group_size" + ("" if acco.local_sgd and acco.local_sgd.replica_group_size else
                                                 ' ("auto": the data-parallel ranks of a node)')
    if w % k:
        return [f"{how} is {k}, which does not divide the data-parallel world size {w}: set "
                f"acco.local_sgd.replica_group_size to a divisor of {w}"]
    if k == w and acco.mode != "decoupled":
        return [f'{how} is {k}, the whole data-parallel world: one replica, nothing to average. Set '
                f'acco.local_sgd.replica_group_size to a divisor of {w} below it (1 = DiLoCo as published), '
                f'or use acco.mode="sync" for plain ZeRO-1']
    return []


def _collective_rules(acco, layout: Layout) -> List[str]:
    """Nodes tile the world; node-aware collectives need more than one node of more than one rank."""
    n, world = node_size(acco, layout), layout.world
    how = "acco.collectives.ranks_per_node" + ("" if acco.collectives.ranks_per_node else
                                               ' ("auto": LOCAL_WORLD_SIZE or LOCAL_SIZE)')
    if world % n:
        return [f"{how} is {n}, which does not divide the world size {world}: set "
                f"acco.collectives.ranks_per_node to the ranks on each node (a divisor of {world})"]
    if acco.collectives.layout == "hierarchical" and not 1 < n < world:
        return [f'acco.collectives.layout="hierarchical" needs more than one node of more than one rank, but '
                f"{how} is {n} on {world} ranks ({world // n} node(s) of {n}): set "
                f'acco.collectives.ranks_per_node, or layout "auto" or "flat"']
    return []


def _model_rules(acco, layout: Layout, ds_config: Optional[dict]) -> List[str]:
    """No hybrid engine, no sequence parallelism, no adaptive accumulation across pipeline stages."""
    out = []
    if ((ds_config or {}).get("hybrid_engine") or {}).get("enabled"):
        out.append('the hybrid engine is not supported by ACCO: set "hybrid_engine": {"enabled": false} or '
                   '"acco": {"enabled": false}')
    if layout.pp > 1 and acco.accumulation == "adaptive":
        out.append(f'acco.accumulation="adaptive" cannot run with {layout.pp} pipeline stages: a pipeline schedule '
                   f'runs a fixed number of micro-batches per train_batch(). Use accumulation "fixed"')
    if layout.sequence_parallel > 1:
        out.append(f"ACCO does not support sequence parallelism (size {layout.sequence_parallel}): its data-parallel "
                   f"rounds and outer groups would have to span the sequence-parallel ranks, which hold one batch "
                   f'together. Train without it (sequence_parallel_size 1) or set "acco": {{"enabled": false}}')
    return out


def _expert_rules(acco, layout: Layout) -> List[str]:
    """Experts train in the modes whose collectives know expert groups (decoupled learners included), over
    data-parallel ranks only (no tensor or pipeline parallelism beside them), in fixed accumulation when split
    across ranks, and inside a replica (a decoupled learner) in the local-SGD modes."""
    if not layout.moe:
        return []
    out, ep = [], max(layout.ep_sizes, default=1)
    if layout.tp * layout.pp > 1:
        out.append(f"ACCO with MoE layers does not support tensor or pipeline parallelism (tp {layout.tp} x pp "
                   f"{layout.pp}) yet: its expert groups and norms assume experts partitioned over data-parallel "
                   f'ranks only. Train the MoE model with tp 1 and pp 1, or set "acco": {{"enabled": false}}')
    if acco.mode not in MOE_MODES:
        out.append(f'acco.mode="{acco.mode}" does not support MoE layers (expert parallel groups) yet: its outer '
                   f'loop partitions every parameter group over the whole replica. Use one of '
                   f'{", ".join(MOE_MODES)} with MoE, or set "acco": {{"enabled": false}}')
    if ep > 1 and acco.accumulation == "adaptive":
        out.append(f'acco.accumulation="adaptive" cannot run with expert parallelism (ep_size {ep}): every MoE '
                   f"layer's all-to-all pairs the micro-batches of the ranks of an expert-parallel group, so they "
                   f'must end their rounds after the same micro-batches. Use accumulation "fixed", or ep_size 1')
    if acco.mode not in ROUND_MODES and acco.mode in MOE_MODES:
        k = replica_group_size(acco, layout)
        out += [f"ACCO local-SGD with MoE layers: ep_size {e} does not divide acco.local_sgd.replica_group_size "
                f"{k}. Expert parallelism must live inside a replica (its all-to-all never crosses replicas): set "
                f"replica_group_size to a multiple of {e}, or ep_size to a divisor of {k}"
                for e in sorted(set(layout.ep_sizes)) if k % e]
    return out


def _parallel_rules(acco, layout: Layout) -> List[str]:
    """sparseloco runs tensor or pipeline parallelism, not both."""
    out = []
    if acco.mode == "sparseloco" and layout.tp > 1 and layout.pp > 1:
        out.append(f'acco.mode "sparseloco" runs tensor or pipeline parallelism, not both (tp {layout.tp} x pp '
                   f'{layout.pp}): its chunks are cut from whole tensors, put back together over the tensor-parallel '
                   f'group only. Use --tp 1 or --pp 1, or mode "diloco"')
    return out


ROUND_MODES_ON_FSDP2 = ("acco: FSDP2 reduce-scatters the gradients inside every backward and keeps no unsharded "
                        "gradient between micro-batches, while an ACCO round accumulates the next half-batch at full "
                        "size while the previous one is reduce-scattered: that needs a second full-size gradient "
                        "buffer beyond FSDP2 (docs/design/hosts.md). Pass the plain module instead (ACCO shards "
                        "the optimizer state like ZeRO-1), or use a local-SGD mode (diloco, co2, edit) on FSDP2")


def _host_rules(acco, layout: Layout) -> List[str]:
    """The torch host runs no tensor or pipeline parallelism; on FSDP2 it runs the local-SGD modes only."""
    out = []
    if layout.host != "deepspeed" and layout.tp * layout.pp > 1:
        out.append(f"acco_ds.torch runs data parallelism only (got tp {layout.tp} x pp {layout.pp}): train "
                   f"tensor- or pipeline-parallel models with DeepSpeed (acco_ds.initialize)")
    if layout.host == "fsdp2" and acco.mode in ROUND_MODES:
        out.append(f'acco_ds.torch: mode "{acco.mode}" does not run on an FSDP2 model. '
                   + (ROUND_MODES_ON_FSDP2 if acco.mode != "sync" else
                      "sync is what FSDP2 already does: train without ACCO, or pass the plain module"))
    return out


RULES = (_round_rules, _replica_rules, _collective_rules, _model_rules, _expert_rules, _parallel_rules, _host_rules)
_NEEDS_CONFIG = (_model_rules,)


def refusals(acco, layout: Layout, ds_config: Optional[dict] = None) -> List[str]:
    """Every reason acco_ds refuses the enabled block ``acco`` (an ``ACCOConfig``) on ``layout``, one message
    each, naming the fix; empty when it runs. ``ds_config``: the DeepSpeed config dict, for the keys beside the
    block that a rule reads (``hybrid_engine``)."""
    if not acco.enabled:
        return []
    out = []
    for rule in RULES:
        out += rule(acco, layout, ds_config) if rule in _NEEDS_CONFIG else rule(acco, layout)
    return out


def check(acco, layout: Layout, ds_config: Optional[dict] = None,
          prefix: str = "ACCO cannot run with this DeepSpeed config") -> None:
    """Raise ``ValueError`` listing every refusal of ``refusals`` (nothing when the block runs)."""
    problems = refusals(acco, layout, ds_config)
    if problems:
        raise ValueError(f"{prefix}:\n  - " + "\n  - ".join(problems))


def rules_markdown() -> str:
    """The refusals as a Markdown list, one line per rule (the plan's page and the reference show it)."""
    return "\n".join(f"- {' '.join(rule.__doc__.split())}" for rule in RULES)


__all__ = ["Layout", "refusals", "check", "replica_group_size", "node_size", "rules_markdown", "RULES",
           "ROUND_MODES_ON_FSDP2"]
