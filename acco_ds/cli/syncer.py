"""``acco-ds syncer``: run the syncer of ``"mode": "decoupled"`` for learners launched on their own (one
``deepspeed`` launch per learner, each naming ``acco.local_sgd.syncer.address``).

    acco-ds syncer --config ds_config.json --shards 2 --port 29600 --state-dir /ckpt/syncer [--learners 3]

Shard j (one CPU process each) listens on port + j and serves rank j of every learner; shard 0 decides the
merges. The outer settings (outer_lr, outer_momentum, nesterov, min_quorum, grace_s, merge, staleness,
nesterov_delay) come from the config's ``acco`` block, as the learners read it. With ``--state-dir`` every
shard checkpoints after every merge, and running the command again on the same folder resumes. It stops once
``--learners`` learners are done (default: on Ctrl-C).
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
    ls = acco.local_sgd
    out = {k: acco.outer[k] for k in ("outer_lr", "outer_momentum", "nesterov")}
    out.update(merge=ls.merge, staleness=ls.staleness, nesterov_delay=ls.nesterov_delay)
    syncer = ls.syncer
    return {"settings": out, "min_quorum": ls.min_quorum, "grace_s": ls.grace_s,
            "state_dir": syncer.state_dir if syncer else None, "timeout_s": syncer.timeout_s if syncer else 120.0,
            "max_message_mb": syncer.max_message_mb if syncer else 4096.0}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="acco-ds syncer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="the learners' DeepSpeed config (its acco block)")
    ap.add_argument("--shards", type=int, required=True, help="ranks per learner (replica_group_size)")
    ap.add_argument("--port", type=int, required=True, help="shard j listens on port + j")
    ap.add_argument("--host", default="0.0.0.0", help="address to bind (default: every interface)")
    ap.add_argument("--state-dir", default=None, help="checkpoint folder (default: acco.local_sgd.syncer.state_dir)")
    ap.add_argument("--learners", type=int, default=None, help="stop once this many learners are done")
    args = ap.parse_args(argv)
    s = settings_from(args.config)
    state_dir = args.state_dir or s["state_dir"] or tempfile.mkdtemp(prefix="acco_syncer_")
    os.makedirs(state_dir, exist_ok=True)
    if s["settings"]["nesterov_delay"] is None:  # Delayed Nesterov's N defaults to the number of learners
        if s["settings"]["staleness"] == "delayed_nesterov" and not args.learners:
            raise SystemExit('acco-ds syncer: staleness "delayed_nesterov" needs its N: set '
                             'acco.local_sgd.nesterov_delay in the config, or pass --learners')
        s["settings"]["nesterov_delay"] = args.learners or 1
    procs = []
    leader = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    for j in range(args.shards):
        cmd = [sys.executable, "-m", "acco_ds.runtime.outer.decoupled.syncer", "--index", str(j), "--host", args.host,
               "--port", str(args.port + j), "--settings", json.dumps(s["settings"]),
               "--min-quorum", str(s["min_quorum"]), "--grace-s", str(s["grace_s"]), "--state-dir", state_dir,
               "--timeout-s", str(s["timeout_s"]), "--max-message-mb", str(s["max_message_mb"])]
        if args.learners:
            cmd += ["--learners", str(args.learners)]
        if j:
            cmd += ["--leader", f"{leader}:{args.port}"]
        procs.append(subprocess.Popen(cmd))
        if j == 0:
            time.sleep(0.5)  # shard 0 listens before the others follow it (they retry anyway)
    print(f"[acco_ds] syncer: {args.shards} shard(s) on {args.host}:{args.port}..{args.port + args.shards - 1}, "
          f"state in {state_dir}", flush=True)

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
