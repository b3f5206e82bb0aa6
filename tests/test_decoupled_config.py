"""The keys of ``"mode": "decoupled"``: defaults, and every bad key or combination refused by name with its fix."""

import pytest

from acco_ds.config import parse_acco_config


def block(**local_sgd):
    return {"acco": {"enabled": True, "mode": "decoupled", "local_sgd": local_sgd}}


def test_defaults():
    acco = parse_acco_config(block())
    ls = acco.local_sgd
    assert acco.local and acco.round_mode() == "sync"
    assert (ls.min_quorum, ls.grace_s, ls.merge, ls.staleness, ls.syncer) == (1, "auto", "tokens", "none", None)
    assert acco.outer == {"outer_lr": 0.7, "outer_momentum": 0.9, "nesterov": True, "staleness_penalty": 1.0,
                          "outer_momentum_clip": None}
    acco = parse_acco_config(block(sync_every_s=2.5, min_quorum=3, grace_s=0, merge="equal",
                                   staleness="delayed_nesterov", nesterov_delay=4,
                                   syncer={"address": "10.0.0.1:29600", "state_dir": "/tmp/s", "timeout_s": 30}))
    ls = acco.local_sgd
    assert (ls.sync_every_s, ls.min_quorum, ls.grace_s, ls.nesterov_delay) == (2.5, 3, 0.0, 4)
    assert ls.syncer.address == "10.0.0.1:29600" and ls.syncer.timeout_s == 30
    assert (ls.syncer.liveness_s, ls.syncer.auth_file, ls.tokens_per_step) == (10.0, None, None)
    ls = parse_acco_config(block(tokens_per_step=4096, syncer={"auth_file": "/k", "liveness_s": 2.5})).local_sgd
    assert (ls.tokens_per_step, ls.syncer.auth_file, ls.syncer.liveness_s) == (4096, "/k", 2.5)


@pytest.mark.parametrize("acco, needle", [
    ({"mode": "diloco", "local_sgd": {"min_quorum": 2}},
     'acco.local_sgd.min_quorum belongs to mode "decoupled"'),
    ({"mode": "edit", "local_sgd": {"grace_s": 1.0}}, 'acco.local_sgd.grace_s belongs to mode "decoupled"'),
    ({"mode": "diloco", "local_sgd": {"syncer": {"address": "h:1"}}}, 'acco.local_sgd.syncer belongs to mode'),
    ({"mode": "decoupled", "local_sgd": {"min_quorum": 0}},
     '"acco.local_sgd.min_quorum": Input should be greater than or equal to 1'),
    ({"mode": "decoupled", "local_sgd": {"grace_s": "soon"}}, '"acco.local_sgd.grace_s'),
    ({"mode": "decoupled", "local_sgd": {"grace_s": -1}}, '"acco.local_sgd.grace_s'),
    ({"mode": "decoupled", "local_sgd": {"merge": "mean"}}, '"acco.local_sgd.merge"'),
    ({"mode": "decoupled", "local_sgd": {"staleness": "cgad"}}, '"acco.local_sgd.staleness"'),
    ({"mode": "decoupled", "local_sgd": {"sync_every": 4, "sync_every_s": 2.0}},
     "acco.local_sgd.sync_every_s (a period ends on wall time) and acco.local_sgd.sync_every"),
    ({"mode": "decoupled", "local_sgd": {"nesterov_delay": 2}}, "nesterov_delay is Delayed Nesterov's N"),
    ({"mode": "decoupled", "local_sgd": {"staleness": "delayed_nesterov", "nesterov": False}},
     'staleness "delayed_nesterov" is a Nesterov outer step'),
    ({"mode": "decoupled", "local_sgd": {"fragments": 2}}, "acco.local_sgd.fragments is Streaming DiLoCo's"),
    ({"mode": "decoupled", "local_sgd": {"topk": 2}}, "acco.local_sgd.topk is SparseLoCo's"),
    ({"mode": "decoupled", "local_sgd": {"sync_time_s": 2.0}}, 'applies to mode "edit", not to mode "decoupled"'),
    ({"mode": "decoupled", "local_sgd": {"staleness_penalty": 2.0}}, 'not to mode "decoupled"'),
    ({"mode": "decoupled", "local_sgd": {"syncer": {"adress": "h:1"}}},
     'unknown key "acco.local_sgd.syncer.adress"'),
    ({"mode": "decoupled", "local_sgd": {"syncer": {"timeout_s": 0}}}, '"acco.local_sgd.syncer.timeout_s"'),
    ({"mode": "decoupled", "local_sgd": {"adopt": "later"}}, '"acco.local_sgd.adopt"'),
    ({"mode": "decoupled", "local_sgd": {"tokens_per_step": 0}}, '"acco.local_sgd.tokens_per_step"'),
    ({"mode": "diloco", "local_sgd": {"tokens_per_step": 8}}, 'acco.local_sgd.tokens_per_step belongs to mode'),
    ({"mode": "decoupled", "local_sgd": {"syncer": {"liveness_s": 0}}}, '"acco.local_sgd.syncer.liveness_s"'),
    ({"mode": "diloco", "local_sgd": {"adopt": "overlap"}}, 'acco.local_sgd.adopt belongs to mode "decoupled"'),
    ({"mode": "decoupled", "fault_tolerance": {}},
     'acco.fault_tolerance (torchft quorums) and acco.mode "decoupled" exclude each other'),
])
def test_bad_decoupled_settings_are_refused_by_name(acco, needle):
    with pytest.raises(ValueError, match="acco") as err:
        parse_acco_config({"acco": {"enabled": True, **acco}})
    assert needle in str(err.value), str(err.value)


def test_compression_of_the_inner_steps_or_the_up_link_is_accepted():
    acco = parse_acco_config({"acco": {"enabled": True, "mode": "decoupled",
                                       "compression": {"dtype": "int8", "apply_to": ["rounds"]}}})
    assert acco.compression.applies_to("rounds") and not acco.compression.applies_to("outer")
    acco = parse_acco_config({"acco": {"enabled": True, "mode": "decoupled", "local_sgd": {"adopt": "overlap"},
                                       "compression": {"dtype": "fp8", "apply_to": ["outer"]}}})
    assert acco.compression.applies_to("outer") and acco.local_sgd.adopt == "overlap"
    from acco_ds.runtime.comm.compression import describe  # what the banner and `acco-ds report` say
    assert describe(acco.compression, True, decoupled=True).endswith(
        "on: the up-link to the syncer (each learner's pseudo-gradient)")


def test_a_learner_says_its_shape_in_one_hello_name():
    """``dp{k}.tp{tp}.pp{pp}.ep{ep}.n{elements}.g{crc32 of the group sizes}``: dp 0 (any size) for a dense learner,
    its size with experts; the characters a wire name may hold, within its 64 bytes."""
    import zlib
    from types import SimpleNamespace

    from acco_ds.config.decoupled import layout_name
    from acco_ds.runtime.outer.decoupled import wire
    groups = SimpleNamespace(k=2, tensor_parallel=2)
    name = layout_name(groups, 4, SimpleNamespace(gather=None), [10**12, 10**12 - 1])
    assert name == f"dp0.tp2.pp2.ep1.n{2 * 10**12 - 1}.g{zlib.crc32(b'1000000000000,999999999999'):08x}"
    assert len(name) <= wire.MAX_NAME and all(c in wire.NAME_CHARS for c in name.encode())
    one = layout_name(SimpleNamespace(k=1, tensor_parallel=1), 1, SimpleNamespace(gather=[None]), [3, 4])
    assert one.startswith("dp0.tp1.pp1.ep1.n7.g") and one != layout_name(
        SimpleNamespace(k=1, tensor_parallel=1), 1, SimpleNamespace(gather=[None]), [4, 3])
