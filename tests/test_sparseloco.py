"""``sparseloco`` on CPU ranks against the float64 simulator (acco_ds/testing/sparseloco.py).

The 146-parameter test model (fc1.weight 91, fc1.bias 13, fc2.weight 39, fc2.bias 3) with chunk 16 and
topk 4 keeps a quarter of each chunk. With 2 replicas of 2 ranks ZeRO-1 splits the padded 148 elements
at 74, inside fc1.weight's chunk [64, 80): that chunk straddles the two partitions, so the boundary
exchange is exercised (chunk 64 makes [64, 91) straddle by 17 elements). Values exact (value_bits null)
and 2-bit. The same launches check resume bit for bit, the summary's words and that the loss goes down."""

import pytest
import torch

import common
from acco_ds.config import LocalSGDConfig, parse_acco_config
from acco_ds.memory import estimate_memory, outer_state_bytes
from acco_ds.ops.reference import chunk_offsets, sparse_payload_bytes
from acco_ds.runtime.outer.chunks import chunk_plan
from acco_ds.testing.sparseloco import simulate_sparseloco
from dist import launch
from test_compression import assert_matches

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

GAS, STEPS, H = 2, 6, 2
SIZES = [91, 13, 39, 3]  # TinyNet's parameters, registration order


def block(k, **sparse):
    return {"mode": "sparseloco", "local_sgd": {"sync_every": H, "replica_group_size": k, **sparse}}


def reference(world, k, chunk=16, topk=4, value_bits=2, error_decay=0.95, steps=STEPS, entropy_coding=None,
              overlap=0):
    # (the coding is lossless: the simulator has none)
    return simulate_sparseloco(common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                               group_size=k, gradient_accumulation_steps=GAS, steps=steps, sync_every=H,
                               optimizer_fn=common.reference_optimizer("AdamW"), chunk=chunk, topk=topk,
                               value_bits=value_bits, error_decay=error_decay, overlap=overlap)


CASES = [dict(chunk=16, topk=4, value_bits=None, entropy_coding=None), dict(chunk=16, topk=4, value_bits=2),
         dict(chunk=64, topk=6, value_bits=4, error_decay=0.5)]  # 2 x 1: the first and the last; 2 x 2: the first two
# the gather behind the next inner step (H = 2: it lands one step after its sync)
OVERLAP = [dict(chunk=16, topk=4, value_bits=2, overlap=1), dict(chunk=64, topk=6, value_bits=4, overlap=1)]


def check_against_simulator(results, world, k, cases, first=0):
    for i, sparse in enumerate(cases):
        ref = reference(world, k, **sparse)
        for rank in range(world):
            r = results[rank][first + i]
            assert r["global_steps"] == STEPS
            assert_matches(r["params"], ref["replicas"][rank // k])
            assert_matches(r["committed"], ref["anchor"])
            s = r["stats"]
            assert s["syncs"] == STEPS // H
            # the summary's residual norm is this replica's ‖e‖, the simulator's after the last sync
            want = float(ref["errors"][rank // k][-1].norm())
            assert abs(s["sparse_residual_norm"] - want) <= 1e-4 * want, (s["sparse_residual_norm"], want)
            assert any(label == "sparse outer" and "residual norm" in text for label, text in r["report"])
        # the anchor really moved, and the replicas differ between syncs
        assert (ref["anchor"][-1] - ref["anchor"][0]).abs().max() > 1e-3
        a, b = results[0][first + i]["params"][0], results[world - 1][first + i]["params"][0]
        assert (a - b).abs().max() > 1e-4, "replicas trained on the same data"
    # bytes handed to the all-gather per sync: each rank's packed payload of its chunks (a tag byte each; over
    # the k ranks of a replica, the whole model's), after its length (8 bytes) when zlib may code it. zlib does
    # not pay on payloads this small, so every sync sends the packed bytes.
    for i, sparse in enumerate(cases):
        coded = sparse.get("entropy_coding", "zlib") is not None
        whole = sparse_payload_bytes(chunk_offsets(SIZES, sparse["chunk"]), sparse["topk"], sparse["value_bits"] or 0)
        stats = [results[rank][first + i]["stats"] for rank in range(k)]
        assert sum(s["sparse_payload_bytes"] - 1 for s in stats) == whole - 1
        # overlapped: the last sync's gather is still in flight when the run ends (it lands at finalize)
        syncs = STEPS // H - (1 if sparse.get("overlap") else 0)
        for s in stats:
            assert s["sparse_wire_bytes"] == s["sparse_payload_bytes"]
            assert s["outer_bytes"] == syncs * (s["sparse_wire_bytes"] + 8 * coded), (s, coded)


def test_chunk_plan_straddles_the_partition_boundary():
    """2 ranks of 74: chunk [64, 80) of fc1.weight is rank 0's, rank 1 sends it its first 6 elements."""
    params = [(91, 0), (13, 91), (39, 104), (3, 143)]
    r0, r1 = (chunk_plan(params, 74, 2, s, 16) for s in (0, 1))
    assert (r0.own_lo, r0.own_hi, r0.tails, r0.head) == (0, 80, [(1, 6)], 0)
    assert (r1.own_lo, r1.head, r1.head_owner, r1.tails) == (6, 6, 0, [])
    assert r0.offsets.tolist() == [0, 16, 32, 48, 64, 80]
    assert r1.offsets.tolist() == [0, 11, 24, 40, 56, 63, 66]  # [80, 91), [91, 104), ... [143, 146) from 80
    # chunk 64 on 8 ranks of 19: [0, 64) spans four partitions, rank 3 owns [64, 91) and takes 15 from rank 4
    plans = [chunk_plan(params, 19, 8, s, 64) for s in range(8)]
    assert plans[0].tails == [(1, 19), (2, 19), (3, 7)] and plans[0].extended == 64
    assert [(p.head, p.head_owner, p.chunks) for p in plans[1:3]] == [(19, 0, 0), (19, 0, 0)]
    assert (plans[3].head, plans[3].tails, plans[3].offsets.tolist()) == (7, [(4, 15)], [0, 27])


@pytest.mark.timeout(300)
def test_two_replicas_of_one_rank_match_the_simulator():
    """Also overlapped (the gather behind the next inner step) against the simulator's overlap rule, and
    ``overlap: 0`` written out: the blocking sync, bit for bit."""
    cases = [CASES[0], CASES[2], OVERLAP[1]]
    runs = [dict(config=common.ds_config(acco=block(1, **c), gas=GAS), steps=STEPS, record_committed=True)
            for c in cases + [dict(CASES[0], overlap=0)]]
    # and finalized: STEPS is a multiple of H, so the last sync's gather is in flight at finalize
    runs.append(dict(runs[2], record_committed=False, finalize=True))
    results = launch({"runs": runs}, world_size=2, timeout=240)
    check_against_simulator(results, 2, 1, cases)
    for rank in range(2):
        blocking, zero = results[rank][0], results[rank][3]
        for a, b in zip(blocking["params"] + blocking["committed"], zero["params"] + zero["committed"]):
            assert torch.equal(a, b)
    # the memory estimate of the outer state is what the loop held at its peak (a sync's average beside the
    # anchor and error; overlapped: also the weights at the sync, 4N/k more, until the gather lands)
    for i, sparse in enumerate(cases + [dict(CASES[0], overlap=0)]):
        for rank in range(2):
            r = results[rank][i]
            held = r["stats"]["outer_state_peak_bytes"]
            numel = r["group_numels"][0]
            assert held == outer_state_bytes(numel, 1, "sparseloco", overlap=sparse.get("overlap", 0)), (i, held)
    assert results[0][2]["stats"]["outer_state_peak_bytes"] - results[0][0]["stats"]["outer_state_peak_bytes"] == \
        4 * results[0][0]["group_numels"][0]
    # finalize right after a sync lands its gather: every replica takes the anchor, one model (this raised on
    # the DeepSpeed host: the masters are leaves that require grad)
    finals = [results[rank][4]["final_params"] for rank in range(2)]
    assert torch.equal(finals[0], finals[1]) and bool(torch.isfinite(finals[0]).all())
    assert not torch.equal(finals[0], results[0][2]["params"][-1]), "the replica's own weights, not the anchor"
    # the overlapped rule is not the blocking one: after the first sync the replica is still on its own weights
    blocking = reference(2, 1, **dict(OVERLAP[1], overlap=0))
    assert (results[0][2]["params"][1] - blocking["replicas"][0][1]).abs().max() > 1e-4


REFUSED = [
    ({"topk": 100, "chunk": 64}, "acco.local_sgd.topk (100) must be at most acco.local_sgd.chunk (64)"),
    ({"chunk": 70000}, "acco.local_sgd.chunk (70000) must be at most 65536: each kept entry's index"),
    ({"value_bits": 3}, '"acco.local_sgd.value_bits": Input should be 2, 4 or 8'),
    ({"error_decay": 1.0}, '"acco.local_sgd.error_decay": Input should be less than 1'),
    ({"error_decay": -0.1}, '"acco.local_sgd.error_decay": Input should be greater than or equal to 0'),
    ({"outer_momentum": 0.9}, 'acco.local_sgd.outer_momentum does not apply to mode "sparseloco"'),
    ({"nesterov": True}, 'acco.local_sgd.nesterov does not apply to mode "sparseloco"'),
    ({"fragments": 2, "sync_every": 4}, 'acco.local_sgd.fragments is Streaming DiLoCo\'s'),
    ({"weighting": "norm"}, 'acco.local_sgd.weighting is EDiT\'s'),
    ({"staleness_penalty": 2.0}, 'acco.local_sgd.staleness_penalty applies to mode "co2"'),
    ({"overlap": 2, "sync_every": 2}, "acco.local_sgd.overlap (2) must be below sync_every (2): a sync's"),
    ({"overlap": -1}, '"acco.local_sgd.overlap": Input should be greater than or equal to 0'),
    ({"entropy_coding": "lz4"}, '"acco.local_sgd.entropy_coding": Input should be \'zlib\''),
]


@pytest.mark.parametrize("local_sgd, needle", REFUSED)
def test_bad_sparseloco_keys_are_refused_by_name(local_sgd, needle):
    with pytest.raises(ValueError) as err:
        parse_acco_config({"acco": {"enabled": True, "mode": "sparseloco", "local_sgd": local_sgd}})
    assert needle in str(err.value), str(err.value)


def test_a_split_tensor_without_its_partition_dim_is_refused_by_name():
    """Tensor parallelism runs (chunks of whole tensors, ``sparse_tp.py``): a split parameter must say along which
    dimension it was split (Megatron's ``partition_dim``); without it the loop refuses before any collective."""
    from acco_ds.runtime.outer.interface import ReplicaGroups, Shards, build_outer_loop
    acco = parse_acco_config({"acco": {"enabled": True, "mode": "sparseloco"}})
    groups = ReplicaGroups(1, 2, 0, 0, [0], [0, 1], None, None, None, None)
    groups.model_main, groups.tensor_parallel = object(), 2
    split = torch.zeros(4)
    split.tensor_model_parallel = True
    zero1 = Shards([torch.zeros(4)], [torch.zeros(4)], lambda: None, [[(split, 0)]])
    with pytest.raises(ValueError, match="a tensor-parallel parameter of shape \\(4,\\) needs Megatron's partition_dim"):
        build_outer_loop(acco, zero1, groups)
    # the overlapped sync gathers on its own thread: not with tensor parallelism or replicas that come and go
    overlap = parse_acco_config({"acco": {"enabled": True, "mode": "sparseloco",
                                          "local_sgd": {"overlap": 1, "sync_every": 2}}})
    with pytest.raises(ValueError, match="acco.local_sgd.overlap cannot be used with tensor parallelism yet"):
        build_outer_loop(overlap, zero1, groups)
    ft = parse_acco_config({"acco": {"enabled": True, "mode": "sparseloco", "fault_tolerance": {},
                                     "local_sgd": {"overlap": 1, "sync_every": 2}}})
    with pytest.raises(ValueError, match="acco.local_sgd.overlap cannot be used with acco.fault_tolerance"):
        build_outer_loop(ft, zero1, groups)


def test_sparseloco_keys_elsewhere_and_what_it_does_not_run_with_are_refused():
    for acco, needle in [
            ({"mode": "diloco", "local_sgd": {"topk": 8}}, 'acco.local_sgd.topk is SparseLoCo\'s: it applies to mode '
                                                            '"sparseloco", not to mode "diloco"'),
            ({"mode": "sparseloco", "compression": {"dtype": "int8", "apply_to": ["outer"]}},
             'acco.compression.apply_to "outer" cannot be used with acco.mode "sparseloco"')]:
        with pytest.raises(ValueError) as err:
            parse_acco_config({"acco": {"enabled": True, **acco}})
        assert needle in str(err.value), str(err.value)
    # fault tolerance runs (tests/test_fault_tolerance.py): the block is accepted
    ft = parse_acco_config({"acco": {"enabled": True, "mode": "sparseloco", "fault_tolerance": {"merge": "tokens"}}})
    assert ft.fault_tolerance.merge == "tokens"
    defaults = parse_acco_config({"acco": {"enabled": True, "mode": "sparseloco"}})
    ls = defaults.local_sgd or LocalSGDConfig()
    assert (ls.chunk, ls.topk, ls.error_decay, ls.value_bits, defaults.outer["outer_lr"]) == (4096, 64, 0.95, 2, 1.0)


@pytest.mark.timeout(500)
def test_two_replicas_of_two_ranks_match_the_simulator_and_resume_bit_for_bit(tmp_path):
    """ZeRO-1 inside each replica, a chunk straddling the partitions; in the same launches: a save mid-period
    (step 3, after a sync left residuals in the error buffers) of the 2-bit case, resumed in fresh processes:
    bit-identical to the uninterrupted run (error buffers, anchor, period position), and the loss goes down."""
    cases = CASES[:2] + OVERLAP[:1]
    cfg = common.ds_config(acco=block(2, **cases[1]), gas=GAS)
    saves = {3: str(tmp_path / "ckpt3")}
    runs = [dict(config=common.ds_config(acco=block(2, **c), gas=GAS), steps=STEPS, record_committed=True)
            for c in cases]
    runs += [dict(config=cfg, steps=100, max_micro=GAS * stop, save=path) for stop, path in saves.items()]
    # overlapped, saved at step 2 with the sync's gather in flight (it lands after step 3)
    overlapped = common.ds_config(acco=block(2, **OVERLAP[0]), gas=GAS)
    runs.append(dict(config=overlapped, steps=100, max_micro=GAS * 2, save=str(tmp_path / "flight2")))
    # PP 2 x DP 2: 2 replicas of one data-parallel rank, each with both stages (one Linear each): chunks are
    # per tensor, so each stage packs its own tensors' chunks; the anchor is the unsplit simulator's
    runs.append(dict(config=common.ds_config(acco=block(1, **cases[1]), gas=GAS), steps=STEPS, pipe=2,
                     record_committed=True))
    results = launch({"runs": runs}, world_size=4, timeout=400)
    check_against_simulator(results, 4, 2, cases)
    from test_pipeline import _whole
    pipe = reference(2, 1, **cases[1])
    for params in _whole(results, len(runs) - 1, STEPS):
        assert_matches(params, pipe["anchor"])
    # and resharded: the same checkpoint into 4 replicas of 1 rank; new replica g takes old replica g mod 2's
    # error buffer (the replica mapping rule), whole (the buffer after the sync at step 2: the simulator's)
    reshard = dict(config=common.ds_config(acco=block(1, **cases[1]), gas=GAS), steps=3, load=saves[3],
                   export_shards=True)
    flight = dict(config=overlapped, steps=STEPS, load=str(tmp_path / "flight2"), record_committed=True)
    resumed = launch({"runs": [dict(config=cfg, steps=STEPS, load=path, record_committed=True)
                               for path in saves.values()] + [flight, reshard]}, world_size=4, timeout=300)
    for rank in range(4):  # the gather saved in flight lands at its own step: bit for bit the run that went on
        r, want = resumed[rank][len(saves)], results[rank][2]
        assert r["loaded"]["global_steps"] == 2
        for got, expect in zip(r["params"] + r["committed"], want["params"][2:] + want["committed"][2:]):
            assert torch.equal(got, expect), (got - expect).abs().max()
    ref = reference(4, 2, **cases[1])
    for rank in range(4):
        error = resumed[rank][-1]["loaded"]["outer"]["error"][0]
        want = ref["errors"][rank % 2][0]
        assert error.numel() == 146 and float(want.abs().max()) > 1e-3
        torch.testing.assert_close(error.double(), want, atol=1e-5, rtol=1e-4)
    for rank in range(4):
        want = results[rank][1]
        for stop, r in zip(saves, resumed[rank][:len(saves)]):
            assert r["loaded"]["global_steps"] == stop
            for got, expect in zip(r["params"], want["params"][stop:]):
                assert torch.equal(got, expect), (stop, (got - expect).abs().max())
            for got, expect in zip(r["committed"], want["committed"][stop:]):
                assert torch.equal(got, expect)
            assert r["stats"]["sparse_residual_norm"] == want["stats"]["sparse_residual_norm"]
    # the loss goes down: the anchor's loss on every rank's data, start against end (simulator = engine)
    model = common.make_model(0)
    data = [common.micro_batch(r, 1000 + i) for r in range(4) for i in range(4)]

    def loss_at(theta):
        torch.nn.utils.vector_to_parameters(theta.float(), model.parameters())
        with torch.no_grad():
            return sum(float(common.loss_fn(model, b)) for b in data) / len(data)

    start = loss_at(torch.nn.utils.parameters_to_vector(common.make_model(0).parameters()))
    # (random targets: the best a linear fit reaches is close to the start; measured 0.976 -> 0.938)
    assert loss_at(results[0][1]["committed"][-1]) < 0.97 * start


@pytest.mark.timeout(400)
def test_the_torch_host_on_plain_modules_and_fsdp2_matches_the_simulator():
    """``acco_ds.torch`` (no DeepSpeed), 2 replicas of 2 ranks, 2-bit values: on a plain module (ZeRO-1's flat
    partitions, the straddling chunk) and on FSDP2 (each parameter sharded by rows, unevenly: fc1.weight's
    13 rows as 7 + 6, so its chunk [48, 64) straddles the two shards at 49); every rank's replica and the
    anchor match the simulator, and finalize leaves one model. The same overlapped (``overlap: 1``): the
    simulator's overlap rule, and finalize lands the last sync's gather, still in flight, on every replica."""
    from test_torch_host import WORKER, local
    cases = [CASES[1], OVERLAP[0]]
    runs = [dict(config=local("sparseloco", 2, H=H, **c), steps=STEPS, finalize=True, fsdp=fsdp)
            for c in cases for fsdp in (None, 2)]
    results = launch({"runs": runs}, world_size=4, timeout=350, worker=WORKER)
    for i, (case, fsdp) in enumerate((c, f) for c in cases for f in (None, 2)):
        ref = reference(4, 2, **case)
        for rank in range(4):
            r = results[rank][i]
            assert not r["deepspeed_imported"]
            assert_matches(r["params"], ref["replicas"][rank // 2])
            assert_matches(r["committed"], ref["anchor"])
            assert torch.equal(r["final_params"], results[0][i]["final_params"])


def test_the_memory_estimate_counts_the_weights_an_overlapped_sync_keeps():
    """``overlap`` > 0 keeps each rank's weights at the sync (one fp32 partition, 4N/k) while the gather is in
    flight; the estimate adds them, and refuses an overlap outside sparseloco."""
    from acco_ds.runtime.rounds.buffers import padded_numel
    n, gpus, k = 10_000_000, 8, 2
    blocking = estimate_memory(params=n, gpus=gpus, mode="sparseloco", replica_group_size=k, verbose=False)
    for overlap in (1, 3):
        est = estimate_memory(params=n, gpus=gpus, mode="sparseloco", replica_group_size=k, overlap=overlap,
                              verbose=False)
        assert est["acco_bytes"] - blocking["acco_bytes"] == 4 * padded_numel(n, k) // k
    with pytest.raises(ValueError, match="overlap=1: local_sgd.overlap is sparseloco's"):
        estimate_memory(params=n, gpus=gpus, mode="diloco", replica_group_size=k, overlap=1, verbose=False)
