"""The local-SGD period schedule alone (no tensors, no processes)."""

import pytest

from acco_ds.algorithms.periods import PeriodSchedule


def run(schedule, steps):
    return [schedule.after_inner_step() for _ in range(steps)]


def test_diloco_blocks_every_period():
    syncs = [s for s in run(PeriodSchedule("diloco", 3), 7) if s is not None]
    assert [(s.period, s.blocking, s.send, s.wait_previous) for s in syncs] == [(0, True, False, False),
                                                                                 (1, True, False, False)]


def test_co2_sends_then_applies_one_period_late():
    s = PeriodSchedule("co2", 2)
    syncs = [x for x in run(s, 6) if x is not None]
    assert [(x.send, x.wait_previous, x.blocking) for x in syncs] == [(True, False, False), (True, True, False),
                                                                      (True, True, False)]
    assert s.in_flight and s.period == 3


def test_final_sync_applies_what_is_in_flight_without_sending_again():
    s = PeriodSchedule("co2", 2)
    run(s, 4)
    final = s.final_sync()  # no inner step since the last sync: apply the in-flight mean, send nothing
    assert (final.wait_previous, final.blocking, final.send) == (True, False, False)
    assert s.period == 2 and not s.in_flight and s.final_sync() is None
    run(s, 1)
    final = s.final_sync()  # a partial period: average it at once
    assert (final.wait_previous, final.blocking, final.send) == (False, True, False) and s.period == 3


def test_state_round_trip_and_mismatch():
    s = PeriodSchedule("co2", 4)
    run(s, 6)
    t = PeriodSchedule("co2", 4)
    t.load_state_dict(s.state_dict())
    assert (t.period, t.inner, t.in_flight) == (1, 2, True)
    with pytest.raises(ValueError, match="sync_every=4 but this run has 8"):
        PeriodSchedule("co2", 8).load_state_dict(s.state_dict())
