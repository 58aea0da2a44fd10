"""What one GRPO step carries between its phases: its data-plane traffic, the groups it took, and its error."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from dataplane_rl.columns.rowsets import RowSet
from dataplane_rl.errors import DataPlaneError


class DynamicSamplingError(DataPlaneError):
    """Dynamic sampling (or async GRPO's staleness bound) could not collect enough groups."""


@dataclass
class StepIO:
    """Data-plane traffic of one step."""

    bytes_written: int = 0
    bytes_read: int = 0
    put_s: float = 0.0
    get_s: float = 0.0
    driver_bytes_read: int = 0
    timing: dict = field(default_factory=dict)

    def add(self, receipt: dict) -> None:
        self.bytes_written += int(receipt.get("bytes_written", 0))
        self.bytes_read += int(receipt.get("bytes_read", 0))
        self.put_s += float(receipt.get("put_s", 0.0))
        self.get_s += float(receipt.get("get_s", 0.0))


@dataclass
class Groups:
    """What collect_groups took for a step: whole groups, in order, and the per-sample scalars."""

    rs: RowSet                 # the kept rows, by partition
    scalars: pa.Table          # DRIVER_FIELDS of those rows, in row-set order
    pids: list[str]            # every round partition of the step (dropped at its end)
    rounds_rewards: list       # every generated reward, per round (train/reward)
    rounds_sources: list       # every generated sample's data_source, all rounds in order (train/reward/<data_source>)
    dropped_stale: int = 0     # rows older than the staleness bound
    groups_generated: int = 0  # every group of every round
    zero_advantage_groups: int = 0  # of those, the groups whose rewards are all equal
    in_flight_refits: int = 0  # refits that landed inside the generations of the step's rounds (receipts)
    token_versions: pa.Array | None = None  # token_policy_version of the kept rows (in-flight weight updates only)
    groups: list = field(default_factory=list)  # the step's new groups, each (pid, rows), in `rs` order
    advantages: np.ndarray | None = None  # the new groups' rows' advantages, in that order
    fresh: RowSet | None = None  # with replayed groups: the new groups' rows (rs: those, then the replayed ones)
    reused: list = field(default_factory=list)  # the replayed entries (driver/replay.py), in `rs` order after `fresh`
