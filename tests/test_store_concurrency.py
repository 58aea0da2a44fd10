"""The column-store contract, continued: readiness (ready/wait) and concurrent writers and readers, on
every backend; across processes on the backends another process can open (CAPABILITIES in conftest.py),
so no test is skipped for the one that cannot (memory://, private to its process).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from dataplane_rl.errors import (
    AlignmentError,
    MissingColumnError,
    PartitionNotFoundError,
    SchemaError,
    StoreTimeoutError,
)
from store_workers import ROLLOUT_FIELDS, as_lists, big_block, check, grpo_columns, put_blocks, race, wait_then_check, write
from test_store_contract import CROSS_PROCESS, N, assert_rows, part  # noqa: F401 - part is a fixture


# ---- readiness -----------------------------------------------------------------------------------
def test_ready_names_rows_with_every_field_written(store, part):
    empty = store.ready(part, ["total_reward"])
    assert empty.dtype == np.int64 and empty.tolist() == []
    store.put(part, grpo_columns([7, 2, 5], ["total_reward", "group_id"]), [7, 2, 5])
    store.put(part, grpo_columns([1, 2], ["advantages"]), [1, 2])
    got = store.ready(part, ["total_reward", "group_id"])
    assert got.dtype == np.int64 and got.tolist() == [2, 5, 7]  # sorted, not in write order
    assert store.ready(part, "total_reward").tolist() == [2, 5, 7]
    assert store.ready(part, ["total_reward", "advantages"]).tolist() == [2]  # every field, not any
    assert store.ready(part, ["prev_logprobs"]).tolist() == []
    with pytest.raises(SchemaError, match="no column 'nope'"):
        store.ready(part, ["nope"])
    with pytest.raises(SchemaError, match="non-empty list"):
        store.ready(part, [])
    with pytest.raises(PartitionNotFoundError, match="partition nope"):
        store.ready("nope", ["total_reward"])


def test_wait_returns_ready_rows_or_names_what_is_missing(store, part):
    store.put(part, grpo_columns(range(4), ["total_reward", "group_id"]), range(4))
    got = store.wait(part, ["total_reward", "group_id"], [3, 0, 1], timeout=5)
    assert got.dtype == np.int64 and got.tolist() == [3, 0, 1]  # the waited rows, as asked
    with pytest.raises(StoreTimeoutError, match=rf"partition {part}: waited 0.05 s .*total_reward: rows 4-5; "
                                                r"advantages: rows 0,2,4-5"):
        store.wait(part, ["total_reward", "advantages"], [0, 2, 4, 5], timeout=0.05)
    with pytest.raises(PartitionNotFoundError, match="partition nope"):
        store.wait("nope", ["total_reward"], timeout=5)
    with pytest.raises(AlignmentError, match="out of range"):
        store.wait(part, ["total_reward"], [N], timeout=5)
    assert issubclass(StoreTimeoutError, TimeoutError)


def test_wait_sees_a_put_made_while_it_waits(store, part):
    """A thread of this process writes while the caller waits: wait returns once the put commits."""
    import threading

    rows = list(range(6))
    writer = threading.Thread(target=lambda: [store.put(part, grpo_columns([r], ["total_reward"]), [r]) for r in rows])
    writer.start()
    try:
        assert store.wait(part, "total_reward", rows, timeout=60).tolist() == rows
    finally:
        writer.join(60)
    assert not writer.is_alive()
    assert_rows(store, part, rows, ["total_reward"])


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_reader_in_another_process_waits_while_this_one_writes(store, part, store_pool):
    fields = ["input_lengths", "input_ids", "total_reward"]
    job = store_pool.submit(wait_then_check, store.url, part, range(N), fields, 120.0)
    for lo in range(0, N, 3):  # four puts; the reader can only finish after the last
        store.put(part, grpo_columns(range(lo, lo + 3), fields), range(lo, lo + 3))
    assert job.result(timeout=180) == list(range(N))


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_waiting_here_while_another_process_writes(store, part, store_pool):
    job = store_pool.submit(write, store.url, part, range(N), ["total_reward", "group_id"], 0, 4)
    assert store.wait(part, ["total_reward", "group_id"], timeout=120).tolist() == list(range(N))
    job.result(timeout=60)  # the writer finished cleanly too
    assert_rows(store, part, range(N), ["total_reward", "group_id"])


# ---- across processes ----------------------------------------------------------------------------
@pytest.fixture
def shared(store):
    return store


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_one_writer_two_readers(shared, store_pool):
    shared.create_partition("p", "grpo", 40)
    store_pool.submit(write, shared.url, "p", range(40), ROLLOUT_FIELDS, 0, 4).result(timeout=120)
    shared.put("p", grpo_columns(range(40), ["advantages", "sample_mask"]), range(40))
    fields = ["input_ids", "generation_logprobs", "advantages", "prompt_text"]
    jobs = [store_pool.submit(check, shared.url, "p", rows, fields) for rows in (range(40), range(39, -1, -3))]
    assert [j.result(timeout=120) for j in jobs] == [120, 42]


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_concurrent_writers_of_disjoint_rows(shared, store_pool):
    shared.create_partition("p", "grpo", 64)
    shared.put("p", grpo_columns(range(64), ["input_lengths"]), range(64))
    jobs = [store_pool.submit(write, shared.url, "p", range(i, 64, 2), ["input_ids", "total_reward"], 0, 8)
            for i in (0, 1)]
    for j in jobs:
        j.result(timeout=120)
    assert_rows(shared, "p", range(64), ["input_ids", "total_reward", "input_lengths"])


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_racing_writers_of_the_same_cells(shared, store_pool):
    pids = [f"race-{i}" for i in range(8)]
    for pid in pids:
        shared.create_partition(pid, "grpo", 16)
    jobs = [store_pool.submit(race, shared.url, pids, range(16), seed) for seed in (1, 2)]
    a, b = (j.result(timeout=120) for j in jobs)
    for pid, ra, rb in zip(pids, a, b):
        assert sorted([ra, rb]) == ["dup", "ok"], (pid, ra, rb)
        winner = 1 if ra == "ok" else 2
        assert_rows(shared, pid, range(16), ["input_lengths", "total_reward"], seed=winner)


def kill_when(proc, ready, pause_s: float = 0.0, spin_s: float = 0.0) -> None:
    """SIGKILL the writer `proc` once `ready()` (checked every `pause_s`, or spinning without a pause; then
    `spin_s` more of spinning), waiting at most 120 s and only while it is alive; reap it."""
    try:
        deadline = time.monotonic() + 120
        while not ready():
            assert proc.is_alive(), f"the writer died on its own (exit code {proc.exitcode})"
            assert time.monotonic() < deadline, "the writer made no progress in 120 s"
            if pause_s:
                time.sleep(pause_s)
        until = time.perf_counter() + spin_s
        while time.perf_counter() < until:
            pass
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(60)
    finally:
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == -signal.SIGKILL


@pytest.mark.parametrize("backend", CROSS_PROCESS)
def test_writer_killed_mid_put_leaves_nothing_partial(shared, backend):
    """kill -9 a real writer while its put is in flight: each put is visible whole or not at all."""
    rows, per_row, blocks = 4, 200_000, 64  # ~7 MB a put: the writer spends nearly all its time inside put
    shared.create_partition("p", "grpo", rows * blocks)
    ctx = mp.get_context("spawn")
    started, done = ctx.Value("q", -1, lock=False), ctx.Value("q", -1, lock=False)
    proc = ctx.Process(target=put_blocks, args=(shared.url, "p", rows, per_row, started, done))
    proc.start()
    # two whole puts, then kill the one in flight
    kill_when(proc, lambda: done.value >= 1 and started.value > done.value, pause_s=0.005)
    last_started, last_done = started.value, done.value
    assert last_started == last_done + 1, "the kill landed between puts, not inside one"
    fields = ["input_lengths", "input_ids", "token_mask", "generation_logprobs"]
    status = shared.status("p")
    for f in fields:  # whole puts only: the same rows in every column of the put
        assert status.rows_written[f] % rows == 0 and status.rows_written[f] == status.rows_written["input_ids"], f
    whole = status.rows_written["input_ids"] // rows
    assert whole in (last_done + 1, last_started + 1), (whole, last_started, last_done)
    for block in range(whole):
        want = big_block(block, rows, per_row)
        got = shared.get("p", fields, range(block * rows, (block + 1) * rows))
        assert got.column("input_ids").to_pylist() == as_lists(want["input_ids"]), block
    rest = range(whole * rows, rows * blocks)
    with pytest.raises(MissingColumnError):
        shared.get("p", ["input_ids"], rest)
    shared.put("p", grpo_columns(rest, ROLLOUT_FIELDS), rest)  # the killed put's cells are still free
    assert_rows(shared, "p", rest, ROLLOUT_FIELDS)


def test_writer_killed_mid_commit_is_never_seen_half(tmp_path):
    """kill -9 a real shm writer at random points inside its commits (claims set, record written, end moved)
    while two reader processes poll: no reader ever sees part of a put, the partition stays readable, the
    dead writer's last put is all there or all absent, and putting its groups again succeeds for the absent
    ones and is refused (write-once) for the rest, whatever claims the dead writer left behind."""
    import random

    from dataplane_rl.errors import DuplicateWriteError
    from dataplane_rl.store import open_store
    from store_workers import commit_loop, poll_whole_groups

    store = open_store(f"shm://{tmp_path}/s")
    group, groups, fields = 2, 400, ["input_lengths", "input_ids", "total_reward"]
    pids = [f"k-{i}" for i in range(30)]
    ctx = mp.get_context("spawn")
    stop, out = ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=poll_whole_groups, args=(store.url, pids, group, fields, stop, out))
               for _ in range(2)]
    rng = random.Random(47)
    inside = 0
    try:
        for r in readers:
            r.start()
        for pid in pids:
            store.create_partition(pid, "grpo", group * groups)
            in_commit, done = ctx.Value("i", 0, lock=False), ctx.Value("i", 0, lock=False)
            proc = ctx.Process(target=commit_loop, args=(store.url, pid, group, fields, in_commit, done))
            proc.start()
            want = rng.randint(3, 60)  # some whole puts first, then a commit at random
            # no sleep while it waits: the kill must land inside a commit, at a random point of it
            kill_when(proc, lambda: done.value >= want and in_commit.value, spin_s=rng.uniform(0, 100e-6))
            inside += in_commit.value  # still 1: it died inside the commit
            committed = done.value
            ready = store.ready(pid, fields)
            assert all(store.ready(pid, f).tolist() == ready.tolist() for f in fields)
            whole = ready.size // group
            assert ready.tolist() == list(range(whole * group)) and whole in (committed, committed + 1), \
                (pid, committed, ready.tolist())
            assert_rows(store, pid, range(whole * group), fields)
            for g in range(max(0, whole - 2), min(groups, whole + 2)):  # the dead writer's last puts, and the next
                rows = range(g * group, (g + 1) * group)
                if g < whole:
                    with pytest.raises(DuplicateWriteError, match=f"partition {pid} column"):
                        store.put(pid, grpo_columns(rows, fields), rows)
                else:
                    store.put(pid, grpo_columns(rows, fields), rows)
                assert_rows(store, pid, rows, fields)
            if inside >= 3:
                break
        stop.set()
        looks = [out.get(timeout=120) for _ in readers]
        assert all(isinstance(n, int) and n > 0 for n in looks), looks
    finally:
        stop.set()
        for r in readers:
            r.join(60)
            if r.is_alive():
                r.kill()
        store.close()
    print(f"kills inside a commit: {inside} of {pids.index(pid) + 1}")
    assert inside >= 1, "no kill landed inside a commit"
