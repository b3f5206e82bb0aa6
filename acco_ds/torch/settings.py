"""The config the torch host reads: the ``"acco"`` block plus the few DeepSpeed keys it gives the same meaning.

    {"gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
     "acco": {"enabled": true, "mode": "acco"}}

``gradient_accumulation_steps``: backward passes per ``optimizer.step()``
(each micro-batch loss divided by it, as DeepSpeed divides it);
``gradient_clipping``: clip the global gradient norm (0: off);
``communication_data_type`` / ``data_types.grad_accum_dtype``: the
reduce-scatter and accumulation dtypes (default: the parameters' dtype).
Batch-size keys are accepted and checked against nothing; any other DeepSpeed
key is refused by name (this host does not run it), so nothing is ignored.
"""

import json
import os
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from ..config import ACCOConfig, Layout, parse_acco_config, refusals
from ..runtime.dtypes import as_dtype

KEYS = ("acco", "gradient_accumulation_steps", "gradient_clipping", "communication_data_type", "data_types")
INFORMATIONAL = ("train_micro_batch_size_per_gpu", "train_batch_size", "steps_per_print")


@dataclass
class HostSettings:
    acco: ACCOConfig
    gradient_accumulation_steps: int
    gradient_clipping: float
    comm_dtype: Optional[torch.dtype]
    accum_dtype: Optional[torch.dtype]


def read_config(config: Union[dict, str, os.PathLike], layout: Layout) -> HostSettings:
    """Parse and check ``config`` (a dict, or the path of a JSON file) for ``layout`` (the rulebook's:
    ``acco_ds.config.rulebook``); raises ``ValueError`` naming every problem and its fix."""
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, dict):
        raise TypeError(f"acco_ds.torch: config must be a dict or the path of a JSON file, got "
                        f"{type(config).__name__}")
    problems = [f'"{key}" is a DeepSpeed setting the torch host does not run (it reads {", ".join(KEYS)}): remove '
                f'it, or train with DeepSpeed (acco_ds.initialize)' for key in config
                if key not in KEYS + INFORMATIONAL]
    acco = parse_acco_config(config)
    if not acco.enabled:
        problems.append('"acco": {"enabled": true} is missing: the torch host only trains with ACCO (without it, '
                        'use your script as it was)')
    gas = config.get("gradient_accumulation_steps", 1)
    if type(gas) is not int or gas < 1:
        problems.append(f"gradient_accumulation_steps must be a whole number >= 1 (backward passes per "
                        f"optimizer.step()), got {gas!r}")
        gas = 1
    clip = config.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip >= 0:
        problems.append(f"gradient_clipping must be a number >= 0 (0: no clipping), got {clip!r}")
        clip = 0.0
    dtypes = config.get("data_types") or {}
    extra = [k for k in dtypes if k != "grad_accum_dtype"] if isinstance(dtypes, dict) else ["(not an object)"]
    if extra:
        problems.append(f"data_types: only grad_accum_dtype is read by the torch host, got {extra}")
    try:
        comm = config.get("communication_data_type")
        comm = None if comm is None else as_dtype(comm)
        accum = dtypes.get("grad_accum_dtype") if isinstance(dtypes, dict) else None
        accum = None if accum is None else as_dtype(accum)
    except (KeyError, ValueError) as err:
        problems.append(f"{err} (write fp32, bf16 or fp16)")
        comm = accum = None
    problems += refusals(acco, replace(layout, micro_batches=gas))
    if problems:
        raise ValueError("acco_ds.torch cannot run with this config:\n  - " + "\n  - ".join(problems))
    return HostSettings(acco, gas, float(clip), comm, accum)


__all__ = ["HostSettings", "read_config"]
