"""Bad configs and unsupported combinations are rejected at initialize, naming the key and the fix."""

import os

import pytest
import torch

import acco_ds
import common
from acco_ds.config import ACCOConfig, check_deepspeed_config, parse_acco_config
from dist import free_port


@pytest.fixture(scope="module", autouse=True)
def single_rank_process_group():
    """A 1-rank gloo group in the test process, for initialize-time errors."""
    import deepspeed
    import torch.distributed as dist
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu")
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo")
    yield


def ds_config(**kw):
    from deepspeed.runtime.config import DeepSpeedConfig
    return DeepSpeedConfig(common.ds_config(**kw))


def ds_config_and_layout(**kw):
    """DeepSpeed's parsed config and the rulebook's layout of this 1-rank launch, as the engine passes them."""
    from acco_ds.config import Layout
    cfg = ds_config(**kw)
    return cfg, Layout.launch(1, micro_batches=int(cfg.gradient_accumulation_steps))


def test_defaults_and_documentation():
    cfg = parse_acco_config({})
    assert not cfg.enabled and cfg.mode == "acco" and cfg.accumulation == "fixed"
    assert parse_acco_config({"acco": {"enabled": True, "accumulation": "adaptive"}}).max_micro_batches(8) == 16
    # Every key is documented on the model itself (what DeepSpeed's config docs and our README table draw on).
    from acco_ds.config import ACCOEmulationConfig
    for model in (ACCOConfig, ACCOEmulationConfig):
        for name, field in model.model_fields.items():
            assert field.description and len(field.description) > 20, (model.__name__, name)


@pytest.mark.parametrize("value", ["yes", "on", "true", 1, 0, "false", None])
def test_enabled_takes_only_json_booleans(value):
    with pytest.raises(ValueError, match='"acco.enabled"'):
        parse_acco_config({"acco": {"enabled": value}})
    assert parse_acco_config({"acco": {"enabled": True}}).enabled is True
    assert parse_acco_config({"acco": {"enabled": False}}).enabled is False


@pytest.mark.parametrize("block, needle", [
    ({"enabld": True}, 'unknown key "acco.enabld"'),
    ({"enabled": True, "mode": "fast"}, '"acco.mode"'),
    ({"enabled": True, "max_micro_batches_per_round": "many"}, '"acco.max_micro_batches_per_round"'),
    ({"enabled": True, "emulation": {"slow_factr": 2}}, 'unknown key "acco.emulation.slow_factr"'),
    ({"enabled": True, "mode": "sync", "accumulation": "adaptive"}, 'accumulation="fixed" with mode="sync"'),
    ("yes", 'must be an object'),
    ({"enabled": True, "collectives": {"layout": "ring"}}, '"acco.collectives.layout"'),
    ({"enabled": True, "collectives": {"ranks_per_node": 0}},
     '"acco.collectives.ranks_per_node": Input should be greater than or equal to 1'),
    ({"enabled": True, "mode": "diloco", "local_sgd": {"sync_every": 8, "fragments": 3}},
     "acco.local_sgd.fragments (3) must divide acco.local_sgd.sync_every (8)"),
    ({"enabled": True, "mode": "diloco", "local_sgd": {"sync_every": 8, "fragments": 2, "fragment_sync_delay": 4}},
     "acco.local_sgd.fragment_sync_delay (4) must be below sync_every / fragments = 4"),
    ({"enabled": True, "mode": "diloco", "local_sgd": {"fragment_update_alpha": 1.5}},
     '"acco.local_sgd.fragment_update_alpha": Input should be less than or equal to 1'),
    ({"enabled": True, "mode": "co2", "local_sgd": {"fragments": 2}},
     'acco.local_sgd.fragments is Streaming DiLoCo\'s: it applies to mode "diloco", not to mode "co2"'),
    ({"enabled": True, "mode": "edit", "local_sgd": {"fragment_update_alpha": 0.5}},
     'acco.local_sgd.fragment_update_alpha is Streaming DiLoCo\'s'),
    ({"enabled": True, "mode": "acco", "local_sgd": {"fragments": 2}}, "acco.local_sgd configures the local-SGD modes"),
    ({"enabled": True, "compression": {"dtype": "int4"}},
     '"acco.compression.dtype": Input should be \'int8\' or \'fp8\''),
    ({"enabled": True, "compression": {"dtype": "int8", "block_size": 4}},
     '"acco.compression.block_size": Input should be greater than or equal to 8'),
    ({"enabled": True, "compression": {"block_size": 64}},
     'acco.compression.block_size has no effect without acco.compression.dtype: set "dtype" to "int8" or "fp8"'),
    ({"enabled": True, "compression": {"dtype": "int8", "apply_to": ["outer"]}},
     'acco.compression.apply_to "outer" compresses the local-SGD outer all-reduce, but acco.mode is "acco"'),
    ({"enabled": True, "compression": {"dtype": "int8", "apply_to": ["rounds", "rounds"]}}, "lists an entry twice"),
    ({"enabled": True, "compression": {"dtype": "int8", "apply_to": []}}, '"acco.compression.apply_to"'),
    ({"enabled": True, "compression": {"dtype": "int8", "apply_to": ["grads"]}}, '"acco.compression.apply_to" (item 0)'),
    ({"enabled": True, "compression": {"dtype": "int8", "error_feedback": False, "residual_dtype": "bf16"}},
     "residual_dtype sets the dtype of the error-feedback residuals, but acco.compression.error_feedback is false"),
    ({"enabled": True, "compression": {"dtype": "int8", "error_feedback": "yes"}}, '"acco.compression.error_feedback"'),
    ({"enabled": True, "compression": {"dtype": "int8", "blocksize": 64}}, 'unknown key "acco.compression.blocksize"'),
])
def test_malformed_acco_blocks(block, needle):
    with pytest.raises(ValueError, match="acco") as err:
        parse_acco_config({"acco": block})
    assert needle in str(err.value)


@pytest.mark.parametrize("kw, needle", [
    (dict(acco={"mode": "acco"}, gas=3), "gradient_accumulation_steps must be even (got 3): set it to 4"),
    (dict(acco={"mode": "acco"}, zero_optimization={"stage": 2}), 'set "zero_optimization": {"stage": 1}'),
    (dict(acco={"mode": "acco"}, zero_optimization={"stage": 0}), "zero_optimization.stage is 0"),
    (dict(acco={"mode": "acco", "accumulation": "adaptive", "max_micro_batches_per_round": 1}, gas=4),
     "max_micro_batches_per_round (1) is below the minimum of 2"),
    (dict(acco={"mode": "acco"}, zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}),
     "remove offload_optimizer"),
    (dict(acco={"mode": "acco", "collectives": {"ranks_per_node": 2}}),
     "acco.collectives.ranks_per_node is 2, which does not divide the world size 1"),
    (dict(acco={"mode": "sync", "collectives": {"layout": "hierarchical"}}),
     'acco.collectives.layout="hierarchical" needs more than one node of more than one rank, but '
     'acco.collectives.ranks_per_node ("auto": LOCAL_WORLD_SIZE or LOCAL_SIZE) is 1 on 1 ranks'),
])
def test_unsupported_deepspeed_settings(kw, needle):
    acco = parse_acco_config(common.ds_config(**kw))
    with pytest.raises(ValueError) as err:
        check_deepspeed_config(acco, *ds_config_and_layout(**kw))
    assert needle in str(err.value)


@pytest.mark.parametrize("block, env, world, layout, per_node", [
    ({}, {}, 4, "flat", 4),  # no launcher variable: one node
    ({}, {"LOCAL_WORLD_SIZE": "2"}, 4, "hierarchical", 2),  # torchrun, 2 nodes of 2
    ({}, {"LOCAL_SIZE": "2"}, 4, "hierarchical", 2),  # the deepspeed launcher
    ({}, {"LOCAL_WORLD_SIZE": "4"}, 4, "flat", 4),  # one node
    ({}, {"LOCAL_WORLD_SIZE": "1"}, 4, "flat", 1),  # one rank per node: nothing to gain
    ({"layout": "flat"}, {"LOCAL_WORLD_SIZE": "2"}, 4, "flat", 2),
    ({"ranks_per_node": 2}, {"LOCAL_WORLD_SIZE": "4"}, 4, "hierarchical", 2),  # the config wins
])
def test_collectives_layout_auto_follows_the_launcher(monkeypatch, block, env, world, layout, per_node):
    from acco_ds.config import Layout, collectives_layout, ranks_per_node, replica_group_size
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    acco = parse_acco_config({"acco": {"enabled": True, "mode": "diloco", "collectives": block}})
    assert collectives_layout(acco, world) == layout
    assert ranks_per_node(acco, world) == per_node == replica_group_size(acco, Layout.launch(world))


def test_odd_accumulation_is_fine_outside_acco_mode():
    kw = dict(acco={"mode": "dpu"}, gas=3)
    check_deepspeed_config(parse_acco_config(common.ds_config(**kw)), *ds_config_and_layout(**kw))


def test_initialize_rejects_before_building_anything():
    model = common.make_model()
    with pytest.raises(ValueError, match="gradient_accumulation_steps must be even"):
        acco_ds.initialize(model=model, model_parameters=model.parameters(),
                           config=common.ds_config(acco={"mode": "acco"}, gas=5))
    with pytest.raises(ValueError, match=r'unknown key "acco.mdoe"'):
        acco_ds.initialize(model=model, model_parameters=model.parameters(),
                           config_params={**common.ds_config(), "acco": {"enabled": True, "mdoe": "dpu"}})
    with pytest.raises(ValueError, match="needs an optimizer"):
        acco_ds.initialize(model=model, model_parameters=model.parameters(),
                           config=common.ds_config(acco={"mode": "acco"}, optimizer=None))


def test_what_pipelines_and_model_parallel_layouts_refuse_before_building_anything():
    """Pipeline stages > 1 train (tests/test_pipeline.py), but adaptive accumulation across stages, sequence
    parallelism (DeepSpeed's key or an mpu's) and MoE in the modes that do not support it yet are refused by
    name before DeepSpeed builds anything (a real 2-stage module needs 2 ranks: its stage count is set)."""
    import types

    from deepspeed.pipe import PipelineModule

    from acco_ds.deepspeed.initialize import check_before_initialize
    pipe = PipelineModule.__new__(PipelineModule)
    torch.nn.Module.__init__(pipe)
    pipe.num_stages = 2
    two = {"gradient_accumulation_steps": 2}
    for mode in ("acco", "dpu", "sync"):
        check_before_initialize(pipe, None, two, parse_acco_config({"acco": {"enabled": True, "mode": mode}}))
    from acco_ds.config import Layout, check  # a local-SGD mode needs replicas: 2 nodes of 4 ranks, 2 stages
    check(parse_acco_config({"acco": {"enabled": True, "mode": "diloco"}}),
          Layout(world=8, ranks_per_node=4, pp=2, micro_batches=2))
    adaptive = parse_acco_config({"acco": {"enabled": True, "accumulation": "adaptive"}})
    with pytest.raises(ValueError, match='accumulation="adaptive" cannot run with 2 pipeline stages'):
        check_before_initialize(pipe, None, two, adaptive)
    pipe.num_stages = 1
    check_before_initialize(pipe, None, two, adaptive)
    acco = parse_acco_config({"acco": {"enabled": True}})
    with pytest.raises(ValueError, match=r"does not support sequence parallelism \(size 2\)"):
        check_before_initialize(common.make_model(), None, {"sequence_parallel_size": 2}, acco)
    mpu = types.SimpleNamespace(get_sequence_parallel_world_size=lambda: 4, get_model_parallel_world_size=lambda: 1)
    with pytest.raises(ValueError, match=r"does not support sequence parallelism \(size 4\)"):
        check_before_initialize(common.make_model(), mpu, {}, acco)
    # MoE (tests/test_moe.py trains it): every mode, but not beside tensor parallelism
    for mode in ("acco", "dpu", "sync", "diloco", "co2", "edit", "sparseloco", "decoupled"):
        check(parse_acco_config({"acco": {"enabled": True, "mode": mode}}), Layout(world=4, moe=True, ep_sizes=(2,),
                                                                                  ranks_per_node=2))
    with pytest.raises(ValueError, match=r"ACCO with MoE layers does not support tensor or pipeline parallelism"):
        check(parse_acco_config({"acco": {"enabled": True, "mode": "decoupled"}}),
              Layout(world=4, moe=True, ep_sizes=(2,), ranks_per_node=2, tp=2))


def test_config_from_args_deepspeed_config(tmp_path):
    import json
    import types
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(common.ds_config(acco={"mode": "acco"}, gas=3)))
    model = common.make_model()
    with pytest.raises(ValueError, match="must be even"):
        acco_ds.initialize(args=types.SimpleNamespace(deepspeed_config=str(path), local_rank=0), model=model,
                           model_parameters=model.parameters())


def _integer_keys(model, prefix="acco", block=None):
    """Every integer key of the "acco" block (nested blocks included), with a block that reaches it."""
    import typing

    from pydantic import BaseModel
    block = {} if block is None else block
    for name, field in model.model_fields.items():
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        nested = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if nested:
            yield from _integer_keys(nested[0], f"{prefix}.{name}", block)
        elif int in kinds or any(typing.get_origin(k) is typing.Annotated and int in typing.get_args(k)
                                 for k in kinds):
            yield f"{prefix}.{name}"


def _block_with(path: str, value) -> dict:
    """An "acco" block whose key ``path`` is ``value``, in a mode where that key applies."""
    parts = path.split(".")[1:]
    streaming = parts[-1] in ("fragments", "fragment_sync_delay", "fragment_update_alpha")
    sparse = parts[-1] in ("chunk", "topk", "error_decay", "value_bits", "overlap")
    decoupled = parts[-1] in ("min_quorum", "nesterov_delay", "tokens_per_step")
    mode = ("diloco" if streaming else "sparseloco" if sparse else "decoupled" if decoupled else "edit") \
        if parts[0] == "local_sgd" else "diloco" if parts[0] == "fault_tolerance" else "acco"
    block = {"enabled": True, "mode": mode}
    if parts[-1] == "fragments":
        block["local_sgd"] = {"sync_every": 16}  # a multiple of the values tried
    if parts[-1] == "chunk":
        block["local_sgd"] = {"topk": 1}  # at most the chunks tried
    if parts[-1] == "nesterov_delay":
        block["local_sgd"] = {"staleness": "delayed_nesterov"}  # Delayed Nesterov's N
    if parts == ["max_micro_batches_per_round"]:
        block["accumulation"] = "adaptive"
    if parts[0] == "compression":  # its keys need a dtype
        block["compression"] = {"dtype": "int8"}
    node = block
    for key in parts[:-1]:
        node = node.setdefault(key, {})
    node[parts[-1]] = value
    return block


INTEGER_KEYS = sorted(_integer_keys(ACCOConfig))


def test_the_integer_keys_are_found():
    assert {"acco.max_micro_batches_per_round", "acco.local_sgd.sync_every", "acco.local_sgd.replica_group_size",
            "acco.local_sgd.anomaly.warmup_syncs", "acco.emulation.slow_rank",
            "acco.collectives.ranks_per_node", "acco.compression.block_size"} <= set(INTEGER_KEYS), INTEGER_KEYS


@pytest.mark.parametrize("path", INTEGER_KEYS)
@pytest.mark.parametrize("value", [True, "4", 2.0])
def test_integer_keys_take_json_integers_only(path, value):
    """``"sync_every": true`` once trained with H = 1: a boolean, a string or a float is refused by name."""
    with pytest.raises(ValueError) as err:
        parse_acco_config({"acco": _block_with(path, value)})
    message = str(err.value)
    assert f'"{path}": Input should be a valid integer (got {value!r})' in message, message
    assert "a JSON integer, not a string, a float or a boolean" in message
    parse_acco_config({"acco": _block_with(path, 8)})  # the same key with a JSON integer is accepted


def test_what_compression_applies_to_and_says():
    """Default ("auto"): what crosses nodes; a listed entry wherever it runs; the words the banner prints."""
    from acco_ds.runtime.comm.compression import describe
    off = parse_acco_config({"acco": {"enabled": True}})
    assert not off.compression.enabled and describe(off.compression, False) == "off (full precision)"
    auto = parse_acco_config({"acco": {"enabled": True, "mode": "diloco", "compression": {"dtype": "int8"}}})
    c = auto.compression
    assert (c.block_size, c.error_feedback, c.residual_dtype, c.apply_to) == (256, True, "fp32", None)
    assert c.applies_to("rounds", True) and not c.applies_to("rounds", False) and c.applies_to("outer", True)
    assert describe(c, True, rounds=False, outer=True) == ("int8, one fp32 scale per 256 values, error feedback "
                                                           "in fp32, on: outer all-reduce; auto: only groups that "
                                                           "span nodes")
    forced = parse_acco_config({"acco": {"enabled": True, "compression": {"dtype": "fp8", "apply_to": ["rounds"],
                                                                        "error_feedback": False}}}).compression
    assert forced.applies_to("rounds", False) and not forced.applies_to("outer", True)
    assert describe(forced, False).startswith("fp8, one fp32 scale per 256 values, no error feedback, on: round")


def test_memory_plan_counts_compression():
    """Residuals: (P-1) partitions (P ranks in the quantized step: W flat, the nodes node-aware) in the
    residual dtype; the kept shard becomes fp32 (acco); sync needs a target shard; the outer all-reduce
    about one shard."""
    from acco_ds.memory import acco_buffer_bytes, estimate_memory, outer_residual_bytes
    n, W = 1 << 20, 8
    base = acco_buffer_bytes(n, W, "bf16", mode="acco")
    int8 = {"dtype": "int8"}
    assert acco_buffer_bytes(n, W, "bf16", mode="acco", compression=int8) == base + 7 * n // W * 4 + n // W * 2 - \
        n // W * 2  # + residuals, kept bf16 -> fp32, the bf16 reduce output is gone
    assert acco_buffer_bytes(n, W, "bf16", mode="acco", compression=int8, nodes=2) == base + n // W * 4
    assert acco_buffer_bytes(n, W, "bf16", mode="acco", compression={**int8, "residual_dtype": "bf16"}) == \
        base + 7 * n // W * 2
    assert acco_buffer_bytes(n, W, "bf16", mode="acco", compression={**int8, "error_feedback": False}) == base
    sync = acco_buffer_bytes(n, W, "bf16", mode="sync")
    # sync: + residuals + a bf16 target shard - the bf16 reduce output
    assert acco_buffer_bytes(n, W, "bf16", mode="sync", compression=int8) == sync + 7 * n // W * 4
    assert outer_residual_bytes(n, 2, 4, int8) == n // 2 * 4
    assert outer_residual_bytes(n, 2, 4, {**int8, "apply_to": ["rounds"]}) == 0
    est = estimate_memory(params=7e9, gpus=16, dtype="bf16", compression=int8, nodes=2, verbose=False)
    assert est["acco_bytes"] > estimate_memory(params=7e9, gpus=16, dtype="bf16", verbose=False)["acco_bytes"]


@pytest.mark.parametrize("address, problem", [
    ("localhost:29510", "the scheme is missing: write http://localhost:29510"),
    ("tcp://10.0.0.5:29510", "the scheme must be http or https"),
    ("file:///etc/hosts", "the scheme must be http or https"),
    ("http://10.0.0.5", "it names no port"),
    ("http://:29510", "it names no host"),
    ("http://10.0.0.5:99999", "Port out of range"),
    ("http://admin:secret@10.0.0.5:29510", "a user or password, which the lighthouse does not check"),
    ("http://10.0.0.5:29510/quorum", "it carries a path, query or fragment"),
])
def test_the_lighthouse_is_an_http_url_with_a_host_and_a_port(address, problem, monkeypatch):
    """acco.fault_tolerance.lighthouse (and TORCHFT_LIGHTHOUSE, read when the replica starts) takes only
    http(s)://host:port: anything else is refused by name, with the fix."""
    from acco_ds.config import FaultToleranceConfig
    block = {"acco": {"enabled": True, "mode": "diloco", "fault_tolerance": {"lighthouse": address}}}
    with pytest.raises(ValueError) as err:
        parse_acco_config(block)
    text = str(err.value)
    assert '"acco.fault_tolerance.lighthouse": Value error, must be an http(s) URL with a host and a port, such as ' \
           'http://10.0.0.5:29510' in text and problem in text and f"(got {address!r})" in text, text
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)
    with pytest.raises(ValueError, match=f"^TORCHFT_LIGHTHOUSE={address!r} must be an http.s. URL"):
        FaultToleranceConfig().resolved_lighthouse()
    for good in ("http://10.0.0.5:29510", "https://lighthouse.cluster.internal:443", "http://[fd00::5]:29510/"):
        assert parse_acco_config({"acco": {**block["acco"], "fault_tolerance": {"lighthouse": good}}}) \
            .fault_tolerance.lighthouse == good
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", good)
        assert FaultToleranceConfig().resolved_lighthouse() == good
