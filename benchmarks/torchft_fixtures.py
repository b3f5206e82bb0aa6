"""Reproduce torchft's Streaming DiLoCo regression fixtures with acco_ds's float64 simulator.

    python benchmarks/torchft_fixtures.py /path/to/torchft    # a checkout or a bare git directory

torchft (github.com/pytorch/torchft) records, in
``test_fixtures/torchft.diloco_regression_test.DiLoCoMockedUpdateTest.test_diloco_mocked_updates_{0..5}.json``,
every parameter of two replicas for 16 inner steps of a mocked run: a model of two one-scalar layers (each
its own fragment, F = 2), starting at 1, a fixed gradient 2, inner SGD with lr 1, outer SGD with lr 2 and no
momentum, ``sync_every`` 6, and (τ, α) = (0, 0), (0, 0.5), (0, 1), (1, 0), (1, 0.5), (1, 1). This script runs
``acco_ds.testing.simulator.simulate_local_sgd`` on the same setup and compares each recorded step (the
replicas' values and the fragments' global values) exactly. The fixtures are read from the given
directory (``git show`` for a bare repository) and never copied into this repository. Results go to
benchmarks/results/torchft_fixtures.json.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from acco_ds.testing.simulator import simulate_local_sgd  # noqa: E402

CASES = [(0, 0.0), (0, 0.5), (0, 1.0), (1, 0.0), (1, 0.5), (1, 1.0)]  # (fragment_sync_delay, alpha), fixtures 0..5
FIXTURE = "test_fixtures/torchft.diloco_regression_test.DiLoCoMockedUpdateTest.test_diloco_mocked_updates_{}.json"


def read_fixture(repo: Path, i: int):
    path = FIXTURE.format(i)
    if (repo / path).is_file():
        return json.loads((repo / path).read_text())
    text = subprocess.run(["git", f"--git-dir={repo}", "show", f"HEAD:{path}"], capture_output=True, text=True,
                          check=True).stdout
    return json.loads(text)


class TwoScalars(nn.Module):
    """Two one-scalar layers (layers.0.weight, layers.1.weight), both starting at 1."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(1, 1, bias=False) for _ in range(2)])
        for layer in self.layers:
            nn.init.ones_(layer.weight)


def fixed_gradient(model, batch):
    """A loss whose gradient is 2 for every parameter, whatever the batch."""
    return 2 * sum(p.sum() for p in model.parameters())


def simulate(delay: int, alpha: float, steps: int = 15) -> dict:
    return simulate_local_sgd("diloco", TwoScalars(), fixed_gradient, lambda rank, i: None, world_size=2,
                              group_size=1, gradient_accumulation_steps=1, steps=steps, sync_every=6,
                              optimizer_fn=lambda m: torch.optim.SGD(m.parameters(), lr=1.0), outer_lr=2.0,
                              outer_momentum=0.0, nesterov=False, fragments=2, fragment_sync_delay=delay,
                              fragment_update_alpha=alpha)


def compare(fixture, sim) -> list:
    """Every mismatch between a fixture (per replica: history, global_parameter_history) and the simulation."""
    bad = []
    for r, replica in enumerate(fixture):
        record = replica[0]
        for step, params in record["history"].items():
            t = int(step)
            want = [params["layers.0.weight"][0][0], params["layers.1.weight"][0][0]]
            got = [1.0, 1.0] if t == 0 else sim["replicas"][r][t - 1].tolist()
            if got != want:
                bad.append(f"replica {r} step {t}: torchft {want}, simulator {got}")
        for step, params in record["global_parameter_history"].items():
            t = int(step)
            want = [params["layers.0.weight"][0][0], params["layers.1.weight"][0][0]]
            got = [1.0, 1.0] if t == 0 else sim["anchor"][t - 1].tolist()
            if got != want:
                bad.append(f"replica {r} global values at step {t}: torchft {want}, simulator {got}")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("torchft", type=Path, help="torchft checkout or bare git directory")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "torchft_fixtures.json"))
    args = p.parse_args()
    rows = []
    for i, (delay, alpha) in enumerate(CASES):
        fixture = read_fixture(args.torchft, i)
        steps = len(fixture[0][0]["history"]) - 1
        bad = compare(fixture, simulate(delay, alpha, steps))
        checked = sum(len(rep[0]["history"]) + len(rep[0]["global_parameter_history"]) for rep in fixture)
        rows.append({"fixture": i, "fragment_sync_delay": delay, "fragment_update_alpha": alpha,
                     "values_checked": 2 * checked, "mismatches": bad})
        print(f"test_diloco_mocked_updates_{i} (τ={delay}, α={alpha:g}): "
              f"{'MATCH' if not bad else 'DIFFERS'} ({2 * checked} values, {steps} steps, 2 replicas)")
        for line in bad[:5]:
            print("   ", line)
    Path(args.out).write_text(json.dumps({"command": f"python benchmarks/torchft_fixtures.py {args.torchft}",
                                          "rows": rows}, indent=1))
    return 0 if all(not r["mismatches"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
