"""examples/fault_tolerance.sh leaves nothing running: run to completion (QUICK=1: one sync, a tiny model),
interrupted by Ctrl-C (SIGINT to the script's process group, as a terminal sends it) once its replicas run,
and failing (no `deepspeed` launcher) after its lighthouse started. Every process the example started (the lighthouse, each replica's `deepspeed` runner, launcher and
rank, each in a session of its own) carries the test's tag in its environment; none may be left after the
script exits."""

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from dist import ROOT, free_port

pytestmark = pytest.mark.slow
SCRIPT = ROOT / "examples" / "fault_tolerance.sh"
TAG = "ACCO_EXAMPLE_TEST_TAG"


def tagged(tag):
    """The processes whose environment carries ``tag`` (the example's and their children)."""
    found = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(TAG) == tag:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def command(p) -> str:
    try:
        return " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return ""


def is_rank(p):
    """A replica's rank (started by DeepSpeed's launch.py), not its runner or launcher."""
    line = command(p)
    return "train_gpt.py" in line and "--local_rank" in line


def _sigint_as_a_terminal_leaves_it():
    """In the script's process: SIGINT at its default and not blocked (bash keeps an inherited mask)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def start(tmp_path, name, bin_dir=Path(sys.executable).parent):
    tag = f"{name}-{uuid.uuid4().hex}"
    env = dict(os.environ, QUICK="1", OUT=str(tmp_path / name), PORT=str(free_port()), MASTER_PORT=str(free_port()),
               BIN=str(bin_dir), DS_ACCELERATOR="cpu", **{TAG: tag},
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    # A session of its own, as a terminal's foreground job: Ctrl-C signals the script's whole group. SIGINT as a
    # terminal leaves it: a test run started in the background (`make test &`) ignores SIGINT, a child inherits
    # that, and bash cannot trap a signal ignored on entry, so the script would never see the Ctrl-C.
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=_sigint_as_a_terminal_leaves_it)
    return proc, tag


def finish(proc, tag, timeout):
    """The script's exit code and output; then nothing tagged may be alive (killed here if it is)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n(the script did not exit within {timeout} s)"
    deadline = time.monotonic() + 3  # a SIGKILLed process may take a moment to be reaped
    while tagged(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = tagged(tag)
    names = [command(p)[:200] for p in left]
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return proc.returncode, out, names


@pytest.mark.timeout(400)
def test_the_fault_tolerance_example_leaves_nothing_running(tmp_path):
    proc, tag = start(tmp_path, "completed")  # first: it also builds DeepSpeed's CPU op if none is built yet
    code, out, left = finish(proc, tag, timeout=240)
    assert code == 0, out
    assert out.count("==== summary ====") == 3 and "---- replica2_relaunched ----" in out, out  # all 3 finished
    assert left == [], f"left running after a successful run: {left}\n{out}"

    proc, tag = start(tmp_path, "interrupted")
    until = time.monotonic() + 60
    # Ctrl-C once every replica's rank is up (its own session: only the script's trap can stop it).
    while time.monotonic() < until and sum(is_rank(p) for p in tagged(tag)) < 3:
        time.sleep(0.2)
    started = [command(p) for p in tagged(tag)]
    sigs = Path(f"/proc/{proc.pid}/status").read_text()
    sigs = [l for l in sigs.splitlines() if l.startswith("Sig")]
    os.killpg(proc.pid, signal.SIGINT)
    code, out, left = finish(proc, tag, timeout=30)
    assert any("torchft_lighthouse" in c for c in started) and sum("--local_rank" in c for c in started) == 3, \
        (started, out)
    assert code == 130 and "interrupted: stopping the lighthouse and the replicas" in out, (out, sigs)
    assert left == [], f"left running after Ctrl-C: {left}\n{out}"

    fake = tmp_path / "bin"  # a lighthouse but no launcher: the first replica fails to start
    fake.mkdir()
    (fake / "torchft_lighthouse").symlink_to(Path(sys.executable).parent / "torchft_lighthouse")
    proc, tag = start(tmp_path, "failed", bin_dir=fake)
    code, out, left = finish(proc, tag, timeout=30)
    assert code == 1 and "ended before" in out and "Lighthouse listening" in \
        (tmp_path / "failed" / "lighthouse.log").read_text(), out
    assert left == [], f"left running after a failure: {left}\n{out}"
