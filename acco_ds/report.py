"""``python -m acco_ds.report`` (or ``acco-ds report``): what acco_ds will use here.

Versions, whether ``acco_ds.patch()`` is active in this process, the native
ops (compatible, built ahead of time, loadable, what ``kernels="auto"``
picks), then DeepSpeed's own environment report (``ds_report``).
"""

import importlib.metadata
import sys


def _version(pkg):
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "report":
        args = args[1:]
    if args:
        print("usage: acco-ds report  |  python -m acco_ds.report")
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
    print(f"patch active ....... {acco_ds.is_patched()} (acco_ds.patch() in this process)")
    print("\nnative ops (building them if needed):")
    from acco_ds import ops
    print(f"  {'op':<16}{'device':<8}{'compatible':<12}{'AOT built':<11}{'loadable':<10}auto uses")
    for row in ops.op_report():
        print(f"  {row['op']:<16}{row['device']:<8}{str(row['compatible']):<12}{str(row['aot_built']):<11}"
              f"{str(row['loadable']):<10}{row['auto_uses']}" + (f"   ({row['error']})" if "error" in row else ""))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"engine kernels ..... {ops.load_kernels('auto', device).name} (acco.kernels=\"auto\" on {device})")
    print("\nDeepSpeed environment (ds_report):")
    sys.stdout.flush()
    from deepspeed.env_report import main as ds_report
    ds_report(hide_operator_status=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
