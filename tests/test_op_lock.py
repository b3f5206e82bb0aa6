"""A JIT build of the native op cannot hang on torch's build lock (``builder.JitBuildLock``).

Every test uses a private ``TORCH_EXTENSIONS_DIR`` and replaces the real build
(``jit_load``) with a fake that takes the lock the way torch's ``_jit_compile``
does, so the tests take seconds and compile nothing.
"""

import importlib
import logging
import os
import socket
import subprocess
import sys
import time
import types

import pytest

from acco_ds import ops
from acco_ds.deepspeed.initialize import guard_deepspeed_shm_op
from acco_ds.ops import builder as builder_mod
from deepspeed.ops.op_builder.builder import OpBuilder

pytestmark = pytest.mark.alone  # bounds on waits of a few seconds: other load would stretch them

NAME = builder_mod.AccoCPUOpBuilder.NAME


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Private extension dir, short bounds, no AOT module, fake build; yields a record of the fake builds."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(builder_mod.JIT_WAIT_ENV, "0.5")
    monkeypatch.setenv(builder_mod.JIT_STALE_ENV, "600")
    monkeypatch.setenv(builder_mod.JIT_IDLE_ENV, "600")
    monkeypatch.setattr(builder_mod._AccoOpBuilder, "aot_module", lambda self: None)
    builds = []

    def fake_jit_load(self, verbose=True):
        # What torch.utils.cpp_extension._jit_compile does with its lock, minus the compiler.
        import torch.utils.cpp_extension as cpp
        build_dir = cpp._get_build_directory(self.name, False)
        baton = cpp.FileBaton(os.path.join(build_dir, "lock"))
        if baton.try_acquire():
            try:
                owner_file = os.path.join(build_dir, "lock.owner")
                builds.append(open(owner_file).read().split()[:2] if os.path.exists(owner_file) else None)
            finally:
                baton.release()
        else:
            baton.wait()
        module = types.SimpleNamespace(adamw_update=None, quantize_pack=None, dequantize_accumulate=None,
                                       sparse_pack=None, sparse_unpack_accumulate=None, sparse_average=None)
        OpBuilder._loaded_ops[self.name] = module
        return module

    monkeypatch.setattr(builder_mod._AccoOpBuilder, "jit_load", fake_jit_load, raising=False)
    saved_loaded = dict(OpBuilder._loaded_ops)
    saved_cache = dict(ops._cache)
    OpBuilder._loaded_ops.pop(NAME, None)
    ops._cache.clear()
    ops._load_errors.clear()
    yield types.SimpleNamespace(builds=builds, lock=builder_mod.JitBuildLock.for_op(NAME))
    OpBuilder._loaded_ops.clear()
    OpBuilder._loaded_ops.update(saved_loaded)
    ops._cache.clear()
    ops._cache.update(saved_cache)
    ops._load_errors.clear()


def plant(lock, owner=None, age_s=0.0):
    """Create ``lock`` as a build would leave it: optionally an owner record, optionally ``age_s`` old."""
    os.makedirs(lock.build_dir, exist_ok=True)
    open(lock.lock_path, "w").close()
    if owner is not None:
        with open(lock.owner_path, "w") as f:
            f.write(f"{owner[0]} {owner[1]}\n")
    if age_s:
        old = time.time() - age_s
        for path in (lock.lock_path, lock.owner_path, lock.build_dir):
            if os.path.exists(path):
                os.utime(path, (old, old))


def acco_warnings(caplog):
    return [r for r in caplog.records if r.name == "acco_ds" and r.levelno >= logging.WARNING]


@pytest.mark.timeout(60)
def test_lock_is_in_torch_build_directory(env):
    import torch.utils.cpp_extension as cpp
    assert env.lock.lock_path == os.path.join(cpp._get_build_directory(NAME, False), "lock")
    assert env.lock.lock_path.startswith(os.environ["TORCH_EXTENSIONS_DIR"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kernels", ["auto", "native"])
def test_stale_lock_of_dead_owner_is_cleared(env, caplog, kernels):
    plant(env.lock, owner=(dead_pid(), socket.gethostname()))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        kernels_ = ops.load_kernels(kernels, "cpu")
    assert time.monotonic() - start < 10
    assert kernels_.name == "native-cpu"
    assert env.builds == [[str(os.getpid()), socket.gethostname()]]  # we took the lock and recorded ourselves
    assert not os.path.exists(env.lock.lock_path) and not os.path.exists(env.lock.owner_path)
    warnings = acco_warnings(caplog)
    assert len(warnings) == 1 and env.lock.lock_path in warnings[0].getMessage()
    assert "stale" in warnings[0].getMessage()


@pytest.mark.timeout(60)
def test_old_ownerless_lock_is_cleared(env, caplog):
    plant(env.lock, age_s=3600)
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        assert ops.load_kernels("auto", "cpu").name == "native-cpu"
    assert len(env.builds) == 1
    assert any(env.lock.lock_path in r.getMessage() for r in acco_warnings(caplog))


@pytest.mark.timeout(60)
def test_recent_ownerless_lock_is_not_stale(env):
    plant(env.lock)
    assert env.lock.stale_reason() is None
    plant(env.lock, age_s=3600)
    with open(os.path.join(env.lock.build_dir, "build.ninja"), "w"):  # a build still writing: not stale
        pass
    assert env.lock.stale_reason() is None


@pytest.mark.timeout(60)
def test_owner_record_of_an_earlier_lock_is_ignored(env):
    plant(env.lock, owner=(dead_pid(), socket.gethostname()))
    old = time.time() - 3600
    os.utime(env.lock.owner_path, (old, old))  # written for an earlier lock, not this one
    assert env.lock.owner() is None
    assert env.lock.stale_reason() is None  # fresh lock, no usable owner: a build may be running


@pytest.mark.timeout(60)
def test_live_lock_auto_falls_back_with_one_warning(env, caplog):
    plant(env.lock, owner=(os.getpid(), socket.gethostname()))  # a build in progress (this process)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        first = ops.load_kernels("auto", "cpu")
        again = ops.load_kernels("auto", "cpu")
    assert time.monotonic() - start < 10
    assert first is ops.TORCH and again is ops.TORCH
    assert env.builds == []
    assert os.path.exists(env.lock.lock_path)  # a live build's lock is left alone
    warnings = acco_warnings(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert env.lock.lock_path in warnings[0].getMessage()


@pytest.mark.timeout(60)
def test_live_lock_native_raises_naming_lock_and_fix(env):
    plant(env.lock, owner=(os.getpid(), socket.gethostname()))
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        ops.load_kernels("native", "cpu")
    assert time.monotonic() - start < 10
    message = str(info.value)
    assert env.lock.lock_path in message
    assert "delete" in message and '"kernels": "torch"' in message
    assert isinstance(info.value.__cause__, builder_mod.JitLockTimeout)


@pytest.mark.timeout(60)
def test_wait_returns_when_the_other_build_finishes(env):
    plant(env.lock, owner=(os.getpid(), socket.gethostname()))
    old = time.time()

    import threading
    timer = threading.Timer(0.3, env.lock.release)
    timer.start()
    env.lock.wait(wait_s=20)
    timer.join()
    assert not env.lock.held() and time.time() - old < 10


@pytest.mark.timeout(60)
def test_torch_baton_wait_is_bounded(env):
    """The race: another process takes the lock after our check, inside torch's own load()."""
    import torch.utils.cpp_extension as cpp
    original = cpp.FileBaton
    plant(env.lock, owner=(os.getpid(), socket.gethostname()))
    with builder_mod.bounded_torch_baton():
        baton = cpp.FileBaton(env.lock.lock_path)
        assert not baton.try_acquire()
        with pytest.raises(builder_mod.JitLockTimeout, match="delete"):
            baton.wait()
    assert cpp.FileBaton is original
    env.lock.release()
    with builder_mod.bounded_torch_baton():
        baton = cpp.FileBaton(env.lock.lock_path)
        assert baton.try_acquire()
        assert env.lock.owner()[:2] == (os.getpid(), socket.gethostname())
        baton.release()
    assert not os.path.exists(env.lock.lock_path) and not os.path.exists(env.lock.owner_path)


@pytest.mark.timeout(60)
def test_concurrent_loaders_build_once(env, tmp_path):
    """Two processes: one takes the lock and builds, the other waits for it and loads the result."""
    script = tmp_path / "loader.py"
    script.write_text(
        "import os, sys, time, types\n"
        "from acco_ds.ops import builder as b\n"
        "b._AccoOpBuilder.aot_module = lambda self: None\n"
        "def fake(self, verbose=True):\n"
        "    import torch.utils.cpp_extension as cpp\n"
        "    d = cpp._get_build_directory(self.name, False)\n"
        "    baton = cpp.FileBaton(os.path.join(d, 'lock'))\n"
        "    if baton.try_acquire():\n"
        "        try:\n"
        "            if not os.path.exists(os.path.join(d, 'built')):  # torch rebuilds only if sources changed\n"
        "                with open(os.path.join(d, 'built'), 'a') as f: f.write(str(os.getpid()) + '\\n')\n"
        "                time.sleep(2)\n"
        "        finally:\n"
        "            baton.release()\n"
        "    else:\n"
        "        baton.wait()\n"
        "    return types.SimpleNamespace()\n"
        "b._AccoOpBuilder.jit_load = fake\n"
        "b.AccoCPUOpBuilder().load()\n"
        "print('loaded')\n")
    env_vars = dict(os.environ, **{builder_mod.JIT_WAIT_ENV: "30", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    procs = [subprocess.Popen([sys.executable, str(script)], env=env_vars, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=50)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    assert all("loaded" in out for out in outputs), outputs
    with open(os.path.join(env.lock.build_dir, "built")) as f:
        assert len(f.read().split()) == 1  # built once
    assert not env.lock.held()


@pytest.mark.timeout(60)
def test_deepspeeds_own_cpu_op_build_cannot_hang_either(tmp_path, monkeypatch, caplog):
    """DeepSpeed JIT-builds its shared-memory op in every CPU process (``build_shm_op``): after
    ``acco_ds.patch()`` a stale lock there is cleared, and a live one is waited for a bounded time,
    after which DeepSpeed goes on without the op (one warning) instead of hanging."""
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # not deepspeed.comm.torch: that name is torch
    from deepspeed.accelerator import get_accelerator
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv(builder_mod.JIT_WAIT_ENV, "0.5")
    calls = []
    monkeypatch.setattr(ds_torch, "build_shm_op", lambda: calls.append("built") or "op")
    guard_deepspeed_shm_op()
    guard_deepspeed_shm_op()  # idempotent
    assert ds_torch.build_shm_op.__wrapped__.__name__ == "<lambda>"
    name = get_accelerator().create_op_builder("ShareMemCommBuilder").name
    lock = builder_mod.JitBuildLock.for_op(name)
    os.makedirs(lock.build_dir, exist_ok=True)
    # Stale: the owner is gone.
    open(lock.lock_path, "w").close()
    open(lock.owner_path, "w").write(f"{dead_pid()} {socket.gethostname()}\n")
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        assert ds_torch.build_shm_op() == "op" and calls == ["built"]
    assert not os.path.exists(lock.lock_path) and "stale JIT build lock" in caplog.text
    # Live: a build by this very process is "in progress"; bounded, then None.
    caplog.clear()
    open(lock.lock_path, "w").close()
    lock.record_owner()
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        start = time.monotonic()
        assert ds_torch.build_shm_op() is None and calls == ["built"]
    assert time.monotonic() - start < 10
    assert "runs without it" in caplog.text and lock.lock_path in caplog.text


# --------------------------------------------------------------------------------------------------
# Issue 19 (6): the wait says at once what it waits for, and an idle build directory makes an
# ownerless lock stale long before ACCO_JIT_STALE_S.

NOTICE = "waiting for the JIT build lock"


def wait_in_thread(lock, wait_s):
    """Run ``lock.wait(wait_s)`` in a thread; returns (thread, outcome dict)."""
    import threading
    outcome = {}

    def run():
        start = time.monotonic()
        try:
            lock.wait(wait_s)
            outcome["result"] = "free"
        except builder_mod.JitLockTimeout as err:
            outcome["result"] = err
        outcome["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def first_notice_after(caplog, start, limit_s):
    """Seconds after ``start`` when the waiting notice was logged, or None within ``limit_s``."""
    while time.monotonic() - start < limit_s:
        if any(NOTICE in r.getMessage() for r in acco_warnings(caplog)):
            return time.monotonic() - start
        time.sleep(0.05)
    return None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("owned", [False, True])
def test_wait_says_at_once_what_it_waits_for(env, caplog, owned):
    """The notice names the lock, its holder, the bound and the fix within a couple of seconds,
    not after the bound (30 s here); the wait then goes on until the lock is released."""
    plant(env.lock, owner=(os.getpid(), socket.gethostname()) if owned else None)
    lock = builder_mod.JitBuildLock.for_op(NAME)
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        start = time.monotonic()
        thread, outcome = wait_in_thread(lock, 30)
        seen = first_notice_after(caplog, start, 10)
        assert seen is not None and seen < 3, [r.getMessage() for r in acco_warnings(caplog)]
        assert thread.is_alive()  # still waiting: the notice came first
        env.lock.release()
        thread.join(10)
    assert outcome["result"] == "free" and outcome["elapsed"] < 10
    notices = [r.getMessage() for r in acco_warnings(caplog) if NOTICE in r.getMessage()]
    assert len(notices) == 1, notices
    msg = notices[0]
    assert env.lock.lock_path in msg
    assert f"If no build of this op is running, delete {env.lock.lock_path}" in msg
    assert "at most 30 s" in msg and builder_mod.JIT_WAIT_ENV in msg
    if owned:
        assert f"held by process {os.getpid()}" in msg
    else:
        assert "no owner record" in msg and "torch's own build lock" in msg
        assert builder_mod.JIT_IDLE_ENV in msg and "600 s" in msg  # when it will count as stale


@pytest.mark.timeout(60)
def test_notice_reaches_stderr_at_deepspeeds_default_level(env, tmp_path):
    """In a process that imported deepspeed and configured no logging (a rank process), the notice is
    printed on stderr at once, before the bounded wait ends."""
    script = tmp_path / "waiter.py"
    script.write_text(
        "import sys, time, types\n"
        "import deepspeed\n"
        "from acco_ds.ops import builder as b\n"
        "b._AccoOpBuilder.aot_module = lambda self: None\n"
        "b._AccoOpBuilder.jit_load = lambda self, verbose=True: types.SimpleNamespace()\n"
        "print('ready', flush=True)\n"
        "b.AccoCPUOpBuilder().load()\n"
        "print('loaded', flush=True)\n")
    plant(env.lock)  # ownerless, fresh: what torch's own baton leaves
    env_vars = dict(os.environ, **{builder_mod.JIT_WAIT_ENV: "40", builder_mod.JIT_IDLE_ENV: "600",
                                   "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    proc = subprocess.Popen([sys.executable, str(script)], env=env_vars, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        ready = time.monotonic()
        line = ""
        while NOTICE not in line:
            line = proc.stderr.readline()
            assert line, "stderr closed without the notice"
        assert time.monotonic() - ready < 5
        assert env.lock.lock_path in line and "delete" in line and "40 s" in line
        assert proc.poll() is None  # still waiting
        env.lock.release()
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "loaded" in out, err


@pytest.mark.timeout(60)
def test_idle_ownerless_lock_is_cleared_early(env, caplog, monkeypatch):
    """No process in the build directory and nothing changing there for ACCO_JIT_IDLE_S: stale, long
    before ACCO_JIT_STALE_S (600 s) and the bound (30 s)."""
    monkeypatch.setenv(builder_mod.JIT_IDLE_ENV, "1.5")
    monkeypatch.setenv(builder_mod.JIT_WAIT_ENV, "30")
    plant(env.lock)  # fresh, ownerless
    assert env.lock.local_fs()  # pytest's tmp_path
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="acco_ds"):
        assert ops.load_kernels("auto", "cpu").name == "native-cpu"
    elapsed = time.monotonic() - start
    assert 1.0 <= elapsed < 10, elapsed
    assert len(env.builds) == 1 and not env.lock.held()
    stale = [r.getMessage() for r in acco_warnings(caplog) if "removing the stale" in r.getMessage()]
    assert len(stale) == 1 and env.lock.lock_path in stale[0] and builder_mod.JIT_IDLE_ENV in stale[0], stale


@pytest.mark.timeout(60)
def test_lock_with_changing_build_directory_is_waited_on(env, caplog, monkeypatch):
    """A build that keeps writing in its directory is not stale, however short ACCO_JIT_IDLE_S: the wait
    runs to its bound and leaves the lock alone."""
    import threading
    monkeypatch.setenv(builder_mod.JIT_IDLE_ENV, "1")
    monkeypatch.setenv(builder_mod.JIT_WAIT_ENV, "4")
    plant(env.lock)
    stop = threading.Event()

    def building():
        i = 0
        while not stop.is_set():
            with open(os.path.join(env.lock.build_dir, f"obj{i % 3}.o"), "w") as f:
                f.write(str(i))
            i += 1
            stop.wait(0.3)

    writer = threading.Thread(target=building, daemon=True)
    writer.start()
    try:
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="acco_ds"):
            assert ops.load_kernels("auto", "cpu") is ops.TORCH  # bound reached: falls back
        assert time.monotonic() - start >= 3.5
    finally:
        stop.set()
        writer.join()
    assert env.lock.held() and env.builds == []
    messages = [r.getMessage() for r in acco_warnings(caplog)]
    assert not any("removing the stale" in m for m in messages), messages
    assert any(NOTICE in m for m in messages) and any("pure-torch" in m for m in messages), messages


@pytest.mark.timeout(60)
def test_process_working_in_build_directory_keeps_lock(env, monkeypatch):
    """ninja and the compilers run with the build directory as working directory: while such a process
    lives, an ownerless lock is not stale even when nothing changes there (a long compile); once it is
    gone, the idle lock is."""
    monkeypatch.setenv(builder_mod.JIT_IDLE_ENV, "1")
    plant(env.lock, age_s=3600)  # idle for an hour, older than ACCO_JIT_STALE_S too
    lock = builder_mod.JitBuildLock.for_op(NAME)
    compiler = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], cwd=lock.build_dir)
    try:
        deadline = time.monotonic() + 10
        while not any(pid == compiler.pid for pid, _ in lock.build_processes() or []):
            assert time.monotonic() < deadline
            time.sleep(0.1)
            lock._scan = (-1e9, None)
        assert lock.stale_reason() is None
        assert "building in it now" in lock.describe() and str(compiler.pid) in lock.describe()
    finally:
        compiler.kill()
        compiler.wait()
    lock._scan = (-1e9, None)
    reason = lock.stale_reason()
    assert reason is not None and "no owner record" in reason
