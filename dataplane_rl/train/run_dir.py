"""The run folder (DESIGN §7): config.yaml, metrics.jsonl, train_data/, reward.png, summary.json.

Every file is appended line by line or written atomically, so an interrupted run leaves a folder whose
files are each whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class RunDir:
    def __init__(self, path: str | Path, config_yaml: str) -> None:
        self.path = Path(path)
        (self.path / "train_data").mkdir(parents=True, exist_ok=True)
        for stale in ("metrics.jsonl", "summary.json", "reward.png"):
            (self.path / stale).unlink(missing_ok=True)
        for old in (self.path / "train_data").glob("step_*.jsonl"):
            old.unlink()
        _atomic_write(self.path / "config.yaml", config_yaml)
        self.metrics: list[dict] = []

    def log_step(self, metrics: dict, samples: list[dict]) -> None:
        step = int(metrics["step"])
        _atomic_write(self.path / "train_data" / f"step_{step:06d}.jsonl",
                      "".join(json.dumps(s) + "\n" for s in samples))
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.metrics.append(metrics)

    def finish(self, status: str, error: str | None = None, extra: dict | None = None) -> dict:
        rewards = [m["train/reward"] for m in self.metrics]
        k = max(1, len(rewards) // 4)
        summary = {
            "status": status,
            "error": error,
            "steps_completed": len(self.metrics),
            "first_reward": rewards[0] if rewards else None,
            "last_reward": rewards[-1] if rewards else None,
            "reward_first_quarter": sum(rewards[:k]) / k if rewards else None,
            "reward_last_quarter": sum(rewards[-k:]) / k if rewards else None,
            "final_metrics": self.metrics[-1] if self.metrics else None,
            **(extra or {}),
        }
        _atomic_write(self.path / "summary.json", json.dumps(summary, indent=2) + "\n")
        if self.metrics:
            self.plot()
        return summary

    def plot(self) -> None:
        import yaml

        from dataplane_rl.train.plot import run_title, save_reward_png

        config = yaml.safe_load((self.path / "config.yaml").read_text()) or {}
        save_reward_png(self.metrics, run_title(config, len(self.metrics)), self.path / "reward.png")
