"""Run Megatron-DeepSpeed HEAD on DeepSpeed 0.19.x without editing its imports.

Put this directory on PYTHONPATH (it is loaded at interpreter start-up as ``sitecustomize``):

- Megatron's ``megatron/training.py`` imports ``deepspeed.compression.compress``, which
  DeepSpeed 0.19 removed. A stand-in module is registered; it fails loudly only if
  compression training (a ``"compression_training"`` config block) is actually used.
- ``megatron/training.py`` also imports its vision code (``knn_monitor`` -> ``torchvision``)
  even for GPT; where torchvision is not installed (installing it would replace a CPU torch
  build), an inert stand-in for that one module is registered. DINO vision pre-training is
  then unavailable. Set ACCO_MEGATRON_KEEP_VISION=1 to skip this stand-in.

A stub directory cannot shadow one submodule of the installed ``deepspeed`` package, which is
why this uses ``sys.modules`` rather than a ``deepspeed/compression/compress.py`` file.
"""

import importlib.util
import os
import sys
import types


def _unavailable(*args, **kwargs):
    raise RuntimeError("deepspeed.compression was removed in DeepSpeed 0.19; this is acco_ds's "
                       "examples/megatron/compat stand-in (compression training is not available)")


_compress = types.ModuleType("deepspeed.compression.compress")
_compress.init_compression = _compress.redundancy_clean = _unavailable
sys.modules.setdefault("deepspeed.compression.compress", _compress)

if not os.environ.get("ACCO_MEGATRON_KEEP_VISION") and importlib.util.find_spec("torchvision") is None:
    _knn = types.ModuleType("megatron.model.vision.knn_monitor")

    def _no_vision(*args, **kwargs):
        raise RuntimeError("torchvision is not installed (examples/megatron/compat stand-in)")

    _knn.compute_feature_bank = _no_vision
    sys.modules.setdefault("megatron.model.vision.knn_monitor", _knn)
