"""The process groups acco_ds creates, and an orderly end for them.

A gloo process group runs its collectives on worker threads of its own. When
a collective finishes, the waiting Python thread goes on while the worker
still holds the finished work, and with it the last reference to a tensor
that Python owns (a temporary input); freeing that tensor takes the GIL. If
the script has already returned and the interpreter is finalizing, taking the
GIL ends the worker thread (``pthread_exit``), and the unwinding through
gloo's ``runLoop`` calls ``std::terminate``: "terminate called without an
active exception", SIGABRT after the script's last line, and the
``deepspeed`` launcher kills the ranks still finishing. A plain torch script
with gloo subgroups that ends without ``destroy_process_group()`` shows it
(benchmarks/exit_codes.py, "torch alone"). A group destroyed while the
interpreter is whole joins its worker threads first.

So every group acco_ds creates is made here (``new_group``, ``new_subgroups``)
and recorded with the engine being built (``owned_by``); ``destroy(groups)``
ends them once the engine drained its work; and ``end_at_exit`` arms one
interpreter-exit handler per process that closes what a script left open
(engines never destroyed, then the default group) before finalization, as
torch asks scripts to do with ``destroy_process_group()``.
"""

import atexit
import contextlib
import gc
import sys
import threading
import weakref
from datetime import timedelta
from typing import Callable, List

import torch.distributed as tdist

_lock = threading.Lock()
_collecting: List[list] = []  # the groups of the engines being built, innermost last
_closers: dict = {}  # id(owner) -> (weak reference to the owner, its close function)
_armed = False


def _record(group) -> None:
    if group is not None and group is not tdist.GroupMember.NON_GROUP_MEMBER and _collecting:
        _collecting[-1].append(group)


def new_group(ranks: List[int], timeout: timedelta):
    """``torch.distributed.new_group`` (collective over the default group), recorded for ``destroy``."""
    group = tdist.new_group(ranks, timeout=timeout)
    _record(group)
    return group


def new_subgroups(lists: List[List[int]], timeout: timedelta):
    """This rank's group of ``new_subgroups_by_enumeration(lists)`` (every rank creates every group),
    recorded for ``destroy``."""
    mine, _ = tdist.new_subgroups_by_enumeration(lists, timeout=timeout)
    _record(mine)
    return mine


@contextlib.contextmanager
def owned_by(groups: list):
    """Record the groups created inside the block into ``groups`` (an engine's own list)."""
    _collecting.append(groups)
    try:
        yield groups
    finally:
        _collecting.remove(groups)


def destroy(groups: list) -> None:
    """Destroy ``groups`` (newest first: a group made from another's ranks goes before it) and empty the
    list. Call it after every collective on them finished, on every rank; a group already destroyed is
    skipped."""
    while groups:
        group = groups.pop()
        if not tdist.is_initialized():
            continue
        try:
            tdist.destroy_process_group(group)
        except (ValueError, RuntimeError):  # destroyed already (by the script, or with the default group)
            pass


def end_at_exit(owner, close: Callable[[object], None]) -> None:
    """At interpreter exit, call ``close(owner)`` if ``owner`` is still alive (it drains its work and destroys
    its groups), then destroy the default process group if the script left it up. Registered once per process;
    ``owner`` is held weakly."""
    global _armed
    key = id(owner)
    with _lock:
        _closers[key] = (weakref.ref(owner, lambda _: _closers.pop(key, None)), close)
        if not _armed:
            atexit.register(_at_exit)
            _armed = True


def release(owner, groups: list) -> None:
    """``owner`` closed itself: destroy its ``groups``, and leave nothing of it to the exit handler."""
    destroy(groups)
    with _lock:
        _closers.pop(id(owner), None)


def _at_exit() -> None:
    for ref, close in list(_closers.values())[::-1]:
        owner = ref()
        if owner is None:
            continue
        try:
            close(owner)
        except Exception as err:  # noqa: BLE001 - a failed peer must not turn a finished run into a crash
            _warn(f"ACCO: closing an engine at interpreter exit failed ({type(err).__name__}: {err}); "
                  f"its process groups are destroyed anyway")
    _closers.clear()
    if tdist.is_initialized():
        try:
            tdist.destroy_process_group()
        except Exception as err:  # noqa: BLE001
            _warn(f"ACCO: destroying the default process group at exit failed: {err}")
    # An engine the script dropped may sit in a reference cycle with its groups: collect it now, so that each
    # group's destructor joins its gloo threads while the interpreter can still give them the GIL.
    gc.collect()


def _warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def is_armed() -> bool:
    """Whether the interpreter-exit handler is registered in this process."""
    return _armed


def owners() -> List[object]:
    """The engines the exit handler would still close."""
    return [owner for owner in (ref() for ref, _ in list(_closers.values())) if owner is not None]


__all__ = ["new_group", "new_subgroups", "owned_by", "destroy", "end_at_exit", "release", "is_armed", "owners"]
