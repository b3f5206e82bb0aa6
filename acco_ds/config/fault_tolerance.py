"""The ``fault_tolerance`` block of ``"acco"``: replicas that come and go, on torchft.

    "acco": {"enabled": true, "mode": "diloco", "local_sgd": {"sync_every": 50},
             "fault_tolerance": {"min_replicas": 2, "merge": "tokens"}}

With the block, one launch is one replica: its ranks run ZeRO-1 (or FSDP2) inside, and the outer
all-reduce of the local-SGD modes runs through torchft's Manager, which forms a quorum of the replicas
present at every sync, heals a replica that joins from a live one, and discards a sync that a failure
interrupted. Kept apart from ``local_sgd`` so each module stays readable; ``ACCOConfig`` checks how
the block combines with the rest of ``"acco"`` (``check``).
"""

import os
import socket
import time
from typing import Literal, Optional
from urllib.parse import urlparse

from pydantic import Field, StrictInt, field_validator

from .local_sgd import _Documented

LIGHTHOUSE_ENV, REPLICA_ENV = "TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID"
START_LIGHTHOUSE = "torchft_lighthouse --min_replicas 1 --bind [::]:29510 --join_timeout_ms 1000"


def lighthouse_problem(addr: str):
    """None if ``addr`` is an http(s) URL with a host and a port (what torchft's lighthouse client dials),
    else what is wrong with it and the fix. The lighthouse has no authentication
    (docs/checkpoint-safety.md): its address belongs on the cluster's private network."""
    try:
        url = urlparse(addr)
        port = url.port
    except ValueError as err:  # a port that is not a number, or out of range
        url, port, problem = None, None, str(err)
    else:
        problem = (f"the scheme is missing: write http://{addr}" if "://" not in addr else
                   "the scheme must be http or https" if url.scheme not in ("http", "https") else
                   "it names no host" if not url.hostname else
                   "it names no port" if port is None else
                   "it carries a user or password, which the lighthouse does not check" if url.username else
                   "it carries a path, query or fragment" if url.path not in ("", "/") or url.query or url.fragment
                   else None)
    return problem and (f"must be an http(s) URL with a host and a port, such as http://10.0.0.5:29510 (the "
                        f"lighthouse's address on the cluster's private network): {problem}")


class FaultToleranceConfig(_Documented):
    """Replicas that come and go (local-SGD modes, torchft). Each launch is one replica; a lost replica
    stops nobody, a relaunched or new one heals from a live one before its first inner step."""

    min_replicas: StrictInt = Field(1, ge=1)
    """Fewest replicas a sync may commit with; below it the sync is discarded and tried again at the
    next one (and the lighthouse waits for that many replicas before the first quorum)."""

    replica_id: Optional[str] = Field(None, min_length=1)
    """This replica's name (every rank of a launch gives the same). Default: the environment variable
    ``REPLICA_GROUP_ID``, as in torchft's examples. End it in a number (``"replica_3"`` or ``"3"``)."""

    lighthouse: Optional[str] = Field(None, min_length=1)
    """The torchft lighthouse, e.g. ``"http://localhost:29510"``. Default: ``TORCHFT_LIGHTHOUSE``."""

    timeout_s: float = Field(60.0, gt=0.0, allow_inf_nan=False)
    """Timeout of the outer all-reduces, of the commit vote, of a heal's transfer and of reaching the
    lighthouse: a replica that stops answering is left out after about this long."""

    quorum_timeout_s: float = Field(600.0, gt=0.0, allow_inf_nan=False)
    """How long a sync waits for a quorum of at least ``min_replicas`` replicas (progress lines every
    10 s meanwhile) before it raises. A joining replica waits up to one sync period of the others with
    ``join: "next_sync"``, about one inner step of theirs with ``"early"``."""

    merge: Literal["mean", "tokens"] = "mean"
    """How the participants' pseudo-gradients are merged: ``mean``, every replica that trained since the
    global model it holds alike; ``tokens``, each weighted by the inner steps it trained since then (its
    tokens, the per-step batch being the same), so a slow replica (A-EDiT) counts for what it did. A
    replica that just healed weighs 0."""

    join: Literal["early", "next_sync"] = "early"
    """When a new or relaunched replica joins. ``early``: the live replicas end their period at their next
    inner step once a replica outside their last quorum waits for one (rank 0 of each replica reads the
    lighthouse's status page every ``join_poll_s``), so the joiner heals within about a step instead of up
    to a whole period; that period is shorter and the run has one more sync. ``next_sync``: the joiner waits
    for the live replicas' scheduled sync. Streaming DiLoCo syncs a fragment every ``sync_every /
    fragments`` steps and always joins there."""

    join_poll_s: float = Field(0.5, gt=0.0, le=60.0, allow_inf_nan=False)
    """How often (seconds) rank 0 of a live replica reads the lighthouse's status page for waiting joiners
    (``join: "early"``): one small HTTP request each time."""

    @field_validator("lighthouse")
    @classmethod
    def _lighthouse_is_a_url(cls, value):
        problem = value and lighthouse_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    def check(self, acco) -> None:
        """How the block combines with the rest of ``"acco"`` (one ``ValueError`` naming the fix)."""
        if not acco.local:
            raise ValueError(f'acco.fault_tolerance lets the replicas of a local-SGD mode come and go, but '
                             f'acco.mode is "{acco.mode}": its ranks are one data-parallel group that takes every '
                             f'step together, so there is no replica to lose or to heal. Use acco.mode "diloco", '
                             f'"co2", "edit" or "sparseloco", or remove acco.fault_tolerance (recovery of the round '
                             f'modes is a relaunch and load_checkpoint)')
        c = acco.compression
        if c.enabled and (c.apply_to is None or "outer" in c.apply_to):
            raise ValueError('acco.compression of the outer all-reduce cannot run with acco.fault_tolerance: its '
                             'error-feedback residuals are laid out per participant, and the participants change '
                             'at every quorum. Set acco.compression.apply_to to ["rounds"] (inside a replica), or '
                             'remove acco.compression')
        edit = acco.local_sgd
        if "join" in self.model_fields_set and self.join == "early" and edit is not None and edit.streaming:
            raise ValueError('acco.fault_tolerance.join "early" ends a period early for a joiner, but Streaming '
                             'DiLoCo (acco.local_sgd.fragments) has no single period end: a joiner takes part in '
                             'the next fragment sync, every sync_every / fragments inner steps. Remove join (or '
                             'set it to "next_sync")')
        if acco.mode == "edit" and edit is not None and (edit.anomaly.enabled or edit.weighting == "norm"):
            what = "anomaly.enabled" if edit.anomaly.enabled else 'weighting="norm"'
            raise ValueError(f"acco.local_sgd.{what} cannot run with acco.fault_tolerance: EDiT's anomaly "
                             f"statistics and norm weighting follow each replica by its place among a fixed set "
                             f"of replicas, which a changing quorum does not have. Remove it: pseudo_grad_clip "
                             f"and A-EDiT's sync_time_s work with fault tolerance")

    def resolved_lighthouse(self) -> str:
        """The lighthouse address (the key, else ``TORCHFT_LIGHTHOUSE``), or a ``ValueError`` naming both."""
        addr = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV)
        if not addr:
            raise ValueError(f"acco.fault_tolerance needs a torchft lighthouse: set {LIGHTHOUSE_ENV} (e.g. "
                             f"http://localhost:29510) or acco.fault_tolerance.lighthouse. Start one with "
                             f"`{START_LIGHTHOUSE}`")
        problem = lighthouse_problem(addr)  # the key was checked when the config was read; the variable here
        if problem:
            raise ValueError(f"{LIGHTHOUSE_ENV}={addr!r} {problem}")
        return addr

    def resolved_replica_id(self) -> str:
        rid = self.replica_id or os.environ.get(REPLICA_ENV)
        if not rid:
            raise ValueError(f"acco.fault_tolerance needs this replica's name: set {REPLICA_ENV} (e.g. 0, 1, 2 for "
                             f"three launches) or acco.fault_tolerance.replica_id")
        if not rid[-1].isdigit():
            raise ValueError(f"acco.fault_tolerance replica id {rid!r} must end in a number (torchft numbers the "
                             f"replicas' ranks from it): use e.g. {rid}_0")
        return rid

    def check_lighthouse(self) -> str:
        """Reach the lighthouse within ``timeout_s`` (every rank, before torchft's Manager is built, so that no
        rank hangs on a peer that failed); returns its address. A refused connection is tried again until then:
        a replica started with its lighthouse (no launcher in between) may ask before it listens."""
        addr = self.resolved_lighthouse()
        url = urlparse(addr)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                socket.create_connection((url.hostname, url.port or 80),
                                         timeout=max(deadline - time.monotonic(), 0.1)).close()
                return addr
            except OSError as err:
                if time.monotonic() + 0.2 < deadline:
                    time.sleep(0.2)
                    continue
                source = "acco.fault_tolerance.lighthouse" if self.lighthouse else LIGHTHOUSE_ENV
                raise RuntimeError(f"acco.fault_tolerance: cannot reach the torchft lighthouse at {addr} ({source}) "
                                   f"within timeout_s={self.timeout_s:g} s: {err}. Start one with "
                                   f"`{START_LIGHTHOUSE}` and point {LIGHTHOUSE_ENV} at it") from None


__all__ = ["FaultToleranceConfig", "lighthouse_problem", "LIGHTHOUSE_ENV", "REPLICA_ENV", "START_LIGHTHOUSE"]
