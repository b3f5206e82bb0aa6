"""The kernels of acco_ds, each with its pure-torch reference:

* ``adamw_update``: fused AdamW update of a flat fp32 shard, written straight
  into the all-gather send buffer; ``commit=False`` (Peek) changes no state.
* ``quantize_pack``: block quantization of compressed communication in one
  pass: add the error-feedback residual, one fp32 scale per block, int8 or
  fp8 e4m3 values, store the new residual.
* ``dequantize_accumulate``: ``out += q * scale`` per block (the receiver's
  fp32 sum, or an update applied to bit16 parameters).
* ``sparse_pack`` / ``sparse_unpack_accumulate``: sparse outer communication
  (sparseloco): per chunk the top-k entries of the error buffer, quantized to
  2/4/8-bit levels with their in-chunk indices (int16; ``sparse_codec`` packs
  them at the chunk's bits for the wire), the residual left in the buffer; and
  the receiver's ``out[kept] += q * weight``.
* ``sparse_average``: the receiver's weighted average of every replica's
  payload. On the CPU one pass over ``out`` (each chunk summed in cache, then
  written once); elsewhere composed from ``sparse_unpack_accumulate``.

(A multi-tensor pack/unpack kernel existed until 0.2: the engine never needed
it, since backward hooks add each gradient straight into the flat
accumulator, so it was removed.)

``load_kernels(kernels, device)`` picks the implementation the engine uses:
``native`` (the C++/CUDA op; an error naming the cause if it does not build),
``torch`` (the reference), ``auto`` (native if it loads, else torch with one
log line). A JIT build never hangs on a lock left by a killed build, nor waits
for another process's build longer than ``ACCO_JIT_WAIT_S`` seconds (default
300): see ``builder.JitBuildLock``.
"""

import functools
import importlib
import logging
import sys
import time
from typing import Dict, List, Optional, Tuple

from . import reference

logger = logging.getLogger("acco_ds")

_cache: Dict[Tuple[str, str, bool], "Kernels"] = {}
_load_errors: Dict[str, str] = {}


class Kernels:
    """One implementation of the ops: ``name`` says which."""

    def __init__(self, name, adamw_update, quantize_pack=reference.quantize_pack,
                 dequantize_accumulate=reference.dequantize_accumulate, sparse_pack=reference.sparse_pack,
                 sparse_unpack_accumulate=reference.sparse_unpack_accumulate, sparse_average=None):
        self.name, self._adamw_update = name, adamw_update
        self.quantize_pack, self.dequantize_accumulate = quantize_pack, dequantize_accumulate
        # sparseloco's chunked top-k + levels + pack, and unpack + accumulate (reference.sparse_pack's contract)
        self.sparse_pack, self.sparse_unpack_accumulate = sparse_pack, sparse_unpack_accumulate
        # the receiver's weighted average of R payloads: one fused pass where the op has it, else composed
        # from sparse_unpack_accumulate (reference.sparse_average)
        self.fused_average = sparse_average is not None
        self.sparse_average = sparse_average or functools.partial(reference.sparse_average,
                                                                  unpack=sparse_unpack_accumulate)

    def adamw_update(self, master, grad, exp_avg, exp_avg_sq, out, *, step, lr, beta1, beta2, eps, weight_decay,
                     grad_scale, commit, adamw=True):
        self._adamw_update(master, grad, exp_avg, exp_avg_sq, out, step=step, lr=lr, beta1=beta1, beta2=beta2,
                           eps=eps, weight_decay=weight_decay, grad_scale=grad_scale, commit=commit, adamw=adamw)

    def __repr__(self):
        return f"Kernels({self.name})"


TORCH = Kernels("torch", reference.adamw_update)


def _device_type(device) -> str:
    return str(device).split(":")[0]


NATIVE_MODULES = {"cpu": "acco_ds.ops.acco_cpu_ops_op", "cuda": "acco_ds.ops.acco_cuda_ops_op"}  # AOT builds


def load_native(device_type: str = "cpu", jit: bool = True):
    """Load the native op module for ``cpu`` or ``cuda``: the one ``pip install`` built ahead of time, else a
    JIT build through DeepSpeed's op builder. ``jit=False`` imports only the ahead-of-time module, never
    DeepSpeed (the torch host), and raises without one."""
    if not jit:
        try:
            return importlib.import_module(NATIVE_MODULES[device_type])
        except (ImportError, KeyError):  # not built, or built against another torch (undefined symbols)
            raise RuntimeError(f"no ahead-of-time {device_type} op module (build it with ACCO_BUILD_OPS=1 pip "
                               f"install --no-build-isolation -e .); JIT builds go through DeepSpeed's op "
                               f"builder, which this host does not import") from None
    from .builder import BUILDERS
    if device_type not in BUILDERS:
        raise RuntimeError(f"acco_ds has no native ops for device type {device_type!r}")
    builder = BUILDERS[device_type]()
    if not builder.is_compatible():
        raise RuntimeError(f"{builder.NAME} is not compatible with this machine: {builder.error_log or ''}")
    return builder.load(verbose=False)


def _native_kernels(device_type: str, jit: bool = True) -> Kernels:
    module = load_native(device_type, jit)
    names = ("adamw_update", "quantize_pack", "dequantize_accumulate", "sparse_pack", "sparse_unpack_accumulate") + \
        (("sparse_average",) if device_type == "cpu" else ())
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"the {device_type} op module {getattr(module, '__file__', module)} has no "
                           f"{', '.join(missing)}: it was built from older sources. Rebuild it "
                           f"(ACCO_BUILD_OPS=1 pip install --no-build-isolation -e .) or delete that file so the "
                           f"op is JIT-built")

    def adamw_update(master, grad, exp_avg, exp_avg_sq, out, *, step, lr, beta1, beta2, eps, weight_decay,
                     grad_scale, commit, adamw=True):
        module.adamw_update(master, grad, exp_avg, exp_avg_sq, out, int(step), float(lr), float(beta1), float(beta2),
                            float(eps), float(weight_decay), float(grad_scale), bool(commit), bool(adamw))

    def quantize_pack(x, residual, q, scales, *, block_size):
        module.quantize_pack(x, residual, q, scales, int(block_size))

    def dequantize_accumulate(q, scales, out, *, block_size):
        module.dequantize_accumulate(q, scales, out, int(block_size))

    def sparse_pack(e, offsets, *, topk, value_bits):
        return module.sparse_pack(e, offsets, int(topk), int(value_bits))

    def sparse_unpack_accumulate(out, offsets, indices, values, scales, *, topk, value_bits, weight=1.0):
        module.sparse_unpack_accumulate(out, offsets, indices, values, scales, int(topk), int(value_bits),
                                        float(weight))

    average = getattr(module, "sparse_average", None)  # fused on the CPU; CUDA composes it

    def sparse_average(out, offsets, payloads, weights, *, topk, value_bits):
        payloads = list(payloads)
        average(out, offsets, [p[0] for p in payloads], [p[1] for p in payloads], [p[2] for p in payloads],
                [float(w) for w in weights], int(topk), int(value_bits))

    return Kernels(f"native-{device_type}", adamw_update, quantize_pack, dequantize_accumulate, sparse_pack,
                   sparse_unpack_accumulate, sparse_average if average is not None else None)


def load_kernels(kernels: str = "auto", device="cpu", jit: Optional[bool] = None) -> Kernels:
    """The implementation for ``kernels`` in {auto, torch, native} on ``device``. ``jit`` (see ``load_native``;
    None: when DeepSpeed is already imported, so the torch host never imports it)."""
    if jit is None:
        jit = "deepspeed" in sys.modules
    if kernels not in ("auto", "torch", "native"):
        raise ValueError(f'kernels must be "auto", "torch" or "native", got {kernels!r}')
    device_type = _device_type(device)
    key = (kernels, device_type, jit)
    if key in _cache:
        return _cache[key]
    if kernels == "torch":
        result = TORCH
    else:
        try:
            result = _native_kernels(device_type, jit)
        except Exception as err:  # noqa: BLE001 - any build/load failure
            _load_errors[device_type] = f"{type(err).__name__}: {err}"
            if kernels == "native" and getattr(err, "lock_path", None) is not None:  # builder.JitLockTimeout
                raise RuntimeError(f'acco.kernels="native" but the {device_type} op could not be loaded: {err}') \
                    from err
            if kernels == "native":
                raise RuntimeError(f'acco.kernels="native" but the {device_type} op could not be built or loaded '
                                   f'({_load_errors[device_type]}). Install a C++ compiler and ninja (and nvcc for '
                                   f'CUDA), or set "acco": {{"kernels": "torch"}}') from err
            logger.warning(f"acco_ds: native {device_type} ops unavailable ({_load_errors[device_type].splitlines()[0]}"
                           f"); using the pure-torch kernels")
            result = TORCH
    _cache[key] = result
    return result


def adamw_update(master, grad, exp_avg, exp_avg_sq, out, *, step, lr, beta1, beta2, eps, weight_decay, grad_scale,
                 commit, adamw=True):
    """Fused AdamW update (see ``reference.adamw_update``), native when it loads."""
    load_kernels("auto", master.device).adamw_update(master, grad, exp_avg, exp_avg_sq, out, step=step, lr=lr,
                                                     beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                                     grad_scale=grad_scale, commit=commit, adamw=adamw)


def op_report() -> List[dict]:
    """One row per native op: compatible, AOT-built, loadable, and what ``auto`` picks."""
    from .builder import BUILDERS
    rows = []
    for device_type, cls in BUILDERS.items():
        builder = cls()
        row = {"op": builder.NAME, "device": device_type, "compatible": bool(builder.is_compatible()),
               "aot_built": builder.aot_module() is not None}
        if row["compatible"]:
            start = time.perf_counter()
            try:
                load_native(device_type)
                row["loadable"], row["load_s"] = True, round(time.perf_counter() - start, 2)
            except Exception as err:  # noqa: BLE001
                row["loadable"], row["error"] = False, f"{type(err).__name__}: {str(err).splitlines()[0]}"
        else:
            row["loadable"], row["error"] = False, f"not compatible: {builder.error_log or 'see DeepSpeed warnings'}"
        row["auto_uses"] = f"native-{device_type}" if row["loadable"] else "torch"
        rows.append(row)
    return rows


__all__ = ["adamw_update", "load_kernels", "load_native", "op_report", "Kernels", "TORCH",
           "reference"]
