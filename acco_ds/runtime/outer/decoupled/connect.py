"""How the ranks of a decoupled learner reach the syncer (a mixin of ``learner.DecoupledLearner``): rank 0 asks
shard 0 how many shards the syncer has (its STATE), every rank of the learner learns the answer, cuts the model
into the syncer's parts (``layout``: as many per model-parallel position as the syncer has shards over the
tensor x pipeline size), and opens a link to each shard whose part it holds: shard ``m s + i`` (position ``m``,
part ``i``) is held by the learner's data-parallel rank ``i mod k`` at position ``m``. A learner of the syncer's
own size holds one link per rank, its partition as it is. A learner of tensor-parallel or pipeline size > 1 whose
parameters map onto the unsplit model (``canonical``) cuts that model into the syncer's parts instead, over its whole
world: part ``i`` is held by its rank of slot ``i mod (tp pp k)``."""

import os
import random
from typing import List

import torch
import torch.distributed as tdist

from ....config.decoupled import layout_name
from . import wire
from .canonical import (ATTRIBUTES, TPRelayout, canonical_model, canonical_name, learner_world, split_params,
                        stage_model)
from .layout import Parts, Relayout
from .link import Link, Uplink


class Connect:
    """Opening the links of this rank, and moving slices between the learner's partitions and the syncer's parts."""

    # ------------------------------------------------------------------ who this learner is
    def _learner_id(self) -> int:
        if self.syncer_config is not None and self.syncer_config.address:
            for name in ("ACCO_LEARNER_ID", "REPLICA_GROUP_ID"):
                if os.environ.get(name):
                    return int(os.environ[name])
        return self.groups.replica

    def _incarnation(self) -> int:
        """A random number per learner process, the same on every rank of the learner (rank 0 draws it)."""
        return self._learner_max(random.SystemRandom().getrandbits(62) if self.slot == 0 else 0)

    def _flat(self, tensors) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])

    def _unflat_into(self, flat: torch.Tensor, targets) -> None:
        offset = 0
        for t in targets:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t).to(t.dtype))
            offset += n

    def _learner_max(self, value: int) -> int:
        """The largest ``value`` over the ranks of this learner (every rank calls it): over the replica group,
        then over the model-parallel group."""
        if self.slots == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.shards.device)
        for group in (self.groups.replica_main if self.groups.k > 1 else None, self.groups.model_main):
            if group is not None:
                tdist.all_reduce(t, op=tdist.ReduceOp.MAX, group=group)
        return int(t.item())

    def _link(self, j: int) -> Link:
        return Link(self.where(j), self.learner, self.incarnation, j, self.timeout_s, self.max_bytes, self.keys,
                    self.tokens_per_step, self.layout)

    def _name(self, groups, shards) -> None:
        """This learner's name at HELLO (``layout``) and, when it maps onto the unsplit model, the specs of its
        parameters (``canon``; ``layouts``: every model-parallel position's; else ``unmapped``: why not, for a
        tensor-parallel or pipeline learner). Every rank of the launch calls it (a model-parallel launch creates
        its learners' world groups)."""
        tp = self.tp = groups.tensor_parallel if self.mp > 1 else 1
        self.canon, self.canon_sizes, self.unmapped, self.world, self.layouts = None, None, "", None, None
        self.layout = layout_name(groups, self.mp, shards, self.mine.sizes)
        if shards.has_experts:  # experts: each position its own slice
            return
        specs, why = split_params(shards.params, tp)
        if self.mp == 1:
            if not why:
                self.canon = specs
                self.canon_sizes, shapes = canonical_model(specs, 1)
                self.layout = canonical_name(self.canon_sizes, shapes)
            return
        group, rank_of, infos = learner_world(groups.replica, self.slot, self.timeout_s, (specs, why, self.mine))
        self.world = (group, rank_of)
        why = next((w for _, w, _ in infos if w), "")
        positions = [infos[groups.k * m] for m in range(self.mp)]  # each position's data-parallel rank 0
        if not why:
            sizes, shapes, shifts, why = stage_model([p[0] for p in positions[::tp]], tp)
        if why:
            self.unmapped = (f"its tensor-parallel slices and pipeline stages cannot be mapped onto the unsplit "
                             f"model: {why} (every split parameter needs {ATTRIBUTES}; a weight tied across "
                             f"pipeline stages cannot be mapped)")
            return
        self.layouts = [(specs_m, mine_m, shifts[m // tp]) for m, (specs_m, _, mine_m) in enumerate(positions)]
        self.canon, self.canon_sizes = specs, sizes
        self.layout = canonical_name(sizes, shapes)

    def _open(self, link: Link) -> int:
        try:
            return link.open(self.timeout_s)
        except wire.Refused as err:
            if self.unmapped and "layout" in str(err):
                raise wire.Refused(f"{err}. Learner {self.learner}: {self.unmapped}") from err
            raise

    def _connect(self) -> List[int]:
        """Open this rank's links (see the module docstring); returns the version each shard holds."""
        first = self._link(0) if self.slot == 0 else None
        v0 = self._open(first) if first is not None else 0
        count = self._learner_max((first.syncer_shards or self.slots) if first is not None else 0)
        self.one_shard = count == 1
        if self.canon is not None and self.mp > 1:  # the unsplit model's parts, over the learner's whole world
            syncer = Parts.syncer(self.canon_sizes, count)
            self.relayout = TPRelayout(self.canon, self.tp, self.groups.k, self.slot, self.mine, syncer,
                                       *self.world, self.shards.device, layouts=self.layouts)
            return self._open_links(first, v0, syncer, list(self.relayout.owned))
        if count % self.mp:
            raise ValueError(f"acco decoupled: the syncer has {count} shards and learner {self.learner} a tensor x "
                             f"pipeline parallel size of {self.mp}: each model-parallel position needs its own "
                             f"shards. Start the syncer with a multiple of {self.mp} (acco-ds syncer --shards)")
        per = count // self.mp
        syncer = Parts.syncer(self.mine.sizes, per)
        if self.shards.has_experts:  # expert groups are cut over the expert-data-parallel group: sent as they are
            if per != self.groups.k:
                raise ValueError(f"acco decoupled: learner {self.learner} has experts, which travel as each rank "
                                 f"partitions them, so the syncer needs one shard per rank: {self.slots}, not "
                                 f"{count} (acco-ds syncer --shards {self.slots})")
            syncer = self.mine
        group = self.groups.replica_main if self.groups.k > 1 else None
        self.relayout = Relayout(self.mine, syncer, self.groups.shard, group, self.shards.device)
        return self._open_links(first, v0, syncer, [self.position * per + i for i in self.relayout.owned])

    def _open_links(self, first, v0: int, syncer: Parts, shards: List[int]) -> List[int]:
        """Open the links to ``shards`` (rank 0's to shard 0 is ``first``, open); their versions."""
        self.part = syncer.numel
        self.links = [first if j == 0 and first is not None else self._link(j) for j in shards]
        key = "uplink" if self.relayout.same else "uplink{}"
        self.uplinks = [Uplink(self.compression, key.format(i)) for i in self.relayout.owned]
        return [v0 if link is first else self._open(link) for link in self.links]

    def _theta(self, msgs) -> torch.Tensor:
        """θ_g in this rank's partition (a collective): from the PARAMS of its links."""
        return self.relayout.from_syncer([m.tensor for m in msgs])


__all__ = ["Connect"]
