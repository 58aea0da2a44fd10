"""shm-only behaviour: the store folder's life, foreign folders, the file pool, the put file's layout.

The contract every backend shares is in test_store_contract.py; damage to shm's own files is in
test_shm_faults.py.
"""

from __future__ import annotations

import os

import pytest

from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl.store import open_store
from store_workers import grpo_columns
from test_store_contract import assert_rows


def test_shm_auto_folder_lives_with_its_store(tmp_path):
    auto = open_store("shm://")
    assert auto.url.startswith("shm:///") and auto.path.is_dir()
    other = open_store(auto.url)
    other.create_partition("p", "grpo", 1)
    other.close()
    assert auto.list_partitions() == ["p"]  # closing a store opened on an existing folder keeps it
    auto.close()
    assert not auto.path.exists()
    named = open_store(f"shm://{tmp_path}/s")
    named.close()
    assert (tmp_path / "s").is_dir()


def test_shm_refuses_foreign_folders(tmp_path):
    from dataplane_rl.errors import ConfigError
    from dataplane_rl.store.shm import ShmStore

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a dataplane-rl store"):
        open_store(f"shm://{tmp_path}")
    with pytest.raises(StoreUnavailableError, match="no shm store"):
        ShmStore(tmp_path / "missing", create=False)
    with pytest.raises(ConfigError, match="pool_bytes"):
        open_store(f"shm://{tmp_path}/x?pool=1")


def test_shm_pool_reuses_dropped_files():
    store = open_store("shm://")
    try:
        fields = ["input_lengths", "input_ids", "total_reward"]
        store.create_partition("a", "grpo", 64)
        store.put("a", grpo_columns(range(64), fields, seed=1), range(64))
        assert_rows(store, "a", range(64), fields, seed=1)  # no array kept: nothing maps "a" afterwards
        store.drop_partition("a")
        pooled = store.pool_bytes()
        assert pooled >= store_bytes_floor(64)
        store.create_partition("b", "grpo", 64)
        store.put("b", grpo_columns(range(64), fields, seed=2), range(64))
        assert store.pool_bytes() < pooled  # the put took files from the pool
        assert_rows(store, "b", range(64), fields, seed=2)
    finally:
        store.close()


def store_bytes_floor(n: int) -> int:
    return 4 * n  # at least the input_lengths values


def test_shm_put_is_one_file_of_aligned_blocks():
    store = open_store("shm://")
    try:
        fields = ["input_lengths", "input_ids", "prev_logprobs", "total_reward"]
        store.create_partition("a", "grpo", 64)
        store.chunk_bytes = 256  # several row blocks, all in the put's one file
        store.put("a", grpo_columns(range(64), fields, seed=3), range(64))
        assert len(os.listdir(store.path / "a" / "chunks")) == 1
        refs = store.storage.snapshot("a").refs
        assert len(refs) > 2 and len({r.key for r in refs}) == len(refs)
        assert all(r.columns == tuple(fields) for r in refs)  # each block holds every column of the put
        assert all(int(r.key.rpartition("@")[2]) % 64 == 0 for r in refs)
        assert_rows(store, "a", range(64), fields, seed=3)
        assert_rows(store, "a", [63, 0, 17], fields, seed=3)
    finally:
        store.close()


def test_a_put_from_what_a_process_knew_follows_a_drop_elsewhere(tmp_path):
    """A process puts into a partition it knows without reading the catalog (its claims check write-once);
    when another process has dropped it meanwhile, the put is refused before anything is committed, and
    when the id was made again, the put lands in the new partition (not the dropped one's files)."""
    from dataplane_rl.errors import MissingColumnError, PartitionNotFoundError

    url = f"shm://{tmp_path}/s"
    a, b = open_store(url), open_store(url)  # two stores: each its own caches, as two processes
    try:
        a.create_partition("p", "grpo", 8)
        a.put("p", grpo_columns(range(4), ["input_lengths", "total_reward"]), range(4))
        b.drop_partition("p")
        with pytest.raises(PartitionNotFoundError, match="partition p was dropped while this put was writing"):
            a.put("p", grpo_columns(range(4, 8), ["input_lengths", "total_reward"]), range(4, 8))
        a.create_partition("p", "grpo", 8)  # the same id, made again by the writer: it knows it again
        a.put("p", grpo_columns(range(4), ["input_lengths"]), range(4))
        b.drop_partition("p")
        b.create_partition("p", "grpo", 8)  # and made again elsewhere: what the writer knows is stale
        a.put("p", grpo_columns(range(4, 8), ["input_lengths", "total_reward"]), range(4, 8))
        assert_rows(b, "p", range(4, 8), ["input_lengths", "total_reward"])
        with pytest.raises(MissingColumnError, match="rows 0-3 not written"):
            b.get("p", ["input_lengths"], range(4))  # the dropped incarnation's rows are not in the new one
        a.put("p", grpo_columns(range(4), ["input_lengths"]), range(4))  # its cells are free here
    finally:
        a.close()
        b.close()
