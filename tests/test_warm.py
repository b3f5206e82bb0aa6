"""``acco_ds.cli.warm``: ranks forked from a parent that imported torch (and the rest) once, restarted together
when one fails; stopped, never orphaned, when the launcher is stopped or killed; bad arguments refused by name.
(The fault-tolerant replica under it: tests/test_fault_tolerance.py.)"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from acco_ds.cli import warm
from dist import free_port

# Each rank appends what it saw to ``<out>/starts.jsonl``; rank 1 SIGKILLs itself in the first start
# (``die`` given), or every rank exits with ``exit_code``, or sleeps until stopped (``sleep``).
SCRIPT = textwrap.dedent("""
    import json, os, signal, sys, time
    preloaded = "torch" in sys.modules
    out, what = sys.argv[1], sys.argv[2]
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    x = torch.ones(1)
    dist.all_reduce(x)
    with open(os.path.join(out, "starts.jsonl"), "a") as f:
        f.write(json.dumps({"rank": dist.get_rank(), "world": dist.get_world_size(), "pid": os.getpid(),
                            "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), "preloaded": preloaded,
                            "sum": x.item()}) + "\\n")
    if what == "die" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "sleep":
        time.sleep(600)
    dist.barrier()  # rank 0 waits here for its dead peer until the launcher stops it
    dist.destroy_process_group()
    sys.exit(int(what) if what.isdigit() else 0)
""")


def launch(tmp_path, what, *options, preload="torch"):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "acco_ds.cli.warm", "--preload", preload, "--master_port", str(free_port()),
            *options, str(script), str(tmp_path), what]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def starts(tmp_path):
    path = tmp_path / "starts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def finish(proc, timeout=120):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode, out


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_killed_rank_is_restarted_with_its_peer_both_forked_with_torch_imported(tmp_path):
    code, out = finish(launch(tmp_path, "die", "--nproc_per_node", "2", "--restarts", "2", "--stop_grace_s", "2"))
    assert code == 0, out
    seen = starts(tmp_path)
    assert sorted((s["restart"], s["rank"]) for s in seen) == [(0, 0), (0, 1), (1, 0), (1, 1)], seen
    assert len({s["pid"] for s in seen}) == 4, "every start is a new process"
    assert all(s["preloaded"] and s["world"] == 2 and s["sum"] == 2.0 for s in seen), seen
    assert "rank 1 was killed by SIGKILL: stopping the other rank(s)" in out
    assert "restart 1 of 2" in out and "restart 2 of 2" not in out
    assert not any(alive(s["pid"]) for s in seen)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_out_of_restarts_the_launcher_exits_with_the_rank_code(tmp_path):
    code, out = finish(launch(tmp_path, "3", "--restarts", "1"))
    assert code == 3, out
    assert [s["restart"] for s in starts(tmp_path)] == [0, 1]
    assert "rank 0 exited with code 3" in out and "no restart left (1 allowed): exiting with the failed rank's code 3" in out


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_stopping_the_launcher_stops_its_ranks_and_restarts_nothing(tmp_path, sig):
    proc = launch(tmp_path, "sleep", "--nproc_per_node", "2", "--restarts", "3", "--stop_grace_s", "2")
    deadline = time.monotonic() + 120
    while len(starts(tmp_path)) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    proc.send_signal(sig)
    code, out = finish(proc, 60)
    pids = [s["pid"] for s in starts(tmp_path)]
    deadline = time.monotonic() + 10  # SIGKILL: the ranks die with their parent (PR_SET_PDEATHSIG)
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids), "a rank outlived its launcher"
    assert len(pids) == 2, "nothing was restarted"
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig)
    if sig != signal.SIGKILL:
        assert f"stopped by {sig.name}; no restart" in out, out


def test_bad_arguments_are_refused_by_name(tmp_path, capsys):
    script = tmp_path / "s.py"
    script.write_text("")
    for argv, needle in ((["--nproc_per_node", "0", str(script)], "--nproc_per_node must be at least 1, not 0"),
                         (["--restarts", "-1", str(script)], "--restarts must be at least 0, not -1"),
                         ([str(tmp_path / "missing.py")], "not found"),
                         (["-m"], "-m needs a module name")):
        with pytest.raises(SystemExit):
            warm.parse(argv)
        assert needle in capsys.readouterr().err, argv
    with pytest.raises(SystemExit, match="--preload module 'no_such_module_here' failed to import"):
        warm.preload("no_such_module_here")


def test_a_script_error_is_the_rank_failure_with_its_traceback(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text("raise ValueError('the script is broken')\n")
    proc = subprocess.run([sys.executable, "-m", "acco_ds.cli.warm", "--preload", "", str(script)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert "ValueError: the script is broken" in proc.stderr and "rank 0 exited with code 1" in proc.stderr
