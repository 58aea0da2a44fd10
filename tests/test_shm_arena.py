"""The shm arena: puts placed in a writer's open segment, segments reused after a drop, the arena's bound."""

from __future__ import annotations

import os

import numpy as np
import pytest
from store_workers import grpo_columns
from test_store_contract import assert_rows

from dataplane_rl.errors import ConfigError, DuplicateWriteError, StoreFullError
from dataplane_rl.store import open_store

FIELDS = ["input_lengths", "input_ids", "total_reward"]


def inodes(store, pid: str) -> set[int]:
    return {e.inode() for e in os.scandir(store.path / pid / "chunks")}


@pytest.fixture
def store(tmp_path):
    s = open_store(f"shm://{tmp_path}/s?prefault_mb=4")
    yield s
    s.close()


def test_puts_of_one_writer_share_one_segment(store):
    store.create_partition("a", "grpo", 64)
    for lo in range(0, 64, 8):
        store.put("a", grpo_columns(range(lo, lo + 8), FIELDS, seed=lo), range(lo, lo + 8))
    assert len(inodes(store, "a")) == 1
    offsets = sorted(int(r.key.rpartition("@")[2]) for r in store.storage.snapshot("a").refs)
    assert len(set(offsets)) == 8 and all(o % 64 == 0 for o in offsets)
    for lo in range(0, 64, 8):
        assert_rows(store, "a", range(lo, lo + 8), FIELDS, seed=lo)
    other = open_store(store.url)  # a process that never wrote reads the same cells
    assert other.get("a", ["total_reward"], [63, 0]).num_rows == 2
    other.close()


def test_a_dropped_partition_gives_its_segment_to_the_next_one(store):
    store.create_partition("a", "grpo", 16)
    store.put("a", grpo_columns(range(16), FIELDS, seed=1), range(16))
    first = inodes(store, "a")
    store.drop_partition("a")
    store.create_partition("b", "grpo", 16)
    store.put("b", grpo_columns(range(16), FIELDS, seed=2), range(16))
    assert inodes(store, "b") == first  # the same file, its pages already there: not unlinked and made again
    assert_rows(store, "b", range(16), FIELDS, seed=2)


def test_a_writer_gets_its_own_segment_back_by_name(store, monkeypatch):
    """A pooled segment keeps its name; the writer that wrote it asks for it by name first (its pages are
    mapped in that process already), without listing the pool, even with other segments pooled."""
    store.create_partition("a", "grpo", 16)
    store.put("a", grpo_columns(range(16), FIELDS, seed=1), range(16))
    (name,) = os.listdir(store.path / "a" / "chunks")
    store.drop_partition("a")
    assert any(n.endswith(name.removeprefix("put-")) for n in os.listdir(store.path / ".pool"))
    listed = []
    real = store.storage._pool.files
    monkeypatch.setattr(store.storage._pool, "files", lambda: listed.append(1) or real())
    store.create_partition("b", "grpo", 16)
    store.put("b", grpo_columns(range(16), FIELDS, seed=2), range(16))
    assert os.listdir(store.path / "b" / "chunks") == [name] and not listed
    assert_rows(store, "b", range(16), FIELDS, seed=2)


def test_a_new_store_has_ready_pages_and_its_first_put_takes_them(tmp_path):
    s = open_store(f"shm://{tmp_path}/s?prefault_mb=2")
    try:
        pooled = {e.inode() for e in os.scandir(tmp_path / "s" / ".pool")}
        assert s.pool_bytes() == 2 << 20 and len(pooled) == 1
        s.create_partition("a", "grpo", 4)
        s.put("a", grpo_columns(range(4), FIELDS), range(4))
        assert inodes(s, "a") == pooled and s.pool_bytes() == 0
    finally:
        s.close()
    none = open_store(f"shm://{tmp_path}/t?prefault_mb=0")
    assert none.pool_bytes() == 0
    none.close()


def test_a_failed_put_gives_its_range_back(store):
    store.create_partition("a", "grpo", 8)
    store.put("a", grpo_columns(range(4), FIELDS), range(4))
    used = store.storage._arena._open["a"].used
    with pytest.raises(DuplicateWriteError):
        store.put("a", grpo_columns([0], ["total_reward"]), [0])  # a second write of a cell: refused early
    from dataplane_rl.store import chunks

    real = chunks.write_block

    def fail(*a, **k):
        raise RuntimeError("injected")

    chunks.write_block = fail
    try:
        with pytest.raises(RuntimeError, match="injected"):
            store.put("a", grpo_columns(range(4, 8), FIELDS), range(4, 8))
    finally:
        chunks.write_block = real
    assert store.storage._arena._open["a"].used == used
    store.put("a", grpo_columns(range(4, 8), FIELDS, seed=5), range(4, 8))
    assert_rows(store, "a", range(4, 8), FIELDS, seed=5)


def big(seed: int) -> dict:
    """4 rows of 20000 tokens: 320 kB of input_ids, a 512 KiB segment."""
    return {"input_lengths": np.full(4, 20000, np.int32), "input_ids": [np.arange(20000, dtype=np.int32) + seed] * 4}


def test_a_full_arena_is_an_error_naming_the_knob_never_an_eviction(tmp_path):
    s = open_store(f"shm://{tmp_path}/s?arena_mb=1&prefault_mb=0")
    try:
        for pid in "abc":
            s.create_partition(pid, "grpo", 4)
        s.put("a", big(1), range(4))
        s.put("b", big(2), range(4))  # a second 512 KiB segment: the arena holds its 1 MiB
        with pytest.raises(StoreFullError, match=r"arena is full.*data_plane\.shm\.arena_mb"):
            s.put("c", big(3), range(4))
        assert sum(s.status("c").rows_written.values()) == 0
        for pid, seed in (("a", 1), ("b", 2)):  # nothing was evicted to make room
            assert s.get(pid, ["input_ids"], [3]).column(0).to_pylist() == [list(range(seed, 20000 + seed))]
        s.drop_partition("a")
        s.put("c", big(3), range(4))  # a drop makes room
        assert s.get("c", ["input_ids"], [0]).column(0).to_pylist() == [list(range(3, 20003))]
    finally:
        s.close()


def test_a_put_takes_a_pooled_segment_of_at_most_4x_or_8_mib(tmp_path):
    s = open_store(f"shm://{tmp_path}/s?prefault_mb=0")
    try:
        s.create_partition("a", "grpo", 8)
        s.put("a", big(1), range(4))  # 512 KiB
        s.drop_partition("a")
        s.storage._arena.prefault(16 << 20)  # and two 8 MiB segments
        s.create_partition("b", "grpo", 8)
        s.put("b", grpo_columns(range(8), FIELDS), range(8))  # ~1 kB: a 64 KiB segment
        took = {e.stat().st_size for e in os.scandir(s.path / "b" / "chunks")}
        assert took == {512 << 10}  # the 512 KiB one (at most 8 MiB is fine), not a new one
        s.create_partition("c", "grpo", 4)
        s.put("c", big(2), range(4))  # 512 KiB asked: an 8 MiB pooled one is within 8 MiB
        assert {e.stat().st_size for e in os.scandir(s.path / "c" / "chunks")} == {8 << 20}
        assert s.storage._pool.add_new(32 << 20)
        for pid, want in (("d", 8 << 20), ("e", 64 << 10)):  # the last 8 MiB one; then never the 32 MiB one
            s.create_partition(pid, "grpo", 8)
            s.put(pid, grpo_columns(range(8), FIELDS), range(8))
            assert {e.stat().st_size for e in os.scandir(s.path / pid / "chunks")} == {want}
        assert s.pool_bytes() == 32 << 20
    finally:
        s.close()


def test_arena_options_travel_in_the_url_and_bad_ones_are_refused(tmp_path):
    s = open_store(f"shm://{tmp_path}/s?arena_mb=64&prefault_mb=1")
    assert s.url == f"shm://{tmp_path}/s?arena_mb=64&prefault_mb=1"
    other = open_store(s.url)
    assert other.storage._arena.limit_bytes == 64 << 20
    other.close()
    s.close()
    with pytest.raises(ConfigError, match="arena_mb=N"):
        open_store(f"shm://{tmp_path}/x?arena=1")
    with pytest.raises(ConfigError, match="arena_mb=-1 must be a non-negative integer"):
        open_store(f"shm://{tmp_path}/y", arena_mb=-1)


def test_a_drop_while_a_put_writes_never_pools_that_segment(store):
    from dataplane_rl.errors import PartitionNotFoundError
    from dataplane_rl.store import chunks

    store.create_partition("a", "grpo", 8)
    store.put("a", grpo_columns(range(4), FIELDS), range(4))
    segment = inodes(store, "a")
    real, dropped = chunks.write_block, []

    def drop_meanwhile(*a, **k):  # the partition is dropped while this put's bytes are being written
        if not dropped:
            dropped.append(1)
            store.drop_partition("a")
        return real(*a, **k)

    chunks.write_block = drop_meanwhile
    try:
        with pytest.raises(PartitionNotFoundError, match="partition a"):
            store.put("a", grpo_columns(range(4, 8), FIELDS), range(4, 8))
    finally:
        chunks.write_block = real
    pooled = {e.inode() for e in os.scandir(store.path / ".pool")}
    assert dropped and not segment & pooled  # deleted, not handed to the next put while written
    store.create_partition("b", "grpo", 4)
    store.put("b", grpo_columns(range(4), FIELDS, seed=9), range(4))
    assert_rows(store, "b", range(4), FIELDS, seed=9)


def test_segment_sizes_double_per_partition_and_fit_a_large_put():
    from dataplane_rl.store.shm.arena import MiB, segment_size

    assert segment_size(1000, 0, 64 * MiB) == 64 << 10  # a small first put: the smallest segment
    assert segment_size(1000, 64 << 10, 64 * MiB) == 128 << 10  # the partition's next one doubles
    assert segment_size(1000, 64 * MiB, 64 * MiB) == 64 * MiB  # ... up to the largest
    assert segment_size(5 * MiB + 1, 0, 64 * MiB) == 8 * MiB  # a power of two that fits
    assert segment_size(100 * MiB + 1, 0, 64 * MiB) == 101 * MiB  # above the largest: its own size, whole MiB
