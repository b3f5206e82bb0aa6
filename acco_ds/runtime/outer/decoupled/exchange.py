"""How a rank of a decoupled learner sends its Δ slice and waits for the merge that holds it, and how the ranks of
a learner of several ranks agree (a mixin of ``learner.DecoupledLearner``, which holds the link, the in-flight
Δ and adopts the merge).

The in-flight Δ is a dict: ``msg`` (the DELTA, kept for a re-send), ``base``, ``steps``, ``sent`` (the weights at
the send, adopt "overlap"), ``posted`` (every rank's slice is held and READY went out), ``broken`` (the error
that closed this rank's connection, or None) and ``params`` (the PARAMS received). Every rank runs the same
collectives in the same order whatever failed: a small MIN all-reduce after each send and each wait, so that
all ranks re-send together, and adopt together once every one holds PARAMS of one version."""

import time

import torch.distributed as tdist

from . import wire

MIN = tdist.ReduceOp.MIN


class Exchange:
    """Sending the in-flight Δ, re-sending it after a syncer restart, and waiting for its merge."""

    def _all(self, flag: float) -> float:
        """The smallest ``flag`` over the ranks of this learner (every rank calls it at the same point)."""
        return flag if self.slots == 1 else self.groups.reduce(float(flag), self.shards.device, op=MIN)

    def _agree(self, version: int) -> bool:
        """Do every rank of this learner hold ``version``?"""
        if self.slots == 1:
            return True
        hi = self.groups.reduce(float(version), self.shards.device, op=tdist.ReduceOp.MAX)
        return self._all(float(version)) == hi

    def _get_agreed(self, msg: wire.Message, deadline: float) -> wire.Message:
        """PARAMS of one version on every rank: ask again (GET) until the shards answer the same one."""
        while not self._agree(msg.version):
            if time.monotonic() > deadline:
                raise ConnectionError(f"acco decoupled: the syncer shards of learner {self.learner} hold different "
                                      f"versions of θ_g (a shard restarted from an older checkpoint than the others): "
                                      f"restart every shard on its state_dir")
            self.link.send(self.link.mine("GET"))
            msg = self.link.recv("PARAMS", "theta", self.numel)
        return msg

    # ------------------------------------------------------------------ the exchange
    def _post(self) -> None:
        """Send the in-flight Δ: one rank sends DELTA then READY; k ranks send DELTA, wait for the ACK, agree that
        every slice is held, and rank 0 says READY. A connection that fails marks the Δ for a re-send."""
        f, link = self.inflight, self.link
        ready = link.mine("READY", version=f["msg"].version, base=f["base"], tokens=f["msg"].tokens, steps=f["steps"])
        f["broken"] = None
        link.waiting_base = f["base"]  # its PINGs ask whether the shard still holds this Δ
        t0 = time.perf_counter()
        try:
            link.send(f["msg"])
            if self.slots == 1:
                link.send(ready)
            else:
                link.recv("ACK")
        except wire.Refused:
            raise
        except OSError as err:  # a closed connection, a reset, a timeout: the syncer went away
            f["broken"] = err
        f["posted"] = self._all(0.0 if f["broken"] else 1.0) == 1.0
        if f["posted"] and self.slots > 1 and self.slot == 0:
            try:
                link.send(ready)
            except OSError as err:
                f["broken"] = err  # every shard went with shard 0: the other ranks lose theirs too
        self.phase_s["send"] += time.perf_counter() - t0

    def _resend(self, deadline: float) -> None:
        """Connect again where the connection broke, and every rank sends its Δ slice again."""
        f = self.inflight
        if f["broken"] is not None:
            self.link.reopen(deadline, f["broken"])
        f["params"] = None
        self._post()

    def _receive(self, wait: bool) -> None:
        f = self.inflight
        if f["posted"] and f["params"] is None and f["broken"] is None:
            try:
                f["params"] = self.link.recv_params(self.numel) if wait else self.link.poll_params(self.numel)
            except wire.Refused:
                raise
            except OSError as err:
                f["broken"] = err

    def _await(self) -> None:
        """Wait for the in-flight merge on every rank (re-sending after a syncer restart), then adopt it."""
        f = self.inflight
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        while True:
            self._receive(wait=True)
            if self._all(1.0 if f["posted"] and f["broken"] is None else 0.0) == 1.0:
                break
            self._resend(deadline)
        msg = self._get_agreed(f["params"], deadline)
        t1 = time.perf_counter()
        self.phase_s["wait"] += t1 - t0
        self._adopt(msg)
        self.phase_s["adopt"] += time.perf_counter() - t1

    def _poll(self) -> None:
        """After an inner step (adopt "overlap"): adopt the merge if every rank holds it; recover if one lost it."""
        f = self.inflight
        self._receive(wait=False)
        state = -1.0 if f["broken"] is not None or not f["posted"] else (1.0 if f["params"] is not None else 0.0)
        if self._all(state) != 0.0:
            self._await()


__all__ = ["Exchange"]
