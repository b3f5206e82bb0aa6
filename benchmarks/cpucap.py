"""CPU cgroups that hold a command and its children to a number of cores (split from harness.py, which
re-exports these names): one emulated node per replica on a machine with fewer cores than replicas.
"""

import os
import threading
import re
import time
from pathlib import Path

# acco-<tag>-<pid of the creating process>-...: these cgroups and harness's network namespaces
OWNED_NAME = re.compile(r"^acco-[a-z]+-(\d+)-")
CGROUP_V1_CPU, CGROUP_V2 = Path("/sys/fs/cgroup/cpu"), Path("/sys/fs/cgroup")


class CpuCap:
    """A CPU cgroup that holds what ``wrap(argv)`` starts (and its children) to ``cores`` cores: the cgroup v1
    ``cpu`` controller's CFS quota, or cgroup v2's ``cpu.max``; ``shares``: its weight against other work
    (v1 ``cpu.shares``, a process's being 1024), so that a loaded machine still gives it its cores.
    ``close()`` removes it (its processes must be gone: kill them first). ``CpuCap.unavailable()`` says why
    none can be made here (None when one can). Named ``acco-<tag>-<pid of the creating process>-<n>``, like
    harness's ``Network`` namespaces."""

    _created = 0
    _lock = threading.Lock()  # chaos.py --together builds caps from several threads
    PERIOD_US = 100_000

    def __init__(self, cores, tag="cap", shares=1024):
        root = self._root()
        with CpuCap._lock:
            name = f"acco-{tag}-{os.getpid()}-{CpuCap._created}"
            CpuCap._created += 1
        self.cores, self.path = cores, root / name
        self.path.mkdir()
        quota = int(cores * self.PERIOD_US)
        try:
            if root == CGROUP_V1_CPU:
                (self.path / "cpu.cfs_period_us").write_text(str(self.PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
                (self.path / "cpu.shares").write_text(str(shares))
            else:
                (self.path / "cpu.max").write_text(f"{quota} {self.PERIOD_US}")
                (self.path / "cpu.weight").write_text(str(max(1, min(10000, shares * 100 // 1024))))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _root():
        if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
            return CGROUP_V1_CPU
        if "cpu" in (CGROUP_V2 / "cgroup.subtree_control").read_text().split():
            return CGROUP_V2
        raise OSError("no cgroup CPU controller: neither /sys/fs/cgroup/cpu (v1) nor cpu in "
                      "/sys/fs/cgroup/cgroup.subtree_control (v2)")

    @classmethod
    def unavailable(cls):
        if os.geteuid() != 0:
            return "CPU cgroups need root (this process is not root)"
        try:
            cls._root()
        except OSError as err:
            return str(err)
        return None

    def wrap(self, argv):
        """``argv`` started inside the cgroup (a shell moves itself in, then execs it: the pid stays the
        command's)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs")] + list(argv)

    def throttled(self):
        """The share of scheduler periods in which the cap held its processes back (None: not known)."""
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip())
        periods = int(stat.get("nr_periods", 0))
        return round(int(stat.get("nr_throttled", 0)) / periods, 3) if periods else None

    def close(self):
        for _ in range(50):  # rmdir fails while a killed process is still being reaped
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


def remove_leftover_caps():
    """Remove the CPU cgroups of processes now gone (a SIGKILLed benchmark); returns their paths."""
    removed = []
    for root in (CGROUP_V1_CPU, CGROUP_V2):
        for path in root.glob("acco-*") if root.exists() else ():
            m = OWNED_NAME.match(path.name + "-")
            if m and not os.path.exists(f"/proc/{m.group(1)}"):
                try:
                    path.rmdir()
                    removed.append(str(path))
                except OSError:
                    pass
    return removed
