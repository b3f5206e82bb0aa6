"""Flags into numbers: sizes, bandwidths, memory, token factors and the DeepSpeed config, each refused by name
with the fix when it is wrong."""

import json
import re

from .factors import REFERENCE_H, TOKEN_FACTORS

UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
         "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12, "p": 1e15}


class PlanError(ValueError):
    """Bad input to the plan: the message names the flag and the fix."""


def parse_bandwidth(text: str, flag: str) -> float:
    """Bits per second from ``100mbit``, ``1gbit``, ``400gbit``, ``10gbps`` or a bare number of bits/s."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]*)\s*", str(text).lower())
    if not m:
        raise PlanError(f"{flag} {text!r} is not a bandwidth: write bits per second such as 100mbit, 1gbit, 400gbit")
    unit = m.group(2) or "bit"
    if unit not in UNITS:
        raise PlanError(f"{flag} {text!r}: unknown unit {m.group(2)!r}. Bandwidths are bits per second: write "
                        f"100mbit, 1gbit, 400gbit (units: {', '.join(UNITS)}), or a bare number of bits/s; "
                        f"bytes per second (GB/s) are not accepted, multiply them by 8")
    value = float(m.group(1)) * UNITS[unit]
    if value <= 0:
        raise PlanError(f"{flag} {text!r} must be positive (a link that carries nothing cannot be planned)")
    return value


def parse_count(text: str, flag: str, integer: bool = False, suffix: str = "", at_least=None, why="") -> float:
    """A positive count such as 7e9, 7b, 1.3B, 4m, 989e12, 989tflops (and >= ``at_least``, ``why`` says why)."""
    t = str(text).strip().lower()
    if suffix and t.endswith(suffix):
        t = t[:-len(suffix)]
    m = re.fullmatch(r"([-+]?[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)([kmbgtp]?)", t)
    if not m:
        raise PlanError(f"{flag} {text!r} is not a number: write e.g. 7e9 or 7b (suffixes k, m, b/g, t, p)")
    value = float(m.group(1)) * SCALE[m.group(2)]
    if value <= 0:
        raise PlanError(f"{flag} must be positive, got {text!r}")
    if integer and value != int(value):
        raise PlanError(f"{flag} must be a whole number, got {text!r}")
    if at_least is not None and value < at_least:
        raise PlanError(f"{flag} {text!r} must be >= {at_least:g} ({why})")
    return int(value) if integer else value


MEMORY_UNITS = {"b": 1.0, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2.0 ** 10, "mib": 2.0 ** 20,
                "gib": 2.0 ** 30, "tib": 2.0 ** 40}


def parse_memory(text: str, flag: str) -> float:
    """Bytes from ``80gb``, ``141GB``, ``80GiB``, ``96gib`` (GB = 1e9 bytes, GiB = 2**30)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m:
        raise PlanError(f"{flag} {text!r} is not a memory size: write e.g. 80gb or 80gib")
    if m.group(2) not in MEMORY_UNITS:
        raise PlanError(f"{flag} {text!r}: unknown memory unit {m.group(2)!r}. Write bytes with a unit: 80gb, "
                        f"141gb (GB = 1e9 bytes) or 80gib (GiB = 2**30); units: {', '.join(MEMORY_UNITS)}")
    value = float(m.group(1)) * MEMORY_UNITS[m.group(2)]
    if value <= 0:
        raise PlanError(f"{flag} {text!r} must be positive")
    return value


def parse_factors(items) -> dict:
    out = {}
    for item in items or []:
        name, _, value = item.partition("=")
        name = name.strip().replace("_", " ")
        if name not in TOKEN_FACTORS:
            raise PlanError(f"--token-factor {item!r}: unknown mode {name!r}. Known: {', '.join(TOKEN_FACTORS)} "
                            f"(local-SGD factors are at H={REFERENCE_H})")
        try:
            out[name] = float(value)
        except ValueError:
            raise PlanError(f"--token-factor {item!r}: write NAME=FACTOR, e.g. diloco=1.1") from None
        if out[name] <= 0:
            raise PlanError(f"--token-factor {item!r}: the factor must be positive")
    return out


def read_config(path: str, layout) -> dict:
    """Micro-batch, accumulation, ZeRO stage, dtypes and the ``"acco"`` block of a DeepSpeed config, checked
    by DeepSpeed's own config model and by the rulebook at ``layout`` (what ``initialize`` would refuse,
    refused)."""
    from dataclasses import replace

    from ..config import parse_acco_config, refusals
    world = layout.dp_world
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as err:
        raise PlanError(f"--config {path}: cannot read it as JSON ({err})") from None
    if not isinstance(cfg, dict):
        raise PlanError(f"--config {path}: a DeepSpeed config is a JSON object, got {type(cfg).__name__}")
    micro = cfg.get("train_micro_batch_size_per_gpu")
    gas = cfg.get("gradient_accumulation_steps", 1)
    tbs = cfg.get("train_batch_size")
    if tbs is not None and micro is not None and tbs != micro * gas * world:  # DeepSpeed's batch rule
        raise PlanError(f"--config {path}: train_batch_size {tbs} != train_micro_batch_size_per_gpu {micro} x "
                        f"gradient_accumulation_steps {gas} x world size {world} (data-parallel: --nodes x "
                        f"--ranks-per-node / (tp x pp)), which DeepSpeed refuses: fix the batch sizes or the world "
                        f"size")
    try:
        from ..deepspeed.compat import DeepSpeedConfig
        body = {k: v for k, v in cfg.items() if k not in ("train_batch_size", "acco")}
        if micro is None and tbs is not None:
            body["train_micro_batch_size_per_gpu"] = max(1, tbs // (gas * world))
        ds = DeepSpeedConfig(body)  # world size 1 here: the batch rule above is checked at the plan's world size
        acco = parse_acco_config(cfg)
    except Exception as err:  # noqa: BLE001 - DeepSpeed raises assorted types for a bad config
        raise PlanError(f"--config {path} is refused: {err}") from None
    problems = refusals(acco, replace(layout, micro_batches=int(ds.gradient_accumulation_steps)), cfg)
    if problems:
        raise PlanError(f"--config {path} is refused:\n  - " + "\n  - ".join(problems))
    dt = "bf16" if ds.bfloat16_config.enabled else "fp16" if ds.float16_config.enabled else "fp32"
    return {"micro_batch": int(ds.train_micro_batch_size_per_gpu), "gas": int(ds.gradient_accumulation_steps),
            "zero_stage": int(ds.zero_optimization_stage), "dtype": dt, "acco": cfg.get("acco"), "parsed": acco,
            "grad_accum_dtype": (cfg.get("data_types") or {}).get("grad_accum_dtype")}
