"""`mooncake://[HOST:PORT]`: columns in the Mooncake distributed store, for more than one machine (docs/architecture.md §5.4).

`mooncake://` starts a cluster of its own (a master and `num_holders` holder processes on free 127.0.0.1
ports, see MooncakeCluster) and stops it on close(); `store.cluster` is that cluster. `mooncake://HOST:PORT`
joins a running master as a pure client. The master's admin HTTP server is taken to be on PORT+1 (true
for masters MooncakeCluster starts); name another with `mooncake://HOST:PORT?admin=HOST:Q`. How the data is
kept in Mooncake (keys, puts, reads, its quirks) is MooncakeStorage's, in storage.py.
"""

from __future__ import annotations

import inspect
from typing import Any
from urllib.parse import parse_qsl

from dataplane_rl.errors import ConfigError
from dataplane_rl.store import stats
from dataplane_rl.store.base import ColumnStore
from dataplane_rl.store.mooncake.client import connect_client, default_admin_address, import_mooncake_store, split_address
from dataplane_rl.store.mooncake.cluster import MooncakeCluster
from dataplane_rl.store.mooncake.storage import CLIENT_ARENA_BYTES, MooncakeStorage

# The master takes a holder that has not sent a heartbeat for client_ttl seconds for dead and unmounts its
# segment: every key in it is gone. A holder starved of CPU on a loaded node can miss 10 s (the default;
# suspected in a bench run at load average 108, where every partition vanished at once), so a cluster this
# store starts waits longer. A killed holder is still named at once (cluster.check() polls the processes).
OWN_CLUSTER_CLIENT_TTL_S = 60
_TRANSPORT_DEFAULTS = {k: p.default for k, p in inspect.signature(connect_client).parameters.items()
                       if k in ("protocol", "device_name", "metadata_server", "local_hostname")}


class MooncakeStore(ColumnStore):
    scheme = "mooncake"
    # Smaller row blocks than the default: a reader of a row shard fetches only the blocks holding its
    # rows, and over TCP a read costs per byte fetched, while one more key costs only ~100 us.
    chunk_bytes = 1 << 20

    def __init__(self, address: str | None = None, *, config=None, admin: str | None = None,
                 cluster: MooncakeCluster | None = None, transport: dict[str, str] | None = None) -> None:
        """address None and no cluster: start a cluster (sized by `config`, a MooncakeConfig) and own it.
        `cluster`: use that started cluster (not owned). `transport`: protocol / device_name /
        metadata_server / local_hostname of a client opened by URL alone (they come from the URL; default tcp,
        and the node's own IP: see advertise_host)."""
        import_mooncake_store()  # StoreUnavailableError: install the `mooncake` extra (and libibverbs1)
        owns_cluster = address is None and cluster is None
        if config is None and owns_cluster:
            from dataplane_rl.config import MooncakeConfig  # imports torch (seconds): only when starting a cluster

            config = MooncakeConfig()
        self.config = config
        if config is not None:
            transport = {"protocol": config.protocol, "device_name": config.device_name,
                         "metadata_server": config.metadata_server, "local_hostname": config.local_hostname}
        if owns_cluster:
            cluster = MooncakeCluster(config.num_holders, config.global_segment_size_mb << 20,
                                      client_ttl_s=OWN_CLUSTER_CLIENT_TTL_S,
                                      **{k: v for k, v in transport.items() if k != "local_hostname"}).start()
        self.cluster = cluster
        if cluster is not None:
            address, admin = cluster.master_address, cluster.admin_address
            transport = {"protocol": cluster.protocol, "device_name": cluster.device_name,
                         "metadata_server": cluster.metadata_server,
                         "local_hostname": (transport or {}).get("local_hostname")}
        split_address(address)  # StoreUnavailableError unless HOST:PORT
        # without a config (a client opened by URL alone) the arena starts small and grows to the largest put
        arena_bytes = config.local_buffer_size_mb << 20 if config is not None else CLIENT_ARENA_BYTES
        counters = stats.Counters()  # the storage counts its retries into the store's counters
        try:
            storage = MooncakeStorage(address, admin or default_admin_address(address),
                                      {k: v for k, v in (transport or {}).items() if v != _TRANSPORT_DEFAULTS[k]},
                                      cluster, owns_cluster, arena_bytes, counters.retry)
        except BaseException:
            if owns_cluster:
                cluster.close()
            raise
        super().__init__(storage, counters)

    @classmethod
    def from_url(cls, rest: str, config=None, **options: Any) -> "MooncakeStore":
        """mooncake:// or mooncake://HOST:PORT[?admin=HOST:PORT&protocol=rdma&device_name=mlx5_0&metadata_server=...]."""
        address, _, query = rest.partition("?")
        params = dict(parse_qsl(query))
        admin = params.pop("admin", None)
        unknown = sorted(set(params) - set(_TRANSPORT_DEFAULTS)) + sorted(options)
        if unknown or "/" in address or (not address and (admin or params)):
            raise ConfigError(f"mooncake://{rest}: unknown option(s) {unknown or query or address!r}; use mooncake:// "
                              "(start a local cluster, sized and configured by config=MooncakeConfig(...)) or "
                              "mooncake://HOST:PORT[?admin=HOST:PORT&protocol=...&device_name=...&metadata_server=...&local_hostname=IP]")
        return cls(address or None, config=config, admin=admin, transport=params or None)

    @property
    def lock_timeout_s(self) -> float:
        """How long a commit waits for a refs slot another writer reserved (catalog.py)."""
        return self.storage.catalog.lock_timeout_s

    @lock_timeout_s.setter
    def lock_timeout_s(self, value: float) -> None:
        self.storage.catalog.lock_timeout_s = value

    # -- the processes it started ----------------------------------------------------------------
    def processes(self) -> list[dict]:
        c = self.cluster
        return [] if c is None or c.master is None else (
            [{"process": "master", "pid": c.master.pid, "node": c.host}]
            + [{"process": "holder", "index": h.index, "pid": h.pid, "node": c.host} for h in c.holders])

    def dead_processes(self) -> list[str] | None:
        return None if self.cluster is None else self.cluster.dead()

    def stop_processes(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
