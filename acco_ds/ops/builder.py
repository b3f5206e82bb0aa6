"""Builders of the native ops, in the manner of DeepSpeed's ``op_builder``.

JIT: ``AccoCPUOpBuilder().load()`` compiles ``csrc/`` with ninja through
DeepSpeed's ``OpBuilder.jit_load`` (cached under torch's extension directory,
``~/.cache/torch_extensions`` unless ``TORCH_EXTENSIONS_DIR`` is set, so a
later process only loads the .so). AOT: ``ACCO_BUILD_OPS=1 pip install
--no-build-isolation .`` builds the same sources through ``builder()`` in
setup.py; ``load()`` imports that module first and JIT-builds only without it.

JIT builds cannot hang on torch's build lock: see ``JitBuildLock``.

This module imports nothing from acco_ds, so that setup.py can load it alone.
"""

import contextlib
import importlib
import logging
import os
import socket
import threading
import time
from pathlib import Path

from deepspeed.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from deepspeed.ops.op_builder.cpu.builder import CPUOpBuilder

_MARKER = "acco_common.h"

logger = logging.getLogger("acco_ds")

JIT_WAIT_ENV = "ACCO_JIT_WAIT_S"  # longest wait for another process's JIT build (default 300 s)
JIT_STALE_ENV = "ACCO_JIT_STALE_S"  # age after which an ownerless lock is stale (default 600 s)
DEFAULT_JIT_WAIT_S = 300.0
DEFAULT_JIT_STALE_S = 600.0


def csrc_dir() -> Path:
    """The kernel sources: copied into the package by setup.py, or ``csrc/`` of a checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc", here.parents[1] / "csrc"):
        if (candidate / _MARKER).is_file():
            return candidate
    raise FileNotFoundError(f"acco_ds kernel sources (csrc/{_MARKER}) not found in {here / 'csrc'} "
                            f"or {here.parents[1] / 'csrc'}")


def _env_seconds(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        logger.warning(f"acco_ds: {name}={os.environ[name]!r} is not a number of seconds; using {default}")
        return default


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    except (OverflowError, ValueError):
        return False
    return True


def _process_start(pid: int):
    """Start time of ``pid`` in clock ticks (Linux ``/proc``), or None: tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


class JitLockTimeout(RuntimeError):
    """A JIT build lock stayed held (by a live build) for longer than the bounded wait."""

    def __init__(self, lock_path: str, waited_s: float, holder: str):
        self.lock_path = lock_path
        super().__init__(
            f"the JIT build lock {lock_path} is still held after waiting {waited_s:.0f} s ({holder}). If no build of "
            f"this op is running (for example a build was killed), delete {lock_path}; or set "
            f'"acco": {{"kernels": "torch"}}, or {JIT_WAIT_ENV} to wait longer')


class JitBuildLock:
    """torch's JIT build lock of one op, with a staleness check and a bounded wait.

    Why: ``torch.utils.cpp_extension.load`` guards a build directory with a
    ``FileBaton``: it creates ``<build dir>/lock`` (``O_EXCL``), builds, removes
    it, and every other process spins in ``FileBaton.wait()`` until the file is
    gone. That wait has no timeout and no staleness check, so a process killed
    during a build (OOM killer, Ctrl-C, a job's time limit) leaves the file behind
    and every later load of the op, on every rank, waits forever. This adds:

    * an owner record: whoever takes the lock through ``try_acquire`` writes
      ``lock.owner`` (``pid host process-start``) next to it;
    * staleness: a lock is stale when its owner process is gone from this host,
      or, without a usable owner record (torch's own baton writes none; the owner
      may be on another host sharing the directory), when the lock and every
      entry of the build directory are older than ``stale_s``
      (``ACCO_JIT_STALE_S``, default 600 s). ``clear_if_stale`` removes a stale
      lock with a warning that names it;
    * a bounded wait: ``wait`` polls until the lock is free (clearing it if it
      goes stale meanwhile) and raises ``JitLockTimeout``, naming the lock and
      the fix, after ``wait_s`` (``ACCO_JIT_WAIT_S``, default 300 s).
    """

    def __init__(self, build_dir, wait_s=None, stale_s=None, poll_s: float = 0.1):
        self.build_dir = str(build_dir)
        self.lock_path = os.path.join(self.build_dir, "lock")  # the name torch's _jit_compile uses
        self.owner_path = self.lock_path + ".owner"
        self.wait_s = _env_seconds(JIT_WAIT_ENV, DEFAULT_JIT_WAIT_S) if wait_s is None else float(wait_s)
        self.stale_s = _env_seconds(JIT_STALE_ENV, DEFAULT_JIT_STALE_S) if stale_s is None else float(stale_s)
        self.poll_s = poll_s

    @classmethod
    def for_op(cls, name: str, **kwargs) -> "JitBuildLock":
        """The lock of op ``name`` in torch's extension directory (``TORCH_EXTENSIONS_DIR`` or the default)."""
        from torch.utils.cpp_extension import _get_build_directory
        return cls(_get_build_directory(name, False), **kwargs)

    def held(self) -> bool:
        return os.path.exists(self.lock_path)

    def owner(self):
        """``(pid, host, start)`` of the current lock's owner, or None if unknown."""
        try:
            lock_mtime = os.stat(self.lock_path).st_mtime
            owner_mtime = os.stat(self.owner_path).st_mtime
            with open(self.owner_path) as f:
                fields = f.read().split()
            pid, host = int(fields[0]), fields[1]
        except (OSError, ValueError, IndexError):
            return None
        if owner_mtime < lock_mtime - 1.0:  # left behind by an earlier lock, not this one's
            return None
        return pid, host, fields[2] if len(fields) > 2 else None

    def _newest_mtime(self) -> float:
        newest = os.stat(self.lock_path).st_mtime
        with contextlib.suppress(OSError):
            with os.scandir(self.build_dir) as entries:
                for entry in entries:
                    with contextlib.suppress(OSError):
                        newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        return newest

    def stale_reason(self):
        """Why the current lock is stale, or None when it is free or may belong to a running build."""
        try:
            owner = self.owner()
            if owner is not None and owner[1] == socket.gethostname():
                pid, host, start = owner
                if not _pid_alive(pid):
                    return f"its owner, process {pid} on {host}, is gone"
                if start is not None and _process_start(pid) not in (None, start):
                    return f"its owner, process {pid} on {host}, is gone (the pid was reused)"
                return None
            age = time.time() - self._newest_mtime()
        except FileNotFoundError:  # released meanwhile
            return None
        if age <= self.stale_s:
            return None
        who = f"its owner is on another host ({owner[1]})" if owner is not None else "it has no owner record"
        return f"{who} and neither it nor its build directory changed for {age:.0f} s (> {self.stale_s:.0f} s)"

    def clear_if_stale(self) -> bool:
        """Remove the lock (with a warning naming it) if it is stale; True if removed."""
        reason = self.stale_reason()
        if reason is None:
            return False
        logger.warning(f"acco_ds: removing the stale JIT build lock {self.lock_path}: {reason} "
                       f"(an interrupted build); the op is built again")
        for path in (self.owner_path, self.lock_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        return True

    def wait(self, wait_s=None) -> None:
        """Return once the lock is free (stale locks are cleared); ``JitLockTimeout`` after ``wait_s``."""
        bound = self.wait_s if wait_s is None else float(wait_s)
        start = time.monotonic()
        while self.held():
            if self.clear_if_stale():
                continue
            if time.monotonic() - start >= bound:
                owner = self.owner()
                holder = (f"held by process {owner[0]} on {owner[1]}" if owner is not None else "owner unknown")
                raise JitLockTimeout(self.lock_path, time.monotonic() - start, holder)
            time.sleep(self.poll_s)

    def record_owner(self) -> None:
        """Write ``lock.owner``: call right after taking the lock."""
        pid = os.getpid()
        tmp = f"{self.owner_path}.{pid}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{pid} {socket.gethostname()} {_process_start(pid) or ''}\n")
        os.replace(tmp, self.owner_path)

    def try_acquire(self) -> bool:
        """Take the lock as torch does (create it exclusively) and record the owner; False if held."""
        try:
            os.close(os.open(self.lock_path, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        self.record_owner()
        return True

    def release(self) -> None:
        for path in (self.owner_path, self.lock_path):
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)


_baton_patch = threading.RLock()


@contextlib.contextmanager
def bounded_torch_baton():
    """Within: torch's JIT builds take their lock through ``JitBuildLock`` (owner record, bounded wait).

    ``torch.utils.cpp_extension`` looks ``FileBaton`` up at build time, so swapping that name covers the
    race where another process takes the lock between our own ``JitBuildLock.wait`` and torch's
    ``try_acquire``; torch then waits through ``JitBuildLock.wait`` instead of forever.
    """
    import torch.utils.cpp_extension as cpp_extension
    original = getattr(cpp_extension, "FileBaton", None)
    if original is None:  # a torch that builds differently: our own wait before the build still applies
        yield
        return

    class BoundedFileBaton(original):

        def __init__(self, lock_file_path, *args, **kwargs):
            super().__init__(lock_file_path, *args, **kwargs)
            self._acco_lock = JitBuildLock(os.path.dirname(lock_file_path))

        def try_acquire(self):
            acquired = super().try_acquire()
            if acquired:
                self._acco_lock.record_owner()
            return acquired

        def release(self):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self._acco_lock.owner_path)
            super().release()

        def wait(self):
            self._acco_lock.wait()

    with _baton_patch:
        cpp_extension.FileBaton = BoundedFileBaton
        try:
            yield
        finally:
            cpp_extension.FileBaton = original


def guard_deepspeed_shm_op() -> None:
    """Make DeepSpeed's own CPU op build unable to hang, like ours.

    DeepSpeed's CPU backend JIT-builds its shared-memory collective op in every
    process that initializes ``deepspeed.comm`` (``deepspeed.comm.torch.build_shm_op``);
    a process killed during that build hangs every later start on the same
    ``FileBaton`` lock. Wrapped here: stale locks are cleared, the wait is
    bounded, and on a timeout DeepSpeed goes on without the op (it accepts None,
    as it does where the op is not compatible) after one warning. Idempotent."""
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # not deepspeed.comm.torch: that name is torch
    original = ds_torch.build_shm_op
    if getattr(original, "_acco_guarded", False):
        return

    def build_shm_op():
        from deepspeed.accelerator import get_accelerator
        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if builder is None:
            return original()
        try:
            JitBuildLock.for_op(builder.name).wait()
            with bounded_torch_baton():
                return original()
        except JitLockTimeout as err:
            logger.warning(f"acco_ds: DeepSpeed's shared-memory op is not loaded ({err}); DeepSpeed runs without it")
            return None

    build_shm_op._acco_guarded = True
    build_shm_op.__wrapped__ = original
    ds_torch.build_shm_op = build_shm_op


class _AccoOpBuilder:
    """What both builders share: module names, include path, AOT-first ``load()``."""

    NAME = None

    def absolute_name(self):
        return f"acco_ds.ops.{self.NAME}_op"

    def include_paths(self):
        return [str(csrc_dir())]

    def aot_module(self):
        """The module setup.py built ahead of time, or None."""
        try:
            return importlib.import_module(self.absolute_name())
        except ImportError:  # not built, or built against another torch (undefined symbols)
            return None

    def load(self, verbose=False):
        # DeepSpeed's load() consults its own installed_ops table, which knows nothing of
        # acco_ds; import our AOT module directly and JIT-build only if it is absent.
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = self.aot_module()
        if module is None:
            return self.guarded_jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    def guarded_jit_load(self, verbose=False):
        """``jit_load`` that cannot hang on torch's build lock (see ``JitBuildLock``): a stale lock is
        cleared, a live build by another process (another rank) is waited for at most
        ``ACCO_JIT_WAIT_S`` seconds, then ``JitLockTimeout``."""
        JitBuildLock.for_op(self.name).wait()
        with bounded_torch_baton():
            return self.jit_load(verbose)


class AccoCPUOpBuilder(_AccoOpBuilder, CPUOpBuilder):
    BUILD_VAR = "ACCO_BUILD_OPS"
    NAME = "acco_cpu_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return [str(csrc_dir() / "bindings" / "acco_cpu_ops.cpp"), str(csrc_dir() / "cpu" / "acco_cpu.cpp")]

    def cxx_args(self):
        # -ffp-contract=off: fuse no multiply-add that torch does not fuse (bit-exact m, v).
        # -fno-math-errno: sqrtf need not set errno, so the AdamW loop vectorizes.
        return super().cxx_args() + ["-ffp-contract=off", "-fno-math-errno"]


class AccoCUDAOpBuilder(_AccoOpBuilder, CUDAOpBuilder):
    BUILD_VAR = "ACCO_BUILD_OPS"
    NAME = "acco_cuda_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def sources(self):
        return [str(csrc_dir() / "bindings" / "acco_cuda_ops.cpp"), str(csrc_dir() / "cuda" / "acco_cuda_kernels.cu")]

    def nvcc_args(self):
        # DeepSpeed builds with --use_fast_math (approximate sqrt and division, flushed
        # denormals); the update must round like torch, so drop it and fuse only the
        # explicit fmaf calls (-fmad=false).
        args = [a for a in super().nvcc_args() if a != "--use_fast_math"]
        return args + ["-fmad=false"] if args else args

    def is_compatible(self, verbose=False):
        import torch
        if not torch.cuda.is_available() and os.environ.get("ACCO_BUILD_CUDA", "0") != "1":
            self.error_log = "torch.cuda.is_available() is False (set ACCO_BUILD_CUDA=1 to build anyway)"
            return False
        return super().is_compatible(verbose)


BUILDERS = {"cpu": AccoCPUOpBuilder, "cuda": AccoCUDAOpBuilder}

