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
        self.validation: list[dict] = []  # validation-only lines (grpo.val_at_start: step 0), not steps

    def log_step(self, metrics: dict, samples: list[dict]) -> None:
        step = int(metrics["step"])
        _atomic_write(self.path / "train_data" / f"step_{step:06d}.jsonl",
                      "".join(json.dumps(s) + "\n" for s in samples))
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.metrics.append(metrics)

    def log_validation(self, metrics: dict) -> None:
        """A metrics line that is not a training step (no train_data, not in steps_completed)."""
        with open(self.path / "metrics.jsonl", "a") as f:
            f.write(json.dumps(metrics) + "\n")
        self.validation.append(metrics)

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
        import matplotlib

        matplotlib.use("Agg")  # no display on training machines
        import matplotlib.pyplot as plt

        steps = [m["step"] for m in self.metrics]
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot(steps, [m["train/reward"] for m in self.metrics], marker="o", label="train/reward (all rounds)")
        ax.plot(steps, [m["train/filtered_reward"] for m in self.metrics], marker=".", label="train/filtered_reward")
        val = [m for m in self.validation + self.metrics if "validation/reward" in m]
        if val:
            ax.plot([m["step"] for m in val], [m["validation/reward"] for m in val], marker="s", linestyle="--",
                    label="validation/reward (held-out)")
        ax.set_xlabel("step")
        ax.set_ylabel("mean reward")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        tmp = self.path / "reward.tmp.png"
        fig.savefig(tmp, dpi=100)
        plt.close(fig)
        os.replace(tmp, self.path / "reward.png")
