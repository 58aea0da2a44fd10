"""Talking to Mooncake: its error codes, the import and master binary, addresses, the master's admin HTTP
endpoint, the no-eviction replica config, and a client factory (`connect_client`). The cluster itself
(master and holder processes) is in cluster.py.

    with MooncakeCluster(num_holders=2, global_segment_size=256 << 20) as cluster:
        client = connect_client(cluster.master_address, local_buffer_size=16 << 20)
        buf = np.zeros(1 << 20, np.uint8)
        client.register_buffer(buf.ctypes.data, buf.nbytes)
        client.batch_put_from(["k"], [buf.ctypes.data], [buf.nbytes], no_eviction_config())
        ...
        client.close()            # about 1 s: share one client per process

Why holders: Mooncake keeps bytes in the process that contributed the segment they were allocated in.
Clients made by `connect_client` contribute nothing (global_segment_size=0), so their data outlives them;
the holders own all memory and do nothing else.

The master is started so that a full store fails a put with NO_AVAILABLE_HANDLE (-200) instead of
silently evicting older objects (see `master_flags`). What this Mooncake version actually does for each
quirk (put of an existing key, missing keys, full segments, dead holders) is measured in
tests/test_mooncake_cluster.py and written down in docs/mooncake_notes.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import time
import urllib.error
import urllib.request
from typing import Any

from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl.hosts import advertise_host, is_loopback, quiet_glog
from dataplane_rl.resources import pip_install_extra
from dataplane_rl.store.mooncake.bind_patch import bind_here
from dataplane_rl.store.mooncake.bind_shim import ADDRESS_ENV

INSTALL_HINT = (f"install the `mooncake` extra: {pip_install_extra('mooncake')} "
                "(package mooncake-transfer-engine-non-cuda), and Debian libibverbs1 (apt-get install libibverbs1)")

# mooncake-store/include/types.h (ErrorCode); returned as negative ints by the Python API.
ERROR_NAMES: dict[int, str] = {
    0: "OK",
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",  # no space left in any segment
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",  # e.g. size 0, or a get buffer smaller than the object
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",  # only put sessions report it; plain puts return 0
    -706: "OBJECT_HAS_LEASE",  # remove() within default_kv_lease_ttl of a read; use force=True
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",  # the holder of the bytes is unreachable (killed, not yet unmounted)
    -900: "RPC_FAIL",  # the master is unreachable
    -1000: "ETCD_OPERATION_ERROR",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
MIN_SEGMENT_SIZE = 16 << 20  # a holder's setup() fails with INVALID_PARAMS below this

# Environment every Mooncake process we make gets, unless already set (read at setup()). The TCP transport
# queues at most MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER (default 1024, max 65535) transfers per peer beyond
# its connection lanes: a batch call with more small keys than that (~2100 by default) stalls 60 s, fails
# with TRANSFER_FAIL (-800), and can leave the client unable to reach that holder ever again (every later
# transfer: -800 after 1 s). 16384 moves the cliff to ~16000 keys per call.
CLIENT_ENV_DEFAULTS = {"MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER": "16384"}  # max 65535, default 1024
MAX_KEYS_PER_BATCH = 1024  # what we recommend per batch_* call, well inside the limit above

OK = 0
NO_AVAILABLE_HANDLE = -200
INVALID_PARAMS = -600
ILLEGAL_CLIENT = -601  # ending a put session the master discarded and gave to another client
REPLICA_IS_NOT_READY = -703  # a key whose put session has not ended: not readable yet
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707  # a read finished after its lease: retried (retry.py)
TRANSFER_FAIL = -800
RPC_FAIL = -900


def error_name(code: int) -> str:
    """-704 -> 'OBJECT_NOT_FOUND(-704)'; non-negative codes (byte counts of gets) -> 'OK(n)'."""
    if code >= 0:
        return f"OK({code})"
    return f"{ERROR_NAMES.get(int(code), 'UNKNOWN')}({code})"


# ---- imports and binaries ----------------------------------------------------------------------
def import_mooncake_store():
    """`mooncake.store`, or StoreUnavailableError saying how to install it."""
    try:
        import mooncake.store as store  # noqa: PLC0415 - optional dependency
    except ImportError as e:
        msg = str(e)
        hint = INSTALL_HINT
        if "libibverbs" in msg or "libnuma" in msg:
            hint = "install Debian libibverbs1 (apt-get install libibverbs1; Mooncake links it even for tcp)"
        raise StoreUnavailableError(f"cannot import mooncake.store ({msg}); {hint}") from e
    return store


def find_master_binary(explicit: str | None = None) -> str:
    """Path of the `mooncake_master` executable: explicit > $MOONCAKE_MASTER_BIN > the wheel's copy > PATH."""
    candidates: list[str] = []
    if explicit:
        candidates.append(explicit)
    elif os.environ.get("MOONCAKE_MASTER_BIN"):
        candidates.append(os.environ["MOONCAKE_MASTER_BIN"])
    else:
        spec = importlib.util.find_spec("mooncake")  # locates the package without loading store.so
        for loc in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(os.path.join(loc, "mooncake_master"))
        on_path = shutil.which("mooncake_master")
        if on_path:
            candidates.append(on_path)
    for c in candidates:
        if os.path.isfile(c):
            if not os.access(c, os.X_OK):
                try:
                    os.chmod(c, os.stat(c).st_mode | 0o111)  # wheels sometimes lose the x bit
                except OSError:
                    pass
            return c
    where = ", ".join(candidates) if candidates else "the mooncake package and PATH"
    raise StoreUnavailableError(f"mooncake_master binary not found (looked in {where}); {INSTALL_HINT}")


# ---- small helpers -----------------------------------------------------------------------------
def _port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port_pair(host: str = "127.0.0.1") -> int:
    """A port p such that p and p+1 are both free now (p: master RPC, p+1: master admin HTTP)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            p = s.getsockname()[1]
        if p < 65535 and _port_is_free(host, p + 1):
            return p
    raise StoreUnavailableError(f"no two adjacent free TCP ports on {host}")


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise StoreUnavailableError(f"Mooncake address {address!r} is not HOST:PORT")
    return host, int(port)


def port_open(address: str, timeout: float = 0.5) -> bool:
    host, port = split_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def default_admin_address(master_address: str) -> str:
    """The admin HTTP address of a master started by MooncakeCluster: RPC port + 1."""
    host, port = split_address(master_address)
    return f"{host}:{port + 1}"


def _http_get(admin_address: str, path: str, timeout: float = 5.0) -> str:
    url = f"http://{admin_address}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        raise StoreUnavailableError(f"Mooncake master admin endpoint {url} is unreachable: {e}") from e


def list_keys(admin_address: str, prefix: str = "") -> list[str]:
    """Every key the master knows (its admin HTTP /get_all_keys), optionally only those starting with prefix.

    Mooncake's client API cannot list keys; the master's admin server can. It returns all keys in one
    response, so call it for catalogs/partitions, not per chunk."""
    keys = [k for k in _http_get(admin_address, "/get_all_keys").split("\n") if k]
    return [k for k in keys if k.startswith(prefix)] if prefix else keys


def list_segments(admin_address: str) -> list[str]:
    """Names of the mounted segments (one per live holder), from the master's admin /get_all_segments."""
    return [s for s in _http_get(admin_address, "/get_all_segments").split("\n") if s.strip()]


def master_health(admin_address: str) -> dict[str, Any]:
    return json.loads(_http_get(admin_address, "/health"))


def no_eviction_config(replica_num: int = 1, preferred_segment: str | None = None):
    """ReplicateConfig with a hard pin: the object is never evicted, even by a master that evicts."""
    store = import_mooncake_store()
    cfg = store.ReplicateConfig()
    cfg.replica_num = replica_num
    cfg.with_hard_pin = True
    if preferred_segment:
        cfg.preferred_segment = preferred_segment
    return cfg


# ---- client ------------------------------------------------------------------------------------
def connect_client(master_address: str, local_buffer_size: int, protocol: str = "tcp", device_name: str = "",
                   metadata_server: str = "P2PHANDSHAKE", *, local_hostname: str | None = None,
                   connect_timeout: float = 5.0):
    """A `MooncakeDistributedStore` client that contributes no memory (global_segment_size=0).

    Data written through it lives in the holders, so it survives this client. `local_buffer_size` is the
    client's internal transfer buffer, used only by the copying calls (`get`, `put`, `get_batch`); the
    zero-copy calls (`batch_put_from`, `batch_get_into` on buffers you `register_buffer`) do not use it.
    With local_buffer_size=0, `get()` returns b"" even for keys that exist.

    `local_hostname`: the address peers reach this client at; None: `advertise_host` (this node's IP, or
    127.0.0.1 for a master on loopback). With a metadata server other than P2PHANDSHAKE, Mooncake takes
    that address from MC_TCP_BIND_ADDRESS instead, so it is set too (unless already set).
    The master is probed first: Mooncake's own setup() against a dead address blocks for ~90 s.
    Sets CLIENT_ENV_DEFAULTS in os.environ (if unset) first, so big batch calls do not wedge the client;
    still keep each batch call to about MAX_KEYS_PER_BATCH keys. Mooncake's glog lines are silenced
    (`quiet_glog`). `close()` on the returned client takes about 1 s.
    """
    store_mod = import_mooncake_store()
    t0 = time.monotonic()
    try:
        socket.create_connection(split_address(master_address), timeout=connect_timeout).close()
    except OSError as e:  # the reason and the real wait: a refused port answers at once, a dead host times out
        raise StoreUnavailableError(
            f"Mooncake master at {master_address} is not accepting connections ({e.strerror or e}, after "
            f"{time.monotonic() - t0:.1f}s); check the address, start a long-running store there (mooncake_master "
            "and `python -m dataplane_rl.store.mooncake.holder`, as in the cluster recipe), or let the run start "
            "its own with data_plane.backend=mooncake://") from None
    host = advertise_host(master_address, local_hostname)
    if ADDRESS_ENV in os.environ:  # the bind shim is preloaded here (run/private_ray.py): listen where peers dial
        os.environ[ADDRESS_ENV] = host
    for k, v in {**CLIENT_ENV_DEFAULTS, "MC_TCP_BIND_ADDRESS": host}.items():
        os.environ.setdefault(k, v)
    quiet_glog()
    # a one-machine store's client listens on loopback only, preloaded with the shim or not (bind_patch.py)
    bind_here(host if is_loopback(host) else None)
    client = store_mod.MooncakeDistributedStore()
    rc = client.setup(host, metadata_server, 0, int(local_buffer_size), protocol, device_name,
                      master_address)
    if rc != 0:
        raise StoreUnavailableError(f"Mooncake client setup(master={master_address}, local_hostname={host}, "
                                    f"protocol={protocol}, device={device_name!r}, "
                                    f"local_buffer_size={local_buffer_size}) failed with rc={rc}")
    return client


