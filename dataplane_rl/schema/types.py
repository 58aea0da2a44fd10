"""Arrow types of declared columns: the dtype names, a token's (possibly shaped) type, their names in errors."""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import pyarrow as pa

# Arrow type names a column may declare. Fixed-width types convert to numpy/torch without a copy.
ARROW_DTYPES: dict[str, pa.DataType] = {
    "bool": pa.bool_(),
    "int8": pa.int8(),
    "int16": pa.int16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "uint8": pa.uint8(),
    "float16": pa.float16(),
    "float32": pa.float32(),
    "float64": pa.float64(),
    "string": pa.string(),
}


def nested_type(value_type: pa.DataType, shape: Sequence[int]) -> pa.DataType:
    """`value_type` wrapped in one fixed_size_list per dimension of `shape`, innermost last."""
    t = value_type
    for d in reversed(tuple(shape)):
        t = pa.list_(t, int(d))
    return t


def inner_shape(t: pa.DataType) -> tuple[tuple[int, ...], pa.DataType]:
    """(shape, value type) of one token's type: ((), t) for a scalar, ((64,), float32) for
    fixed_size_list<float32, 64>."""
    shape = []
    while pa.types.is_fixed_size_list(t):
        shape.append(t.list_size)
        t = t.value_type
    return tuple(shape), t


_NAMES = {t: n for n, t in ARROW_DTYPES.items()}


def type_name(t: pa.DataType) -> str:
    """Arrow type in the schema's words: float32, list<int32>."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{type_name(t.value_type)}>"
    shape, value = inner_shape(t)
    if shape:
        return f"{type_name(value)}[{', '.join(map(str, shape))}]"
    return _NAMES.get(t, str(t))


def token_lengths(arr: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Per-row value counts of a list column, from its offsets (no copy of the values)."""
    if isinstance(arr, pa.ChunkedArray):
        parts = [token_lengths(c) for c in arr.chunks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    offsets = np.asarray(arr.offsets)
    return np.diff(offsets).astype(np.int64)


# A shape dimension that names a config value: dotted lower-case words (distillation.topk_logits_k).
CONFIG_KEY = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)+")


def whole_dims(shape):
    """A schema's `shape`, refused unless it lists whole numbers or config keys: pydantic took `shape: [true]`
    as [1]."""
    if isinstance(shape, (list, tuple)) and not all(type(d) is int or (isinstance(d, str) and CONFIG_KEY.fullmatch(d))
                                                    for d in shape):
        raise ValueError(f"shape {list(shape)} must list whole numbers (true/false and decimals are not "
                         "dimensions) or config keys, e.g. shape: [64] or shape: [distillation.topk_logits_k]")
    return shape
