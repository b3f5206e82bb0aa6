"""The rulebook (``acco_ds.config.rulebook``): one set of refusals for both hosts and for ``acco-ds plan``.

Unit cases name each rule's message; a hypothesis property runs the plan over random models, fleets, flags and
layouts and checks every row against the rulebook, rebuilt from what the plan prints; a launch on 4 CPU ranks
(2 nodes of 2) passes the plans' recommended blocks through ``deepspeed.initialize`` and checks that a refused
row is refused there with the plan's words."""

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import common
from acco_ds.config import Layout, parse_acco_config, refusals
from acco_ds.config.rulebook import replica_group_size, rules_markdown
from acco_ds.plan import command as plan_cli
from acco_ds.plan.report import plan
from dist import launch


def block(**acco):
    return parse_acco_config({"acco": {"enabled": True, **acco}})


@pytest.mark.parametrize("acco, layout, needle", [
    (dict(mode="acco"), Layout(world=2, micro_batches=3), "gradient_accumulation_steps must be even (got 3)"),
    (dict(mode="diloco"), Layout(world=4, ranks_per_node=4, micro_batches=2), "the whole data-parallel world"),
    (dict(mode="diloco"), Layout(world=16, ranks_per_node=8, tp=2, micro_batches=2), None),  # 2 replicas of 4
    (dict(mode="sync", accumulation="fixed", collectives={"ranks_per_node": 3}), Layout(world=4),
     "acco.collectives.ranks_per_node is 3, which does not divide the world size 4"),
    (dict(mode="acco", accumulation="adaptive"), Layout(world=4, pp=2, micro_batches=2),
     'accumulation="adaptive" cannot run with 2 pipeline stages'),
    (dict(mode="diloco"), Layout(world=8, ranks_per_node=4, moe=True, ep_sizes=(2,), tp=2, micro_batches=2),
     "ACCO with MoE layers does not support tensor or pipeline parallelism (tp 2 x pp 1)"),
    (dict(mode="acco", accumulation="adaptive"), Layout(world=4, moe=True, ep_sizes=(2,), micro_batches=2),
     'acco.accumulation="adaptive" cannot run with expert parallelism (ep_size 2)'),
    (dict(mode="diloco", local_sgd={"replica_group_size": 1}), Layout(world=4, moe=True, ep_sizes=(2,)),
     "ep_size 2 does not divide acco.local_sgd.replica_group_size 1"),
    (dict(mode="decoupled"), Layout(world=4, moe=True, ep_sizes=(2,)), None),  # a learner of 4 holds ep_size 2
    (dict(mode="decoupled", local_sgd={"replica_group_size": 1}), Layout(world=4, moe=True, ep_sizes=(2,)),
     "ep_size 2 does not divide acco.local_sgd.replica_group_size 1"),
    (dict(mode="decoupled"), Layout(world=8, ranks_per_node=4, pp=2), None),  # learners of 2 stages x 2 ranks
    (dict(mode="decoupled"), Layout(world=8, ranks_per_node=4, tp=2, pp=2), None),
    (dict(mode="decoupled"), Layout(world=8, ranks_per_node=4, tp=2, moe=True, ep_sizes=(2,)),
     "ACCO with MoE layers does not support tensor or pipeline parallelism (tp 2 x pp 1)"),
    (dict(mode="sparseloco"), Layout(world=16, ranks_per_node=4, tp=2, pp=2),
     'acco.mode "sparseloco" runs tensor or pipeline parallelism, not both'),
    (dict(mode="acco"), Layout(world=2, host="fsdp2", micro_batches=2), 'mode "acco" does not run on an FSDP2 model'),
    (dict(mode="sync"), Layout(world=4, tp=2, host="torch"), "acco_ds.torch runs data parallelism only"),
    (dict(mode="sync"), Layout(world=2, sequence_parallel=2), "does not support sequence parallelism (size 2)"),
])
def test_each_rule_names_its_refusal(acco, layout, needle):
    found = refusals(block(**acco), layout)
    if needle is None:
        assert found == []
    else:
        assert any(needle in text for text in found), found


def test_layouts_read_no_environment_but_the_launch(monkeypatch):
    """The same layout gets the same answer inside and outside a launch; only ``Layout.launch`` reads the
    launcher's ranks per node. The default replica is a node's data-parallel ranks, whatever tp x pp."""
    acco = block(mode="diloco")
    fleet = Layout(world=16, ranks_per_node=8, tp=2, micro_batches=2)
    outside = refusals(acco, fleet)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert refusals(acco, fleet) == outside == []
    assert replica_group_size(acco, fleet) == 4
    assert Layout.launch(16, tp=2).ranks_per_node == 2 and replica_group_size(acco, Layout.launch(16, tp=2)) == 1
    assert refusals(block(enabled=False), Layout(world=3, micro_batches=3)) == []  # a disabled block runs as stock


def test_the_rules_are_listed_on_the_plan_page():
    """docs/plan.md lists the refusals as ``python -m acco_ds.config.reference`` writes them."""
    from pathlib import Path
    page = (Path(common.__file__).resolve().parents[1] / "docs" / "plan.md").read_text()
    assert rules_markdown() in page


FLEETS = st.sampled_from([(1, 8), (2, 1), (2, 2), (2, 8), (4, 4), (8, 8), (16, 8)])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleet=FLEETS, params=st.sampled_from(["125m", "1b", "7b", "47b", "70b"]),
       moe=st.sampled_from([None, 0.25]), bandwidth=st.sampled_from(["10mbit", "1gbit", "100gbit"]),
       memory=st.sampled_from([None, "80gb"]), layout=st.sampled_from([None, (1, 1), (2, 1), (1, 2), (2, 2)]),
       tokens=st.sampled_from(["1m", "4m", "16m"]), shape=st.booleans())
def test_the_plan_never_recommends_what_the_rulebook_refuses(fleet, params, moe, bandwidth, memory, layout, tokens,
                                                            shape):
    nodes, per_node = fleet
    flags = ["--params", params, "--tokens-per-step", tokens, "--nodes", str(nodes), "--ranks-per-node",
             str(per_node), "--rank-flops", "989tflops", "--inter-bandwidth", bandwidth]
    if moe:
        flags += ["--active-params", str(int(plan_cli.parse_count(params, "p") * moe))]
    if memory:
        flags += ["--gpu-memory", memory]
    if shape:
        flags += ["--seq-len", "2048", "--micro-batch", "1"]
    if layout:
        flags += ["--tp", str(layout[0]), "--pp", str(layout[1])]
    try:
        inp, gas, accum, search = plan_cli.inputs_from(plan_cli.parser().parse_args(flags))
    except plan_cli.PlanError:
        return  # a layout that does not tile this fleet: refused by the flags, with its own test
    result = plan(inp, gas, accum, **search)
    for row in result["modes"]:  # the rulebook at the row's layout, rebuilt from what the plan prints
        moe_row = bool(moe)
        ep = per_node // (row["tp"] * row["pp"]) if moe_row and row["tp"] * row["pp"] == 1 else 1
        here = Layout(world=nodes * per_node, ranks_per_node=per_node, tp=row["tp"], pp=row["pp"], moe=moe_row,
                      ep_sizes=(ep,) if moe_row else (), micro_batches=row["gradient_accumulation_steps"])
        said = refusals(parse_acco_config({"acco": row["acco"]}), here)
        assert ("; ".join(said) or None) == row["refused"], (row["name"], row["tp"], row["pp"], said)
        if row["name"] == result["recommended"]:
            assert said == [] and row["fits"], row
        if row["acco"].get("mode") == "acco":
            assert row["gradient_accumulation_steps"] % 2 == 0
        for key, value in row["acco"].get("local_sgd", {}).items():
            assert not (isinstance(value, float) and value <= 0), (key, value)  # nothing rounded to invalid
    if result["recommended"] is None:
        assert any("no row is recommended" in n or "nothing fits" in n for n in result["notes"])


def four_rank_plan(*flags) -> dict:
    """A plan for 2 nodes of 2 CPU ranks (the launch below), as JSON."""
    base = ["--params", "2m", "--tokens-per-step", "64k", "--nodes", "2", "--ranks-per-node", "2",
            "--rank-flops", "1tflops", "--inter-bandwidth", "10mbit"]
    inp, gas, accum, search = plan_cli.inputs_from(plan_cli.parser().parse_args(base + list(flags)))
    return json.loads(json.dumps(plan(inp, gas, accum, **search)))


def row(result: dict, mode=None) -> dict:
    """The recommended row, or the first row of ``mode``."""
    return next(r for r in result["modes"] if (r["acco"].get("mode") == mode if mode else
                                                r["name"] == result["recommended"]))


@pytest.mark.slow
def test_recommended_blocks_initialize_and_refused_ones_are_refused_in_the_plans_words(monkeypatch):
    dense, moe = four_rank_plan(), four_rank_plan("--inter-bandwidth", "100mbit", "--active-params", "1m")
    picked = {"dense": row(dense), "moe": row(moe), "decoupled": row(dense, mode="decoupled")}
    refused = [r for r in moe["modes"] if r["refused"] and r["tp"] * r["pp"] == 1]  # the launch runs tp 1 x pp 1
    assert (picked["dense"]["mode"], picked["moe"]["name"]) == ("sparseloco", "dpu int8") and refused
    assert all(r["refused"] is None for r in picked.values()), picked
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # the launch's 4 ranks as the plan's 2 nodes of 2

    def run(r, model, **extra):
        cfg = common.ds_config(gas=r["gradient_accumulation_steps"])
        cfg["acco"] = r["acco"]
        return dict(config=cfg, model=model, steps=2, **extra)
    runs = [run(picked["dense"], "tiny"), run(picked["moe"], "moe"), run(picked["decoupled"], "tiny"),
            run(refused[0], "moe", init_error=True)]
    results = launch({"runs": runs}, world_size=4, timeout=240)
    for rank in range(4):
        for i in range(3):
            losses = results[rank][i]["losses"]
            assert len(losses) >= 2 and all(math.isfinite(x) for x in losses), (rank, i, runs[i]["config"]["acco"])
        error = results[rank][3]["init_error"]
        for part in refusals(parse_acco_config({"acco": refused[0]["acco"]}),
                             Layout(world=4, ranks_per_node=2, tp=refused[0]["tp"], pp=refused[0]["pp"], moe=True,
                                    ep_sizes=(2,), micro_batches=refused[0]["gradient_accumulation_steps"])):
            assert part in error, (part, error)
        assert refused[0]["refused"].split("; ")[0] in error
