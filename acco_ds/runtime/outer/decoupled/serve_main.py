"""``python -m acco_ds.runtime.outer.decoupled.syncer``: one shard of the syncer, as ``acco-ds syncer`` and a
launch's own shards start it. The secret comes from ``--auth-file`` (never from the command line, which other
users can read); a launch that made a secret for itself passes ``--remove-auth-file`` and the shard deletes the
file once it has read it."""

import argparse
import ctypes
import json
import os

import torch

from . import transport, wire


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="one shard of the syncer of acco's decoupled mode")
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--shards", type=int, default=0, help="how many shards the syncer has (told to learners)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--leader", default=None, help="host:port of shard 0 (shards above 0)")
    p.add_argument("--settings", required=True, help="JSON: outer_lr, outer_momentum, nesterov, merge, staleness, "
                                                     "nesterov_delay")
    p.add_argument("--min-quorum", type=int, default=1)
    p.add_argument("--grace-s", default="0")
    p.add_argument("--learners", type=int, default=None)
    p.add_argument("--max-learners", type=int, default=None)
    p.add_argument("--max-connections", type=int, default=1024)
    p.add_argument("--state-dir", default=None)
    p.add_argument("--port-file", default=None, help="write the port here once listening")
    p.add_argument("--max-message-mb", type=float, default=4096.0)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--liveness-s", type=float, default=10.0)
    p.add_argument("--idle-exit-s", type=float, default=None)
    p.add_argument("--auth-file", default=None)
    p.add_argument("--remove-auth-file", action="store_true")
    return p


def keep_freed_memory() -> None:
    """Large buffers (a Δ slice, the copy of θ_g sent) come from the heap and freed ones stay in it: glibc would
    map each one fresh and fault in every page of it again at each merge (a third of a 64 MiB exchange's time on
    the shard). Only in a shard's own process."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_max = -1, -4  # mallopt's parameters (malloc.h)
    libc.mallopt(m_mmap_max, 0)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


def main(Shard, argv=None) -> int:
    """Parse ``argv`` and serve one ``Shard`` (the class, passed by ``syncer.main``)."""
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    keep_freed_memory()
    keys = None
    if args.auth_file:
        try:
            keys = transport.load_keys(args.auth_file)
        except ValueError as err:
            raise SystemExit(str(err))
        finally:
            if args.remove_auth_file and os.path.exists(args.auth_file):
                os.remove(args.auth_file)
    grace = args.grace_s if args.grace_s == "auto" else float(args.grace_s)
    leader = wire.split_address(args.leader) if args.leader else None
    try:
        shard = Shard(args.index, args.host, args.port, json.loads(args.settings), min_quorum=args.min_quorum,
                      grace_s=grace, learners=args.learners, state_dir=args.state_dir, leader=leader,
                      max_message_mb=args.max_message_mb, timeout_s=args.timeout_s, idle_exit_s=args.idle_exit_s,
                      liveness_s=args.liveness_s, keys=keys, max_learners=args.max_learners,
                      max_connections=args.max_connections, shards=args.shards)
    except ValueError as err:
        raise SystemExit(str(err))
    if args.port_file:
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(shard.port))
        os.replace(args.port_file + ".tmp", args.port_file)
    shard.say(f"listening on {args.host}:{shard.port}, " + ("CURVE (auth_file)" if keys else "no secret, loopback")
              + (f", following {args.leader}" if leader else ""))
    shard.start().serve()
    return 0


__all__ = ["main", "parser"]
