"""`shm://DIR`: the shared-memory store of one machine, the embedded default (docs/architecture.md §5.3).

    store.py    ShmStore: what a user opens, the URL and its options, keep(), path
    storage.py  ShmStorage: the store's storage (../storage.py) over a folder on /dev/shm: blocks in and out, drop
    catalog.py  its catalog: a partition's meta log and its writers' logs, as a process follows them
    logs.py     the log format: a header with the committed end, then framed records
    commit.py   a commit: claims under a byte-range lock of its rows, then a record in the writer's own log
    arena.py    each writer's open segments of a partition, bounded by data_plane.shm.arena_mb
    pool.py     segments of dropped partitions, kept pre-touched for reuse
    maps.py     the per-process map cache and the leases that keep a mapping alive

    files.py    the private, trusted files it is made of (also used by the ownership records and shared weights)
    owners.py   who owns an auto-made store folder, and collecting those of dead owners (`store gc`)
"""

from __future__ import annotations

from dataplane_rl.store.shm.store import ShmStore

__all__ = ["ShmStore"]
