"""`dataplane-rl store export`: a partition to Parquet, read back with pyarrow (and pandas, where installed) with
equal values; and `store ls|show` printing shapes."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from dataplane_rl.errors import MissingColumnError
from dataplane_rl.schema import GRPO_SCHEMA
from dataplane_rl.store import open_store, token_rows
from dataplane_rl.store.parquet import SCHEMA_KEY, SOURCE_KEY, export_partition, read_parquet_schema
from store_workers import ROLLOUT_FIELDS, as_lists, grpo_columns
from test_store_cli import run

TEACHER = ["teacher_topk_logprobs", "teacher_topk_ids"]


@pytest.fixture
def shm_url():
    store = open_store("shm://")
    store.create_partition("step-000001", "grpo", 16)
    store.put("step-000001", grpo_columns(range(16), ROLLOUT_FIELDS), range(16))
    store.put("step-000001", grpo_columns(range(16), TEACHER), range(16))
    store.put("step-000001", grpo_columns(range(4), ["advantages"]), range(4))  # partly written: not exported
    yield store.url
    store.close()


def test_export_reads_back_equal(shm_url, tmp_path):
    out = tmp_path / "step.parquet"
    p = run("export", shm_url, "step-000001", str(out))
    assert p.returncode == 0, p.stderr
    written = [*ROLLOUT_FIELDS, *TEACHER]
    assert f"wrote {out}: partition step-000001, 16 rows, {len(written)} columns" in p.stdout
    table = pq.read_table(out)
    assert sorted(table.column_names) == sorted(written) and "advantages" not in table.column_names
    want = grpo_columns(range(16), written)
    for name in written:
        assert as_lists(table.column(name)) == as_lists(want[name]), name
    k = GRPO_SCHEMA.by_name["teacher_topk_ids"].shape[0]
    assert str(table.schema.field("teacher_topk_ids").type.value_type).startswith("fixed_size_list")
    for got, w in zip(token_rows(table.column("teacher_topk_logprobs")), want["teacher_topk_logprobs"]):
        assert got.shape == (len(w), k) and np.array_equal(got, w)  # [L, k] again, exactly
    meta = pq.read_schema(out).metadata
    assert json.loads(meta[SOURCE_KEY]) == {"store": shm_url, "partition": "step-000001"}
    assert read_parquet_schema(out) == GRPO_SCHEMA.model_validate_json(meta[SCHEMA_KEY])
    assert read_parquet_schema(out).by_name["teacher_topk_ids"].shape == (k,)
    import subprocess
    import sys

    check = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "schema", "validate", str(out), "--writer",
                            "teacher"], capture_output=True, text=True, timeout=120)  # shapes and lengths match
    assert check.returncode == 0 and f"16 rows, {len(written)} columns match schema 'grpo'" in check.stdout, check.stderr
    p = run("export", shm_url, "step-000001", str(out), "--fields", "input_ids,teacher_topk_ids")
    assert p.returncode == 0 and pq.read_table(out).column_names == ["input_ids", "teacher_topk_ids"]


def test_pandas_reads_it(shm_url, tmp_path):
    pd = pytest.importorskip("pandas")  # not a dependency; users have it
    store = open_store(shm_url)
    try:
        export_partition(store, "step-000001", tmp_path / "p.parquet", ["input_ids", "teacher_topk_ids"])
    finally:
        store.close()
    df = pd.read_parquet(tmp_path / "p.parquet")
    want = grpo_columns([3], ["teacher_topk_ids"])["teacher_topk_ids"][0]
    assert np.array_equal(np.stack(df["teacher_topk_ids"][3]), want)


def test_export_errors_name_the_problem(shm_url, tmp_path):
    p = run("export", shm_url, "step-000001", str(tmp_path / "x.parquet"), "--fields", "advantages")
    assert p.returncode != 0 and "advantages" in p.stderr and "rows 4-15" in p.stderr and "not written" in p.stderr
    assert not (tmp_path / "x.parquet").exists()
    p = run("export", shm_url, "nope", str(tmp_path / "x.parquet"))
    assert p.returncode != 0 and "partition nope" in p.stderr
    store = open_store("memory://")
    store.create_partition("empty", "grpo", 3)
    with pytest.raises(Exception, match="no column written on all of its 3 rows; name the columns"):
        export_partition(store, "empty", tmp_path / "e.parquet")
    with pytest.raises(MissingColumnError):
        export_partition(store, "empty", tmp_path / "e.parquet", ["input_ids"])


def test_ls_and_show_print_shapes(shm_url):
    k = GRPO_SCHEMA.by_name["teacher_topk_ids"].shape[0]
    p = run("ls", shm_url)
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.strip().startswith("teacher_topk_ids"))
    assert f"teacher  [L, {k}]" in line
    p = run("show", shm_url, "step-000001", "--rows", "1", "--fields", "teacher_topk_ids")
    assert p.returncode == 0, p.stderr
    assert f"tokens of [{k}])" in p.stdout and "[[" in p.stdout
    doc = json.loads(run("ls", shm_url, "--json").stdout)
    assert doc["partitions"][0]["columns"]["teacher_topk_ids"]["shape"] == [k]


def test_hugging_face_datasets_reads_it(shm_url, tmp_path):
    datasets = pytest.importorskip("datasets")  # not a dependency; checked where it is installed
    store = open_store(shm_url)
    try:
        export_partition(store, "step-000001", tmp_path / "p.parquet", ["input_ids", "teacher_topk_logprobs"])
    finally:
        store.close()
    ds = datasets.Dataset.from_parquet(str(tmp_path / "p.parquet"), cache_dir=str(tmp_path / "cache"))
    want = grpo_columns([5], ["teacher_topk_logprobs"])["teacher_topk_logprobs"][0]
    assert np.array_equal(np.array(ds[5]["teacher_topk_logprobs"], dtype=np.float32), want)
