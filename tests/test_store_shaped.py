"""Shaped token columns (a teacher's top-k, [L, k] per row) on every backend: exact round trips in every row
form, zero-copy [L, k] numpy and torch rows, padding to [B, T, k], and refusals that store nothing.

Runs through the `store` fixture, so memory, shm, ray and Mooncake each pass it (the round trip of every
dtype with shapes [3] and [2, 3] is in test_store_contract.py)."""

from __future__ import annotations

import uuid

import numpy as np
import pyarrow as pa
import pytest
import torch

from dataplane_rl.errors import DuplicateWriteError, SchemaError
from dataplane_rl.config import bound_schema
from dataplane_rl.schema import load_schema
from dataplane_rl.store import list_array, pad_tokens, token_rows, token_values
from store_workers import grpo_columns, row_len
from test_store_contract import corrupt

GRPO = bound_schema()  # what a partition created as "grpo" holds: the teacher columns at the default k

N = 12
TEACHER = ["teacher_topk_logprobs", "teacher_topk_ids"]
K = GRPO.by_name["teacher_topk_ids"].shape[0]


@pytest.fixture
def part(store) -> str:
    """A GRPO partition of N rows with its lengths written (the teacher columns are checked against them)."""
    pid = f"step-{uuid.uuid4().hex[:8]}"
    store.create_partition(pid, "grpo", N)
    store.put(pid, grpo_columns(range(N), ["input_lengths", "input_ids"]), range(N))
    return pid


def _equal(table: pa.Table, rows, fields=TEACHER) -> None:
    want = grpo_columns(rows, fields)
    for f in fields:
        got = token_rows(table.column(f))
        assert len(got) == len(want[f])
        for g, w in zip(got, want[f]):
            assert g.shape == w.shape == (len(w), K) and g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)


def test_shaped_round_trip_in_any_row_order(store, part, monkeypatch):
    monkeypatch.setattr(store, "chunk_bytes", 4096)  # several row blocks per put: cuts fall inside the put
    store.put(part, grpo_columns(range(0, 7), TEACHER), range(0, 7))
    store.put(part, grpo_columns([11, 7, 9, 8, 10], TEACHER), [11, 7, 9, 8, 10])
    assert len({r.key for r in store.storage.snapshot(part).refs}) > 3
    assert store.ready(part, TEACHER).tolist() == list(range(N))
    _equal(store.get(part, TEACHER), range(N))
    for rows in ([3, 4, 5], [11, 0, 6, 6, 2], list(range(N))[::-1], np.arange(1, N, 3)):
        _equal(store.get(part, TEACHER, rows), list(rows))
    status = store.status(part)
    assert status.rows_written["teacher_topk_ids"] == N
    assert status.nbytes["teacher_topk_ids"] == sum(4 * K * row_len(r) + 4 for r in range(N))  # values + offsets


def test_rows_are_zero_copy_numpy_and_torch(store, part):
    store.put(part, grpo_columns(range(N), TEACHER), range(N))
    col = store.get(part, ["teacher_topk_logprobs"], range(2, 6)).column(0)
    values, lengths = token_values(col)  # [N_tok, K], [4]
    assert values.shape == (int(lengths.sum()), K) and lengths.tolist() == [row_len(r) for r in range(2, 6)]
    flat = col.chunk(0).values.values  # the Arrow buffer the store handed out
    assert np.shares_memory(values, np.frombuffer(flat.buffers()[1], dtype=np.float32))
    rows = token_rows(col)
    assert all(np.shares_memory(r, values) for r in rows)
    t = torch.from_numpy(rows[1].copy())  # [L, K]
    assert t.shape == (row_len(3), K) and t.dtype == torch.float32
    padded, mask = pad_tokens(store.get(part, ["teacher_topk_ids"], [5, 1]).column(0))  # [2, T, K], [2, T]
    T = max(row_len(5), row_len(1))
    assert padded.shape == (2, T, K) and padded.dtype == torch.int32 and mask.shape == (2, T)
    want = grpo_columns([5, 1], ["teacher_topk_ids"])["teacher_topk_ids"]
    for b, w in enumerate(want):
        assert torch.equal(padded[b, :len(w)], torch.from_numpy(w)) and int(mask[b].sum()) == len(w)
        assert not padded[b, len(w):].any()


def test_one_flat_array_with_lengths(store, part):
    """The other put form: values [N_tok, K] (or flat) and the row lengths, through list_array."""
    rows = [1, 4]
    want = grpo_columns(rows, TEACHER)
    lengths = [row_len(r) for r in rows]
    cols = {f: list_array(np.concatenate(want[f]).reshape(-1), lengths, GRPO.by_name[f].token_type)
            for f in TEACHER}
    store.put(part, cols, rows)
    _equal(store.get(part, TEACHER, rows), rows)


def _refused(store, pid, data, match):
    with pytest.raises(SchemaError, match=match):
        store.put(pid, data, [2, 3])
    assert store.status(pid).rows_written["teacher_topk_logprobs"] == 0
    assert store.status(pid).rows_written["teacher_topk_ids"] == 0


def test_refusals_name_the_column_and_shape_and_store_nothing(store, part):
    good = grpo_columns([2, 3], TEACHER)
    lp, ids = good["teacher_topk_logprobs"], good["teacher_topk_ids"]
    cases = [  # (the bad column, the data given, what the error says)
        ("teacher_topk_logprobs", [x[:, :K // 2] for x in lp], rf"teacher_topk_logprobs.*\[L, {K}\]"),
        ("teacher_topk_logprobs", [x.reshape(-1) for x in lp], rf"teacher_topk_logprobs.*\[L, {K}\]"),
        ("teacher_topk_logprobs", [x.astype(np.float64) for x in lp], "teacher_topk_logprobs.*float64.*float32"),
        ("teacher_topk_ids", [x[:-1] for x in ids], "teacher_topk_ids.*token lengths differ from input_lengths"),
        ("teacher_topk_ids", pa.array([x[:, :K // 2].tolist() for x in ids], type=pa.list_(pa.list_(pa.int32(), K // 2))),
         rf"teacher_topk_ids.*int32\[{K // 2}\].*declared list<int32\[{K}\]>.*shape \[{K}\]"),
        ("teacher_topk_ids", pa.array([x.tolist() for x in ids], type=pa.list_(pa.list_(pa.int64(), K))),
         "teacher_topk_ids.*int64"),
    ]
    for name, data, match in cases:
        _refused(store, part, {**good, name: data}, match)
    nan = [x.copy() for x in lp]
    nan[1][0, 5] = np.nan
    _refused(store, part, {**good, "teacher_topk_logprobs": nan}, "teacher_topk_logprobs.*rows 3.*NaN")
    holes = [x.tolist() for x in ids]
    holes[0][1][3] = None  # one value of one token
    _refused(store, part, {**good, "teacher_topk_ids": pa.array(holes, type=GRPO.by_name["teacher_topk_ids"]
                                                               .arrow_type)}, "teacher_topk_ids.*rows 2.*null")
    store.put(part, good, [2, 3])  # what was refused left nothing behind: the good put is the first write
    _equal(store.get(part, TEACHER, [2, 3]), [2, 3])
    with pytest.raises(DuplicateWriteError, match="teacher_topk_ids.*writer: teacher"):
        store.put(part, {"teacher_topk_ids": ids}, [2, 3])


def test_saved_partition_round_trip(store, part, tmp_path):
    """Async checkpoints save the rounds generated ahead as Arrow IPC and put them back (checkpoint/ahead.py)."""
    from dataplane_rl.checkpoint.ahead import read_table, write_table
    from dataplane_rl.columns.rowsets import write

    fields = ["input_lengths", "input_ids", *TEACHER]
    store.put(part, grpo_columns(range(N), TEACHER), range(N))
    write_table(tmp_path / "p.arrow", store.get(part, fields))
    table = read_table(tmp_path, "p.arrow", N)
    store.create_partition("again", "grpo", N)
    write(store, [("again", np.arange(N))], table)
    _equal(store.get("again", TEACHER), range(N))


def test_damaged_shaped_block_is_an_error(store, part):
    from dataplane_rl.errors import CorruptChunkError

    store.put(part, grpo_columns(range(N), TEACHER), range(N))
    corrupt(store, part, "teacher_topk_ids")
    with pytest.raises(CorruptChunkError, match="teacher_topk_ids"):
        store.get(part, ["teacher_topk_ids"], [0])


def test_several_inner_dims_stay_narrow(store):
    """A router's choices, [L, layers, top_k] int16 per row (m_int16: [L, 2, 3]): 2 bytes a value, stored and
    read back as [L, 2, 3] int16, padded to [B, T, 2, 3]."""
    from store_workers import all_dtypes_columns, all_dtypes_schema

    schema = all_dtypes_schema()
    store.create_partition("r", schema, 5)
    cols = all_dtypes_columns(range(5))
    store.put("r", {"input_lengths": cols["input_lengths"], "m_int16": cols["m_int16"]}, range(5))
    assert store.status("r").nbytes["m_int16"] == sum(2 * 6 * len(x) + 4 for x in cols["m_int16"])
    col = store.get("r", ["m_int16"], [4, 1, 3]).column(0)
    assert str(col.type) == "list<item: fixed_size_list<item: fixed_size_list<item: int16>[3]>[2]>"
    for got, want in zip(token_rows(col), [cols["m_int16"][i] for i in (4, 1, 3)]):
        assert got.dtype == np.int16 and got.shape == want.shape and np.array_equal(got, want)
    padded, mask = pad_tokens(col, torch=False)
    assert padded.shape == (3, int(mask.sum(1).max()), 2, 3) and padded.dtype == np.int16
    with pytest.raises(SchemaError, match=r"m_int16' row #0 has shape \[.*, 3, 2\]; each row must be \[L, 2, 3\]"):
        store.put("r", {"m_int16": [np.swapaxes(cols["m_int16"][0], 1, 2)]}, [0])


def test_schema_declares_shapes_and_checks_them():
    col = GRPO.by_name["teacher_topk_logprobs"]
    assert col.writer == "teacher" and col.shape == (K,) and col.shape_text == f"[{K}]"
    assert col.arrow_type == pa.list_(pa.list_(pa.float32(), K))
    GRPO.require_shape("teacher_topk_ids", [K], "distillation.topk_logits_k")
    with pytest.raises(SchemaError, match=r"teacher_topk_ids.*shape \[64\].*topk_logits_k=32 needs shape \[32\]"):
        GRPO.require_shape("teacher_topk_ids", [32], "distillation.topk_logits_k=32")


@pytest.mark.parametrize("shape,match", [([0], "dimensions >= 1"), ([1 << 11, 1 << 10], "at most"),
                                         ("[true]", r"shape \[True\] must list whole numbers"),  # was taken as [1]
                                         ("[2.0]", "must list whole numbers")])
def test_bad_shapes_refused_when_the_schema_loads(tmp_path, shape, match):
    f = tmp_path / "s.yaml"
    f.write_text("name: s\ncolumns:\n  - {name: input_lengths, dtype: int32, kind: sample, writer: rollout}\n"
                 f"  - {{name: k, dtype: float32, kind: token, writer: teacher, shape: {shape}}}\n")
    with pytest.raises(SchemaError, match=f"(column 'k'|columns.1.shape).*{match}"):
        load_schema(f)
    f.write_text("name: s\ncolumns:\n  - {name: r, dtype: float32, kind: sample, writer: driver, shape: [4]}\n")
    with pytest.raises(SchemaError, match="shape applies to token columns"):
        load_schema(f)


@pytest.mark.parametrize("mode", ["padded", "dynamic", "packed"])
def test_inner_dimensions_ride_along_in_microbatches(mode):
    """build_train_batch pads a shaped column to [B, T, k]; padded, dynamic and packed microbatches cut it like
    every token column, so each microbatch row holds its own row's [L, k] values, then zeros."""
    from dataplane_rl.bench.train import policy_for, synthetic_table
    from dataplane_rl.train.batch import build_train_batch, plan_microbatches

    lengths = np.array([5, 17, 3, 9, 12, 1, 7, 30])
    table = synthetic_table(lengths, 50)
    rng = np.random.default_rng(0)
    lp = [rng.standard_normal((n, K)).astype(np.float32) for n in lengths]
    ids = [rng.integers(0, 50, (n, K)).astype(np.int32) for n in lengths]
    for name, rows in zip(TEACHER, (lp, ids)):
        table = table.append_column(name, list_array(np.concatenate(rows), lengths,
                                                     GRPO.by_name[name].token_type))
    batch = build_train_batch(table, GRPO)
    assert batch["teacher_topk_logprobs"].shape == (8, 30, K) and batch["teacher_topk_ids"].dtype == torch.int64
    seen = []
    for mb in plan_microbatches(batch, policy_for(mode, 3, 40), "train"):
        t = mb["input_ids"].shape[1]
        assert mb["teacher_topk_ids"].shape == (len(mb["row_index"]), t, K)
        for b, r in enumerate(mb["row_index"].tolist()):
            n = lengths[r]
            assert torch.equal(mb["teacher_topk_logprobs"][b, :n], torch.from_numpy(lp[r]))
            assert torch.equal(mb["teacher_topk_ids"][b, :n], torch.from_numpy(ids[r]).long())
            assert not mb["teacher_topk_ids"][b, n:].any()
            seen.append(r)
    assert sorted(seen) == list(range(8))
