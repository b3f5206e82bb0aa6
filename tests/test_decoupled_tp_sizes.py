"""Decoupled learners of different tensor-parallel sizes on one syncer: the syncer cuts the unsplit model
(``decoupled/canonical.py``); a tensor-parallel learner whose split parameters carry Megatron's attributes moves its
slices into those parts over its whole world. A learner of tensor-parallel size 2 (``tp.TPNet`` on 2 ranks) and one
of size 1 (the same net unsplit, 1 rank) with K = 2 and ``grace_s`` 0 are DiLoCo weighed by tokens: the float64
simulator of two one-rank learners of the unsplit model gives θ_g after every merge. Learners whose unsplit models
differ are refused in words that name both; so is a parameter that cannot be mapped."""

import threading

import pytest
import torch

import tp
from acco_ds.config.decoupled import shape_refusal
from acco_ds.runtime.outer.decoupled import wire
from acco_ds.runtime.outer.decoupled import canonical
from acco_ds.runtime.outer.decoupled.canonical import (TPRelayout, canonical_model, canonical_name, rank_runs,
                                                       split_params)
from acco_ds.runtime.outer.decoupled.connect import Connect
from acco_ds.runtime.outer.decoupled.layout import Parts, part_width
from acco_ds.runtime.outer.decoupled.syncer import Shard
from test_decoupled_sizes import H, STEPS, assert_syncer_holds, reference, run_fleet
from test_decoupled_shapes import say_hello
from test_decoupled_wire import KEYS, SETTINGS, serve
from test_engine import assert_matches


def megatron(shape, dim=None, stride=1):
    """A parameter as Megatron's layers leave it (``dim`` None: replicated over the tensor-parallel group)."""
    p = torch.nn.Parameter(torch.zeros(shape))
    if dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


def flat_params(shapes_dims):
    """``Shards.params`` of one group: the parameters end to end."""
    out, at = [], 0
    for shape, dim in shapes_dims:
        p = megatron(shape, dim)
        out.append((p, at))
        at += p.numel()
    return [out]


def name(params, tp_size):
    specs, why = split_params(params, tp_size)
    assert why == ""
    return canonical_name(*canonical_model(specs, tp_size))


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_learners_of_tensor_parallel_sizes_two_and_one_share_a_syncer_and_are_diloco_by_tokens(tmp_path):
    shards = 2
    out, state = run_fleet(tmp_path, shards, [(2, 0, {"tp": 2}), (1, 1, {"tp": 1})])
    versions = reference(tp.make_full(0), [1, 1])
    committed = [versions[s // H] for s in range(1, STEPS + 1)]
    two, one = [out[0][r][0] for r in range(2)], out[1][0][0]
    for r in (*two, one):
        assert r["global_steps"] == STEPS and r["stats"]["merges"] == STEPS // H, r["stats"]
    assert_matches([tp.assemble([r["committed"][s] for r in two]) for s in range(STEPS)], committed)
    assert_matches([tp.assemble([r["params"][-1] for r in two])], [versions[STEPS // H]])
    assert_matches(one["committed"], committed)
    assert [r["stats"]["syncer_shards"] for r in (*two, one)] == [[0], [1], [0, 1]]
    assert_syncer_holds(state, versions, shards)


def test_tensor_parallel_slices_map_onto_the_unsplit_model_once_each():
    """Every element of the unsplit model is in the Δ runs of exactly one rank of a tp 2 x dp 2 learner (a
    replicated parameter from tensor-parallel rank 0) and in the θ_g runs of one rank (a replicated one: of one
    rank per tensor-parallel rank); one
    run per parameter for partition_dim 0, one per row for partition_dim 1; the names of tp 2 and tp 1 agree."""
    layers = [((8, 7), 0), ((8,), 0), ((3, 8), 1), ((3,), None)]  # TPNet's halves
    whole = [((16, 7), None), ((16,), None), ((3, 16), None), ((3,), None)]
    params = flat_params(layers)
    specs, _ = split_params(params, 2)
    sizes, shapes = canonical_model(specs, 2)
    assert sizes == [16 * 7 + 16 + 48 + 3] and shapes == [[(16, 7), (16,), (3, 16), (3,)]]
    assert name(params, 2) == name(flat_params(whole), 1)
    local = sum(p.numel() for p, _ in params[0])
    k, syncer = 2, Parts.syncer(sizes, 3)
    mine = Parts((local,), (-(-local // 4) * 2,), k)
    delta, theta = torch.zeros(sizes[0], dtype=torch.int64), torch.zeros(sizes[0], dtype=torch.int64)
    for t in range(2):
        runs = [run for j in range(k) for run in rank_runs(specs, 2, t, j, mine, syncer)]
        for _, i, po, n, c, st, rep in runs:  # c rows of n elements, st apart in the part
            at = i * syncer.widths[0] + po
            theta.as_strided((c, n), (st, 1), at).add_(1)
            if not (rep and t):
                delta.as_strided((c, n), (st, 1), at).add_(1)
        assert len(rank_runs(specs, 2, t, 0, mine, syncer)) < 12  # runs, not elements
    assert torch.equal(delta, torch.ones_like(delta))
    assert torch.equal(theta, torch.cat([torch.ones(sizes[0] - 3, dtype=torch.int64), torch.full((3,), 2)]))


def test_parameters_that_cannot_be_mapped_are_named():
    p = megatron((4, 3))
    p.tensor_model_parallel = True  # no partition_dim
    assert split_params([[(p, 0)]], 2) == (None, "parameter 0 of group 0 (shape [4, 3]) is tensor_model_parallel "
                                                  "with partition_dim None, not 0 or 1")
    q = megatron((4, 3), 0, stride=3)
    assert split_params([[(q, 0)]], 2)[1] == "parameter 0 of group 0 (shape [4, 3]) has partition_stride 3, not 1"
    assert split_params([[(q, 0)]], 1)[1] == ""  # tensor-parallel size 1: nothing is split


def test_learners_of_other_unsplit_models_are_refused_naming_both(tmp_path):
    """A vocabulary padded per tensor-parallel size (Megatron pads to a multiple of 128 x tp): an embedding of
    50304 rows at tp 1 and 50432 at tp 2 of a 50257-token vocabulary; the second learner is refused, both named."""
    at_tp1 = name(flat_params([((50304, 4), None)]), 1)
    at_tp2 = name(flat_params([((25216, 4), 0)]), 2)
    assert at_tp1 != at_tp2
    shard, thread = serve(Shard(0, "127.0.0.1", 0, SETTINGS, min_quorum=2, grace_s=0.0, state_dir=str(tmp_path),
                                keys=KEYS, say=lambda _: None))

    def hello(learner, layout):
        return say_hello(shard.port, learner, layout)
    try:
        assert hello(0, at_tp1) == wire.NO_VERSION
        with pytest.raises(wire.Refused) as err:
            hello(1, at_tp2)
        assert hello(2, name(flat_params([((25152, 4), 0)]), 2)) == wire.NO_VERSION  # 50304 rows at tp 2: one model
    finally:
        shard.stop()
        thread.join(5)
    assert str(err.value).endswith(shape_refusal(1, at_tp2, at_tp1, 0))
    words = str(err.value)
    assert ("learner 1 runs as any number of data-parallel ranks x any tensor-parallel and pipeline size mapped onto "
            "the unsplit model, expert parallel 1 (201728 elements of the unsplit model") in words
    assert "but learner 0 as any number of data-parallel ranks x any tensor-parallel and pipeline size mapped onto " \
           "the unsplit model, expert parallel 1 (201216 elements of the unsplit model" in words
    assert "a vocabulary padded per tensor-parallel size differs" in words
    assert "A weight tied across pipeline stages (tied embeddings) is on two stages and cannot be mapped" in words


def test_a_learner_that_does_not_map_says_why_when_refused():
    """The shard's refusal names both layouts; the learner adds which of its parameters kept it from mapping."""
    class Refusing:
        def open(self, timeout_s):
            raise wire.Refused("the peer refused: refused message: layout: learner 1 runs as ...")

    learner = Connect()
    learner.learner, learner.timeout_s = 1, 5.0
    learner.unmapped = "its tensor-parallel slices cannot be mapped onto the unsplit model: parameter 0 ..."
    with pytest.raises(wire.Refused) as err:
        learner._open(Refusing())
    assert str(err.value) == ("the peer refused: refused message: layout: learner 1 runs as .... Learner 1: its "
                              "tensor-parallel slices cannot be mapped onto the unsplit model: parameter 0 ...")


def threaded_round_trip(relayouts, sent, rank_of, monkeypatch):
    """Each slot's ``to_syncer`` then ``from_syncer`` in a thread of its own, the world's all-to-all stood in for
    by the threads (slot s at group rank ``rank_of[s]``): ``{slot: (its syncer parts, its partition back)}``."""
    world = len(relayouts)
    me, box, barrier = threading.local(), {}, threading.Barrier(world)

    def all_to_all_single(recv, send, in_splits, out_splits, group=None):
        box[me.rank] = torch.split(send, out_splits)
        barrier.wait()
        recv.copy_(torch.cat([box[r][me.rank] for r in range(world)]))
        barrier.wait()

    monkeypatch.setattr(canonical.tdist, "all_to_all_single", all_to_all_single)
    out = {}

    def rank(s):
        me.rank = rank_of[s]
        parts = relayouts[s].to_syncer(sent[s])
        out[s] = (parts, relayouts[s].from_syncer(parts))
    threads = [threading.Thread(target=rank, args=(s,)) for s in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def tp_slice(full, t, tp_size):
    """Tensor-parallel rank ``t``'s flat parameters of ``tp.FullNet``'s flat ``full`` (w1 rows, b1, w2 columns,
    b2 replicated): ``tp.assemble``'s inverse."""
    h, n = tp.HIDDEN, tp.HIDDEN // tp_size
    w1, b1, w2, b2 = torch.split(full, [h * 7, h, 3 * h, 3])
    rows = slice(t * n, (t + 1) * n)
    return torch.cat([w1.view(h, 7)[rows].reshape(-1), b1[rows], w2.view(3, h)[:, rows].reshape(-1), b2])


def test_a_tp2_dp2_learner_moves_its_partitions_into_five_parts_of_the_unsplit_model_and_back(monkeypatch):
    """Four ranks (threads over a stand-in all-to-all; slot j + 2t at group rank 2j + t, Megatron's order): Δ in
    the syncer's 5 parts is the unsplit model end to end (slot 0 holds parts 0 and 4; the replicated bias from
    tensor-parallel rank 0), θ_g comes back as each rank's partition, the bias on both, its padding zero."""
    tp_size, k, world = 2, 2, 4
    layers = [((8, 7), 0), ((8,), 0), ((3, 8), 1), ((3,), None)]
    specs, _ = split_params(flat_params(layers), tp_size)
    sizes, _ = canonical_model(specs, tp_size)
    full = torch.randn(sizes[0])
    local = 56 + 8 + 24 + 3
    mine, syncer = Parts((local,), (-(-local // 4) * 2,), k), Parts.syncer(sizes, 5)
    rank_of = [0, 2, 1, 3]
    relayouts = [TPRelayout(specs, tp_size, k, s, mine, syncer, None, rank_of) for s in range(world)]
    assert [r.owned for r in relayouts] == [[0, 4], [1], [2], [3]] and relayouts[0].world == world
    w = mine.widths[0]
    partitions, sent = [], []
    for s in range(world):
        flat = torch.zeros(k * w)
        flat[:local] = tp_slice(full, s // k, tp_size)
        partitions.append(flat[(s % k) * w:(s % k + 1) * w].clone())
        flat[local - 3:local] = -1.0 if s >= k else flat[local - 3:local]  # b2 leaves from tp rank 0 only
        sent.append(flat[(s % k) * w:(s % k + 1) * w].clone())
    out = threaded_round_trip(relayouts, sent, rank_of, monkeypatch)
    parts = {i: p for s in range(world) for i, p in zip(relayouts[s].owned, out[s][0])}
    assert torch.equal(torch.cat([parts[i] for i in range(5)])[:full.numel()], full)
    for s in range(world):
        assert torch.equal(out[s][1], partitions[s]), s


@pytest.mark.parametrize("j", [0, 1, 2])
def test_rows_split_along_dimension_one_travel_as_blocks_cut_only_at_the_edges(j):
    """A (64, 12) weight split along dimension 1 over 4 tensor-parallel ranks (local (64, 3): a run per row) seen by
    rank t = 1 at data-parallel rank j of 3 (partitions of 64 elements: edges inside rows) and 5 syncer parts of
    154 elements (the edge at 616 cuts a row of t's): every element of its partition lands where the unsplit model
    has it, in a handful of blocks."""
    tp_size, t, k = 4, 1, 3
    specs, _ = split_params(flat_params([((64, 3), 1)]), tp_size)
    mine, syncer = Parts((192,), (part_width(192, k),), k), Parts.syncer([768], 5)
    runs = rank_runs(specs, tp_size, t, j, mine, syncer)
    lo, hi = j * mine.widths[0], min((j + 1) * mine.widths[0], 192)
    got = {}
    for so, i, po, n, c, st, rep in runs:
        canon = i * syncer.widths[0] + po + (torch.arange(c)[:, None] * st + torch.arange(n)).reshape(-1)
        got.update(zip(range(lo + so, lo + so + n * c), canon.tolist()))
    assert got == {e: (e // 3) * 12 + t * 3 + e % 3 for e in range(lo, hi)}
    assert len(runs) <= 7, runs
