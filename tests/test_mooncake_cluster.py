"""MooncakeCluster, connect_client, and the Mooncake behaviour the store relies on.

Each quirk test pins down what THIS Mooncake version does (docs/mooncake_notes.md has the table);
if an upgrade changes one, the test that fails names the assumption that broke.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import signal
import sys
import time
import uuid

import numpy as np
import pytest

from dataplane_rl.errors import StoreUnavailableError
from mooncake_fixtures import mooncake_client, mooncake_cluster, require_mooncake  # noqa: F401

from dataplane_rl.store.mooncake import client as mc  # noqa: E402 - part of the package: an import error is a failure
from dataplane_rl.store.mooncake.cluster import MooncakeCluster  # noqa: E402


def _uid(tag: str) -> str:
    return f"t-{tag}-{uuid.uuid4().hex[:10]}"


class Arena:
    """One registered buffer; slices of it are the zero-copy source/target of batch calls."""

    def __init__(self, client, nbytes: int):
        self.client = client
        self.buf = np.zeros(nbytes, dtype=np.uint8)
        self.base = self.buf.ctypes.data
        assert client.register_buffer(self.base, nbytes) == 0

    def ptr(self, offset: int) -> int:
        return self.base + offset

    def close(self) -> None:
        assert self.client.unregister_buffer(self.base) == 0


@pytest.fixture
def arena(mooncake_client):
    a = Arena(mooncake_client, 4 << 20)
    yield a
    a.close()


@pytest.fixture(scope="module")
def bare_client(mooncake_cluster):
    """A second client, with no local transfer buffer (only zero-copy calls work fully)."""
    c = mooncake_cluster.connect(local_buffer_size=0)
    yield c
    c.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _fill(client, arena: Arena, prefix: str, n: int, size: int, config=None) -> list[int]:
    """Put n objects of `size` bytes one by one; return each put's code."""
    arena.buf[:size] = 7
    codes = []
    for i in range(n):
        args = ([f"{prefix}-{i}"], [arena.ptr(0)], [size])
        codes.append(client.batch_put_from(*args, config)[0] if config is not None else client.batch_put_from(*args)[0])
    return codes


# ---- lifecycle ---------------------------------------------------------------------------------
def test_session_cluster_is_up(mooncake_cluster):
    c = mooncake_cluster
    c.check()
    assert c.alive()
    assert len(c.holders) == 2 and sorted(c.list_segments()) == sorted(h.segment_name for h in c.holders)
    assert mc.master_health(c.admin_address)["status"] == "ok"
    flags = c.master_flags()
    assert "--eviction_high_watermark_ratio=1.0" in flags and "--eviction_ratio=0.0" in flags
    assert f"--rpc_port={c.rpc_port}" in flags and f"--metrics_port={c.rpc_port + 1}" in flags
    assert c.url == f"mooncake://127.0.0.1:{c.rpc_port}"
    assert mc.default_admin_address(c.master_address) == c.admin_address


def _listening(pid: int) -> list[str]:
    """'IP:PORT' of every TCP socket process `pid` listens on, from /proc (no ss or psutil needed)."""
    import ipaddress

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                hexip, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexip)
                # /proc prints the address as 32-bit words in host (little-endian) order
                ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
                if ip.version == 6 and ip.ipv4_mapped:
                    ip = ip.ipv4_mapped
                out.append(f"{ip}:{int(hexport, 16)}")
    return out


def test_local_store_listens_only_on_loopback(mooncake_cluster):
    """A one-machine store says 127.0.0.1 and listens only there: the master by its flags, the holders
    (whose Mooncake listeners bind every interface) through the bind shim."""
    from dataplane_rl.store.mooncake.bind_shim import shim_path

    assert shim_path() is not None, "the bind shim could not be built (no C compiler?): holders listen on all interfaces"
    c = mooncake_cluster
    for pid in c.pids():
        socks = _listening(pid)
        assert len(socks) >= 2, f"pid {pid} listens on {socks}: expected RPC + admin (master) or handshake + data (holder)"
        assert all(s.startswith("127.0.0.1:") for s in socks), f"pid {pid} of the local store listens on {socks}"
    assert all(h.segment_name.startswith("127.0.0.1:") for h in c.holders)


def test_start_and_stop_leaves_no_processes():
    require_mooncake()
    t0 = time.monotonic()
    with MooncakeCluster(num_holders=2, global_segment_size=16 << 20) as c:
        started = time.monotonic() - t0
        pids = c.pids()
        log_dir = c.log_dir
        assert len(pids) == 3 and all(_pid_alive(p) for p in pids)
        assert os.path.isdir(log_dir)
    assert started < 20
    assert not any(_pid_alive(p) for p in pids), "a master or holder outlived close()"
    assert not os.path.exists(log_dir)
    with pytest.raises(StoreUnavailableError, match="closed"):
        c.check()
    c.close()  # idempotent


def test_missing_binary_names_the_fix():
    require_mooncake()
    with pytest.raises(StoreUnavailableError, match=r"mooncake_master binary not found.*mooncake.*libibverbs1"):
        MooncakeCluster(master_binary="/nonexistent/mooncake_master").start()


def test_holder_that_cannot_start_is_reported_with_its_log():
    require_mooncake()
    c = MooncakeCluster(num_holders=1, global_segment_size=16 << 20, protocol="no-such-protocol",
                           env={"MC_STORE_CLIENT_SETUP_RETRIES": "1"}, start_timeout=30)
    with pytest.raises(StoreUnavailableError, match=r"(?s)holder 0 .*exited with code 2.*unsupported_protocol"):
        c.start()
    assert not any(_pid_alive(p) for p in c.pids())


def test_connect_client_to_nothing_fails_fast():
    require_mooncake()
    port = mc.free_port_pair()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError, match="not accepting connections"):
        mc.connect_client(f"127.0.0.1:{port}", 0, connect_timeout=1.0)
    assert time.monotonic() - t0 < 5  # Mooncake's own setup() would block ~90 s here


# ---- data path ---------------------------------------------------------------------------------
def test_zero_copy_roundtrip(mooncake_client, arena):
    client = mooncake_client
    rng = np.random.default_rng(0)
    sizes = [1, 100, 4096, 65536, 123457, 1 << 20, 7, 333, 2 << 10]
    keys = [_uid(f"rt{i}") for i in range(len(sizes))]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(int)
    total = int(sum(sizes))
    arena.buf[:total] = rng.integers(0, 256, total, dtype=np.uint8)
    src = arena.buf[:total].copy()
    assert client.batch_put_from(keys, [arena.ptr(o) for o in offsets], sizes,
                                 mc.no_eviction_config()) == [0] * len(keys)
    arena.buf[:total] = 0
    dst = 2 << 20  # read into the second half of the arena
    got = client.batch_get_into(keys, [arena.ptr(dst + o) for o in offsets], sizes)
    assert got == sizes  # success = the object's size in bytes
    assert np.array_equal(arena.buf[dst:dst + total], src)
    assert [client.get_size(k) for k in keys] == sizes
    assert client.batch_is_exist(keys) == [1] * len(keys)
    assert client.batch_remove(keys, force=True) == [0] * len(keys)


def test_quirk_thousands_of_keys_in_one_batch(mooncake_client, arena):
    """512 samples x 9 columns as one key per cell: above ~2100 keys per call Mooncake's default TCP
    admission limit stalls the call for 60 s and wedges the client; connect_client raises the limit."""
    client, n, size = mooncake_client, 4608, 400
    assert int(os.environ.get("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "0")) > n  # set by connect_client
    keys = [_uid("many") for _ in range(n)]
    arena.buf[:n * size] = np.arange(n * size, dtype=np.uint64).astype(np.uint8)
    t0 = time.monotonic()
    assert client.batch_put_from(keys, [arena.ptr(i * size) for i in range(n)], [size] * n) == [0] * n
    dst = 2 << 20
    assert client.batch_get_into(keys, [arena.ptr(dst + i * size) for i in range(n)], [size] * n) == [size] * n
    assert time.monotonic() - t0 < 30
    assert np.array_equal(arena.buf[dst:dst + n * size], arena.buf[:n * size])
    assert client.batch_remove(keys, force=True) == [0] * n


def test_quirk_put_of_existing_key_returns_ok_and_keeps_old_value(mooncake_client, arena):
    client, key = mooncake_client, _uid("dup")
    arena.buf[:8] = 1
    arena.buf[8:16] = 2
    assert client.batch_put_from([key], [arena.ptr(0)], [8]) == [0]
    assert client.batch_put_from([key], [arena.ptr(8)], [8]) == [0]  # OK ... but nothing was written
    assert client.put(key, b"\x03" * 8) == 0
    assert client.batch_put_from([key], [arena.ptr(8)], [4]) == [0]  # even with another size
    assert client.get(key) == b"\x01" * 8 and client.get_size(key) == 8
    # upsert is the call that replaces
    assert client.upsert_from(key, arena.ptr(8), 8) == 0
    assert client.get(key) == b"\x02" * 8
    client.remove(key, True)


def test_quirk_put_session_is_an_atomic_put_if_absent(mooncake_client, bare_client, arena):
    client, other = mooncake_client, bare_client
    existing, fresh = _uid("psx"), _uid("psn")
    arena.buf[:100] = np.arange(100, dtype=np.uint8)
    assert client.batch_put_from([existing], [arena.ptr(0)], [100]) == [0]
    # reserve: an existing (or already reserved) key answers OBJECT_ALREADY_EXISTS
    assert client.batch_put_session_start([existing, fresh], [100, 100]) == [mc.OBJECT_ALREADY_EXISTS, 0]
    assert other.batch_put_session_start([fresh], [100]) == [mc.OBJECT_ALREADY_EXISTS]  # another client
    assert client.batch_put_session_start([fresh], [100]) == [mc.INVALID_PARAMS]  # its own open session
    # a plain put onto the reserved key says OK and writes nothing
    assert other.batch_put_from([fresh], [arena.ptr(50)], [100]) == [0]
    # fill the reservation from (several) registered buffers, then publish
    assert client.batch_put_from_multi_buffer_ranges([fresh], [[arena.ptr(0), arena.ptr(60)]], [[60, 40]],
                                                     [[0, 60]]) == [100]
    assert client.batch_get_into([fresh], [arena.ptr(1000)], [100]) == [-703]  # REPLICA_IS_NOT_READY
    assert client.is_exist(fresh) == 0
    assert client.batch_put_session_end([fresh]) == [0]
    assert client.batch_get_into([fresh], [arena.ptr(1000)], [100]) == [100]
    assert np.array_equal(arena.buf[1000:1100], np.arange(100, dtype=np.uint8))
    # a revoked reservation leaves nothing behind
    gone = _uid("psr")
    assert client.batch_put_session_start([gone], [10]) == [0]
    assert client.batch_put_session_revoke([gone]) == [0]
    assert client.is_exist(gone) == 0
    client.batch_remove([existing, fresh], force=True)


def test_quirk_missing_key(mooncake_client, arena):
    client, key = mooncake_client, _uid("missing")
    assert client.get(key) == b""  # indistinguishable from an empty value
    assert client.batch_get_into([key], [arena.ptr(0)], [16]) == [mc.OBJECT_NOT_FOUND]
    assert client.get_size(key) == mc.OBJECT_NOT_FOUND
    assert client.is_exist(key) == 0 and client.batch_is_exist([key]) == [0]
    assert client.remove(key) == mc.OBJECT_NOT_FOUND
    assert mc.error_name(-704) == "OBJECT_NOT_FOUND(-704)"


def test_quirk_small_target_buffer_and_empty_object(mooncake_client, arena):
    client, key = mooncake_client, _uid("small")
    assert client.batch_put_from([key], [arena.ptr(0)], [1000]) == [0]
    assert client.batch_get_into([key], [arena.ptr(0)], [999]) == [mc.INVALID_PARAMS]
    assert client.batch_get_into([key], [arena.ptr(0)], [4000]) == [1000]  # a bigger buffer is fine
    assert client.batch_put_from([_uid("empty")], [arena.ptr(0)], [0]) == [mc.INVALID_PARAMS]
    client.remove(key, True)


def test_quirk_remove_within_read_lease_needs_force(mooncake_client, arena):
    client, key = mooncake_client, _uid("lease")
    assert client.batch_put_from([key], [arena.ptr(0)], [64]) == [0]
    assert client.batch_get_into([key], [arena.ptr(64)], [64]) == [64]  # a read grants a lease
    assert client.remove(key) == mc.OBJECT_HAS_LEASE
    assert client.remove(key, True) == 0
    assert client.is_exist(key) == 0


def test_quirk_copying_get_needs_local_buffer(mooncake_client, bare_client):
    key = _uid("nolocal")
    assert mooncake_client.put(key, b"payload") == 0
    assert bare_client.is_exist(key) == 1
    assert bare_client.get(key) == b""  # exists, but the copying get has no buffer to land in
    out = np.zeros(16, dtype=np.uint8)  # zero-copy works without any local buffer, even unregistered
    assert bare_client.batch_get_into([key], [out.ctypes.data], [16]) == [7]
    assert out[:7].tobytes() == b"payload"
    mooncake_client.remove(key, True)


def test_keys_can_be_listed_through_the_admin_endpoint(mooncake_cluster, mooncake_client, arena):
    prefix = _uid("list") + "/"
    keys = [f"{prefix}{i}" for i in range(5)]
    assert mooncake_client.batch_put_from(keys, [arena.ptr(0)] * 5, [10] * 5) == [0] * 5
    assert sorted(mooncake_cluster.list_keys(prefix)) == keys
    assert mooncake_client.remove_by_regex("^" + prefix.replace("-", r"\-") + ".*", True) == 5
    assert mooncake_cluster.list_keys(prefix) == []


# ---- full store --------------------------------------------------------------------------------
def test_quirk_full_segment_fails_puts_instead_of_evicting():
    require_mooncake()
    with MooncakeCluster(num_holders=1, global_segment_size=16 << 20) as c:
        client = c.connect(local_buffer_size=0)
        try:
            a = Arena(client, 2 << 20)
            codes = _fill(client, a, "full", 12, 2 << 20)
            ok = [i for i, r in enumerate(codes) if r == 0]
            assert set(codes) == {0, mc.NO_AVAILABLE_HANDLE}
            assert ok == list(range(len(ok))) and 6 <= len(ok) <= 8  # the first ones fit, the rest fail
            time.sleep(0.5)
            assert client.batch_is_exist([f"full-{i}" for i in ok]) == [1] * len(ok)  # nothing evicted
            assert client.remove("full-0", True) == 0  # freeing space makes room again
            assert client.batch_put_from(["again"], [a.ptr(0)], [2 << 20]) == [0]
        finally:
            client.close()


def test_quirk_default_master_evicts_silently_but_not_hard_pinned_objects():
    require_mooncake()
    with MooncakeCluster(num_holders=1, global_segment_size=16 << 20, eviction=True) as c:
        assert "--eviction_ratio=0.0" not in c.master_flags()
        client = c.connect(local_buffer_size=0)
        try:
            a = Arena(client, 2 << 20)
            pinned = _fill(client, a, "pin", 3, 2 << 20, mc.no_eviction_config())
            assert pinned == [0, 0, 0]
            codes = _fill(client, a, "loose", 20, 2 << 20)
            time.sleep(0.5)
            present = client.batch_is_exist([f"loose-{i}" for i in range(20)])
            accepted = sum(1 for r in codes if r == 0)
            assert accepted > sum(present), "expected puts that said OK but whose objects were evicted"
            assert client.batch_is_exist(["pin-0", "pin-1", "pin-2"]) == [1, 1, 1]
        finally:
            client.close()


# ---- dead processes ----------------------------------------------------------------------------
def test_killed_holder_is_detected_and_its_keys_are_lost():
    require_mooncake()
    with MooncakeCluster(num_holders=3, global_segment_size=16 << 20, client_ttl_s=2) as c:
        client = c.connect(local_buffer_size=0)
        try:
            a = Arena(client, 1 << 20)
            a.buf[:4096] = 9
            keys = {}
            for h in c.holders:  # 4 keys on each holder
                keys[h.index] = [f"h{h.index}-{i}" for i in range(4)]
                cfg = mc.no_eviction_config(preferred_segment=h.segment_name)
                assert client.batch_put_from(keys[h.index], [a.ptr(0)] * 4, [1000] * 4, cfg) == [0] * 4

            def read(idx):
                return client.batch_get_into(keys[idx], [a.ptr(8192 + 1000 * i) for i in range(4)], [1000] * 4)

            assert read(0) == read(1) == read(2) == [1000] * 4
            c.kill_holder(0, signal.SIGKILL)  # a crash: no unmount
            c.kill_holder(1, signal.SIGTERM)  # graceful: the holder unmounts its segment
            with pytest.raises(StoreUnavailableError, match=r"(?s)holder 0 .*SIGKILL|holder 0 .*code -9"):
                c.check()
            assert not c.alive()
            # graceful: gone at once
            assert read(1) == [mc.OBJECT_NOT_FOUND] * 4
            # crash: reads fail with TRANSFER_FAIL (slowly) until the master drops the segment after client_ttl
            t0 = time.monotonic()
            first = read(0)
            assert set(first) <= {mc.TRANSFER_FAIL, mc.OBJECT_NOT_FOUND}
            while read(0) != [mc.OBJECT_NOT_FOUND] * 4:
                assert time.monotonic() - t0 < 30, "keys of a SIGKILLed holder never disappeared"
                time.sleep(0.2)
            assert client.batch_is_exist(keys[0]) == [0] * 4
            assert read(2) == [1000] * 4  # the surviving holder is untouched
            assert c.holders[2].segment_name in c.list_segments()
            assert c.holders[0].segment_name not in c.list_segments()
        finally:
            client.close()


def test_dead_master_is_detected():
    require_mooncake()
    with MooncakeCluster(num_holders=1, global_segment_size=16 << 20) as c:
        c.master.kill()
        c.master.wait(5)
        with pytest.raises(StoreUnavailableError, match="mooncake_master .* exited"):
            c.check()


# ---- the raw reference benchmark ---------------------------------------------------------------
def test_raw_mooncake_benchmark_runs(mooncake_cluster):
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "raw_mooncake.py"
    spec = importlib.util.spec_from_file_location("raw_mooncake", path)
    raw = importlib.util.module_from_spec(spec)
    sys.modules["raw_mooncake"] = raw  # spawned workers import it by this name
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(raw)
        bufs = raw.synthetic_buffers(32, layout="per-column")
        res = raw.raw_mooncake_roundtrip(mooncake_cluster, [memoryview(b) for b in bufs], repeats=2, readers=2,
                                         shard="bytes", warmup=0, touching=True)  # as bench store's reference
    finally:
        sys.path.remove(str(path.parent))
    assert res["bytes"] == 32 * sum(raw.DEFAULT_COLUMN_BYTES) and res["keys"] == 9 and res["readers"] == 2
    for k in ("write_gbps", "read_gbps", "e2e_gbps"):
        assert 0 < res[k]["min"] <= res[k]["median"] <= res[k]["max"]
    assert len(res["read_s"]) == 2 and len(res["per_reader_read_s"][0]) == 2
    assert mooncake_cluster.list_keys("raw-mooncake-") == []  # each repeat cleans up after itself


def test_raw_mooncake_floor_copies_and_checksums_its_pieces(mooncake_cluster):
    """The Mooncake floor (raw with the copies and checksums): each writer copies a key's pieces into its arena
    inside its timed put, so the readers read the pieces' bytes. Pieces of other bytes than the buffers they
    stand for are what the readers find (their digests differ from the buffers'), and pieces that do not add
    up to a key are refused before any process starts."""
    from dataplane_rl.bench.raw_mooncake import raw_mooncake_roundtrip

    rng = np.random.default_rng(0)
    pieces = [[rng.integers(0, 256, n, dtype=np.uint8) for n in (100, 4000, 12)] for _ in range(6)]
    keys = [np.concatenate(p) for p in pieces]
    res = raw_mooncake_roundtrip(mooncake_cluster, keys, repeats=2, readers=2, writers=2, group_of=range(6),
                                 warmup=0, touching=True, pieces=pieces)
    assert res["keys"] == 6 and 0 < res["e2e_gbps"]["min"] <= res["e2e_gbps"]["max"]
    assert [p["exitcode"] for p in res["processes"]] == [0, 0, 0, 0]
    others = [[255 - b for b in p] for p in pieces]  # same sizes, other bytes: the readers see these
    with pytest.raises(RuntimeError, match="read different bytes than were written"):
        raw_mooncake_roundtrip(mooncake_cluster, keys, repeats=1, readers=2, writers=2, group_of=range(6), warmup=0,
                               pieces=others)
    with pytest.raises(ValueError, match="a key's buffers must hold exactly its bytes"):
        raw_mooncake_roundtrip(mooncake_cluster, keys, pieces=[p[:2] for p in pieces])
    with pytest.raises(ValueError, match="shard='keys'"):
        raw_mooncake_roundtrip(mooncake_cluster, keys, shard="bytes", pieces=pieces)
    assert mooncake_cluster.list_keys("raw-mooncake-") == []
