"""Launch test scenarios on several CPU ranks (gloo), with a hard timeout."""

import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from multiprocessing import context as mp_context, forkserver as mp_forkserver, popen_forkserver, spawn
from multiprocessing import util as mp_util
from pathlib import Path

import torch

from acco_ds.testing.ports import free_port  # noqa: F401 - one picker for tests and the benchmarks they start

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKER = HERE / "workers.py"
TORCH_WORKER = HERE / "torch_workers.py"
# Ranks are forked from a server that has imported their modules once (multiprocessing's forkserver, as
# DeepSpeed's own unit tests reuse a process pool): a rank then starts in milliseconds instead of ~2.5 s of
# imports per process. One server per worker script: workers.py (the DeepSpeed host) from one that imported
# DeepSpeed, torch_workers.py (the torch host) from one that never did, and each of its ranks checks that
# DeepSpeed is not imported. Other workers start fresh, as every rank does with ACCO_TEST_FORKSERVER=0.
FORKSERVER = os.environ.get("ACCO_TEST_FORKSERVER", "1") != "0"
# Each server also imports what its ranks would import anyway, down to the engine's modules and the native op:
# a one-rank, two-step launch of workers.py then takes 0.08 s of CPU after the fork instead of 0.21 s.
PRELOAD = {WORKER: ["torch", "torch.distributed", "deepspeed", "acco_ds", "acco_ds.deepspeed",
                    "acco_ds.deepspeed.engine", "acco_ds.ops.acco_cpu_ops_op", "torch.utils.cpp_extension",
                    "deepspeed.runtime.zero.muon", "deepspeed.module_inject.auto_ep_layer", "common"],
           TORCH_WORKER: ["torch", "torch.distributed", "torch.distributed.fsdp", "acco_ds", "acco_ds.torch",
                          "acco_ds.ops.acco_cpu_ops_op", "common"]}
WITHOUT_DEEPSPEED = {TORCH_WORKER}
_servers = {}  # worker script -> its multiprocessing.forkserver.ForkServer


def _server(worker: Path):
    if worker not in _servers:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when the server imports DeepSpeed
        _servers[worker] = mp_forkserver.ForkServer()
        _servers[worker].set_forkserver_preload(PRELOAD[worker])
    return _servers[worker]


def stop_forkserver():
    """Stop the fork servers and reap them (pytest's session end, ``tests/conftest.py``). Each reaps the ranks it
    forked; left to exit with this process, it would be reparented to init, and its ranks' CPU time would be
    missing from what the run's parent (``make``, GNU ``time``) counts."""
    for server in _servers.values():
        server._stop()  # CPython's own way to stop it (its test suite's): close the alive pipe, waitpid


class _ServerPopen(popen_forkserver.Popen):
    """multiprocessing's forkserver Popen, on the server of the rank's worker script instead of the one
    server of the process (the stdlib's ``_launch``, with ``_servers[...]`` for ``forkserver``)."""

    def _launch(self, process_obj):
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            mp_context.reduction.dump(prep_data, buf)
            mp_context.reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = _servers[Path(process_obj.worker)].connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of its parent, as in the stdlib
        self.finalizer = mp_util.Finalize(self, mp_util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = mp_forkserver.read_signed(self.sentinel)


class _RankProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _ServerPopen(process_obj)


def _rank_main(worker: str, argv: list, env: dict, log_path: str):
    """A forked rank: its own environment and log, then the worker script as ``__main__``."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    if Path(worker) in WITHOUT_DEEPSPEED:
        imported = sorted(m for m in sys.modules if m == "deepspeed" or m.startswith("deepspeed."))
        if imported:
            raise RuntimeError(f"{worker} runs without DeepSpeed, but its fork server imported {imported[:5]}: "
                               f"take DeepSpeed out of PRELOAD[{Path(worker).name!r}] in tests/dist.py")
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [worker] + argv
    sys.path[:0] = [str(Path(worker).parent), str(ROOT), str(HERE)]
    runpy.run_path(worker, run_name="__main__")


class _ForkedRank:
    """The subprocess.Popen calls ``launch`` makes, on a forked rank."""

    def __init__(self, worker, argv, env, log_path):
        _server(Path(worker))
        self.proc = _RankProcess(target=_rank_main, args=(str(worker), argv, env, str(log_path)))
        self.proc.worker = str(worker)
        self.proc.start()

    def wait(self, timeout=None):
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired("rank", timeout)
        return self.proc.exitcode

    def kill(self):
        self.proc.kill()

    @property
    def returncode(self):
        return self.proc.exitcode


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
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        if FORKSERVER and Path(worker) in PRELOAD:
            procs.append(_ForkedRank(worker, [str(spec_path), str(workdir)], rank_env, workdir / f"rank{rank}.log"))
            continue
        log = open(workdir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(worker), str(spec_path), str(workdir)], env=rank_env,
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
