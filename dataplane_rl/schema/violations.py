"""What a batch breaks of a schema: a `Violation` names the column, the rows and the fix; `bad_values` finds nulls and NaN."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dataplane_rl.errors import format_rows


@dataclass(frozen=True)
class Violation:
    """One reason a batch does not match the schema."""

    column: str
    message: str
    rows: tuple[int, ...] = ()

    def __str__(self) -> str:
        where = f" rows {format_rows(self.rows)}" if self.rows else ""
        return f"column '{self.column}'{where}: {self.message}"



def bad_values(col, arr: pa.Array | pa.ChunkedArray) -> list[Violation]:
    """Nulls inside token lists, and NaN/inf in a float column that does not allow them, with their rows.

    The common case (nothing wrong) costs one pass over the values and no per-row work."""
    chunks = arr.chunks if isinstance(arr, pa.ChunkedArray) else [arr]
    floats = col.dtype.startswith("float") and not col.allow_nonfinite
    nulls, nonfinite, base = [], [], 0
    for chunk in chunks:
        flat, width, null_at = chunk.flatten() if col.kind == "token" else chunk, 1, None  # width: values per token
        while null_at is None and pa.types.is_fixed_size_list(flat.type):  # a shaped column: down to its values
            if flat.null_count:
                null_at = np.flatnonzero(np.asarray(flat.is_null())) // width
            k = flat.type.list_size
            flat, width = flat.values.slice(flat.offset * k, len(flat) * k), width * k
        if null_at is None and col.kind == "token" and flat.null_count:
            null_at = np.flatnonzero(np.asarray(flat.is_null())) // width
        if null_at is not None:
            nulls.append(base + np.unique(np.asarray(pc.list_parent_indices(chunk))[null_at]))
        elif floats and len(flat):
            values = flat.to_numpy(zero_copy_only=False)
            ok = np.isfinite(values)
            if not ok.all():
                at = np.flatnonzero(~ok) // width
                if col.kind == "token":
                    at = np.unique(np.asarray(pc.list_parent_indices(chunk))[at])
                nonfinite.append(base + at)
        base += len(chunk)
    out = []
    if nulls:
        out.append(Violation(col.name, "has null values inside token lists; every token must hold a value",
                             tuple(np.concatenate(nulls).tolist())))
    if nonfinite:
        out.append(Violation(col.name, "has NaN or infinite values; fix the writer, or declare the column with "
                                       "allow_nonfinite: true in the schema if they are valid",
                             tuple(np.concatenate(nonfinite).tolist())))
    return out
