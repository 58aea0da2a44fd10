"""The group replay buffer's part of a checkpoint: its state, and the rows of every group it holds.

The buffer (driver/replay.py) holds references, not rows; a checkpoint must hold the rows, since a resumed run
(or an in-run resume after a lost store) opens a new store. Each pinned partition's rows that an entry refers
to go to replay/<pid>.arrow with every column written on all of them (rollout, driver and policy columns alike:
a replayed group trains on its stored advantages and log-probs), and the buffer's state (entries, use counts,
its RNG) into driver.json. On resume the partitions are made again in the new store, at the same size and rows,
so every entry's reference holds as it did.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dataplane_rl.checkpoint.ahead import read_table, write_table
from dataplane_rl.checkpoint.files import CheckpointError
from dataplane_rl.columns.rowsets import write
from dataplane_rl.store.parquet import written_fields

FOLDER = "replay"


def save_replay(store, replay, folder: Path) -> dict | None:
    """The buffer's state and its groups' rows, written under `folder`; None without a buffer."""
    if replay is None:
        return None
    state = replay.state_dict()
    rows: dict[str, set[int]] = {}
    for e in state["entries"]:
        rows.setdefault(e["pid"], set()).update(e["rows"])
    parts = []
    if rows:
        (folder / FOLDER).mkdir(mode=0o700)
    for pid in sorted(rows):
        held = np.array(sorted(rows[pid]), dtype=np.int64)
        table = store.get(pid, written_fields(store, pid, held), held)
        rel = f"{FOLDER}/{pid}.arrow"
        write_table(folder / rel, table)
        parts.append({"pid": pid, "size": store.num_rows(pid), "rows": held.tolist(), "file": rel})
    return {"state": state, "partitions": parts}


def check_replay(folder: Path, saved: dict | None) -> None:
    """Parse the buffer's part of driver.json and every saved partition (before Ray starts)."""
    if saved is None:
        return
    try:
        for p in saved["partitions"]:
            read_table(folder, p["file"], len(p["rows"]))
            if not 0 <= min(p["rows"]) <= max(p["rows"]) < int(p["size"]):
                raise CheckpointError(f"{folder}/driver.json: replay partition {p['pid']} rows outside its size")
        held = {p["pid"]: set(p["rows"]) for p in saved["partitions"]}
        for e in saved["state"]["entries"]:
            if not set(e["rows"]) <= held.get(e["pid"], set()):
                raise CheckpointError(f"{folder}/driver.json: replay entry of {e['pid']} refers to rows not saved")
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{folder}/driver.json: not a checkpoint's replay buffer ({type(err).__name__}: {err})") from None


def restore_replay(store, schema, folder: Path, saved: dict | None, replay) -> None:
    """Put the saved groups' rows into this run's store and the buffer's state into `replay`. A checkpoint of a
    run without the buffer resumes into an empty one; one with it, into a run without it, is refused."""
    if replay is None:
        if saved is not None and saved["state"]["entries"]:
            raise CheckpointError(f"{folder}: the checkpoint holds a group replay buffer; resume with "
                                  "grpo.replay.enabled=true, as the run was")
        return
    if saved is None:
        return
    live = set(store.list_partitions())
    for p in saved["partitions"]:
        rows = np.asarray(p["rows"], dtype=np.int64)
        if p["pid"] in live:  # a named store the killed run used: its copy may lack cells; the checkpoint's rows rule
            store.drop_partition(p["pid"])
        store.create_partition(p["pid"], schema, int(p["size"]))
        write(store, [(p["pid"], rows)], read_table(folder, p["file"], len(rows)))
    replay.load_state_dict(saved["state"])
