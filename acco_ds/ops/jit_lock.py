"""A JIT build lock that cannot hang a start: torch's build baton with an owner record and a bounded wait.

A process killed while ``torch.utils.cpp_extension`` JIT-builds leaves a ``lock`` file in the op's build
directory, and every later load would wait on it forever (``FileBaton.wait``), silently. ``JitBuildLock``
records its owner next to the lock, says at once what it waits for (the lock, the fix, the bound), judges
an ownerless lock by build activity (a compiler working in the directory, files changing there) and age,
and gives up after ``ACCO_JIT_WAIT_S`` seconds.

This module imports nothing from acco_ds, so that setup.py can load it (through ``builder.py``) alone.
"""

import contextlib
import logging
import os
import socket
import time

logger = logging.getLogger("acco_ds")

JIT_WAIT_ENV = "ACCO_JIT_WAIT_S"  # longest wait for another process's JIT build (default 300 s)
JIT_STALE_ENV = "ACCO_JIT_STALE_S"  # age after which an ownerless lock is stale (default 600 s)
JIT_IDLE_ENV = "ACCO_JIT_IDLE_S"  # no build activity for this long: an ownerless local lock is stale (default 60 s)
DEFAULT_JIT_WAIT_S = 300.0
DEFAULT_JIT_STALE_S = 600.0
DEFAULT_JIT_IDLE_S = 60.0

# File systems a lock may be shared on between hosts: there, build processes on another host are invisible
# to this one, so only the age rule (ACCO_JIT_STALE_S) judges an ownerless lock.
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "afs",
               "panfs", "wekafs", "9p", "virtiofs", "fuse", "pvfs2", "orangefs", "ocfs2", "gfs2", "quobyte")


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
    return _stat_field(pid, 0) != "Z"  # a zombie (ended, not yet reaped by its parent or a subreaper) holds nothing


def _stat_field(pid: int, index: int):
    """Field ``index`` of ``/proc/<pid>/stat`` after the command name (0: state, 19: start time), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def _process_start(pid: int):
    """Start time of ``pid`` in clock ticks (Linux ``/proc``), or None: tells a reused pid apart."""
    return _stat_field(pid, 19)


def _filesystem_type(path: str):
    """The type of the file system holding ``path`` (longest mount point of ``/proc/mounts``), or None."""
    try:
        real = os.path.realpath(path)
        best, fstype = "", None
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best):
                    best, fstype = mount, fields[2]
        return fstype
    except OSError:
        return None


def _is_network_fs(fstype) -> bool:
    return fstype is None or any(fstype == t or fstype.startswith(t + ".") for t in _NETWORK_FS)


def _processes_in(directory: str):
    """``[(pid, name)]`` of the processes of this host (other than this one) whose working directory is
    ``directory`` or below it: torch runs ninja, and ninja the compilers, in the build directory. None
    when ``/proc`` cannot be read."""
    real = os.path.realpath(directory)
    found = []
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return None
    me = os.getpid()
    for pid in pids:
        if pid == me:
            continue
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:  # gone, or another user's process
            continue
        if cwd == real or cwd.startswith(real + "/"):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    name = f.read().strip()
            except OSError:
                name = "?"
            found.append((pid, name))
    return found


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
    * staleness: a lock is stale when its owner process is gone from this host.
      Without a usable owner record (torch's own baton writes none; the owner
      may be on another host sharing the directory) staleness is judged by build
      activity: a build in progress has ninja or a compiler running with the
      build directory as working directory, or changes files there. A lock on a
      local file system (so its builder would be a process of this host) is
      stale once no process works in the build directory and neither the lock
      nor any entry of the directory changed for ``idle_s`` (``ACCO_JIT_IDLE_S``,
      default 60 s). On a network file system, where another host's build is
      invisible, only the age rule applies: stale when the lock and every entry
      of the build directory are older than ``stale_s`` (``ACCO_JIT_STALE_S``,
      default 600 s). A lock with a process of this host working in its build
      directory is never stale. ``clear_if_stale`` removes a stale lock with a
      warning that names it;
    * a bounded wait that says what it waits for: ``wait`` polls until the lock
      is free (clearing it if it goes stale meanwhile). Once the lock has been
      held ``notice_s`` (1 s: a warm load of the op takes less), it warns, at
      the level DeepSpeed's rank processes show, naming the lock, its holder,
      the bound and the fix, and again every ``progress_s`` (60 s); after
      ``wait_s`` (``ACCO_JIT_WAIT_S``, default 300 s) it raises
      ``JitLockTimeout``, naming the lock and the fix.
    """

    notice_s = 1.0  # held this long: say what is being waited for
    progress_s = 60.0  # then repeat it this often
    proc_scan_s = 1.0  # look for build processes at most this often

    def __init__(self, build_dir, wait_s=None, stale_s=None, poll_s: float = 0.1, idle_s=None):
        self.build_dir = str(build_dir)
        self.lock_path = os.path.join(self.build_dir, "lock")  # the name torch's _jit_compile uses
        self.owner_path = self.lock_path + ".owner"
        self.wait_s = _env_seconds(JIT_WAIT_ENV, DEFAULT_JIT_WAIT_S) if wait_s is None else float(wait_s)
        self.stale_s = _env_seconds(JIT_STALE_ENV, DEFAULT_JIT_STALE_S) if stale_s is None else float(stale_s)
        self.idle_s = _env_seconds(JIT_IDLE_ENV, DEFAULT_JIT_IDLE_S) if idle_s is None else float(idle_s)
        self.poll_s = poll_s
        self._fstype = None
        self._scan = (-1e9, None)  # (monotonic time, result) of the last _processes_in

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

    def local_fs(self) -> bool:
        """True when the build directory is on a local file system (its builder is a process of this host)."""
        if self._fstype is None:
            self._fstype = _filesystem_type(self.build_dir) or "unknown"
        return not _is_network_fs(None if self._fstype == "unknown" else self._fstype)

    def build_processes(self):
        """Processes of this host working in the build directory (ninja, compilers), or None if unknown;
        cached for ``proc_scan_s``."""
        now = time.monotonic()
        if now - self._scan[0] >= self.proc_scan_s:
            self._scan = (now, _processes_in(self.build_dir))
        return self._scan[1]

    def idle_for(self) -> float:
        """Seconds since the lock or any entry of the build directory last changed."""
        return time.time() - self._newest_mtime()

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
            age = self.idle_for()
        except FileNotFoundError:  # released meanwhile
            return None
        local = owner is None and self.local_fs()
        if age <= (self.idle_s if local else self.stale_s) and age <= self.stale_s:
            return None
        procs = self.build_processes()
        if procs:  # ninja or a compiler works in the build directory: a build is running
            return None
        if owner is not None:
            return (f"its owner is on another host ({owner[1]}) and neither it nor its build directory changed "
                    f"for {age:.0f} s (> {self.stale_s:.0f} s, {JIT_STALE_ENV})")
        if age > self.stale_s:
            return (f"it has no owner record and neither it nor its build directory changed for {age:.0f} s "
                    f"(> {self.stale_s:.0f} s, {JIT_STALE_ENV})")
        if procs is None:  # /proc unreadable: build processes unknown, only the age rule
            return None
        return (f"it has no owner record, no process is building in {self.build_dir} and nothing there changed "
                f"for {age:.1f} s (> {self.idle_s:g} s, {JIT_IDLE_ENV})")

    def describe(self) -> str:
        """Who holds the lock and when it will count as stale: for the waiting notice."""
        owner = self.owner()
        if owner is not None and owner[1] == socket.gethostname():
            return (f"held by process {owner[0]} on this host, which is building the op; the lock is cleared "
                    f"as soon as that process is gone")
        if owner is not None:
            return (f"held by process {owner[0]} on {owner[1]}; cleared as stale when nothing in {self.build_dir} "
                    f"changed for {self.stale_s:.0f} s ({JIT_STALE_ENV})")
        who = ("no owner record: taken by torch's own build lock (a process building this op without acco_ds, "
               "or a build that was killed)")
        if self.local_fs():
            procs = self.build_processes()
            running = (f"; building in it now: {', '.join(f'{name} ({pid})' for pid, name in procs)}"
                       if procs else "")
            return (f"{who}; cleared as stale once no process works in {self.build_dir} and nothing there changed "
                    f"for {self.idle_s:.0f} s ({JIT_IDLE_ENV}){running}")
        return (f"{who}; on a network file system ({self._fstype}), so cleared as stale only when nothing in "
                f"{self.build_dir} changed for {self.stale_s:.0f} s ({JIT_STALE_ENV})")

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
        """Return once the lock is free (stale locks are cleared); ``JitLockTimeout`` after ``wait_s``.
        Says what it waits for (``notice_s`` after the start, then every ``progress_s``)."""
        bound = self.wait_s if wait_s is None else float(wait_s)
        start = time.monotonic()
        next_notice = start + self.notice_s
        while self.held():
            if self.clear_if_stale():
                continue
            now = time.monotonic()
            if now - start >= bound:
                owner = self.owner()
                holder = (f"held by process {owner[0]} on {owner[1]}" if owner is not None else "owner unknown")
                raise JitLockTimeout(self.lock_path, now - start, holder)
            if now >= next_notice:
                self._notice(now - start, bound, first=next_notice == start + self.notice_s)
                next_notice = now + self.progress_s
            time.sleep(self.poll_s)

    def _notice(self, waited: float, bound: float, first: bool) -> None:
        with contextlib.suppress(FileNotFoundError):
            idle = self.idle_for()
            head = "waiting for" if first else f"still waiting ({waited:.0f} s) for"
            logger.warning(f"acco_ds: {head} the JIT build lock {self.lock_path} ({self.describe()}; last change in "
                           f"its build directory {idle:.0f} s ago). Waiting at most {bound:.0f} s ({JIT_WAIT_ENV}), "
                           f"then the op is not used. If no build of this op is running, delete {self.lock_path}")

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
