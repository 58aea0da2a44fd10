"""`dataplane-rl store export`: a partition to Parquet, read back with pyarrow (and pandas, where installed) with
equal values; and `store ls|show` printing shapes."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from dataplane_rl.errors import MissingColumnError
from dataplane_rl.config import bound_schema
from dataplane_rl.store import open_store, token_rows
from dataplane_rl.store.parquet import SCHEMA_KEY, SOURCE_KEY, export_partition, read_parquet_schema
from store_workers import ROLLOUT_FIELDS, as_lists, grpo_columns
from test_store_cli import run

GRPO = bound_schema()  # what a partition created as "grpo" holds: the teacher columns at the default k

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
    k = GRPO.by_name["teacher_topk_ids"].shape[0]
    assert str(table.schema.field("teacher_topk_ids").type.value_type).startswith("fixed_size_list")
    for got, w in zip(token_rows(table.column("teacher_topk_logprobs")), want["teacher_topk_logprobs"]):
        assert got.shape == (len(w), k) and np.array_equal(got, w)  # [L, k] again, exactly
    meta = pq.read_schema(out).metadata
    assert json.loads(meta[SOURCE_KEY]) == {"store": shm_url, "partition": "step-000001"}
    assert read_parquet_schema(out) == GRPO.model_validate_json(meta[SCHEMA_KEY])
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
    k = GRPO.by_name["teacher_topk_ids"].shape[0]
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


def test_export_never_writes_into_a_store_and_a_bad_target_is_one_line(tmp_path):
    """`store export URL step-000001 DIR/step-000002/log` once returned 0 and left step-000002 corrupt: a target
    inside any store folder (directly, through a symlink, or one of the exported partition's own segments) is
    refused before anything is read, and the store reads back as before. A folder, a missing parent, /proc,
    another user's file or `--fields ''` is one `error:` line too."""
    import os

    url, folder = f"shm://{tmp_path}/s", tmp_path / "s"
    store = open_store(url)
    store.create_partition("step-000001", "grpo", 4)
    store.put("step-000001", grpo_columns(range(4), ROLLOUT_FIELDS), range(4))
    store.create_partition("step-000002", "grpo", 4)
    store.put("step-000002", grpo_columns(range(4), ROLLOUT_FIELDS), range(4))
    before = {pid: store.get(pid, ROLLOUT_FIELDS) for pid in ("step-000001", "step-000002")}
    segment = next((folder / "step-000001" / "chunks").iterdir())
    (tmp_path / "link").symlink_to(folder / "step-000002")
    owned = tmp_path / "theirs.parquet"
    owned.write_bytes(b"not ours")
    os.chown(owned, 65534, 65534)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    cases = {  # target -> what its one line says
        folder / "step-000002" / "log": "inside the column store folder",
        segment: "inside the column store folder",
        folder / "new.parquet": "inside the column store folder",
        tmp_path / "link" / "log": "inside the column store folder",
        tmp_path: "is a folder; name a file",
        tmp_path / "missing" / "x.parquet": "does not exist; create it first",
        "/proc/x.parquet": "could not be written",
        fifo: "not a regular file",  # the rename would replace it (as root, a device in /dev)
        owned: "belongs to another user",
    }
    for target, says in cases.items():
        p = run("export", url, "step-000001", str(target))
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ConfigError: "), (target, p.stderr)
        assert says in lines[0] and str(target) in lines[0], (target, lines[0])
    assert owned.read_bytes() == b"not ours"
    assert not list(tmp_path.glob(".*.tmp")) and not list(folder.rglob("*.parquet*"))
    for pid, table in before.items():
        assert store.get(pid, ROLLOUT_FIELDS).equals(table), pid
    p = run("export", url, "step-000001", str(tmp_path / "x.parquet"), "--fields", "")
    assert p.returncode == 2 and "--fields '' names no column" in p.stderr and not (tmp_path / "x.parquet").exists()
    store.close()


def test_export_and_trace_png_never_write_into_a_store(tmp_path):
    """Every command that writes a file asks store/targets.py first: `export RUN OUT` and `trace RUN --png OUT`
    with OUT in a store folder are one line, and the store's folder is left as it was."""
    import subprocess
    import sys

    store = open_store(f"shm://{tmp_path}/s")
    store.create_partition("step-000001", "grpo", 2)
    store.close()
    before = sorted(p.name for p in (tmp_path / "s").rglob("*"))
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "trace.json").write_text('{"traceEvents": []}')
    for args in (["export", str(tmp_path / "run"), str(tmp_path / "s" / "step-000001" / "model")],
                 ["trace", str(tmp_path / "run"), "--png", str(tmp_path / "s" / "t.png")]):
        p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", *args], capture_output=True, text=True,
                           timeout=120)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and "inside the column store folder" in lines[0], p.stderr
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == before
