"""No surprises on a shared machine: a store the run cannot use is refused before anything starts.

That a run starts its own Ray despite a dead ray_current_cluster, and prints no Mooncake glog line or
Ray token warning, is checked on the one-host run of tests/test_multihost.py (GLOG_LINE is used there)."""

from __future__ import annotations

import json
import os
import re

import pytest

from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError, StoreUnavailableError
from dataplane_rl.driver.placement import check_backend_spans

SMALL = ["grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=1",
         "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4", "generation.max_new_tokens=6",
         "logger.progress=false"]
# glog's prefix: severity, MMDD, time, thread id, file:line] (torch's c10d lines have no thread id)
GLOG_LINE = re.compile(r"\b[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [\w.]+:\d+\]")


def test_glog_pattern_matches_mooncake_lines():
    """The quiet check must be able to fail: it matches what Mooncake printed before."""
    assert GLOG_LINE.search("E1201 08:37:20.480871 12790 transfer_metadata.cpp:1098] Local segment descriptor not found")
    assert GLOG_LINE.search("(RolloutWorker pid=1) I1201 08:37:33.253877 13255 tcp_transport.cpp:391] TcpTransport")
    assert not GLOG_LINE.search("[W1201 08:45:39.445042425 socket.cpp:207] [c10d] The hostname of the client")


def test_unreachable_mooncake_master_is_refused_before_ray_starts(tmp_path):
    import ray

    from dataplane_rl.driver.loop import train

    cfg = load_config(None, [*SMALL, f"logger.run_dir={tmp_path / 'r'}", "data_plane.enabled=true",
                             "data_plane.backend=mooncake://127.0.0.1:9"])
    was_up = ray.is_initialized()
    with pytest.raises(StoreUnavailableError, match=r"data_plane.backend=mooncake://127.0.0.1:9.*no Mooncake master"):
        train(cfg)
    assert ray.is_initialized() == was_up, "Ray was started for a run that could not reach its store"
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["status"] == "failed"


TWO_NODES = [{"NodeManagerAddress": "10.0.0.5", "Alive": True}, {"NodeManagerAddress": "10.0.0.6", "Alive": True}]


@pytest.mark.parametrize("backend,needle", [("shm://", "/dev/shm"), ("mooncake://", "127.0.0.1"),
                                            ("mooncake://127.0.0.1:50051", "loopback")])
def test_one_machine_stores_are_refused_on_a_multi_node_cluster(backend, needle):
    cfg = load_config(None, ["data_plane.enabled=true", f"data_plane.backend={backend}"])
    with pytest.raises(ConfigError, match="data_plane.backend") as e:
        check_backend_spans(cfg, TWO_NODES)
    assert needle in str(e.value) and "mooncake://HEAD:PORT" in str(e.value) and "10.0.0.6" in str(e.value)
    check_backend_spans(cfg, TWO_NODES[:1])  # one node: fine
    check_backend_spans(load_config(None, ["data_plane.enabled=true", "data_plane.backend=mooncake://10.0.0.5:50051"]),
                        TWO_NODES)


def test_advertised_address_is_loopback_only_for_a_loopback_master(monkeypatch):
    from dataplane_rl.hosts import HOST_ENV, advertise_host, interface_of

    monkeypatch.setenv(HOST_ENV, "10.9.9.9")
    assert advertise_host("127.0.0.1:50051") == "127.0.0.1"  # a one-machine store stays on loopback
    assert advertise_host("10.0.0.5:50051") == "10.9.9.9"  # the per-node override
    assert advertise_host("10.0.0.5:50051", "10.1.1.1") == "10.1.1.1"  # data_plane.mooncake.local_hostname
    monkeypatch.delenv(HOST_ENV)
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this host's address towards a remote peer
        try:
            s.connect(("192.0.2.77", 9))
            mine = s.getsockname()[0]
        except OSError:  # no route off this host: then the refusal must say so
            mine = None
    if mine is None:
        with pytest.raises(StoreUnavailableError, match=HOST_ENV):
            advertise_host("192.0.2.77:50051")
    else:
        assert advertise_host("192.0.2.77:50051") == mine != "127.0.0.1"
    assert interface_of("127.0.0.1") == "lo" and interface_of("203.0.113.254") is None


def test_strict_spread_with_more_actors_than_nodes_is_refused():
    from dataplane_rl.driver.placement import placement_group

    cfg = load_config(None, ["cluster.placement_strategy=STRICT_SPREAD", "generation.num_workers=3"])
    with pytest.raises(ConfigError, match="cluster.placement_strategy=STRICT_SPREAD.*3.*2 node"):
        placement_group("rollout", 3, 0, cfg, TWO_NODES)


def test_a_sealed_bind_slot_is_written_and_sealed_again():
    """bind_patch writes a pointer into a library's relocation slot; where the loader sealed the slot's
    page read-only (full RELRO), the page is opened for the write and sealed again."""
    import ctypes
    import mmap

    from dataplane_rl.store.mooncake.bind_patch import _protection, _write_pointer

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    page = libc.mmap(None, mmap.PAGESIZE, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    assert page not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        assert _protection(page + 64) == mmap.PROT_READ
        _write_pointer(page + 64, 0x1234_5678_9ABC)
        assert ctypes.c_void_p.from_address(page + 64).value == 0x1234_5678_9ABC
        assert _protection(page + 64) == mmap.PROT_READ  # sealed again
    finally:
        libc.munmap(page, mmap.PAGESIZE)
