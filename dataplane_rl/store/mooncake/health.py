"""What a Mooncake store lost, named (store.py): a dead holder, a full store, an unreachable master.

A self-started cluster's processes are polled (µs), so a dead holder is named at once. A client opened by
URL cannot poll them; it remembers the segments the master listed (one per live holder). When the master
drops a dead holder's segment (after its client_ttl) it drops every key in it, a partition's catalog keys
too, so the partition looks dropped though nobody dropped it, or (a commit's slot gone, later ones standing)
the rows of that commit look never written: a segment seen before and gone now says the data died with its
holder.
"""

from __future__ import annotations

from dataplane_rl.errors import StoreUnavailableError
from dataplane_rl.store.mooncake.client import NO_AVAILABLE_HANDLE, RPC_FAIL, TRANSFER_FAIL, error_name, list_segments
from dataplane_rl.store.mooncake.cluster import MooncakeCluster


class Health:
    """The store's view of its processes: `cluster` if it started one, else the master's segment list."""

    def __init__(self, cluster: MooncakeCluster | None, address: str, admin: str) -> None:
        self.cluster, self.address, self.admin = cluster, address, admin
        self.segments = self.mounted()

    def check(self, where: str) -> None:
        """A self-started cluster is polled (µs): a dead holder is named at once, not after a slow read."""
        if self.cluster is None:
            return
        try:
            self.cluster.check()
        except StoreUnavailableError as e:
            raise StoreUnavailableError(f"{where}: {e}\nThe data that process held died with it; close this store, "
                                        "open a new one and regenerate the partitions") from None

    def mounted(self) -> set[str] | None:
        """The segments the master lists now; None if its admin endpoint does not answer."""
        try:
            return set(list_segments(self.admin))
        except StoreUnavailableError:
            return None

    def lost(self) -> list[str]:
        """Segments seen before that the master no longer lists (none if it cannot be asked)."""
        now, seen = self.mounted(), self.segments
        if now is None:
            return []
        if seen is not None and seen - now:
            return sorted(seen - now)
        self.segments = now | (seen or set())
        return []

    def error(self, code: int, what: str, url: str) -> StoreUnavailableError:
        """The error for a Mooncake answer `code` to the operation `what`."""
        self.check(what)
        name = error_name(code)
        if code == NO_AVAILABLE_HANDLE:
            c = self.cluster
            room = f"{c.num_holders} holder(s) x {c.global_segment_size >> 20} MiB" if c else f"the holders of {url}"
            return StoreUnavailableError(f"{what}: mooncake store full ({name}; {room}): drop old partitions, or raise "
                                         "data_plane.mooncake.global_segment_size_mb or num_holders")
        if code == RPC_FAIL:
            return StoreUnavailableError(f"{what}: the Mooncake master at {self.address} is unreachable ({name}); "
                                         "restart it (its data is lost) and regenerate the partitions")
        if code == TRANSFER_FAIL:
            return StoreUnavailableError(f"{what}: a Mooncake holder is unreachable ({name}): data died with its "
                                         "holder; restart the store and regenerate the partitions")
        return StoreUnavailableError(f"{what}: Mooncake answered {name}")
