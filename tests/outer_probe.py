"""An outer loop from outside the package, for tests/test_local_sgd.py: DiLoCo that also counts the host's
calls. It is registered with ``register_outer_loop`` by the worker, touching no file of acco_ds."""

from acco_ds.runtime.outer.diloco import DiLoCo


class CountingLoop(DiLoCo):
    """``DiLoCo`` plus a count of each hook the host calls, reported through ``stats()`` and ``report()``."""

    HOOKS = ("attach", "after_inner_step", "wait", "before_read", "committed_flats", "finalize", "close")

    def __init__(self, *args, **kwargs):
        self.calls = {name: 0 for name in self.HOOKS}
        super().__init__(*args, **kwargs)

    def __getattribute__(self, name):
        if name in CountingLoop.HOOKS:
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)

    def stats(self) -> dict:
        return {**super().stats(), "probe_calls": dict(self.calls)}

    def banner(self) -> str:
        return "probe " + super().banner()

    def report(self):
        return super().report() + [("probe", "counted by a loop registered from outside acco_ds")]
