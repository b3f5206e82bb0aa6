"""Run an unmodified DeepSpeed training script with ACCO.

    python -m acco_ds.cli.run script.py [args...]
    python -m acco_ds.cli.run -m package.module [args...]
    acco-ds-run script.py [args...]

The runner calls ``acco_ds.patch()`` and then runs the script as ``__main__``:
its ``deepspeed.initialize`` calls build the ACCO engine wherever the DeepSpeed
config has ``"acco": {"enabled": true}``, and stock DeepSpeed otherwise.
Under a launcher::

    deepspeed --module acco_ds.cli.run train.py --deepspeed_config ds.json
    deepspeed --no_python acco-ds-run train.py --deepspeed_config ds.json
    torchrun --nproc_per_node 2 -m acco_ds.cli.run train.py ...
    accelerate launch -m acco_ds.cli.run train.py ...

The DeepSpeed launcher puts ``--local_rank=N`` before the script path; the
runner moves it after the script path, where the script's argument parser
expects it, and sets ``LOCAL_RANK`` if it is missing.
"""

import importlib.util
import os
import runpy
import sys

USAGE = "usage: python -m acco_ds.cli.run [--local_rank=N] (script.py | -m module) [args...]"


def split_argv(argv):
    """``(local_rank_args, target, is_module, script_args)`` from the runner's argv."""
    argv = list(argv)
    local_rank = []
    while argv and argv[0].startswith("--local_rank"):
        opt = argv.pop(0)
        if opt == "--local_rank":
            if not argv:
                raise SystemExit(f"acco_ds.cli.run: --local_rank needs a value\n{USAGE}")
            opt = f"--local_rank={argv.pop(0)}"
        local_rank.append(opt)
    if not argv:
        raise SystemExit(f"acco_ds.cli.run: no script given\n{USAGE}")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit(f"acco_ds.cli.run: -m needs a module name\n{USAGE}")
        return local_rank, argv[1], True, argv[2:]
    if argv[0].startswith("-"):
        raise SystemExit(f"acco_ds.cli.run: unknown option {argv[0]!r} before the script\n{USAGE}")
    return local_rank, argv[0], False, argv[1:]


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    local_rank, target, is_module, script_args = split_argv(args)
    if local_rank:
        os.environ.setdefault("LOCAL_RANK", local_rank[-1].split("=", 1)[1])
    if not is_module and not os.path.exists(target):
        raise SystemExit(f"acco_ds.cli.run: script {target!r} not found\n{USAGE}")

    import acco_ds
    acco_ds.patch()
    sys.argv = [target] + local_rank + list(script_args)
    if is_module:
        # As `python -m`: the working directory is importable, also when the runner itself was
        # started as a console script (`deepspeed --no_python acco-ds-run -m pkg.train`).
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            spec = importlib.util.find_spec(target)
        except (ImportError, ValueError) as err:
            spec, why = None, f" ({err})"
        else:
            why = ""
        if spec is None:
            raise SystemExit(f"acco_ds.cli.run: module {target!r} not found{why}\n{USAGE}")
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        # As `python script.py`: the script's directory comes first on sys.path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
