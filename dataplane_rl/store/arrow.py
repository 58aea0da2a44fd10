"""Arrow at the store's edges: user data in (coercion to the declared types, one fast validation pass, a
put's columns as flat buffers cut into row blocks), Arrow columns out (zero-copy numpy views, padded
[B, T] tensors with masks), the one offsets-to-ListArray builder everything else uses, and each partition
schema's decoded form and Arrow types, cached by its text."""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import SchemaError
from dataplane_rl.schema import Column, Schema, inner_shape
from dataplane_rl.schema.types import type_name
from dataplane_rl.store.chunks import Block, Columns, Part, PartitionMeta, block_layout, nest, part_bytes, token_width


# ---- per-schema caches: decoded and built once per process, keyed by the schema's JSON text -------
@lru_cache(maxsize=256)
def _parse_schema(schema_json: str) -> Schema:
    return Schema.model_validate_json(schema_json)


def schema_of(meta: PartitionMeta) -> Schema:
    """The partition's schema, decoded once per process."""
    return _parse_schema(meta.schema_json)


@lru_cache(maxsize=256)
def arrow_types(schema_json: str) -> dict[str, pa.DataType]:
    """Each column's stored Arrow type, built once per schema (Column.arrow_type makes a new one per call)."""
    return {c.name: c.arrow_type for c in _parse_schema(schema_json).columns}


@lru_cache(maxsize=1024)
def block_schema(schema_json: str, columns: tuple[str, ...]) -> pa.Schema:
    """The Arrow schema of a block holding `columns`: what its record batch is written and decoded with."""
    return _parse_schema(schema_json).arrow_schema(list(columns))


@lru_cache(maxsize=1024)
def block_columns(schema_json: str, columns: tuple[str, ...]) -> Columns:
    """How a stored block of `columns` decodes, made once per schema and column set, keyed by strings
    (whose hashes Python caches; hashing Arrow types walks them on every call)."""
    types = arrow_types(schema_json)
    return Columns.of([types[c] for c in columns])


def list_array(values: np.ndarray, lengths, value_type: pa.DataType) -> pa.ListArray:
    """The one offsets-to-ListArray builder: flat `values` [N] cut into rows of `lengths` [B] (sum N). For a
    shaped column `value_type` is its token type (`Column.token_type`, fixed_size_list<dtype, K>) and
    `values` are [N, *shape] (or the same values flat, [N * prod(shape)])."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.zeros(lengths.size + 1, dtype=np.int32)  # [B+1]
    np.cumsum(lengths, out=offsets[1:])
    shape, scalar = inner_shape(value_type)
    width = math.prod(shape)
    values = np.asarray(values)
    if shape and values.ndim > 1 and tuple(values.shape[1:]) != shape:
        raise ValueError(f"list_array: values have shape {values.shape}, tokens of {value_type} need [N, "
                         f"{', '.join(map(str, shape))}]")
    if int(offsets[-1]) * width != values.size:
        raise ValueError(f"list_array: lengths sum to {int(offsets[-1])} tokens of {width} values, values hold "
                         f"{values.size}")
    flat = values.reshape(-1) if shape else values
    return pa.ListArray.from_arrays(pa.array(offsets), nest(pa.array(flat, type=scalar), shape))


def list_array_of_rows(rows, value_type: pa.DataType) -> pa.ListArray:
    """A token column from one array per row: [L_i], or [L_i, *shape] for a shaped column whose token type
    (`Column.token_type`) is `value_type`."""
    rows = list(rows)
    shape, scalar = inner_shape(value_type)
    flat = np.concatenate(rows) if rows else np.zeros((0, *shape), dtype=scalar.to_pandas_dtype())
    return list_array(flat, [len(r) for r in rows], value_type)


def schema_table(schema: Schema, columns: dict[str, Any], lengths=None) -> pa.Table:
    """A table of `columns`, in their order, each in the Arrow type `schema` declares for it, from plain values:
    a sample column from its rows' values; a token column from one sequence per row, or, given `lengths` (the
    rows' token counts), from all rows' values flat, row after row (no array per row: cheaper, docs/benchmarks.md
    "Store throughput"). An Arrow array is taken as it is (the put validates it)."""
    out = {}
    for name, values in columns.items():
        col = schema.column(name)
        if isinstance(values, (pa.Array, pa.ChunkedArray)):
            out[name] = values
        elif col.kind == "token":
            dtype = col.value_type.to_pandas_dtype()
            out[name] = (list_array(np.asarray(values, dtype), lengths, col.token_type) if lengths is not None else
                         list_array_of_rows([np.asarray(v, dtype) for v in values], col.token_type))
        elif col.dtype in ("string", "bool"):
            out[name] = pa.array(list(values), type=col.value_type)
        else:
            out[name] = pa.array(np.asarray(values, col.value_type.to_pandas_dtype()), type=col.value_type)
    return pa.table(out)


def to_numpy(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A sample column as numpy; zero-copy for one chunk of a fixed-width type. (Token columns: `token_values`,
    `token_rows`, `pad_tokens`.)"""
    if isinstance(column, pa.ChunkedArray):
        if column.num_chunks == 1:
            column = column.chunk(0)
        else:
            return np.concatenate([to_numpy(c) for c in column.chunks]) if column.num_chunks else np.zeros(0)
    if pa.types.is_boolean(column.type) or pa.types.is_string(column.type):
        return column.to_numpy(zero_copy_only=False)
    return column.to_numpy(zero_copy_only=True)


def token_values(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a token (list) column: values [N], or [N, *shape] for a shaped column, a zero-copy
    view for one chunk of a fixed-width type; lengths [B]."""
    if isinstance(column, pa.ChunkedArray):
        parts = [token_values(c) for c in column.chunks]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            shape, scalar = inner_shape(column.type.value_type)
            return np.zeros((0, *shape), dtype=scalar.to_pandas_dtype()), np.zeros(0, dtype=np.int64)
        return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]))
    offsets = np.asarray(column.offsets)
    tokens = column.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    flat, _ = flat_values(tokens)
    if flat is None or flat.null_count or column.null_count:  # stores refuse these; data from elsewhere may hold them
        raise SchemaError(f"token column of type {column.type} holds nulls; every row and token needs a value")
    values = flat.to_numpy(zero_copy_only=not pa.types.is_boolean(flat.type))
    shape = inner_shape(tokens.type)[0]
    return values.reshape(-1, *shape) if shape else values, np.diff(offsets).astype(np.int64)


def token_rows(column: pa.Array | pa.ChunkedArray) -> list[np.ndarray]:
    """A token column as one numpy array per row, [L_i] or [L_i, *shape], each a zero-copy view for one chunk
    (`torch.from_numpy` of a row is then one too; the arrays are read-only when they view store memory)."""
    values, lengths = token_values(column)
    return np.split(values, np.cumsum(lengths)[:-1]) if lengths.size else []


def pad_tokens(column: pa.Array | pa.ChunkedArray, pad_value=0, length: int | None = None, torch: bool = True):
    """A token column as a right-padded [B, T] array ([B, T, *shape] for a shaped column) and its [B, T]
    validity mask.

    T is the longest row (or `length`). Returns torch tensors by default, numpy arrays with torch=False.
    """
    values, lengths = token_values(column)
    B = lengths.size
    T = int(lengths.max(initial=0)) if length is None else int(length)
    if lengths.size and lengths.max() > T:
        raise ValueError(f"pad_tokens: a row has {int(lengths.max())} tokens, more than length={T}")
    out = np.full((B, T, *values.shape[1:]), pad_value, dtype=values.dtype)  # [B, T, *shape]
    row_idx = np.repeat(np.arange(B), lengths)  # [N]
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if B else np.zeros(0, dtype=np.int64)
    col_idx = np.arange(len(values)) - np.repeat(starts, lengths)  # [N]
    out[row_idx, col_idx] = values
    mask = np.arange(T)[None, :] < lengths[:, None]  # [B, T]
    if not torch:
        return out, mask
    import torch as _torch

    return _torch.from_numpy(out), _torch.from_numpy(mask)


# ---- input coercion ----------------------------------------------------------------------------
def as_numpy(data: Any) -> np.ndarray:
    if hasattr(data, "detach") and hasattr(data, "cpu"):  # torch.Tensor, without importing torch
        data = data.detach().cpu().numpy()
    return np.asarray(data)


def to_arrow(col: Column, data: Any, where: Any, want: pa.DataType | None = None) -> pa.Array:
    """Coerce user data to the column's declared Arrow type (`want`, if the caller has it cached),
    refusing silent casts. `where` prefixes error messages (anything formattable).

    Accepts Arrow arrays, numpy arrays or torch tensors (sample columns), lists of strings, and for
    token columns an Arrow list array or a sequence of arrays/tensors, one per row: [L_i], or [L_i, *shape]
    for a shaped column (one flat array with the lengths: `list_array(values, lengths, col.token_type)`).
    """
    want = want or col.arrow_type
    if isinstance(data, pa.ChunkedArray):
        data = data.combine_chunks()
    if isinstance(data, pa.Array):
        if data.type != want:
            shape = f" (shape {col.shape_text} per token)" if col.shape else ""
            raise SchemaError(f"{where} column '{col.name}' has Arrow type {type_name(data.type)}, declared "
                              f"{type_name(want)}{shape}; cast it (.cast) to the declared type only if the values fit")
        return data
    if col.kind == "token":
        row = f"[L, {', '.join(map(str, col.shape))}]" if col.shape else "1-D"
        if isinstance(data, np.ndarray) and data.dtype != object:
            raise SchemaError(f"{where} token column '{col.name}' given as a {data.ndim}-D array; pass one {row} "
                              "array per row (a list) or a pyarrow ListArray, so each row keeps its own length")
        parts = [as_numpy(x) for x in data]
        for i, p in enumerate(parts):
            if p.ndim != 1 + len(col.shape) or p.shape[1:] != col.shape:
                raise SchemaError(f"{where} token column '{col.name}' row #{i} has shape {list(p.shape)}; each row "
                                  f"must be {row}" + (f" (shape {col.shape_text} per token)" if col.shape else ""))
        values = np.concatenate(parts) if parts else np.zeros((0, *col.shape), dtype=col.value_type.to_pandas_dtype())
        _check_np_dtype(col, values, where)
        return list_array(values, [len(p) for p in parts], col.token_type)
    if col.dtype == "string":
        values = list(data)
        if not all(isinstance(v, str) for v in values):
            raise SchemaError(f"{where} string column '{col.name}' holds a non-str value; pass a list of str")
        try:
            return pa.array(values, type=pa.string())
        except UnicodeEncodeError:  # a lone surrogate ('\ud800', e.g. from errors="surrogateescape") has no UTF-8
            i = next(i for i, v in enumerate(values) if not _utf8(v))
            raise SchemaError(f"{where} string column '{col.name}' row #{i} is not valid Unicode (it holds a lone "
                              "surrogate, which UTF-8 cannot encode); decode the text with errors='replace'") from None
    arr = as_numpy(data)
    if arr.ndim != 1:
        raise SchemaError(f"{where} sample column '{col.name}' has shape {arr.shape}; a sample column is 1-D "
                          "(one value per row)")
    _check_np_dtype(col, arr, where)
    return pa.array(arr, type=col.value_type)


def _utf8(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def _check_np_dtype(col: Column, arr: np.ndarray, where: str) -> None:
    want = np.dtype(col.value_type.to_pandas_dtype())
    if arr.dtype != want:
        raise SchemaError(f"{where} column '{col.name}' has dtype {arr.dtype}, declared {col.dtype}; "
                          f"convert it first (e.g. .astype(np.{want}))")


def _column_info(schema: Schema) -> dict[str, tuple[bool, bool, bool, bool, bool]]:
    """Per column: (token column, has offsets, NaN/inf refused, bool values, shaped), read once per schema."""
    info = schema.__dict__.get("_scan_info")
    if info is None:
        info = {c.name: (c.kind == "token", c.kind == "token" or c.dtype == "string",
                         c.dtype.startswith("float") and not c.allow_nonfinite, c.dtype == "bool", bool(c.shape))
                for c in schema.columns}
        schema.__dict__["_scan_info"] = info  # a frozen model: its cache goes beside the fields
    return info


def flat_values(tokens: pa.Array) -> tuple[pa.Array | None, int]:
    """The tokens of a shaped column (nested fixed_size_list) as one flat array of their values, from the
    tokens' first, and the values per token; (None, 0) if a level holds nulls (the exact check names them)."""
    width = 1
    while pa.types.is_fixed_size_list(tokens.type):
        if tokens.null_count:
            return None, 0
        k = tokens.type.list_size
        tokens, width = tokens.values.slice(tokens.offset * k, len(tokens) * k), width * k
    return tokens, width


def offsets_view(arr: pa.Array) -> np.ndarray:
    """The [n+1] int32 offsets of a list or string array's rows, a view of its offsets buffer (no offsets
    array or scalars made)."""
    n = len(arr)
    if not n:
        return np.zeros(1, dtype=np.int32)
    return np.frombuffer(arr.buffers()[1], dtype=np.int32, count=n + 1, offset=4 * arr.offset)


def flatten(schema: Schema, arrays: dict[str, pa.Array], lengths: np.ndarray | None,
            validate: bool = True) -> tuple[list[Part], list[int]] | None:
    """Each column of a put (arrays already of the declared types) as flat buffers (`chunks.Part`: zero-copy
    views of the caller's offsets and values) with its bytes as `ChunkRef.sizes` counts them. With
    `validate`, None unless the put certainly passes `schema.check`: no nulls, token lengths equal to the
    length column, no negative length (None sends the put through `schema.check` to name what is wrong);
    NaN/inf, where refused, are left to the write (`Part.finite`), which checks each piece of the values
    as it copies it, in cache, instead of one more pass over them here. A few vectorised calls per
    column, no per-row work."""
    if validate and lengths is None and schema.length_column in arrays:
        arr = arrays[schema.length_column]
        if arr.null_count:
            return None
        lengths = arr.to_numpy(zero_copy_only=False)
    info = _column_info(schema)
    ends = None  # the bytes of the [B] int32 offsets a token column starting at 0 must end its rows at
    parts, sizes = [], []
    # one pass, few Python steps per column: this runs for every column of every put (most of a small put's cost)
    for name, arr in arrays.items():
        token, has_offsets, finite, is_bool, shaped = info[name]
        if validate and arr.null_count:
            return None
        finite = validate and finite
        if has_offsets:
            offsets = offsets_view(arr)  # [B+1], of this slice's rows
            first, last = int(offsets[0]), int(offsets[-1])
            if token:
                if validate:
                    if lengths is None:
                        return None
                    if first == 0:  # the common case: one memcmp of the offsets, no diff array
                        if ends is None:
                            ends = lengths.cumsum(dtype=np.int32).tobytes()  # wraps only where int32 offsets cannot match
                        if offsets[1:].tobytes() != ends:
                            return None
                    elif not np.array_equal(np.diff(offsets), lengths):
                        return None
                child = arr.values
                if validate and child.null_count:
                    return None
                if shaped:  # [N, K]: K = prod(shape) values per token
                    child, width = flat_values(child)
                    if child is None or validate and child.null_count:
                        return None
                    values = child.to_numpy(zero_copy_only=not is_bool).reshape(-1, width)[first:last]
                else:
                    values = child.to_numpy(zero_copy_only=not is_bool)[first:last]
            else:  # string: offsets index its data buffer
                values = np.frombuffer(arr.buffers()[2], dtype=np.uint8, count=last)[first:] if last else \
                    np.zeros(0, dtype=np.uint8)
            parts.append(Part(offsets, values, finite))
            sizes.append(((values.size + 7) >> 3 if is_bool else values.nbytes) + 4 * (offsets.size - 1))
        else:
            values = arr.to_numpy(zero_copy_only=not is_bool)
            parts.append(Part(None, values, finite))
            sizes.append((values.size + 7) >> 3 if is_bool else values.nbytes)
    if validate and lengths is not None and len(lengths) and int(lengths.min()) < 0:
        return None
    return parts, sizes


def make_blocks(rows: np.ndarray, names: tuple[str, ...], parts: Sequence[Part], sizes: Sequence[int],
                limit: int) -> list[Block]:
    """Cut a put into row blocks of about `limit` bytes each (at least one block; split by bytes, not
    rows, so long rows do not make one block huge)."""
    n = rows.size
    offs = tuple(p.offsets is not None for p in parts)
    if not n or sum(sizes) <= limit:
        return [Block(rows, names, tuple(parts), tuple(sizes), *block_layout(offs, n, tuple(sizes)))]
    # cum[r]: the bytes of rows 0..r-1, from each column's offsets (no per-row array per column)
    r = np.arange(n + 1, dtype=np.float64)  # [n+1]
    fixed = sum(p.values.itemsize for p in parts if p.offsets is None)
    cum = r * (fixed + 4 * sum(offs))  # [n+1]
    for p in parts:
        if p.offsets is not None:
            cum += (p.offsets - p.offsets[0]) * (p.values.itemsize * token_width(p.values))
    total = float(cum[-1])
    k = max(1, min(n, int(-(-total // limit))))
    cuts = np.searchsorted(cum[1:], total * np.arange(1, k) / k, side="right").tolist() if k > 1 else []
    bounds = sorted({0, n, *cuts})
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        sub = []
        for p in parts:
            if p.offsets is None:
                sub.append(p._replace(values=p.values[lo:hi]))
            else:
                first = int(p.offsets[0])
                sub.append(p._replace(offsets=p.offsets[lo:hi + 1],
                                      values=p.values[int(p.offsets[lo]) - first:int(p.offsets[hi]) - first]))
        size = tuple(part_bytes(p) for p in sub)
        out.append(Block(rows[lo:hi], names, tuple(sub), size, *block_layout(offs, hi - lo, size)))
    return out
