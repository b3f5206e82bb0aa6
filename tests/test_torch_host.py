"""acco_ds.torch, the host without DeepSpeed: every mode on plain modules and the local-SGD modes on FSDP2
(2x2) against the float64 simulators, sync against ZeroRedundancyOptimizer + DDP, resume bit for bit,
finalize, the committed-weight reads, and the refusals."""

import json

import pytest
import torch

import common
from acco_ds.testing.simulator import simulate, simulate_local_sgd
from dist import HERE, ROOT, free_port, launch
from test_engine import assert_matches

slow = pytest.mark.slow
WORKER = HERE / "torch_workers.py"
OUTER = {"diloco": (0.7, 0.9, True), "co2": (1.0, 0.5, False), "edit": (0.7, 0.8, True)}


def config(mode, gas=4, clip=0.0, **acco):
    return {"gradient_accumulation_steps": gas, "gradient_clipping": clip,
            "acco": {"enabled": True, "mode": mode, **acco}}


def local(mode, k, H=4, **ls):
    return config(mode, gas=2, local_sgd={"sync_every": H, "replica_group_size": k, **ls})


def local_reference(world, k, mode, model="tiny", steps=8, H=4, **streaming):
    lr, momentum, nesterov = OUTER[mode]
    return simulate_local_sgd(mode, common.make_model(0, model), common.loss_fn, common.micro_batch,
                              world_size=world, group_size=k, gradient_accumulation_steps=2, steps=steps,
                              sync_every=H, optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=lr,
                              outer_momentum=momentum, nesterov=nesterov, **streaming)


SPARSE = dict(chunk=16, topk=4, value_bits=2)  # sparseloco: a chunk straddles the shards (tests/test_sparseloco.py)


def run(runs, world=2, timeout=400):
    return launch({"runs": runs}, world_size=world, timeout=timeout, worker=WORKER)


@slow
@pytest.mark.timeout(500)
@pytest.mark.parametrize("world", [2, 4])
def test_round_modes_match_the_simulator_and_sync_matches_zero_redundancy_optimizer_with_ddp(world):
    modes = [("acco", {}), ("dpu", {}), ("sync", {}), ("acco", {"clip": 0.05, "groups": True, "lr_schedule": True})]
    runs = [dict(config=config(m, clip=o.get("clip", 0.0)), steps=5, finalize=True, inspect=True,
                 groups=o.get("groups"), lr_schedule=o.get("lr_schedule")) for m, o in modes]
    runs.append(dict(config=config("sync"), steps=5, zero_ddp=True))
    results = run(runs, world=world)
    for i, (mode, o) in enumerate(modes):
        ref = simulate(mode, common.make_model(0), common.loss_fn, common.micro_batch, world_size=world,
                       gradient_accumulation_steps=4, steps=5, clip=o.get("clip", 0.0),
                       optimizer_fn=common.reference_optimizer("AdamW", o.get("groups")),
                       lr_lambda=common.lr_factor if o.get("lr_schedule") else None)
        for rank in range(world):
            r = results[rank][i]
            assert not r["deepspeed_imported"]
            assert r["steps_seen"] == [1, 2, 3, 4, 5] and r["global_steps"] == 5
            assert_matches(r["committed"], ref["params"])  # what users read after each step: θ_t
            assert_matches([r["final_params"]], ref["params"][-1:])
            assert torch.equal(r["eval_out"], r["committed_out"]) and torch.equal(r["state_dict"], r["committed"][-1])
            assert r["compute_kept"]
        assert all(torch.equal(results[0][i]["final_params"], results[r][i]["final_params"]) for r in range(world))
        losses = results[0][i]["losses"]
        assert sum(losses[-4:]) < sum(losses[:4]), losses  # the last step's micro-batches vs the first's
    zero = results[0][-1]["params"]  # sync on the torch host = DDP averaging + ZeroRedundancyOptimizer
    assert_matches([p.double() for p in results[0][2]["params"]], [z.double() for z in zero], atol=1e-6)
    mid = results[0][0]  # acco: between steps the compute side holds the estimate, which users never see
    assert not torch.equal(mid["params"][2], mid["committed"][2])
    assert not torch.equal(mid["train_out"], mid["eval_out"])


@slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world, k", [(2, 1), (4, 2)])
def test_local_sgd_modes_on_plain_modules_and_fsdp2_match_the_simulator(world, k):
    cases = [("diloco", False, {}), ("co2", False, {}), ("edit", False, {})]
    cases += [("diloco", True, {}), ("co2", True, {}), ("edit", True, {}),
              ("diloco", True, {"fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5})]
    runs = [dict(config=local(m, k, **s), steps=8, finalize=True, fsdp=k if fsdp else None)
            for m, fsdp, s in cases]
    results = run(runs, world=world, timeout=550)
    for i, (mode, fsdp, s) in enumerate(cases):
        ref = local_reference(world, k, mode, **s)
        for rank in range(world):
            r = results[rank][i]
            assert not r["deepspeed_imported"], (mode, fsdp)
            assert_matches(r["params"], ref["replicas"][rank // k])  # each replica's weights, step by step
            assert_matches(r["committed"], ref["anchor"])  # what users read: the last global model
            assert r["stats"]["syncs"] >= 2 and r["stats"]["replicas"] == world // k
        finals = [results[rank][i]["final_params"] for rank in range(world)]
        assert all(torch.equal(f, finals[0]) for f in finals), (mode, fsdp)  # finalize: one model


@slow
@pytest.mark.timeout(500)
def test_a_edit_on_plain_modules_and_fsdp2_syncs_on_time_and_matches_the_simulator():
    """A-EDiT (edit + sync_time_s), 4 ranks as 2 replicas of 2; rank 3 takes twice as long per micro-batch
    on an injected clock. The loop ends on ``optimizer.acco_syncs``; the slow replica runs fewer inner steps
    per period; both replicas and the anchor equal the simulator fed the observed step counts."""
    costs = [1.0, 1.0, 1.0, 2.0]
    cfg = config("edit", gas=2, local_sgd={"sync_time_s": 9.0, "replica_group_size": 2})
    runs = [dict(config=cfg, steps=0, until_syncs=3, fake_clock=costs, finalize=True, fsdp=fsdp)
            for fsdp in (None, 2)]
    results = run(runs, world=4)
    for i, fsdp in enumerate((None, 2)):
        history = results[0][i]["sync_history"]
        period_steps = [[int(n) for n in h["steps"]] for h in history]
        assert len(period_steps) == 3 and all(fast > slow for fast, slow in period_steps), (fsdp, period_steps)
        ref = local_reference(4, 2, "edit", period_steps=period_steps)
        for rank in range(4):
            r = results[rank][i]
            assert r["syncs"] == 3 and r["sync_history"] == history and not r["deepspeed_imported"]
            assert r["global_steps"] == sum(p[rank // 2] for p in period_steps)
            assert_matches(r["params"], ref["replicas"][rank // 2])
            assert_matches([r["committed"][-1]], ref["anchor"][-1:])
            assert torch.equal(r["final_params"], results[0][i]["final_params"])  # one model after finalize


@slow
@pytest.mark.timeout(600)
def test_compression_on_plain_modules_and_fsdp2_matches_the_compressed_simulator():
    """``acco.compression`` (int8, blocks of 16) through the torch host: ACCO's rounds and DiLoCo's outer
    all-reduce on plain modules (ZeRO-1's partitions), and DiLoCo's outer all-reduce on FSDP2 2x2, whose
    local shards are each parameter's dim-0 chunks (``layout="fsdp2"`` in the simulator)."""
    from test_compression import FLIP_TOL, INT8, diloco_reference
    from test_compression import assert_matches as assert_close, reference as compressed
    from test_engine import deviation
    from test_local_sgd import GAS, H, STEPS

    def diloco(k, apply_to):  # the settings diloco_reference simulates
        cfg = local("diloco", k, H=H)
        cfg["gradient_accumulation_steps"] = GAS
        cfg["acco"]["compression"] = {**INT8, "apply_to": apply_to}
        return cfg

    two = run([dict(config=config("acco", compression=INT8), steps=4), dict(config=diloco(1, ["outer"]), steps=STEPS)])
    four = run([dict(config=diloco(2, ["rounds", "outer"]), steps=STEPS),
                dict(config=diloco(2, ["outer"]), steps=STEPS, fsdp=2)], world=4)
    assert_close(two[0][0]["committed"], compressed("acco", 2)["params"])
    assert two[0][0]["stats"]["compression"] == "int8 blocks of 16" and two[0][0]["stats"]["compressed_bytes"] > 0
    cases = [(two, 1, 2, 1, ["outer"], "zero"), (four, 0, 4, 2, ["rounds", "outer"], "zero"),
             (four, 1, 4, 2, ["outer"], "fsdp2")]
    for results, i, world, k, apply_to, layout in cases:
        ref = diloco_reference(world, k, apply_to, layout)
        for rank in range(world):
            r = results[rank][i]
            assert_close(r["params"], ref["replicas"][rank // k])
            assert_close(r["committed"], ref["anchor"])
            assert r["stats"]["outer_compression"] == "int8 blocks of 16" and r["stats"]["outer_residual_bytes"] > 0
        assert deviation(results[0][i]["committed"], local_reference(world, k, "diloco", steps=STEPS, H=H)["anchor"]) \
            > 4 * FLIP_TOL, "compression changed nothing"


@slow
@pytest.mark.timeout(600)
def test_resume_continues_bit_for_bit(tmp_path):
    cases = [(2, config("acco"), None), (2, config("dpu", accumulation="adaptive"), None),
             (4, local("diloco", 2, fragments=2, fragment_sync_delay=1, fragment_update_alpha=0.5), 2),
             (4, local("co2", 2), None)]
    # sparseloco: the error-feedback buffers resume too (ZeRO-1's flat partitions, and FSDP2's row shards)
    cases += [(4, local("sparseloco", 2, H=2, **SPARSE), fsdp) for fsdp in (None, 2)]
    for world in (2, 4):  # the cases of one world size share their launches
        bases = [dict(config=cfg, steps=6, fsdp=fsdp, lr_schedule=True) for w, cfg, fsdp in cases if w == world]
        ckpts = [str(tmp_path / f"ckpt{world}_{i}") for i in range(len(bases))]
        full = run(bases + [dict(b, save_at=3, save=c) for b, c in zip(bases, ckpts)], world=world)
        resumed = run([dict(b, load=c) for b, c in zip(bases, ckpts)], world=world)
        for rank in range(world):
            for i in range(len(bases)):
                got, want = resumed[rank][i], full[rank][i]
                assert all(torch.equal(a, b) for a, b in zip(got["committed"], want["committed"][3:]))
                assert all(torch.equal(a, b) for a, b in zip(got["params"], want["params"][3:]))
                assert got["global_steps"] == want["global_steps"]


@slow
@pytest.mark.timeout(400)
def test_a_checkpoint_of_another_layout_is_resharded_and_a_weights_only_load(tmp_path):
    """acco on a plain module saved on 4 ranks, loaded on 2: the committed weights are model.pt's, the masters and
    moments a stock-style repartition of the saved ones, and training goes on. diloco on FSDP2 saved as 2
    replicas of 2, loaded as 2 of 1: each replica's local shards are its mapped old replica's parameters, the
    anchor old replica 0's. A partial or damaged checkpoint is refused on every rank by name; the weights
    alone load into another layout and the optimizer starts afresh."""
    from test_reshard import stock_partition
    from test_resharding import damaged, loss_on
    plain, fsdp, sparse = str(tmp_path / "c"), str(tmp_path / "f"), str(tmp_path / "s")
    run([dict(config=config("acco"), steps=2, save_at=2, save=plain, groups=True),
         dict(config=local("diloco", 2), steps=3, save_at=3, save=fsdp, fsdp=2),
         dict(config=local("sparseloco", 2, H=2, **SPARSE), steps=3, save_at=3, save=sparse, fsdp=2)], world=4)
    broken = damaged(plain, tmp_path, name="rank3.pt")
    loads = [dict(config=config("acco"), steps=6, load=plain, groups=True, export_shards=True, finalize=True),
             dict(config=local("diloco", 1), steps=6, load=fsdp, fsdp=1, export_shards=True, finalize=True)]
    loads.append(dict(config=local("sparseloco", 1, H=2, **SPARSE), steps=6, load=sparse, fsdp=1, export_shards=True,
                      finalize=True))
    loads += [dict(config=config("acco"), steps=6, load=path, load_error=True) for _, path, _ in broken]
    loads.append(dict(config=config("sync"), steps=3, load=plain, load_kwargs={"load_optimizer_states": False}))
    out = launch({"runs": loads}, world_size=2, timeout=300, worker=WORKER, workdir=tmp_path / "logs")
    files = [torch.load(f"{plain}/rank{r}.pt", weights_only=False) for r in range(4)]
    committed = torch.cat([t.double().reshape(-1) for t in torch.load(f"{plain}/model.pt").values()])
    for rank in range(2):
        r = out[rank][0]
        assert torch.equal(r["loaded"]["committed"], committed) and torch.equal(r["loaded"]["params"], committed)
        for g, master in enumerate(r["loaded"]["masters"]):
            old = [sd["masters"][g] for sd in files]
            n = sum(p.numel() for p in common.param_groups(common.make_model(0))[g]["params"])
            assert torch.equal(master, stock_partition(old, n, 2, rank)), g
            for key in ("exp_avg", "exp_avg_sq"):
                moments = [sd["inner"]["state"][g][key] for sd in files]
                assert torch.equal(r["loaded"]["inner"]["state"][g][key], stock_partition(moments, n, 2, rank))
        assert r["global_steps"] >= 6
    seen = [(w, i) for w in range(2) for i in range(8, out[w][0]["micro"])]  # what the resumed run trained on
    assert loss_on(out[0][0]["final_params"], seen) < loss_on(committed, seen)
    shards = [torch.load(f"{fsdp}/rank{r}.pt", weights_only=False) for r in range(4)]
    for rank in range(2):  # new replica g <- old replica g (ranks 2g, 2g + 1); the anchor from old replica 0
        r = out[rank][1]
        for i, local_shard in enumerate(r["loaded"]["masters"]):
            assert torch.equal(local_shard, torch.cat([sd["shards"][i] for sd in shards[2 * rank:2 * rank + 2]]))
            assert torch.equal(r["loaded"]["outer"]["anchor"][i], torch.cat([sd["outer"]["anchor"][i]
                                                                              for sd in shards[:2]]))
        assert r["global_steps"] == 6 and torch.equal(r["final_params"], out[0][1]["final_params"])
    olds = [torch.load(f"{sparse}/rank{r}.pt", weights_only=False) for r in range(4)]
    for rank in range(2):  # sparseloco: each new replica's error buffer is its mapped old replica's, whole
        r = out[rank][2]
        for i, error in enumerate(r["loaded"]["outer"]["error"]):
            assert torch.equal(error, torch.cat([sd["outer"]["error"][i] for sd in olds[2 * rank:2 * rank + 2]]))
        assert any(e.abs().sum() > 0 for e in r["loaded"]["outer"]["error"])
        assert r["global_steps"] == 6 and torch.equal(r["final_params"], out[0][2]["final_params"])
    for j, (how, _, name) in enumerate(broken, start=3):
        for rank in range(2):
            err = out[rank][j]["load_error"]
            assert name in err and ("is partial" in err if how == "missing" else "truncated or corrupted" in err), err
    r = out[0][-1]  # the weights alone, into another world size: the optimizer restarts from them
    assert r["global_steps"] == 1 and r["losses"][-1] < r["losses"][0]
    text = (tmp_path / "logs" / "rank0.log").read_text()
    assert text.count("[acco_ds] ACCO: resharded the checkpoint") == 3, text[-3000:]
    assert "from 4 data-parallel ranks to 2 data-parallel ranks" in text and "from 2 replicas x 2 ranks to 2 " \
        "replicas x 1 rank" in text and "resharded" not in (tmp_path / "logs" / "rank1.log").read_text()


@slow
@pytest.mark.timeout(300)
def test_refusals_name_the_problem_and_the_fix():
    bad = [  # (run, text the error must contain)
        (dict(config=config("acco"), fsdp=2), "does not run on an FSDP2 model"),
        (dict(config=config("sync"), fsdp=2), "sync is what FSDP2 already does"),
        (dict(config=local("diloco", 2), fsdp=2, mesh_2d=True), "2D mesh"),
        (dict(config=local("diloco", 1), fsdp=2), "replica_group_size=1"),
        (dict(config=dict(local("diloco", 2), communication_data_type="bf16"), fsdp=2), "MixedPrecisionPolicy"),
        (dict(config=config("diloco", gas=2, local_sgd={"sync_every": 4, "replica_group_size": 2},
                            compression={"dtype": "int8", "apply_to": ["rounds", "outer"]}), fsdp=2),
         'FSDP2 does not compress its reduce-scatter; use "apply_to": ["outer"]'),
        (dict(config=dict(config("acco"), zero_optimization={"stage": 1})), '"zero_optimization" is a DeepSpeed'),
        (dict(config=config("acco", gas=3)), "must be even"),
        (dict(config=config("acco"), backward_per_step=3, steps=1), "after 3 backward passes"),
    ]
    results = run([dict(r, steps=r.get("steps", 2), expect_error=True) for r, _ in bad], world=4)
    for (spec, text), got in zip(bad, results[0]):
        assert text in got.get("error", ""), (text, got)


@slow
@pytest.mark.timeout(300)
def test_non_finite_gradients_skip_the_step_on_every_rank():
    r = run([dict(config=config("sync"), steps=4, nan_at_micro=5)])
    for rank in (0, 1):
        assert r[rank][0]["skipped_steps"] == 1 and r[rank][0]["global_steps"] == 4
        assert torch.isfinite(r[rank][0]["committed"][-1]).all()
    assert torch.equal(r[0][0]["committed"][1], r[0][0]["committed"][0])  # step 2 saw the NaN: unchanged


@pytest.fixture
def one_rank():
    """A one-rank gloo process group in this process (an earlier test's, if one is up)."""
    import torch.distributed as tdist
    from dist import free_port
    own = not tdist.is_initialized()
    if own:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    assert tdist.get_world_size() == 1
    yield
    if own:
        tdist.destroy_process_group()


def test_the_host_refuses_a_wrapped_model_and_an_optimizer_over_other_tensors(one_rank):
    import acco_ds.torch
    model = common.make_model(0)
    with pytest.raises(ValueError, match="wrapped in DistributedDataParallel"):
        acco_ds.torch.initialize(torch.nn.parallel.DistributedDataParallel(model),
                                 torch.optim.AdamW(model.parameters()), config("sync"))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        acco_ds.torch.initialize(model, torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]), config("sync"))
    opt = torch.optim.AdamW(model.parameters())
    torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ValueError, match="LR scheduler was created over this optimizer before initialize"):
        acco_ds.torch.initialize(model, opt, config("sync"))
    with pytest.raises(ValueError, match="model parameter fc2.weight requires grad but is in no param group"):
        acco_ds.torch.initialize(model, torch.optim.AdamW([model.fc1.weight, model.fc1.bias]), config("sync"))
    from torch.distributed.fsdp import FullyShardedDataParallel
    fsdp1 = FullyShardedDataParallel(common.make_model(0), device_id=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"FSDP1 \(FullyShardedDataParallel\) is not supported"):
        acco_ds.torch.initialize(fsdp1, torch.optim.AdamW(fsdp1.parameters()), config("sync"))
    with pytest.raises(ValueError, match='"acco": {"enabled": true} is missing'):
        acco_ds.torch.initialize(model, torch.optim.AdamW(model.parameters()), {"gradient_accumulation_steps": 2})


@slow
@pytest.mark.timeout(300)
def test_the_fsdp2_example_trains_and_checkpoints_without_deepspeed(tmp_path):
    """examples/fsdp2_train_gpt.py as the README runs it (fewer steps): 4 ranks, 2 replicas sharded by FSDP2."""
    from test_integrations import run as run_launcher, tool
    out = tmp_path / "summary.json"
    run_launcher([tool("torchrun"), "--nproc_per_node", "4", "--master_port", str(free_port()),
                  str(ROOT / "examples" / "fsdp2_train_gpt.py"),
                  "--config", str(ROOT / "configs" / "fsdp2_diloco_cpu.json"),
                  "--fsdp", "--steps", "8", "--eval_batches", "4", "--out", str(out), "--save", str(tmp_path / "ckpt")],
                 timeout=280)
    s = json.loads(out.read_text())
    assert s["mode"] == "diloco" and s["fsdp"] and s["world"] == 4 and s["steps"] == 8
    assert s["val_loss"] < s["first_val_loss"] - 0.5, s  # one sync (8 inner steps) of the committed model
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["meta.pt", "model.pt"] + [
        f"rank{r}.pt" for r in range(4)]
