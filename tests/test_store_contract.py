"""The column-store contract (docs/architecture.md §5), run against every backend: memory, shm, ray, mooncake.

The semantics live once in ColumnStore; these tests pin them down on each backend's storage. Readiness
(ready/wait) and concurrency across threads and processes are in test_store_concurrency.py.
"""

from __future__ import annotations

import json
import os
import re
import uuid

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataplane_rl.errors import (
    AlignmentError,
    CorruptChunkError,
    DuplicateWriteError,
    MissingColumnError,
    PartitionExistsError,
    PartitionNotFoundError,
    SchemaError,
    StoreUnavailableError,
    format_rows,
)
from conftest import CAPABILITIES
from dataplane_rl.schema import GRPO_SCHEMA
from dataplane_rl.store import MemoryStore, open_store
from store_workers import (
    ROLLOUT_FIELDS,
    all_dtypes_columns,
    all_dtypes_schema,
    as_lists,
    grpo_columns,
    row_len,
)

N = 12
CROSS_PROCESS = [b for b, c in CAPABILITIES.items() if c["cross_process"]]  # the others are private to a process


@pytest.fixture
def part(store) -> str:
    """A fresh GRPO partition of N rows."""
    pid = f"step-{uuid.uuid4().hex[:8]}"
    store.create_partition(pid, "grpo", N)
    return pid


def assert_rows(store, pid, rows, fields, seed=0):
    table = store.get(pid, fields, rows)
    assert table.column_names == list(fields)
    want = grpo_columns(rows, fields, seed)
    for f in fields:
        assert table.column(f).to_pylist() == as_lists(want[f]), f


def refs_of(store, pid: str, column: str) -> list:
    """The committed blocks holding `column`, as the catalog lists them."""
    return [r for r in store.storage.snapshot(pid).refs if column in r.columns]


def column_byte(store, pid: str, ref, column: str) -> int:
    """Where, in its stored block, `column`'s first value byte lies (its offsets' first byte if it has no
    values): a byte that a read of the block's first row of `column` must checksum."""
    from dataplane_rl.store.arrow import block_columns
    from dataplane_rl.store.chunks import block_layout

    cols = block_columns(store.storage.snapshot(pid).meta.schema_json, ref.columns)
    o_at, v_at, vbytes, _ = block_layout(cols.offsets, ref.rows.size, ref.sizes)[0][ref.columns.index(column)]
    return v_at if vbytes else o_at


def corrupt(store, pid: str, column: str, lose: bool = False) -> None:
    """Damage the stored bytes of `column`'s first block (a byte of `column`'s own, in its first row)
    through the backend's own storage (the file, the Mooncake key, the Ray object, the buffer): no hook in
    the store's code."""
    ref = refs_of(store, pid, column)[0]
    obj, off = ref.key.rpartition("@")[0], int(ref.key.rpartition("@")[2]) if "@" in ref.key else 0
    at = column_byte(store, pid, ref, column)
    if isinstance(store, MemoryStore):
        data = bytearray(store.storage._blobs[ref.key].to_pybytes())
        data[at] ^= 0xFF
        store.storage._blobs[ref.key] = pa.py_buffer(b"" if lose else bytes(data))
    elif store.scheme == "shm":
        path = store.path / pid / "chunks" / obj
        if lose:
            os.truncate(path, off)  # the block and the ones after it in the put's file are gone
        else:
            with open(path, "r+b") as f:
                f.seek(off + at)
                b = f.read(1)
                f.seek(off + at)
                f.write(bytes([b[0] ^ 0xFF]))
    elif store.scheme == "mooncake":
        from mooncake_fixtures import damage_key

        damage_key(store.storage._client, obj, off, off + at, lose)
    elif store.scheme == "ray":
        def damage(catalog, pid=pid, key=ref.key, lose=lose, at=at):  # runs inside the catalog actor
            import ray

            if lose:
                catalog.objs[pid].pop(key)
                return
            data = bytearray(ray.get(catalog.objs[pid][key]).tobytes())
            data[at] ^= 0xFF
            catalog.objs[pid][key] = ray.put(np.frombuffer(bytes(data), dtype=np.uint8))

        import ray

        ray.get(store.storage._catalog.__ray_call__.remote(damage))
    else:  # a backend the damage tests cannot reach is a gap in the suite, not a reason to pass
        pytest.fail(f"{type(store).__name__}: the damage tests do not know its storage; teach corrupt()", pytrace=False)


# ---- round trips ---------------------------------------------------------------------------------
def test_round_trip_every_dtype_and_kind(store):
    schema = all_dtypes_schema()
    store.create_partition("p", schema, 7)
    cols = all_dtypes_columns(range(7))
    store.put("p", cols, range(7))
    table = store.get("p", list(cols))
    for name, data in cols.items():
        assert table.column(name).type == schema.by_name[name].arrow_type
        assert table.column(name).to_pylist() == as_lists(data), name
    assert store.schema("p").name == "all_dtypes"


def test_round_trip_grpo_in_writer_stages(store, part):
    store.put(part, grpo_columns(range(N), ROLLOUT_FIELDS), range(N))
    driver = [c.name for c in GRPO_SCHEMA.columns if c.writer == "driver"]
    store.put(part, grpo_columns(range(N), driver), range(N))
    for writer in ("policy", "reference", "teacher"):  # teacher: shaped [L, k] columns
        fields = [c.name for c in GRPO_SCHEMA.columns if c.writer == writer]
        store.put(part, grpo_columns(range(N), fields), np.arange(N))
    assert_rows(store, part, range(N), GRPO_SCHEMA.names)
    assert store.status(part).complete(GRPO_SCHEMA.names)


@pytest.mark.parametrize("form", ["range", "list", "numpy", "reversed", "shuffled", "slice"])
def test_rows_forms(store, part, form):
    order = {"range": range(N), "list": list(range(N)), "numpy": np.arange(N, dtype=np.int32),
             "reversed": range(N - 1, -1, -1), "shuffled": np.random.default_rng(1).permutation(N),
             "slice": slice(None)}[form]
    rows = np.arange(N)[order] if form == "slice" else np.asarray(list(order))
    store.put(part, grpo_columns(rows, ["input_lengths", "input_ids", "prompt_text"]), order)
    assert_rows(store, part, range(N), ["input_ids", "prompt_text", "input_lengths"])
    assert_rows(store, part, rows, ["input_ids"])  # read back in the order written


def test_get_subsets_reordered_and_repeated_rows(store, part):
    fields = ["input_lengths", "token_mask", "total_reward"]
    for rows in ([5, 1, 9], [0, 2, 4, 6], [3, 7, 8, 10, 11]):  # three puts, interleaved rows
        store.put(part, grpo_columns(rows, fields), rows)
    assert_rows(store, part, [11, 0, 5, 5, 2, 9], fields)
    assert_rows(store, part, range(2, 9), ["token_mask"])
    assert_rows(store, part, [], fields)
    assert store.get(part, "total_reward").num_rows == N  # default: every row


def test_get_returns_zero_copy_arrow(store, part):
    store.put(part, grpo_columns(range(N), ["input_lengths", "prev_logprobs"]), range(N))
    table = store.get(part, ["prev_logprobs", "input_lengths"])
    assert table.schema == GRPO_SCHEMA.arrow_schema(["prev_logprobs", "input_lengths"])
    from dataplane_rl.store import pad_tokens, to_numpy

    padded, mask = pad_tokens(table.column("prev_logprobs"), torch=False)
    assert padded.shape == (N, int(to_numpy(table.column("input_lengths")).max()))
    assert mask.sum() == to_numpy(table.column("input_lengths")).sum()


def test_large_put_is_stored_in_row_blocks(store, part, monkeypatch):
    monkeypatch.setattr(store, "chunk_bytes", 64)  # a few rows per chunk; the session store gets its own back
    fields = ["input_lengths", "input_ids", "prompt_text", "total_reward"]
    store.put(part, grpo_columns(range(N), fields), range(N))
    blocks = refs_of(store, part, "input_ids")
    assert len(blocks) > 2 and sorted(np.concatenate([b.rows for b in blocks]).tolist()) == list(range(N))
    assert_rows(store, part, range(N), fields)
    assert_rows(store, part, [11, 3, 4, 0], fields)
    corrupt(store, part, "input_ids")  # the first block only: other blocks stay readable
    first = refs_of(store, part, "input_ids")[0].rows
    with pytest.raises(CorruptChunkError):
        store.get(part, ["input_ids"], first[:1])
    rest = sorted(set(range(N)) - set(first.tolist()))
    assert_rows(store, part, rest, ["input_ids"])



def test_contiguous_rows_across_many_puts(store, caps):
    """A shard of rows written by many puts of ranges (a round's groups), fields of puts cut differently: each
    field is its blocks' rows in order, blocks cut at the shard's ends; a damaged block is named, the others
    still read. Also through a second client, which learns every put at once."""
    pid, n = f"tiles-{uuid.uuid4().hex[:8]}", 40
    store.create_partition(pid, "grpo", n)
    first, later = ["input_lengths", "input_ids", "token_mask"], ["total_reward", "prev_logprobs"]
    for a in range(0, 12, 4):  # blocks of all five
        store.put(pid, grpo_columns(range(a, a + 4), first + later), range(a, a + 4))
    for a in range(12, n, 4):
        store.put(pid, grpo_columns(range(a, a + 4), first), range(a, a + 4))
    for a in range(12, n, 6):
        store.put(pid, grpo_columns(range(a, min(a + 6, n)), later), range(a, min(a + 6, n)))
    readers = [store] + ([open_store(store.url)] if caps["cross_process"] else [])
    try:
        for reader in readers:
            for rows in (range(3, 29), range(0, n), range(5, 7), range(12, 18)):
                assert_rows(reader, pid, rows, ["prev_logprobs", "input_ids", "total_reward", "input_lengths"])
        corrupt(store, pid, "input_ids")  # rows 0-3's block
        for reader in readers:
            with pytest.raises(CorruptChunkError, match=rf"partition {pid} column\(s\) .*'input_ids'.* rows 0-3: "
                                                        r"stored block .* corrupt"):
                reader.get(pid, ["total_reward", "input_ids"], range(2, 9))
            assert_rows(reader, pid, range(4, 33), ["input_ids", "total_reward"])
    finally:
        for reader in readers[1:]:
            reader.close()
        store.drop_partition(pid)


def test_row_index_of_many_refs_matches_one_by_one():
    """RowIndex learns hundreds of refs at once (a reader's first sight of a partition) with a few numpy calls;
    its twin learns them one at a time: the same blocks, first rows and per-row arrays."""
    from dataplane_rl.store.chunks import ChunkRef
    from dataplane_rl.store.index import RowIndex

    rng = np.random.default_rng(0)
    order = rng.permutation(300)
    refs, at = [], 0
    for k in range(40):  # runs, scattered rows, one row, no row; two sets of columns
        size = [0, 1, 7, 9][k % 4]
        rows = np.sort(order[at:at + size]) if k % 3 else np.arange(at, at + size) + 300
        cols = ("input_lengths", "total_reward") if k % 5 else ("advantages", "total_reward")
        refs.append(ChunkRef(cols, rows.astype(np.int64), f"k{k}", 0, ()))
        at += size
    many, one = RowIndex(600), RowIndex(600)
    many.add(refs)
    for r in refs:
        one.add([r])
        one._build()
    assert many.first == one.first
    assert many.first[:2] == [-1, int(order[0])] and many.first[3] == 308  # no row; one row; a run of 9 (rows 308-316)
    for c in ("input_lengths", "total_reward", "advantages"):
        assert (many.owner[c] == one.owner[c]).all() and (many.pos[c] == one.pos[c]).all(), c


def test_row_index_any_written_agrees_with_each_column_alone():
    """`any_written` (one lookup per group of columns that share their arrays, what a commit's conflict check
    asks) says yes exactly when some column alone has a written row, for runs and scattered rows, columns
    written together or apart, and columns never written."""
    from dataplane_rl.store.chunks import ChunkRef
    from dataplane_rl.store.index import RowIndex

    rng = np.random.default_rng(1)
    idx = RowIndex(200)
    idx.add([ChunkRef(("input_lengths", "total_reward", "advantages"), np.arange(0, 40), "a", 0, ()),
             ChunkRef(("total_reward",), np.arange(100, 110), "b", 0, ()),  # a column apart from its group
             ChunkRef(("input_lengths", "advantages"), np.sort(rng.choice(np.arange(120, 200), 9, replace=False)),
                      "c", 0, ())])
    columns = ["input_lengths", "total_reward", "advantages", "input_ids"]  # input_ids: never written
    asked = 0
    for _ in range(300):
        cols = [c for c in columns if rng.random() < 0.5] or ["input_ids"]
        lo = int(rng.integers(0, 190))
        rows = slice(lo, lo + int(rng.integers(1, 10))) if rng.random() < 0.5 else \
            np.sort(rng.choice(200, int(rng.integers(1, 6)), replace=False))
        want = any(idx.written(c, rows).size for c in cols)
        assert idx.any_written(cols, rows) == want, (cols, rows)
        asked += want
    assert 30 < asked < 270  # both answers were asked many times


# ---- errors --------------------------------------------------------------------------------------
def test_a_reader_keeps_a_bounded_cache_of_partitions(store, monkeypatch):
    """A process that reads partitions it never drops (a train worker: the driver drops them) caches the
    catalog state of only the last KNOWN_PARTITIONS; a forgotten one is read again from the store."""
    from dataplane_rl.store import base

    monkeypatch.setattr(base, "KNOWN_PARTITIONS", 4)
    pids = [f"known-{uuid.uuid4().hex[:6]}-{i}" for i in range(10)]
    for i, pid in enumerate(pids):
        store.create_partition(pid, "grpo", N)
        store.put(pid, grpo_columns(range(N), ["input_lengths", "total_reward"], seed=i), range(N))
        assert_rows(store, pid, range(N), ["total_reward"], seed=i)
    assert len(store._known) <= 4 and len(store._indexes) <= 4
    forgotten = {"shm": lambda: set(store.storage._logs),
                 "mooncake": lambda: set(store.storage._catalog.parts)}.get(store.scheme)
    if forgotten is not None:  # the backend's own caches follow
        assert not forgotten() & set(pids[:6]), forgotten()
    assert_rows(store, pids[0], range(N), ["total_reward"], seed=0)  # forgotten, still readable
    store.put(pids[0], grpo_columns(range(N), ["advantages"], seed=0), range(N))
    with pytest.raises(DuplicateWriteError):
        store.put(pids[1], grpo_columns(range(N), ["total_reward"], seed=1), range(N))  # write-once still holds
    for pid in pids:
        store.drop_partition(pid)


def test_unknown_column(store, part):
    with pytest.raises(SchemaError, match=rf"partition {part} put rows 0-1.*'total_rewards'.*did you mean 'total_reward'"):
        store.put(part, {"total_rewards": np.zeros(2, np.float32)}, [0, 1])
    with pytest.raises(SchemaError, match="no column 'nope'"):
        store.get(part, ["nope"])


def test_wrong_dtype(store, part):
    with pytest.raises(SchemaError, match=rf"partition {part}.*'total_reward' has dtype float64, declared float32"):
        store.put(part, {"total_reward": np.zeros(3)}, range(3))
    with pytest.raises(SchemaError, match="Arrow type int64, declared int32"):
        store.put(part, {"input_lengths": pa.array([1, 2, 3])}, range(3))
    with pytest.raises(SchemaError, match="pass one 1-D array per row"):
        store.put(part, {"input_lengths": np.ones(2, np.int32), "input_ids": np.ones((2, 1), np.int32)}, [0, 1])


def test_token_length_must_match_input_lengths(store, part):
    cols = grpo_columns([0, 1, 2], ["input_lengths", "input_ids"])
    cols["input_ids"][1] = cols["input_ids"][1][:-1]
    with pytest.raises(SchemaError, match=r"'input_ids' rows 1: token lengths differ from input_lengths"):
        store.put(part, cols, [0, 1, 2])
    store.put(part, grpo_columns([0, 1, 2], ["input_lengths"]), [0, 1, 2])
    short = grpo_columns([0, 1, 2], ["prev_logprobs"])
    short["prev_logprobs"][2] = np.zeros(99, np.float32)
    with pytest.raises(SchemaError, match=r"'prev_logprobs' rows 2: token lengths differ"):
        store.put(part, short, [0, 1, 2])  # checked against the stored input_lengths


def test_token_lengths_checked_after_a_get_of_input_lengths(store, part):
    """A process remembers the input_lengths it read; a later put of token columns checks against them
    (also for rows it did not read, read then), and a partition dropped and made again under the same id
    is checked against its own lengths, not the old incarnation's."""
    store.put(part, grpo_columns(range(N), ["input_lengths"]), range(N))
    store.get(part, ["input_lengths"], [1, 3, 5])  # remembered here
    bad = grpo_columns([3, 5], ["prev_logprobs"])
    bad["prev_logprobs"][1] = np.zeros(99, np.float32)
    with pytest.raises(SchemaError, match=r"'prev_logprobs' rows 5: token lengths differ"):
        store.put(part, bad, [3, 5])
    mixed = grpo_columns([5, 6], ["prev_logprobs"])  # row 6 was not read here
    mixed["prev_logprobs"][1] = np.zeros(99, np.float32)
    with pytest.raises(SchemaError, match=r"'prev_logprobs' rows 6: token lengths differ"):
        store.put(part, mixed, [5, 6])
    store.put(part, grpo_columns([1, 3, 5, 6], ["prev_logprobs"]), [1, 3, 5, 6])
    assert_rows(store, part, [1, 3, 5, 6], ["prev_logprobs", "input_lengths"])
    store.drop_partition(part)
    store.create_partition(part, "grpo", N)  # the same id, one token longer on every row
    store.put(part, {"input_lengths": np.array([row_len(r) + 1 for r in range(N)], np.int32)}, range(N))
    with pytest.raises(SchemaError, match=r"'prev_logprobs' rows 1: token lengths differ"):
        store.put(part, grpo_columns([1], ["prev_logprobs"]), [1])  # right for the dropped incarnation only
    store.put(part, {"prev_logprobs": [np.zeros(row_len(1) + 1, np.float32)]}, [1])


def test_token_column_before_input_lengths(store, part):
    with pytest.raises(MissingColumnError, match=rf"partition {part} column 'input_lengths' rows 0-2 not written "
                                                 r"\(writer: rollout\).*write input_lengths first"):
        store.put(part, grpo_columns(range(3), ["prev_logprobs"]), range(3))


def test_different_row_counts_in_one_put(store, part):
    cols = grpo_columns(range(4), ["total_reward", "group_id"])
    cols["group_id"] = cols["group_id"][:3]
    with pytest.raises(AlignmentError, match=r"'group_id' has 3 values for 4 rows"):
        store.put(part, cols, range(4))


@pytest.mark.parametrize("second", [[3, 4, 5], [5, 6, 7], [0, 9, 4]], ids=["same", "partial", "scattered"])
def test_second_write_of_a_cell(store, part, second):
    store.put(part, grpo_columns(range(6), ["total_reward"]), range(6))
    text = re.escape(format_rows(r for r in second if r < 6))
    with pytest.raises(DuplicateWriteError, match=rf"partition {part} column 'total_reward' rows {text} "
                                                  r"already written \(writer: rollout\)"):
        store.put(part, grpo_columns(second, ["total_reward"], seed=1), second)
    assert_rows(store, part, range(6), ["total_reward"])  # the old values stay


def test_out_of_range_and_repeated_rows(store, part):
    with pytest.raises(AlignmentError, match=rf"partition {part}: rows 12 out of range"):
        store.put(part, grpo_columns([11, 12], ["total_reward"]), [11, 12])
    with pytest.raises(AlignmentError, match="out of range"):
        store.put(part, grpo_columns([0], ["total_reward"]), [-1])
    with pytest.raises(AlignmentError, match="out of range"):
        store.get(part, ["total_reward"], range(N + 1))
    with pytest.raises(AlignmentError, match=r"rows 2 given more than once"):
        store.put(part, grpo_columns([2, 3, 2], ["total_reward"]), [2, 3, 2])
    with pytest.raises(AlignmentError, match="integer indices"):
        store.get(part, ["total_reward"], [0.5])


def test_reading_unwritten_cells(store, part):
    store.put(part, grpo_columns(range(4), ["input_lengths", "input_ids"]), range(4))
    with pytest.raises(MissingColumnError, match=rf"partition {part} column 'prev_logprobs' rows 0-3 not "
                                                 r"written \(writer: policy\)"):
        store.get(part, ["input_ids", "prev_logprobs"], range(4))
    with pytest.raises(MissingColumnError, match=r"column 'input_ids' rows 4-5,9 \(3 rows\) not written"):
        store.get(part, ["input_ids"], [0, 4, 5, 9])
    assert_rows(store, part, [3, 0], ["input_ids"])


def test_unknown_and_dropped_partition(store, part):
    for op in (lambda p: store.get(p, ["total_reward"]), lambda p: store.status(p),
               lambda p: store.put(p, grpo_columns([0], ["total_reward"]), [0]), store.drop_partition):
        with pytest.raises(PartitionNotFoundError, match=r"partition nope .*(unknown|dropped)"):
            op("nope")
    store.drop_partition(part)
    with pytest.raises(PartitionNotFoundError, match=rf"partition {part} is unknown or dropped"):
        store.get(part, ["total_reward"])
    with pytest.raises(PartitionNotFoundError):
        store.drop_partition(part)


def test_partition_exists_and_bad_ids(store, part):
    with pytest.raises(PartitionExistsError, match=rf"partition {part} already exists"):
        store.create_partition(part, "grpo", 3)
    for bad in ("", "../etc", ".hidden", "a/b", "x" * 200):
        with pytest.raises(SchemaError, match="partition id"):
            store.create_partition(bad, "grpo", 3)
    with pytest.raises(SchemaError, match="num_rows"):
        store.create_partition("ok", "grpo", -1)
    assert store.num_rows(part) == N


# One of each character class a name rule must refuse: a trailing newline (what a `$` anchor lets through),
# the other C0 controls, DEL, C1 controls, Unicode line separators, a space and a non-ASCII letter.
BAD_CHARS = {"trailing LF": "\n", "CR": "\r", "tab": "\t", "NUL": "\x00", "ESC": "\x1b", "DEL": "\x7f",
             "C1 NEL": "\x85", "LINE SEPARATOR": "\u2028", "space": " ", "non-ASCII": "\u00e9"}


def test_names_with_control_characters_refused(store, tmp_path):
    """Partition ids, schema and column names are full-matched: every class is refused by create (naming the
    id), by every op on an id (never found), and by a schema naming it; nothing is made."""
    before = store.list_partitions()
    for what, ch in BAD_CHARS.items():
        pid = f"p-{uuid.uuid4().hex[:6]}{ch}"
        with pytest.raises(SchemaError, match=re.escape(repr(pid))):
            store.create_partition(pid, "grpo", 2)
        for op in (lambda: store.status(pid), lambda: store.get(pid, ["total_reward"]),
                   lambda: store.drop_partition(pid)):
            with pytest.raises(PartitionNotFoundError, match=re.escape(repr(pid))):
                op()
        for key, bad in (("name", f"t{ch}"), ("column", f"score{ch}")):
            path = tmp_path / f"{key}-{ord(ch)}.yaml"
            column = bad if key == "column" else "score"
            schema = {"name": bad if key == "name" else "t",
                      "columns": [{"name": column, "dtype": "float32", "kind": "sample", "writer": "rollout"}]}
            path.write_text(json.dumps(schema))  # JSON is YAML, and escapes every control character
            with pytest.raises(SchemaError, match=re.escape(repr(bad))):
                store.create_partition(f"s-{uuid.uuid4().hex[:6]}", str(path), 2)
    assert store.list_partitions() == before, what


def test_closed_store(store, caps):
    s = open_store(store.url) if caps["cross_process"] else store
    s.close()
    s.close()  # idempotent
    for op in (lambda: s.list_partitions(), lambda: s.create_partition("p", "grpo", 1),
               lambda: s.get("p", ["total_reward"]), lambda: s.status("p")):
        with pytest.raises(StoreUnavailableError, match="is closed"):
            op()


# ---- all or nothing ------------------------------------------------------------------------------
def _dup(store, pid):
    store.put(pid, grpo_columns([0, 1], ["total_reward", "group_id"], seed=3), [0, 1])  # total_reward 0 is taken


def _dtype(store, pid):
    cols = grpo_columns([2, 3], ["total_reward", "group_id"])
    cols["group_id"] = cols["group_id"].astype(np.int32)
    store.put(pid, cols, [2, 3])


def _tokens(store, pid):
    cols = grpo_columns([2, 3], ["input_lengths", "input_ids"])
    cols["input_ids"][0] = cols["input_ids"][0][1:]
    store.put(pid, cols, [2, 3])


def _lengths(store, pid):
    cols = grpo_columns([2, 3], ["total_reward", "group_id"])
    cols["total_reward"] = cols["total_reward"][:1]
    store.put(pid, cols, [2, 3])


def _commit_fails(store, pid):
    def boom(*a, **k):
        raise RuntimeError("injected commit failure")

    store.storage.commit = boom
    try:
        store.put(pid, grpo_columns([2, 3], ["total_reward", "group_id", "input_ids", "input_lengths"]), [2, 3])
    finally:
        del store.storage.commit


def _second_chunk_fails(store, pid):
    from dataplane_rl.store import chunks

    real, calls = chunks.write_block, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("injected encode failure")
        return real(*a, **k)

    chunks.write_block, chunk_bytes = flaky, store.chunk_bytes
    store.chunk_bytes = 8  # one block per row: the second block fails after the first is stored
    try:
        store.put(pid, grpo_columns([2, 3], ["total_reward", "group_id", "prompt_text"]), [2, 3])
    finally:
        chunks.write_block = real
        del store.chunk_bytes
    assert len(calls) == 2, "the put did not reach its second block"


@pytest.mark.parametrize("fail,error,match", [
    (_dup, DuplicateWriteError, "'total_reward' rows 0 already written"),
    (_dtype, SchemaError, "'group_id' has dtype int32, declared int64"),
    (_tokens, SchemaError, "'input_ids' rows 2: token lengths differ"),
    (_lengths, AlignmentError, "'total_reward' has 1 values for 2 rows"),
    (_commit_fails, RuntimeError, "injected commit failure"),
    (_second_chunk_fails, RuntimeError, "injected encode failure"),
], ids=["dup", "dtype", "tokens", "lengths", "commit_fails", "second_chunk_fails"])
def test_failed_put_changes_nothing(store, backend, part, fail, error, match):
    store.put(part, grpo_columns([0], ["total_reward"]), [0])
    before = store.status(part)
    with pytest.raises(error, match=match):
        fail(store, part)
    assert store.status(part) == before
    if backend == "shm":  # no stray chunk file either
        assert len(os.listdir(store.path / part / "chunks")) == 1
    store.put(part, grpo_columns([2, 3], ["total_reward", "group_id", "input_lengths", "input_ids"]), [2, 3])
    assert_rows(store, part, [0, 2, 3], ["total_reward"])
    assert_rows(store, part, [2, 3], ["group_id", "input_ids"])


# ---- status, listing, dropping, damage -------------------------------------------------------------
def test_status_and_list(store):
    assert store.list_partitions() == []
    for pid in ("b", "a"):
        store.create_partition(pid, "grpo", 8)
    store.put("a", grpo_columns(range(5), ["input_lengths", "input_ids"]), range(5))
    st_a = store.status("a")
    assert (st_a.pid, st_a.schema, st_a.num_rows) == ("a", "grpo", 8)
    assert st_a.rows_written["input_ids"] == 5 and st_a.rows_written["total_reward"] == 0
    assert st_a.nbytes["input_ids"] > 4 * sum(len(x) for x in grpo_columns(range(5), ["input_ids"])["input_ids"])
    assert not st_a.complete(["input_ids"])
    assert store.list_partitions() == ["a", "b"]


def test_drop_frees_and_id_can_be_reused(store, backend):
    store.create_partition("p", "grpo", 4)
    store.put("p", grpo_columns(range(4), ["input_lengths", "input_ids"]), range(4))
    store.drop_partition("p")
    assert store.list_partitions() == []
    if backend == "shm":
        assert not (store.path / "p").exists()  # the folder is gone
    store.create_partition("p", "grpo", 2)
    assert store.status("p").rows_written["input_ids"] == 0
    with pytest.raises(MissingColumnError):
        store.get("p", ["input_ids"])


def test_arrays_stay_valid_after_drop_and_reuse(store):
    """Zero-copy data a reader holds must not change when its partition is dropped and memory reused."""
    fields = ["input_lengths", "prev_logprobs", "total_reward"]
    store.create_partition("old", "grpo", N)
    store.put("old", grpo_columns(range(N), fields, seed=1), range(N))
    held = store.get("old", fields)
    store.drop_partition("old")
    store.create_partition("new", "grpo", N)
    store.put("new", grpo_columns(range(N), fields, seed=2), range(N))  # same shapes: shm reuses files
    want = grpo_columns(range(N), fields, seed=1)
    for f in fields:
        assert held.column(f).to_pylist() == as_lists(want[f])
    assert_rows(store, "new", range(N), fields, seed=2)


@pytest.mark.parametrize("lose", [False, True], ids=["corrupt", "lost"])
def test_damaged_chunk_is_an_error(store, part, lose):
    store.put(part, grpo_columns(range(N), ["input_lengths"]), range(N))
    store.put(part, grpo_columns(range(N), ["input_ids", "token_mask"]), range(N))  # a block of its own
    corrupt(store, part, "input_ids", lose=lose)
    rows = re.escape(format_rows(refs_of(store, part, "input_ids")[0].rows))
    what = "missing" if lose else "corrupt"
    with pytest.raises(CorruptChunkError, match=rf"partition {part} column\(s\) 'input_ids', 'token_mask' rows {rows}: "
                                                rf"stored block .* {what}"):
        store.get(part, ["input_lengths", "input_ids"])
    assert_rows(store, part, range(N), ["input_lengths"])


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_url_reopens_the_same_store(store, part):
    store.put(part, grpo_columns(range(3), ["total_reward"]), range(3))
    other = open_store(store.url)
    try:
        assert part in other.list_partitions()
        assert_rows(other, part, range(3), ["total_reward"])
        other.put(part, grpo_columns([3], ["total_reward"]), [3])
    finally:
        other.close()
    assert store.status(part).rows_written["total_reward"] == 4


# ---- property-based ------------------------------------------------------------------------------
@st.composite
def plans(draw):
    n = draw(st.integers(1, 30))
    fields = draw(st.lists(st.sampled_from(GRPO_SCHEMA.names), min_size=1, unique=True))
    if any(GRPO_SCHEMA.by_name[f].kind == "token" for f in fields) and "input_lengths" not in fields:
        fields.append("input_lengths")
    order = draw(st.permutations(range(n)))
    cuts = sorted(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=4, unique=True)))
    puts = [order[a:b] for a, b in zip([0, *cuts], [*cuts, n]) if order[a:b]]
    reads = draw(st.lists(st.integers(0, n - 1), max_size=2 * n))
    return n, fields, puts, reads, draw(st.integers(0, 1000))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=plans())
def test_property_round_trip(store, plan):
    n, fields, puts, reads, seed = plan
    pid = f"prop-{uuid.uuid4().hex[:8]}"
    store.create_partition(pid, "grpo", n)
    try:
        for rows in puts:
            store.put(pid, grpo_columns(rows, fields, seed), rows)
        assert all(store.status(pid).rows_written[f] == n for f in fields)
        assert_rows(store, pid, reads, fields, seed)
        assert_rows(store, pid, range(n), fields[::-1], seed)
    finally:
        store.drop_partition(pid)


# ---- the store by composition ----------------------------------------------------------------------
BACKEND_CLASSES = {  # scheme -> (module, class): every backend a user can open
    "memory": ("dataplane_rl.store.memory", "MemoryStore"),
    "shm": ("dataplane_rl.store.shm.store", "ShmStore"),
    "mooncake": ("dataplane_rl.store.mooncake.store", "MooncakeStore"),
    "ray": ("dataplane_rl.store.ray_store", "RayStore"),
}


def overridden_private_names(cls: type) -> list[str]:
    """The `_name`s (not dunders) that `cls` or a class it mixes in beyond ColumnStore's own bases defines and
    ColumnStore (with its bases) has too: a private method of the store that the backend replaces."""
    from dataplane_rl.store.base import ColumnStore

    own = [k for k in cls.__mro__ if k not in ColumnStore.__mro__]
    return sorted(f"{k.__name__}.{name}" for k in own for name in vars(k)
                  if name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
                  and hasattr(ColumnStore, name))


@pytest.mark.parametrize("scheme", sorted(BACKEND_CLASSES))
def test_backends_override_no_private_name_of_the_store(scheme):
    """A backend supplies a Storage (store/storage.py) and may add public methods; it replaces nothing private of
    ColumnStore, so the store's semantics are the same code on every backend."""
    import importlib

    from dataplane_rl.store import BACKENDS
    from dataplane_rl.store.base import ColumnStore

    assert BACKENDS.keys() == BACKEND_CLASSES.keys(), "a backend was added: list it in BACKEND_CLASSES"
    module, name = BACKEND_CLASSES[scheme]
    cls = getattr(pytest.importorskip(module), name)
    assert issubclass(cls, ColumnStore)
    assert not overridden_private_names(cls), overridden_private_names(cls)


def test_private_override_check_finds_what_it_should():
    """The checker itself: a backend that replaces a private method of ColumnStore, directly or through a mixin,
    is named; a private name of its own is not."""
    from dataplane_rl.store.base import ColumnStore

    class Mixin:
        def _put(self, *a):  # replaces ColumnStore._put
            return 0

    class Backend(Mixin, ColumnStore):
        def _snap(self, pid):  # replaces ColumnStore._snap
            return None

        def _own_helper(self):  # a name ColumnStore does not have
            return None

    assert overridden_private_names(Backend) == ["Backend._snap", "Mixin._put"]


def test_every_backend_works_over_a_storage(store):
    """The object holding the bytes and the catalog is the store's `storage`, an instance of the protocol."""
    from dataplane_rl.store.storage import Storage

    assert isinstance(store.storage, Storage) and store.storage.url == store.url
