"""Fixtures shared by the suite: one Ray session, and a column store of every backend.

The store contract suite is parametrised over BACKENDS through the `store` fixture. A backend that
cannot start here (Mooncake not installed, its module not built yet) skips, unless
DATAPLANE_RL_REQUIRE_BACKENDS=1 (what CI sets), where it fails: see `backend_unavailable`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import uuid

import pytest

from dataplane_rl.errors import DataPlaneError

# The suite's workers (three in CI) share CI's 2 cores with the runs they start, whose torch threads (OpenMP,
# libgomp) spin-wait at every barrier, 300,000 spins by default, while other processes want the cores. Measured on the
# 2-core VM, the default run (`dataplane-rl train`) beside 2 busy loops: 545 s with the default, 126 s with
# 10,000 spins; idle 62-65 s against 70-74 s (README, "A busy machine"). Set before torch is imported in this
# process; the runs and Ray workers the tests start inherit it. A value set by the caller wins.
os.environ.setdefault("GOMP_SPINCOUNT", "10000")
# As many workers as cores or more (CI: 3 on 2) keep every core busy with runs already, so each process of a run
# gets one torch thread (the runs read OMP_NUM_THREADS: driver/preflight.py torch_threads): two threads a process on a
# machine this busy wait at every barrier for a thread the other worker's run preempted (the real model's test
# took 182 s beside the other worker, 81 s alone).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) >= (os.cpu_count() or 1):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

BACKENDS = ("memory", "shm", "ray", "mooncake")

# Where backends differ. cross_process: another process can open the store by its url and see the data.
CAPABILITIES: dict[str, dict[str, bool]] = {
    "memory": {"cross_process": False},
    "shm": {"cross_process": True},
    "ray": {"cross_process": True},
    "mooncake": {"cross_process": True},
}


# CI runs the suite on three pytest-xdist workers that take whole files in collection order (.ci/run): the
# longest files go first, so the workers finish together instead of one idling while the other runs a long file
# that started last. Measured in CI's --durations (the default runs, kills and resumes, the README's commands).
LONGEST_FIRST = ("test_train_e2e.py", "test_real_model.py", "test_checkpoint.py", "test_async_grpo.py", "test_readme.py",
                 "test_resume.py", "test_multihost.py", "test_bench_cli.py", "test_preempt.py", "test_faults.py",
                 "test_replay.py", "test_multiturn_e2e.py", "test_private_run.py", "test_packing_e2e.py", "test_cli.py")


def pytest_collection_modifyitems(config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def backend_unavailable(backend: str, reason: str) -> None:
    """Skip the test for a backend that cannot start here, or fail it when CI requires every backend."""
    if os.environ.get("DATAPLANE_RL_REQUIRE_BACKENDS") == "1":
        pytest.fail(f"{backend} backend required (DATAPLANE_RL_REQUIRE_BACKENDS=1) but unavailable: {reason}",
                    pytrace=False)
    pytest.skip(f"{backend} backend unavailable: {reason}")


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (starting one costs seconds); reused if already running."""
    import ray

    started = not ray.is_initialized()
    if started:
        # address="local": never join a cluster that /tmp/ray/ray_current_cluster names (maybe dead)
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level=logging.WARNING)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_store_url(ray_session) -> str:
    """A catalog of its own for this session, so tests never see another run's partitions."""
    from dataplane_rl.store import open_store

    try:
        store = open_store(f"ray:///pytest-{uuid.uuid4().hex[:8]}")
    except (DataPlaneError, ImportError) as e:
        backend_unavailable("ray", f"{type(e).__name__}: {e}")
    yield store.url
    store.close()


@pytest.fixture(scope="session")
def mooncake_store():
    """One Mooncake store (its own master and holders) for the session: a start costs seconds."""
    from dataplane_rl.store import open_store

    try:
        store = open_store("mooncake://")
    except (DataPlaneError, ImportError) as e:  # ImportError: dataplane_rl.store.mooncake not there yet
        backend_unavailable("mooncake", f"{type(e).__name__}: {e}")
    yield store
    store.close()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def caps(backend) -> dict[str, bool]:
    return CAPABILITIES[backend]


@pytest.fixture
def store(backend, request):
    """An empty store of `backend`. Local ones are made per test; shared ones are emptied after it."""
    from dataplane_rl.store import MemoryStore, open_store

    shared = None
    if backend == "memory":
        s = MemoryStore()
    elif backend == "shm":
        s = open_store("shm://")
    elif backend == "ray":
        s = open_store(request.getfixturevalue("ray_store_url"))
        shared = s
    else:
        s = shared = request.getfixturevalue("mooncake_store")
    yield s
    if shared is not None and not shared._closed:
        for pid in shared.list_partitions():
            shared.drop_partition(pid)
    if backend != "mooncake":
        s.close()


@pytest.fixture
def store_url(store) -> str:
    return store.url


@pytest.fixture(scope="session")
def store_pool():
    """Three spawned worker processes for cross-process store tests (their Ray/Mooncake clients start once).

    concurrent.futures, not multiprocessing.Pool: a worker that dies fails its job at once (BrokenProcessPool)
    instead of leaving it to time out, and the teardown cannot hang on a queue lock a dead worker held (Pool's
    terminate can)."""
    from concurrent.futures import ProcessPoolExecutor

    pool = ProcessPoolExecutor(3, mp_context=mp.get_context("spawn"))
    yield pool
    # workers exit normally (Ray's exit hooks run); one that hangs is killed by its PID
    procs = list((pool._processes or {}).values())
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join(10)
