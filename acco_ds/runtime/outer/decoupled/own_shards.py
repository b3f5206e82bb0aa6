"""The syncer shards a ``deepspeed`` launch of ``"mode": "decoupled"`` starts for itself: the ranks of learner 0
start them (its rank j, ``loop.slot``, starts shard j, shard 0 first: the others follow it), and every rank learns
every port through two small all-reduces at start-up. A shard is a CPU process of its own session, so the crash of the rank
that started it does not end it; it stops once every learner is done, or once no learner has been heard from for
``IDLE_EXIT_S`` seconds (learners that died).

Without ``syncer.auth_file`` the launch makes a secret for itself: rank 0 draws 32 random bytes and every rank
receives them in one all-reduce (they never touch a disk but for the moment a shard reads them from an owner-only
file that it then deletes), so the launch's shards admit the launch's learners only, encrypted, whatever
``syncer.host`` is."""

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as tdist

from . import transport, wire

IDLE_EXIT_S = 10.0
KEY = "acco.local_sgd.syncer.auth_file"


def shard_address(loop) -> Callable[[int], Tuple[str, int]]:
    """``where(j)``: ``(host, port)`` of syncer shard j: ``syncer.address`` + j, or a shard of the launch's own."""
    cfg, groups = loop.syncer_config, loop.groups
    j, slots = loop.slot, loop.slots  # this rank's place in its learner, over its replica and model-parallel groups
    auth_file = cfg.auth_file if cfg is not None else None
    if cfg is not None and cfg.address:
        host, port = wire.split_address(cfg.address)
        loop.keys = transport.load_keys(auth_file, KEY)
        return lambda shard: (host, port + shard)
    loop.secret = None if auth_file else launch_secret(loop)
    loop.keys = transport.load_keys(auth_file, KEY) if auth_file else transport.Keys(loop.secret)
    host = cfg.host if cfg is not None else "127.0.0.1"
    state_dir = (cfg.state_dir if cfg is not None else None) or tempfile.mkdtemp(prefix="acco_syncer_")
    mine = groups.replica == 0
    ports = torch.zeros(slots, dtype=torch.int64, device=loop.shards.device)
    if mine and j == 0:
        ports[0] = spawn(loop, 0, host, None, state_dir)
    tdist.all_reduce(ports)
    if mine and j > 0:
        ports[j] = spawn(loop, j, host, f"{host}:{int(ports[0])}", state_dir)
    if slots > 1:
        rest = ports.clone()
        rest[0] = 0
        tdist.all_reduce(rest)
        ports[1:] = rest[1:]
    ports = [int(p) for p in ports.tolist()]
    return lambda shard: (host, ports[shard])


def launch_secret(loop) -> bytes:
    """32 random bytes drawn by rank 0 of learner 0, the same on every rank (one all-reduce)."""
    first = loop.groups.replica == 0 and loop.slot == 0
    draw = secrets.token_bytes(transport.MIN_SECRET) if first else bytes(transport.MIN_SECRET)
    t = torch.tensor(list(draw), dtype=torch.int64, device=loop.shards.device)
    tdist.all_reduce(t)
    return bytes(int(v) for v in t.tolist())


def secret_file(loop) -> tuple:
    """The ``--auth-file`` arguments of a shard: the configured file, or the launch's secret in an owner-only file
    that the shard deletes once read."""
    auth_file = loop.syncer_config.auth_file if loop.syncer_config is not None else None
    if auth_file:
        return ["--auth-file", auth_file]
    fd, path = tempfile.mkstemp(prefix="acco_syncer_secret_")  # mode 0600
    with os.fdopen(fd, "wb") as f:
        f.write(loop.secret)
    return ["--auth-file", path, "--remove-auth-file"]


def spawn(loop, j: int, host: str, leader: Optional[str], state_dir: str) -> int:
    """Start shard ``j`` with ``loop``'s settings; returns its port once it listens."""
    ls, timeout_s = loop.local, loop.timeout_s
    settings = {**{k: loop.settings[k] for k in ("outer_lr", "outer_momentum", "nesterov")},
                "merge": ls.merge, "staleness": ls.staleness,
                "nesterov_delay": ls.nesterov_delay or loop.groups.replicas}
    os.makedirs(state_dir, exist_ok=True)
    port_file = os.path.join(state_dir, f"port{j}")
    if os.path.exists(port_file):
        os.remove(port_file)
    cmd = [sys.executable, "-m", "acco_ds.runtime.outer.decoupled.syncer", "--index", str(j), "--host", host,
           "--shards", str(loop.slots),           "--settings", json.dumps(settings), "--min-quorum", str(ls.min_quorum), "--grace-s", str(ls.grace_s),
           "--learners", str(loop.groups.replicas), "--state-dir", state_dir, "--port-file", port_file,
           "--timeout-s", str(timeout_s), "--idle-exit-s", str(IDLE_EXIT_S)]
    if leader:
        cmd += ["--leader", leader]
    if loop.syncer_config is not None:
        cmd += ["--max-message-mb", str(loop.syncer_config.max_message_mb),
                "--liveness-s", str(loop.syncer_config.liveness_s)]
    cmd += secret_file(loop)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log = open(os.path.join(state_dir, f"shard{j}.log"), "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    loop.procs.append(proc)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(port_file):
        if proc.poll() is not None:
            raise RuntimeError(f"acco decoupled: syncer shard {j} exited at start (code {proc.returncode}); its "
                               f"log: {log.name}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"acco decoupled: syncer shard {j} did not start within {timeout_s:g} s; its log: "
                               f"{log.name}")
        time.sleep(0.05)
    loop.state_dir = state_dir
    with open(port_file) as f:
        return int(f.read())


__all__ = ["shard_address", "spawn", "IDLE_EXIT_S"]
