"""Async GRPO's rounds generated ahead of the trainer, saved with a checkpoint and loaded back on resume.

When a checkpoint of step k is saved, steps k+1..k+1+age have been sent to the rollout actors, each with
the weights of the version it was sent after (driver/rollouts.py). The save WAITS for them rather than
reissuing them on resume: the wait is bounded by the age (at most age+1 batches), the rows are exactly
those the uninterrupted run trains on, and reissuing would need every older weight version kept. Their
rollout columns go to partitions/<pid>.arrow (Arrow IPC, covered by the checkpoint's manifest), and the
schedule (which step each partition is, its jobs and receipts) into driver.json. On resume they are put
back into the new run's store, whatever its backend, and the step loop takes them as if never stopped.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa

from dataplane_rl.rollout.worker import RolloutJob
from dataplane_rl.columns.rowsets import write
from dataplane_rl.checkpoint.files import CheckpointError
from dataplane_rl.rollout.worker import Pending


def _done(receipts: list[dict]) -> list:
    """Futures that are already resolved: the data is in the store, so a collect returns these receipts."""
    import ray

    return [ray.put((None, r)) for r in receipts]


def save_ahead(fleet, folder: Path) -> list[dict]:
    """Wait for every round sent ahead, write its rollout columns under `folder`; the schedule entries."""
    r = fleet.rollouts
    if not r.pending:
        return []
    (folder / "partitions").mkdir(mode=0o700)
    entries = []
    for step in sorted(r.pending):
        p = r.pending[step]
        receipts = r.collect(p)  # lands the rows in the store (the data plane off: from the futures)
        p.futures = _done(receipts)  # the step that takes it later sees the same receipts, no second write
        failed = [row for receipt in receipts for row in receipt.get("failed_rows", ())]  # never written
        size = sum(len(j.prompts) for j in p.jobs) * p.G
        written = np.setdiff1d(np.arange(size), failed) if failed else None
        table = fleet.store.get(p.pid, r.fields, written)
        rel = f"partitions/{p.pid}.arrow"
        write_table(folder / rel, table)
        entries.append({"pid": p.pid, "step": p.step, "G": p.G, "rows": table.num_rows, "file": rel,
                        "jobs": [asdict(j) for j in p.jobs], "receipts": receipts,
                        **({"size": size, "written": written.tolist()} if failed else {})})
    return entries


def write_table(path: Path, table: pa.Table) -> None:
    """A partition's columns as an Arrow IPC file (shaped token columns keep their fixed_size_list types)."""
    with pa.OSFile(str(path), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        w.write_table(table)


def read_table(folder: Path, file: str, rows: int) -> pa.Table:
    """A saved partition's columns (an Arrow IPC file: no code runs on reading it), checked to be inside the
    checkpoint `folder` and to hold `rows` rows."""
    if Path(file).is_absolute() or ".." in Path(file).parts:
        raise CheckpointError(f"{folder}/driver.json: partition file {file!r} is outside the checkpoint")
    path = folder / file
    try:
        with pa.memory_map(str(path)) as f:
            table = pa.ipc.open_file(f).read_all()
    except (OSError, pa.ArrowInvalid) as err:
        raise CheckpointError(f"{path}: not an Arrow IPC file ({err})") from None
    if table.num_rows != rows:
        raise CheckpointError(f"{path}: {table.num_rows} rows, driver.json says {rows}")
    return table


def check_partitions(folder: Path, entries: list) -> None:
    """Parse every saved partition and its schedule entry (before Ray starts)."""
    try:
        for e in entries:
            read_table(folder, e["file"], e["rows"])
            for j in e["jobs"]:
                RolloutJob(**j)
    except (KeyError, TypeError, AttributeError) as err:
        raise CheckpointError(f"{folder}/driver.json: not a checkpoint's schedule ({type(err).__name__}: {err})") from None


def restore_ahead(fleet, folder: Path, entries: list) -> None:
    """Put the saved rounds into this run's store and schedule them for their steps."""
    for e in entries:
        table = read_table(folder, e["file"], e["rows"])
        fleet.store.create_partition(e["pid"], fleet.schema, e.get("size", e["rows"]))
        written = np.asarray(e["written"], np.int64) if "written" in e else np.arange(e["rows"])  # failed groups: not
        write(fleet.store, [(e["pid"], written)], table)
        jobs = [RolloutJob(**j) for j in e["jobs"]]
        fleet.rollouts.put_ahead(Pending(e["pid"], e["step"], e["G"], jobs, _done(e["receipts"])))
