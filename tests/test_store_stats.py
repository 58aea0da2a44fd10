"""A store's counters and gauges (ColumnStore.stats, `store ls|show`): Prometheus names, every process of a store."""

from __future__ import annotations

import subprocess
import sys

import pytest
from store_workers import grpo_columns

from dataplane_rl.errors import (
    DuplicateWriteError,
    MissingColumnError,
    PartitionNotFoundError,
)
from dataplane_rl.store import open_store

P = "dataplane_store_"
FIELDS = ["input_lengths", "input_ids", "total_reward"]


@pytest.mark.parametrize("url", ["memory://", "shm://"])
def test_counts_puts_gets_and_refusals_by_cause(url):
    s = open_store(url)
    try:
        s.create_partition("a", "grpo", 8)
        s.put("a", grpo_columns(range(4), FIELDS), range(4))
        s.put("a", grpo_columns(range(4, 8), FIELDS), range(4, 8))
        s.get("a", FIELDS, range(8))
        with pytest.raises(DuplicateWriteError):
            s.put("a", grpo_columns([0], ["total_reward"]), [0])
        with pytest.raises(MissingColumnError):
            s.get("a", ["advantages"])
        with pytest.raises(PartitionNotFoundError):
            s.get("nope", FIELDS)
        st = s.stats()
        assert st[P + "puts_total"] == 2 and st[P + "gets_total"] == 1
        stored = s.status("a").total_bytes
        assert st[P + "put_bytes_total"] >= stored and st[P + "get_bytes_total"] >= stored
        assert st[P + "put_seconds_total"] > 0 and st[P + "get_seconds_total"] > 0
        assert st[P + 'refusals_total{cause="duplicate_write"}'] == 1
        assert st[P + 'refusals_total{cause="missing_column"}'] == 1
        assert st[P + 'refusals_total{cause="partition_not_found"}'] == 1
        assert st[P + "partitions"] == 1 and st[P + "cells_used"] == 8 * len(FIELDS)
        assert st[P + "cells_free"] == 8 * (len(s.schema("a").names) - len(FIELDS))
        assert st[P + "used_bytes"] == stored
        assert all(k.startswith(P) for k in st)
    finally:
        s.close()


WRITER = """import sys
from dataplane_rl.store import open_store
sys.path.insert(0, "tests")
from store_workers import grpo_columns
s = open_store(sys.argv[1])
s.put("a", grpo_columns(range(4), ["total_reward"]), range(4))
s.put("a", grpo_columns(range(4, 6), ["total_reward"]), range(4, 6))
s.close()
"""


def test_shm_adds_up_every_process_and_reports_the_arena(tmp_path):
    s = open_store(f"shm://{tmp_path}/s?arena_mb=32&prefault_mb=2")
    try:
        st = s.stats()
        assert st[P + "arena_capacity_bytes"] == 32 << 20 and st[P + "arena_pooled_bytes"] == 2 << 20
        assert st[P + "arena_allocated_bytes"] == 0 and st[P + "arena_free_bytes"] == 32 << 20
        s.create_partition("a", "grpo", 8)
        p = subprocess.run([sys.executable, "-c", WRITER, s.url], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        s.put("a", grpo_columns([6, 7], ["total_reward"]), [6, 7])
        st = s.stats()
        assert st[P + "puts_total"] == 3  # two of the other process, one of this one
        assert st[P + "arena_allocated_bytes"] >= 64 << 10 and st[P + "arena_pooled_bytes"] < 2 << 20
        ls = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", "ls", s.url], capture_output=True,
                            text=True, timeout=120)
        assert ls.returncode == 0, ls.stderr
        assert f"  {P}puts_total 3\n" in ls.stdout and f"  {P}arena_capacity_bytes {32 << 20}\n" in ls.stdout
        show = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", "show", s.url, "a"],
                              capture_output=True, text=True, timeout=120)
        assert show.returncode == 0 and f"  {P}cells_used 8\n" in show.stdout, show.stderr
        s.drop_partition("a")
        assert s.stats()[P + "arena_allocated_bytes"] == 0
    finally:
        s.close()
