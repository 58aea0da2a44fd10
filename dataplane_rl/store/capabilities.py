"""What a store can say about itself beyond columns: every store answers, with the defaults here.

A backend that differs overrides the method (mooncake:// runs processes of its own; shm:// can keep its folder),
so the driver and faults/ ask the store instead of probing for attributes.
"""

from __future__ import annotations


class Capabilities:
    def keep(self) -> None:
        """Leave the data in place at close (data_plane.keep_partitions); by default close frees nothing kept."""

    def processes(self) -> list[dict]:
        """The processes this store started (actors.json's `store`: process, pid, node[, index])."""
        return []

    def dead_processes(self) -> list[str] | None:
        """Health: each of its own processes that has exited, described (empty: all alive); None: it has none
        whose death loses rows."""
        return None

    def stop_processes(self) -> None:
        """Stop its own processes even after a failed close (a store that lost one is being replaced)."""
