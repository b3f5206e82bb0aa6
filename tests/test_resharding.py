"""Checkpoints loaded into another layout on the DeepSpeed host (``acco_ds/deepspeed/reshard.py``): acco saved
mid-round on 4 ranks and loaded on 2 and on 1, saved on 2 and loaded on 4; diloco, co2 (a pseudo-gradient in
flight) and Streaming DiLoCo (a fragment prepared) saved as 2 replicas of 2 and loaded as 2 and 4 replicas of
1, and diloco grown from 2 replicas of 1 to 2 of 2. What each rank holds right after the load is compared with
a stock-style repartition of the saved files; training goes on; rank 0 says what happened, once; a partial or
damaged checkpoint is refused on every rank, naming the file. Five launches in all (one per world size and
direction), every scenario a run inside them."""

import shutil
from pathlib import Path

import pytest
import torch

import common
from dist import launch
from test_reshard import stock_partition

pytestmark = pytest.mark.slow  # multi-process: `make test-fast` leaves it out

GAS, H = 2, 2
N = 146  # TinyNet's parameters
SAVED_AT = 11  # acco saves after 11 micro-batches per rank (gas 4: inside the estimate round of step 3)


def local(mode, k, **extra):
    return common.ds_config(acco={"mode": mode, "local_sgd": {"sync_every": H, "replica_group_size": k, **extra}},
                            gas=GAS)


STREAMING = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.5}
ACCO = common.ds_config(acco={"mode": "acco"}, clip=0.05)
LOCAL = {"diloco": (local, {}, 3), "co2": (local, {}, 3), "streaming": (local, STREAMING, 5)}  # saved after steps


def local_config(name, k):
    build, extra, _ = LOCAL[name]
    mode = "diloco" if name == "streaming" else name
    cfg = build(mode, k, **extra)
    return cfg


def saved(ckpt):
    """Per data-parallel rank, the ZeRO file's optimizer state; the module weights of the model-states file."""
    ckpt = Path(ckpt)
    tag = (ckpt / "latest").read_text().strip()
    files = sorted((ckpt / tag).glob("zero_pp_rank_*_mp_rank_00_optim_states.pt"),
                   key=lambda p: int(p.name.split("_")[3]))
    zero = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]
    module = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    return zero, torch.cat([t.float().reshape(-1) for t in module.values()])


def loss_on(params: torch.Tensor, batches) -> float:
    """The mean loss of TinyNet at ``params`` on the micro-batches ``batches`` ((worker, index) pairs)."""
    model = common.make_model(0)
    torch.nn.utils.vector_to_parameters(params.float(), model.parameters())
    with torch.no_grad():
        return sum(float(common.loss_fn(model, common.micro_batch(w, i))) for w, i in batches) / len(batches)


def check_round_mode(zero, module, results, world):
    """acco after a resharding load: the committed weights are the saved ones bit for bit, the masters and
    moments a stock repartition of the saved ones, and training went on with a falling loss."""
    for rank in range(world):
        r = results[rank]
        assert torch.equal(r["loaded"]["params"], module), "the committed weights changed"
        for g, master in enumerate(r["loaded"]["masters"]):
            old = [sd["single_partition_of_fp32_groups"][g] for sd in zero]
            n = sum(p.numel() for p in old)
            assert torch.equal(master, stock_partition(old, n, world, rank)), (rank, g)
            for key in ("exp_avg", "exp_avg_sq"):
                moments = [sd["base_optimizer_state"]["state"][g][key] for sd in zero]
                assert torch.equal(r["loaded"]["inner"][g][key], stock_partition(moments, n, world, rank)), key
            assert r["loaded"]["inner"][g]["step"] == zero[0]["base_optimizer_state"]["state"][g]["step"]
        assert len(r["params"]) == 8 - r["loaded"]["global_steps"] and r["global_steps"] >= 8
    # The targets are noise, so the loss that training lowers is the one on what it trained on: the
    # micro-batches the resumed run consumed, lower at its end than at the save, and lower there than at start.
    seen = [(w, i) for w in range(world) for i in range(SAVED_AT, results[w]["micro"])]
    init = loss_on(torch.nn.utils.parameters_to_vector(common.make_model(0).parameters()), seen)
    at_save, final = loss_on(module, seen), loss_on(results[0]["final_params"], seen)
    assert final < at_save < init, (init, at_save, final)


def check_local(zero, module, results, world, k, name):
    """A local-SGD mode after a resharding load: users read the saved anchor; the anchor and the outer momentum
    are old replica 0's, the replica's weights and fp32 master its mapped old replica's; training goes on."""
    old_k = zero[0]["acco"]["outer"]["k"]
    old_replicas = len(zero) // old_k
    # DeepSpeed's ds_to_universal maps parameters from replica 0's files only: one copy of the model.
    assert all(zero[r]["param_slice_mappings"][0] for r in range(old_k))
    assert not any(sd["param_slice_mappings"][0] for sd in zero[old_k:])
    for rank in range(world):
        r, (replica, shard) = results[rank], divmod(rank, k)
        source = replica % old_replicas
        first, mine = zero[:old_k], zero[source * old_k:(source + 1) * old_k]
        assert torch.equal(r["loaded"]["params"], module), "users do not read the saved anchor"
        outer = r["loaded"]["outer"]
        for key in ("anchor", "momentum") + (("in_flight",) if name == "co2" else ()):
            want = stock_partition([sd["acco"]["outer"][key][0] for sd in first], N, k, shard)
            assert torch.equal(outer[key][0], want), (name, key, rank)
        if name == "co2":
            want = stock_partition([sd["acco"]["outer"]["start"][0] for sd in mine], N, k, shard)
            assert torch.equal(outer["start"][0], want)
        if name == "streaming":
            assert outer["streaming"]["pending"] is None
        assert outer["schedule"] == zero[0]["acco"]["outer"]["schedule"], "the period position moved"
        weights = stock_partition([sd["acco"]["compute_part"][0] for sd in mine], N, 1, 0)
        assert torch.equal(r["loaded"]["compute"], weights[:N]), "the replica's weights are not its mapped old one's"
        old = [sd["single_partition_of_fp32_groups"][0] for sd in mine]
        assert torch.equal(r["loaded"]["masters"][0], stock_partition(old, N, k, shard))
        assert r["global_steps"] == 8
    assert all(torch.equal(results[0]["final_params"], results[r]["final_params"]) for r in range(world))


def damaged(ckpt, tmp_path, name="zero_pp_rank_3_mp_rank_00_optim_states.pt"):
    """Two copies of ``ckpt``: one without rank 3's file ``name``, one with it cut in half."""
    out = []
    for how in ("missing", "truncated"):
        dst = tmp_path / f"ckpt_{how}"
        shutil.copytree(ckpt, dst)
        tag = dst / (dst / "latest").read_text().strip() if (dst / "latest").exists() else dst
        f = tag / name
        if how == "missing":
            f.unlink()
        else:
            f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])
        out.append((how, str(dst), f.name))
    return out


@pytest.mark.timeout(900)
def test_every_mode_loads_a_checkpoint_of_another_layout(tmp_path):
    ck = {name: str(tmp_path / name) for name in ("acco4", "acco2", "diloco1", *LOCAL)}
    locals4 = [dict(config=local_config(name, 2), steps=steps, save=ck[name], record_committed=True)
               for name, (_, _, steps) in LOCAL.items()]
    launch({"runs": [dict(config=ACCO, steps=100, max_micro=SAVED_AT, save=ck["acco4"], groups=True)] + locals4},
           world_size=4, timeout=300)
    launch({"runs": [dict(config=ACCO, steps=100, max_micro=SAVED_AT, save=ck["acco2"], groups=True),
                     dict(config=local("diloco", 1), steps=3, save=ck["diloco1"])]}, world_size=2, timeout=300)
    broken = damaged(ck["acco4"], tmp_path)

    def load(name, cfg, **extra):
        return dict(config=cfg, steps=8, load=ck[name], export_shards=True, finalize=True, **extra)

    logs = {world: tmp_path / f"logs{world}" for world in (1, 2, 4)}
    weights_only = [dict(config=local("diloco", 1), steps=5, load=ck["diloco"], load_kwargs=kwargs,
                         record_committed=True) for kwargs in (
        {"load_optimizer_states": False, "load_lr_scheduler_states": False}, {"load_module_only": True})]
    two = launch({"runs": [load("acco4", ACCO, groups=True)] + [load(n, local_config(n, 1)) for n in LOCAL]
                  + [dict(config=ACCO, steps=8, load=path, groups=True, load_error=True) for _, path, _ in broken]
                  + weights_only}, world_size=2, timeout=400, workdir=logs[2])
    one = launch({"runs": [load("acco4", ACCO, groups=True)]}, world_size=1, timeout=200, workdir=logs[1])
    four = launch({"runs": [load("acco2", ACCO, groups=True), load("diloco1", local("diloco", 2)),
                            load("diloco", local("diloco", 1)), load("co2", local("co2", 1))]},
                  world_size=4, timeout=400, workdir=logs[4])

    zero, module = saved(ck["acco4"])
    check_round_mode(zero, module, [r[0] for r in two], 2)
    check_round_mode(zero, module, [r[0] for r in one], 1)
    check_round_mode(*saved(ck["acco2"]), [r[0] for r in four], 4)
    for i, name in enumerate(LOCAL, start=1):
        check_local(*saved(ck[name]), [r[i] for r in two], 2, 1, name)
    check_local(*saved(ck["diloco1"]), [r[1] for r in four], 4, 2, "diloco")
    check_local(*saved(ck["diloco"]), [r[2] for r in four], 4, 1, "diloco")
    check_local(*saved(ck["co2"]), [r[3] for r in four], 4, 1, "co2")

    # A partial or damaged checkpoint: every rank refuses it, naming the file and the fix.
    for j, (how, _, name) in enumerate(broken, start=1 + len(LOCAL)):
        for rank in range(2):
            err = two[rank][j]["load_error"]
            assert name in err, err
            assert ("is partial" in err and "copy it back" in err) if how == "missing" else \
                ("A file is probably truncated or corrupted: load an earlier tag" in err), err

    # The module weights alone load (the committed anchor) and the outer loop starts over from them.
    anchor = saved(ck["diloco"])[1]
    for rank in range(2):
        for r in two[rank][-2:]:
            assert torch.equal(r["loaded"]["params"], anchor), "the module weights are not the committed anchor"
            assert r["global_steps"] == 5
            assert torch.equal(r["committed"][0], anchor), "the outer loop kept the anchor it had before the load"

    # One warning per resharding load, on rank 0 only, saying what moved and what did not.
    text = (logs[2] / "rank0.log").read_text()
    lines = [line for line in text.splitlines() if "ACCO: resharded the checkpoint" in line]
    assert len(lines) == 1 + len(LOCAL), lines
    assert "from 4 data-parallel ranks to 2 data-parallel ranks: the fp32 master weights and the optimizer moments " \
           "are re-partitioned by ZeRO-1's rule; the committed weights are the saved ones. Dropped: " in lines[0]
    assert "rounds restart with a start-up round at the committed weights" in lines[0]
    assert "Not carried: per-rank random state" in lines[0]
    assert "from 2 replicas x 2 ranks to 2 replicas x 1 rank: the anchor and the outer momentum" in lines[1]
    assert "new replica g takes its weights, fp32 master and inner optimizer moments from old replica g mod 2" \
        in lines[1]
    assert "fragment 0's prepared pseudo-gradient mean (prepared again, blocking, at its sync)" in lines[3]
    assert "resharded" not in (logs[2] / "rank1.log").read_text()
    assert "to 1 data-parallel rank:" in (logs[1] / "rank0.log").read_text()
