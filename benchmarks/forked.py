"""Ranks forked from a process that has imported torch, DeepSpeed and acco_ds once.

A fresh rank spends about 3 s of CPU importing torch, DeepSpeed and acco_ds before its first step, while the
fault drill's tiny model trains in a fraction of that, and a scenario starts 2 to 8 ranks. After ``preload()``
has imported those modules into the driver's own process, ``Forked`` starts a rank as an ``os.fork()`` of it
that runs the rank's script as ``python script.py args`` would: its own session (a kill of its group takes
what it starts), its environment, working folder and log; the script as ``__main__``; on the way out, the
script's atexit functions and its exit code (a signal's death as ``-signal``, as ``subprocess`` reports it).
What the fork inherits is the imports only: the driver starts no thread pool (one intra-op thread) and no
process group before forking, and the child puts the driver's signal handlers and atexit functions aside.

``Forked`` has the part of ``subprocess.Popen`` that ``harness.RankSet`` uses: ``pid``, ``returncode``,
``poll``, ``wait``, ``send_signal``, ``kill``.
"""

import atexit
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback

MODULES = ("torch", "torch.distributed", "deepspeed", "acco_ds", "acco_ds.deepspeed", "acco_ds.deepspeed.engine")
_preloaded = False


def preload(modules=MODULES) -> None:
    """Import ``modules`` here, once, so that every forked rank finds them imported."""
    global _preloaded
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when DeepSpeed is imported
    for name in modules:
        __import__(name)
    import torch
    torch.set_num_threads(1)  # no OpenMP team in the driver: a fork would inherit it broken
    _preloaded = True


def can_fork(argv) -> bool:
    """``argv`` is ``[this interpreter, script.py, ...]`` and the driver preloaded."""
    return _preloaded and len(argv) >= 2 and argv[0] == sys.executable and argv[1].endswith(".py")


class Forked:
    """``argv`` (``[sys.executable, script.py, args...]``) as a fork of this process."""

    def __init__(self, argv, env, log, cwd):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _run(argv, env, log.fileno(), cwd)  # never returns
        self.pid, self.args, self.returncode = pid, list(argv), None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        until = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if until is not None and time.monotonic() > until:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)


def _run(argv, env, log_fd, cwd):
    """In the child: become ``python argv[1] argv[2:]`` in a session of its own, then exit."""
    code = 1
    try:
        os.setsid()
        for sig in range(1, signal.NSIG):
            if sig not in (signal.SIGKILL, signal.SIGSTOP):
                try:
                    signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
                except (OSError, ValueError):
                    pass
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as a fresh interpreter has it
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=unbuffered, write_through=unbuffered or stream is sys.stderr)
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        atexit._clear()  # the driver's
        import torch
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        sys.argv = list(argv[1:])
        sys.path[0] = os.path.dirname(os.path.abspath(argv[1]))  # as `python script.py` sets it
        runpy.run_path(argv[1], run_name="__main__")
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else 0 if end.code is None else 1
        if not isinstance(end.code, (int, type(None))):
            print(end.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code & 0xFF)
