"""The dtype names users write (`model.dtype`, `parallel.fsdp_plan.param_dtype` / `reduce_dtype`, the tools'
`--dtype`) and the torch dtypes they stand for — the one table every package reads."""

from __future__ import annotations

import torch

from mmfsdp.parallel.config import DType

__all__ = ["DTYPES", "dtype_name"]

DTYPES: dict[DType, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The short name of `dtype` (`bf16`), or its torch name for a dtype outside the table."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    return str(dtype).removeprefix("torch.")
