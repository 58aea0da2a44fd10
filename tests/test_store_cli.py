"""Smoke tests of `dataplane-rl store ls|show` in a subprocess, against live stores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dataplane_rl.store import open_store
from store_workers import ROLLOUT_FIELDS, grpo_columns


def run(*args):
    return subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", *args], capture_output=True,
                          text=True, timeout=120)


def fill(store):
    store.create_partition("step-000001", "grpo", 16)
    store.put("step-000001", grpo_columns(range(16), ROLLOUT_FIELDS), range(16))
    store.put("step-000001", grpo_columns(range(4), ["advantages"]), range(4))
    store.create_partition("step-000002", "grpo", 8)


@pytest.fixture
def shm_url():
    store = open_store("shm://")
    fill(store)
    yield store.url
    store.close()


def test_ls_table_and_json(shm_url):
    p = run("ls", shm_url)
    assert p.returncode == 0, p.stderr
    assert f"store {shm_url}: 2 partition(s)" in p.stdout
    assert "step-000001  schema grpo  16 rows" in p.stdout
    first = p.stdout.split("\nstep-000002")[0]
    lines = {line.split()[0]: line for line in first.splitlines() if line.startswith("  ")}
    assert "16/16" in lines["input_ids"] and lines["input_ids"].split()[-2] in ("B", "KiB")
    assert "4/16" in lines["advantages"] and "(partial)" in lines["advantages"]
    doc = json.loads(run("ls", shm_url, "--json").stdout)
    part = doc["partitions"][0]
    assert doc["url"] == shm_url and [p["partition"] for p in doc["partitions"]] == ["step-000001", "step-000002"]
    assert part["columns"]["input_ids"]["rows_written"] == 16 and part["columns"]["prev_logprobs"]["rows_written"] == 0
    assert part["nbytes"] == sum(c["nbytes"] for c in part["columns"].values()) > 0


def test_show_rows_and_fields(shm_url):
    p = run("show", shm_url, "step-000001", "--rows", "2-3,15", "--fields", "input_ids,total_reward,prompt_text")
    assert p.returncode == 0, p.stderr
    assert "showing rows 2-3,15 (3 rows)" in p.stdout
    assert [line for line in p.stdout.splitlines() if line.startswith("row ")] == ["row 2", "row 3", "row 15"]
    assert "input_ids     [200, 201, 202, 203] (4 tokens)" in p.stdout  # grpo_columns: r*100 + position
    assert "[1500, 1501, 1502, 1503, …, 1506] (7 tokens)" in p.stdout  # abbreviated
    assert "prompt_text   'prompt_text 15 seed 0 ✓'" in p.stdout
    default = run("show", shm_url, "step-000001")
    assert default.returncode == 0 and "row 9" in default.stdout and "row 10" not in default.stdout
    assert "column 'advantages' rows 4-9 not written" in default.stderr
    adv = [line.split(None, 1)[1] for line in default.stdout.splitlines() if line.startswith("  advantages")]
    assert adv[3] == "-3.5" and adv[4:] == ["(not written)"] * 6  # written cells shown, the rest marked


def test_errors_name_the_problem(shm_url, tmp_path):
    p = run("show", shm_url, "step-000001", "--fields", "prev_logprobs")
    assert p.returncode == 2 and "MissingColumnError" in p.stderr and "(writer: policy)" in p.stderr
    p = run("show", shm_url, "nope")
    assert p.returncode == 2 and "partition nope is unknown" in p.stderr
    p = run("ls", f"shm://{tmp_path}/missing")
    assert p.returncode == 2 and "no shm store" in p.stderr and not (tmp_path / "missing").exists()
    p = run("show", shm_url, "step-000001", "--rows", "a-b")
    assert p.returncode == 2 and "--rows" in p.stderr
    # refused before the range is built: 10**20 rows would be an OverflowError or a MemoryError first
    p = run("show", shm_url, "step-000001", "--rows", "0-99999999999999999999")
    assert p.returncode == 2 and "row 99999999999999999999 is out of range" in p.stderr and "16 rows" in p.stderr


def test_rows_are_range_checked_before_they_are_built():
    from dataplane_rl.cli.store_cmd import parse_rows
    from dataplane_rl.errors import ConfigError

    assert parse_rows("0-2,7", 8) == [0, 1, 2, 7]
    for bad, says in (("0-30000000", "row 30000000 is out of range"), ("8", "row 8 is out of range"),
                      ("5-3", "ends before it starts")):
        with pytest.raises(ConfigError, match=says):
            parse_rows(bad, 8)


def test_ls_ray(ray_store_url):
    store = open_store(ray_store_url)
    try:
        fill(store)
        p = run("ls", ray_store_url, "--json")
        assert p.returncode == 0, p.stderr
        doc = json.loads(p.stdout)
        assert doc["partitions"][0]["columns"]["input_ids"]["rows_written"] == 16
    finally:
        for pid in store.list_partitions():
            store.drop_partition(pid)
        store.close()


def test_ls_mooncake(mooncake_store):
    fill(mooncake_store)
    try:
        p = run("ls", mooncake_store.url)
        assert p.returncode == 0, p.stderr
        assert "step-000001  schema grpo  16 rows" in p.stdout and "16/16" in p.stdout
    finally:
        for pid in mooncake_store.list_partitions():
            mooncake_store.drop_partition(pid)


KEPT_BY_A_CHILD = ("import sys; sys.path.insert(0, 'tests'); from dataplane_rl.store import open_store; "
                   "from test_store_cli import fill; s = open_store('shm://'); fill(s); s.keep(); print(s.url); "
                   "s.close()")


def test_drop_one_then_all_removes_a_kept_folder(tmp_path):
    """`store drop URL PARTITION|--all`: --all also frees a kept shm:// folder, nothing left in /dev/shm."""
    from pathlib import Path

    # made by a process that has ended, as a run's kept store is: a live owner's store is not dropped
    url = subprocess.run([sys.executable, "-c", KEPT_BY_A_CHILD], capture_output=True, text=True, timeout=120,
                         check=True).stdout.strip()
    folder = Path(url.removeprefix("shm://"))
    try:
        assert folder.is_dir(), "keep() must leave the auto-made folder in place at close"
        p = run("drop", url, "step-000002")
        assert p.returncode == 0 and "dropped 1 partition(s)" in p.stdout, p.stderr
        assert json.loads(run("ls", url, "--json").stdout)["partitions"][0]["partition"] == "step-000001"
        p = run("drop", url, "step-000002")
        assert p.returncode == 2 and "PartitionNotFoundError" in p.stderr and "step-000002" in p.stderr
        p = run("drop", url, "--all")
        assert p.returncode == 0 and f"removed {folder}" in p.stdout, p.stderr
        assert not folder.exists()
        p = run("ls", url)
        assert p.returncode == 2 and "folder does not exist" in p.stderr and "create the store" not in p.stderr
        p = run("drop", url)
        assert p.returncode == 2 and "--all" in p.stderr  # a partition or --all is required
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


def test_a_run_folder_names_its_kept_store(tmp_path, shm_url):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "kept_store_url": shm_url}))
    p = run("ls", str(run_dir))
    assert p.returncode == 0 and f"store {shm_url}: 2 partition(s)" in p.stdout, p.stderr
    (run_dir / "summary.json").write_text(json.dumps({"status": "completed", "kept_store_url": None}))
    p = run("ls", str(run_dir))
    assert p.returncode == 2 and "kept no partitions" in p.stderr and "keep_partitions=true" in p.stderr
    p = run("ls", str(tmp_path / "nope"))
    assert p.returncode == 2 and "neither a store URL" in p.stderr


def test_a_live_run_folder_names_its_store(tmp_path, shm_url):
    """A live run has no summary.json yet: its store.json (written at the start) names the store."""
    run_dir = tmp_path / "live"
    run_dir.mkdir()
    (run_dir / "store.json").write_text(json.dumps({"store_url": shm_url}))
    p = run("ls", str(run_dir))
    assert p.returncode == 0 and f"store {shm_url}: 2 partition(s)" in p.stdout, p.stderr
    p = run("show", str(run_dir), "step-000001", "--rows", "0")
    assert p.returncode == 0 and "row 0" in p.stdout, p.stderr
    (run_dir / "store.json").write_text(json.dumps({"store_url": None}))
    p = run("ls", str(run_dir))
    assert p.returncode == 2 and "data plane off" in p.stderr and "data_plane.enabled=true" in p.stderr


def test_drop_refuses_the_store_of_a_live_run_unless_forced():
    """`store drop RUN --all` on a live run once removed its store, and the run died with a remote traceback:
    a store whose owner record names a live process is refused, naming it and --force."""
    from test_store_owners import OWNER

    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        url = owner.stdout.readline().strip()
        for which in (["--all"], ["p"]):
            p = run("drop", url, *which)
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, p.stderr
            assert f"in use by a live run (pid {owner.pid} " in lines[0] and "--force" in lines[0]
            assert json.loads(run("ls", url, "--json").stdout)["partitions"][0]["partition"] == "p"
        p = run("drop", url, "--all", "--force")
        assert p.returncode == 0 and "dropped 1 partition(s)" in p.stdout, p.stderr
    finally:
        owner.kill()
        owner.wait()


def test_one_damaged_partition_hides_no_other(tmp_path):
    """A damaged log (a flipped byte) or a removed chunks/ folder: `ls` marks that partition and lists the
    rest; `show` and `export` of another partition read only it."""
    import shutil

    url = f"shm://{tmp_path}/s"
    store = open_store(url)
    fill(store)
    store.create_partition("step-000003", "grpo", 4)
    store.close()
    log = tmp_path / "s" / "step-000002" / "log"
    data = bytearray(log.read_bytes())
    data[len(data) // 2] ^= 0xFF
    log.write_bytes(bytes(data))
    shutil.rmtree(tmp_path / "s" / "step-000003" / "chunks")
    p = run("ls", url)
    assert p.returncode == 0, p.stderr
    assert "step-000001  schema grpo  16 rows" in p.stdout
    assert "step-000002  DAMAGED: CorruptChunkError" in p.stdout
    # removed chunks/: damaged, not "unknown or dropped" while listed live in the same line
    assert "step-000003  DAMAGED: CorruptChunkError" in p.stdout and "step-000003/chunks is missing" in p.stdout
    assert "unknown or dropped" not in p.stdout + p.stderr
    assert "2 damaged partition(s): step-000002, step-000003" in p.stderr
    assert json.loads(run("ls", url, "--json").stdout)["stats"]["dataplane_store_damaged_partitions"] == 2
    p = run("show", url, "step-000001", "--rows", "0", "--fields", "input_ids")
    assert p.returncode == 0 and "input_ids  [0] (1 tokens)" in p.stdout, p.stderr
    p = run("export", url, "step-000001", str(tmp_path / "one.parquet"))
    assert p.returncode == 0 and "16 rows" in p.stdout, p.stderr
    p = run("show", url, "step-000003")
    assert p.returncode == 2 and "damaged" in p.stderr and "unknown or dropped" not in p.stderr
    p = run("drop", url, "step-000002", "--force")  # a damaged partition can be dropped (this process made the store)
    assert p.returncode == 0, p.stderr


def test_a_ray_url_never_waits_on_a_dead_or_recorded_cluster(tmp_path):
    """`store ls ray://127.0.0.1:1` hung over 6 minutes, and a `ray://` without an address joined whatever
    ray_current_cluster named, retrying a dead or foreign address for minutes (11 seen). Now a given address that
    does not answer is one error line at once, and `ray://` starts a Ray of its own whatever is recorded."""
    p = run("ls", "ray://127.0.0.1:1")
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines()[-1] == (
        "error: StoreUnavailableError: cannot reach Ray at 127.0.0.1:1 (connection refused); start it (`ray start "
        "--head --port=1`) or give the address `ray start` printed; ray:// without an address starts a local Ray of "
        "this process's own"), p.stderr
    # a stale record of a dead cluster where Ray looks for one (RAY_TMPDIR: a folder of this test's own, so no
    # other process on the machine sees it; Ray reads RAY_TMPDIR/ray/ray_current_cluster as it would /tmp/ray's)
    ray_tmp = tempfile.mkdtemp(prefix="dprl-", dir="/tmp")  # short: Ray's socket paths live under it
    try:
        (Path(ray_tmp) / "ray").mkdir()
        (Path(ray_tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", "ls", "ray://", "--json"],
                           capture_output=True, text=True, timeout=300, env={**env, "RAY_TMPDIR": ray_tmp})
        assert p.returncode == 0, p.stderr[-3000:]
        doc = json.loads(p.stdout)
        assert doc["partitions"] == [] and not doc["url"].startswith("ray://127.0.0.1:1/"), doc
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
