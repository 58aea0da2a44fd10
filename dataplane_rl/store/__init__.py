"""Column stores behind one protocol, chosen by URL (docs/architecture.md §5).

    store = open_store("shm:///dev/shm/my-run")
    store.create_partition("step-000001", "grpo", num_rows=128)
    store.put("step-000001", {"total_reward": rewards}, rows=range(0, 128))
    table = store.get("step-000001", ["total_reward"], rows=range(0, 64))
"""

from __future__ import annotations

import importlib
from typing import Any

from dataplane_rl.errors import ConfigError
from dataplane_rl.store.arrow import (list_array, list_array_of_rows, pad_tokens, schema_table, to_numpy, token_rows,
                                      token_values)
from dataplane_rl.store.base import ColumnStore, PartitionStatus
from dataplane_rl.store.chunks import ChunkRef, PartitionMeta
from dataplane_rl.store.memory import MemoryStore

# scheme -> (module, class); optional backends are imported only when asked for
BACKENDS: dict[str, tuple[str, str]] = {
    "memory": ("dataplane_rl.store.memory", "MemoryStore"),
    "shm": ("dataplane_rl.store.shm", "ShmStore"),
    "mooncake": ("dataplane_rl.store.mooncake", "MooncakeStore"),
    "ray": ("dataplane_rl.store.ray_store", "RayStore"),
}


def open_store(url_or_store: str | ColumnStore, **options: Any) -> ColumnStore:
    """Open a store from a URL (memory://, shm://DIR, mooncake://HOST:PORT, ray://) or pass one through."""
    if isinstance(url_or_store, ColumnStore):
        return url_or_store
    if not isinstance(url_or_store, str) or "://" not in url_or_store:
        raise ConfigError(f"store {url_or_store!r} is neither a ColumnStore nor a URL; use memory://, "
                          "shm://DIR, mooncake://HOST:PORT or ray://")
    scheme, rest = url_or_store.split("://", 1)
    if scheme not in BACKENDS:
        raise ConfigError(f"unknown store scheme '{scheme}' in '{url_or_store}'; use one of "
                          + ", ".join(f"{s}://" for s in BACKENDS))
    module, cls = BACKENDS[scheme]
    backend = getattr(importlib.import_module(module), cls)
    return backend.from_url(rest, **options) if hasattr(backend, "from_url") else backend(rest, **options)


__all__ = ["BACKENDS", "ChunkRef", "ColumnStore", "MemoryStore", "PartitionMeta", "PartitionStatus",
           "list_array", "list_array_of_rows", "open_store", "pad_tokens", "schema_table", "to_numpy",
           "token_rows", "token_values"]
