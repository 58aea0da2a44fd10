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
    """Three panels over the steps: the rewards (and held-out validation where logged, `validation` adding
    lines that are not steps, e.g. step 0); the loss, with the KL penalty on its own right-hand axis; the
    entropy. Each legend sits above its panel, never on the curves."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [m["step"] for m in metrics]
    # constrained layout makes room for the legends placed above the panels
    fig, (top, mid, bottom) = plt.subplots(3, 1, figsize=(7, 8), sharex=True, layout="constrained",
                                           height_ratios=(2, 1.4, 1))
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
    _legend_above(top, top.get_lines(), ncol=1)  # long labels: one per row, within the figure's width

    # the KL penalty is often 100x smaller than the loss: its own axis, so neither is drawn flat
    right = mid.twinx()
    lines = []
    for ax, key, color in ((mid, "train/loss", "C0"), (right, "train/kl_penalty", "C1"), (bottom, "train/entropy", "C2")):
        if all(key in m for m in metrics):
            line = ax.plot(steps, [m[key] for m in metrics], marker=".", color=color, label=key)
            lines += line if ax is not bottom else []
            ax.set_ylabel(key.split("/")[1].replace("_", " "), color=color)
    _legend_above(mid, lines)
    _legend_above(bottom, bottom.get_lines())
    bottom.set_xlabel("step")
    bottom.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    return fig


def _legend_above(ax, lines, ncol: int = 2) -> None:
    ax.grid(alpha=0.3)
    if lines:
        ax.legend(lines, [ln.get_label() for ln in lines], fontsize="small", loc="lower left",
                  bbox_to_anchor=(0, 1.0), ncol=ncol, frameon=False, borderaxespad=0.2)


def save_reward_png(metrics: list[dict], title: str, path: Path, validation: list[dict] = ()) -> None:
    """Draw and write `path` atomically (a temporary file renamed)."""
    import matplotlib.pyplot as plt

    fig = reward_figure(metrics, title, validation)
    tmp = path.with_name(path.stem + ".tmp" + path.suffix)
    try:
        fig.savefig(tmp, dpi=100)
        os.replace(tmp, path)
    finally:  # a full disk: no half-drawn .tmp left
        plt.close(fig)
        tmp.unlink(missing_ok=True)
