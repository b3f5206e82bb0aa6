"""Start without torch._dynamo until something compiles.

Importing ``torch._dynamo`` costs about 2.4 s of CPU per process (``python -X importtime``,
2026-11-26): on every rank of every launch, and on the path of a relaunched replica back into the quorum. Two
things import it although nothing is being compiled:

- the methods of ``torch.optim.Optimizer`` that torch decorates with ``torch._disable_dynamo``
  (``add_param_group``, ``state_dict``, ``load_state_dict``, ``zero_grad``) import it on their first call, to
  wrap themselves in ``torch._dynamo.disable``; ``Optimizer.__init__`` calls ``add_param_group``;
- DeepSpeed's Muon module, which ZeRO's optimizer checks import whatever the optimizer is, applies
  ``torch.compile`` to three functions when it is imported.

``defer_optimizer()`` and ``acco_ds.deepspeed.compat.defer_muon_compile()`` postpone them without changing
what runs. ``torch._dynamo.disable`` only matters once dynamo can
trace, and it cannot before ``torch._dynamo`` is imported (its frame hook comes with it): until then the
optimizer methods call straight through, and from the first call after the import on they wrap themselves
exactly as torch would. Muon's functions are compiled on their first call instead of at import. Each part
checks the shape of the torch or DeepSpeed code it relies on and leaves that code alone if it differs.
"""

import functools
import sys

def imported(name: str) -> bool:
    return name in sys.modules


def _call_through(fn):
    """``fn`` itself while torch._dynamo is not imported; afterwards what ``torch._disable_dynamo`` builds."""

    def call(*args, **kwargs):
        if "torch._dynamo" in sys.modules:
            import torch._dynamo
            disabled = torch._dynamo.disable(fn, True, wrapping=False)
            setattr(fn, "__dynamo_disable", disabled)  # torch's own cache slot: later calls go straight there
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def defer_optimizer() -> None:
    """torch.optim.Optimizer's dynamo-disabled methods: no torch._dynamo import until it is imported elsewhere."""
    if imported("torch._dynamo"):  # too late to save anything; torch's own path is already right
        return
    import torch
    marker = torch._disable_dynamo(lambda: None).__code__  # the wrapper torch._disable_dynamo returns
    for attr in vars(torch.optim.Optimizer).values():
        fn = getattr(attr, "__wrapped__", None)
        if getattr(attr, "__code__", None) is marker and fn is not None and not hasattr(fn, "__dynamo_disable"):
            setattr(fn, "__dynamo_disable", _call_through(fn))  # a second call finds the slot taken


def compile_on_first_call(fn=None, **options):
    """``torch.compile(fn, **options)``, done when ``fn`` is first called (a decorator, with or without
    options). ``acco_ds.deepspeed.compat.defer_muon_compile`` puts it under DeepSpeed's Muon module."""
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    compiled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not compiled:
            import torch
            compiled.append(torch.compile(fn, **options))
        return compiled[0](*args, **kwargs)

    return call
