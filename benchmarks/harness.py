"""What every benchmark driver here shares: free ports, a slow link between two network namespaces, a
set of rank processes with logs and deadlines, and the cleanup of all of it.

* ``free_port()``: a TCP port that is free now (MASTER_PORT), per test worker (``acco_ds.testing.ports``).
* ``Network``: two network namespaces joined by a veth pair, optionally limited with the ``tbf`` qdisc
  (``limit("200mbit")``, ``unlimit()``), with each end's tx counter (``tx_bytes()``, and the loopback's:
  ``lo_tx_bytes()``), a link cut (``set_link``) and a
  TCP goodput check (``goodput()``); ``close()`` removes them, ``cleanup_leftovers()`` those of a run
  that was killed with SIGKILL. Addresses are only ever used inside these namespaces.
* ``link_tx_bytes()``: inside a rank, the bytes sent so far on gloo's interface (GLOO_SOCKET_IFNAME).
* ``CpuCap`` (from cpucap.py): a CPU cgroup that holds a command and its children to a number of cores (one
  emulated node per replica on a machine with fewer cores than replicas); ``wrap(argv)`` starts a command
  inside it.
* ``cpu_name()``, ``skip_deepspeed_shm_op()`` (inside a rank: no JIT build of DeepSpeed's inference-only
  op), ``processes_naming()`` (what a benchmark left running).
* ``rank_env()``, ``RankSet``: one process per rank, started at once, each in its own session with its
  own log file; wait with a deadline, wait for a line in a log, signal one rank, kill them all.
  ``kill_everything()`` reaps every RankSet still alive (errors, Ctrl-C, SIGTERM).

Used by cluster.py, faults.py, collectives_bytes.py and train_worker.py (tests/dist.py shares its
``free_port``). Run as root for the namespaces (``ip``, ``tc``); everything else works unprivileged.
"""

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from acco_ds.testing.ports import free_port  # noqa: E402,F401 - one port picker for benchmarks and tests
import forked  # noqa: E402 - ranks forked from a driver that preloaded their imports


def cpu_name() -> str:
    """The CPU's model name (for a results header)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor()


def sh(*cmd, check=True, timeout=30):
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=timeout)


# ---------------------------------------------------------------------- network
ADDRS = ["10.231.0.1", "10.231.0.2"]  # rank r's address, inside the namespaces of a Network only
from cpucap import (  # noqa: E402,F401 - CpuCap and its cleanup are re-exported; the naming is shared
    CGROUP_V1_CPU, CGROUP_V2, OWNED_NAME as _NAME, CpuCap, remove_leftover_caps)
LEGACY_NAMESPACES = ("accobench", "acco_fd", "acco_cb")  # fixed names used by earlier versions of the scripts


def namespaces_unavailable():
    """Why the namespaces cannot be created here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not root)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


def rate_bits(rate):
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, factor in units.items():
        if rate.endswith(unit):
            return float(rate[:-len(unit)]) * factor
    raise ValueError(f"bandwidth {rate!r}: use e.g. 50mbit, 200mbit, 1gbit")


class Network:
    """Two namespaces (rank 0 and rank 1) joined by a veth pair; ``close()`` removes them.

    Names carry the creating process's id (``acco-<tag>-<pid>-<n>-r<rank>``), so that runs side by side
    never share a namespace and ``cleanup_leftovers()`` removes only those of processes that are gone."""

    _created = 0

    def __init__(self, tag="bench"):
        pid, n = os.getpid(), Network._created
        Network._created += 1
        self.ns = [f"acco-{tag}-{pid}-{n}-r{r}" for r in range(2)]
        self.dev = [f"av{pid}n{n}r{r}"[:15] for r in range(2)]  # IFNAMSIZ
        self.addrs = ADDRS
        self.rate = None
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.dev[0], "netns", self.ns[0], "type", "veth", "peer", "name", self.dev[1],
               "netns", self.ns[1])
            for r in range(2):
                sh("ip", "-n", self.ns[r], "addr", "add", f"{self.addrs[r]}/24", "dev", self.dev[r])
                sh("ip", "-n", self.ns[r], "link", "set", self.dev[r], "up")
                sh("ip", "-n", self.ns[r], "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def describe(self):
        return " and ".join(f"{self.ns[r]} ({self.addrs[r]} on {self.dev[r]})" for r in range(2))

    def limit(self, rate):
        """Limit both ends to ``rate`` (a tbf rate: 50mbit, 200mbit, 1gbit)."""
        rate_bits(rate)
        for r in range(2):
            sh("tc", "-n", self.ns[r], "qdisc", "replace", "dev", self.dev[r], "root", "tbf", "rate", rate, "burst",
               "256kb", "latency", "50ms")
        self.rate = rate

    def unlimit(self):
        """Remove the tbf limit from both ends (the veth pair at full speed)."""
        for r in range(2):
            sh("tc", "-n", self.ns[r], "qdisc", "del", "dev", self.dev[r], "root", check=False)
        self.rate = None

    def lo_tx_bytes(self):
        """Bytes each namespace's loopback has sent so far (traffic that stayed inside a namespace)."""
        out = []
        for r in range(2):
            info = json.loads(sh("ip", "-n", self.ns[r], "-j", "-s", "link", "show", "dev", "lo").stdout)
            out.append(info[0]["stats64"]["tx"]["bytes"])
        return out

    def set_link(self, rank, up):
        """Bring rank's end of the veth pair up or down (a cut link)."""
        sh("ip", "-n", self.ns[rank], "link", "set", self.dev[rank], "up" if up else "down")

    def tx_bytes(self):
        """Bytes each end has sent so far (the kernel's counters, read from outside)."""
        out = []
        for r in range(2):
            info = json.loads(sh("ip", "-n", self.ns[r], "-j", "-s", "link", "show", "dev", self.dev[r]).stdout)
            out.append(info[0]["stats64"]["tx"]["bytes"])
        return out

    def wrap(self, rank, argv):
        """``argv`` run inside rank's namespace (``ip netns exec`` execs it: the pid stays the command's)."""
        return ["ip", "netns", "exec", self.ns[rank]] + list(argv)

    def rank_env(self, rank):
        """What binds a rank's gloo to this link."""
        return {"MASTER_ADDR": self.addrs[0], "GLOO_SOCKET_IFNAME": self.dev[rank]}

    def goodput(self, seconds=3.0):
        """TCP goodput from rank 0's namespace to rank 1's over the veth pair, in bit/s."""
        port = str(free_port())
        cmds = [({}, self.wrap(0, [sys.executable, "-c", _SEND, self.addrs[1], port, str(seconds)])),
                ({}, self.wrap(1, [sys.executable, "-c", _RECV, self.addrs[1], port]))]
        out_dir = Path(tempfile.mkdtemp(prefix="acco_goodput_"))
        try:
            with RankSet(cmds, out_dir, "link check") as rs:
                rs.finish(timeout=seconds + 40)
                n, dt = rs.log(1).split()
        finally:
            shutil.rmtree(out_dir, ignore_errors=True)
        return int(n) * 8 / float(dt)

    def close(self):
        for ns in self.ns:
            remove_namespace(ns)


_RECV = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(30); n, t0 = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t0 = t0 or time.perf_counter()
    n += len(b)
print(n, time.perf_counter() - t0)
"""
_SEND = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30); break
    except OSError:
        time.sleep(0.05)
buf, end = b"x" * 65536, time.perf_counter() + float(sys.argv[3])
while time.perf_counter() < end:
    c.sendall(buf)
c.close()
"""


def remove_namespace(ns):
    """Kill what still runs in a namespace of ours (its ranks), then delete it (and its veth end)."""
    for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    sh("ip", "netns", "del", ns, check=False)


def cleanup_leftovers():
    """Remove the namespaces that processes now gone left behind (a SIGKILLed benchmark), and those with the
    fixed names of earlier versions; returns their names."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = _NAME.match(name)
        if (m and not os.path.exists(f"/proc/{m.group(1)}")) or name.startswith(LEGACY_NAMESPACES):
            remove_namespace(name)
            removed.append(name)
    return removed


def lo_tx_bytes():
    """Bytes sent so far on this namespace's loopback (traffic between ranks of one "node")."""
    try:
        with open("/sys/class/net/lo/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def counters_now():
    """Inside a rank: the link and loopback counters, as ``{"tx": link_tx_bytes(), "lo": lo_tx_bytes()}``."""
    return {"tx": link_tx_bytes(), "lo": lo_tx_bytes()}


def write_counters_after_close(results, rank, run_start):
    """Every rank, once its communication threads are closed (co2's last all-reduce may still have been on
    the wire when the run's counters were read): the bytes sent since ``run_start``, to ``results.rank<r>``."""
    if not results or run_start["tx"] is None:
        return
    now = counters_now()
    with open(f"{results}.rank{rank}", "w") as f:
        json.dump({"rank": rank, "tx_bytes_after_destroy": now["tx"][0] - run_start["tx"][0],
                   "lo_tx_bytes_after_destroy": None if now["lo"] is None or run_start["lo"] is None
                   else now["lo"] - run_start["lo"]}, f)


def acco_totals(host):
    """Cumulative ACCO round figures of an engine or optimizer (None for a stock one); local-SGD modes add
    their outer figures."""
    if not hasattr(host, "acco_stats"):
        return None
    s = host.acco_stats()
    return {k: s[k] for k in ("rounds", "micro_batches", "compute_s", "wait_s", "comm_s", "reduce_scatter_s",
                              "stats_allreduce_s", "update_s", "all_gather_s", "outer_comm_s", "outer_wait_s")
            if isinstance(s.get(k), (int, float))}


def link_tx_bytes():
    """Inside a rank: (bytes sent, TCP segments retransmitted) so far on the interface gloo uses
    (GLOO_SOCKET_IFNAME), from the kernel's counters of this network namespace; None when gloo is not
    bound to one interface."""
    dev = os.environ.get("GLOO_SOCKET_IFNAME")
    path = f"/sys/class/net/{dev}/statistics/tx_bytes"
    if not dev or not os.path.exists(path):
        return None
    with open(path) as f:
        sent = int(f.read())
    with open("/proc/net/snmp") as f:
        tcp = [line.split() for line in f if line.startswith("Tcp:")]
    return sent, int(tcp[1][tcp[0].index("RetransSegs")])


# ------------------------------------------------------------------------ ranks
class DeadlineExceeded(Exception):
    pass


class Deadline:

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds
        self.seconds = seconds

    def left(self):
        return self.end - time.monotonic()

    def check(self):
        if self.left() <= 0:
            raise DeadlineExceeded(f"exceeded its {self.seconds:.0f} s limit")


def skip_deepspeed_shm_op():
    """Inside a rank, before ``deepspeed.init_distributed``: DeepSpeed's CPU backend JIT-loads its
    shared-memory all-reduce op (used by inference only) there, under torch's build lock in the extension
    folder that every checkout on the machine shares (another venv's build makes the next load rebuild it,
    minutes on 2 cores): skipped, so that a benchmark neither builds it nor waits on other processes' builds."""
    import deepspeed.comm.torch  # noqa: F401 - the attribute deepspeed.comm.torch is torch itself
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


def rank_env(rank, world, port, net=None, local_rank=None):
    """The environment of one CPU rank (gloo, one thread); on ``net`` bound to rank's end of the link."""
    env = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(world),
           "LOCAL_RANK": str(rank if local_rank is None else local_rank), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1"}
    if net is not None:
        env.update(net.rank_env(rank))
    return env


def shell_line(env, argv):
    """A command line that reruns one rank by hand."""
    return " ".join(f"{k}={v}" for k, v in env.items() if k != "PYTHONUNBUFFERED") + " " + " ".join(
        shlex.quote(a) for a in argv)


_LIVE = []  # every RankSet started and not yet reaped


class RankSet:
    """One process per ``(env, argv)`` of ``commands`` (env over this process's environment), all started
    at once, each in its own session (so that a kill takes its children along: a compiler, a launcher's
    ranks), its output in ``outdir/rank<r>.log``. A ``deadline`` (``Deadline``) bounds every wait."""

    def __init__(self, commands, outdir, name=None, deadline=None, cwd=ROOT, fork=False):
        self.outdir = Path(outdir)
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.name = name or self.outdir.name
        self.commands = list(commands)
        self.world, self.deadline = len(self.commands), deadline
        self.procs, self.logs, self.exit_time = [], [], [None] * self.world
        _LIVE.append(self)
        try:
            for r, (env, argv) in enumerate(self.commands):
                log = open(self.outdir / f"rank{r}.log", "w")
                self.logs.append(log)
                if fork and forked.can_fork(argv):  # ``fork``: a script's rank forks from this process
                    self.procs.append(forked.Forked(argv, dict(os.environ, **env), log, str(cwd)))
                    continue
                self.procs.append(subprocess.Popen(argv, env=dict(os.environ, **env), stdout=log,
                                                   stderr=subprocess.STDOUT, cwd=str(cwd), start_new_session=True))
        except BaseException:
            self.kill_all()
            raise
        self.start = time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.kill_all()

    # -- observation
    def log(self, r):
        try:
            return (self.outdir / f"rank{r}.log").read_text(errors="replace")
        except OSError:
            return ""

    def texts(self):
        return [self.log(r) for r in range(self.world)]

    def tails(self, n=2500):
        return "\n".join(f"--- {self.name} rank {r} ---\n{self.log(r)[-n:]}" for r in range(self.world))

    def poll(self):
        """Exit codes (None: still running); notes when each rank exited."""
        now = time.monotonic()
        for r, p in enumerate(self.procs):
            if self.exit_time[r] is None and p.poll() is not None:
                self.exit_time[r] = now
        return [p.returncode for p in self.procs]

    def _tick(self, until):
        self.poll()
        if self.deadline is not None:
            self.deadline.check()
        if until is not None and time.monotonic() > until:
            return False
        time.sleep(0.05)
        return True

    def wait_for(self, pattern, rank=0, timeout=120.0):
        """Wait until rank's log matches ``pattern``; returns the match or raises."""
        until = time.monotonic() + timeout
        rx = re.compile(pattern)
        while True:
            m = rx.search(self.log(rank))
            if m:
                return m
            if self.procs[rank].poll() is not None:
                m = rx.search(self.log(rank))
                if m:
                    return m
                raise RuntimeError(f"{self.name}: rank {rank} exited ({self.procs[rank].returncode}) before "
                                   f"{pattern!r}:\n{self.log(rank)[-3000:]}")
            if not self._tick(until):
                raise RuntimeError(f"{self.name}: no {pattern!r} on rank {rank} within {timeout:.0f} s:\n"
                                   f"{self.log(rank)[-3000:]}")

    def wait(self, timeout=120.0, ranks=None):
        """Wait for ``ranks`` (default all) to exit; returns exit codes, None for ranks still running."""
        until = time.monotonic() + timeout
        ranks = range(self.world) if ranks is None else ranks
        while any(self.procs[r].poll() is None for r in ranks):
            if not self._tick(until):
                break
        return self.poll()

    def finish(self, timeout=120.0):
        """Wait for a run that should succeed: every rank exits 0. At the first failure (the others would
        wait on a collective until their timeout) or after ``timeout`` s, kill all and raise with the logs."""
        until = time.monotonic() + timeout
        while any(c is None for c in self.poll()):
            if any(c for c in self.poll() if c is not None) or not self._tick(until):
                break
        codes = self.poll()
        if all(c == 0 for c in codes):
            self.close()
            return codes
        self.kill_all()
        if any(c for c in codes if c is not None):
            raise RuntimeError(f"{self.name} failed, exit codes {codes} (logs in {self.outdir}):\n{self.tails()}")
        raise RuntimeError(f"{self.name} did not finish in {timeout:.0f} s (logs in {self.outdir}):\n{self.tails()}")

    # -- faults and cleanup
    def signal(self, rank, sig):
        """Send ``sig`` to rank's whole session (process group)."""
        try:
            os.killpg(self.procs[rank].pid, sig)
        except ProcessLookupError:
            pass

    def kill_all(self):
        """SIGKILL every rank still running (a stopped one too), wait for them, close the logs."""
        for r, p in enumerate(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGCONT)
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.poll()
        self.close()

    def close(self):
        for log in self.logs:
            log.close()
        if self in _LIVE:
            _LIVE.remove(self)


def processes_naming(marks):
    """Processes still running (this one aside) whose command line holds one of ``marks`` (a work folder, a
    port): what a benchmark checks it left behind, as ``"pid command line"``."""
    left = []
    for p in Path("/proc").iterdir():
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if p.name.isdigit() and int(p.name) != os.getpid() and any(m in cmd for m in marks):
            left.append(f"{p.name} {cmd[:150]}")
    return left


def kill_everything():
    for rs in list(_LIVE):
        rs.kill_all()


def interrupt_on_signals():
    """SIGTERM, SIGHUP and SIGINT raise KeyboardInterrupt, so that ``finally`` blocks and ``with`` exits
    kill the ranks and remove the namespaces (a SIGKILL leaves them: ``cleanup_leftovers()``)."""

    def stop(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, stop)
