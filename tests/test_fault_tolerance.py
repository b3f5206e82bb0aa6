"""Replicas that come and go (``acco.fault_tolerance``, torchft): each replica its own launch, joined through a
torchft lighthouse. Without failures a run equals the float64 simulator; a replica killed mid-period stops
nobody; one killed inside an outer all-reduce makes every survivor discard that sync (anchor unchanged bit
for bit) and commit the next; a relaunched replica heals from a live one and every replica ends on the
same committed weights; bad settings and bad luck give errors that name the fix."""

import time

import pytest
import torch

import common
from acco_ds.config import ACCOConfig, Layout, parse_acco_config, refusals
from acco_ds.config import FaultToleranceConfig
from acco_ds.testing.simulator import simulate_local_sgd
from dist import free_port
from ft import Fleet
from test_engine import assert_matches

GAS, H = 2, 2


def ft_config(mode="diloco", min_replicas=1, sync_every=H, **ft):
    local = {"sync_every": sync_every}
    return common.ds_config(acco={"mode": mode, "local_sgd": local,
                                  "fault_tolerance": {"min_replicas": min_replicas, "timeout_s": 20,
                                                      "quorum_timeout_s": 120, **ft}}, gas=GAS)


def reference(mode, replicas, k, steps):
    s = ACCOConfig(enabled=True, mode=mode, local_sgd={"sync_every": H}).outer
    return simulate_local_sgd(mode, common.make_model(0), common.loss_fn, common.micro_batch, world_size=replicas * k,
                              group_size=k, gradient_accumulation_steps=GAS, steps=steps, sync_every=H,
                              optimizer_fn=common.reference_optimizer("AdamW"), outer_lr=s["outer_lr"],
                              outer_momentum=s["outer_momentum"], nesterov=s["nesterov"],
                              staleness_penalty=s["staleness_penalty"], dtype=torch.float64)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_without_failures_a_fault_tolerant_run_equals_the_simulator(tmp_path):
    """diloco with 2 replicas of 2 ranks (the start-up quorum heals each rank of one replica from the other), and
    co2 with 2 replicas of 1 rank (the pseudo-gradient in flight through torchft's works), side by side: every
    rank's replica and the committed anchor match the float64 simulator after every inner step."""
    steps = 6
    with Fleet(tmp_path / "diloco", min_replicas=2) as a, Fleet(tmp_path / "co2", min_replicas=2) as b:
        for r in ("r0", "r1"):
            a.start(r, {"config": ft_config("diloco", min_replicas=2), "steps": steps}, ranks=2)
            b.start(r, {"config": ft_config("co2", min_replicas=2), "steps": steps}, ranks=1)
        for fleet, k in ((a, 2), (b, 1)):
            assert [fleet.wait(r, 360) for r in ("r0", "r1")] == [[0] * k, [0] * k], fleet.logs("r0")
    for fleet, mode, k in ((a, "diloco", 2), (b, "co2", 1)):
        ref = reference(mode, 2, k, steps)
        for g in range(2):
            for rank in range(k):
                got = fleet.result(f"r{g}", rank)
                assert got["global_steps"] == steps
                assert_matches(got["params"], ref["replicas"][g])
                assert_matches(got["committed"], ref["anchor"])
                s = got["stats"]
                assert s["participants_min"] == s["participants_max"] == 2 and s["syncs_discarded"] == 0
        for rank in range(k):  # the start-up quorum heals rank r of every replica but one
            assert sum(fleet.result(f"r{g}", rank)["stats"]["heals"] for g in range(2)) == 1
        assert fleet.result("r0")["acco_syncs"] == steps // H
        labels = [label for label, _ in fleet.result("r0")["report"]]
        assert "fault tolerance" in labels


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_sparseloco_without_failures_equals_the_simulator(tmp_path):
    """sparseloco's payloads (their indices differ per replica) cross torchft as one all-reduce of a buffer with
    a slot per replica. 2 replicas of 2 ranks, 2-bit values, a chunk straddling the ZeRO-1 partitions, the
    start-up quorum healing one replica: every rank's replica, the committed anchor and the residual norm match
    the float64 simulator after every inner step; each sync hands torchft twice the payload (two slots)."""
    from acco_ds.ops.reference import chunk_offsets, sparse_payload_bytes
    from test_sparseloco import CASES, SIZES, block
    from test_sparseloco import reference as sparse_reference
    # packed payloads (entropy_coding null): their length is fixed, so the bytes below are exact (the zlib
    # coding's lengths depend on the data; the discarded-sync test below runs it)
    steps, sparse = 6, dict(CASES[1], entropy_coding=None)
    cfg = common.ds_config(acco={**block(2, **sparse), "fault_tolerance": {
        "min_replicas": 2, "timeout_s": 20, "quorum_timeout_s": 120}}, gas=GAS)
    with Fleet(tmp_path, min_replicas=2) as fleet:
        for r in ("r0", "r1"):
            fleet.start(r, {"config": cfg, "steps": steps}, ranks=2)
        assert [fleet.wait(r, 360) for r in ("r0", "r1")] == [[0, 0], [0, 0]], fleet.logs("r0") + fleet.logs("r1")
    ref = sparse_reference(4, 2, **sparse)
    payload = sparse_payload_bytes(chunk_offsets(SIZES, sparse["chunk"]), sparse["topk"], sparse["value_bits"])
    for g in range(2):
        for rank in range(2):
            got = fleet.result(f"r{g}", rank)
            assert got["global_steps"] == steps
            assert_matches(got["params"], ref["replicas"][g])
            assert_matches(got["committed"], ref["anchor"])
            s = got["stats"]
            assert s["participants_min"] == s["participants_max"] == 2 and s["syncs_discarded"] == 0
            want = float(ref["errors"][g][-1].norm())
            assert abs(s["sparse_residual_norm"] - want) <= 1e-4 * want, (s["sparse_residual_norm"], want)
        # the join and the syncs: two slots of each rank's packed payload (a tag byte each)
        stats = [fleet.result(f"r{g}", rank)["stats"] for rank in range(2)]
        assert sum(s["sparse_payload_bytes"] for s in stats) == payload + 1
        assert sum(s["outer_bytes"] for s in stats) == (1 + steps // H) * 2 * (payload + 1), (stats, payload)
    for rank in range(2):  # the start-up quorum heals rank r of one replica
        assert sum(fleet.result(f"r{g}", rank)["stats"]["heals"] for g in range(2)) == 1
    assert fleet.result("r0")["acco_syncs"] == steps // H


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_sparseloco_sync_discarded_by_a_death_leaves_anchor_and_error_buffers_alone(tmp_path):
    """Two sparseloco replicas of one rank; replica 1 is SIGKILLed inside a sync's gather (torchft's all-reduce).
    The survivor discards that sync: its anchor and its error-feedback buffer stay bit for bit as they were
    before the sync (its progress goes into the next sync's pseudo-gradient), and its next sync commits alone."""
    cfg = common.ds_config(acco={"mode": "sparseloco", "local_sgd": {"sync_every": H, "chunk": 16, "topk": 4},
                                 "fault_tolerance": {"min_replicas": 1, "timeout_s": 20, "quorum_timeout_s": 120}},
                           gas=GAS)
    slow = {"sleep_per_step": 0.5, "syncs": 10_000}

    with Fleet(tmp_path, min_replicas=1) as fleet:
        fleet.start("r0", {"config": cfg, **slow})
        fleet.start("r1", {"config": cfg, **slow})
        fleet.wait_for(lambda: fleet.syncs("r1") >= 2, 240, "two syncs of both replicas")
        fleet.control(die={"r1": fleet.syncs("r1") + 1})
        assert fleet.wait("r1", 120) == [-9], "replica 1 was to die inside a gather"
        died_at = fleet.syncs("r0")
        fleet.wait_for(lambda: fleet.syncs("r0") >= died_at + 2, 120, "the survivor to commit after the discarded sync")
        fleet.control(stop_at_syncs=fleet.syncs("r0") + 1)
        assert fleet.wait("r0", 240) == [0], fleet.logs("r0")
    r0 = fleet.result("r0")
    synced = [q for q in r0["quorums"] if not q["join"]]
    discarded = [q for q in synced if not q["committed"]]
    assert len(discarded) == 1 and r0["stats"]["syncs_discarded"] == 1, [q["committed"] for q in synced]
    q = discarded[0]
    assert all(torch.equal(a, b) for a, b in zip(q["anchor_before"], q["anchor_after"]))
    assert all(torch.equal(a, b) for a, b in zip(q["error_before"], q["error_after"]))
    assert any(e.abs().sum() > 0 for e in q["error_before"]), "the error buffer held nothing: the test would not see it"
    after = synced[synced.index(q) + 1]
    assert after["committed"] and after["participants"] == 1
    assert not all(torch.equal(a, b) for a, b in zip(after["error_before"], after["error_after"]))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_replicas_that_die_stop_nobody_and_a_relaunched_one_heals(tmp_path):
    """Three replicas of one rank, diloco, joiners waiting for the next sync (``join: "next_sync"``). Replica 2
    is SIGKILLed mid-period: the survivors' syncs go on with two participants while it is dead. Its relaunch
    heals from a live replica (it starts at their sync count and step count) and trains on. Then replica 1
    dies inside an outer all-reduce: that sync is discarded on both survivors, whose anchor it leaves bit for
    bit as it was, and their next sync commits. The survivors end on the same committed weights after the
    same syncs, exit code 0, no period ended early."""
    slow = {"sleep_per_step": 0.5, "syncs": 10_000}  # the test says when to stop (control.json)
    config = ft_config(join="next_sync")

    with Fleet(tmp_path, min_replicas=1) as fleet:
        fleet.start("r0", {"config": config, **slow})
        fleet.start("r1", {"config": config, **slow})
        fleet.start("r2", {"config": config, "die_at_micro": 9, **slow})  # mid-period 3
        assert fleet.wait("r2", 240) == [-9], "replica 2 was to die mid-period"
        dead_at = fleet.syncs("r0")
        fleet.wait_for(lambda: fleet.syncs("r0") >= dead_at + 2, 120, "the survivors to sync on without replica 2")
        fleet.start("r2_again", {"config": config, **slow}, replica_id=2)
        fleet.wait_for(lambda: fleet.syncs("r2_again") >= 0, 240, "the relaunched replica to join")
        joined = fleet.syncs("r2_again")  # written right after its join: the survivors' count
        fleet.wait_for(lambda: fleet.syncs("r2_again") > joined, 60, "a sync of the relaunched replica after its join")
        fleet.control(die={"r1": fleet.syncs("r1") + 1})
        assert fleet.wait("r1", 120) == [-9], "replica 1 was to die inside an all-reduce"
        died_at = fleet.syncs("r0")
        fleet.wait_for(lambda: fleet.syncs("r0") >= died_at + 2, 120,
                       "the survivors to commit after the discarded sync")
        fleet.control(stop_at_syncs=max(fleet.syncs("r0"), fleet.syncs("r2_again")) + 2)
        codes = [fleet.wait(r, 240) for r in ("r0", "r2_again")]
        assert codes == [[0], [0]], fleet.logs("r0") + fleet.logs("r2_again")
    r0, r2 = fleet.result("r0"), fleet.result("r2_again")
    # Replica 2 was dead for at least two syncs of the survivors, who synced with two participants.
    while_dead = [s for s in r0["syncs"] if dead_at < s["syncs"] <= dead_at + 2]
    assert len(while_dead) == 2 and all(s["participants"] == 2 for s in while_dead), r0["syncs"]
    # The relaunch healed: it joined at the survivors' count with their step count; state came over the wire.
    assert r2["syncs_at_join"] > dead_at and r2["stats"]["heals"] == 1 and r2["stats"]["heal_bytes"] > 0
    assert r2["steps_at_join"] > 0, "the healed replica's step counter is its peer's"
    # Replica 1 died inside an all-reduce: that sync was discarded on every survivor, nothing applied.
    for survivor in (r0, r2):
        discarded = [q for q in survivor["quorums"] if not q["committed"]]
        assert len(discarded) == 1 and survivor["stats"]["syncs_discarded"] == 1, survivor["quorums"]
        q = discarded[0]
        assert all(torch.equal(a, b) for a, b in zip(q["anchor_before"], q["anchor_after"]))
        after = survivor["quorums"][survivor["quorums"].index(q) + 1]
        assert after["committed"] and after["participants"] == 2
    # Both survivors end on one model, after the same syncs.
    assert r0["acco_syncs"] == r2["acco_syncs"]
    assert torch.equal(r0["final"], r2["final"])
    assert not torch.equal(r0["final"], r0["committed"][0])
    assert r0["stats"]["join"] == "next_sync" and r0["stats"]["early_syncs"] == 0
    # Every period ran its H steps (a discarded sync's period is followed by the next: 2H between commits).
    assert all((b["global_steps"] - a["global_steps"]) % H == 0 for a, b in zip(r0["syncs"], r0["syncs"][1:]))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replica_under_acco_ds_warm_restarts_forked_and_joins_early(tmp_path):
    """Two replicas of two ranks. Replica 1 runs under ``acco_ds.cli.warm`` (a parent that imported torch,
    DeepSpeed, acco_ds and torchft once), and its ranks SIGKILL themselves mid-period. The launcher forks them
    again: each new rank is another process that found those modules imported. The period is 1000 steps, far
    beyond the test: both ranks of replica 0 end it at the same inner step for the joiner (``join: "early"``,
    the default), which heals rank by rank from replica 0 (its sync count and step count); all four ranks end
    on the same committed weights after the same syncs, every launch exiting 0."""
    slow = {"sleep_per_step": 0.3, "syncs": 10_000}
    config = ft_config(min_replicas=2, sync_every=1000)  # 2: the last sync, mid-period, waits for both
    with Fleet(tmp_path, min_replicas=2) as fleet:
        fleet.start("r0", {"config": config, **slow}, ranks=2)
        fleet.start("r1", {"config": config, "die_at_micro": 9, **slow}, ranks=2,
                    warm=["--restarts", "1", "--restart_delay_s", "1"])
        fleet.wait_for(lambda: "restart 1 of 1" in fleet.logs("r1"), 240, "acco_ds.cli.warm to restart replica 1")
        dead_at = fleet.syncs("r0")
        fleet.wait_for(lambda: fleet.progress("r1").get("restart") == 1, 240, "the restarted ranks to join")
        time.sleep(2.0)  # a few inner steps of both after the join
        fleet.control(stop_at_syncs=max(fleet.syncs("r0"), fleet.syncs("r1")))
        assert [fleet.wait(r, 240) for r in ("r0", "r1")] == [[0, 0], [0]], fleet.logs("r1")
        log = (tmp_path / "r1.rank0.log").read_text()
    assert "was killed by SIGKILL" in log and log.count("imported torch, deepspeed, acco_ds, torchft") == 1, log
    for rank in range(2):
        r0, r1 = fleet.result("r0", rank), fleet.result("r1", rank)
        assert r1["restart"] == 1 and r1["preloaded"] == ["acco_ds", "deepspeed", "torch", "torchft"]
        assert not {"torch", "deepspeed", "torchft"} & set(r0["preloaded"]), "a fresh rank imports them itself"
        assert r1["syncs_at_join"] > dead_at and r1["stats"]["heals"] == 1 and r1["steps_at_join"] > 0
        assert r0["acco_syncs"] == r1["acco_syncs"] and torch.equal(r0["final"], r1["final"])
        # No period reached its 1000 steps: replica 0 synced once before the end, to take the relaunch in.
        assert r0["stats"]["join"] == "early" and r0["stats"]["early_syncs"] == 1 and r0["global_steps"] < 1000
        assert r0["syncs_at_join"] == 0 and r1["syncs_at_join"] == 1, r0["syncs"]
    steps = [[s["global_steps"] for s in fleet.result("r0", rank)["syncs"]] for rank in range(2)]
    assert len(steps[0]) == 1 and steps[0] == steps[1], "both ranks of replica 0 ended the period at one step"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_no_quorum_says_so_while_waiting_then_raises(tmp_path):
    """min_replicas 2 with one replica: a progress line every 10 s, then an error after quorum_timeout_s that
    names the lighthouse, min_replicas and the fix; the replica exits non-zero instead of hanging."""
    cfg = ft_config(min_replicas=2)
    cfg["acco"]["fault_tolerance"]["quorum_timeout_s"] = 12
    with Fleet(tmp_path, min_replicas=2) as fleet:
        fleet.start("r0", {"config": cfg, "steps": 2})
        t0 = time.monotonic()
        codes = fleet.wait("r0", 200)
        log = fleet.logs("r0", tail=20000)
    assert codes != [0]
    assert "waiting for a quorum of at least 2 replica(s)" in log, log
    assert "found no quorum of at least min_replicas=2 replica(s)" in log and "raise quorum_timeout_s" in log, log
    assert time.monotonic() - t0 < 150


def test_bad_settings_are_refused_by_name(monkeypatch):
    """Each refusal names the key and the fix; an unreachable lighthouse fails within timeout_s."""
    def refused(block, needle):
        with pytest.raises(ValueError) as err:
            parse_acco_config({"acco": {"enabled": True, **block}})
        assert needle in str(err.value), str(err.value)

    refused({"mode": "acco", "fault_tolerance": {}}, 'acco.fault_tolerance lets the replicas of a local-SGD mode')
    refused({"mode": "diloco", "fault_tolerance": {}, "compression": {"dtype": "int8"}},
            'Set acco.compression.apply_to to ["rounds"]')
    refused({"mode": "edit", "local_sgd": {"anomaly": {"enabled": True}}, "fault_tolerance": {}},
            "acco.local_sgd.anomaly.enabled cannot run with acco.fault_tolerance")
    refused({"mode": "edit", "local_sgd": {"weighting": "norm"}, "fault_tolerance": {}},
            'acco.local_sgd.weighting="norm" cannot run with acco.fault_tolerance')
    refused({"mode": "diloco", "fault_tolerance": {"merge": "sum"}}, '"acco.fault_tolerance.merge"')
    refused({"mode": "diloco", "fault_tolerance": {"min_replica": 2}}, 'unknown key "acco.fault_tolerance.min_replica"')
    streaming = {"sync_every": 8, "fragments": 2}
    refused({"mode": "diloco", "local_sgd": streaming, "fault_tolerance": {"join": "early"}},
            'Streaming DiLoCo (acco.local_sgd.fragments) has no single period end')
    refused({"mode": "diloco", "fault_tolerance": {"join": "now"}}, '"acco.fault_tolerance.join"')
    refused({"mode": "diloco", "fault_tolerance": {"join_poll_s": 0}}, '"acco.fault_tolerance.join_poll_s"')
    for ft in ({}, {"join": "next_sync"}):  # the default applies where it can: Streaming DiLoCo keeps its grid
        parse_acco_config({"acco": {"enabled": True, "mode": "diloco", "local_sgd": streaming, "fault_tolerance": ft}})
    ok = parse_acco_config({"acco": {"enabled": True, "mode": "diloco", "fault_tolerance": {},
                                     "compression": {"dtype": "int8", "apply_to": ["rounds"]}}})
    assert refusals(ok, Layout(world=2, micro_batches=2)) == []  # one launch, one replica of all its ranks
    bad = parse_acco_config({"acco": {"enabled": True, "mode": "diloco", "local_sgd": {"replica_group_size": 1},
                                      "fault_tolerance": {}}})
    assert "with acco.fault_tolerance one launch is one replica" in refusals(bad, Layout(world=2, micro_batches=2))[0]

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    monkeypatch.delenv("REPLICA_GROUP_ID", raising=False)
    ft = FaultToleranceConfig(timeout_s=2)
    with pytest.raises(ValueError, match="set TORCHFT_LIGHTHOUSE .* or acco.fault_tolerance.lighthouse"):
        ft.check_lighthouse()
    with pytest.raises(ValueError, match="set REPLICA_GROUP_ID"):
        ft.resolved_replica_id()
    with pytest.raises(ValueError, match="must end in a number"):
        FaultToleranceConfig(replica_id="east").resolved_replica_id()
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        ft.check_lighthouse()
    assert time.monotonic() - t0 < 3
    assert "cannot reach the torchft lighthouse" in str(err.value) and "(TORCHFT_LIGHTHOUSE)" in str(err.value)
    assert "torchft_lighthouse --min_replicas" in str(err.value)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_torch_host_under_torchrun_heals_a_relaunched_replica(tmp_path):
    """acco_ds.torch (plain module, no DeepSpeed), each replica a `torchrun --nproc_per_node 2` launch, Streaming
    DiLoCo with 2 fragments and fragment_sync_delay 1 (the all-reduce in flight over an inner step). Replica 1
    is SIGKILLed mid-run; replica 0 syncs on alone; the relaunch joins in the middle of a fragment's sync, heals
    rank by rank, and both end on the same committed weights after the same syncs."""
    cfg = {"gradient_accumulation_steps": GAS, "acco": {
        "enabled": True, "mode": "diloco",
        "local_sgd": {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1},
        "fault_tolerance": {"min_replicas": 1, "timeout_s": 20, "quorum_timeout_s": 120}}}
    spec = {"host": "torch", "config": cfg, "syncs": 10_000, "sleep_per_step": 0.3, "model": "deep"}

    with Fleet(tmp_path, min_replicas=1) as fleet:
        fleet.start("r0", spec, ranks=2, torchrun=True)
        fleet.start("r1", {**spec, "die_at_micro": 20}, ranks=2, torchrun=True)
        assert fleet.wait("r1", 240) != [0], "replica 1 was to die mid-run"
        dead_at = fleet.syncs("r0")
        fleet.wait_for(lambda: fleet.syncs("r0") >= dead_at + 2, 120, "replica 0 to sync on alone")
        fleet.start("r1_again", spec, ranks=2, torchrun=True, replica_id=1)
        fleet.wait_for(lambda: fleet.syncs("r1_again") >= 0, 240, "the relaunched replica to join")
        joined = fleet.syncs("r1_again")
        fleet.wait_for(lambda: fleet.syncs("r1_again") >= joined + 3, 120, "syncs after the join")
        fleet.control(stop_at_syncs=max(fleet.syncs("r0"), fleet.syncs("r1_again")) + 2)
        assert [fleet.wait(r, 240) for r in ("r0", "r1_again")] == [[0], [0]], fleet.logs("r1_again")
    for rank in range(2):
        r0, r1 = fleet.result("r0", rank), fleet.result("r1_again", rank)
        assert r1["syncs_at_join"] > dead_at and r1["stats"]["heals"] == 1 and r1["steps_at_join"] > 0
        assert r0["acco_syncs"] == r1["acco_syncs"] and torch.equal(r0["final"], r1["final"])
        alone = [s for s in r0["syncs"] if dead_at < s["syncs"] <= dead_at + 2]
        assert alone and all(s["participants"] == 1 for s in alone), r0["syncs"]
        assert r0["stats"]["fragments"] == 2
