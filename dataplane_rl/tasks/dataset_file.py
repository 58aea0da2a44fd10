"""A dataset file as Arrow columns: read once into an uncompressed Arrow IPC copy in the cache, then memory-mapped.

verl's datasets are large (DAPO-Math-17k in its layout is 1.79M rows) and every process of a run needs some of their
rows. Held as Python objects per process, a 100,000-row file cost 228 MB and 12 s of start-up; memory-mapped Arrow
costs the pages a process touches. The copy is made once per version of the files' contents (an xxh3 hash of their
bytes: a file rewritten with the same size and mtime is a new version), written through a temporary file and renamed,
so processes that race make it harmlessly, and a new version replaces the path's old copy. pyarrow streams Parquet
into it a batch at a time, so making it holds one batch, not the file.

Every value reaches the reward function as it was written: a column Arrow cannot type as one without changing a
value (a JSONL ground truth 1 in one row and 2.5 in another would become 1.0; rows' extra_info dicts of other keys
would each get the others' keys as nulls; files of a folder that type a column differently) is kept as JSON text
and decoded on reading. A dictionary-encoded column (a pandas categorical) is stored as its values.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import pyarrow as pa

from dataplane_rl.errors import ConfigError

SUFFIXES = (".parquet", ".jsonl", ".json")
FORMAT = 2  # the cache copy's layout; a new one makes new copies
JSON_COLUMNS = b"dataplane_rl.json_columns"  # schema metadata: columns kept as JSON text (JSONL of mixed types)
BATCH_ROWS = 16_384


def source_files(path: str) -> list[Path]:
    """The files of `path`: itself, a folder's .parquet/.jsonl files in name order, or a `datasets` folder."""
    p = Path(path)
    if p.is_dir():
        if _saved_dataset(p):
            return sorted(f for f in p.rglob("*") if f.is_file())
        files = sorted(f for f in p.iterdir() if f.suffix in SUFFIXES and f.is_file())
        if not files:
            raise ConfigError(f"task path '{p}' is a folder with no .parquet or .jsonl files")
        return files
    if not p.is_file():
        raise ConfigError(f"task path '{p}' not found; give a Parquet or JSONL file, or a folder of them")
    if p.suffix not in SUFFIXES:
        raise ConfigError(f"task path '{p}': unknown file type '{p.suffix}'; use .parquet or .jsonl")
    return [p]


def _saved_dataset(p: Path) -> bool:
    return (p / "dataset_info.json").is_file() or (p / "dataset_dict.json").is_file()


def cache_dir() -> Path:
    """Private (0700) folder of dataset copies, beside the tiny models (DATAPLANE_RL_CACHE)."""
    from dataplane_rl.model.load import cache_root

    d = cache_root() / "datasets"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.lstat()
    if st.st_uid != os.getuid() or st.st_mode & 0o022 or d.is_symlink():
        raise ConfigError(f"dataset cache {d} is not a private folder of this user (mode {st.st_mode & 0o777:o}); "
                          "remove it or set DATAPLANE_RL_CACHE to a folder of your own")
    return d


def open_dataset(path: str) -> pa.Table:
    """The rows of `path` as a memory-mapped Arrow table, copied into the cache first if this version of its files
    was never copied."""
    files = source_files(path)
    stamp = [[str(f), _digest(f)] for f in files]
    where = hashlib.blake2b(str(Path(path).absolute()).encode(), digest_size=6).hexdigest()
    version = hashlib.blake2b(json.dumps([FORMAT, stamp]).encode(), digest_size=8).hexdigest()
    target = cache_dir() / f"{Path(path).stem}-{where}-{version}.arrow"
    if not target.is_file():
        _write_copy(path, files, target)
        # older versions of this path's copy go (a process that still maps one keeps its pages until it unmaps)
        for old in target.parent.glob(f"{Path(path).stem}-{where}-*.arrow"):
            if old != target:
                old.unlink(missing_ok=True)
    try:
        return pa.ipc.open_file(pa.memory_map(str(target))).read_all()
    except (pa.ArrowInvalid, OSError):  # a damaged copy (a crash, a full disk): it is derived data, made again
        target.unlink(missing_ok=True)
        _write_copy(path, files, target)
        return pa.ipc.open_file(pa.memory_map(str(target))).read_all()


def _digest(f: Path) -> str:
    """xxh3-64 of the file's bytes (GB/s: the file is read once more, from the page cache once it was read)."""
    import xxhash

    h, buf = xxhash.xxh3_64(), bytearray(1 << 20)
    with open(f, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def json_columns(table: pa.Table) -> set[str]:
    """The columns kept as JSON text (a JSONL column of mixed types)."""
    meta = table.schema.metadata or {}
    return set(json.loads(meta[JSON_COLUMNS])) if JSON_COLUMNS in meta else set()


def _write_copy(path: str, files: list[Path], target: Path) -> None:
    parts = _parts(path, files)
    # a column the files type differently (an int in one, a float in another; structs of other keys) is kept as
    # JSON text in all of them: Arrow's unified type would turn 1 into 1.0 and give each file's rows the other's
    # keys as nulls
    shapes: dict[str, set] = {}
    for schema, as_json, _ in parts:
        for f in schema:
            if not pa.types.is_null(f.type):
                shapes.setdefault(f.name, set()).add("json" if f.name in as_json else _shape(f.type))
    as_json = sorted(name for name, kinds in shapes.items() if len(kinds) > 1 or kinds == {"json"})
    try:
        schema = pa.unify_schemas([_stored_schema(s, as_json) for s, _, _ in parts], promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise ConfigError(f"task path '{path}': its files disagree on a column's type ({e}); give files of one "
                          "layout") from None
    schema = schema.with_metadata({JSON_COLUMNS: json.dumps(as_json).encode()})
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".", suffix=".tmp")  # 0600
    try:
        with os.fdopen(fd, "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for _, own_json, batches in parts:
                for batch in batches():
                    table = pa.Table.from_batches([batch])
                    for name in as_json:  # this file's own typed values, as JSON text
                        if name in table.column_names and name not in own_json:
                            text = _json_text(table.column(name), f"task path '{path}' column '{name}'")
                            table = table.set_column(table.column_names.index(name), name, text)
                    for field in schema:  # a file without a column another file has: nulls
                        if field.name not in table.column_names:
                            table = table.append_column(field.name, pa.nulls(table.num_rows, field.type))
                    writer.write_table(table.select(schema.names).cast(schema))
        os.replace(tmp, target)
    except (pa.ArrowInvalid, OSError) as e:
        os.unlink(tmp)
        raise ConfigError(f"task path '{path}' cannot be read: {type(e).__name__}: {e}") from None
    except BaseException:
        os.unlink(tmp)
        raise


def _shape(t: pa.DataType):
    """What a column's Python values look like: types that give the same values (int32 and int64, string and
    large_string, a dictionary and its values) have one shape."""
    if pa.types.is_dictionary(t):
        return _shape(t.value_type)
    for kind, test in (("int", pa.types.is_integer), ("float", pa.types.is_floating), ("str", pa.types.is_string),
                       ("str", pa.types.is_large_string), ("bytes", pa.types.is_binary),
                       ("bytes", pa.types.is_large_binary)):
        if test(t):
            return kind
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list", _shape(t.value_type)
    if pa.types.is_struct(t):
        return "struct", tuple((f.name, _shape(f.type)) for f in t)
    if pa.types.is_map(t):
        return "map", _shape(t.key_type), _shape(t.item_type)
    return str(t)


def _stored_schema(schema: pa.Schema, as_json: list[str]) -> pa.Schema:
    """A file's schema as the copy stores it: JSON columns as text, dictionary-encoded ones as their values (one
    IPC file holds one dictionary per column, and a prompt column is checked as text)."""
    def stored(f: pa.Field) -> pa.Field:
        if f.name in as_json:
            return f.with_type(pa.string())
        return f.with_type(f.type.value_type) if pa.types.is_dictionary(f.type) else f
    return pa.schema([stored(f) for f in schema])


def _json_text(col: pa.ChunkedArray, where: str) -> pa.Array:
    """A typed column's values as JSON text (maps as dicts), each as it was."""
    return pa.array([json.dumps(v, default=str) for v in python_values(col, where)], pa.string())


def python_values(values, where: str):
    """An Arrow array's, row's or value's Python values, a MAP as a dict (pyarrow's default is a list of pairs);
    a map holding a key twice, which no dict can, is a ConfigError naming `where`."""
    try:
        return (values.as_py if isinstance(values, pa.Scalar) else values.to_pylist)(maps_as_pydicts="strict")
    except KeyError as e:  # pyarrow: "... (duplicate key was 'k')."
        key = str(e.args[0]).rpartition("duplicate key was ")[2].rstrip(").")
        raise ConfigError(f"{where}: a MAP value holds the key {key} twice; a dict holds each key once: keep one "
                          "of them") from None


def _parts(path: str, files: list[Path]) -> list:
    """(schema, its JSON columns, batches()) per file: Parquet streamed a row-group batch at a time, JSONL parsed
    whole."""
    if Path(path).is_dir() and _saved_dataset(Path(path)):
        table = _saved(Path(path))
        return [(table.schema.remove_metadata(), set(), lambda: table.to_batches(BATCH_ROWS))]
    parts = []
    for f in files:
        if f.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                pf = pq.ParquetFile(f)
            except Exception as e:  # noqa: BLE001 - pyarrow's errors for a bad file are of several kinds
                raise ConfigError(f"task path '{f}' is not a readable Parquet file: {type(e).__name__}: {e}") from None
            parts.append((pf.schema_arrow.remove_metadata(), set(), lambda pf=pf: pf.iter_batches(BATCH_ROWS)))
        else:
            table = _jsonl(f)
            parts.append((table.schema.remove_metadata(), json_columns(table),
                          lambda table=table: table.to_batches(BATCH_ROWS)))
    return parts


def _jsonl(p: Path) -> pa.Table:
    """A JSONL file's rows; a column whose values Arrow cannot type as one without changing one (1 in a row, "1" or
    2.5 in another; dicts of other keys) is kept as JSON text and decoded on reading, so every value reaches the
    reward function as it was written."""
    try:
        text = p.read_bytes().decode()
    except UnicodeDecodeError as e:
        raise ConfigError(f"task path '{p}' is not UTF-8 text ({e.reason} at byte {e.start})") from None
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"task path '{p}' line {i}: not JSON ({e.msg}); one JSON object per line") from None
            if not isinstance(row, dict):
                raise ConfigError(f"task path '{p}' line {i}: a JSON {type(row).__name__}, not an object")
            rows.append(row)
    arrays, as_json = {}, []
    for name in dict.fromkeys(k for r in rows for k in r):
        values = [r.get(name) for r in rows]
        try:
            arrays[name] = pa.array(values)
            exact = _same(arrays[name].to_pylist(), values)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            exact = False
        if not exact:
            arrays[name] = pa.array([json.dumps(v) for v in values], pa.string())
            as_json.append(name)
    return pa.table(arrays, metadata={JSON_COLUMNS: json.dumps(as_json).encode()})


def _same(got: list, written: list) -> bool:
    """Whether Arrow's values are the written ones, type for type: 1 is not 1.0, a key added as null is a change."""
    return json.dumps(got, sort_keys=True) == json.dumps(written, sort_keys=True)


def _saved(p: Path) -> pa.Table:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"task path '{p}' is a Hugging Face datasets folder; reading it needs the datasets "
                          "package: pip install datasets (or save it as Parquet: ds.to_parquet('train.parquet'))") from None
    ds = datasets.load_from_disk(str(p))
    if isinstance(ds, datasets.DatasetDict):
        raise ConfigError(f"task path '{p}' holds the splits {sorted(ds)}; point task.path at one split's folder, "
                          f"e.g. {p / 'train'}")
    return ds.data.table
