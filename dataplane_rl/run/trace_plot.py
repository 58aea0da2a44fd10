"""A run's trace.json at a glance: seconds per process and phase, and a timeline picture (one lane per process)."""

from __future__ import annotations

from collections import defaultdict
import os
from pathlib import Path

from dataplane_rl.trace import read_trace

# one colour per phase, related phases in one hue: rollouts orange, log-prob and train passes blue, the refit
# red, the store's puts and gets purple, checkpoints brown; another phase takes the next of tab10's
COLOURS = {"step": "#d9d9d9", "start": "#bdbdbd", "close": "#bdbdbd", "validation": "#31a354",
           "collect_groups": "#fdd0a2", "wait_for_rollouts": "#fd8d3c", "rollout_job": "#fdae6b", "generate": "#e6550d",
           "advantages": "#1b9e77", "train_data": "#66a61e",
           "logprobs": "#6baed6", "train": "#c6dbef", "forward_backward": "#08519c",
           "refit": "#de2d26", "gather_weights": "#fc9272", "publish_weights": "#fc9272", "load_weights": "#a50f15",
           "put": "#54278f", "get": "#e7298a", "checkpoint": "#8c6d31", "save_checkpoint": "#bd9e39",
           "checkpoint_load": "#e7ba52", "load_checkpoint": "#e7ba52"}


def processes(events: list[dict]) -> dict[int, str]:
    """pid -> process name, in the file's sort order (driver, rollout actors, train ranks)."""
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "process_name"}
    order = {e["pid"]: e["args"]["sort_index"] for e in events if e.get("ph") == "M" and e["name"] == "process_sort_index"}
    return dict(sorted(names.items(), key=lambda kv: (order.get(kv[0], kv[0]), kv[0])))


def depths(events: list[dict]) -> list[int]:
    """Each complete event's nesting depth within its process (0: outermost), in the order given."""
    out = [0] * len(events)
    stacks: dict[int, list[int]] = defaultdict(list)  # pid -> end times of the open spans
    for i in sorted(range(len(events)), key=lambda i: (events[i]["ts"], -events[i]["dur"])):
        e, stack = events[i], stacks[events[i]["pid"]]
        while stack and stack[-1] <= e["ts"]:
            stack.pop()
        out[i] = len(stack)
        stack.append(e["ts"] + e["dur"])
    return out


def phase_table(path: str | Path) -> list[dict]:
    """Per process and phase: how many spans, their seconds in all, the longest."""
    events = read_trace(path)["traceEvents"]
    names = processes(events)
    acc: dict[tuple, list] = {}
    for e in events:
        if e.get("ph") == "X":
            a = acc.setdefault((e["pid"], e["name"]), [0, 0.0, 0.0])
            a[0] += 1
            a[1] += e["dur"] / 1e6
            a[2] = max(a[2], e["dur"] / 1e6)
    rank = {pid: i for i, pid in enumerate(names)}
    rows = sorted(acc.items(), key=lambda kv: (rank.get(kv[0][0], len(rank)), -kv[1][1]))
    return [{"process": names.get(pid, str(pid)), "phase": name, "count": n, "seconds": round(s, 6), "max_s": round(m, 6)}
            for (pid, name), (n, s, m) in rows]


def timeline_figure(path: str | Path, steps: tuple[int, int] | None = None):
    """Bars of every complete event, one lane per process, nested spans drawn below their parent, one colour
    per phase. `steps`: only from the start of the first to the end of the last of these steps."""
    import matplotlib

    matplotlib.use("Agg")  # no display on training machines
    import matplotlib.pyplot as plt

    all_events = read_trace(path)["traceEvents"]
    names = processes(all_events)
    timed = [e for e in all_events if e.get("ph") == "X" and e["pid"] in names]
    depth = depths(timed)
    spans = [e for e in timed if e["name"] == "step" and (steps is None or steps[0] <= e["args"].get("step", 0) <= steps[1])]
    lo = min((e["ts"] for e in spans or timed), default=0)
    hi = max((e["ts"] + e["dur"] for e in spans or timed), default=1)
    lanes = {pid: i for i, pid in enumerate(names)}
    deepest = max(depth, default=0) + 1
    phases = sorted({e["name"] for e in timed})
    cmap = plt.get_cmap("tab10")
    others = iter(range(10**6))
    colour = {p: COLOURS.get(p) or cmap(next(others) % 10) for p in phases}
    fig, ax = plt.subplots(figsize=(12, 0.8 + 0.55 * len(lanes)), constrained_layout=True)
    shown = set()
    for e, d in zip(timed, depth):
        if e["ts"] + e["dur"] < lo or e["ts"] > hi:
            continue
        height = 0.8 / deepest
        y = lanes[e["pid"]] - 0.4 + d * height
        ax.barh(y, e["dur"] / 1e6, left=(e["ts"] - lo) / 1e6, height=height * 0.95, align="edge",
                color=colour[e["name"]], edgecolor="none", label=None if e["name"] in shown else e["name"])
        shown.add(e["name"])
    ax.set_yticks(list(lanes.values()), list(names.values()))
    ax.invert_yaxis()  # the driver on top
    ax.set_xlim(0, (hi - lo) / 1e6)
    ax.set_xlabel("seconds since the first step began" if spans else "seconds")
    ax.set_title(f"{Path(path).parent.name or path}: one lane per process, nested phases below their parent")
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: labels[i])
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
    return fig


def save_timeline_png(path: str | Path, out: str | Path, steps: tuple[int, int] | None = None) -> None:
    import matplotlib.pyplot as plt

    fig = timeline_figure(path, steps)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")  # renamed into place: OUT is whole or as it was
    try:
        fig.savefig(tmp, dpi=110, format="png")
        os.replace(tmp, out)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
