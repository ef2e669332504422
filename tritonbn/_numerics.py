"""The dtypes tritonbn takes, and the arithmetic type it computes each in (kernels and PyTorch backend alike)."""

from __future__ import annotations

import torch

FLOAT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What inputs of ``dtype`` compute in (and save invstd as): float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32
