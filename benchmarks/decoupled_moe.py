"""The mixture-of-experts case of ``decoupled_race.py``: the MoE GPT of ``moe_race.py`` as 3 learners of one rank.

Every block's MLP is DeepSpeed's ``MoE`` of ``moe_race.EXPERTS`` (8) copies of it, top-2, the loss adding
``moe_race.L_AUX`` x the gates' load-balancing loss in training (validation reads the cross-entropy alone), as in
``moe_race.py``; here ``ep_size`` is 1: each learner is one rank and holds all 8 experts of every block (expert
parallelism lives inside a learner, and 3 learners of 2 ranks would be 6 ranks on 2 cores). Rank 2 is slowed 3x as
in the dense rows. Rows: stock ZeRO-1 (its final validation loss is the target), diloco (a barrier at every sync),
A-EDiT (syncs on wall time), decoupled K = 1 with Delayed Nesterov, and decoupled K = 1 with no slow rank (the fast
learners' rate when nobody is slowed).

Run as a rank (the launcher passes ``--local_rank``), this file trains ``decoupled_worker.py``'s loop on the MoE GPT.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "decoupled_worker.py"
EP = 1  # ep_size inside a learner of one rank


def rank_main():
    """One rank: ``decoupled_worker.main`` with the MoE GPT (ep_size ``EP``) and named parameter groups."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
    import decoupled_worker
    import moe_race
    moe_race.EP = EP
    groups = decoupled_worker.param_groups

    def named_groups(model, weight_decay):  # DeepSpeed splits named groups into dense and expert groups
        return [dict(g, name=f"group{i}") for i, g in enumerate(groups(model, weight_decay))]

    decoupled_worker.GPT, decoupled_worker.param_groups = moe_race.moe_gpt, named_groups
    decoupled_worker.main()


def model_words(n_layer, n_embd, block):
    """The MoE GPT in numbers, built here without process groups (DeepSpeed makes them at initialize)."""
    sys.path[:0] = [str(HERE), str(HERE.parent / "examples")]
    import moe_race
    moe_race.EP = EP
    model = moe_race.moe_gpt(n_layer, 4, n_embd, block)
    experts = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
    dense = sum(p.numel() for p in model.parameters()) - experts
    active = dense + experts * moe_race.TOP_K // moe_race.EXPERTS
    return (f"MoE GPT {n_layer} layers x {n_embd}, {(dense + experts) / 1e6:.2f}M parameters ({dense:,} dense, "
            f"{experts:,} in {n_layer} x {moe_race.EXPERTS} experts, top-{moe_race.TOP_K}: {active:,} active per "
            f"token), ep_size {EP} (each learner holds every expert)")


def plan(config, dec, args):
    """(label, DeepSpeed config, worker flags) of each MoE row; ``config`` and ``dec`` as in decoupled_race.py."""
    H = args.sync_every
    steps, seconds = ["--steps", str(args.moe_steps)], ["--seconds", str(args.moe_seconds)]
    edit = {"mode": "edit", "local_sgd": {"sync_time_s": args.moe_sync_time_s, "replica_group_size": 1}}
    return [
        ("MoE stock ZeRO-1 (slow rank 2 x3)", config(None), ["--steps", str(args.moe_stock_steps)]),
        ("MoE diloco (slow rank 2 x3)", config({"mode": "diloco", "local_sgd": {"sync_every": H,
                                                                               "replica_group_size": 1}}), steps),
        ("MoE A-EDiT (slow rank 2 x3)", config(edit), ["--syncs", str(args.moe_syncs)]),
        ("MoE decoupled K=1 (slow rank 2 x3)", config(dec), seconds),
        ("MoE decoupled K=1 (no slow rank)", config(dec, slow=False), seconds),
    ]


if __name__ == "__main__":
    rank_main()
