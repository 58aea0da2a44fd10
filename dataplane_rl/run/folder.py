"""The run folder (docs/run-folder.md): config.yaml, metrics.jsonl, train_data/, reward.png, summary.json.

Every file is appended line by line or written atomically, so an interrupted run leaves a folder whose
files are each whole.

Who may write a folder (the policy, docs/run-folder.md):
- no `logger.run_dir`: a fresh `runs/YYYYmmdd-HHMMSS` (suffix -2, -3, ... if taken); `runs/latest` points
  at it once the run has started, and a run that fails before that removes the folder again;
- a folder that already holds a run is refused unless `overwrite` (or, with `--resume`, reopened:
  `resume_from` drops what a killed run logged after its checkpoint);
- a live run holds an flock on `RUN_DIR/.lock`, which names its PID; a second one is refused;
- `open` removes nothing: an overwritten run's files go only in `begin`, once the run has really started,
  and a failure before that still writes `summary.json` (status failed, `started: false`) in a folder the
  user named.
- `store.json` names the run's store from the start (`dataplane-rl store ls RUN_DIR` on a live run).
- `run.json` holds the run's id, made when it starts and kept by --resume: its checkpoints record it
  (checkpoint/identity.py), so a resume can tell its own checkpoints from another run's.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import math
import os
import shutil
import time
import traceback
from pathlib import Path

from dataplane_rl.checkpoint.identity import RUN_FILE, new_run_id, read_run_id
from dataplane_rl.errors import ConfigError, one_line, strip_ansi

RUN_FILES = ("config.yaml", "metrics.jsonl", "summary.json")
_STALE = ("metrics.jsonl", "summary.json", "reward.png", "store.json", "trace.json")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:  # a full disk: no half-written .tmp left beside the file
        tmp.unlink(missing_ok=True)


def fresh_run_dir(root: str | Path = "runs") -> Path:
    """Make `root/YYYYmmdd-HHMMSS` (or -2, -3, ...; mkdir decides, so two runs never share one)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for i in range(1, 1000):
        path = root / (stamp if i == 1 else f"{stamp}-{i}")
        try:
            path.mkdir()
            break
        except FileExistsError:
            continue
    else:
        raise ConfigError(f"{root}: 999 runs started in second {stamp}; set logger.run_dir")
    return path


def link_latest(path: Path) -> None:
    """Point `latest` next to `path` at it."""
    root = path.parent
    latest, tmp = root / "latest", root / f".latest-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(path.name, tmp)
    try:
        os.replace(tmp, latest)  # atomic: readers see the old run or the new one
    except OSError:  # runs/latest is a real folder (an older layout): leave it alone
        tmp.unlink(missing_ok=True)


def holds_run(path: Path) -> bool:
    """A folder holds a run when it has any run file, unless all it has is the summary of a run that
    failed before it started (nothing to lose: the next run may take the folder)."""
    present = [f for f in RUN_FILES if (path / f).exists()]
    if present == ["summary.json"]:
        try:
            return json.loads((path / "summary.json").read_text()).get("started", True) is not False
        except (OSError, ValueError, AttributeError):
            return True
    return bool(present)


def _parse(line: str) -> dict | None:
    """A metrics line, or None for one a kill cut short (the last, of a step after the checkpoint)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


class _Steps:
    """Per step, the metrics summary.json and reward.png read, as float arrays (NaN: not logged that step;
    validation/reward is logged only every grpo.val_period steps); the last step's metrics whole."""

    KEYS = ("step", "train/reward", "train/filtered_reward", "train/loss", "train/kl_penalty", "train/entropy",
            "validation/reward")

    def __init__(self) -> None:
        self.cols = {k: array.array("d") for k in self.KEYS}
        self.last: dict | None = None

    def add(self, m: dict) -> None:
        """A step's line; a step logged again (run again after an in-run resume: faults/restart.py) replaces its
        earlier line and those of the steps after it: the last line of a step is the one that counts."""
        steps = self.cols["step"]
        keep = len(steps)
        while keep and steps[keep - 1] >= m["step"]:
            keep -= 1
        for col in self.cols.values():
            del col[keep:]
        for k, col in self.cols.items():
            v = m.get(k)
            col.append(float(v) if isinstance(v, (int, float)) else math.nan)
        self.last = m

    def __len__(self) -> int:
        return len(self.cols["step"])

    def rows(self) -> list[dict]:
        n = len(self)
        out = []
        for i in range(n):
            if i == n - 1 and self.last is not None:
                out.append(self.last)
                continue
            row = {k: col[i] for k, col in self.cols.items() if not math.isnan(col[i])}
            row["step"] = int(row["step"])
            out.append(row)
        return out


class RunDir:
    """A run folder, locked for this process from `__init__` until `close`."""

    def __init__(self, path: str | Path | None, *, overwrite: bool = False, resume: bool = False) -> None:
        self.fresh = not path  # ours alone: made here, linked as latest only once the run starts
        self.path = Path(path) if path else fresh_run_dir()
        self.overwrite = overwrite
        self.started = False
        self._steps = _Steps()  # what summary.json and reward.png need of every step, not every metric
        self.validation: list[dict] = []  # validation-only lines (grpo.val_at_start: step 0), not steps
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"logger.run_dir={self.path}: cannot make the run folder ({e.strerror}); "
                              "choose a writable folder") from None
        if not self.path.is_dir():
            raise ConfigError(f"logger.run_dir={self.path} is not a folder; choose a folder")
        self._lock_fd = self._lock()
        if not overwrite and not resume and holds_run(self.path):
            self.close()
            raise ConfigError(f"logger.run_dir={self.path} already holds a run; continue it with "
                              f"`dataplane-rl train --resume {self.path}`, replace it with logger.overwrite=true, "
                              "or leave logger.run_dir unset for a fresh runs/<time> folder")
        # a resume continues the run (a folder from before runs had ids gets one); any other start is a new run
        self.run_id = (read_run_id(self.path) if resume else None) or new_run_id(self.path)

    def _lock(self) -> int:
        lock = self.path / ".lock"
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"logger.run_dir={self.path} is in use by a live run (PID {holder}, which holds "
                              f"{lock}); wait for it, or choose another logger.run_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def begin(self, config_yaml: str) -> None:
        """The run has started: only now replace an overwritten run's files, and write the config."""
        if self.overwrite:
            for stale in _STALE:
                (self.path / stale).unlink(missing_ok=True)
            for old in self._step_files():
                old.unlink()
            # the replaced run's checkpoints: left, a --resume of this run could find one of them the latest
            # (a shared checkpointing.checkpoint_dir holds a folder per run, which stays)
            for old in (*(self.path / "checkpoints").glob("step_*"), *(self.path / "checkpoints").glob(".step_*.tmp")):
                shutil.rmtree(old, ignore_errors=True)
        (self.path / "train_data").mkdir(exist_ok=True)
        _atomic_write(self.path / RUN_FILE, json.dumps({"run_id": self.run_id}) + "\n")
        _atomic_write(self.path / "config.yaml", config_yaml)
        self.started = True
        if self.fresh:
            link_latest(self.path)

    def _step_files(self) -> list[Path]:
        """Each step's files: train_data/step_N.jsonl and (logger.save_rollouts) rollouts/step_N.parquet."""
        return [*(self.path / "train_data").glob("step_*.jsonl"), *(self.path / "rollouts").glob("step_*.parquet")]

    def record_store(self, url: str | None) -> None:
        """store.json: the store this run's partitions live in while it runs (None: the data plane is off),
        for `dataplane-rl store ls RUN_DIR` before summary.json exists."""
        _atomic_write(self.path / "store.json", json.dumps({"store_url": url}) + "\n")

    def close(self) -> None:
        """Release the lock (also released by the OS if the process dies)."""
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def resume_from(self, config_yaml: str, step: int) -> None:
        """`begin` for --resume from the checkpoint of `step`: the steps a killed run logged after it are
        dropped (they are run again), so metrics.jsonl, train_data/ and rollouts/ have each step once."""
        metrics = self.path / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.is_file() else []
        kept = [m for m in map(_parse, lines) if m is not None and m["step"] <= step]
        self._steps = _Steps()
        for m in kept:
            if "train/reward" in m:
                self._steps.add(m)
        self.validation = [m for m in kept if "train/reward" not in m]  # grpo.val_at_start's step-0 line
        _atomic_write(metrics, "".join(json.dumps(m) + "\n" for m in kept))
        (self.path / "train_data").mkdir(parents=True, exist_ok=True)
        for f in self._step_files():
            if int(f.stem.split("_")[1]) > step:
                f.unlink()
        (self.path / "summary.json").unlink(missing_ok=True)
        _atomic_write(self.path / RUN_FILE, json.dumps({"run_id": self.run_id}) + "\n")
        _atomic_write(self.path / "config.yaml", config_yaml)
        self.started = True

    def log_step(self, metrics: dict, samples: list[dict]) -> None:
        step = int(metrics["step"])
        _atomic_write(self.path / "train_data" / f"step_{step:06d}.jsonl",
                      "".join(json.dumps(s) + "\n" for s in samples))
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self._steps.add(metrics)

    @property
    def metrics(self) -> list[dict]:
        """Every step so far with the metrics summary.json and reward.png use (the last step: all of them),
        built on demand: the run keeps ~60 bytes a step, not each step's ~100 metrics (the driver grew
        ~6 kB a step through a 1000-step soak when it kept them all)."""
        return self._steps.rows()

    def log_validation(self, metrics: dict) -> None:
        """A metrics line that is not a training step (no train_data, not in steps_completed)."""
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.validation.append(metrics)

    def record_error(self, e: BaseException) -> str:
        """The summary's error: one line, no colour codes, no remote traceback; the whole traceback (a
        Ray task's remote one included) goes to error.log in the run folder, which the line names."""
        line = one_line(e)
        if self.started:  # a run refused before it started leaves the folder's files as they were
            log = self.path / "error.log"
            try:
                _atomic_write(log, strip_ansi("".join(traceback.format_exception(e))))
                line = f"{line} (traceback: {log})"
            except OSError as why:  # a folder that cannot take it still gets the summary
                line = f"{line} (no traceback: {log} could not be written: {why.strerror or why})"
            with contextlib.suppress(AttributeError, TypeError):
                e.run_error = line  # the command's `error:` line is the summary's (cli/main.py)
        return line

    def finish(self, status: str, error: str | None = None, extra: dict | None = None) -> dict:
        """Write summary.json and reward.png; returns the summary. A fresh folder of a run that never
        started is removed instead: nothing ran, and runs/latest keeps naming the last run that did."""
        metrics = self.metrics  # built once: each access rebuilds every step's row
        rewards = [m["train/reward"] for m in metrics]
        k = max(1, len(rewards) // 4)
        summary = {
            "status": status,
            "error": error,
            "started": self.started,
            "steps_completed": len(metrics),
            "first_reward": rewards[0] if rewards else None,
            "last_reward": rewards[-1] if rewards else None,
            "reward_first_quarter": sum(rewards[:k]) / k if rewards else None,
            "reward_last_quarter": sum(rewards[-k:]) / k if rewards else None,
            "final_metrics": metrics[-1] if metrics else None,
            "final_validation_reward": next((m["validation/reward"] for m in reversed([*self.validation, *metrics])
                                             if "validation/reward" in m), None),
            **(extra or {}),
        }
        if self.fresh and not self.started:
            shutil.rmtree(self.path, ignore_errors=True)
            with contextlib.suppress(OSError):  # runs/ itself, if this attempt made it and nothing else is there
                self.path.parent.rmdir()
            return summary
        if metrics:
            summary["plot"] = str(self.path / "reward.png")
        try:
            _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")
            if metrics:
                self.plot(metrics)
        except OSError as e:  # a full disk: the run's end is told in one line all the same
            import sys

            summary["summary_error"] = (f"{self.path / 'summary.json'} or reward.png could not be written: "
                                        f"{e.strerror or e}")
            print(f"error: {summary['summary_error']}; the run ended {status}" + (f": {error}" if error else ""),
                  file=sys.stderr, flush=True)
        return summary

    def plot(self, metrics: list[dict]) -> None:
        import yaml

        from dataplane_rl.run.plot import run_title, save_reward_png

        config = yaml.safe_load((self.path / "config.yaml").read_text()) or {}
        save_reward_png(metrics, run_title(config, len(metrics)), self.path / "reward.png", self.validation)
