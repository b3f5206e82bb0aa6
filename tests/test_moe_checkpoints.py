"""Checkpoints of a model with MoE layers loaded on another data-parallel size (``ep_size`` kept), and replicas
that come and go healing expert weights (``acco.fault_tolerance``).

Resharding: each expert group is partitioned over its expert-data-parallel group (the ranks at one position of
every expert-parallel run of ``ep_size`` consecutive ranks); a resharding load regathers it over the old such
group and re-splits it over the new one. acco and sync saved on 4 ranks (ep_size 2) and loaded on 2, acco saved
on 2 and loaded on 4, diloco grown and shrunk in replicas of 2: what each rank holds after the load is compared
with a stock-style repartition of the saved files, bit for bit, and training goes on. Healing: a replica that
joins late takes every rank's expert partitions from the rank in the same position of a live replica."""

from pathlib import Path

import pytest
import torch

import common
from dist import launch
from ft import Fleet
from test_reshard import split, stock_partition
from acco_ds.runtime.reshard import Layout, Plan

EP, GAS = common.MOE_EP, 2
SAVED_AT = 11  # acco and sync save after 11 micro-batches per rank (gas 2: one unfinished step in flight)


def expert_plan(old_world, old_k, new_world, new_k, rank, n, strides, local=False):
    return Plan(old_world=old_world, old_k=old_k, new_world=new_world, new_k=new_k, rank=rank, local=local,
                layouts=lambda ways: [Layout.zero(m, ways) for m in n], strides=strides)


@pytest.mark.parametrize("old_world, old_k, new_world, new_k, local", [
    (4, 4, 2, 2, False), (2, 2, 4, 4, False), (4, 4, 8, 8, False), (4, 2, 2, 2, True), (2, 2, 8, 4, True),
    (8, 4, 4, 2, True)])
def test_plan_regathers_each_expert_group_over_its_expert_data_parallel_group(old_world, old_k, new_world,
                                                                              new_k, local):
    """Group 0 dense (over the replica), group 1 an expert group of ep_size 2: position j of every old replica
    holds its own experts (``experts[replica][j]``), split over the old replica's ranks at position j."""
    n, m = 146, 37
    replicas = old_world // old_k
    dense = [torch.randn(n) for _ in range(replicas)]
    experts = [[torch.randn(m) for _ in range(EP)] for _ in range(replicas)]
    per_rank = []  # per old rank: [dense piece, expert piece] and an inner state of each
    for rank in range(old_world):
        g, s = divmod(rank, old_k)
        pieces = [split(dense[g], n, old_k, unpadded=True)[s], split(experts[g][s % EP], m, old_k // EP)[s // EP]]
        per_rank.append(pieces)
    for rank in range(new_world):
        plan = expert_plan(old_world, old_k, new_world, new_k, rank, (n, m), (1, EP), local)
        old = per_rank[plan.source * old_k:(plan.source + 1) * old_k]
        got = plan.piece(old)
        s = rank % new_k
        assert torch.equal(got[0], stock_partition(split(dense[plan.source], n, old_k), n, new_k, s))
        want = stock_partition(split(experts[plan.source][s % EP], m, old_k // EP), m, new_k // EP, s // EP)
        assert torch.equal(got[1], want), (rank, "expert")
        inner = plan.inner_state([[{"step": torch.tensor(3.0), "exp_avg": p} for p in r] for r in old])
        assert torch.equal(inner[1]["exp_avg"], want) and inner[1]["step"] == 3.0
    assert "each expert group (its ep_size kept) is regathered over its old expert-data-parallel group" in \
        plan.message("c")
    assert "expert" not in expert_plan(4, 4, 2, 2, 0, (n,), None).message("c")
    with pytest.raises(ValueError, match="expert-parallel size of 4 does not divide a replica of 4 .saved. or 2"):
        expert_plan(4, 4, 2, 2, 0, (n, m), (1, 4))


def moe_config(mode, k=None):
    acco = {"mode": mode}
    if k is not None:
        acco["local_sgd"] = {"sync_every": 2, "replica_group_size": k}
    return common.ds_config(acco=acco, gas=GAS)


def saved(ckpt, world, ep=EP):
    """The ZeRO files' optimizer states (one per data-parallel rank), and per expert-parallel position the module
    weights a rank there loads (the model-states file's dense weights, its experts from DeepSpeed's per-expert
    files), flattened in ``module.state_dict()`` order."""
    ckpt = Path(ckpt)
    tag = ckpt / (ckpt / "latest").read_text().strip()
    zero = [torch.load(tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt", weights_only=False)
            ["optimizer_state_dict"] for r in range(world)]
    dense = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    module = []
    for j in range(ep):
        flat = []
        for name in common.MoENet(ep).state_dict():
            if ".deepspeed_experts." in name:
                head, tail = name.split(".deepspeed_experts.")
                local, what = tail.split(".")
                expert = j * (common.MOE_EXPERTS // ep) + int(local)
                key = f"{head}.deepspeed_experts.{expert}.{what}"
                flat.append(torch.load(tag / f"layer_0_expert_{expert}_mp_rank_00_model_states.pt",
                                       weights_only=False)[key])
            else:
                flat.append(dense[name])
        module.append(torch.cat([t.float().reshape(-1) for t in flat]))
    return zero, module


def old_pieces(zero, key, g, ranks, expert, ep):
    """Group ``g``'s pieces under ``key`` of the old ``ranks`` (one replica) that make the group a new rank at
    position ``expert`` (None: dense) holds."""
    ranks = ranks if expert is None else ranks[expert::ep]
    if key == "master":
        return [zero[r]["single_partition_of_fp32_groups"][g] for r in ranks]
    if key in ("anchor", "momentum"):
        return [zero[r]["acco"]["outer"][key][g] for r in ranks]
    return [zero[r]["base_optimizer_state"]["state"][g][key] for r in ranks]


def check_load(zero, module, results, world, k, local, ep=EP):
    """Right after the load, on every rank: the committed weights are the saved ones; the fp32 masters, Adam's
    moments (and in a local-SGD mode the anchor and outer momentum of old replica 0) a stock repartition of
    the saved pieces, each expert group over the old ranks at this rank's position; Adam's step the saved one."""
    old_k = zero[0]["acco"]["outer"]["k"] if local else len(zero)
    for rank in range(world):
        r, (replica, shard) = results[rank], divmod(rank, k)
        source = replica % (len(zero) // old_k)
        mine, first = list(range(source * old_k, (source + 1) * old_k)), list(range(old_k))
        assert torch.equal(r["loaded"]["params"], module[rank % ep]), f"rank {rank}: the committed weights changed"
        for g in range(2):  # 0: dense, 1: the expert group
            expert = None if g == 0 else shard % ep
            ways, index = (k, shard) if g == 0 else (k // ep, shard // ep)
            n = sum(p.numel() for p in old_pieces(zero, "master", g, mine, expert, ep))  # saved without padding
            got = {"master": r["loaded"]["masters"][g], **{key: r["loaded"]["inner"][g][key]
                                                           for key in ("exp_avg", "exp_avg_sq")}}
            if local:
                got.update({key: r["loaded"]["outer"][key][g] for key in ("anchor", "momentum")})
            for key, value in got.items():
                pieces = old_pieces(zero, key, g, first if key in ("anchor", "momentum") else mine, expert, ep)
                assert torch.equal(value, stock_partition(pieces, n, ways, index)), (world, k, rank, g, key)
            assert r["loaded"]["inner"][g]["step"] == zero[0]["base_optimizer_state"]["state"][g]["step"]


def check_trained_on(results, world, steps, ep=EP):
    """Training went on after the load: every rank reached ``steps``, and the ranks that hold the same experts
    (same position) end on the same committed weights."""
    for rank in range(world):
        assert results[rank]["global_steps"] >= steps
        assert torch.equal(results[rank]["final_params"], results[rank % ep]["final_params"]), rank
    assert ep == 1 or not torch.equal(results[0]["final_params"], results[1]["final_params"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_moe_checkpoints_load_on_another_data_parallel_size(tmp_path):
    """ep_size 2: acco and sync 4 -> 2 ranks, acco 2 -> 4, diloco 2 replicas x 2 ranks -> 4 x 2 (replicas hold
    a multiple of ep_size). ep_size 1 (every rank holds the 4 experts, partitioned over its replica): diloco
    2 x 2 -> 2 x 1 and 2 x 1 -> 2 x 2. Another ep_size is refused by name."""
    ck = {name: str(tmp_path / name) for name in ("acco4", "sync4", "diloco4", "acco2", "diloco2", "ep2x2")}

    def run(name, mode, model="moe", k=None, **extra):
        if "save" not in extra and "load" not in extra:
            extra = dict(extra, save=ck[name])
        return dict(config=moe_config(mode, k), model=model, **extra)

    launch({"runs": [run("acco4", "acco", steps=100, max_micro=SAVED_AT), run("sync4", "sync", steps=100,
                                                                             max_micro=SAVED_AT),
                     run("diloco4", "diloco", "moe_ep1", 2, steps=3), run("ep2x2", "diloco", k=2, steps=3)]},
           world_size=4, timeout=300)
    launch({"runs": [run("acco2", "acco", steps=100, max_micro=SAVED_AT), run("diloco2", "diloco", "moe_ep1", 1,
                                                                              steps=3)]},
           world_size=2, timeout=300)

    def load(name, mode, model="moe", k=None):
        return run(name, mode, model, k, steps=8, load=ck[name], export_shards=True, finalize=True)

    logs = tmp_path / "logs2"
    two = launch({"runs": [load("acco4", "acco"), load("sync4", "sync"), load("diloco4", "diloco", "moe_ep1", 1),
                           run("acco4", "acco", "moe_ep1", steps=8, load=ck["acco4"], load_error=True)]},
                 world_size=2, timeout=300, workdir=logs)
    four = launch({"runs": [load("acco2", "acco"), load("diloco2", "diloco", "moe_ep1", 2)]}, world_size=4,
                  timeout=300)
    eight = launch({"runs": [load("ep2x2", "diloco", k=2)]}, world_size=8, timeout=300)

    cases = [("acco4", 2, two, 0, 2, EP), ("sync4", 2, two, 1, 2, EP), ("diloco4", 2, two, 2, 1, 1),
             ("acco2", 4, four, 0, 4, EP), ("diloco2", 4, four, 1, 2, 1), ("ep2x2", 8, eight, 0, 2, EP)]
    for name, world, launched, i, k, ep in cases:
        results = [r[i] for r in launched]
        zero, module = saved(ck[name], 2 if name in ("acco2", "diloco2") else 4, ep)
        check_load(zero, module, results, world, k, k < world, ep)  # k < world: replicas
        check_trained_on(results, world, 8, ep)
    for rank in range(2):  # another ep_size: refused by name on every rank
        assert "changing ep_size" in two[rank][3]["load_error"], two[rank][3]["load_error"]
    text = (logs / "rank0.log").read_text()
    lines = [line for line in text.splitlines() if "ACCO: resharded the checkpoint" in line]
    assert len(lines) == 3, lines
    assert all("each expert group (its ep_size kept) is regathered" in x for x in lines[:2]), lines


def ft_config():
    return common.ds_config(acco={"mode": "diloco", "local_sgd": {"sync_every": 2}, "fault_tolerance": {
        "min_replicas": 1, "timeout_s": 20, "quorum_timeout_s": 120}}, gas=GAS)


def test_a_replica_of_another_ep_size_is_not_healed(monkeypatch):
    """A healing rank takes rank i's expert shards only from a replica with the same ep_size (rank i holds
    the same experts there): another ep_size is refused by name, as another replica size is."""
    from types import SimpleNamespace
    from acco_ds.config import parse_acco_config
    from acco_ds.config import Layout, refusals
    from acco_ds.runtime.outer import fault_tolerance
    from acco_ds.runtime.outer.diloco import DiLoCo
    assert refusals(parse_acco_config(ft_config()), Layout(world=4, moe=True, ep_sizes=(2,))) == []
    sizes = {None: 4, "edp": 2}  # a replica of 4 ranks, its experts split over 2: ep_size 2
    monkeypatch.setattr(fault_tolerance.tdist, "get_world_size", lambda group=None: sizes[group])
    loop = object.__new__(DiLoCo)
    loop.shards = SimpleNamespace(gather=[None, (1, "edp", "side")])
    assert loop._ep_sizes() == [2]
    for theirs, words in (([1], "have ep_size [2] but the replica it heals from has [1]"),
                          ([], "has none (no MoE)")):
        with pytest.raises(ValueError, match=r"every replica must run the same model and ep_size") as err:
            loop.heal_load({"replica_size": 4, "ep_sizes": theirs})
        assert words in str(err.value), str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_replica_that_joins_late_heals_its_expert_shards(tmp_path):
    """torchft, diloco, two replicas of 2 ranks with ep_size 2 (rank i of each holds experts 2i and 2i+1).
    Replica 1 joins after replica 0 synced twice alone: each of its ranks takes its expert shards (anchor, outer
    momentum, Adam's state) with the dense ones from rank i of replica 0. Right after the join it stands on
    replica 0's committed weights, experts included, and both replicas end on the same committed weights after
    the same syncs."""
    spec = {"config": ft_config(), "model": "moe", "syncs": 10_000, "sleep_per_step": 0.2}
    with Fleet(tmp_path, min_replicas=1) as fleet:
        fleet.start("r0", spec, ranks=2)
        fleet.wait_for(lambda: fleet.syncs("r0") >= 2, 240, "two syncs of replica 0 alone")
        fleet.start("r1", spec, ranks=2)
        fleet.wait_for(lambda: fleet.syncs("r1") >= 0, 240, "replica 1 to join")
        joined = fleet.syncs("r1")
        fleet.wait_for(lambda: fleet.syncs("r1") >= joined + 2, 120, "two syncs after the join")
        fleet.control(stop_at_syncs=max(fleet.syncs("r0"), fleet.syncs("r1")) + 1)
        assert [fleet.wait(r, 240) for r in ("r0", "r1")] == [[0, 0], [0, 0]], fleet.logs("r0") + fleet.logs("r1")
    finals = []
    for rank in range(2):
        r0, r1 = fleet.result("r0", rank), fleet.result("r1", rank)
        assert r1["syncs_at_join"] >= 2 and r1["stats"]["heals"] == 1 and r1["stats"]["heal_bytes"] > 0
        assert r1["steps_at_join"] > 0, "the healed replica's step counter is its peer's"
        assert any(torch.equal(r1["committed"][0], c) for c in r0["committed"]), "not healed to replica 0's model"
        assert r0["acco_syncs"] == r1["acco_syncs"] and torch.equal(r0["final"], r1["final"]), rank
        finals.append(r0["final"])
    assert not torch.equal(finals[0], finals[1]), "the two ranks hold the same experts: the test would not see it"
