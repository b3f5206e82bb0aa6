"""Replicas that come and go: the outer all-reduce through torchft's Manager (``acco.fault_tolerance``).

One launch is one replica: its ``k`` ranks run ZeRO-1 (or FSDP2) inside, each rank with a Manager of its
own (rank i of k, the replica's id). torchft joins rank i of every replica into one process group that it
reconfigures at every quorum: that is the outer group. A sync (``transport.GroupTransport`` has the same
calls) runs:

* ``begin``: ``start_quorum()``, synchronous. A replica that is behind (new, or relaunched after a crash)
  receives here, rank by rank from the same rank of a live replica, what the loop registered: anchor,
  outer momentum, the loop's position and the host's inner optimizer shard and counters (with MoE layers,
  rank i's expert shards: rank i of every replica holds the same experts). It then stands at the anchor and
  contributes nothing to this sync. With ``join: "early"`` the live replicas end their period at the next
  inner step once rank 0's watch (``join_watch``) sees such a replica waiting;
* ``average``: ``Σ w_i δ_i / Σ w_i``, two torchft all-reduces (SUM) of the tensors scaled by this
  replica's merge weight and of the weight, so a replica with nothing to add (weight 0) changes nothing,
  and ``merge: "tokens"`` weighs each replica by what it trained;
* ``gather`` (sparseloco, whose payloads cannot be summed): one all-reduce of a buffer with a slot per
  participant;
* ``commit``: ``should_commit()``, False on every survivor when a participant failed during the sync; the
  loop then discards the sync (anchor and momentum as they were).

``committed`` counts the syncs the global model took (those that committed with some weight), so
``acco_syncs`` is the same on every replica, a healed one included.
"""

import contextlib
import threading
import time
from datetime import timedelta
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as tdist
from torch.distributed import ReduceOp

PROGRESS_EVERY_S = 10.0  # a line while a quorum is awaited


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    values = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(_nbytes(v) for v in values)


class TorchFTTransport:
    """The outer all-reduce through torchft (see the module docstring).

    Args:
        ft: the ``FaultToleranceConfig``.
        groups: this rank's replica layout (``k`` = the launch's ranks; ``shard`` = this rank in it).
        state: returns what a healing peer receives from this rank (copies: the transfer may run later).
        load: takes a peer's ``state()`` (on the main thread, inside ``begin``).
    """

    fault_tolerant = True
    worker = None  # the asynchronous averages are torchft's own works, no thread of ours

    def __init__(self, ft, groups, state: Callable[[], dict], load: Callable[[dict], None]):
        try:  # only with acco.fault_tolerance: torchft is a dependency of this feature alone
            import torchft
        except ImportError as err:
            raise ImportError("acco.fault_tolerance runs on torchft, which is not installed here: pip install "
                              "'acco_ds[ft]' (or torchft), then relaunch") from err
        self.ft, self.groups, self._state, self._load = ft, groups, state, load
        self.lighthouse = ft.check_lighthouse()
        self.replica_id = ft.resolved_replica_id()
        seconds = timedelta(seconds=ft.timeout_s)
        self.manager = torchft.Manager(
            pg=torchft.ProcessGroupGloo(timeout=seconds), load_state_dict=self._heal, state_dict=self._state,
            min_replica_size=ft.min_replicas, use_async_quorum=False, timeout=seconds,
            quorum_timeout=timedelta(seconds=ft.quorum_timeout_s), connect_timeout=seconds,
            # The launch is the replica: rank i of it (its data-, tensor- and pipeline-parallel position) meets
            # rank i of every other replica.
            rank=tdist.get_rank(), world_size=tdist.get_world_size(), replica_id=self.replica_id,
            lighthouse_addr=self.lighthouse, init_sync=True)
        self.committed = 0  # syncs the global model took
        self.bytes = 0  # payload this rank handed to outer all-reduces
        self.discarded = 0
        self.participants_per_sync: List[int] = []
        self.quorum_wait_s = 0.0
        self.heals, self.heal_bytes, self.heal_s = 0, 0, 0.0
        self._healed = False
        self._pending = None  # (tensors, works, weight tensor) of an asynchronous average
        self._weights = 0.0  # Σ w of the last average
        self.watch = None  # join "early": rank 0's reader of the lighthouse's status page (join_watch)
        self.early_syncs = 0  # periods this replica ended early for a joiner

    @property
    def participants(self) -> int:
        return self.manager.num_participants()

    # ------------------------------------------------------------------ a sync
    def begin(self) -> bool:
        """The quorum; returns True when this replica just took a peer's state."""
        self._healed = False
        t0 = time.perf_counter()
        with self._progress(t0):
            try:
                self.manager.start_quorum(timeout=timedelta(seconds=self.ft.quorum_timeout_s))
            except Exception as err:  # noqa: BLE001 - torchft raises TimeoutError or RuntimeError
                raise RuntimeError(
                    f"acco.fault_tolerance: replica {self.replica_id} found no quorum of at least "
                    f"min_replicas={self.ft.min_replicas} replica(s) at the lighthouse {self.lighthouse} within "
                    f"quorum_timeout_s={self.ft.quorum_timeout_s:g} s ({type(err).__name__}: {err}). Start more "
                    f"replicas, lower min_replicas, or raise quorum_timeout_s above one sync period") from err
        seconds = time.perf_counter() - t0
        if self.watch is not None:  # what it read before this quorum formed no longer holds
            self.watch.reset()
        self.quorum_wait_s += seconds
        self.participants_per_sync.append(self.participants)
        if self._healed:
            self.heals += 1
            self.heal_s += seconds
        return self._healed

    def watch_joiners(self) -> None:
        """Start reading the lighthouse's status page for waiting joiners (rank 0 of the replica; once)."""
        if self.watch is None and tdist.get_rank() == 0:
            from .join_watch import JoinWatch
            self.watch = JoinWatch(self.lighthouse, self.ft.join_poll_s,
                                   say=lambda line: print(line, flush=True))

    def _heal(self, state: dict) -> None:
        self.heal_bytes += _nbytes(state)
        self._load(state)
        self._healed = True

    @contextlib.contextmanager
    def _progress(self, t0: float):
        """Say, every ``PROGRESS_EVERY_S`` while the quorum is awaited, how long it has been (rank 0 of the
        replica)."""
        done = threading.Event()

        def say():
            while not done.wait(PROGRESS_EVERY_S):
                print(f"[acco_ds] replica {self.replica_id}: waiting for a quorum of at least "
                      f"{self.ft.min_replicas} replica(s) at {self.lighthouse}: {time.perf_counter() - t0:.0f} s of "
                      f"quorum_timeout_s={self.ft.quorum_timeout_s:g}", flush=True)

        watcher = threading.Thread(target=say, daemon=True) if tdist.get_rank() == 0 else None
        if watcher is not None:
            watcher.start()
        try:
            yield
        finally:
            done.set()
            if watcher is not None:
                watcher.join()

    def average(self, tensors: List[torch.Tensor], keys=None, weight: float = 1.0, side: bool = False) -> float:
        start = time.perf_counter()
        self.average_async(tensors, keys, weight)
        self.collect()
        return time.perf_counter() - start

    def average_async(self, tensors: List[torch.Tensor], keys=None, weight: float = 1.0) -> None:
        """Start ``Σ w δ`` and ``Σ w`` (torchft's works run on their own); ``collect`` divides."""
        device = tensors[0].device if tensors else torch.device("cpu")
        w = torch.tensor([float(weight)], dtype=torch.float64, device=device)
        works = []
        for t in tensors:
            if t.numel() == 0:
                continue
            if weight != 1.0:
                t.mul_(weight)
            works.append(self.manager.allreduce(t, reduce_op=ReduceOp.SUM))
            self.bytes += t.numel() * t.element_size()
        works.append(self.manager.allreduce(w, reduce_op=ReduceOp.SUM))
        self._pending = (tensors, works, w)

    def gather(self, mine: torch.Tensor, weight: float = 1.0) -> List[Tuple[torch.Tensor, float]]:
        """Every participant's ``mine`` (bytes, the same size everywhere) with its merge weight. torchft's
        Manager offers only all-reduces, so this is one all-reduce (SUM) of a buffer with a slot per
        participant, zero but in this replica's slot: every byte of the sum comes from one replica, so it is
        exact, at twice an all-gather's bytes on the wire. Empty when the all-reduce failed (``commit`` then
        says False)."""
        n, slots = mine.numel(), self.participants
        slot = self.manager.participating_rank()
        buf = torch.zeros(slots * n, dtype=torch.uint8, device=mine.device)
        w = torch.zeros(slots, dtype=torch.float64, device=mine.device)
        if slot is not None:  # a replica outside the participants adds nothing (torchft zeroes it anyway)
            buf[slot * n:(slot + 1) * n] = mine
            w[slot] = float(weight)
        works = [self.manager.allreduce(buf, reduce_op=ReduceOp.SUM), self.manager.allreduce(w, reduce_op=ReduceOp.SUM)]
        self.bytes += buf.numel()
        ok = all(work.wait() is not False for work in works) and not self.manager.errored()
        self._weights = float(w.sum()) if ok else 0.0
        return [(buf[i * n:(i + 1) * n], float(w[i])) for i in range(slots)] if ok else []

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def collect(self) -> float:
        """Wait for the asynchronous average; the tensors become the weighted mean (zeros when nobody
        contributed, or when the all-reduce failed: ``commit`` then says False)."""
        t0 = time.perf_counter()
        tensors, works, w = self._pending
        self._pending = None
        ok = all(work.wait() is not False for work in works)
        self._weights = float(w.item()) if ok else 0.0
        for t in tensors:
            if ok and self._weights > 0:
                t.div_(self._weights)
            else:
                t.zero_()
        return time.perf_counter() - t0

    def commit(self) -> bool:
        ok = self.manager.should_commit()
        if ok and self._weights > 0:
            self.committed += 1
        if not ok:
            self.discarded += 1
        return ok

    @property
    def contributed(self) -> bool:
        """Some replica added weight to the last average (the start-up sync has none)."""
        return self._weights > 0

    # ------------------------------------------------------------- observability
    def stats(self) -> dict:
        n = self.participants_per_sync
        return {"fault_tolerance": True, "replica_id": self.replica_id, "lighthouse": self.lighthouse,
                "participants_min": min(n) if n else None, "participants_max": max(n) if n else None,
                "participants_mean": sum(n) / len(n) if n else None, "syncs_discarded": self.discarded,
                "heals": self.heals, "heal_bytes": self.heal_bytes, "heal_s": self.heal_s,
                "quorum_wait_s": self.quorum_wait_s, "quorums": len(n), "join": self.ft.join,
                "early_syncs": self.early_syncs}

    def close(self) -> None:
        watch, self.watch = getattr(self, "watch", None), None
        if watch is not None:
            watch.close()
        manager, self.manager = getattr(self, "manager", None), None
        if manager is not None:
            manager.shutdown(wait=True)


class JoinsAndHeals:
    """What a local-SGD loop (``base.LocalSGD``, which mixes this in) does for replicas that come and go: the
    join before the first inner step, and the state a healing replica takes from a live one. A loop with
    more position (Streaming DiLoCo) or state in flight (CO2) extends ``join_tensors``, ``after_join``,
    ``loop_state`` and ``load_loop_state``. ``joins_early``: the loop can end a period at any inner step for a
    joiner (``fault_tolerance.join: "early"``); Streaming DiLoCo cannot, its fragments sync on a fixed grid."""

    joins_early = True

    @torch.no_grad()
    def join(self) -> None:
        """With ``fault_tolerance``, take part in the next sync of the replicas present (the first quorum, or
        the running replicas' next sync) before the first inner step: a new or relaunched replica takes a
        live replica's state there, so it trains from the global model. A discarded sync is tried again."""
        if self.fault_tolerance is None:
            return
        while not self.join_sync():
            pass
        if self.early_join:
            self.transport.watch_joiners()
        if self.transport.participants == 1 and not self.healed and tdist.get_rank() == 0:
            # Alone with nothing to heal from: torchft cannot tell a new job from one whose replicas are all gone.
            print(f"[acco_ds] replica {self.transport.replica_id}: alone in its first quorum at "
                  f"{self.transport.lighthouse}: the global model starts from this replica's own weights. If "
                  f"replicas of this run trained before and are all gone, their global model is not here: load a "
                  f"checkpoint (save_checkpoint per replica) or keep min_replicas above 1", flush=True)

    @property
    def early_join(self) -> bool:
        """``fault_tolerance.join: "early"`` applies to this loop."""
        return self.fault_tolerance is not None and self.joins_early and self.fault_tolerance.join == "early"

    def joiner_waiting(self) -> bool:
        """``join: "early"``: has rank 0's watch seen a replica waiting to join? Every rank of the replica
        takes rank 0's answer (one small all-reduce per inner step when the replica has several ranks), so
        they all end the period at the same inner step."""
        if not self.early_join:
            return False
        watch = self.transport.watch
        seen = 1.0 if watch is not None and watch.seen else 0.0
        return self.groups.reduce(seen, self.anchor[0].device, op=tdist.ReduceOp.MAX) > 0

    def join_sync(self) -> bool:
        """One sync of the replicas present, this replica with weight 0; True when it committed (then this
        replica stands on the global model). A loop whose syncs are not averages (sparseloco) overrides it."""
        self.begin_sync()
        mean = self.join_tensors()
        self.transport.average(mean, weight=0.0)
        if not self.transport.commit():
            return False
        self.after_join(mean)
        return True

    def join_tensors(self) -> List[torch.Tensor]:
        """Zeros shaped like what the others average at the sync a joining replica takes part in."""
        return [torch.zeros_like(x) for x in self.anchor]

    def after_join(self, mean) -> None:
        """The joining sync committed: take its outer step (when some replica contributed) and the anchor."""
        if self.transport.contributed:
            self._outer(self.scale_mean(mean))
        self._install(self.anchor)
        self.unsent_steps = 0

    def heal_state(self) -> dict:
        """What a healing replica's rank receives from this rank (copies: the transfer may run later)."""
        host = self.shards.host_state() if self.shards.host_state is not None else None
        return {"replica_size": tdist.get_world_size(), "ep_sizes": self._ep_sizes(),
                "anchor": [t.clone() for t in self.anchor], "momentum": [t.clone() for t in self.momentum],
                "syncs": self.transport.committed, "loop": self.loop_state(), "host": host}

    def _ep_sizes(self) -> List[int]:
        """Per expert group, its ep_size: the replica's ranks over those its partitions are split over."""
        return [tdist.get_world_size() // tdist.get_world_size(g[1]) for g in self.shards.gather or [] if g]

    @torch.no_grad()
    def heal_load(self, state: dict) -> None:
        """Take a live replica's state (inside ``begin``): this replica then stands at the anchor."""
        if state["replica_size"] != tdist.get_world_size():
            raise ValueError(f"acco.fault_tolerance: this replica has {tdist.get_world_size()} rank(s) but the "
                             f"replica it heals from has {state['replica_size']}: every replica must run the same "
                             f"number of ranks (their shards of the anchor and of the inner optimizer state must "
                             f"match). Relaunch it with {state['replica_size']} rank(s)")
        if state.get("ep_sizes", []) != self._ep_sizes():
            raise ValueError(f"acco.fault_tolerance: this replica's expert groups have ep_size "
                             f"{self._ep_sizes() or 'none (no MoE)'} but the replica it heals from has "
                             f"{state.get('ep_sizes') or 'none (no MoE)'}: every replica must run the same model "
                             f"and ep_size (rank i of every replica holds the same experts). Relaunch it with theirs")
        for mine, saved in ((self.anchor, state["anchor"]), (self.momentum, state["momentum"]),
                            (self.shards.masters, state["anchor"])):
            for dst, src in zip(mine, saved):
                dst.copy_(src)
        self.transport.committed = state["syncs"]
        self.load_loop_state(state["loop"])
        if state["host"] is not None and self.shards.load_host_state is not None:
            self.shards.load_host_state(state["host"])
        self.unsent_steps = 0

    def loop_state(self) -> dict:
        """The loop's position a healing replica takes (a subclass adds its own)."""
        return {"schedule": self.schedule.state_dict()}

    def load_loop_state(self, state: dict) -> None:
        self.schedule.load_state_dict(state["schedule"])


__all__ = ["TorchFTTransport", "JoinsAndHeals", "PROGRESS_EVERY_S"]
