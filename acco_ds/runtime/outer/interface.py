"""The outer-loop interface: how a host (the DeepSpeed engine or the torch host) drives an outer algorithm.

The round modes (``acco``, ``dpu``, ``sync``) have no outer loop: every rank
is one data-parallel worker. The local-SGD family (``diloco``, ``co2``,
``edit``) runs the host's inner steps inside *replica groups* and synchronises
the replicas every period. Everything a host needs from such an algorithm
goes through ``OuterLoop``, whose base class is the do-nothing loop of the
round modes, so the host calls every hook unconditionally:

* ``after_inner_step``: after every committed inner step (the period clock);
* ``wait``: before the host reuses its inner communication thread (training waits for the sync);
* ``before_read``: before anything reads weights or state (finish what is in flight);
* ``committed_flats``: what users read (the anchor), in flat model-dtype buffers;
* ``finalize``: leave every replica on one model;
* ``state_dict`` / ``load_state_dict``: the outer state a checkpoint holds; ``restart``: the host's
  weights were replaced (a load of module weights only), start over from them;
* ``stats``: the loop's figures (``engine.acco_stats()``); ``banner``, ``report``, ``progress``: its
  start-up words, summary lines and progress words, which the host prints as they are, so a new loop
  is described without host changes;
* ``attach``: the module, for per-layer forward hooks (``edit``); ``join``: the host is built (a
  replica that comes and goes joins the others here); ``close``: stop the loop's threads.

An outer loop never sees the engine or the optimizer: it gets ``Shards`` (its
fp32 master shards, the replica's flat parameters, a spare flat buffer per
group, the parameters with their flat offsets) and ``ReplicaGroups`` (its
process groups). A new algorithm subclasses ``OuterLoop`` (or
``base.LocalSGD``, which owns the anchor, the outer momentum, the average and
the install) and registers itself with ``register_outer_loop(mode, factory)``;
no host file changes. ``OuterLoopHost`` is what every host shows of its loop.
"""

import importlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as tdist

from ..comm import lifetime


@dataclass
class ReplicaGroups:
    """This rank's place in the replica layout: ``R = W / k`` replica groups of ``k`` consecutive ranks; the
    ranks with the same index in every replica form an *outer group* (they hold the same shard)."""
    k: int  # ranks per replica group
    replicas: int  # R
    replica: int  # this rank's replica index
    shard: int  # this rank's index inside its replica (its ZeRO-1 partition)
    replica_ranks: List[int]
    outer_ranks: List[int]
    replica_main: object  # the host's inner group (main thread)
    replica_side: object  # the inner communication thread's copy
    outer_main: object  # blocking outer collectives (main thread)
    outer_side: object  # the outer communication thread's copy
    # Tensor/pipeline parallelism: the model-parallel group of this rank's position (None: none). Norms over a
    # replica's parameters and A-EDiT's clock are summed (maxed) over it too, main thread and outer thread.
    model_main: object = None
    model_side: object = None
    tensor_parallel: int = 1  # ranks that split one tensor (the tensor-parallel size; pipeline stages do not)

    def reduce(self, value: float, device, side: bool = False, op=tdist.ReduceOp.SUM) -> float:
        """``value`` summed (or ``op``) over every rank of this replica: its replica group, then its
        model-parallel group. ``side``: from the outer communication thread (its own group copies)."""
        groups = [self.replica_side if side else self.replica_main] if self.k > 1 else []
        if self.model_main is not None:
            groups.append(self.model_side if side else self.model_main)
        if not groups:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=device)
        for group in groups:
            tdist.all_reduce(t, op=op, group=group)
        return float(t)


def make_groups(dp_groups: List[List[int]], k: int, timeout_s: float) -> ReplicaGroups:
    """Cut every data-parallel group (one per tensor-parallel rank and pipeline stage; the same list on every
    rank) into replicas of ``k`` consecutive ranks, create every replica and outer group (collective: all
    ranks call it alike) and return this rank's. The outer groups join the ranks of the same model-parallel
    position and shard across replicas."""
    me = tdist.get_rank()
    R = len(dp_groups[0]) // k
    replicas = [dp[g * k:(g + 1) * k] for dp in dp_groups for g in range(R)]
    outers = [[dp[g * k + i] for g in range(R)] for dp in dp_groups for i in range(k)]
    timeout = timedelta(seconds=timeout_s)
    made = [lifetime.new_subgroups(lists, timeout) for lists in (replicas, replicas, outers, outers)]
    mine = next(ranks for ranks in replicas if me in ranks)
    dp = next(ranks for ranks in dp_groups if me in ranks)
    return ReplicaGroups(k, R, dp.index(me) // k, mine.index(me), mine, next(o for o in outers if me in o), *made)


@dataclass
class Shards:
    """The narrow view of one replica's ZeRO-1 state an outer loop may read and write.

    ``masters[i]`` is this rank's fp32 master shard of parameter group ``i`` (the inner optimizer steps it;
    an outer step overwrites it); ``flats[i]`` the replica's flat compute parameters in the model dtype,
    partitioned ``k`` ways like the masters (``flats`` None: the masters are the compute weights, as FSDP2's
    local shards are, and ``committed_flats`` returns shards in the masters' layout); ``spare[i]`` a flat buffer of the same layout that the host
    does not use while the loop reads it (the committed view is gathered there; the DeepSpeed host, which
    keeps no communication buffer without overlap, allocates it per call, freed when dropped); ``params[i]`` the
    parameters of group ``i`` with their offsets in ``flats[i]``, in registration (forward) order.
    """
    masters: List[torch.Tensor]
    flats: List[torch.Tensor]
    spare: Callable[[], List[torch.Tensor]]
    params: List[List[Tuple[torch.Tensor, int]]]
    # Replicas that come and go: what a healing replica's rank takes from this rank besides the outer state
    # (copies of the inner optimizer's state over this rank's shard and the host's step counters), and how
    # it takes them. None: the host cannot heal.
    host_state: Optional[Callable[[], dict]] = None
    load_host_state: Optional[Callable[[dict], None]] = None
    # Tensor/pipeline parallelism: per group, the (start, length) ranges of this rank's master shard that count
    # in a global norm (split parameters on every rank, replicated ones once; None: all of it).
    norm_segments: Optional[List[List[Tuple[int, int]]]] = None
    # Mixture of experts: per group, None (partitioned over the replica group, at rank ``groups.shard``) or
    # ``(rank, main, side)``: an expert group, partitioned over the expert-data-parallel group inside the replica
    # (``side``: the host's communication-thread copy of it). The ranks that hold the same expert shard in every
    # replica are still this rank's outer group.
    gather: Optional[List[Optional[Tuple[int, object, object]]]] = None

    def gather_at(self, i: int, groups: "ReplicaGroups", side: bool = False) -> Tuple[int, object]:
        """``(rank, group)`` over which group ``i``'s flat buffer is partitioned (``side``: a copy of that
        group for a thread other than the main one)."""
        own = self.gather[i] if self.gather is not None else None
        if own is None:
            return groups.shard, groups.replica_side if side else groups.replica_main
        return own[0], own[2] if side else own[1]

    @property
    def has_experts(self) -> bool:
        return self.gather is not None and any(g is not None for g in self.gather)

    @property
    def partition(self) -> List[int]:
        return [m.numel() for m in self.masters]

    @property
    def device(self) -> torch.device:
        return self.masters[0].device


class OuterLoop:
    """The do-nothing outer loop of the round modes, and the base of every outer algorithm."""

    replicas: int = 1  # R: replicas whose samples one inner step counts once each
    replica_ranks: Optional[List[int]] = None  # ranks whose ZeRO-1 files this rank's replica reads (None: all)
    per_replica_counters: bool = False  # replicas run different step counts (A-EDiT): each keeps its own
    syncs: int = 0  # outer synchronisations done, the same on every rank

    def attach(self, module: torch.nn.Module) -> None:
        """The host's module, once built."""

    def join(self) -> None:
        """The host is built and training is about to start (replicas that come and go join here)."""

    def after_inner_step(self) -> None:
        """One inner step was committed on this replica."""

    def wait(self) -> None:
        """Finish outer communication in flight that the next inner step needs (counted as training wait);
        the host calls it before it reuses its inner communication thread's group."""

    def before_read(self) -> None:
        """Weights or state are about to be read: finish what is in flight."""

    def committed_flats(self) -> Optional[List[torch.Tensor]]:
        """After ``before_read``: flat model-dtype buffers holding what users read, or None (the host's own)."""
        return None

    def finalize(self) -> None:
        """End of training: leave every replica on one model."""

    def restart(self) -> None:
        """The host's weights were replaced from outside (a checkpoint load of module weights only): start
        over from its current master shards, dropping what is in flight."""

    def waited_s(self) -> float:
        """Seconds the compute side waited for outer communication so far."""
        return 0.0

    def state_dict(self) -> Optional[dict]:
        return None

    def load_state_dict(self, state: Optional[dict]) -> None:
        """Restore ``state_dict()``'s result (None: the checkpoint has no outer state)."""

    def reshard_state(self, first: List[Optional[dict]], mine: List[Optional[dict]], plan) -> Optional[dict]:
        """This rank's state in this run's layout, for ``load_state_dict``, from a checkpoint of another
        (``runtime.reshard.Plan``): ``first`` old replica 0's ``state_dict()`` per old rank, ``mine`` the
        mapped old replica's. Name what is dropped or not carried in ``plan.dropped``/``plan.not_carried``."""
        raise ValueError(f"the outer loop {type(self).__name__} cannot load a checkpoint of another layout: resume "
                         f"with the same world size and replica_group_size, or load only the module weights "
                         f"(load_optimizer_states=False)")

    def stats(self) -> dict:
        return {}

    def banner(self) -> str:
        """This loop's words in the host's start-up line ("": the host describes its rounds)."""
        return ""

    def report(self) -> List[Tuple[str, str]]:
        """This loop's lines of a run summary, ``(label, text)``, from ``stats()`` ([]: the host's rounds)."""
        return []

    def progress(self) -> str:
        """This loop's words in the host's periodic progress line ("": the host's round figures)."""
        return ""

    def close(self) -> None:
        pass


class OuterLoopHost:
    """What every host (the DeepSpeed engine, ``acco_ds.torch``'s optimizers) shows of its outer loop
    ``self.outer``."""

    outer: OuterLoop

    @property
    def acco_syncs(self) -> int:
        """Outer syncs the global model has committed (local-SGD modes; 0 in the round modes), the same on
        every rank: a loop ``while acco_syncs < N`` ends every replica on the same global model (A-EDiT)."""
        return self.outer.syncs


Factory = Callable[..., OuterLoop]
# mode -> factory(acco_config, shards, groups), or "module:Class" imported on first use (no import cycle,
# no cost for modes that are not used).
OUTER_LOOPS: Dict[str, Union[str, Factory]] = {
    "diloco": "acco_ds.runtime.outer.streaming:build",  # Streaming DiLoCo when its keys are set
    "co2": "acco_ds.runtime.outer.co2:CO2",
    "edit": "acco_ds.runtime.outer.edit:EDiT",
    "sparseloco": "acco_ds.runtime.outer.sparseloco:SparseLoCo",
    "decoupled": "acco_ds.runtime.outer.decoupled.learner:DecoupledLearner",
}


def register_outer_loop(mode: str, factory: Factory) -> None:
    """Make ``mode`` build ``factory(acco_config, shards, groups)`` (the config must accept the mode)."""
    OUTER_LOOPS[mode] = factory


def needs_replicas(mode: str) -> bool:
    """Does ``mode`` run an outer loop over replica groups?"""
    return mode in OUTER_LOOPS


def build_outer_loop(acco, shards: Shards, groups: Optional[ReplicaGroups]) -> OuterLoop:
    """The outer loop of ``acco.mode`` (the do-nothing loop for the round modes)."""
    factory = OUTER_LOOPS.get(acco.mode)
    if factory is None:
        return OuterLoop()
    if groups is None:
        raise ValueError(f"mode {acco.mode!r} runs on replica groups: the host must create them (make_groups)")
    if isinstance(factory, str):
        module, name = factory.split(":")
        factory = getattr(importlib.import_module(module), name)
    return factory(acco, shards, groups)


__all__ = ["OuterLoop", "OuterLoopHost", "Shards", "ReplicaGroups", "make_groups", "register_outer_loop", "build_outer_loop",
           "needs_replicas", "OUTER_LOOPS"]
