"""DeepSpeed's dtype names and element sizes, in one place."""

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def size(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (DeepSpeed's names), anything else as torch prints it."""
    return next((name for name, dt in DTYPES.items() if dt == dtype), str(dtype))


def as_dtype(name) -> torch.dtype:
    """``"bf16"`` (or a torch dtype) -> ``torch.bfloat16``."""
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]
