"""What the recoveries see of the run's processes: two small protocols, which the Fleet (driver/fleet.py) implements.

faults/ sits below driver/ and imports none of it; each handler is typed against the part of the fleet it needs,
so a recovery cannot reach into the fleet's state, and a test can hand it a stand-in with only these methods.
"""

from __future__ import annotations

from typing import Protocol


class RolloutSlots(Protocol):
    """The rollout actors by slot (faults/rollout_actors.py)."""

    def actors(self) -> list:
        """The rollout actors' handles, by slot."""

    def where(self, slot: int) -> tuple[int, str | None]:
        """The PID and node IP of the actor in `slot`."""

    def replace_rollout(self, slot: int) -> int:
        """Kill the actor of `slot` and start a new one there; its PID. Raises what the new actor's start raised."""

    def open_rounds(self) -> list:
        """The rounds sent and not yet collected, in send order (rollout/worker.py Pending)."""

    def processes(self) -> dict:
        """Each rollout actor's and train rank's PID and node, and the run's own store processes (actors.json)."""


class TrainGroup(Protocol):
    """The train ranks and the run's store, as the in-run restarts see them (faults/restart.py, faults/train_ranks.py)."""

    def ranks(self) -> list:
        """The train ranks' actor handles, by rank."""

    def rank_where(self, rank: int) -> tuple[int | None, str | None]:
        """Train rank `rank`'s PID and node IP as recorded at start (None: not recorded)."""

    def generates_ahead(self) -> bool:
        """Whether rows are generated ahead of the trainer (async GRPO): their weights are gone once a step trains."""

    def store_address(self) -> str | None:
        """The run's store URL (None: the data plane is off)."""

    def dead_store_processes(self, e: BaseException | None) -> list[str]:
        """The dead processes of the run's own Mooncake store, described (faults/store.py dead_store)."""

    def reopen_store(self) -> str:
        """Replace the run's store with a new one that every actor opens; its URL."""

    def close(self, kill: bool = False) -> None:
        """Stop every process (kill: without asking them to close)."""
