"""shm faults a real machine has: a full filesystem, a read-only one, a URL naming a file, damaged
metadata, and another user. Each test makes the fault for real (a small tmpfs it mounts, a second uid)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dataplane_rl.errors import CorruptChunkError, StoreFullError, StoreUnavailableError
from dataplane_rl.store import open_store
from store_workers import grpo_columns

NOBODY = 65534


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        from conftest import backend_unavailable

        backend_unavailable("shm faults", f"{what} needs root")


@pytest.fixture
def tmpfs(tmp_path):
    """A fresh 8 MiB tmpfs: the /dev/shm of a machine with little room, without filling the real one."""
    need_root("mounting a tmpfs")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def used(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def tokens(n_rows: int, per_row: int) -> dict:
    return {"input_lengths": np.full(n_rows, per_row, np.int32),
            "input_ids": [np.arange(per_row, dtype=np.int32) for _ in range(n_rows)]}


PUT_IN_CHILD = """
import sys, numpy as np
from dataplane_rl.store import open_store
s = open_store(sys.argv[1])
n, per = int(sys.argv[2]), int(sys.argv[3])
cols = {"input_lengths": np.full(n, per, np.int32), "input_ids": [np.arange(per, dtype=np.int32)] * n}
try:
    s.put("p", cols, range(n))
except Exception as e:
    print(type(e).__name__, e, flush=True)
    sys.exit(3)
print("stored", flush=True)
"""


def test_put_larger_than_free_space_is_store_full_not_sigbus(tmpfs):
    store = open_store(f"shm://{tmpfs}/s?pool_bytes=0")
    try:
        store.create_partition("p", "grpo", 10)
        before = used(tmpfs)
        # ~12 MiB of tokens into 8 MiB: in a child, because without a reservation the kernel kills the writer
        p = subprocess.run([sys.executable, "-c", PUT_IN_CHILD, store.url, "10", "300000"], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 3, f"writer ended with {p.returncode} (-7 is SIGBUS): {p.stdout} {p.stderr[-2000:]}"
        assert p.stdout.startswith("StoreFullError"), p.stdout
        assert str(tmpfs / "s") in p.stdout and "bytes asked" in p.stdout and "bytes free" in p.stdout
        assert not [f for f in (tmpfs / "s").rglob("*") if f.name.startswith(".tmp")], "a temporary file was left"
        assert used(tmpfs) == before, "the failed put kept space"
        assert sum(store.status("p").rows_written.values()) == 0
        store.put("p", tokens(10, 1000), range(10))  # a put that fits still works
        assert store.get("p", ["input_ids"], [9]).column(0).to_pylist() == [list(range(1000))]
    finally:
        store.close()


def fill(mnt: Path) -> None:
    """Take every free byte of the filesystem."""
    with open(mnt / "filler", "ab") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 16))
                f.flush()
        except OSError:
            pass


def test_create_partition_and_commit_on_a_full_filesystem(tmpfs):
    store = open_store(f"shm://{tmpfs}/s?pool_bytes=0")
    try:
        store.create_partition("p", "grpo", 64)
        fill(tmpfs)
        with pytest.raises(StoreFullError, match=rf"shm store {tmpfs}/s is full: cannot create partition q"):
            store.create_partition("q", "grpo", 4)
        assert store.list_partitions() == ["p"] and not [n for n in os.listdir(tmpfs / "s") if n.startswith(".create")]
        (tmpfs / "filler").unlink()

        # The put's segment fits; then the disk fills. Puts go on into the segment's allocated pages, and
        # their commits into the log's page, until a commit needs a new page of the log: that put fails
        # whole, and nothing of it is visible
        store.put("p", grpo_columns([0], ["total_reward"]), [0])
        fill(tmpfs)
        size = os.path.getsize(tmpfs / "s" / "p" / "logs" / "0")
        with pytest.raises(StoreFullError, match="cannot commit a put to partition p"):
            for row in range(1, 64):  # each record ~0.2 kB: the log's last page (4 KiB) is full within 20 puts
                store.put("p", {"total_reward": np.ones(1, np.float32) * row}, [row])
        assert row > 1, "the log's page ran out at once: this test's puts did not reach the log"
        assert os.path.getsize(tmpfs / "s" / "p" / "logs" / "0") <= -(-size // 4096) * 4096
        other = open_store(store.url)  # what another process sees: the rows before the failed put, no more
        assert other.ready("p", "total_reward").tolist() == list(range(row))
        other.close()
        (tmpfs / "filler").unlink()
        store.put("p", {"total_reward": np.ones(1, np.float32) * row}, [row])  # the failed put's rows: free
        assert store.get("p", "total_reward", [row]).column(0).to_pylist() == [float(row)]
    finally:
        store.close()


def test_a_store_made_on_a_full_filesystem_works_once_space_is_back(tmpfs):
    fill(tmpfs)
    with pytest.raises(StoreFullError, match=rf"shm store {tmpfs}/new is full"):
        open_store(f"shm://{tmpfs}/new")
    assert not (tmpfs / "new" / ".dataplane-rl").exists(), "an empty marker was left (read later as format '')"
    (tmpfs / "filler").unlink()
    store = open_store(f"shm://{tmpfs}/new")
    try:
        store.create_partition("p", "grpo", 4)
        store.put("p", grpo_columns(range(4), ["total_reward"]), range(4))
    finally:
        store.close()


def test_read_only_folder_and_url_naming_a_file(tmpfs, tmp_path):
    store = open_store(f"shm://{tmpfs}/s")
    try:
        store.create_partition("p", "grpo", 4)
        subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
        with pytest.raises(StoreUnavailableError, match=rf"shm store {tmpfs}/s: cannot write a put of partition p"):
            store.put("p", grpo_columns(range(4), ["total_reward"]), range(4))
        with pytest.raises(StoreUnavailableError, match="cannot create partition q"):
            store.create_partition("q", "grpo", 4)
        with pytest.raises(StoreUnavailableError, match=rf"{tmpfs}/new: cannot make the store folder"):
            open_store(f"shm://{tmpfs}/new")
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(tmpfs)], check=True)
        store.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(StoreUnavailableError, match=rf"shm://{tmp_path}/file names a file, not a folder"):
        open_store(f"shm://{tmp_path}/file")


# ---- metadata ------------------------------------------------------------------------------------
@pytest.fixture
def shm():
    s = open_store("shm://")
    s.create_partition("p", "grpo", 8)
    s.put("p", grpo_columns(range(8), ["input_lengths", "total_reward"]), range(8))
    yield s
    s.close()


def log_of(store) -> Path:
    """The log of the store's one writer: its puts' records."""
    return store.path / "p" / "logs" / "0"


def reopen(store):
    return open_store(store.url)  # a process that has not read the log


def set_end(log: Path, end: int) -> None:
    """Move the log's committed end (a valid header: only the records can be wrong)."""
    from dataplane_rl.store.shm.catalog import _head

    with open(log, "r+b") as f:
        f.write(_head(end))


def test_edited_log_record_is_corrupt_not_wrong_rows(shm):
    f = log_of(shm)
    f.write_bytes(f.read_bytes().replace(b'"rows": [[0, 8]]', b'"rows": [[1, 9]]', 1))
    other = reopen(shm)
    with pytest.raises(CorruptChunkError, match=rf"shm metadata {f} at \d+ is damaged"):
        other.get("p", ["total_reward"])
    other.close()


def test_a_copied_log_record_is_corrupt_not_rows_counted_twice(shm):
    f = log_of(shm)
    data = f.read_bytes()
    last = data[data.rindex(b'[{"columns"') - 21:]  # the put's record: its length, checksum and JSON
    f.write_bytes(data + last)  # a valid checksum: the same commit, seen twice
    set_end(f, len(data) + len(last))
    other = reopen(shm)
    with pytest.raises(CorruptChunkError, match=rf"shm log {f} repeats chunk put-\w+@\d+ of an earlier commit"):
        other.status("p")
    other.close()


def test_truncated_log_and_meta_are_corrupt(shm):
    f = log_of(shm)
    data = f.read_bytes()
    f.write_bytes(data[:-7])
    other = reopen(shm)
    with pytest.raises(CorruptChunkError, match=rf"shm metadata {f} is damaged \({len(data) - 7} bytes, the header says"):
        other.get("p", ["total_reward"])
    other.close()
    f = log_of(shm).parent.parent / "log"  # the meta's log
    data = f.read_bytes()
    f.write_bytes(data.replace(b'"num_rows": 8', b'"num_rows": 9'))
    other = reopen(shm)
    with pytest.raises(CorruptChunkError, match=rf"{f} at 64 is damaged"):
        other.num_rows("p")
    other.close()
    f.write_bytes(b"x" * len(data))
    other = reopen(shm)
    with pytest.raises(CorruptChunkError, match=rf"{f} is damaged \(no valid header\)"):
        other.num_rows("p")
    other.close()


def test_log_naming_a_path_outside_the_partition_is_refused(shm):
    from dataplane_rl.store.shm.catalog import _record

    f = log_of(shm)
    data = f.read_bytes()
    at = data.rindex(b'[{"columns"') - 21
    body = json.loads(data[at + 21:])
    body[0]["key"] = "../../../../etc/passwd@0"
    record = _record(json.dumps(body))  # a valid checksum: only the key check stands in the way
    f.write_bytes(data[:at] + record)
    set_end(f, at + len(record))
    other = reopen(shm)
    with pytest.raises(CorruptChunkError, match=r"names chunk key '\.\./\.\./\.\./\.\./etc/passwd@0'"):
        other.get("p", ["total_reward"])
    other.close()


# ---- privacy -------------------------------------------------------------------------------------
def test_store_is_private_to_its_user(shm):
    for p in [shm.path, *shm.path.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), f"{p} has mode {mode:o}"
    need_root("switching to a second uid")
    chunk = next((shm.path / "p" / "chunks").iterdir())
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # the second user: only system calls and our already-imported store code
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = []
            for attempt in (lambda: open(chunk, "rb").read(1), lambda: os.listdir(shm.path),
                            lambda: open_store(shm.url).get("p", ["total_reward"])):
                try:
                    attempt()
                    out.append("read")
                except BaseException as e:  # noqa: BLE001 - report any outcome to the parent
                    out.append(f"{type(e).__name__}: {e}")
            os.write(w, json.dumps(out).encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as pipe:
        report = pipe.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, report
    direct, listing, via_store = json.loads(report)
    assert direct.startswith("PermissionError") and listing.startswith("PermissionError")
    assert via_store.startswith("StoreUnavailableError") and "belongs to another user; owner root" in via_store, via_store


def test_store_of_the_older_format_is_refused(tmp_path):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / ".dataplane-rl").write_text("dataplane-rl shm store v1\n")
    with pytest.raises(StoreUnavailableError, match="older dataplane-rl .*make a new store"):
        open_store(f"shm://{tmp_path}/old")
