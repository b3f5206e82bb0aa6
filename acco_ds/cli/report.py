"""``python -m acco_ds.cli.report`` (or ``acco-ds report``): what acco_ds will use here.

Versions, whether ``acco_ds.patch()`` is active in this process, the startup
hook (``acco_ds_autopatch.pth`` installed in site-packages, its state in this
process, the ``ACCO_DS_AUTOPATCH`` opt-out), the native ops (compatible,
built ahead of time, loadable, what ``kernels="auto"`` picks), then
DeepSpeed's own environment report (``ds_report``).
"""

import importlib.metadata
import sys


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def autopatch_lines():
    """The startup hook: is its .pth installed, what did it do in this process, the opt-out."""
    from acco_ds import _autopatch
    st = _autopatch.status()
    if st["pth"]:
        hook = f"installed ({', '.join(st['pth'])})"
    else:
        hook = (f"not installed (no {_autopatch.PTH_NAME} in this interpreter's site directories: "
                "reinstall acco_ds, or use acco_ds.patch() / python -m acco_ds.cli.run)")
    if st["env"] is None:
        optout = "unset (autopatch on)"
    elif st["enabled"]:
        optout = f"{st['env']!r} (autopatch on)"
    else:
        optout = f"{st['env']!r} (autopatch off: stock DeepSpeed unless acco_ds.patch() or acco_ds.cli.run)"
    active = st["active"]
    if active.startswith("armed"):
        active = ("armed: patches deepspeed.initialize when a process first imports deepspeed (a training "
                  "process does so at its `import deepspeed`; this report process has not yet)")
    return [f"startup hook ....... {hook}", f"autopatch .......... {active}",
            f"{_autopatch.ENV} .. {optout}"]


def patch_line():
    """Whether deepspeed.initialize is patched in this process, worded so that it reads consistently with
    the autopatch line: the hook patches at the first ``import deepspeed``, which a report process may not
    have done yet, so ``False`` here next to ``armed`` is expected, not a contradiction."""
    import acco_ds
    if acco_ds.is_patched():
        return "patch active ....... True (deepspeed.initialize is patched in this process)"
    try:
        from acco_ds import _autopatch
        st = _autopatch.status()
    except Exception:  # noqa: BLE001 - report, do not crash
        st = {"active": ""}
    active = st["active"]
    if active.startswith("armed"):
        why = ("not yet in this report process, which has not imported deepspeed; the startup hook (autopatch, "
               "below) patches deepspeed.initialize when a process imports deepspeed, so training processes are "
               "patched")
    elif active.startswith("off"):
        why = "autopatch is off: only acco_ds.patch(), acco_ds.initialize or python -m acco_ds.cli.run use ACCO"
    elif active.startswith("fired"):
        why = "acco_ds.unpatch() was called in this process"
    elif active.startswith("failed"):
        why = "the startup hook failed to patch (see autopatch below)"
    else:
        why = "no startup hook in this process: call acco_ds.patch() or launch with python -m acco_ds.cli.run"
    return f"patch active ....... False ({why})"


def _ops_table(torch):
    """The acco_ds.ops table and the engine's kernel choice; a clear line instead of a crash when
    the ops package (or a part of it) is missing or fails."""
    try:
        from acco_ds import ops
    except Exception as err:  # noqa: BLE001 - report, do not crash
        print(f"  acco_ds.ops unavailable: {type(err).__name__}: {err}")
        return
    if not hasattr(ops, "op_report"):
        print("  acco_ds.ops has no op_report(): ops table unavailable in this build")
    else:
        try:
            rows = ops.op_report()
        except Exception as err:  # noqa: BLE001
            print(f"  op_report() failed: {type(err).__name__}: {err}")
        else:
            print(f"  {'op':<16}{'device':<8}{'compatible':<12}{'AOT built':<11}{'loadable':<10}auto uses")
            for row in rows:
                print(f"  {row.get('op', '?'):<16}{row.get('device', '?'):<8}{str(row.get('compatible')):<12}"
                      f"{str(row.get('aot_built')):<11}{str(row.get('loadable')):<10}{row.get('auto_uses', '?')}"
                      + (f"   ({row['error']})" if row.get("error") else ""))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        name = ops.load_kernels("auto", device).name
    except Exception as err:  # noqa: BLE001
        name = f"unavailable ({type(err).__name__}: {err})"
    print(f"engine kernels ..... {name} (acco.kernels=\"auto\" on {device})")


def internals_line() -> str:
    """Whether the installed DeepSpeed has every internal acco_ds uses (``deepspeed/compat.py``)."""
    try:
        from ..deepspeed import compat
        compat.check_deepspeed()
    except Exception as err:  # noqa: BLE001 - DeepSpeedIncompatible, or a DeepSpeed that fails to import
        return f"DeepSpeed internals  MISSING: {err}"
    return (f"DeepSpeed internals  ok ({len(compat.IMPORTS)} names, {len(compat.METHODS)} methods checked; "
            f"tested with deepspeed{compat.SUPPORTED})")


def config_report(path: str) -> int:
    """What the "acco" block of a DeepSpeed config file sets up: mode, collectives, compression (checked as
    ``initialize`` checks it; a bad block prints the same error)."""
    import json

    from ..config import LocalSGDConfig, parse_acco_config
    from ..runtime.comm.compression import describe
    try:
        with open(path) as f:
            acco = parse_acco_config(json.load(f))
    except (OSError, ValueError) as err:
        print(f"{path}: {err}")
        return 1
    if not acco.enabled:
        print(f"{path}: no enabled \"acco\" block: stock DeepSpeed")
        return 0
    print(f"mode ............... {acco.mode}" + (f" ({acco.accumulation} accumulation)" if not acco.local else ""))
    sparse = acco.mode == "sparseloco"  # its outer step is its own compression
    if acco.local:
        print(f"local_sgd .......... {acco.outer}")
    if sparse:
        ls = acco.local_sgd or LocalSGDConfig()
        print(f"sparse outer ....... top {ls.topk} of every {ls.chunk} elements, "
              f"{f'{ls.value_bits}-bit' if ls.value_bits else 'fp32'} values, error decay {ls.error_decay:g}")
    c = acco.collectives
    print(f"collectives ........ layout {c.layout}, ranks_per_node {c.ranks_per_node or 'auto (launcher)'}")
    what = describe(acco.compression, acco.local and not sparse, decoupled=acco.mode == "decoupled")
    print(f"compression ........ {what}")
    return 0


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "memory":
        from .memory import main as memory
        return memory(args[1:])
    if args and args[0] == "plan":
        from ..plan import main as plan
        return plan(args[1:])
    if args and args[0] == "syncer":  # the syncer of mode "decoupled", for learners launched apart
        from .syncer import main as syncer
        return syncer(args[1:])
    if args and args[0] == "report":
        args = args[1:]
    if len(args) == 2 and args[0] == "--config":
        return config_report(args[1])
    if args:
        print("usage: acco-ds report [--config ds_config.json]  |  acco-ds memory --params 7e9 --gpus 8 --dtype bf16  |  "
              "acco-ds plan --params 7e9 --tokens-per-step 4m --nodes 2 --ranks-per-node 8 --rank-flops 989e12 "
              "--inter-bandwidth 10gbit")
        return 2
    import torch

    import acco_ds
    print("-" * 60)
    print("acco_ds report")
    print("-" * 60)
    print(f"acco_ds ............ {acco_ds.__version__} ({acco_ds.__file__})")
    for pkg in ("torch", "deepspeed", "pydantic", "ninja"):
        print(f"{pkg:.<20} {_version(pkg)}")
    print(f"CUDA available ..... {torch.cuda.is_available()}")
    print(patch_line())  # before anything here imports deepspeed (which the startup hook would patch)
    print(internals_line())
    try:
        for line in autopatch_lines():
            print(line)
    except Exception as err:  # noqa: BLE001
        print(f"startup hook ....... unknown ({type(err).__name__}: {err})")
    print("\nnative ops (building them if needed):")
    _ops_table(torch)
    print("\nDeepSpeed environment (ds_report):")
    sys.stdout.flush()
    try:
        from ..deepspeed.compat import env_report as ds_report
        ds_report(hide_operator_status=True)
    except Exception as err:  # noqa: BLE001
        print(f"ds_report failed: {type(err).__name__}: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
