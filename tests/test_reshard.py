"""The host-free core of a resharding load (``acco_ds/runtime/reshard.py``), against a stock-style repartition:
concatenate the saved partitions, keep the group's ``n`` elements, pad, split (DeepSpeed's elastic rule)."""

from types import SimpleNamespace

import pytest
import torch

from acco_ds.runtime.rounds.buffers import padded_numel
from acco_ds.runtime.outer.co2 import CO2
from acco_ds.runtime.outer.diloco import DiLoCo
from acco_ds.runtime.outer.streaming import StreamingDiLoCo
from acco_ds.runtime.reshard import Layout, Plan, reshard_rounds


def stock_partition(pieces, n, ways, rank):
    """Rank ``rank``'s ZeRO-1 partition of ``n`` elements split ``ways`` ways, from any old partitions."""
    full = torch.cat([p.reshape(-1) for p in pieces])[:n]
    padded = torch.cat([full, full.new_zeros(padded_numel(n, ways) - n)])
    return padded.chunk(ways)[rank]


def split(flat, n, ways, unpadded=False):
    parts = list(torch.cat([flat, flat.new_zeros(padded_numel(n, ways) - n)]).chunk(ways))
    if unpadded:  # DeepSpeed saves fp32 partitions without their padding
        P = parts[0].numel()
        parts = [p[:max(0, min(P, n - r * P))] for r, p in enumerate(parts)]
    return parts


@pytest.mark.parametrize("n", [1, 7, 146, 1001])
@pytest.mark.parametrize("old, new", [(4, 2), (4, 1), (2, 4), (3, 5), (1, 8)])
@pytest.mark.parametrize("unpadded", [False, True])
def test_zero_layout_repartitions_like_stock(n, old, new, unpadded):
    flat = torch.randn(n)
    pieces = split(flat, n, old, unpadded)
    for rank in range(new):
        got = Layout.zero(n, old).repartition(pieces, Layout.zero(n, new), rank)
        assert torch.equal(got, stock_partition(pieces, n, new, rank))
    assert Layout.zero(n, new).sizes[0] * new == padded_numel(n, new)


@pytest.mark.parametrize("shape", [(5, 3), (3,), (8, 2, 2), (1, 4)])
@pytest.mark.parametrize("old, new", [(2, 3), (4, 1), (1, 2), (3, 2)])
def test_dim0_layout_is_fsdp2s_chunks(shape, old, new):
    full = torch.randn(shape)

    def chunks(ways):  # FSDP2's Shard(0): torch.chunk, padded with empty chunks
        out = list(full.chunk(ways))
        return out + [full.new_zeros((0,) + tuple(shape[1:]))] * (ways - len(out))

    for rank, want in enumerate(chunks(new)):
        got = Layout.dim0(shape, old).repartition(chunks(old), Layout.dim0(shape, new), rank)
        assert torch.equal(got, want.reshape(-1))


def test_pieces_of_another_model_are_refused():
    with pytest.raises(ValueError, match="saved with another model"):
        Layout.zero(10, 2).take([torch.zeros(7), torch.zeros(7)], 0, 4)
    with pytest.raises(ValueError, match="3 saved pieces for a layout of 2 ranks"):
        Layout.zero(10, 2).take([torch.zeros(6)] * 3, 0, 4)


def plan(old_world, old_k, new_world, new_k, rank, n=(146, 16), local=True):
    return Plan(old_world=old_world, old_k=old_k, new_world=new_world, new_k=new_k, rank=rank, local=local,
                layouts=lambda ways: [Layout.zero(m, ways) for m in n])


def test_replica_mapping_rule():
    # 2 replicas x 2 ranks -> 4 replicas x 1: new replica g takes old replica g mod 2; the anchor old replica 0.
    p = plan(4, 2, 4, 1, rank=3)
    assert (p.replica, p.shard, p.source) == (3, 0, 1)
    assert p.mapped_ranks == [2, 3] and p.first_ranks == [0, 1]
    # 2 replicas x 1 -> 2 replicas x 2: rank 3 is replica 1, shard 1, from old replica 1 (rank 1).
    p = plan(2, 1, 4, 2, rank=3)
    assert (p.replica, p.shard, p.source, p.mapped_ranks) == (1, 1, 1, [1])
    assert "from 2 replicas x 1 rank to 2 replicas x 2 ranks" in p.message("ckpt")
    assert plan(4, 4, 2, 2, 1, local=False).words() == "from 4 data-parallel ranks to 2 data-parallel ranks"


def test_inner_state_repartitions_tensors_and_copies_scalars():
    n = (146, 16)
    moments = [torch.randn(m) for m in n]
    per_rank = [[{"step": torch.tensor(5.0), "exp_avg": part} for part in parts]
                for parts in zip(*[split(m, len(m), 4) for m in moments])]
    for rank in range(2):
        got = plan(4, 4, 2, 2, rank, local=False).inner_state(per_rank)
        for g, m in enumerate(moments):
            assert torch.equal(got[g]["exp_avg"], stock_partition(split(m, len(m), 4), len(m), 2, rank))
            assert got[g]["step"] == 5.0
    per_rank[1][0] = {"step": torch.tensor(5.0)}
    with pytest.raises(ValueError, match="other keys on other ranks"):
        plan(4, 4, 2, 2, 0, local=False).inner_state(per_rank)


def rounds_state(mode="acco", local_micro=0, kept=0, pending=None, outer=None, residuals=None):
    return {"schedule": {"mode": mode, "index": 3}, "local_micro": local_micro, "kept_count": kept,
            "pending": pending, "residuals": residuals or [None], "gradient_accumulation_steps": 4,
            "compute_part": [torch.zeros(74)], "outer": outer, "host_counters": None}


def test_round_modes_drop_what_is_in_flight_and_say_so():
    p = plan(2, 2, 1, 1, 0, n=(146,), local=False)
    states = [rounds_state(local_micro=3, kept=2, pending={"op": "peek"}, residuals=[torch.ones(3)]),
              rounds_state(local_micro=3, kept=2)]
    new = reshard_rounds(p, states, states, None, "acco", 8)  # the batch kept on fewer ranks: more accumulation
    assert new["resharded"] and new["world_size"] == 1 and new["compute_part"] is None and new["outer"] is None
    assert new["gradient_accumulation_steps"] == 8
    text = p.message("ckpt")
    assert text.startswith("ACCO: resharded the checkpoint in ckpt from 2 data-parallel ranks to 1 data-parallel "
                           "rank: the fp32 master weights and the optimizer moments are re-partitioned"), text
    for words in ("3 accumulated micro-batches of the unfinished round", "the estimate round's kept gradient shard",
                  "a finished estimate whose weights were not installed yet", "rounds restart with a start-up round",
                  "compression error-feedback residuals", "Not carried: per-rank random state",
                  "Changed: gradient_accumulation_steps 4 -> 8."):
        assert words in text, text
    with pytest.raises(ValueError, match="saved with ACCO mode='acco' but this run has 'dpu'"):
        reshard_rounds(plan(2, 2, 1, 1, 0, local=False), states, states, None, "dpu", 4)
    with pytest.raises(ValueError, match="saved in a local-SGD mode"):
        local = [rounds_state("sync", outer={"k": 1})] * 2
        reshard_rounds(plan(2, 2, 1, 1, 0, local=False), local, local, None, "sync", 4)


def loop(cls, replicas, k, **extra):
    """An outer loop object with only what ``reshard_state`` reads (no process groups)."""
    obj = object.__new__(cls)
    obj.groups = SimpleNamespace(replicas=replicas, k=k)
    for key, value in extra.items():
        setattr(obj, key, value)
    return obj


def outer_state(anchor, momentum, **extra):
    return {"schedule": {"mode": "diloco", "period": 2, "inner": 1}, "replicas": 2, "k": 2, "anchor": [anchor],
            "momentum": [momentum], "residuals": {(0, 0): torch.ones(2)}, **extra}


def test_local_sgd_outer_state_comes_from_replica_0_and_the_mapped_replica():
    n = 146
    anchor, momentum, start0, start1, sent = (torch.randn(n) for _ in range(5))
    first = [outer_state(a, m, start=[s], in_flight=[f]) for a, m, s, f in
             zip(split(anchor, n, 2), split(momentum, n, 2), split(start0, n, 2), split(sent, n, 2))]
    mine = [outer_state(a, m, start=[s], in_flight=[torch.full_like(f, 99.0)]) for a, m, s, f in
            zip(split(anchor, n, 2), split(momentum, n, 2), split(start1, n, 2), split(sent, n, 2))]
    p = plan(4, 2, 4, 1, rank=3, n=(n,))  # new replica 3 <- old replica 1
    sd = loop(CO2, 4, 1).reshard_state(first, mine, p)
    assert (sd["replicas"], sd["k"], sd["schedule"]["period"], sd["residuals"]) == (4, 1, 2, {})
    assert torch.equal(sd["anchor"][0], stock_partition(split(anchor, n, 2), n, 1, 0))
    assert torch.equal(sd["momentum"][0], stock_partition(split(momentum, n, 2), n, 1, 0))
    assert torch.equal(sd["start"][0], stock_partition(split(start1, n, 2), n, 1, 0)), "start: the mapped replica's"
    assert torch.equal(sd["in_flight"][0], stock_partition(split(sent, n, 2), n, 1, 0)), "in flight: replica 0's"
    assert "the outer all-reduce's error-feedback residuals" in p.message("c")
    with pytest.raises(ValueError, match="saved without a local-SGD mode"):
        loop(DiLoCo, 4, 1).reshard_state([None, None], [None, None], plan(4, 2, 4, 1, 0, n=(n,)))


def test_streaming_drops_a_prepared_fragment_which_is_prepared_again_at_its_sync():
    n = 146
    stream = {"step": 5, "fragments": 2, "fragment_sync_delay": 1, "prepared_at": [5, 3], "fragment_syncs": [1, 1],
              "pending": {"fragment": 0, "delta": torch.ones(3)}}
    states = [outer_state(a, a, streaming=stream) for a in split(torch.randn(n), n, 2)]
    p = plan(4, 2, 2, 1, rank=0, n=(n,))
    sd = loop(StreamingDiLoCo, 2, 1, F=2, tau=1).reshard_state(states, states, p)
    assert sd["streaming"]["pending"] is None and sd["streaming"]["prepared_at"] == [-1, 3]
    assert stream["pending"] is not None and stream["prepared_at"] == [5, 3], "the saved state is left alone"
    assert "fragment 0's prepared pseudo-gradient mean (prepared again, blocking, at its sync)" in p.message("c")
    with pytest.raises(ValueError, match="fragments=2 but this run has"):
        loop(StreamingDiLoCo, 2, 1, F=4, tau=1).reshard_state(states, states, p)


def test_edit_restarts_its_detector_and_a_edit_names_its_counters():
    from acco_ds.runtime.outer.edit import EDiT
    n = 146
    states = [outer_state(a, a, edit={"detector": {"mean": [1.0]}, "period_elapsed_s": 1.5, "anomalies": 2})
              for a in split(torch.randn(n), n, 2)]
    p = plan(4, 2, 2, 1, rank=1, n=(n,))
    edit = loop(EDiT, 2, 1, sync=SimpleNamespace(detector=object()), per_replica_counters=True)
    sd = edit.reshard_state(states, states, p)
    assert sd["edit"] == {"detector": None, "period_elapsed_s": 1.5, "anomalies": 2}
    text = p.message("c")
    assert "EDiT's anomaly-detector statistics" in text and "A-EDiT's uneven step counts" in text, text
