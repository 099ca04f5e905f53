"""The element types echonccl reduces, by name, for numpy and for CUDA."""
from __future__ import annotations

import ml_dtypes
import numpy as np

SUPPORTED = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}
CUDA_TYPE = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float"}


_NAMES: dict = {}     # dtype -> name, for the hot path (numpy's dtype.name is slow)


def canonical(dtype) -> str:
    """Name of a supported dtype; `TypeError` naming the supported ones otherwise."""
    try:
        return _NAMES[dtype]
    except (KeyError, TypeError):
        pass
    name = _canonical(dtype)
    if isinstance(dtype, np.dtype):
        _NAMES[dtype] = name
    return name


def _canonical(dtype) -> str:
    name = dtype if isinstance(dtype, str) else getattr(dtype, "name", None)
    if not isinstance(name, str):       # a scalar type (np.float32, ml_dtypes.bfloat16) or an unknown object
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    name = {"half": "float16", "float": "float32", "bf16": "bfloat16"}.get(name, name)
    if name not in SUPPORTED:
        raise TypeError(f"echonccl reduces float16, bfloat16 and float32 arrays, not {name}")
    return name


def numpy_dtype(name: str) -> np.dtype:
    return SUPPORTED[canonical(name)]
