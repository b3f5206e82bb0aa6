"""How a rank of a decoupled learner sends its Δ slice and waits for the merge that holds it, and how the ranks of
a learner of several ranks agree (a mixin of ``learner.DecoupledLearner``, which holds the links, the in-flight
Δ and adopts the merge).

The in-flight Δ is a dict: ``msgs`` (a DELTA per link, kept for a re-send), ``base``, ``tokens``, ``steps``,
``sent`` (the weights at the send, adopt "overlap"), ``posted`` (every slice is held and READY went out),
``broken`` (link index -> the error that closed it), ``params`` (the PARAMS received, per link) and ``adopted``
(the period's inner steps taken before its base was adopted). Every rank runs the same collectives in the same
order whatever failed: a small MIN all-reduce after each send and each wait, so that all ranks re-send together,
and adopt together once every one holds PARAMS of one version."""

import time

import torch.distributed as tdist

from . import wire

MIN = tdist.ReduceOp.MIN
NONE = float(1 << 62)  # the smallest version of a rank that holds no link: any other is smaller


class Exchange:
    """Sending the in-flight Δ, re-sending it after a syncer restart, and waiting for its merge, over the links this
    rank holds (``self.links``: one per syncer part it holds, ``layout``; none for some ranks of a learner larger
    than the syncer)."""

    def _all(self, flag: float) -> float:
        """The smallest ``flag`` over the ranks of this learner (every rank calls it at the same point)."""
        return flag if self.slots == 1 else self.groups.reduce(float(flag), self.shards.device, op=MIN)

    def _agree(self, msgs) -> tuple:
        """``(True, v)`` when the PARAMS every link of every rank of this learner holds are of one version ``v``."""
        versions = [m.version for m in msgs]
        lo, hi = float(min(versions, default=NONE)), float(max(versions, default=-1))
        if self.slots > 1:
            hi = self.groups.reduce(hi, self.shards.device, op=tdist.ReduceOp.MAX)
            lo = self._all(lo)
        return lo == hi, int(hi)

    def _get_agreed(self, msgs, deadline: float) -> tuple:
        """PARAMS of one version on every link of every rank: ask again (GET) until the shards answer the same one.
        Returns ``(msgs, version)``."""
        while True:
            same, version = self._agree(msgs)
            if same:
                return msgs, version
            if time.monotonic() > deadline:
                raise ConnectionError(f"acco decoupled: the syncer shards of learner {self.learner} hold different "
                                      f"versions of θ_g (a shard restarted from an older checkpoint than the others): "
                                      f"restart every shard on its state_dir")
            for link in self.links:
                link.send(link.mine("GET"))
            msgs = [link.recv("PARAMS", "theta", self.part) for link in self.links]

    # ------------------------------------------------------------------ the exchange
    def _post(self) -> None:
        """Send the in-flight Δ: on a syncer of one shard, DELTA then READY; else every link sends its DELTA and
        waits for the ACK, the ranks agree that every slice is held, and rank 0 says READY to shard 0. A connection
        that fails marks the Δ for a re-send."""
        f, links = self.inflight, self.links
        ready = wire.Message("READY", learner=self.learner, incarnation=self.incarnation, version=f["adopted"],
                             base=f["base"], tokens=f["tokens"], steps=f["steps"])
        f["broken"] = {}  # link index -> the error that closed it
        t0 = time.perf_counter()
        for i, link in enumerate(links):
            link.waiting_base = f["base"]  # its PINGs ask whether the shard still holds this Δ
            try:
                link.send(f["msgs"][i])
                if self.one_shard:
                    link.send(ready)  # the shard reads them in order
                else:
                    link.recv("ACK")
            except wire.Refused:
                raise
            except OSError as err:  # a closed connection, a reset, a timeout: the syncer went away
                f["broken"][i] = err
        f["posted"] = self._all(0.0 if f["broken"] else 1.0) == 1.0
        if f["posted"] and not self.one_shard and self.slot == 0:
            try:
                links[0].send(ready)  # rank 0's first link is shard 0's
            except OSError as err:
                f["broken"][0] = err  # every shard went with shard 0: the other ranks lose theirs too
        self.phase_s["send"] += time.perf_counter() - t0

    def _resend(self, deadline: float) -> None:
        """Connect again where a connection broke, and every rank sends its Δ slices again."""
        f = self.inflight
        for i, err in f["broken"].items():
            self.links[i].reopen(deadline, err)
        f["params"] = [None] * len(self.links)
        self._post()

    def _receive(self, wait: bool) -> None:
        f = self.inflight
        if not f["posted"] or f["broken"]:
            return
        for i, link in enumerate(self.links):
            if f["params"][i] is not None:
                continue
            try:
                f["params"][i] = link.recv_params(self.part) if wait else link.poll_params(self.part)
            except wire.Refused:
                raise
            except OSError as err:
                f["broken"][i] = err
                return

    def _await(self) -> None:
        """Wait for the in-flight merge on every rank (re-sending after a syncer restart), then adopt it."""
        f = self.inflight
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._receive(wait=True)
            if self._all(1.0 if f["posted"] and not f["broken"] else 0.0) == 1.0:
                break
            self._resend(deadline)
        msgs, version = self._get_agreed(f["params"], deadline)
        t1 = time.perf_counter()
        self.phase_s["wait"] += t1 - t0
        self._adopt(version, msgs)
        self.phase_s["adopt"] += time.perf_counter() - t1

    def _poll(self) -> None:
        """After an inner step (adopt "overlap"): adopt the merge if every rank holds it; recover if one lost it."""
        f = self.inflight
        self._receive(wait=False)
        held = all(p is not None for p in f["params"])
        state = -1.0 if f["broken"] or not f["posted"] else (1.0 if held else 0.0)
        if self._all(state) != 0.0:
            self._await()


__all__ = ["Exchange"]
