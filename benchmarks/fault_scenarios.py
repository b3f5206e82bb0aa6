"""The scenarios of the fault drill (``faults.py``): start ranks of ``fault_worker.py``, inject one fault,
and judge what a user sees. ``SCENARIOS`` maps a name to ``(function(workdir, deadline, opts), limit_s)``;
each returns result rows. No command line of its own: ``python benchmarks/faults.py`` runs them."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "benchmarks" / "fault_worker.py"
RESULTS = ROOT / "benchmarks" / "results"
MOUNT_PREFIX = "acco_fault_tmpfs_"


ScenarioTimeout = harness.DeadlineExceeded


# ------------------------------------------------------------------ processes
def start(spec, workdir, name, world=2, deadline=None, env=None, net=None, port=None):
    """``world`` processes of fault_worker.py with one spec (a harness.RankSet; logs, spec and results in
    ``workdir/name``); on ``net`` (a harness.Network) gloo runs over its veth pair."""
    outdir = Path(workdir) / name
    outdir.mkdir(parents=True, exist_ok=True)
    spec_path = outdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = port or harness.free_port()
    extra = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **(env or {})}
    cmds = []
    for r in range(world):
        argv = [sys.executable, str(WORKER), str(spec_path), str(outdir)]
        cmds.append(({**harness.rank_env(r, world, port, net), **extra}, argv if net is None else net.wrap(r, argv)))
    # forked from the drill when it preloaded (not inside a namespace, nor with an environment of its own)
    return harness.RankSet(cmds, outdir, name, deadline=deadline, fork=net is None and not env)


def finish(rs, timeout):
    """Wait for a run expected to succeed; returns each rank's result{rank}.pt or raises with the logs."""
    rs.finish(timeout)
    import torch
    return [torch.load(rs.outdir / f"result{r}.pt", weights_only=False) for r in range(rs.world)]


# ------------------------------------------------------------------ messages
_EXC = re.compile(r"^(?:\[rank\d+\]: )?([A-Za-z_][\w.]*(?:Error|Exception|Timeout|Interrupt|Full)\b[^\n]*)$", re.M)


def error_line(text):
    """The exception line the user reads at the bottom of the traceback (shortened), or None."""
    hits = _EXC.findall(text)
    return hits[-1].strip() if hits else None


_SECONDARY = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crashing")


def user_error(texts):
    """The error a user reads first: the first rank's own error (not a "peer closed the connection"
    error caused by another rank's failure) if any, else the first rank's error; (rank, line) or (None, None)."""
    lines = [(r, error_line(t)) for r, t in enumerate(texts)]
    lines = [(r, m) for r, m in lines if m]
    for r, m in lines:
        if not _SECONDARY.search(m):
            return r, m
    return lines[0] if lines else (None, None)


def _all_errors(text):
    return [h.strip() for h in _EXC.findall(text)]


def first_line(text, pattern):
    m = re.search(pattern, text, re.M)
    return m.group(0).strip() if m else None


def short(s, n=170):
    if s is None:
        return "-"
    s = " ".join(str(s).split())
    return s if len(s) <= n else s[:n - 1] + "…"


def judge(msg, problem_words, fix_words):
    """Does ``msg`` name the problem (any of problem_words) and a fix (any of fix_words)? Case-insensitive."""
    low = (msg or "").lower()
    problem = any(w.lower() in low for w in problem_words)
    fix = any(w.lower() in low for w in fix_words)
    return f"problem: {'yes' if problem else 'no'}; fix: {'yes' if fix else 'no'}"


def equal_params(a, b):
    import torch
    return all(torch.equal(x["params"], y["params"]) for x, y in zip(a, b))


def row(fault, seen, seconds, resumes, clear, **details):
    return {"fault": fault, "seen": seen, "seconds": seconds, "resumes": resumes, "clear": clear, **details}


# ------------------------------------------------------------------ scenarios
# Each takes (workdir, deadline, opts) and returns a list of rows. Shared
# runs are recomputed inside each scenario so that any subset can run alone.

SAVE_EVERY = 4
STEPS = 16


def _train_spec(save_dir, **kw):
    spec = {"steps": STEPS, "save_dir": str(save_dir), "save_every": SAVE_EVERY}
    spec.update(kw)
    return spec


def reference_run(workdir, deadline, steps=STEPS, **kw):
    """An uninterrupted run (with the same checkpoints) to compare against."""
    rs = start(_train_spec(Path(workdir) / "ref_ckpt", steps=steps, **kw), workdir, "reference",
                 deadline=deadline)
    return finish(rs, deadline.left())


def scenario_jit_kill(workdir, deadline, opts):
    """SIGKILL of both ranks' process groups while ninja/the compiler runs, then a restart."""
    ext = Path(workdir) / "torch_extensions"
    env = {"TORCH_EXTENSIONS_DIR": str(ext), "ACCO_FAULT_NO_AOT": "1", "ACCO_JIT_WAIT_S": "600"}
    spec = {"kernels": "native", "stop_after_start": True}
    first = start(spec, workdir, "jit_first", deadline=deadline, env=env)
    lock = None
    until = time.monotonic() + min(180, deadline.left())
    while time.monotonic() < until:
        locks = list(ext.glob("*/acco_cpu_ops/lock")) + list(ext.glob("acco_cpu_ops/lock"))
        compiling = _compiler_running(first)
        if locks and compiling:
            lock = locks[0]
            break
        if all(c is not None for c in first.poll()):
            break
        time.sleep(0.05)
    if lock is None:
        first.kill_all()
        return [row("SIGKILL during the JIT build, then restart", "could not catch the build (no lock file "
                    "while the compiler ran)", "n/a", "n.a.", "-", logs=first.tails())]
    time.sleep(1.0)  # well inside the compile (it takes tens of seconds)
    for r in range(2):
        first.signal(r, signal.SIGKILL)
    first.wait(timeout=10)
    first.close()
    left_behind = lock.exists()
    t0 = time.monotonic()
    second = start(spec, workdir, "jit_restart", deadline=deadline, env=env)
    codes = second.wait(timeout=deadline.left())
    took = time.monotonic() - t0
    logs = second.log(0) + second.log(1)
    warn = first_line(logs, r".*stale JIT build lock.*")
    ok = codes == [0, 0] and "FAULTDRILL STARTED" in second.log(0)
    second.close()
    seen = (warn or "(no warning)") if ok else (error_line(logs) or "failed")
    return [row("SIGKILL during the JIT build (kernels native, cold cache), then restart",
                f"restart: {short(warn, 150) if warn else 'no warning'}; both ranks start (op rebuilt)" if ok else
                short(seen), f"restart ok in {took:.1f}" if ok else "n/a", "n.a.",
                judge(warn, ["stale JIT build lock"], ["built again"]) if warn else "-",
                lock_left_behind=left_behind, restart_codes=codes, restart_seconds=took, warning=warn,
                logs=second.tails() if not ok else None)]


def _compiler_running(rs):
    """Is a compiler (ninja/c++) a descendant of one of the ranks?"""
    pgids = {p.pid for p in rs.procs}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            pgid = int(stat.rsplit(")", 1)[1].split()[2])
        except (OSError, ValueError, IndexError):
            continue
        if pgid in pgids and comm in ("ninja", "c++", "g++", "cc1plus", "gcc", "x86_64-linux-gnu-g++"):
            return True
    return False


def _kill_mid_round(workdir, deadline, name, fault_label, sig, opts, extra_spec=None, net=None,
                    inject=None, after_kill=None):
    """Train with checkpoints, inject a fault after the checkpoint at step SAVE_EVERY, measure how long
    until every rank has exited with an error."""
    spec = _train_spec(Path(workdir) / f"{name}_ckpt", micro_sleep=0.05, **(extra_spec or {}))
    rs = start(spec, workdir, name, deadline=deadline, net=net)
    rs.wait_for(rf"FAULTDRILL SAVED rank=1 step={SAVE_EVERY}\b", rank=1, timeout=min(120, deadline.left()))
    rs.wait_for(rf"FAULTDRILL STEP rank=1 step={SAVE_EVERY + 1}\b", rank=1, timeout=min(60, deadline.left()))
    time.sleep(0.03)  # inside the next round's compute, its communication in flight
    t0 = time.monotonic()
    if inject is not None:
        inject(rs)
    else:
        rs.signal(1, sig)
    watch = [0] if sig == signal.SIGSTOP else [0, 1]
    codes = rs.wait(timeout=deadline.left() - 15, ranks=watch)
    times = [None if rs.exit_time[r] is None else rs.exit_time[r] - t0 for r in range(2)]
    if after_kill is not None:
        after_kill(rs)
    survivors_codes = [codes[r] for r in watch]
    all_exited = all(c is not None for c in survivors_codes)
    all_error = all_exited and all(c != 0 for c in survivors_codes)
    seconds = max(times[r] for r in watch) if all_exited else None
    rank, msg = user_error([rs.log(r) for r in watch])
    tails = rs.tails()
    rs.kill_all()
    return {"codes": codes, "times": times, "all_error": all_error, "seconds": seconds, "msg": msg,
            "messages": [error_line(rs.log(r)) for r in range(2)],
            "log0": rs.log(0), "tails": tails, "spec": spec}


def _resume(workdir, deadline, name, ref, extra_spec=None):
    """Relaunch both ranks with load_checkpoint, train to STEPS, compare with the uninterrupted run."""
    spec = _train_spec(Path(workdir) / f"{name}_ckpt", load=True, **(extra_spec or {}))
    rs = start(spec, workdir, f"{name}_resume", deadline=deadline)
    res = finish(rs, deadline.left())
    loaded = first_line(rs.log(0), r"FAULTDRILL LOADED.*")
    return equal_params(res, ref), loaded


def scenario_kill_rank(workdir, deadline, opts):
    ref = reference_run(workdir, deadline)
    out = _kill_mid_round(workdir, deadline, "kill", "SIGKILL", signal.SIGKILL, opts)
    exact, loaded = _resume(workdir, deadline, "kill", ref)
    return [row("SIGKILL of rank 1 mid-round (step 5, checkpoint at step 4)", short(out["msg"]),
                f"{out['seconds']:.1f}" if out["all_error"] else "n/a (a rank did not exit with an error)",
                "yes" if exact else "no", judge(out["msg"], ["closed", "peer", "reset", "rank"], ["relaunch",
                                                                                                  "checkpoint"]),
                codes=out["codes"], exit_seconds=out["times"], message=out["msg"], loaded=loaded,
                bit_exact=exact, logs=out["tails"] if not out["all_error"] else None)]


def scenario_stop_rank(workdir, deadline, opts):
    timeout_s = opts.get("stop_timeout_s", 20)
    out = _kill_mid_round(workdir, deadline, "stop", "SIGSTOP", signal.SIGSTOP, opts,
                          extra_spec={"timeout_s": timeout_s, "pg_timeout": timeout_s},
                          after_kill=lambda rs: (rs.signal(1, signal.SIGKILL), rs.signal(1, signal.SIGCONT)))
    ok = out["all_error"]
    return [row(f'SIGSTOP of rank 1 (hang), "timeout_s": {timeout_s}, init_distributed timeout {timeout_s} s',
                short(out["msg"]), f"{out['seconds']:.1f} (rank 0; rank 1 then SIGKILLed)" if ok else
                "n/a (rank 0 did not exit with an error)", "n.a.",
                judge(out["msg"], ["timeout", "timed out", "timedout"], ["timeout_s", "relaunch"]),
                codes=out["codes"], exit_seconds=out["times"], message=out["msg"], timeout_s=timeout_s,
                bit_exact=None, logs=out["tails"] if not ok else None)]


def scenario_link_down(workdir, deadline, opts):
    why = harness.namespaces_unavailable()
    if why:
        return [row("link cut mid-round (veth down)", f"skipped: {why}", "n/a", "n.a.", "-")]
    timeout_s = opts.get("link_timeout_s", 20)
    with harness.Network("fault") as net:
        out = _kill_mid_round(
            workdir, deadline, "link", "link down", None, opts, net=net,
            extra_spec={"timeout_s": timeout_s, "pg_timeout": timeout_s},
            inject=lambda rs: net.set_link(0, up=False))
    msgs = out["messages"]
    ok = out["all_error"]
    return [row(f'link cut mid-round (rank 0\'s end of the veth pair set down), "timeout_s": {timeout_s}',
                short(out["msg"]), f"{out['seconds']:.1f}" if ok else
                f"n/a (exit codes {out['codes']})", "n.a.",
                judge(out["msg"], ["timeout", "timed out", "connection", "closed", "reset"], ["timeout_s",
                                                                                               "relaunch"]),
                codes=out["codes"], exit_seconds=out["times"], messages=msgs, timeout_s=timeout_s,
                logs=out["tails"] if not ok else None)]


def scenario_bad_grads(workdir, deadline, opts):
    """A NaN (micro 4) and an Inf (micro 9) loss on rank 0, in fp32, bf16 and fp16."""
    rows = []
    for dtype in opts.get("dtypes", ["fp32", "bf16", "fp16"]):
        spec = {"dtype": dtype, "steps": 8, "bad_grads": [[4, "nan"], [9, "inf"]]}
        rs = start(spec, workdir, f"bad_{dtype}", deadline=deadline)
        try:
            res = finish(rs, deadline.left())
        except RuntimeError as err:
            rows.append(row(f"NaN and Inf gradients ({dtype})", short(error_line(str(err)) or "failed"), "n/a",
                            "n.a.", "-", error=str(err)[-3000:]))
            continue
        warns = [re.findall(r"ACCO: non-finite gradients.*", rs.log(r)) for r in range(2)]
        warn = warns[0][0] if warns[0] else None
        skipped = [r["skipped_steps"] for r in res]
        finite = all(r["finite"] for r in res)
        steps = [r["global_steps"] for r in res]
        good = all(warns) and all(s >= 2 for s in skipped) and finite and steps == [8, 8]
        rows.append(row(f"NaN (micro 4) and Inf (micro 9) loss on rank 0, {dtype}",
                        f"warning on both ranks: {short(warn, 150)}; skipped_steps={skipped[0]}; weights finite: "
                        f"{'yes' if finite else 'NO'}", "n/a (training continues)", "n.a.",
                        judge(warn, ["non-finite"], ["learning rate", "loss scale", "gradient_clipping"]),
                        skipped_steps=skipped, warnings_per_rank=[len(w) for w in warns], finite=finite,
                        global_steps=steps, ok=good, warning=warn))
    return rows


def _checkpoint(workdir, deadline, name, **kw):
    """A 2-rank run that saves at step 4 and 8 (acco mode unless kw says otherwise)."""
    spec = _train_spec(Path(workdir) / f"{name}_ckpt", **{"steps": 8, **kw})
    rs = start(spec, workdir, name, deadline=deadline)
    return finish(rs, deadline.left()), Path(spec["save_dir"])


def scenario_disk_full(workdir, deadline, opts):
    if os.geteuid() != 0:
        return [row("disk full during save_checkpoint", "skipped: needs root (mount tmpfs)", "n/a", "n.a.", "-")]
    # Size one checkpoint, then give a tmpfs room for 1.5 of them.
    _, probe = _checkpoint(workdir, deadline, "probe", steps=4)
    one = sum(f.stat().st_size for f in (probe / "global_step4").rglob("*") if f.is_file())
    mnt = Path(tempfile.mkdtemp(prefix=MOUNT_PREFIX))
    size_kb = max(64, int(one * 1.5 / 1024) + 4)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode:
            return [row("disk full during save_checkpoint", f"skipped: mount tmpfs failed ({short(r.stderr, 80)})",
                        "n/a", "n.a.", "-")]
        ckpt = mnt / "ckpt"
        spec = {"steps": 12, "save_dir": str(ckpt), "save_every": 4}
        rs = start(spec, workdir, "diskfull", deadline=deadline)
        # The second save starts right after step 8: time from there (both ranks write their own files).
        rs.wait_for(r"FAULTDRILL STEP rank=0 step=8\b", rank=0, timeout=min(deadline.left() - 20, 120))
        t0 = time.monotonic()
        codes = rs.wait(timeout=min(deadline.left() - 20, 120))
        took = max((t - t0 for t in rs.exit_time if t is not None), default=None)
        logs = [rs.log(0), rs.log(1)]
        tails = rs.tails()
        rs.kill_all()
        _, msg = user_error(logs)
        latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").exists() else None
        tags = sorted(p.name for p in ckpt.iterdir() if p.is_dir()) if ckpt.exists() else []
        # The previous checkpoint must still load: resume from it and train 2 more steps.
        loads, load_err = False, None
        if latest:
            spec2 = {"steps": 6, "save_dir": str(ckpt), "load": True}
            rs2 = start(spec2, workdir, "diskfull_load", deadline=deadline)
            try:
                res2 = finish(rs2, deadline.left())
                loads = all(r["global_steps"] == 6 for r in res2) and \
                    "step=4" in (first_line(rs2.log(0), r"FAULTDRILL LOADED.*") or "")
            except RuntimeError as err:
                load_err = str(err)[-2000:]
        all_error = all(c is not None and c != 0 for c in codes)
        return [row(f"disk full during the 2nd save_checkpoint (tmpfs of {size_kb} KiB, one checkpoint "
                    f"{one // 1024} KiB)", short(msg), (f"{took:.1f}" if all_error and took is not None else
                                                        f"n/a (exit codes {codes})"),
                    f"{'yes' if loads else 'no'} (latest -> {latest}; tags {tags})",
                    judge(msg, ["No space", "ENOSPC", "disk"], ["free", "space"]), codes=codes, message=msg,
                    messages=[_all_errors(t) for t in logs],
                    latest=latest, tags=tags, previous_loads=loads, load_error=load_err, checkpoint_bytes=one,
                    tmpfs_kb=size_kb, logs=tails if not all_error else None)]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
        shutil.rmtree(mnt, ignore_errors=True)


def _load_attempt(workdir, deadline, name, src, world=2, **kw):
    """Load checkpoint dir ``src`` with a run configured by ``kw``; returns (codes, message line, rankset logs)."""
    spec = {"steps": 10, "save_dir": str(src), "load": True}
    spec.update(kw)
    rs = start(spec, workdir, name, world=world, deadline=deadline)
    codes = rs.wait(timeout=min(deadline.left() - 5, 120))
    texts = rs.texts()
    rs.kill_all()
    results = None
    if all(c == 0 for c in codes):
        import torch
        results = [torch.load(rs.outdir / f"result{r}.pt", weights_only=False) for r in range(world)]
    return codes, texts, results


def scenario_corrupt(workdir, deadline, opts):
    """Damage one file of the latest checkpoint (step 8), then relaunch with load_checkpoint. A load that
    succeeds is compared with a resume from the intact checkpoint (to step 10): silently wrong or not."""
    rows = []
    _, ckpt = _checkpoint(workdir, deadline, "corrupt_src")
    codes, _, clean = _load_attempt(workdir, deadline, "load_clean", ckpt)
    if clean is None:
        raise RuntimeError(f"resuming from the intact checkpoint failed: exit codes {codes}")
    cases = [("truncated zero_pp_rank_0_mp_rank_00_optim_states.pt (half of it)", "optim", "truncate"),
             ("truncated mp_rank_00_model_states.pt (half of it)", "model", "truncate"),
             ("256 zero bytes in the middle of mp_rank_00_model_states.pt", "model", "garble"),
             ("256 zero bytes in the middle of zero_pp_rank_0_mp_rank_00_optim_states.pt", "optim", "garble")]
    for label, which, how in opts.get("corrupt_cases") or cases:
        dst = Path(workdir) / f"corrupt_{which}_{how}"
        shutil.copytree(ckpt, dst)
        tag = (dst / "latest").read_text().strip()
        f = dst / tag / ("zero_pp_rank_0_mp_rank_00_optim_states.pt" if which == "optim" else
                         "mp_rank_00_model_states.pt")
        data = f.read_bytes()
        if how == "truncate":
            f.write_bytes(data[:len(data) // 2])
        else:
            mid = len(data) // 2
            f.write_bytes(data[:mid] + bytes(256) + data[mid + 256:])
        codes, texts, res = _load_attempt(workdir, deadline, f"load_{which}_{how}", dst)
        rank, msg = user_error(texts)
        failed = all(c is not None and c != 0 for c in codes)
        same = None if res is None else equal_params(res, clean)
        if failed:
            seen = f"rank {rank}: {short(msg)}"
        elif res is not None:
            seen = (f"loads without any message; resumed weights {'equal' if same else 'DIFFER from'} a resume "
                    f"from the intact checkpoint")
        else:
            seen = f"exit codes {codes}: {short(msg)}"
        rows.append(row(label, seen, "n/a", "n.a.",
                        judge(msg, [f.name, "corrupt", "truncat", "zip", "archive", "central directory", "EOF"],
                              ["re-save", "another checkpoint", "earlier", "previous"]) if failed else
                        "no message", codes=codes, message=msg, message_rank=rank, file=f.name, errored=failed,
                        loaded_equal_to_clean=same, messages=[error_line(t) for t in texts]))
    return rows


def scenario_mismatch(workdir, deadline, opts):
    rows = []
    _, acco_ckpt = _checkpoint(workdir, deadline, "mm_acco")
    attempts = [
        ("ACCO checkpoint, 2 ranks -> 1 rank", acco_ckpt, {"world": 1}),
        ("ACCO checkpoint, mode acco -> dpu", acco_ckpt, {"mode": "dpu"}),
        ("ACCO checkpoint, gradient_accumulation_steps 2 -> 4", acco_ckpt, {"gas": 4}),
        ("ACCO checkpoint -> stock DeepSpeed (no acco block)", acco_ckpt, {"acco": False}),
    ]
    _, stock_ckpt = _checkpoint(workdir, deadline, "mm_stock", acco=False)
    attempts.append(("stock DeepSpeed ZeRO-1 checkpoint -> ACCO", stock_ckpt, {}))
    wanted = opts.get("mismatch_cases")
    for i, (label, src, kw) in enumerate(attempts):
        if wanted and i not in wanted:
            continue
        kw = dict(kw)
        world = kw.pop("world", 2)
        codes, texts, res = _load_attempt(workdir, deadline, f"mm_load{i}", src, world=world, **kw)
        ok = all(c == 0 for c in codes)
        logs = "\n".join(texts)
        loaded = first_line(logs, r"FAULTDRILL LOADED.*")
        warn = first_line(logs, r"(ACCO|acco)[^\n]*(checkpoint|rounds restart)[^\n]*")
        rank, msg = user_error(texts)
        if ok:
            step = re.search(r"step=(\d+)", loaded or "")
            seen = (f"loads (global_steps {step.group(1) if step else '?'}) and trains on"
                    f"{'; warning: ' + short(warn, 140) if warn else '; no message'}")
        else:
            seen = short(msg)
        rows.append(row(label, seen, "n/a", "n.a.",
                        judge(msg if not ok else warn, ["rank", "world size", "mode", "min_micro", "accumulation",
                                                        "ACCO state"], ["resume with", "load only", "restart"])
                        if (msg if not ok else warn) else "no message",
                        codes=codes, message=msg, warning=warn, loaded=loaded, loads=ok))
    return rows


SCENARIOS = {
    "jit_kill": (scenario_jit_kill, 420),
    "kill_rank": (scenario_kill_rank, 240),
    "stop_rank": (scenario_stop_rank, 180),
    "link_down": (scenario_link_down, 180),
    "bad_grads": (scenario_bad_grads, 240),
    "disk_full": (scenario_disk_full, 240),
    "corrupt": (scenario_corrupt, 240),
    "mismatch": (scenario_mismatch, 300),
}
