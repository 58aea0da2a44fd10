"""Arrow columns to numpy/torch: zero-copy views of values, and padded [B, T] tensors with masks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa


def list_array(values: np.ndarray, lengths, value_type: pa.DataType) -> pa.ListArray:
    """The one offsets-to-ListArray builder: flat `values` [N] cut into rows of `lengths` [B] (sum N)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int32)  # [B+1]
    np.cumsum(lengths, out=offsets[1:])
    if int(offsets[-1]) != len(values):
        raise ValueError(f"list_array: lengths sum to {int(offsets[-1])}, values hold {len(values)}")
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=value_type))


def list_array_of_rows(rows, value_type: pa.DataType) -> pa.ListArray:
    """A token column from one 1-D array per row."""
    rows = list(rows)
    flat = np.concatenate(rows) if rows else np.zeros(0, dtype=value_type.to_pandas_dtype())
    return list_array(flat, [len(r) for r in rows], value_type)


def to_numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A sample column as numpy; zero-copy for one chunk of a fixed-width type."""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            column = column.chunk(0)
        else:
            return np.concatenate([to_numpy(c) for c in column.chunks]) if column.num_chunks else np.zeros(0)
    if pa.types.is_boolean(column.type) or pa.types.is_string(column.type):
        return column.to_numpy(zero_copy_only=False)
    return column.to_numpy(zero_copy_only=True)


def token_values(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(flat values, lengths) of a token (list) column. Values are a zero-copy view for one chunk."""
    if isinstance(column, pa.ChunkedArray):
        parts = [token_values(c) for c in column.chunks]
        if len(parts) == 1:
            return parts[0]
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    offsets = np.asarray(column.offsets)
    values = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    if values.null_count or column.null_count:  # stores refuse these; a column from elsewhere may hold them
        from dataplane_rl.errors import SchemaError

        raise SchemaError(f"token column of type {column.type} holds nulls; every row and token needs a value")
    return values.to_numpy(zero_copy_only=True), np.diff(offsets).astype(np.int64)


def pad_tokens(column: pa.Array | pa.ChunkedArray, pad_value=0, length: int | None = None, torch: bool = True):
    """A token column as a right-padded [B, T] array and its [B, T] validity mask.

    T is the longest row (or `length`). Returns torch tensors by default, numpy arrays with torch=False.
    """
    values, lengths = token_values(column)
    B = lengths.size
    T = int(lengths.max(initial=0)) if length is None else int(length)
    if lengths.size and lengths.max() > T:
        raise ValueError(f"pad_tokens: a row has {int(lengths.max())} tokens, more than length={T}")
    out = np.full((B, T), pad_value, dtype=values.dtype)  # [B, T]
    row_idx = np.repeat(np.arange(B), lengths)  # [N]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if B else np.zeros(0, dtype=np.int64)
    col_idx = np.arange(values.size) - np.repeat(starts, lengths)  # [N]
    out[row_idx, col_idx] = values
    mask = np.arange(T)[None, :] < lengths[:, None]  # [B, T]
    if not torch:
        return out, mask
    import torch as _torch

    return _torch.from_numpy(out), _torch.from_numpy(mask)
