"""reward.png: the run at a glance. One function draws it; add a series where its panel is drawn."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def run_title(config: dict, steps_done: int) -> str:
    """'GRPO repeat · model tiny · 12/30 steps' from the resolved config."""
    task, model = config.get("task", {}), config.get("policy", {})
    name = task.get("name", "?") + (f" ({Path(task['path']).name})" if task.get("path") else "")
    total = config.get("grpo", {}).get("max_num_steps", "?")
    return f"GRPO {name} · model {Path(str(model.get('model', '?'))).name} · {steps_done}/{total} steps"


def reward_figure(metrics: list[dict], title: str, validation: list[dict] = ()):
    """Two panels over the steps: the rewards (and held-out validation where logged, `validation` adding
    lines that are not steps, e.g. step 0), then loss, KL penalty and entropy."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [m["step"] for m in metrics]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    fig.suptitle(title)

    reward = np.array([m["train/reward"] for m in metrics])
    filtered = np.array([m["train/filtered_reward"] for m in metrics])
    if np.allclose(reward, filtered, rtol=0, atol=1e-9):
        # nothing was filtered: one line that says so, not two drawn on top of each other
        top.plot(steps, reward, marker="o", label="train/reward = train/filtered_reward (no rows filtered)")
    else:
        top.plot(steps, reward, marker="o", label="train/reward (all rounds)")
        top.plot(steps, filtered, marker=".", label="train/filtered_reward (rows trained on)")
    val = [m for m in [*validation, *metrics] if "validation/reward" in m]
    if val:
        top.plot([m["step"] for m in val], [m["validation/reward"] for m in val], marker="s", linestyle="--",
                 label="validation/reward (held-out, greedy by default)")
    top.set_ylabel("mean reward")
    top.grid(alpha=0.3)
    top.legend(fontsize="small")

    # entropy (~ln V at the start) on its own axis, so loss and KL keep a readable scale
    right = bottom.twinx()
    lines = []
    for ax, key, color in ((bottom, "train/loss", "C0"), (bottom, "train/kl_penalty", "C1"),
                           (right, "train/entropy", "C2")):
        if all(key in m for m in metrics):
            lines += ax.plot(steps, [m[key] for m in metrics], marker=".", color=color, label=key)
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    bottom.set_ylabel("loss, KL penalty")
    right.set_ylabel("entropy (nats per token)")
    bottom.grid(alpha=0.3)
    bottom.legend(lines, [ln.get_label() for ln in lines], fontsize="small")
    fig.tight_layout()
    return fig


def save_reward_png(metrics: list[dict], title: str, path: Path, validation: list[dict] = ()) -> None:
    """Draw and write `path` atomically (a temporary file renamed)."""
    import matplotlib.pyplot as plt

    fig = reward_figure(metrics, title, validation)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
