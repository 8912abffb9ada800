"""Model dtypes by name, for from_pretrained and the command line."""

from __future__ import annotations

import torch

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float64": torch.float64,
    "fp64": torch.float64,
    "double": torch.float64,
}
# float8 and the integer types hold weights, but no model runs in them
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A model dtype from a torch dtype or one of DTYPE_NAMES ("bf16", "float32", ...); anything else is a
    ValueError listing what is accepted."""
    accepted = f"one of {', '.join(repr(n) for n in DTYPE_NAMES)} or torch.{{float32, bfloat16, float16, float64}}"
    if isinstance(dtype, torch.dtype):
        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype {dtype} is not a dtype a model runs in; expected {accepted}")
        return dtype
    if isinstance(dtype, str) and dtype.lower().removeprefix("torch.") in DTYPE_NAMES:
        return DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    raise ValueError(f"dtype {dtype!r} is not understood; expected {accepted}")
