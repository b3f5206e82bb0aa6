"""Launch test scenarios on several CPU ranks (gloo), with a hard timeout."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "workers.py"



def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(spec: dict, world_size: int = 2, timeout: float = 300.0, expect_failure: bool = False, workdir=None,
           worker: Path = WORKER):
    """Run ``workers.py`` with ``spec`` on ``world_size`` ranks; return each
    rank's saved results (or, with ``expect_failure``, each rank's
    ``(returncode, log)``). Never waits longer than ``timeout`` seconds. ``worker``: the script each rank
    runs (``torch_workers.py`` for the torch host)."""
    own_dir = workdir is None
    workdir = Path(workdir or tempfile.mkdtemp(prefix="acco_test_"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    env.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")]))
    procs, logs = [], []
    for rank in range(world_size):
        log = open(workdir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(worker), str(spec_path), str(workdir)],
                                      env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                      stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    timed_out = False
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    if timed_out:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    for log in logs:
        log.close()
    texts = [(workdir / f"rank{r}.log").read_text() for r in range(world_size)]
    if timed_out:
        raise AssertionError(f"ranks did not finish within {timeout}s; logs:\n" + _tails(texts))
    codes = [p.returncode for p in procs]
    if expect_failure:
        return list(zip(codes, texts))
    if any(codes):
        raise AssertionError(f"ranks failed with exit codes {codes}; logs:\n" + _tails(texts))
    results = [torch.load(workdir / f"result{r}.pt", weights_only=False) for r in range(world_size)]
    if own_dir:
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _tails(texts, n=4000):
    return "\n".join(f"--- rank {r} ---\n{t[-n:]}" for r, t in enumerate(texts))


def run_in_session(cmd, timeout, env, cwd=ROOT, check=True):
    """Run ``cmd`` (a launcher and its ranks) in its own session; on timeout, and after it ends, kill the
    whole process group, so no rank outlives the test."""
    import pytest
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout}s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # stragglers (a launcher that exited before its ranks)
        except ProcessLookupError:
            pass
    if check:
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{stdout[-4000:]}\n{stderr[-4000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
