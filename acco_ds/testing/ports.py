"""Free TCP ports for test and benchmark processes, also when two pytest-xdist workers run at once.

Worker ``gwN`` takes ports from its own block below the kernel's ephemeral range (32768-60999 here, which
gloo's own connections use): the pytest process the first half of the block, the benchmark processes a test
starts the second, so that no two processes that run at once can be handed the same port. Each port handed out
keeps the ``STRIDE`` - 1 ports above it free, for servers that listen on port + j (the syncer's shard j).
Outside xdist the kernel picks a free ephemeral port. Used by ``tests/dist.py`` and ``benchmarks/harness.py``."""

import os
import socket
import sys

PORT_BASE, PORT_BLOCK, STRIDE = 20000, 3000, 8
_next_port = None


def free_port() -> int:
    """A TCP port free on loopback now, and handed to no other test process of this run."""
    global _next_port
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    half = PORT_BLOCK // 2
    low = PORT_BASE + int(worker[2:]) * PORT_BLOCK + (0 if "_pytest" in sys.modules else half)
    slots = half // STRIDE
    if _next_port is None:
        _next_port = int.from_bytes(os.urandom(2), "little") % slots  # two runs on one machine rarely meet
    for _ in range(slots):
        port, _next_port = low + STRIDE * _next_port, (_next_port + 1) % slots
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or in TIME_WAIT
            return port
    raise RuntimeError(f"no free port in {low}-{low + half - 1} for test worker {worker}")
