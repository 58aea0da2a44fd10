"""A local Mooncake cluster: a master and dedicated holder processes (holder.py), started and watched.

    with MooncakeCluster(num_holders=2, global_segment_size=256 << 20) as cluster:
        client = cluster.connect(local_buffer_size=16 << 20)

Why holders: Mooncake keeps bytes in the process that contributed the segment they were allocated in.
Clients made by `connect_client` contribute nothing (global_segment_size=0), so their data outlives them;
the holders own all memory and do nothing else.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Sequence

from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl.hosts import is_loopback
from dataplane_rl.store.mooncake.bind_patch import warn_no_shim
from dataplane_rl.store.mooncake.bind_shim import bind_env, shim_path
from dataplane_rl.store.mooncake.client import (
    CLIENT_ENV_DEFAULTS,
    INSTALL_HINT,
    MIN_SEGMENT_SIZE,
    connect_client,
    find_master_binary,
    free_port_pair,
    import_mooncake_store,
    list_keys,
    list_segments,
    port_open,
)
from dataplane_rl.store.mooncake.processes import HolderInfo, die_with_parent, log_tail, stop_all, stop_process

_LIVE: "weakref.WeakSet[MooncakeCluster]" = weakref.WeakSet()


@atexit.register
def _close_all_clusters() -> None:
    for c in list(_LIVE):
        try:
            c.close()
        except Exception:
            pass


class MooncakeCluster:
    """A `mooncake_master` plus `num_holders` holder processes on 127.0.0.1.

    Master flags: RPC on a free port P, admin/metrics HTTP on P+1 (key listing, health), no HTTP
    metadata server (clients use P2PHANDSHAKE), and, unless `eviction=True`,
    eviction_high_watermark_ratio=1.0 and eviction_ratio=0.0 so a full store fails puts with
    NO_AVAILABLE_HANDLE (-200) instead of evicting. `kv_lease_ttl_ms`: after a read, a key cannot be
    removed without force=True for this long. `client_ttl_s`: a holder that died without unmounting keeps
    its keys listed (reads fail with TRANSFER_FAIL, -800) for this long, then they vanish (-704).

    `start()` (or `with`) launches everything and waits until the master answers and every holder's
    segment is mounted; `close()` stops everything (SIGTERM, then SIGKILL after `stop_timeout`); it is
    also registered with atexit, and the children get SIGKILL if the starting thread dies.
    """

    def __init__(self, num_holders: int = 1, global_segment_size: int = 512 << 20, *,
                 protocol: str = "tcp", device_name: str = "", metadata_server: str = "P2PHANDSHAKE",
                 host: str = "127.0.0.1", rpc_port: int | None = None, eviction: bool = False,
                 kv_lease_ttl_ms: int = 10_000, client_ttl_s: int = 10, start_timeout: float = 30.0,
                 stop_timeout: float = 5.0, log_dir: str | None = None, master_binary: str | None = None,
                 extra_master_flags: Sequence[str] = (), python: str | None = None,
                 env: dict[str, str] | None = None):
        if num_holders < 0:
            raise ValueError(f"num_holders must be >= 0, got {num_holders}")
        if global_segment_size < MIN_SEGMENT_SIZE:
            raise ValueError(f"global_segment_size must be >= {MIN_SEGMENT_SIZE} bytes (16 MiB: Mooncake refuses "
                             f"smaller segments), got {global_segment_size}")
        self.num_holders = num_holders
        self.global_segment_size = int(global_segment_size)
        self.protocol, self.device_name, self.metadata_server = protocol, device_name, metadata_server
        self.host = host
        self.eviction = eviction
        self.kv_lease_ttl_ms = int(kv_lease_ttl_ms)
        self.client_ttl_s = int(client_ttl_s)
        self.start_timeout, self.stop_timeout = start_timeout, stop_timeout
        self.extra_master_flags = list(extra_master_flags)
        self.python = python or sys.executable
        self.env = {**CLIENT_ENV_DEFAULTS, **os.environ, **(env or {})}  # for the master and holders
        self._requested_port = rpc_port
        self._master_binary = master_binary
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir
        self.rpc_port: int | None = None
        self.master: subprocess.Popen | None = None
        self.holders: list[HolderInfo] = []
        self._holder_procs: list[subprocess.Popen] = []
        self._lock = threading.Lock()
        self._closed = False
        self.start_seconds: float | None = None

    # -- addresses ------------------------------------------------------------------------------
    @property
    def master_address(self) -> str:
        self._require_started()
        return f"{self.host}:{self.rpc_port}"

    @property
    def admin_address(self) -> str:
        self._require_started()
        return f"{self.host}:{self.rpc_port + 1}"

    @property
    def url(self) -> str:
        return f"mooncake://{self.master_address}"

    def master_flags(self) -> list[str]:
        """The exact command-line flags the master is started with."""
        port = self.rpc_port if self.rpc_port is not None else 0
        flags = [f"--rpc_address={self.host}", f"--rpc_port={port}",
                 f"--metrics_host={self.host}", f"--metrics_port={port + 1}",
                 "--enable_http_metadata_server=false",
                 f"--default_kv_lease_ttl={self.kv_lease_ttl_ms}",
                 f"--client_ttl={self.client_ttl_s}",
                 "--logtostderr=true"]
        if not self.eviction:
            flags += ["--eviction_high_watermark_ratio=1.0", "--eviction_ratio=0.0"]
        return flags + self.extra_master_flags

    # -- lifecycle ------------------------------------------------------------------------------
    def __enter__(self) -> "MooncakeCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "MooncakeCluster":
        if self.master is not None:
            return self
        if self._closed:
            raise StoreUnavailableError("this MooncakeCluster was closed; make a new one")
        binary = find_master_binary(self._master_binary)
        import_mooncake_store()  # holders need it; fail here with the install hint, not in a child
        if is_loopback(self.host) and shim_path() is None:
            warn_no_shim()  # nothing narrows the holders' listeners (bind_env below)
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="mooncake-cluster-")
        os.makedirs(self.log_dir, exist_ok=True)
        _LIVE.add(self)
        t0 = time.monotonic()
        try:
            self._start_master(binary)
            self._start_holders()
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _start_master(self, binary: str) -> None:
        attempts = 1 if self._requested_port else 3
        last_error: StoreUnavailableError | None = None
        for attempt in range(attempts):
            self.rpc_port = self._requested_port or free_port_pair(self.host)
            log_path = os.path.join(self.log_dir, f"master-{attempt}.log")
            self.master_log = log_path
            with open(log_path, "wb") as log:
                try:
                    self.master = subprocess.Popen([binary, *self.master_flags()], stdin=subprocess.DEVNULL,
                                                   stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                                   preexec_fn=die_with_parent, start_new_session=True)
                except OSError as e:
                    raise StoreUnavailableError(f"cannot run {binary}: {e}; {INSTALL_HINT}") from e
            try:
                self._wait_master_up(log_path)
                return
            except StoreUnavailableError as e:
                last_error = e
                stop_process(self.master, 2.0)
                self.master = None
                text = log_tail(log_path, 200)
                if "error while loading shared libraries" in text:
                    raise StoreUnavailableError(f"{binary} cannot load its libraries; {INSTALL_HINT}\n{text}") from e
                if "in use" not in text.lower() and "bind" not in text.lower():
                    break  # not a port race: retrying will not help
        assert last_error is not None
        raise last_error

    def _wait_master_up(self, log_path: str) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.master.poll() is not None:
                raise StoreUnavailableError(
                    f"mooncake_master exited with code {self.master.returncode} during start-up "
                    f"(flags: {' '.join(self.master_flags())}); last lines of its log:\n{log_tail(log_path)}")
            if port_open(f"{self.host}:{self.rpc_port}", 0.2) and port_open(f"{self.host}:{self.rpc_port + 1}", 0.2):
                return
            time.sleep(0.05)
        raise StoreUnavailableError(
            f"mooncake_master did not open {self.host}:{self.rpc_port} (RPC) and :{self.rpc_port + 1} (admin) "
            f"within {self.start_timeout}s; last lines of its log:\n{log_tail(log_path)}")

    def _holder_cmd(self, index: int, ready_file: str) -> list[str]:
        return [self.python, "-m", "dataplane_rl.store.mooncake.holder",
                "--master", f"{self.host}:{self.rpc_port}", "--segment-size", str(self.global_segment_size),
                "--ready-file", ready_file, "--local-hostname", self.host,
                "--metadata-server", self.metadata_server, "--protocol", self.protocol,
                "--device-name", self.device_name, "--parent-pid", str(os.getpid())]

    def _start_holders(self) -> None:
        pending = [self._spawn_holder(len(self._holder_procs)) for _ in range(self.num_holders)]
        self._wait_holders(pending)

    def _spawn_holder(self, index: int) -> tuple[int, subprocess.Popen, str, str]:
        ready = os.path.join(self.log_dir, f"holder-{index}.ready.json")
        log_path = os.path.join(self.log_dir, f"holder-{index}.log")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(ready)
        with open(log_path, "wb") as log:
            # the shim makes the holder's listeners bind self.host instead of every interface (bind_shim.py)
            proc = subprocess.Popen(self._holder_cmd(index, ready), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=bind_env(self.host, self.env),
                                    preexec_fn=die_with_parent,
                                    start_new_session=True)
        self._holder_procs.append(proc)
        return index, proc, ready, log_path

    def _wait_holders(self, pending: list[tuple[int, subprocess.Popen, str, str]]) -> None:
        deadline = time.monotonic() + self.start_timeout
        waiting = list(pending)
        while waiting:
            for item in list(waiting):
                index, proc, ready, log_path = item
                if proc.poll() is not None:
                    raise StoreUnavailableError(
                        f"Mooncake holder {index} (pid {proc.pid}) exited with code {proc.returncode} during "
                        f"start-up; last lines of its log:\n{log_tail(log_path)}")
                if os.path.exists(ready):
                    with open(ready) as f:
                        info = json.load(f)
                    self.holders.append(HolderInfo(index, proc.pid, info["segment_name"], self.global_segment_size,
                                                   log_path))
                    waiting.remove(item)
            if self.master.poll() is not None:
                raise StoreUnavailableError(f"mooncake_master exited with code {self.master.returncode} while "
                                            f"holders started; last lines of its log:\n{log_tail(self.master_log)}")
            if waiting and time.monotonic() > deadline:
                index, proc, _, log_path = waiting[0]
                raise StoreUnavailableError(
                    f"Mooncake holder {index} (pid {proc.pid}) did not mount its segment within "
                    f"{self.start_timeout}s; last lines of its log:\n{log_tail(log_path)}")
            if waiting:
                time.sleep(0.05)
        self.holders.sort(key=lambda h: h.index)
        # the ready file is written after setup() mounted the segment; make sure the master agrees
        names = {h.segment_name for h in self.holders}
        while True:
            mounted = set(list_segments(self.admin_address))
            if names <= mounted:
                return
            if time.monotonic() > deadline:
                raise StoreUnavailableError(f"holders report segments {sorted(names)} but the master lists "
                                            f"{sorted(mounted)} after {self.start_timeout}s")
            time.sleep(0.05)

    def add_holder(self, segment_size: int | None = None) -> HolderInfo:
        """Start one more holder (same segment size unless given) and wait until it is mounted."""
        self._require_started()
        old = self.global_segment_size
        if segment_size is not None:
            self.global_segment_size = int(segment_size)
        try:
            item = self._spawn_holder(len(self._holder_procs))
            self._wait_holders([item])
        finally:
            self.global_segment_size = old
        return next(h for h in self.holders if h.index == item[0])

    def kill_holder(self, index: int, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to holder `index` (SIGKILL: a crash; SIGTERM: graceful unmount) and reap it."""
        proc = self._holder_procs[index]
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            proc.wait(self.stop_timeout + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    # -- health ---------------------------------------------------------------------------------
    def dead(self) -> list[str]:
        """Descriptions of processes of this cluster that have exited (empty: all alive)."""
        out = []
        if self.master is not None and self.master.poll() is not None:
            out.append(f"mooncake_master (pid {self.master.pid}) exited with code {self.master.returncode}; "
                       f"last lines of its log:\n{log_tail(self.master_log)}")
        for h, proc in zip(self.holders, self._holder_procs):
            if proc.poll() is not None:
                out.append(f"Mooncake holder {h.index} (pid {h.pid}, segment {h.segment_name}) exited with code "
                           f"{proc.returncode}; its {h.segment_size} bytes of store memory and every object in "
                           f"them are lost; last lines of its log:\n{log_tail(h.log_path)}")
        return out

    def alive(self) -> bool:
        return self.master is not None and not self._closed and not self.dead()

    def check(self) -> None:
        """Raise StoreUnavailableError if the master or any holder has died (cheap: polls the processes)."""
        if self._closed:
            raise StoreUnavailableError("the MooncakeCluster is closed")
        self._require_started()
        problems = self.dead()
        if problems:
            raise StoreUnavailableError("Mooncake cluster lost a process: " + "\n".join(problems))

    def pids(self) -> list[int]:
        return ([self.master.pid] if self.master is not None else []) + [p.pid for p in self._holder_procs]

    def list_keys(self, prefix: str = "") -> list[str]:
        return list_keys(self.admin_address, prefix)

    def list_segments(self) -> list[str]:
        return list_segments(self.admin_address)

    def connect(self, local_buffer_size: int = 16 << 20, **kwargs):
        """A client of this cluster (see connect_client)."""
        self.check()
        return connect_client(self.master_address, local_buffer_size, protocol=self.protocol,
                              device_name=self.device_name, metadata_server=self.metadata_server, **kwargs)

    def _require_started(self) -> None:
        if self.rpc_port is None or self.master is None:
            raise StoreUnavailableError("MooncakeCluster is not started; call start() or use it in a with block")

    # -- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop holders (SIGTERM: they unmount), then the master; SIGKILL whatever outlives stop_timeout."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # holders unmount on SIGTERM (~1 s); with the master gone that would only wait for a timeout
        master_up = self.master is not None and self.master.poll() is None
        sig = signal.SIGTERM if master_up else signal.SIGKILL
        stop_all(self._holder_procs, self.stop_timeout, sig)
        if self.master is not None:
            stop_process(self.master, self.stop_timeout)
        _LIVE.discard(self)
        if self._own_log_dir and self.log_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __del__(self):  # best effort; atexit covers interpreter exit
        try:
            if not self._closed and self.master is not None:
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("running" if self.master is not None else "not started")
        addr = f"{self.host}:{self.rpc_port}" if self.rpc_port else "-"
        return (f"MooncakeCluster({addr}, holders={self.num_holders}x{self.global_segment_size}B, "
                f"{state})")


__all__ = ["HolderInfo", "MooncakeCluster"]
