"""Distributed checkpoints: one manager decides what is saved, as `Stateful` objects (STYLE §13).

A checkpoint is a folder RUN_DIR/checkpoints/step_NNNNNN/ (with checkpointing.checkpoint_dir=DIR set,
DIR/RUN_ID/step_NNNNNN/: runs sharing DIR never replace or prune each other's) holding
  train/          torch.distributed.checkpoint: each train rank writes its own model/optimizer shards and RNG
                  (what a rank saves: train/state.py);
                  loaded resharded for any policy.dp_size
  driver.json     the driver's state: step, its RNG, every rollout actor's RNG, the async schedule, and the
                  record of the run that saved it (checkpoint/identity.py), which --resume checks
  partitions/     async GRPO: the rounds generated ahead of the trainer, as Arrow IPC (checkpoint/ahead.py)
  config.yaml     the run's resolved config
  manifest.json   every other file with its size and xxh3, written last (checkpoint/files.py)
It is written under a hidden temporary name and renamed when complete, so a crash during a save leaves
the previous checkpoint the latest one; a leftover temporary folder is removed by the next save. Resume and
export verify the manifest before they load anything, and load no pickled code.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import warnings
from pathlib import Path

from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from dataplane_rl import trace
from dataplane_rl.errors import ConfigError
from dataplane_rl.checkpoint.files import CheckpointError, damage, dcp_load, read_dcp_metadata, read_json, write_manifest
from dataplane_rl.rng import RNGState

_NAME = re.compile(r"^step_(\d{6,})$")
DRIVER = "driver.json"


def check_plain_items(path: Path) -> None:
    """Read every non-tensor item of a DCP folder with weights_only=True, in this process: a crafted item is
    refused here, before any actor starts, naming the file."""
    meta = read_dcp_metadata(path)
    items = {k: None for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    with single_process():
        dcp_load(items, path, no_dist=True)


@contextlib.contextmanager
def single_process():
    """The driver is in no process group: DCP warns on every no_dist call that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def step_of(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


class CheckpointManager:
    """Saves, finds, verifies and prunes the checkpoints of one run; the driver calls it between steps."""

    def __init__(self, root: str | Path, keep_top_k: int | None = None, record: dict | None = None) -> None:
        # absolute: the train workers write their shards from their own working directory (Ray's), so a
        # relative logger.run_dir would put them somewhere the driver never looks
        self.root = Path(root).absolute()
        self.keep_top_k = keep_top_k
        self.record = record  # the saving run's (checkpoint/identity.py), written into every driver.json

    @classmethod
    def for_config(cls, cfg, run_id: str | None = None, record: dict | None = None) -> "CheckpointManager":
        """The checkpoints of the run `run_id` (RUN_DIR/run.json) of `cfg`: RUN_DIR/checkpoints, the run's own
        folder, or a folder of the run's own inside a checkpointing.checkpoint_dir that other runs may share."""
        c = cfg.checkpointing
        if c.checkpoint_dir:
            root = Path(c.checkpoint_dir) / run_id if run_id else Path(c.checkpoint_dir)  # no id: an older run's
        else:
            root = Path(cfg.logger.run_dir) / "checkpoints"
        return cls(root, c.keep_top_k, record)

    def all(self) -> list[Path]:
        """Checkpoint folders, oldest first (temporary folders never match the name)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if _NAME.match(p.name) and p.is_dir()), key=step_of)

    def find(self, step: int | None = None) -> Path:
        """The checkpoint of `step` (default: the latest), its bytes verified against its manifest."""
        done = self.all()
        if not done:
            raise ConfigError(f"no complete checkpoint in {self.root}; the run saved none there (checkpointing."
                              "enabled was false, it died before checkpointing.save_period steps, or checkpointing."
                              "checkpoint_dir names another folder than the one it saved into)")
        path = done[-1] if step is None else next((p for p in done if step_of(p) == step), None)
        if path is None:
            raise ConfigError(f"no checkpoint of step {step} in {self.root}; have steps {[step_of(p) for p in done]}")
        self.verify(path)
        return path

    def verify(self, path: Path) -> None:
        """Raise one line naming the damaged file and the step, offering the newest checkpoint that verifies."""
        why = damage(path)
        if why is None:
            return
        good = next((p for p in reversed(self.all()) if p != path and damage(p) is None), None)
        offer = (f"the newest complete checkpoint is step {step_of(good)} (export --step {step_of(good)}; to resume "
                 f"from it, move {path} out of {self.root})" if good else "no other checkpoint of this run verifies")
        raise CheckpointError(f"checkpoint step {step_of(path)} ({path}): {why}; {offer}")

    def check(self, path: Path) -> dict:
        """Everything a resume reads, read here before Ray starts, with no code run: returns driver.json."""
        driver = read_json(path / DRIVER)
        check_plain_items(path / "train")
        from dataplane_rl.checkpoint.ahead import check_partitions
        from dataplane_rl.checkpoint.replay import check_replay

        check_partitions(path, driver.get("ahead", []))
        check_replay(path, driver.get("replay"))
        return driver

    @trace.traced("checkpoint")
    def save(self, fleet, step: int, config_yaml: str, replay=None) -> Path:
        """Save every process's state through `fleet`'s interface (driver/fleet.py) as checkpoint `step`, and the
        group replay buffer `replay` (driver/replay.py; None: off) with the rows it refers to."""
        import json

        from dataplane_rl.checkpoint.ahead import save_ahead
        from dataplane_rl.checkpoint.replay import save_replay

        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".step_*.tmp"):  # what a crashed save left behind
            shutil.rmtree(stale, ignore_errors=True)
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f".{final.name}.tmp"
        try:
            tmp.mkdir(mode=0o700)
            fleet.call_ranks("save_checkpoint", str(tmp / "train"))  # a dead rank: at once
            driver = {"step": step, "rng": RNGState().state_dict(),
                      "rollout_rng": fleet.call_rollouts(f"step {step}: checkpoint", "rng_state"),
                      "ahead": save_ahead(fleet, tmp), "replay": save_replay(fleet.store, replay, tmp)}
            if self.record is not None:
                driver["run"] = self.record
            (tmp / DRIVER).write_text(json.dumps(driver))
            (tmp / "config.yaml").write_text(config_yaml)
            write_manifest(tmp, step)  # last: a folder without it is incomplete
            if final.exists():  # a resumed run saving a step again
                shutil.rmtree(final)
            os.replace(tmp, final)  # the checkpoint appears whole or not at all
        except BaseException as e:
            # torch's writer says "unexpected pos 704 vs 598", not ENOSPC: the room left tells, before the
            # half-written checkpoint is removed (nothing of it is left; its room is needed now)
            full = disk_full(e) if isinstance(e, Exception) else None
            if full is None and isinstance(e, Exception) and free_bytes(self.root) < FULL_BELOW_BYTES:
                full = os.strerror(errno.ENOSPC)
            shutil.rmtree(tmp, ignore_errors=True)
            if full is None:
                raise
            raise CheckpointError(f"the checkpoint of step {step} could not be written to {self.root}: {full} "
                                  f"({free_text(self.root)}); free space there or set checkpointing.checkpoint_dir "
                                  "to a larger disk, then resume") from e
        self.prune()
        return final

    @trace.traced("checkpoint_load")
    def load(self, fleet, path: Path, driver: dict | None = None, replay=None) -> int:
        """Restore every process from `path` (verified by find) and refit the rollout actors with its weights;
        returns its step. `--resume` and an in-run resume (faults/restart.py) both come here. Rollout actors
        beyond the saving run's number keep their seeded RNG: generation is seeded per sample, so no number
        depends on it. `replay`: the run's group replay buffer (None: off), given the checkpoint's state and rows."""
        from dataplane_rl.checkpoint.ahead import restore_ahead
        from dataplane_rl.checkpoint.replay import restore_replay

        driver = driver if driver is not None else self.check(path)
        fleet.call_ranks("load_checkpoint", str(path / "train"))
        RNGState().load_state_dict(driver["rng"])
        states = driver["rollout_rng"][:fleet.cfg.generation.num_workers]
        states += [None] * (fleet.cfg.generation.num_workers - len(states))  # more actors than saved: seeded RNG
        fleet.call_rollouts(f"resume at step {driver['step']}", "set_rng_state", states)
        restore_ahead(fleet, path, driver.get("ahead", []))  # async: the rounds generated ahead
        restore_replay(fleet.store, fleet.schema, path, driver.get("replay"), replay)
        fleet.resume_at(int(driver["step"]))  # the rollout actors get the checkpoint's weights
        return int(driver["step"])

    def prune(self) -> None:
        if self.keep_top_k is None:
            return
        for old in self.all()[:-self.keep_top_k]:
            shutil.rmtree(old, ignore_errors=True)


def disk_full(e: BaseException) -> str | None:
    """'No space left on device' (or the quota's words) if `e`, its causes or the error inside a Ray task that
    it wraps, is a full filesystem; else None. The train ranks write their shards remotely, so the OSError
    may reach the driver only as text."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return e.strerror or os.strerror(e.errno)
        for words in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)):
            if words in str(e):
                return words
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    return None


FULL_BELOW_BYTES = 1 << 20  # a failed save with less room than this left was a full disk


def free_bytes(path: Path) -> int:
    """Bytes this user may still write to `path`'s filesystem (a huge number if unknown: never 'full')."""
    try:
        st = os.statvfs(path)
    except OSError:
        return 1 << 62
    return st.f_bavail * st.f_frsize


def free_text(path: Path) -> str:
    from dataplane_rl.units import human_bytes

    return f"{human_bytes(free)} free after removing the partial checkpoint" if (free := free_bytes(path)) < 1 << 62 \
        else "free space unknown"
