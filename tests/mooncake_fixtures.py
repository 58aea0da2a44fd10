"""Session-wide Mooncake cluster and client for tests.

Use from a test module (tests/ is on sys.path under pytest's default import mode):

    from mooncake_fixtures import mooncake_cluster, mooncake_client  # noqa: F401

or register once for the whole suite with `pytest_plugins = ["mooncake_fixtures"]` in the root conftest.

However many modules import these fixtures, they share ONE cluster and ONE client per test session
(a module-level singleton: pytest would otherwise make one session fixture per importing module).
Starting the cluster takes ~1.5 s, and a client's close() ~1 s, hence the sharing.

Without Mooncake the fixtures skip, unless DATAPLANE_RL_REQUIRE_BACKENDS=1 (CI), where they fail.
"""

from __future__ import annotations

import os
import threading

import pytest

from dataplane_rl.errors import StoreUnavailableError

SESSION_HOLDERS = 2
SESSION_SEGMENT_SIZE = 128 << 20  # per holder
SESSION_CLIENT_BUFFER = 16 << 20

_lock = threading.Lock()
_shared: dict[str, object] = {}


def require_mooncake() -> None:
    """Skip (or fail under DATAPLANE_RL_REQUIRE_BACKENDS=1) when Mooncake cannot run here."""
    try:
        from dataplane_rl.store.mooncake.client import find_master_binary, import_mooncake_store

        import_mooncake_store()
        find_master_binary()
    except StoreUnavailableError as e:
        if os.environ.get("DATAPLANE_RL_REQUIRE_BACKENDS") == "1":
            pytest.fail(f"Mooncake backend required (DATAPLANE_RL_REQUIRE_BACKENDS=1) but unavailable: {e}")
        pytest.skip(f"Mooncake unavailable: {e}")


def shared_cluster():
    """The session's MooncakeCluster (started on first use; closed at session end or exit)."""
    require_mooncake()
    from dataplane_rl.store.mooncake.cluster import MooncakeCluster

    with _lock:
        c = _shared.get("cluster")
        if c is None or not c.alive():
            if c is not None:
                c.close()
                _shared.pop("client", None)
            c = MooncakeCluster(num_holders=SESSION_HOLDERS, global_segment_size=SESSION_SEGMENT_SIZE).start()
            _shared["cluster"] = c
        return c


def shared_client():
    """A pure client (contributes no memory) of the session cluster."""
    c = shared_cluster()
    with _lock:
        cl = _shared.get("client")
        if cl is None:
            cl = c.connect(local_buffer_size=SESSION_CLIENT_BUFFER)
            _shared["client"] = cl
        return cl


def _close_shared() -> None:
    with _lock:
        cl = _shared.pop("client", None)
        c = _shared.pop("cluster", None)
    if cl is not None:
        cl.close()
    if c is not None:
        c.close()


@pytest.fixture(scope="session")
def mooncake_cluster():
    c = shared_cluster()
    yield c
    _close_shared()  # idempotent: a second importing module's teardown finds nothing to close


@pytest.fixture(scope="session")
def mooncake_client(mooncake_cluster):
    yield shared_client()


def damage_key(client, key: str, off: int, at: int, lose: bool) -> None:
    """Flip byte `at` of Mooncake object `key` (an upsert replaces, unlike a put), or lose the block at
    `off` with the blocks after it in the object (the object is cut at the block)."""
    import numpy as np

    from dataplane_rl.store.mooncake.client import no_eviction_config

    size = client.get_size(key)
    assert size > 0, f"no object {key}"
    buf = np.zeros(size, dtype=np.uint8)
    ptr = buf.ctypes.data
    assert client.register_buffer(ptr, size) == 0
    try:
        assert client.batch_get_into([key], [ptr], [size]) == [size]
        if lose:
            client.remove(key, True)
            size = off
            if not size:
                return
        else:
            buf[at] ^= 0xFF
        assert client.batch_upsert_from([key], [ptr], [size], no_eviction_config()) == [0]
    finally:
        client.unregister_buffer(ptr)
