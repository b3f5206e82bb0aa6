"""Decoupled learners of different sizes on one syncer (``acco-ds syncer --shards S``): a learner of 2 ranks and a
learner of 1 rank, each its own launch. The syncer holds the model cut into S parts (``decoupled/layout.py``);
each learner moves its pieces into those parts inside itself. With K = 2 learners and ``grace_s`` 0 this is
DiLoCo with each learner's pseudo-gradient weighed by its tokens: the float64 simulator of learners of 2 and 1
ranks (2 and 1 tokens per inner step) gives θ_g after every merge, which every rank reads after every step and
the shards hold at the end. S = 3: no learner has the syncer's size (the 2-rank learner's rank 0 holds parts 0
and 2); S = 1: the 2-rank learner's rank 1 holds no link at all."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import common
from acco_ds.runtime.outer.decoupled.layout import part_width
from acco_ds.testing.decoupled import simulate_decoupled
from dist import ROOT, free_port, launch
from test_engine import assert_matches

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

GAS, STEPS, H = 2, 4, 2
OUTER = dict(outer_lr=0.7, outer_momentum=0.9, nesterov=True)


def learner_config(port, state_dir, tokens_per_step):  # learner 0: 2 tokens per inner step, learner 1: 1
    acco = {"mode": "decoupled", "local_sgd": {"sync_every": H, "min_quorum": 2, "grace_s": 0,
                                               "tokens_per_step": tokens_per_step,
                                               "syncer": {"address": f"127.0.0.1:{port}", "timeout_s": 60,
                                                          "state_dir": str(state_dir)}}}
    return common.ds_config(acco=acco, gas=GAS)


def run_fleet(tmp_path, shards, learners):
    """``acco-ds syncer --shards shards --learners 2`` and one launch per learner (``learners``: its ``(world size,
    data rank offset, run extras)``, learner ids 0 and 1); every launch's results and the syncer's state_dir."""
    port, state = free_port(), tmp_path / "syncer"
    configs = [learner_config(port, state, tps) for tps in (2, 1)]
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(configs[0]))
    cmd = [sys.executable, "-m", "acco_ds.cli.report", "syncer", "--config", str(path), "--shards", str(shards),
           "--port", str(port), "--state-dir", str(state), "--learners", str(len(learners))]
    log = open(tmp_path / "syncer.log", "w")
    syncer = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    out = {}

    def learner(i, world, offset, extra):
        run = dict(config=configs[i], steps=STEPS, record_committed=True, env={"ACCO_LEARNER_ID": str(i)},
                   data_rank_offset=offset, **extra)
        out[i] = launch({"runs": [run]}, world_size=world, timeout=200, workdir=tmp_path / f"learner{i}")

    threads = [threading.Thread(target=learner, args=(i, *args)) for i, args in enumerate(learners)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert syncer.wait(30) == 0, (tmp_path / "syncer.log").read_text()  # --learners: it stops once all are done
    finally:
        if syncer.poll() is None:
            os.killpg(syncer.pid, 9)
            syncer.wait(10)
        log.close()
    return out, state


def reference(model, group_size):
    return simulate_decoupled(model, common.loss_fn, common.micro_batch, learners=2, group_size=group_size,
                              gradient_accumulation_steps=GAS, sync_every=H, periods=STEPS // H,
                              optimizer_fn=common.reference_optimizer("AdamW"), min_quorum=2, grace_s=0.0,
                              tokens_per_step=[2, 1], **OUTER)["versions"]


def assert_syncer_holds(state, versions, shards):
    """Both learners in every merge, weighed 2 : 1 by tokens; the shards' parts end to end, less the padding, are
    the last θ_g (one parameter group)."""
    log_ = [json.loads(line) for line in (state / "merges.jsonl").read_text().splitlines()]
    assert [sorted(rec["learners"]) for rec in log_] == [[0, 1]] * (STEPS // H)
    assert [sorted(c["tokens"] for c in rec["contributions"]) for rec in log_] == [[H, 2 * H]] * (STEPS // H)
    numel = versions[0].numel()
    theta = [torch.load(state / f"shard{j}.pt", weights_only=True)["x"] for j in range(shards)]
    assert [t.numel() for t in theta] == [part_width(numel, shards)] * shards
    torch.testing.assert_close(torch.cat(theta)[:numel].double(), versions[STEPS // H], rtol=1e-5, atol=1e-6)
    assert not torch.equal(versions[1], versions[2]), "θ_g moves at every merge"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shards", [3, 1])
def test_learners_of_two_and_one_ranks_share_a_syncer_and_are_diloco_by_tokens(tmp_path, shards):
    out, state = run_fleet(tmp_path, shards, [(2, 0, {}), (1, 2, {})])
    versions = reference(common.make_model(0), [2, 1])
    committed = [versions[s // H] for s in range(1, STEPS + 1)]
    ranks = [(out[0], 0), (out[0], 1), (out[1], 0)]
    for results, rank in ranks:
        r = results[rank][0]
        assert r["global_steps"] == STEPS and r["stats"]["merges"] == STEPS // H, r["stats"]
        assert_matches(r["committed"], committed)
        assert_matches([r["params"][-1]], [versions[STEPS // H]])
    links = [out[0][0][0]["stats"]["syncer_shards"], out[0][1][0]["stats"]["syncer_shards"],
             out[1][0][0]["stats"]["syncer_shards"]]
    assert links == ([[0, 2], [1], [0, 1, 2]] if shards == 3 else [[0], [], [0]])
    assert_syncer_holds(state, versions, shards)
