"""Goodput at scale under failures: data-parallel, elastic data-parallel, acco_ds's synchronous torchft quorum and
decoupled learners (``"mode": "decoupled"``), from a closed-form model, next to Decoupled DiLoCo's figures (arXiv
2604.21428: 27% data-parallel, 58% elastic data-parallel, 88% decoupled with M = 8 learners at 1.2M chips, per-chip
mean time between interruptions 1 year).

Goodput is the share of chip-seconds that ends in a committed model. Failures are Poisson: N chips of MTBI ``T``
interrupt the fleet at rate λ = N / T (every 26 s at 1.2M chips). A failure takes its *slice* (S chips, the unit a
scheduler replaces) out. What each method loses per failure (assumptions, all stated in the output):

* data-parallel (one synchronous job): every chip stops, the job restarts from its last checkpoint:
  ``D = R_job + C/2`` lost by all N chips. ``G = 1 / (1 + λ D)``.
* elastic data-parallel: every chip pauses ``P`` while the job re-forms without the slice, and again when the
  repaired slice rejoins; the slice is out for ``R_slice``, a fraction ``d = S R_slice / T`` of the chips on
  average. ``G = (1 − d) / (1 + 2 λ P)``.
* synchronous quorum (acco_ds's ``fault_tolerance``: M replicas, one launch each; a failure ends its replica):
  the survivors wait ``Q`` (the heartbeat timeout) at their next quorum; the failed replica's N/M chips lose
  ``R_learner`` (relaunch) plus the half period in progress ``H/2``, plus, without ``join: "early"``, half a
  period waiting for the next quorum to heal. ``G = 1 − λ (Q + (R_learner + H) / M)``.
* decoupled, whole-learner restart (what ``"mode": "decoupled"`` does: a failure ends its learner, a
  relaunched learner takes θ_g and trains at once, no one else waits): ``G = 1 − λ (R_learner + H/2) / M``.
* decoupled, learners elastic inside (the paper's setting: a learner re-forms without the slice like elastic
  data-parallel, only its own N/M chips pause): ``G = (1 − d) / (1 + 2 λ P / M)``.

Two constants are fitted to the paper's synchronous baselines at 1.2M chips: ``D`` = 70 s (data-parallel 27%)
and ``P`` = 9 s (elastic 58%); the decoupled figures are then predictions of the same model, not fits. A
goodput below 0 means the method never completes a step at that scale (printed as 0).

    python benchmarks/decoupled_goodput.py            # table, benchmarks/results/decoupled_goodput.{json,md}
"""

import argparse
import json
import platform
import time
from pathlib import Path

YEAR_S = 365 * 24 * 3600.0
PAPER = {"data-parallel": 0.27, "elastic data-parallel": 0.58, "decoupled (elastic learners)": 0.88}

DEFAULTS = dict(mtbi_s=YEAR_S, slice_chips=256, r_job_s=40.0, checkpoint_s=60.0, pause_s=9.0, r_slice_s=3600.0,
                quorum_s=2.1, r_learner_s=40.0, period_s=60.0)


def goodputs(N: int, M: int, p: dict) -> dict:
    lam = N / p["mtbi_s"]
    d = p["slice_chips"] * p["r_slice_s"] / p["mtbi_s"]
    D = p["r_job_s"] + p["checkpoint_s"] / 2
    out = {
        "data-parallel": 1.0 / (1.0 + lam * D),
        "elastic data-parallel": (1.0 - d) / (1.0 + 2.0 * lam * p["pause_s"]),
        "synchronous quorum (torchft)": 1.0 - lam * (p["quorum_s"] + (p["r_learner_s"] + p["period_s"]) / M),
        "decoupled (learner restarts)": 1.0 - lam * (p["r_learner_s"] + p["period_s"] / 2) / M,
        "decoupled (elastic learners)": (1.0 - d) / (1.0 + 2.0 * lam * p["pause_s"] / M),
    }
    return {k: max(0.0, v) for k, v in out.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "decoupled_goodput"))
    for key, value in DEFAULTS.items():
        ap.add_argument("--" + key.replace("_", "-"), type=float, default=value)
    args = ap.parse_args(argv)
    p = {k: getattr(args, k) for k in DEFAULTS}
    chips = [150_000, 300_000, 600_000, 1_200_000, 2_400_000]
    rows = [{"chips": n, "learners": args.learners, **goodputs(n, args.learners, p)} for n in chips]
    sweep = [{"chips": 1_200_000, "learners": m, **goodputs(1_200_000, m, p)} for m in (1, 2, 4, 8, 16, 32)]
    methods = list(goodputs(1, 1, p))

    def table(rs, key):
        head = f"| {key} | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods) + "\n"
        return head + "".join(f"| {r[key]:,} | " + " | ".join(f"{100 * r[m]:.1f}%" for m in methods) + " |\n"
                              for r in rs)

    at = next(r for r in rows if r["chips"] == 1_200_000)
    vs = "\n".join(f"- {m}: model {100 * at[m]:.1f}%, paper {100 * PAPER[m]:.0f}%"
                   + (" (fitted)" if m != "decoupled (elastic learners)" else " (predicted)") for m in PAPER)
    assumptions = ", ".join(f"{k} = {v:g}" for k, v in p.items())
    md = (f"# Goodput at scale under failures (model)\n\nCommand: `python benchmarks/decoupled_goodput.py` "
          f"({time.strftime('%Y-%m-%d %H:%M')}, Python {platform.python_version()}). A closed-form model, not a run: "
          f"see the script's docstring for each formula. Assumptions: {assumptions} (seconds and chips; mtbi_s is one "
          f"year per chip).\n\n## M = {args.learners} learners, 150k to 2.4M chips\n\n{table(rows, 'chips')}\n"
          f"## 1.2M chips, M learners\n\n{table(sweep, 'learners')}\n## Against the paper (1.2M chips, M = 8)\n\n"
          f"{vs}\n\nThe two synchronous baselines fix the loss per failure of a whole-job restart "
          f"({p['r_job_s'] + p['checkpoint_s'] / 2:g} s) and of an elastic re-formation ({p['pause_s']:g} s); with the same constants, learners that pause only themselves give the "
          f"decoupled figure. acco_ds's decoupled learners restart whole (a failure ends its launch), which "
          f"the model puts lower at this failure rate: a learner of 150k chips is interrupted every "
          f"{p['mtbi_s'] / 150_000:.0f} s.\n")
    print(md)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"assumptions": p, "paper": PAPER, "by_chips": rows,
                                                    "by_learners": sweep}, indent=1))
    out.with_suffix(".md").write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
