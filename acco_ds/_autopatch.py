"""Startup hook: make every ``deepspeed.initialize`` honour the ``"acco"`` block.

Installing acco_ds puts ``acco_ds_autopatch.pth`` into site-packages. Python
runs its one line at start-up; it calls :func:`install`, which adds a tiny
``sys.meta_path`` finder and nothing else (no torch, no deepspeed import). The
finder ignores every import but the top-level ``deepspeed``; when that module
has finished executing it calls ``acco_ds.patch()`` and removes itself. So an
unmodified script launched with plain ``deepspeed``, ``torchrun``,
``accelerate launch`` or ``python`` gets the ACCO engine where its DeepSpeed
config has ``"acco": {"enabled": true}``, and stock DeepSpeed otherwise.

Opt out with ``ACCO_DS_AUTOPATCH=0`` (also ``false``/``no``/``off``) in the
environment: checked at start-up and again when deepspeed is imported.
``acco_ds.patch()``/``unpatch()`` and ``python -m acco_ds.cli.run`` keep working
(``patch()`` is idempotent, so the hook never wraps twice).

The hook is silent; if ``patch()`` fails it warns once (RuntimeWarning) and
the process goes on with stock DeepSpeed.
"""

import os
import sys
import threading

PTH_NAME = "acco_ds_autopatch.pth"
ENV = "ACCO_DS_AUTOPATCH"
_OFF = ("0", "false", "no", "off")

_lock = threading.RLock()
_finder = None  # the armed finder, while it waits for deepspeed
_state = {"installed": False, "fired": False, "skipped": None, "error": None}


def enabled() -> bool:
    """False when the environment opts out (``ACCO_DS_AUTOPATCH=0``)."""
    return os.environ.get(ENV, "1").strip().lower() not in _OFF


def _fire() -> None:
    """deepspeed is imported: patch it, unless opted out meanwhile."""
    _uninstall_finder()
    with _lock:
        if _state["fired"]:
            return
        _state["fired"] = True
    if not enabled():
        _state["skipped"] = f"{ENV}={os.environ.get(ENV)}"
        return
    _state["skipped"] = None
    try:
        import acco_ds
        acco_ds.patch()  # idempotent: no double wrap after an explicit patch() or acco_ds.cli.run
    except Exception as err:  # noqa: BLE001 - never break the user's `import deepspeed`
        _state["error"] = f"{type(err).__name__}: {err}"
        import warnings
        warnings.warn(f"acco_ds: the startup hook could not patch deepspeed.initialize ({_state['error']}); "
                      'the "acco" config block is ignored in this process', RuntimeWarning, stacklevel=2)


class _DeepSpeedImportHook:
    """A ``sys.meta_path`` finder that only reacts to the top-level ``deepspeed`` import: it finds the
    module's spec with the other finders and wraps that spec's loader's ``exec_module`` (on the
    loader instance: the loader keeps its type), so that ``_fire`` runs right after deepspeed's
    ``__init__`` has executed."""

    def __init__(self):
        self._searching = threading.local()

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" or path is not None or getattr(self._searching, "on", False):
            return None
        self._searching.on = True
        try:
            spec = None
            for finder in list(sys.meta_path):
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._searching.on = False
        loader = getattr(spec, "loader", None)
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return None  # not found, or an unusual loader: leave the import alone
        def exec_then_patch(module):
            try:
                del loader.exec_module  # back to the class's method
            except AttributeError:
                pass
            exec_module(module)  # raises like a plain import; the finder then stays for a retry
            _fire()
        try:
            loader.exec_module = exec_then_patch
        except (AttributeError, TypeError):
            return None
        return spec

    def invalidate_caches(self):
        pass


def _uninstall_finder() -> None:
    global _finder
    with _lock:
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None


def install() -> None:
    """Arm the hook (what the ``.pth`` line calls); patch at once if deepspeed is already imported.
    Does nothing when opted out or already installed."""
    global _finder
    if not enabled():
        _state["skipped"] = f"{ENV}={os.environ.get(ENV)}"
        return
    _state["skipped"] = None
    with _lock:
        if _state["installed"]:
            return
        _state["installed"] = True
        if "deepspeed" not in sys.modules:
            _finder = _DeepSpeedImportHook()
            sys.meta_path.insert(0, _finder)
            return
    _fire()


def pth_locations() -> list:
    """The ``acco_ds_autopatch.pth`` files in the site directories of this interpreter (the only
    directories whose ``.pth`` files Python runs at start-up)."""
    import site
    dirs = list(getattr(site, "getsitepackages", lambda: [])())
    if getattr(site, "ENABLE_USER_SITE", False):
        dirs.append(site.getusersitepackages())
    found = []
    for d in dict.fromkeys(dirs):
        path = os.path.join(d, PTH_NAME)
        if os.path.isfile(path):
            found.append(path)
    return found


def status() -> dict:
    """Where the hook stands in this process (for ``acco-ds report``)."""
    import acco_ds
    if _state["error"]:
        active = f"failed ({_state['error']})"
    elif _state["skipped"]:
        active = f"off ({_state['skipped']})"
    elif _state["fired"]:
        active = "fired: deepspeed was imported and patched" if acco_ds.is_patched() else \
            "fired, but acco_ds.unpatch() was called since"
    elif _finder is not None:
        active = "armed: patches deepspeed.initialize when deepspeed is imported"
    else:
        active = "not loaded in this process"
    return {"pth": pth_locations(), "active": active, "enabled": enabled(), "env": os.environ.get(ENV)}
