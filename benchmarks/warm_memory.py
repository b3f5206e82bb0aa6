"""The memory of ``acco-ds-warm``'s idle parent beside its rank, against a fresh process after the same imports.

    python benchmarks/warm_memory.py        # about 15 s; writes benchmarks/results/warm_memory.{md,json}

An ``acco-ds-warm`` launch of one rank that sleeps; once the rank runs, psutil's ``memory_full_info`` of the
parent and the rank: RSS, and USS (the pages a process alone holds: what would be freed if it exited). Then a
fresh ``python -c "import torch, deepspeed, acco_ds, torchft"`` measured the same way.
"""

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
IMPORTS = "import torch, deepspeed, acco_ds, torchft"


def mib(process) -> dict:
    m = process.memory_full_info()
    return {"rss_mib": round(m.rss / 2**20, 1), "uss_mib": round(m.uss / 2**20, 1)}


def main() -> int:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "idle.py"
        script.write_text("import time\nprint('ready', flush=True)\ntime.sleep(5)\n")
        launch = subprocess.Popen([sys.executable, "-m", "acco_ds.cli.warm", str(script)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env)
        assert launch.stdout.readline().strip() == "ready"
        time.sleep(1)
        parent = psutil.Process(launch.pid)
        rows = {"acco-ds-warm parent (idle)": mib(parent), "its rank (forked, idle)": mib(parent.children()[0])}
        launch.wait(timeout=60)
    code = f"{IMPORTS}, psutil; m = psutil.Process().memory_full_info(); print(m.rss, m.uss)"
    rss, uss = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                       check=True, timeout=300).stdout.split())
    rows[f"a fresh process after `{IMPORTS}`"] = {"rss_mib": round(rss / 2**20, 1), "uss_mib": round(uss / 2**20, 1)}
    import torch
    meta = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}, "
            f"torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}")
    table = "| process | RSS MiB | USS MiB (its own pages) |\n|---|---|---|\n" + "".join(
        f"| {name} | {r['rss_mib']} | {r['uss_mib']} |\n" for name, r in rows.items())
    print(meta + "\n\n" + table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "warm_memory.md").write_text(meta + "\n\n" + table)
    (RESULTS / "warm_memory.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
