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
KERNEL_NAME = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}   # kernel_table's names


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


def kernel_name(dtype) -> str:
    """The name `kernel_table` gives a supported data dtype: "f16", "bf16" or "f32"."""
    return KERNEL_NAME[canonical(dtype)]


def residual_kernel_name(dtype) -> str:
    """The name `kernel_table` gives a residual store of ``dtype``: "i8" for the int8 block
    format (stored as uint8, `codec.residual_dtype`), else `kernel_name` (`TypeError` for any
    other type)."""
    return "i8" if np.dtype(dtype) == np.uint8 else kernel_name(dtype)
