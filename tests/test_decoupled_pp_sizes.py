"""Decoupled learners of different pipeline sizes on one syncer: group g of the unsplit model is every stage's group g
in stage order (``decoupled/canonical.py``), so a learner of two stages maps onto the model a one-stage
``PipelineModule`` of the same layers holds. A learner of pipeline size 2 (2 ranks) and one of pipeline size 1 (1 rank)
with K = 2 and ``grace_s`` 0 are DiLoCo weighed by tokens: the float64 simulator of two one-rank learners of the
unsplit model gives θ_g after every merge. Stages with a weight tied across them, or with different numbers of
groups, do not map: their learner keeps its per-stage name and is refused with both named."""

import math

import pytest
import torch

import common
from acco_ds.config.decoupled import shape_refusal
from acco_ds.runtime.outer.decoupled import wire
from acco_ds.runtime.outer.decoupled.canonical import (TPRelayout, canonical_model, canonical_name, rank_runs,
                                                       split_params, stage_model)
from acco_ds.runtime.outer.decoupled.layout import Parts, part_width
from acco_ds.runtime.outer.decoupled.syncer import Shard
from test_decoupled_sizes import H, STEPS, assert_syncer_holds, reference, run_fleet
from test_decoupled_tp_sizes import flat_params, threaded_round_trip
from test_decoupled_shapes import say_hello
from test_decoupled_wire import KEYS, SETTINGS, serve
from test_engine import assert_matches

# TPNet's unsplit layers cut into two stages, each split over 2 tensor-parallel ranks (b2 replicated)
STAGES = [[((8, 7), 0), ((8,), 0)], [((3, 8), 1), ((3,), None)]]
WHOLE = [((16, 7), None), ((16,), None), ((3, 16), None), ((3,), None)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_learners_of_pipeline_sizes_two_and_one_share_a_syncer_and_are_diloco_by_tokens(tmp_path):
    shards = 2
    out, state = run_fleet(tmp_path, shards, [(2, 0, {"pipe": 2}), (1, 1, {"pipe": 1})])
    versions = reference(common.make_model(0), [1, 1])
    committed = [versions[s // H] for s in range(1, STEPS + 1)]
    stages = sorted((out[0][r][0] for r in range(2)), key=lambda r: r["layout"]["stage"])
    one = out[1][0][0]
    for r in (*stages, one):
        assert r["global_steps"] == STEPS and r["stats"]["merges"] == STEPS // H, r["stats"]
    assert [r["layout"]["stage"] for r in stages] == [0, 1]
    assert_matches([torch.cat([r["committed"][s] for r in stages]) for s in range(STEPS)], committed)
    assert_matches(one["committed"], committed)
    assert [r["stats"]["syncer_shards"] for r in (*stages, one)] == [[0], [1], [0, 1]]
    assert_syncer_holds(state, versions, shards)


def stage_layouts(k):
    """Per model-parallel position m = stage * 2 + t of a tp 2 x pp 2 x dp k learner: ``(specs, mine, shift)``,
    and the unsplit model's group sizes and shapes."""
    specs = [split_params(flat_params(layers), 2)[0] for layers in STAGES]
    sizes, shapes, shifts, why = stage_model(specs, 2)
    assert why == ""
    layouts = []
    for st, spec in enumerate(specs):
        local = sum(math.prod(shape) for _, shape, _ in spec[0])
        layouts += [(spec, Parts((local,), (part_width(local, k),), k), shifts[st])] * 2
    return layouts, sizes, shapes


def test_pipeline_stages_map_onto_the_unsplit_model_once_each():
    """Every element of the unsplit model is in the Δ runs of exactly one rank of a tp 2 x pp 2 x dp 2 learner (the
    replicated bias of the last stage from tensor-parallel rank 0) and in the θ_g runs of one rank per copy; the
    name equals a one-stage learner's; runs, not elements."""
    k = 2
    layouts, sizes, shapes = stage_layouts(k)
    assert sizes == [16 * 7 + 16 + 48 + 3] and shapes == [[(16, 7), (16,), (3, 16), (3,)]]
    assert canonical_name(sizes, shapes) == canonical_name(*canonical_model(split_params(flat_params(WHOLE), 1)[0], 1))
    syncer = Parts.syncer(sizes, 3)
    delta, theta = torch.zeros(sizes[0], dtype=torch.int64), torch.zeros(sizes[0], dtype=torch.int64)
    for m, (specs, mine, shift) in enumerate(layouts):
        for j in range(k):
            runs = rank_runs(specs, 2, m % 2, j, mine, syncer, shift)
            assert len(runs) < 12
            for _, i, po, n, c, st, rep in runs:  # c rows of n elements, st apart in the part
                at = i * syncer.widths[0] + po
                theta.as_strided((c, n), (st, 1), at).add_(1)
                if not (rep and m % 2):
                    delta.as_strided((c, n), (st, 1), at).add_(1)
    assert torch.equal(delta, torch.ones_like(delta))
    assert torch.equal(theta, torch.cat([torch.ones(sizes[0] - 3, dtype=torch.int64), torch.full((3,), 2)]))


def stage_slice(full, m):
    """Position m's (stage m // 2, tensor-parallel rank m % 2) flat parameters of the unsplit flat ``full``."""
    w1, b1, w2, b2 = torch.split(full, [16 * 7, 16, 48, 3])
    rows = slice((m % 2) * 8, (m % 2 + 1) * 8)
    if m < 2:
        return torch.cat([w1.view(16, 7)[rows].reshape(-1), b1[rows]])
    return torch.cat([w2.view(3, 16)[:, rows].reshape(-1), b2])


def test_a_tp2_pp2_learner_moves_its_stages_into_the_parts_of_the_unsplit_model_and_back(monkeypatch):
    """Four ranks (threads over a stand-in all-to-all), one per position: Δ in the syncer's 3 parts is the unsplit
    model end to end (the replicated bias from tensor-parallel rank 0 of the last stage), θ_g comes back as each
    rank's partition."""
    k, world = 1, 4
    layouts, sizes, _ = stage_layouts(k)
    syncer, full = Parts.syncer(sizes, 3), torch.randn(sizes[0])
    rank_of = [0, 1, 2, 3]
    relayouts = [TPRelayout(None, 2, k, s, layouts[s][1], syncer, None, rank_of, layouts=layouts)
                 for s in range(world)]
    assert [r.owned for r in relayouts] == [[0], [1], [2], []]
    partitions, sent = [], []
    for m in range(world):
        flat = torch.zeros(layouts[m][1].numel)
        piece = stage_slice(full, m)
        flat[:piece.numel()] = piece
        partitions.append(flat.clone())
        if m == 3:
            flat[piece.numel() - 3:piece.numel()] = -1.0  # b2 leaves from tensor-parallel rank 0 only
        sent.append(flat)
    out = threaded_round_trip(relayouts, sent, rank_of, monkeypatch)
    parts = {i: p for s in range(world) for i, p in zip(relayouts[s].owned, out[s][0])}
    assert torch.equal(torch.cat([parts[i] for i in range(3)])[:full.numel()], full)
    for s in range(world):
        assert torch.equal(out[s][1], partitions[s]), s


def test_stages_that_cannot_be_concatenated_are_named_and_refused(tmp_path):
    """A tied weight's later copy (DeepSpeed marks it ``ds_pipe_replicated``) and stages with different numbers of
    groups do not map; the learner keeps its per-stage name and a syncer of the unsplit model refuses it, naming
    both and why a tied weight cannot be mapped."""
    tied = flat_params([((8, 8), None)])
    tied[0][0][0].ds_pipe_replicated = True
    assert split_params(tied, 1) == (None, "parameter 0 of group 0 (shape [8, 8]) is a copy of a weight tied across "
                                           "pipeline stages (DeepSpeed's TiedLayerSpec): the stages hold it twice, "
                                           "the unsplit model once")
    one, two = split_params(flat_params(WHOLE), 1)[0], split_params(flat_params(WHOLE) * 2, 1)[0]
    assert stage_model([one, two], 1)[3] == ("its pipeline stages have [1, 2] parameter groups: group g of the "
                                             "unsplit model is every stage's group g, so every stage needs the same "
                                             "groups")
    first = canonical_name(*canonical_model(one, 1))
    per_stage = "dp0.tp1.pp2.ep1.n72.g0a1b2c3d"
    shard, thread = serve(Shard(0, "127.0.0.1", 0, SETTINGS, min_quorum=2, grace_s=0.0, state_dir=str(tmp_path),
                                keys=KEYS, say=lambda _: None))

    def hello(learner, layout):
        return say_hello(shard.port, learner, layout)
    try:
        assert hello(0, first) == wire.NO_VERSION
        with pytest.raises(wire.Refused) as err:
            hello(1, per_stage)
    finally:
        shard.stop()
        thread.join(5)
    words = str(err.value)
    assert words.endswith(shape_refusal(1, per_stage, first, 0))
    assert "learner 1 runs as any number of data-parallel ranks x tensor parallel 1 x pipeline 2" in words
    assert "but learner 0 as any number of data-parallel ranks x any tensor-parallel and pipeline size" in words
    assert "A weight tied across pipeline stages (tied embeddings) is on two stages and cannot be mapped" in words
