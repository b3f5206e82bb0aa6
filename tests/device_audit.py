"""Would these collectives be valid on NCCL? An audit that runs on CPU (gloo), without a GPU.

On a GPU host every process group acco_ds creates uses the default backend, NCCL, which refuses host
tensors. A tensor that a torch factory (``torch.tensor``, ``torch.zeros``, ...) made without a ``device``
lands on the CPU there, while one derived from the host's tensors (``zeros_like``, ``clone``, a slice of a
flat buffer) lands on the GPU. On CPU both are CPU tensors, so the test run cannot tell them apart by
device: the audit marks every tensor that code under ``acco_ds/`` makes with a factory and no explicit
device, and records each collective's tensors and group. A marked tensor handed to a collective is a
tensor NCCL would refuse: a violation, with the call site.

``install()`` runs before the scenario builds anything; it also re-binds the native flat-tensor collectives
that ``runtime.comm.collectives`` bound at import.
"""

import os
import sys
import traceback
from typing import List

import torch
import torch.distributed as tdist

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "acco_ds") + os.sep
FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "from_numpy")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter",
               "all_to_all_single", "all_to_all", "broadcast", "reduce", "send", "recv", "isend", "irecv",
               "reduce_scatter_single", "all_gather_single")
MARK = "_acco_audit_host_default"


class DeviceAudit:
    """Records collectives and flags host-default tensors made by code under ``package``."""

    def __init__(self, package: str = PACKAGE):
        self.package = package
        self.calls: List[dict] = []  # one per collective: op, devices, group ranks, caller
        self.violations: List[str] = []
        self._saved = []

    def _from_package(self, depth: int) -> bool:
        return sys._getframe(depth).f_code.co_filename.startswith(self.package)

    def _factory(self, name, original):
        def made(*args, **kwargs):
            out = original(*args, **kwargs)
            explicit = kwargs.get("device") is not None
            if not explicit and isinstance(out, torch.Tensor) and self._from_package(2):
                setattr(out, MARK, "".join(traceback.format_stack(sys._getframe(1), limit=1)).strip())
            return out
        return made

    def _collective(self, name, original):
        def call(*args, **kwargs):
            tensors = [t for a in list(args) + list(kwargs.values())
                       for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
            group = kwargs.get("group")
            ranks = tdist.get_process_group_ranks(group) if group is not None else None
            caller = sys._getframe(1).f_code.co_filename
            self.calls.append({"op": name, "devices": sorted({str(t.device) for t in tensors}), "group": ranks,
                               "caller": caller})
            for t in tensors:
                made_at = getattr(t, MARK, None)
                if made_at is not None:
                    self.violations.append(f"{name} on group {ranks or 'WORLD'} got a host tensor (a torch "
                                           f"factory without device=) made at {made_at}")
            return original(*args, **kwargs)
        return call

    def install(self) -> "DeviceAudit":
        for module, names, wrap in ((torch, FACTORIES, self._factory), (tdist, COLLECTIVES, self._collective)):
            for name in names:
                original = getattr(module, name, None)
                if original is not None:
                    self._saved.append((module, name, original))
                    setattr(module, name, wrap(name, original))
        bound = sys.modules.get("acco_ds.runtime.comm.collectives")  # imported already: re-bind its natives
        if bound is not None:
            for attr, name in (("_native_reduce_scatter", "reduce_scatter_tensor"),
                               ("_native_all_gather", "all_gather_into_tensor")):
                self._saved.append((bound, attr, getattr(bound, attr)))
                setattr(bound, attr, getattr(tdist, name))
        return self

    def uninstall(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved = []

    def report(self) -> dict:
        ours = [c for c in self.calls if c["caller"].startswith(self.package)]
        return {"violations": sorted(set(self.violations)), "collectives": len(self.calls),
                "package_collectives": len(ours), "ops": sorted({c["op"] for c in ours})}


def install(package: str = PACKAGE) -> DeviceAudit:
    return DeviceAudit(package).install()
