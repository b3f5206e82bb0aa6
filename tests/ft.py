"""Replicas that come and go, for the fault-tolerance tests: a torchft lighthouse and replica launches.

Each replica is its own launch (its own ``MASTER_PORT``, its ``k`` ranks started here as processes, as
the ``deepspeed`` launcher or ``torchrun`` would), joined to the others only through the lighthouse.
Everything started here is killed on exit (``Fleet`` is a context manager), so a failed test leaves no
process behind.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from dist import HERE, ROOT, free_port

LIGHTHOUSE = shutil.which("torchft_lighthouse") or str(Path(sys.executable).with_name("torchft_lighthouse"))
TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))


class Fleet:
    """A lighthouse and the replica launches of one test, all under ``workdir``."""

    def __init__(self, workdir, min_replicas: int = 1, join_timeout_ms: int = 1000, heartbeat_timeout_ms: int = 1500,
                 worker: Path = HERE / "ft_worker.py"):
        self.workdir, self.worker = Path(workdir), worker
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.log = open(self.workdir / "lighthouse.log", "w")
        self.lighthouse = subprocess.Popen(
            [LIGHTHOUSE, "--min_replicas", str(min_replicas), "--bind", f"[::]:{self.port}",
             "--join_timeout_ms", str(join_timeout_ms), "--heartbeat_timeout_ms", str(heartbeat_timeout_ms)],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.replicas = {}  # name -> list of rank processes

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start(self, name: str, spec: dict, ranks: int = 1, replica_id=None, env=None, torchrun: bool = False,
              warm: list = None):
        """Launch replica ``name``: ``ranks`` processes running the worker on ``spec``, started here, or by
        ``torchrun``, or by ``acco_ds.cli.warm`` with the options ``warm`` (one process group, killed as a whole)."""
        spec_path = self.workdir / f"{name}.json"
        spec_path.write_text(json.dumps(spec))
        port = free_port()
        base = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), WORLD_SIZE=str(ranks), LOCAL_SIZE=str(ranks),
                    REPLICA_GROUP_ID=str(replica_id if replica_id is not None else name.split("_")[0][-1]),
                    TORCHFT_LIGHTHOUSE=self.address,
                    PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]),
                    **(env or {}))
        procs = []
        if torchrun or warm is not None:
            log = open(self.workdir / f"{name}.rank0.log", "w")
            launcher = [TORCHRUN] if torchrun else [sys.executable, "-m", "acco_ds.cli.warm"] + list(warm)
            procs.append(subprocess.Popen(launcher + ["--nproc_per_node", str(ranks), "--master_port", str(port),
                                                      str(self.worker), str(spec_path), str(self.workdir), name],
                                          env=base, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
            self.replicas[name] = procs
            return procs
        for rank in range(ranks):
            log = open(self.workdir / f"{name}.rank{rank}.log", "w")
            procs.append(subprocess.Popen([sys.executable, str(self.worker), str(spec_path), str(self.workdir), name],
                                          env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=log, stderr=subprocess.STDOUT))
            log.close()
        self.replicas[name] = procs
        return procs

    def kill(self, name: str) -> None:
        for p in self.replicas[name]:
            if p.poll() is None:
                try:  # a torchrun launch: its agent and every worker
                    os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.send_signal(signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.replicas[name]:
            p.wait()

    def wait(self, name: str, timeout: float) -> list:
        """Exit codes of replica ``name``'s ranks (an AssertionError with the logs if it runs too long)."""
        deadline = time.monotonic() + timeout
        for p in self.replicas[name]:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.kill(name)
                raise AssertionError(f"replica {name} did not finish within {timeout} s:\n{self.logs(name)}")
        return [p.returncode for p in self.replicas[name]]

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(
                    self.logs(n) for n in self.replicas))
            time.sleep(0.2)

    def progress(self, name: str, rank: int = 0) -> dict:
        """What replica ``name``'s rank wrote after its last sync (``{}`` before the first)."""
        path = self.workdir / f"{name}.rank{rank}.progress.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def syncs(self, name: str) -> int:
        """The outer syncs replica ``name`` had done at its last report (-1 before the first)."""
        return self.progress(name).get("syncs", -1)

    def control(self, **values) -> None:
        """Steer the running replicas (``ft_worker.py`` reads ``control.json`` every step): ``die``,
        ``stop_at_syncs``."""
        tmp = self.workdir / "control.json.tmp"
        tmp.write_text(json.dumps(values))
        tmp.replace(self.workdir / "control.json")

    def result(self, name: str, rank: int = 0):
        import torch
        return torch.load(self.workdir / f"{name}.rank{rank}.pt", weights_only=False)

    def logs(self, name: str, tail: int = 3000) -> str:
        return "\n".join(f"--- {name} rank {r} ---\n" + (self.workdir / f"{name}.rank{r}.log").read_text()[-tail:]
                         for r in range(len(self.replicas[name])))

    def close(self) -> None:
        for name in list(self.replicas):
            self.kill(name)
        if self.lighthouse.poll() is None:
            self.lighthouse.kill()
        self.lighthouse.wait()
        self.log.close()


__all__ = ["Fleet", "LIGHTHOUSE"]
