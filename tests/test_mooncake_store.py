"""Faults specific to the mooncake:// store: a full store, a dead holder, other processes, shutdown, the CLI.

The contract every backend shares is in test_store_contract.py. Tests here that break a cluster (fill
it, kill a holder) start a small one of their own, so the session's store (conftest `mooncake_store`)
survives; starting and closing a cluster costs a few seconds each.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from dataplane_rl.errors import ConfigError, PartitionNotFoundError, StoreUnavailableError
from dataplane_rl.store import open_store
from mooncake_fixtures import require_mooncake
from store_workers import ROLLOUT_FIELDS, as_lists, grpo_columns


@pytest.fixture
def session_store(mooncake_store):
    """The session's Mooncake store, emptied after the test (contract tests expect it empty)."""
    yield mooncake_store
    for pid in mooncake_store.list_partitions():
        mooncake_store.drop_partition(pid)


def small_store(**config):
    """A store with a cluster of its own: 16 MiB holders unless told otherwise."""
    require_mooncake()
    from dataplane_rl.config import MooncakeConfig
    from dataplane_rl.store.mooncake import MooncakeStore

    config.setdefault("global_segment_size_mb", 16)
    config.setdefault("local_buffer_size_mb", 16)
    return MooncakeStore.from_url("", config=MooncakeConfig(**config))


def big_tokens(rows, tokens_per_row: int) -> dict:
    lengths = np.full(len(rows), tokens_per_row, dtype=np.int32)
    return {"input_lengths": lengths, "input_ids": [np.arange(tokens_per_row, dtype=np.int32) + r for r in rows]}


# ---- store full ----------------------------------------------------------------------------------
def test_full_store_is_an_error_and_changes_nothing():
    store = small_store(num_holders=1)  # 16 MiB in all
    try:
        store.create_partition("p", "grpo", 64)
        store.put("p", grpo_columns(range(8), ["input_lengths", "input_ids"]), range(8))
        before = store.status("p")
        keys_before = sorted(store.cluster.list_keys("dprl/p/"))
        rows = range(8, 64)
        with pytest.raises(StoreUnavailableError, match=r"(?s)partition p put rows .*mooncake store full .*"
                                                        r"raise data_plane\.mooncake\.global_segment_size_mb or num_holders"):
            store.put("p", big_tokens(rows, 100_000), rows)  # 22 MB of tokens
        assert store.status("p") == before
        assert sorted(store.cluster.list_keys("dprl/p/")) == keys_before  # what the put stored was removed
        store.put("p", grpo_columns(rows, ["input_lengths", "input_ids"]), rows)  # a put that fits still works
        assert store.status("p").rows_written["input_ids"] == 64
        # fill it up with committed data: dropping still frees the memory
        store.create_partition("q", "grpo", 64)
        with pytest.raises(StoreUnavailableError, match="mooncake store full"):
            for i in range(64):
                store.put("q", big_tokens([i], 1 << 20), [i])  # 4 MiB a put
        store.drop_partition("q")
        store.create_partition("q", "grpo", 4)
        store.put("q", big_tokens(range(2), 1 << 20), range(2))
        assert store.get("q", ["input_ids"], [1]).column(0)[0].values[7].as_py() == 8
    finally:
        store.close()


# ---- dead holder ---------------------------------------------------------------------------------
def test_killed_holder_is_a_clear_error():
    store = small_store(num_holders=2)
    client = None
    try:
        store.create_partition("p", "grpo", 64)
        for lo in range(0, 64, 4):  # a put is one object: 16 of them, so some surely live on the holder we kill
            store.put("p", big_tokens(range(lo, lo + 4), 256), range(lo, lo + 4))
        client = open_store(store.url)  # a pure client: it cannot poll the holder processes
        assert client.cluster is None and client.get("p", ["input_ids"]).num_rows == 64
        objects = {r.key.rpartition("@")[0] for r in store.storage.snapshot("p").refs}  # block keys are <object>@<offset>
        holders = {store.storage._client.get_replica_desc(k)[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
                   for k in objects}
        assert len(holders) == 2, "Mooncake placed all 16 puts on one holder (odds 1 in 32768)"
        store.cluster.kill_holder(0, signal.SIGKILL)
        # the owning store polls its processes: every operation names the dead holder at once
        with pytest.raises(StoreUnavailableError, match=r"(?s)partition p: Mooncake cluster lost a process: "
                                                        r"Mooncake holder 0 .*exited.*died with it"):
            store.get("p", ["input_ids"])
        # a client finds out from the reads: TRANSFER_FAIL until the master drops the segment, then missing
        with pytest.raises(StoreUnavailableError, match=r"partition p column\(s\) .*'input_ids'.* rows .*: stored block "
                                                        r"\S+ is (unreadable|missing).*data died with its holder"):
            client.get("p", ["input_ids"])
    finally:
        if client is not None:
            client.close()
        store.close()


def test_holder_lost_with_the_catalog_is_not_called_a_drop():
    """A lone holder dies under a pure client (it cannot poll the processes): its reads answer TRANSFER_FAIL,
    retried, until the master drops the segment, and then every key is gone, the partition's meta and marker
    with it. That is data lost with its holder, not a dropped partition (a drop answers OBJECT_NOT_FOUND at
    once, never TRANSFER_FAIL): a run must stop naming the store, not report a partition nobody dropped."""
    require_mooncake()
    from dataplane_rl.store.mooncake.cluster import MooncakeCluster

    with MooncakeCluster(num_holders=1, global_segment_size=16 << 20) as cluster:  # client_ttl 10 s
        client = open_store(cluster.url)
        try:
            client.create_partition("p", "grpo", 8)
            client.put("p", big_tokens(range(8), 64), range(8))
            assert client.get("p", ["input_ids"]).num_rows == 8  # it knows the partition
            cluster.kill_holder(0, signal.SIGKILL)
            with pytest.raises(StoreUnavailableError, match=r"partition p .*data died with its holder"):
                client.get("p", ["input_ids"])  # TRANSFER_FAIL, retried until the master dropped the segment
            # the master has dropped the segment with its keys: every call that meets the partition's absence
            # (a put, a get, a drop) names the lost holder, not a partition nobody dropped
            assert cluster.list_segments() == []
            lost = rf"partition p .* holder segment\(s\) {re.escape(cluster.holders[0].segment_name)} this store saw " \
                   r"are no longer mounted: its data died with its holder"
            for call in (lambda: client.put("p", big_tokens([0], 64), [0]), lambda: client.get("p", ["input_ids"]),
                         lambda: client.drop_partition("p")):
                with pytest.raises(StoreUnavailableError, match=lost):
                    call()
            with open_store(cluster.url) as fresh:  # a store opened after the loss saw no holder die: unknown
                with pytest.raises(PartitionNotFoundError, match="partition p is unknown or dropped"):
                    fresh.get("p", ["input_ids"])
        finally:
            client.close()


def test_a_create_whose_meta_met_a_dead_holder_is_put_again_not_called_taken():
    """A holder dies under a pure client that has talked to it: until the master drops its segment, the master
    still places keys there, and their transfers fail (TRANSFER_FAIL; a client that never reached that holder
    gets INVALID_PARAMS at once, which the error explains). A create whose meta key lands there
    published nothing, so the id is still free: it must put the meta again (counted as a retry), not report
    PartitionExistsError for a partition nobody made (CI met it in a run on two hosts)."""
    require_mooncake()
    from dataplane_rl.store.mooncake.cluster import MooncakeCluster

    with MooncakeCluster(num_holders=2, global_segment_size=16 << 20) as cluster:  # client_ttl 10 s
        with open_store(cluster.url) as client:
            for i in range(16):  # keys on both holders: the client's transfer engine knows both
                client.create_partition(f"warm-{i}", "grpo", 4)
            stranger = open_store(cluster.url)  # it will never have reached the holder that dies
            cluster.kill_holder(1, signal.SIGKILL)
            with stranger:  # its fills on the dead holder answer -600 at once: named, not retried
                with pytest.raises(StoreUnavailableError, match=r"INVALID_PARAMS\(-600\); a fill answers so when "
                                                                r"the key's holder died before this client reached it"):
                    for i in range(16):  # each key goes to the dead holder with odds 1/2
                        stranger.create_partition(f"q{i}", "grpo", 4)
            before = client.counters().get("dataplane_store_retries_total", 0)
            made = []
            for i in range(8):  # each key goes to the dead holder with odds 1/2 until the master drops it
                client.create_partition(f"p{i}", "grpo", 4)
                made.append(f"p{i}")
            assert client.counters()["dataplane_store_retries_total"] > before  # some key met the dead holder
            with open_store(cluster.url) as fresh:  # every meta was published whole, on the live holder
                assert [fresh.num_rows(p) for p in made] == [4] * 8


def _holder_of(cluster, client, key: str) -> int:
    """The index of the holder whose segment has `key`: its replica's transfer endpoint is a port that holder
    listens on."""
    import psutil

    endpoint = client.get_replica_desc(key)[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
    port = int(endpoint.rsplit(":", 1)[1])
    for h in cluster.holders:
        if any(c.laddr.port == port for c in psutil.Process(h.pid).net_connections("tcp") if c.status == "LISTEN"):
            return h.index
    raise AssertionError(f"no holder listens on {endpoint}")


def test_a_commit_lost_with_its_holder_is_named_not_called_unwritten():
    """Two holders; a pure client commits 12 puts, and the holder of some commit's catalog slot dies (the
    partition's meta and marker live on the other). Once the master drops the dead segment with its keys, that
    slot is gone while later ones stand, so the rows it wrote look never written. A get and a wait must name the
    lost holder (a run stops naming the store), not report cells nobody wrote, which would blame the writer."""
    require_mooncake()
    from dataplane_rl.errors import MissingColumnError, StoreTimeoutError
    from dataplane_rl.store.mooncake.catalog import marker_key, meta_key, refs_key
    from dataplane_rl.store.mooncake.cluster import MooncakeCluster

    with MooncakeCluster(num_holders=2, global_segment_size=16 << 20, client_ttl_s=2) as cluster:
        client = open_store(cluster.url)
        try:
            raw = client.storage._catalog._client
            for attempt in range(20):  # the master places keys at random: make the partition until they fit
                client.create_partition("p", "grpo", 12)
                for r in range(12):
                    client.put("p", big_tokens([r], 64), [r])
                inc = client.storage._catalog.parts["p"].inc
                home = {_holder_of(cluster, raw, k) for k in (meta_key("p"), marker_key("p", inc))}
                slots = [_holder_of(cluster, raw, refs_key("p", inc, k)) for k in range(12)]
                if len(home) == 1 and any(h not in home for h in slots[:-1]):
                    break
                client.drop_partition("p")
            else:
                pytest.fail("in 20 partitions, no commit's slot was on the holder without the meta and the marker")
            victim = next(h for h in slots[:-1] if h not in home)
            lost_rows = [k for k, h in enumerate(slots) if h == victim]
            assert client.get("p", ["input_ids"]).num_rows == 12
            late = open_store(cluster.url)  # a process that has not read the partition yet, as a trainer
            cluster.kill_holder(victim, signal.SIGKILL)
            t0 = time.monotonic()
            while cluster.holders[victim].segment_name in cluster.list_segments():
                assert time.monotonic() - t0 < 60, "the master never dropped the dead holder's segment"
                time.sleep(0.2)
            assert raw.batch_is_exist([refs_key("p", inc, k) for k in range(12)]) == [int(h != victim) for h in slots]
            named = rf"rows {lost_rows[0]}.* the holder segment\(s\) " \
                    rf"{re.escape(cluster.holders[victim].segment_name)} this store saw are no longer mounted"
            with open_store(cluster.url) as fresh:  # reads the catalog anew: the lost slot ends what it sees
                with pytest.raises(MissingColumnError, match=rf"rows {lost_rows[0]}\b"):
                    fresh.get("p", ["input_ids"])  # it saw no holder die: it cannot tell
            with late:  # it saw the dead holder's segment when it opened
                with pytest.raises(StoreUnavailableError, match=named):
                    late.get("p", ["input_ids"], lost_rows)
                with pytest.raises(StoreUnavailableError, match=named):
                    late.wait("p", ["input_ids"], lost_rows, timeout=0.5)
            with open_store(cluster.url) as fresh:
                with pytest.raises(StoreTimeoutError, match=rf"rows {lost_rows[0]}\b"):
                    fresh.wait("p", ["input_ids"], lost_rows, timeout=0.2)
        finally:
            client.close()


# ---- other processes -----------------------------------------------------------------------------
def read_in_child(url: str, pid: str, rows: list[int], fields: list[str]) -> tuple[list, bool]:
    """Runs in a spawned process: open the store by URL, read, close; (values, had a cluster of its own)."""
    store = open_store(url)
    try:
        table = store.get(pid, fields, rows)
        return [table.column(f).to_pylist() for f in fields], store.cluster is not None
    finally:
        store.close()


def test_second_process_opens_the_store_by_url(session_store):
    store = session_store
    store.create_partition("p", "grpo", 16)
    store.put("p", grpo_columns(range(16), ROLLOUT_FIELDS), range(16))
    fields = ["input_ids", "prompt_text", "total_reward"]
    with mp.get_context("spawn").Pool(1) as pool:
        values, owns = pool.apply(read_in_child, (store.url, "p", [15, 2, 9], fields), )
    want = grpo_columns([15, 2, 9], fields)
    assert values == [as_lists(want[f]) for f in fields]
    assert not owns  # a client: it neither starts nor stops a cluster
    store.cluster.check()  # the child's close() left the cluster running
    assert store.get("p", ["total_reward"], [15]).column(0).to_pylist() == [7.5]  # and the data in place


def test_close_stops_master_and_holders():
    store = small_store(num_holders=2)
    pids = store.cluster.pids()
    assert len(pids) == 3 and all(os.path.exists(f"/proc/{p}") for p in pids)
    store.create_partition("p", "grpo", 1)
    store.close()
    assert not any(os.path.exists(f"/proc/{p}") for p in pids), "a master or holder outlived close()"
    with pytest.raises(StoreUnavailableError, match="is closed"):
        store.list_partitions()


def test_chunks_bigger_than_the_arena(session_store):
    """A put bigger than the configured arena grows it, in blocks and in one block alone."""
    from dataplane_rl.config import MooncakeConfig

    session_store.create_partition("p", "grpo", 40)
    client = open_store(session_store.url, config=MooncakeConfig(local_buffer_size_mb=16))
    try:
        cols = big_tokens(range(20), 250_000)  # 20 MB in 1 MiB blocks: more than the 16 MiB arena
        client.put("p", cols, range(20))
        client.chunk_bytes = 64 << 20
        cols2 = big_tokens(range(20, 40), 250_000)  # one 20 MB chunk
        client.put("p", {"input_ids": cols2["input_ids"], "input_lengths": cols2["input_lengths"]}, range(20, 40))
        table = session_store.get("p", ["input_ids"], [0, 19, 20, 39])
        assert [a[-1] for a in table.column(0).to_pylist()] == [249_999 + r for r in (0, 19, 20, 39)]
    finally:
        client.close()


def test_stale_refs_of_an_earlier_partition_are_ignored(session_store):
    """A refs key left by an earlier partition of the same id (a drop racing a commit) is not read as this
    partition's, and the next commit replaces it."""
    store = session_store
    store.create_partition("p", "grpo", 4)
    store.drop_partition("p")
    stale = json.dumps({"inc": "000000000000", "refs": []}).encode()
    assert store.storage._catalog.put_if_absent("dprl/p/r/0", stale) == 0
    store.create_partition("p", "grpo", 4)
    assert store.status("p").rows_written["total_reward"] == 0
    store.put("p", grpo_columns(range(4), ["total_reward"]), range(4))
    assert store.get("p", "total_reward").column(0).to_pylist() == [0.0, 0.5, 1.0, 1.5]


# ---- listeners of a library user's process ------------------------------------------------------
# A program that opens the store itself (no preload, unlike `dataplane-rl train`): two clients in one
# process, data through them, then it waits while the test lists what it listens on.
LIBRARY_USER = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from store_workers import grpo_columns
from dataplane_rl.store import open_store
store = open_store("mooncake://")
other = open_store(store.url)
store.create_partition("p", "grpo", 4)
store.put("p", grpo_columns(range(4), ["total_reward"]), range(4))
got = other.get("p", ["total_reward"], [3]).column(0).to_pylist()
print(json.dumps({"pids": store.cluster.pids(), "got": got}), flush=True)
sys.stdin.readline()
other.close()
store.close()
"""
LOOPBACK = ("127.0.0.1", "::ffff:127.0.0.1")


def run_library_user(env: dict) -> tuple[list[str], dict[int, list[str]], str]:
    """Run LIBRARY_USER with `env`: the 'IP:PORT's it listens on, {pid: the same} of its cluster's
    processes, and its stderr."""
    import queue
    import threading
    import time

    import psutil

    require_mooncake()
    # -W always: Python's own once-per-place filter must not be what keeps the warning to one
    proc = subprocess.Popen([sys.executable, "-W", "always", "-c", LIBRARY_USER, os.path.dirname(__file__)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"the library user exited with {proc.returncode}: {proc.stderr.read()[-3000:]}"
            assert time.monotonic() < deadline, "the library user did not open its store within 120 s"
            try:
                report = json.loads(lines.get(timeout=0.5))
                break
            except queue.Empty:
                continue
        assert report["got"] == [1.5]  # the clients move data
        listening = {pid: [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process(pid).net_connections("tcp")
                           if c.status == psutil.CONN_LISTEN] for pid in [proc.pid, *report["pids"]]}
        _, err = proc.communicate("\n", timeout=60)
        assert proc.returncode == 0, err[-3000:]
        return listening.pop(proc.pid), listening, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_a_library_users_local_store_listens_only_on_loopback():
    """open_store("mooncake://") from plain Python: its own clients (each a handshake and a data listener)
    and the cluster's processes bind 127.0.0.1, without a preload, and nothing warns."""
    from dataplane_rl.store.mooncake.bind_shim import shim_path

    assert shim_path() is not None, "no C compiler built the bind shim here; the no-compiler case is the next test"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DATAPLANE_RL_BIND_ADDRESS")}
    mine, cluster, err = run_library_user(env)
    assert len(mine) >= 4, f"two clients should listen on 2 ports each, the process listens on {mine}"
    for who, socks in {"the library user": mine, **{f"cluster pid {p}": s for p, s in cluster.items()}}.items():
        assert socks and all(s.rpartition(":")[0] in LOOPBACK for s in socks), f"{who} listens on {socks}"
    assert "ListenWarning" not in err, err


def test_without_a_compiler_a_library_user_is_warned_once(tmp_path):
    """No C compiler (PATH without one, an empty cache): nothing can narrow Mooncake's listeners, and
    the program is told once, with the exposure and the fix, however many clients it opens."""
    (tmp_path / "bin").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "DATAPLANE_RL_BIND_ADDRESS", "CC")}
    env.update(PATH=str(tmp_path / "bin"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    mine, _, err = run_library_user(env)
    assert err.count("ListenWarning") == 1, err
    assert ("the local Mooncake store's listeners (this process's client and the store's holders) accept "
            "connections on every interface") in err and "install cc" in err and "docs/security.md" in err, err
    # what the warning says is so: the clients and the holders listen on the wildcard address
    assert any(s.rpartition(":")[0] in ("0.0.0.0", "::") for s in mine), mine


def test_an_unpatchable_mooncake_names_the_preload(monkeypatch):
    """Where Mooncake's bind() cannot be redirected (a layout this code does not know: simulated), the
    warning gives the preload `dataplane-rl train` uses, with the shim's path."""
    require_mooncake()
    from dataplane_rl.store.mooncake import bind_patch
    from dataplane_rl.store.mooncake.bind_shim import shim_path

    path = shim_path()
    assert path is not None
    monkeypatch.setattr(bind_patch, "_mooncake_libraries", lambda: [])
    monkeypatch.setattr(bind_patch, "_warned", False)
    with pytest.warns(bind_patch.ListenWarning, match=rf"this process's Mooncake client listeners accept connections on "
                      rf"every interface .*no bind\(\) slot found.*LD_PRELOAD={path} DATAPLANE_RL_BIND_ADDRESS=127\.0\.0\.1"):
        assert not bind_patch.bind_here("127.0.0.1")


# ---- urls and the CLI ----------------------------------------------------------------------------
def test_url_forms_and_errors(session_store, monkeypatch):
    host, port = session_store.url.removeprefix("mooncake://").rsplit(":", 1)
    # the URL names the master this store started, on loopback, with the admin port its default (no ?admin=)
    assert host == "127.0.0.1" and session_store.url == session_store.cluster.url
    assert session_store.cluster.admin_address == f"{host}:{int(port) + 1}"
    with socket.create_connection((host, int(port)), timeout=10):
        pass  # the master listens where the URL says
    with pytest.raises(ConfigError, match="unknown option"):
        open_store(f"{session_store.url}?holders=2")
    with pytest.raises(ConfigError, match="unknown option"):
        open_store(f"{session_store.url}/name")
    with pytest.raises(StoreUnavailableError, match=r"not accepting connections \(Connection refused, after 0\.\d+s\).*"
                       r"data_plane.backend=mooncake://") as e:
        open_store(f"mooncake://127.0.0.1:{int(port) + 2}?admin={host}:{int(port) + 1}")
    assert "MooncakeCluster" not in str(e.value)  # a command-line fix, not a Python class
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if the extra were not installed
    # this test runs from the checkout: the hint is the checkout's editable install
    with pytest.raises(StoreUnavailableError, match=r"install the `mooncake` extra: pip install -e '\.\[mooncake\]' in /"):
        open_store(session_store.url)


def test_cli_ls_and_show(session_store):
    store = session_store
    store.create_partition("step-000001", "grpo", 16)
    store.put("step-000001", grpo_columns(range(16), ROLLOUT_FIELDS), range(16))
    store.create_partition("step-000002", "grpo", 8)

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "store", *args], capture_output=True,
                              text=True, timeout=120)

    p = cli("ls", store.url, "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["url"] == store.url
    assert [x["partition"] for x in doc["partitions"]] == ["step-000001", "step-000002"]
    assert doc["partitions"][0]["columns"]["input_ids"]["rows_written"] == 16
    p = cli("show", store.url, "step-000001", "--rows", "2", "--fields", "input_ids")
    assert p.returncode == 0, p.stderr
    assert "[200, 201, 202, 203] (4 tokens)" in p.stdout
    store.cluster.check()  # the CLI's client came and went; the cluster is untouched
