"""The round schedule alone (no tensors, no processes)."""

import pytest

from acco_ds.algorithms.rounds import COMMIT, ESTIMATE, PEEK, REAL, STARTUP, SYNC, DELAYED, RoundSchedule


def kinds(schedule, n):
    out = [schedule.current]
    for _ in range(n - 1):
        out.append(schedule.advance())
    return out


def test_acco_alternates_estimate_and_real_after_startup():
    rounds = kinds(RoundSchedule("acco", 3), 6)
    assert [r.kind for r in rounds] == [STARTUP, ESTIMATE, REAL, ESTIMATE, REAL, ESTIMATE]
    assert [r.comm for r in rounds] == [None, PEEK, COMMIT, PEEK, COMMIT, PEEK]
    assert all(r.min_micro == r.max_micro == 3 for r in rounds)
    assert rounds[1].keep_shard and not rounds[1].add_kept_shard
    assert rounds[2].add_kept_shard and not rounds[2].keep_shard


def test_dpu_and_sync():
    assert [r.kind for r in kinds(RoundSchedule("dpu", 4), 3)] == [STARTUP, DELAYED, DELAYED]
    rounds = kinds(RoundSchedule("sync", 4), 2)
    assert [r.kind for r in rounds] == [SYNC, SYNC] and all(r.min_micro == 4 and r.commits for r in rounds)


def test_committed_steps_follow_the_documented_data_mapping():
    # acco: k startup micro-batches, then 2k per committed step.
    s = RoundSchedule("acco", 2)
    assert [s.committed_steps(n) for n in range(7)] == [0, 0, 0, 1, 1, 2, 2]
    assert [RoundSchedule("dpu", 4).committed_steps(n) for n in range(4)] == [0, 0, 1, 2]
    assert [RoundSchedule("sync", 4).committed_steps(n) for n in range(3)] == [0, 1, 2]


def test_fixed_rounds_end_exactly_at_the_count_whatever_the_communication():
    s = RoundSchedule("acco", 2)
    s.advance()
    assert not s.may_end(1, comm_done=True)
    assert s.may_end(2, comm_done=False)  # the caller then waits


def test_adaptive_keeps_accumulating_while_communication_is_in_flight():
    s = RoundSchedule("acco", 2, max_micro=5)
    assert s.may_end(2, comm_done=False)  # startup: nothing to wait for
    s.advance()
    assert not s.may_end(2, comm_done=False)
    assert not s.may_end(4, comm_done=False)
    assert s.may_end(5, comm_done=False)  # the maximum
    assert s.may_end(3, comm_done=True)


def test_unknown_mode_is_rejected():
    # Rules about the DeepSpeed config (even accumulation, adaptive needs overlap) live in acco_ds.config.
    with pytest.raises(ValueError, match="unknown round mode 'diloco'"):
        RoundSchedule("diloco", 2)


def test_state_dict_round_trip_and_mismatch():
    s = RoundSchedule("acco", 2)
    for _ in range(3):
        s.advance()
    t = RoundSchedule("acco", 2)
    t.load_state_dict(s.state_dict())
    assert t.current == s.current
    with pytest.raises(ValueError, match="min_micro"):
        RoundSchedule("acco", 4).load_state_dict(s.state_dict())
