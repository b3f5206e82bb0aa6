"""``acco-ds syncer``: run the syncer of ``"mode": "decoupled"`` for learners launched on their own (one
``deepspeed`` launch per learner, each naming ``acco.local_sgd.syncer.address``).

    acco-ds syncer --make-secret /etc/acco/syncer.key          # once: 32 random bytes, owner-only
    acco-ds syncer --config ds_config.json --shards 2 --port 29600 --host 0.0.0.0 \\
        --auth-file /etc/acco/syncer.key --state-dir /ckpt/syncer --learners 3

Shard j (one CPU process each) listens on port + j and holds part j of the global model, cut as a ZeRO-1
optimizer of ``--shards`` ranks would cut it; a learner of as many ranks sends each rank's partition as it is, a
learner of another size moves its pieces between its ranks first (``runtime/outer/decoupled/layout.py``), so
learners of different sizes share one syncer. Shard 0 decides the merges. The outer settings (outer_lr,
outer_momentum, nesterov, min_quorum, grace_s, merge, staleness, nesterov_delay, liveness_s) come from the config's ``acco`` block, as the learners read it. With ``--auth-file``
(or ``acco.local_sgd.syncer.auth_file``) every peer proves it holds the secret and all traffic is encrypted
(CURVE); without one the syncer binds loopback only. With ``--state-dir`` every shard checkpoints after every
merge, and running the command again on the same folder resumes. With ``--learners M`` no merge happens before M
learners have joined, and the syncer stops once M are done (default: it runs until Ctrl-C).
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def settings_from(config_path: str) -> dict:
    from ..config import parse_acco_config
    with open(config_path) as f:
        acco = parse_acco_config(json.load(f))
    if acco.mode != "decoupled":
        raise SystemExit(f'acco-ds syncer: {config_path} has acco.mode "{acco.mode}"; the syncer serves mode '
                         f'"decoupled"')
    from ..config.local_sgd import LocalSGDConfig
    ls = acco.local_sgd or LocalSGDConfig()  # every key at its default
    out = {k: acco.outer[k] for k in ("outer_lr", "outer_momentum", "nesterov")}
    out.update(merge=ls.merge, staleness=ls.staleness, nesterov_delay=ls.nesterov_delay)
    syncer = ls.syncer
    return {"settings": out, "min_quorum": ls.min_quorum, "grace_s": ls.grace_s,
            "state_dir": syncer.state_dir if syncer else None, "timeout_s": syncer.timeout_s if syncer else 120.0,
            "max_message_mb": syncer.max_message_mb if syncer else 4096.0,
            "liveness_s": syncer.liveness_s if syncer else 10.0, "auth_file": syncer.auth_file if syncer else None}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="acco-ds syncer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make-secret", metavar="PATH", help="write a new secret (32 random bytes, mode 600) and exit")
    ap.add_argument("--config", help="the learners' DeepSpeed config (its acco block)")
    ap.add_argument("--shards", type=int,
                    help="CPU processes that hold the global model, each a part of it (any number for dense "
                         "learners; a multiple of the tensor x pipeline parallel size; with experts, the ranks "
                         "per learner)")
    ap.add_argument("--port", type=int, help="shard j listens on port + j")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; any other needs "
                                                        "--auth-file)")
    ap.add_argument("--auth-file", default=None, help="the secret (default: acco.local_sgd.syncer.auth_file)")
    ap.add_argument("--state-dir", default=None, help="checkpoint folder (default: acco.local_sgd.syncer.state_dir)")
    ap.add_argument("--learners", type=int, default=None, help="M: no merge before M learners joined; stop once "
                                                               "M are done")
    ap.add_argument("--max-learners", type=int, default=None, help="refuse learners beyond this many")
    ap.add_argument("--max-connections", type=int, default=1024, help="connections each shard admits")
    return ap


def shard_cmd(args, s, j: int, state_dir: str, auth_file) -> list:
    leader = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    cmd = [sys.executable, "-m", "acco_ds.runtime.outer.decoupled.syncer", "--index", str(j), "--host", args.host,
           "--shards", str(args.shards), "--port", str(args.port + j), "--settings", json.dumps(s["settings"]),
           "--min-quorum", str(s["min_quorum"]), "--grace-s", str(s["grace_s"]), "--state-dir", state_dir,
           "--timeout-s", str(s["timeout_s"]), "--max-message-mb", str(s["max_message_mb"]),
           "--liveness-s", str(s["liveness_s"]), "--max-connections", str(args.max_connections)]
    for flag, value in (("--learners", args.learners), ("--max-learners", args.max_learners),
                        ("--auth-file", auth_file)):
        if value:
            cmd += [flag, str(value)]
    if j:
        cmd += ["--leader", f"{leader}:{args.port}"]
    return cmd


def main(argv=None) -> int:
    from ..runtime.outer.decoupled import transport
    args = parser().parse_args(argv)
    if args.make_secret:
        try:
            transport.make_secret(args.make_secret)
        except FileExistsError:
            raise SystemExit(f"acco-ds syncer: {args.make_secret} exists; remove it first or choose another path")
        print(f"[acco_ds] syncer: wrote a new secret to {args.make_secret} (mode 600); give it to the syncer "
              f"(--auth-file) and the learners (acco.local_sgd.syncer.auth_file)")
        return 0
    if not (args.config and args.shards and args.port):
        raise SystemExit("acco-ds syncer: --config, --shards and --port are needed (or --make-secret PATH)")
    s = settings_from(args.config)
    auth_file = args.auth_file or s["auth_file"]
    if auth_file is None and not transport.is_loopback(args.host):
        raise SystemExit(f"acco-ds syncer: --host {args.host} is not loopback: give --auth-file PATH (a secret the "
                         f"learners share; acco-ds syncer --make-secret PATH writes one), or bind 127.0.0.1")
    if auth_file is not None:
        try:
            transport.check_secret_file(auth_file)
        except ValueError as err:
            raise SystemExit(f"acco-ds syncer: {err}")
    state_dir = args.state_dir or s["state_dir"] or tempfile.mkdtemp(prefix="acco_syncer_")
    os.makedirs(state_dir, exist_ok=True)
    if s["settings"]["nesterov_delay"] is None:  # Delayed Nesterov's N defaults to the number of learners
        if s["settings"]["staleness"] == "delayed_nesterov" and not args.learners:
            raise SystemExit('acco-ds syncer: staleness "delayed_nesterov" needs its N: set '
                             'acco.local_sgd.nesterov_delay in the config, or pass --learners')
        s["settings"]["nesterov_delay"] = args.learners or 1
    procs = []
    for j in range(args.shards):
        procs.append(subprocess.Popen(shard_cmd(args, s, j, state_dir, auth_file)))
        if j == 0:
            time.sleep(0.5)  # shard 0 listens before the others follow it (they retry anyway)
    print(f"[acco_ds] syncer: {args.shards} shard(s) on {args.host}:{args.port}..{args.port + args.shards - 1}, "
          f"{'encrypted (CURVE)' if auth_file else 'no secret (loopback)'}, state in {state_dir}", flush=True)

    def stop(*_):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    try:
        codes = [p.wait() for p in procs]
    except KeyboardInterrupt:
        stop()
        codes = [p.wait() for p in procs]
    return max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main())
