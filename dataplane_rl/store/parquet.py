"""Columns out as Parquet: token columns as list columns, shaped ones as lists of fixed-size lists, the schema in the file's metadata."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa

from dataplane_rl.errors import SchemaError
from dataplane_rl.schema import Schema

# Keys of the file's metadata: the partition's whole schema (its JSON, as `Schema.model_validate_json` reads it)
# and where the rows came from. pyarrow keeps the Arrow schema too (ARROW:schema), so shaped columns read back
# as fixed-size lists.
SCHEMA_KEY = b"dataplane_rl.schema"
SOURCE_KEY = b"dataplane_rl.source"


def written_fields(store, pid: str, rows: np.ndarray | None = None) -> list[str]:
    """The partition's columns, in schema order, written on every one of `rows` (default: all its rows). From
    the catalog alone (`ready`), no data read."""
    schema = store.schema(pid)
    want = np.arange(store.num_rows(pid)) if rows is None else np.unique(np.asarray(rows))
    return [c for c in schema.names if np.isin(want, store.ready(pid, [c]), assume_unique=True).all()]


def write_parquet(table: pa.Table, schema: Schema, path: str | Path, source: dict | None = None) -> Path:
    """Write `table` (columns of `schema`) to `path` as Parquet, atomically (a reader never sees half a file),
    with the schema and `source` in the file's metadata."""
    path = Path(path)
    for name in table.column_names:
        if table.schema.field(name).type != schema.column(name).arrow_type:
            raise SchemaError(f"{path}: column '{name}' is {table.schema.field(name).type}, not the declared "
                              f"{schema.column(name).arrow_type}")
    meta = {**(table.schema.metadata or {}), SCHEMA_KEY: schema.json_text.encode(),
            SOURCE_KEY: json.dumps(source or {}).encode()}
    import pyarrow.parquet as pq  # imported here: a run that never exports does not load it

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table.replace_schema_metadata(meta), tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def export_partition(store, pid: str, path: str | Path, fields: Sequence[str] | None = None) -> tuple[int, list[str]]:
    """Partition `pid` (every row; `fields`, default every column written on all of them) to a Parquet file;
    returns (rows, fields). An unwritten cell of a named field is a MissingColumnError, as in `get`."""
    fields = list(fields) if fields else written_fields(store, pid)
    if not fields:
        raise SchemaError(f"partition {pid} has no column written on all of its {store.num_rows(pid)} rows; "
                          "name the columns to export with --fields")
    table = store.get(pid, fields)
    write_parquet(table, store.schema(pid), path, {"store": store.url, "partition": pid})
    return table.num_rows, fields


def read_parquet_schema(path: str | Path) -> Schema:
    """The schema an exported file records in its metadata."""
    import pyarrow.parquet as pq

    meta = pq.read_schema(path).metadata or {}
    if SCHEMA_KEY not in meta:
        raise SchemaError(f"{path}: no dataplane-rl schema in its metadata; it was not written by "
                          "`dataplane-rl store export` or logger.save_rollouts")
    return Schema.model_validate_json(meta[SCHEMA_KEY])
