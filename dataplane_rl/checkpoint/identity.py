"""Whose a checkpoint is: the run that saved it, the values its numbers depend on, and the data it trained on.

A run's id is made when it starts (`new_run_id`), kept in RUN_DIR/run.json and kept by `--resume`. Every
checkpoint's driver.json records (`record`) that id, the run folder, the value of every key that changes the
numbers (checkpoint/resume.py `numbers`) and the xxh3 of the contents of task.path and task.val_path. `--resume`
compares that record with the run it continues before Ray starts (`check`): a checkpoint another run saved (two
runs of one YAML sharing checkpointing.checkpoint_dir), one saved under other values, or data rewritten since the
save is one line naming both sides, unless the user says `--accept-mismatch`.
"""

from __future__ import annotations

import json
import secrets
import sys
from pathlib import Path

import xxhash

from dataplane_rl.checkpoint.files import CheckpointError, file_digest
from dataplane_rl.checkpoint.resume import numbers

RUN_FILE = "run.json"
ACCEPT = "--accept-mismatch"


class CheckpointMismatchError(CheckpointError):
    """A checkpoint is not the resumed run's: another run saved it, or the run's values or data differ from it."""


def new_run_id(run_dir: str | Path) -> str:
    """The folder's name and 8 random hex digits: two runs in folders of one name still differ."""
    return f"{Path(run_dir).name}-{secrets.token_hex(4)}"


def read_run_id(run_dir: str | Path | None) -> str | None:
    """The id RUN_DIR/run.json records; None for a folder made before runs recorded one (or no run)."""
    if run_dir is None:
        return None
    try:
        value = json.loads((Path(run_dir) / RUN_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def data_digest(path: str) -> str | None:
    """xxh3 of a data file's bytes, or of a folder's files (the ones the dataset task reads, else every file not
    hidden: each one's name, size and xxh3, in name order); None when nothing is there."""
    from dataplane_rl.errors import ConfigError
    from dataplane_rl.tasks.dataset_file import source_files

    p = Path(path)
    if p.is_file():
        return file_digest(p)
    if not p.is_dir():
        return None
    try:
        files = source_files(str(p))
    except ConfigError:  # a folder some other task (a task.module's) reads as it likes
        files = sorted(f for f in p.rglob("*") if f.is_file() and not f.name.startswith("."))
    h = xxhash.xxh3_64()
    for f in files:
        h.update(f"{f.relative_to(p).as_posix()}\0{f.stat().st_size}\0{file_digest(f)}\n".encode())
    return h.hexdigest()


def data_digests(cfg) -> dict[str, str | None]:
    """The digest of each data file the config names (task.path, task.val_path), by key."""
    named = {"task.path": cfg.task.path, "task.val_path": cfg.task.val_path}
    return {key: data_digest(path) for key, path in named.items() if path}


def record(cfg, run_id: str | None, run_dir: str | Path, data: dict | None = None) -> dict:
    """What each checkpoint of this run records about it; `data`: the digests, when already computed."""
    return {"id": run_id, "run_dir": str(Path(run_dir).absolute()), "config": numbers(cfg),
            "data": data_digests(cfg) if data is None else data}


def mismatch(saved, current: dict) -> tuple[str, str] | None:
    """(what differs, the fix) when the record `saved` is not of the run `current` describes; None when it is."""
    accept = f"pass {ACCEPT} to continue this run from its weights"
    if not isinstance(saved, dict):
        return ("records no run (it was saved before checkpoints recorded theirs)",
                f"if it is this run's, {accept}")
    if saved.get("id") != current["id"]:
        return (f"was saved by run {saved.get('id')} (in {saved.get('run_dir')}), not by this run {current['id']} "
                f"(in {current['run_dir']})", f"resume that run (--resume {saved.get('run_dir')}), or {accept}")
    old = saved.get("config") if isinstance(saved.get("config"), dict) else {}
    for key, value in current["config"].items():
        if key in old and old[key] != value:
            return (f"was saved with {key}={old[key]!r}, and this run has {value!r}",
                    f"set it back in {current['run_dir']}/config.yaml, or {accept}")
    then = saved.get("data") if isinstance(saved.get("data"), dict) else {}
    for key, digest in current["data"].items():
        if key in then and then[key] != digest:
            now = f"xxh3 {digest} now" if digest else "missing now"
            return (f"trained on {key}={current['config'].get(key)} with xxh3 {then[key]}, and its contents have "
                    f"changed ({now})",
                    f"restore the data the run trained on, or {accept} (the resumed steps then differ from an "
                    "unbroken run's)")
    return None


def check(cfg, path: Path, step: int, saved, run_id: str | None, accept: bool = False) -> dict:
    """Refuse (CheckpointMismatchError, one line) a checkpoint at `path` whose record `saved` is not of the run
    `cfg` resumes, or only say so on stderr when `accept`; returns this run's data digests."""
    current = record(cfg, run_id, cfg.logger.run_dir)
    why = mismatch(saved, current)
    if why is not None:
        line = f"--resume {cfg.logger.run_dir}: checkpoint step {step} ({path}) {why[0]}"
        if not accept:
            raise CheckpointMismatchError(f"{line}; {why[1]}")
        print(f"warning: {line}; resumed from it all the same ({ACCEPT})", file=sys.stderr, flush=True)
    return current["data"]
