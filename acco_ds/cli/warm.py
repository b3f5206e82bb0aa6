"""Restart crashed ranks warm: a launcher that imports torch, DeepSpeed and acco_ds once, then forks the ranks.

    acco-ds-warm [--nproc_per_node K] [--restarts N] [--restart_delay_s S] [--master_port P] \\
                 [--preload MOD,...] script.py [args...]
    python -m acco_ds.cli.warm ...  (the same)

A fault-tolerant replica (``acco.fault_tolerance``) that crashes is relaunched and heals from a live one.
Started fresh, most of that relaunch is Python importing: ``import torch, deepspeed, acco_ds, torchft``
alone takes 8.3 s in a process held to 0.45 of a core (the chaos benchmark's replicas), more than building
the model and the engine and joining together. This launcher imports them once, in a parent process that
then stays idle, and forks the ranks from it. A rank it starts, first or after a crash, is a new process
that finds everything imported and begins with the script itself.

* The parent imports ``--preload`` (default: torch, deepspeed, acco_ds and torchft, those installed), applies
  ``acco_ds.patch()`` as ``acco_ds.cli.run`` does, and forks ``K`` ranks with torchrun's environment
  (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, and
  ``TORCHELASTIC_RESTART_COUNT``: 0, then the number of the restart). Each
  rank runs the script as ``__main__`` (as ``acco_ds.cli.run`` does) in a session of its own, and dies with
  the parent.
* When every rank exits 0, so does the launcher. When one fails (a non-zero exit or a signal), the others are
  stopped (SIGTERM, then SIGKILL after ``--stop_grace_s``): a rank left alone would wait on its dead peer
  until its timeout. While restarts are left, all ``K`` are forked again after ``--restart_delay_s``; out of
  restarts, the launcher exits with the failed rank's code (128 + the signal for a signal).
* SIGINT or SIGTERM to the launcher stops the ranks and restarts nothing.

Forking after ``import torch`` is what DataLoader workers do on Linux. The parent freezes its objects before
each fork (``gc.freeze``) so that the ranks share its pages instead of copying them when collected.

What it cannot do: a machine that is lost takes the parent with it; a new machine starts cold. The parent
must not initialize CUDA (a forked child could not use it): it asks NVML, not the driver, whether there is a
GPU (``PYTORCH_NVML_BASED_CUDA_CHECK=1``) and refuses to fork if the preload initialized CUDA. Not yet run on a
GPU machine. It starts the ranks of one machine, like ``torchrun --nnodes 1``: a replica is one launch of it.
"""

import argparse
import atexit
import ctypes
import gc
import importlib
import importlib.util
import os
import signal
import sys
import time
import traceback

DEFAULT_PRELOAD = ("torch", "deepspeed", "acco_ds", "torchft")
PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def say(text: str) -> None:
    print(f"[acco-ds-warm] {text}", file=sys.stderr, flush=True)


def parse(argv):
    ap = argparse.ArgumentParser(prog="acco-ds-warm", description="Start the ranks of one machine forked from a "
                                 "parent that imported torch, DeepSpeed and acco_ds once; restart them warm when one "
                                 "fails.")
    ap.add_argument("--nproc_per_node", type=int, default=1, help="ranks to start (default 1)")
    ap.add_argument("--restarts", type=int, default=0, help="times to restart the ranks after a failure (default 0)")
    ap.add_argument("--restart_delay_s", type=float, default=0.0, help="wait before a restart (default 0)")
    ap.add_argument("--stop_grace_s", type=float, default=5.0,
                    help="after SIGTERM, how long the other ranks get before SIGKILL (default 5)")
    ap.add_argument("--master_addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"))
    ap.add_argument("--master_port", type=int, default=int(os.environ.get("MASTER_PORT", "29500")))
    ap.add_argument("--preload", default=None,
                    help="comma-separated modules to import once in the parent (default: torch, deepspeed, acco_ds, "
                         "torchft, those installed); each one named here must import")
    ap.usage = "acco-ds-warm [options] (script.py | -m module) [args...]"
    i, options = 0, []  # the launcher's options come first, each with its value
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        takes_value = "=" not in argv[i] and argv[i] not in ("-h", "--help")
        options += argv[i:i + 1 + takes_value]
        i += 1 + takes_value
    a = ap.parse_args(options)
    for name, value, low in (("--nproc_per_node", a.nproc_per_node, 1), ("--restarts", a.restarts, 0),
                             ("--restart_delay_s", a.restart_delay_s, 0), ("--stop_grace_s", a.stop_grace_s, 0)):
        if value < low:
            ap.error(f"{name} must be at least {low}, not {value}")
    a.script = list(argv[i:])
    if not a.script:
        ap.error("no script given")
    if a.script[0] == "-m" and len(a.script) < 2:
        ap.error("-m needs a module name")
    if a.script[0] != "-m" and not os.path.exists(a.script[0]):
        ap.error(f"script {a.script[0]!r} not found")
    return a


def preload(modules) -> list:
    """Import ``modules`` here (None: the defaults that are installed); returns the names imported."""
    # torch.cuda.is_available() (DeepSpeed's accelerator detection calls it) then asks NVML instead of starting
    # the CUDA driver, which a forked child could not use.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    names = [m for m in DEFAULT_PRELOAD if importlib.util.find_spec(m) is not None] if modules is None else \
        [m.strip() for m in modules.split(",") if m.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - named in the error, with the fix
            raise SystemExit(f"acco-ds-warm: --preload module {name!r} failed to import ({type(err).__name__}: {err}); "
                             f"install it or leave it out of --preload") from err
    if "acco_ds" in names:
        sys.modules["acco_ds"].patch()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise SystemExit("acco-ds-warm: importing the --preload modules initialized CUDA, which a forked rank could not "
                         "use: leave the module that does it out of --preload (it is then imported by each rank)")
    return names


class Ranks:
    """The ranks of one machine, forked from this process; restarted together when one fails."""

    def __init__(self, args):
        self.args = args
        self.pids = {}  # pid -> rank, of the live ranks
        self.stopping = None  # the signal that asked this launcher to stop
        self.failed = None  # (rank, exit code) of the first failure of the current start
        self.restarts = 0  # restarts so far (torchrun tells its ranks as TORCHELASTIC_RESTART_COUNT)

    # ------------------------------------------------------------------ the ranks
    def start(self) -> None:
        self.failed = None
        gc.freeze()  # the ranks share the parent's objects instead of copying them when they collect
        for rank in range(self.args.nproc_per_node):
            pid = os.fork()
            if pid == 0:
                self._rank(rank)  # never returns
            self.pids[pid] = rank

    def _rank(self, rank: int) -> None:
        """The forked child: become rank ``rank`` and run the script; exits the process."""
        code = 1
        try:
            os.setsid()  # a session of its own: stopping it stops what it started
            parent = os.getppid()
            prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)  # Linux: die with the parent
            if prctl is not None:
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the parent died before prctl took effect
                os._exit(1)
            for sig in (signal.SIGTERM, signal.SIGCHLD):
                signal.signal(sig, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            gc.enable()
            k = self.args.nproc_per_node
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(k), LOCAL_WORLD_SIZE=str(k),
                              GROUP_RANK="0", TORCHELASTIC_RESTART_COUNT=str(self.restarts),
                              MASTER_ADDR=self.args.master_addr, MASTER_PORT=str(self.args.master_port))
            from . import run
            code = run.main(self.args.script) or 0
        except SystemExit as stop:
            code = _exit_code(stop.code)
        except KeyboardInterrupt:
            traceback.print_exc()
            code = 128 + signal.SIGINT
        except BaseException:  # noqa: BLE001 - the script's error, shown as Python shows it
            traceback.print_exc()
            code = 1
        finally:
            try:
                atexit._run_exitfuncs()  # what the interpreter runs at exit (the script's handlers too)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def wait(self) -> int:
        """Until every rank has exited; 0 when all exited 0, else the first failure's code (the others are
        stopped then)."""
        while self.pids:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            if pid not in self.pids:
                continue
            rank = self._reaped(pid)
            code = os.waitstatus_to_exitcode(status)
            if code != 0 and self.failed is None:
                self.failed = (rank, code)
                if self.stopping is None:
                    say(f"rank {rank} {_describe(code)}: stopping the other rank(s)" if self.pids else
                        f"rank {rank} {_describe(code)}")
                self.stop(signal.SIGTERM)
        if self.failed is None:
            return 0
        code = self.failed[1]
        return 128 - code if code < 0 else code

    def stop(self, sig) -> None:
        """``sig`` to every live rank's session, then SIGKILL to those still there after the grace period."""
        for pid in list(self.pids):
            _signal_group(pid, sig)
        deadline = time.monotonic() + self.args.stop_grace_s
        while self.pids and time.monotonic() < deadline:
            for pid in list(self.pids):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if done:
                    self._reaped(pid)
            time.sleep(0.05)
        for pid in list(self.pids):
            _signal_group(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            self._reaped(pid)

    def _reaped(self, pid: int) -> int:
        """``pid`` has exited: forget it, and kill what it started and left behind; returns its rank."""
        _signal_group(pid, signal.SIGKILL)
        return self.pids.pop(pid)

    # ---------------------------------------------------------------- signals
    def on_signal(self, sig, frame) -> None:
        self.stopping = sig
        for pid in list(self.pids):
            _signal_group(pid, sig)

    def pause(self, seconds: float) -> None:
        """Sleep, but return at once when this launcher is asked to stop."""
        deadline = time.monotonic() + seconds
        while self.stopping is None and time.monotonic() < deadline:
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


def _signal_group(pid: int, sig) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    names = preload(args.preload)
    gc.disable()  # nothing left to collect here; each rank enables its own
    ranks = Ranks(args)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, ranks.on_signal)
    say(f"imported {', '.join(names) or 'nothing'} in {time.perf_counter() - t0:.1f} s; starting "
        f"{args.nproc_per_node} rank(s) of {' '.join(args.script)}")
    while ranks.stopping is None:
        ranks.start()
        code = ranks.wait()
        if ranks.stopping is not None:
            break
        if code == 0:
            return 0
        if ranks.restarts == args.restarts:
            say(f"no restart left ({args.restarts} allowed): exiting with the failed rank's code {code}")
            return code
        ranks.restarts += 1
        say(f"restart {ranks.restarts} of {args.restarts} in {args.restart_delay_s:g} s: forking the "
            f"{args.nproc_per_node} rank(s) again")
        ranks.pause(args.restart_delay_s)
    say(f"stopped by {signal.Signals(ranks.stopping).name}; no restart")
    return 128 + ranks.stopping


if __name__ == "__main__":
    sys.exit(main())
