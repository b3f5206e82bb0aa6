"""RoundPeers: what lets ranks that end their rounds on their own meet at a read without deadlock.

Jobs pair ranks round by round: a rank that ends round ``k`` waits for job
``k``, whose collectives need every peer to have *submitted* job ``k``, i.e.
to have ended round ``k - 1``. In fixed accumulation every rank ends its
rounds after the same micro-batches, so this always holds. In adaptive
accumulation a rank ends a round when its communication is done or at the
maximum, so at the same point of the user's program a rank may be one round
ahead (never more: it cannot end round ``k`` before every peer submitted job
``k``). Training alone never deadlocks: the peer behind keeps computing and
ends its round. A read (``eval()``, ``state_dict()``, ``save_checkpoint``,
``acco_finalize``) or a user collective stops the peer's compute: if the peer
then blocks in a main-thread collective while this rank blocks waiting for job
``k``, neither moves (seen: rank 0 in ``finish_round``, rank 1 in the read's
all-reduce).

The protocol (adaptive accumulation only; fixed costs nothing):

1. A rank about to block on a job that is not done writes "waiting for job k"
   under its name in the process group's key-value store, and clears it after.
2. A rank that reaches a read (``arrive``) announces it in the store and, until
   every peer of its round group has arrived, polls the peers' keys: when one
   waits for job ``k`` beyond its own round, it ends its round (submitting job
   ``k``; its micro-batch count, possibly 0, travels with the gradients, so the
   mean stays exact). Only then does it enter the read's all-reduce.
3. The host aligns rounds at every step boundary too (the read protocol, then
   the all-reduce of ``align_rounds``), so a user collective *between steps*
   finds every rank at the same round with nothing to wait for.

So no rank ever blocks in a main-thread collective while a peer waits for a
job only it can submit: a peer that blocks on a job either gets it from a
rank that is still computing (it ends its round by itself) or from a rank at
the read (step 2). The store is torch.distributed's own (the one the launch's
rendezvous made), under a prefix of the round group's ranks.
"""

import time
from typing import List

import torch
import torch.distributed as tdist

POLL_S = 0.0005


def default_store():
    """The key-value store of the default process group (torch's rendezvous store)."""
    from torch.distributed import distributed_c10d
    get = getattr(distributed_c10d, "_get_default_store", None)
    if get is None:  # named in one place: acco_ds's only private torch.distributed name
        raise RuntimeError("acco_ds: torch.distributed has no _get_default_store(): adaptive accumulation needs the "
                           "rendezvous store to align reads; use \"accumulation\": \"fixed\" on this torch version")
    return get()


class RoundPeers:
    """The store keys of one round group. Args: ``ranks`` (global ranks of the group), ``me`` (this rank's
    index in it)."""

    def __init__(self, ranks: List[int], me: int):
        prefix = "acco_rounds/" + "-".join(map(str, ranks)) + "/"
        self.store = tdist.PrefixStore(prefix, default_store())
        self.size, self.me = len(ranks), me
        self.reads = 0  # reads this rank has arrived at (the same sequence on every rank)
        self._keys = [f"wait/{i}" for i in range(self.size) if i != me]
        self.store.set(f"wait/{me}", "-1")

    def waiting(self, job: int) -> "_Waiting":
        """Context of a blocking wait for round ``job``'s job: peers at a read see it."""
        return _Waiting(self.store, f"wait/{self.me}", job)

    def peer_waits_beyond(self, index: int) -> bool:
        """Does a peer wait for a job beyond round ``index`` (one this rank submits when it ends its round)?"""
        if not self.store.check(self._keys):  # a peer that has not written yet waits for nothing
            return False
        return any(int(v) > index for v in self.store.multi_get(self._keys))

    def arrive(self, current_index, end_round, timeout_s: float) -> None:
        """Announce this rank at a read and, until every peer has arrived, end a round whenever a peer waits
        for one (``current_index()``: this rank's round now; ``end_round()``: end it)."""
        self.reads += 1
        key = f"arrived/{self.reads}"
        arrived = self.store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while arrived < self.size:
            if self.peer_waits_beyond(current_index()):
                end_round()
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ACCO: {arrived} of {self.size} ranks reached read or step boundary number {self.reads} within "
                    f"acco.timeout_s = {timeout_s:g} s. With \"accumulation\": \"adaptive\" every rank must call "
                    f"step() at an accumulation boundary, and every read (eval(), state_dict(), save_checkpoint, "
                    f"acco_finalize), the same number of times, as data parallelism assumes (the same number of "
                    f"micro-batches per rank, e.g. a DistributedSampler); a loop that stops on global_steps must "
                    f"test it at step boundaries only. Otherwise another rank has failed: check its log")
            time.sleep(POLL_S)
            arrived = self.store.add(key, 0)

    def forget_read(self) -> None:
        """After the read's collective (every rank has passed ``arrive``): drop its key."""
        if self.me == 0:
            self.store.delete_key(f"arrived/{self.reads}")


def align_rounds(driver, end_round) -> int:
    """Make every rank of ``driver``'s round group end the same round before a read (collective).

    In adaptive accumulation each rank ends its rounds on its own, so at the same user-level iteration a rank
    may already have submitted the next round's job while a peer has not: waiting for that job would
    deadlock. Every rank first arrives (``RoundPeers.arrive``: a rank blocked on a job that only this rank can
    submit gets it), then one all-reduce of index * 2^32 + micro-batches; ranks a round behind close their
    round early with ``end_round()`` (the micro-batch counts travel with the gradients, so the mean stays
    exact). Returns the most micro-batches any rank holds in its round."""
    peers = driver.peers
    if peers is not None:
        peers.arrive(lambda: driver.schedule.index, end_round, driver.acco.timeout_s)
    key = torch.tensor([(driver.schedule.index << 32) + driver.local_micro], dtype=torch.int64,
                       device=driver.compute_flats[0].device)
    tdist.all_reduce(key, op=tdist.ReduceOp.MAX, group=driver.round_group)
    value = int(key.item())
    if peers is not None:
        peers.forget_read()
    if value >> 32 > driver.schedule.index:  # at most one round behind: jobs pair ranks round by round
        end_round()
    return value & 0xFFFFFFFF


class _Waiting:
    def __init__(self, store, key, job):
        self.store, self.key, self.job = store, key, job

    def __enter__(self):
        self.store.set(self.key, str(self.job))

    def __exit__(self, *exc):
        self.store.set(self.key, "-1")


__all__ = ["RoundPeers", "align_rounds", "default_store"]
