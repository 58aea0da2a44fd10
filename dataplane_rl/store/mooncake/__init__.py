"""`mooncake://`: the Mooncake distributed store as a column-store backend (docs/architecture.md §5.4).

    store.py    MooncakeStore: what a user opens: the URL, the cluster it starts or joins, its processes
    storage.py  MooncakeStorage: the store's storage (../storage.py): blocks in, blocks out, what was lost
    catalog.py  partition metas and committed refs as Mooncake keys (no lock)
    commit.py   a put's blocks and commit record, stored in the same calls
    retry.py    transient answers of a loaded store, retried and counted
    health.py   what the store lost, named: a dead holder, a full store, an unreachable master
    buffers.py  registered memory: the write arena and the read landing buffers
    client.py   error codes, addresses, the admin endpoint, connect_client
    cluster.py  MooncakeCluster: a master and holder processes started here
    processes.py  the cluster's child processes: death with the parent, stopping, log tails
    holder.py   the holder process (python -m dataplane_rl.store.mooncake.holder)

MooncakeStore is imported on first use, so a holder process (which imports only holder.py) starts fast.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "MooncakeStore":
        from dataplane_rl.store.mooncake.store import MooncakeStore

        return MooncakeStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
