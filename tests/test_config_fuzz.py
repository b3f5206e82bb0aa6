"""Property test of the config checks over random "acco" blocks and DeepSpeed settings.

Property: every input either gives a valid config or a ValueError whose
message names the offending key; never another exception type, and never an
unknown key silently accepted.
"""

import math
import os
import tempfile

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from acco_ds.config import (ACCOConfig, ACCOEmulationConfig, CollectivesConfig, CompressionConfig, LocalSGDConfig,
                            check_deepspeed_config, parse_acco_config)
from acco_ds.config import FaultToleranceConfig, Layout
from acco_ds.config import AnomalyConfig

if not os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):  # no .hypothesis/ in the checkout
    set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "acco_ds_hypothesis"))

KNOWN = set(ACCOConfig.model_fields)
KNOWN_EMULATION = set(ACCOEmulationConfig.model_fields)
KNOWN_LOCAL = set(LocalSGDConfig.model_fields)
KNOWN_COLLECTIVES = set(CollectivesConfig.model_fields)
KNOWN_COMPRESSION = set(CompressionConfig.model_fields)
KNOWN_FT = set(FaultToleranceConfig.model_fields)
KNOWN_ANOMALY = set(AnomalyConfig.model_fields)
# Misspellings, and names that are special to pydantic or DeepSpeedConfigModel.__init__(strict=...).
TRICKY_KEYS = ["enabld", "Enabled", "mode ", "modes", "accumulate", "kernel", "timeout", "max_micro_batches",
               "emulations", "strict", "self", "model_config", "model_fields", "__class__", "data", "replace_method",
               "gradient_accumulation_steps", ""]

scalars = st.one_of(
    st.just("auto"), st.none(), st.booleans(), st.integers(-10, 10), st.integers(-2**70, 2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.sampled_from(["acco", "dpu", "sync", "fixed", "adaptive", "torch", "native", "true", "false", "yes", "1",
                     "-1", "0.5", "1e3", "inf", "nan"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)
emulation_blocks = st.dictionaries(st.sampled_from(sorted(KNOWN_EMULATION) + ["slow_factr", "delay", "auto"]),
                                   values, max_size=4)
local_sgd_blocks = st.dictionaries(st.sampled_from(sorted(KNOWN_LOCAL) + ["sync_evry", "auto"]),
                                   st.one_of(st.integers(-2, 40), st.floats(-1, 3), values), max_size=4)
collectives_blocks = st.dictionaries(st.sampled_from(sorted(KNOWN_COLLECTIVES) + ["layot", "auto"]),
                                     st.one_of(st.sampled_from(["auto", "flat", "hierarchical", "ring"]),
                                               st.integers(-2, 9), values), max_size=3)
compression_blocks = st.dictionaries(st.sampled_from(sorted(KNOWN_COMPRESSION) + ["dtpye", "auto"]),
                                     st.one_of(st.sampled_from(["int8", "fp8", "fp32", "bf16", "int4"]),
                                               st.lists(st.sampled_from(["rounds", "outer", "grads"]), max_size=3),
                                               st.integers(-2, 600), st.booleans(), values), max_size=4)
ft_blocks = st.dictionaries(st.sampled_from(sorted(KNOWN_FT) + ["min_replica", "auto"]),
                            st.one_of(st.sampled_from(["mean", "tokens", "sum", "rep_1", "http://localhost:1"]),
                                      st.integers(-2, 5), st.floats(-1, 100), values), max_size=4)
acco_values = {
    "enabled": st.one_of(st.booleans(), values),
    "mode": st.one_of(st.sampled_from(["acco", "dpu", "sync", "diloco", "co2"]), values),
    "local_sgd": st.one_of(st.none(), local_sgd_blocks, values),
    "accumulation": st.one_of(st.sampled_from(["fixed", "adaptive"]), values),
    "max_micro_batches_per_round": st.one_of(st.none(), st.integers(-3, 40), values),
    "kernels": st.one_of(st.sampled_from(["auto", "torch", "native"]), values),
    "timeout_s": st.one_of(st.floats(-10, 1e4), values),
    "emulation": st.one_of(emulation_blocks, values),
    "collectives": st.one_of(collectives_blocks, values),
    "compression": st.one_of(compression_blocks, values),
    "fault_tolerance": st.one_of(st.none(), ft_blocks, values),
}


@st.composite
def acco_blocks(draw):
    block = {}
    for key in draw(st.lists(st.sampled_from(sorted(KNOWN)), unique=True, max_size=len(KNOWN))):
        block[key] = draw(acco_values[key])
    for key in draw(st.lists(st.one_of(st.sampled_from(TRICKY_KEYS), st.text(max_size=10)), max_size=2)):
        if key not in KNOWN:
            block[key] = draw(values)
    return block


def named(message: str, path: str) -> bool:
    return f'"{path}"' in message or f'{path}=' in message or f'{path} ' in message


def check_parse(block):
    """parse_acco_config on one block: the config, or None after checking its ValueError."""
    unknown = [f"acco.{k}" for k in block if k not in KNOWN]
    emulation, local, coll = block.get("emulation"), block.get("local_sgd"), block.get("collectives")
    comp, ft = block.get("compression"), block.get("fault_tolerance")
    if isinstance(comp, dict):
        unknown += [f"acco.compression.{k}" for k in comp if k not in KNOWN_COMPRESSION]
    if isinstance(ft, dict):
        unknown += [f"acco.fault_tolerance.{k}" for k in ft if k not in KNOWN_FT]
    if isinstance(emulation, dict):
        unknown += [f"acco.emulation.{k}" for k in emulation if k not in KNOWN_EMULATION]
    if isinstance(coll, dict):
        unknown += [f"acco.collectives.{k}" for k in coll if k not in KNOWN_COLLECTIVES]
    anomaly = local.get("anomaly") if isinstance(local, dict) else None  # the one block nested two deep
    if isinstance(local, dict):
        unknown += [f"acco.local_sgd.{k}" for k in local if k not in KNOWN_LOCAL]
    if isinstance(anomaly, dict):
        unknown += [f"acco.local_sgd.anomaly.{k}" for k in anomaly if k not in KNOWN_ANOMALY]
    try:
        cfg = parse_acco_config({"acco": block})
    except ValueError as err:
        message = str(err)
        for path in unknown:  # every unknown key is named
            assert named(message, path), (path, message)
        if not unknown:  # a bad value: the message names one of the block's keys
            paths = [f"acco.{k}" for k in block] + [f"acco.emulation.{k}" for k in (
                emulation if isinstance(emulation, dict) else {})] + [f"acco.local_sgd.{k}" for k in (
                    local if isinstance(local, dict) else {})] + [f"acco.collectives.{k}" for k in (
                        coll if isinstance(coll, dict) else {})] + [f"acco.compression.{k}" for k in (
                            comp if isinstance(comp, dict) else {})] + [f"acco.fault_tolerance.{k}" for k in (
                                ft if isinstance(ft, dict) else {})] + [f"acco.local_sgd.anomaly.{k}" for k in (
                                    anomaly if isinstance(anomaly, dict) else {})]
            assert any(named(message, p) for p in paths), message
        return None
    assert not unknown, f"unknown keys accepted: {unknown}"
    # What was accepted is a usable config.
    assert isinstance(cfg.enabled, bool)
    assert cfg.mode in ("acco", "dpu", "sync", "diloco", "co2") and cfg.accumulation in ("fixed", "adaptive")
    assert cfg.local_sgd is None or cfg.local, "a local_sgd block was accepted in a round mode"
    if cfg.local:
        assert all(block.get(k, "auto") == "auto" for k in ("accumulation", "max_micro_batches_per_round"))
        outer = cfg.outer
        assert outer["outer_lr"] > 0 and 0 <= outer["outer_momentum"] < 1 and outer["staleness_penalty"] > 0
        assert cfg.mode == "co2" or (cfg.local_sgd is None or (cfg.local_sgd.staleness_penalty is None
                                                               and cfg.local_sgd.outer_momentum_clip is None))
    assert cfg.kernels in ("auto", "torch", "native")
    assert not (cfg.mode == "sync" and cfg.accumulation == "adaptive")
    assert cfg.max_micro_batches_per_round is None or (isinstance(cfg.max_micro_batches_per_round, int)
                                                       and cfg.max_micro_batches_per_round >= 1)
    assert math.isfinite(cfg.timeout_s) and cfg.timeout_s > 0
    assert cfg.collectives.layout in ("auto", "flat", "hierarchical")
    c = cfg.compression
    assert c.dtype in (None, "int8", "fp8") and type(c.block_size) is int and c.block_size >= 8
    assert c.enabled or not (set(comp) - {"dtype"} if isinstance(comp, dict) else False), "a key without dtype"
    assert c.apply_to is None or (c.apply_to and set(c.apply_to) <= {"rounds", "outer"})
    f = cfg.fault_tolerance
    assert f is None or (cfg.local and f.min_replicas >= 1 and f.merge in ("mean", "tokens")
                         and f.timeout_s > 0 and f.quorum_timeout_s > 0), "a fault_tolerance block accepted wrongly"
    n = cfg.collectives.ranks_per_node
    assert n is None or (type(n) is int and n >= 1)
    em = cfg.emulation
    assert math.isfinite(em.comm_delay_s) and em.comm_delay_s >= 0
    assert math.isfinite(em.slow_factor) and em.slow_factor >= 1 and isinstance(em.slow_rank, int)
    for key in ("mode", "accumulation", "kernels"):  # given values are kept, "auto" means the default
        if isinstance(block.get(key), str) and block[key] in ("acco", "dpu", "sync", "fixed", "adaptive", "torch",
                                                              "native"):
            assert getattr(cfg, key) == block[key]
    return cfg


@pytest.mark.timeout(600)
@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(acco_blocks())
@example({"accumulation": "fixed", "collectives": {}, "compression": {}, "max_micro_batches_per_round": None,
          "local_sgd": {"anomaly": {"": "auto"}}})  # found by this test: an empty key two blocks deep
def test_random_acco_blocks(block):
    check_parse(block)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", [1, "yes", ["enabled"], True, 0.5])
def test_acco_block_that_is_not_an_object(block):
    with pytest.raises(ValueError, match='"acco" must be an object'):
        parse_acco_config({"acco": block})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block, path", [
    ({"strict": True}, "acco.strict"),  # would be taken as DeepSpeedConfigModel's own argument
    ({"enabeld": "auto"}, "acco.enabeld"),  # "auto" values are dropped before pydantic sees the key
    ({"emulation": {"slow_factr": "auto"}}, "acco.emulation.slow_factr"),
    ({1: True}, "acco.1"),  # not a string: was a TypeError
    ({"timeout_s": float("inf")}, "acco.timeout_s"),  # timedelta(seconds=inf) fails at initialize
    ({"emulation": {"comm_delay_s": float("inf")}}, "acco.emulation.comm_delay_s"),
])
def test_keys_and_values_found_by_fuzzing(block, path):
    with pytest.raises(ValueError) as err:
        parse_acco_config({"acco": block})
    assert named(str(err.value), path), str(err.value)


@st.composite
def deepspeed_cases(draw):
    acco = {"enabled": True, "mode": draw(st.sampled_from(["acco", "dpu", "sync"]))}
    if acco["mode"] != "sync" and draw(st.booleans()):
        acco["accumulation"] = "adaptive"
        if draw(st.booleans()):
            acco["max_micro_batches_per_round"] = draw(st.integers(1, 20))
    stage = draw(st.integers(0, 3))
    gas = draw(st.integers(1, 8))
    precision = draw(st.sampled_from(["fp32", "bf16", "fp16"]))
    cfg = {"train_micro_batch_size_per_gpu": draw(st.integers(1, 4)), "gradient_accumulation_steps": gas,
           "zero_optimization": {"stage": stage}, "steps_per_print": 10_000,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "acco": acco}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        cfg["fp16"] = {"enabled": True}
    elif draw(st.booleans()):
        cfg[draw(st.sampled_from(["bf16", "fp16"]))] = {"enabled": False}
    grad_accum_dtype = draw(st.sampled_from([None, "fp32", "fp16", "bf16"]))
    if grad_accum_dtype is not None:
        cfg["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    offload = draw(st.sampled_from([None, "none", "cpu"]))
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": offload}
    return cfg


def expected_problems(cfg):
    """The keys check_deepspeed_config must name (the grad_accum_dtype rule is left out: it may change)."""
    acco, zero = cfg["acco"], cfg["zero_optimization"]
    gas = cfg["gradient_accumulation_steps"]
    problems = []
    if zero["stage"] != 1:
        problems.append("zero_optimization.stage")
    if acco["mode"] == "acco" and gas % 2:
        problems.append("gradient_accumulation_steps")
    if acco.get("accumulation") == "adaptive":
        low = gas // 2 if acco["mode"] == "acco" else gas
        if acco.get("max_micro_batches_per_round", 4 * low) < low:
            problems.append("acco.max_micro_batches_per_round")
    if zero.get("offload_optimizer", {}).get("device", "none") != "none":
        problems.append("offload_optimizer")
    return problems


@pytest.mark.timeout(600)
@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(deepspeed_cases())
def test_random_deepspeed_combinations(cfg):
    from deepspeed.runtime.config import DeepSpeedConfig
    acco = check_parse(cfg["acco"])
    assert acco is not None
    ds_config = DeepSpeedConfig(cfg)  # no process group: DeepSpeed takes world size 1
    problems = expected_problems(cfg)
    try:
        gas = int(ds_config.gradient_accumulation_steps)
        check_deepspeed_config(acco, ds_config, Layout.launch(1, micro_batches=gas))
    except ValueError as err:
        message = str(err)
        for key in problems:
            assert key in message, (key, message)
        if not problems:  # only the bf16 + grad_accum_dtype rule may reject the rest
            assert "grad_accum_dtype" in cfg.get("data_types", {}) and "data_types.grad_accum_dtype" in message, \
                message
        return
    assert not problems, f"accepted although {problems} should be rejected"
