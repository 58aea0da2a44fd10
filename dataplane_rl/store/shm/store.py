"""`shm://DIR`: the embedded default, shared by every process on one machine (docs/architecture.md §5.3).

`shm://` alone makes a fresh folder that the store removes on close (unless `keep()` is called); `shm://DIR`
opens (or makes) DIR and leaves it in place. The folder and everything done in it is ShmStorage's (storage.py);
this class is what a user opens: the URL and its options, and the folder's own calls (keep, path, pool_bytes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

from dataplane_rl.errors import ConfigError
from dataplane_rl.store.base import ColumnStore
from dataplane_rl.store.shm.arena import DEFAULT_ARENA, DEFAULT_PREFAULT, DEFAULT_SEGMENT, MiB
from dataplane_rl.store.shm.storage import DEFAULT_POOL_BYTES, OPTIONS, ShmStorage


class ShmStore(ColumnStore):
    scheme = "shm"
    # One block per put (up to the largest segment): a shard reader checksums only the pieces holding its
    # rows anyway, and gets one zero-copy slice per column instead of one per block and column.
    chunk_bytes = DEFAULT_SEGMENT

    def __init__(self, path: str | os.PathLike | None = None, *, pool_bytes: int = DEFAULT_POOL_BYTES,
                 arena_mb: int = DEFAULT_ARENA // MiB, prefault_mb: int = DEFAULT_PREFAULT // MiB,
                 create: bool = True) -> None:
        super().__init__(ShmStorage(path, pool_bytes=pool_bytes, arena_mb=arena_mb, prefault_mb=prefault_mb,
                                    create=create))

    @classmethod
    def from_url(cls, rest: str, **options: Any) -> "ShmStore":
        path, _, query = rest.partition("?")
        for key, value in parse_qsl(query):
            if key not in OPTIONS or not value.isdigit():
                known = "; ".join(f"{k}=N ({what})" for k, (_, what) in OPTIONS.items())
                raise ConfigError(f"shm://{rest}: unknown or bad option '{key}={value}'; the options are {known}")
            options.setdefault(key, int(value))
        return cls(path or None, **options)

    @property
    def path(self) -> Path:
        return self.storage.path

    def keep(self) -> None:
        """Leave the folder in place at close, even one made for `shm://` (data_plane.keep_partitions)."""
        self.storage.keep()

    def pool_bytes(self) -> int:
        """Bytes of dropped chunk files held for reuse (counted in /dev/shm usage)."""
        return self.storage.pool_bytes()
