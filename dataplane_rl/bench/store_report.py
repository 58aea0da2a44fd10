"""`bench store`'s output: markdown tables and a bar chart of one run's results."""

from __future__ import annotations

from typing import Any

import numpy as np

SMALL_COLUMNS = (("put_us", "put"), ("put_full_us", "put into 200"), ("get_us", "get"),
                 ("remote_get_us", "get, other process"), ("remote_get_full_us", "get of 200, other process"))
SMALL_CALL_TARGET_US = 150  # issue 30's target for each 64-row call, drawn as the dashed line


def table(results: dict[str, Any]) -> str:
    """Two markdown tables: throughput (steady and cold) and the small calls' µs."""
    mem, fresh = results["memcpy"]["e2e_gbps"]["median"], results["fresh_pages"]["e2e_gbps"]["median"]
    raw = results.get("raw_mooncake", {}).get("e2e_gbps", {}).get("median")
    floor = results.get("shm_floor", {}).get("e2e_gbps", {}).get("median")
    rows = ["| backend | write GB/s | read GB/s | steady e2e GB/s (min-max) | x memcpy | x shm floor | x raw Mooncake | "
            "cold e2e GB/s | cold x fresh pages |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("memcpy", "fresh_pages", "shm_floor", "raw_mooncake", "shm", "mooncake", "ray"):
        if name not in results:
            continue
        r = results[name]
        e = r["e2e_gbps"]
        w = f"{r['write_gbps']['median']:.3f}" if "write_gbps" in r else "-"
        rd = f"{r['read_gbps']['median']:.3f}" if "read_gbps" in r else "-"
        ratio_r = f"{e['median'] / raw:.2f}" if raw else "-"
        ratio_f = f"{e['median'] / floor:.2f}" if floor and name != "fresh_pages" else "-"
        cold = r.get("cold")
        c = f"{cold['e2e_gbps']:.3f} | {cold['e2e_gbps'] / fresh:.2f}" if cold else "- | -"
        rows.append(f"| {name} | {w} | {rd} | {e['median']:.3f} ({e['min']:.3f}-{e['max']:.3f}) | "
                    f"{e['median'] / mem:.2f} | {ratio_f} | {ratio_r} | {c} |")
    small = [n for n in ("shm", "mooncake", "ray") if n in results and "small" in results[n]]
    if small:
        s0 = results[small[0]]["small"]
        rows += ["", f"µs per call of {s0['rows']} rows ({s0['bytes'] / 1e6:.2f} MB), median (min-max):", "",
                 "| backend | " + " | ".join(label for _, label in SMALL_COLUMNS) + " |",
                 "| --- |" + " --- |" * len(SMALL_COLUMNS)]
        for name in small:
            sm = results[name]["small"]
            cells = [f"{sm[k]['median']:.0f} ({sm[k]['min']:.0f}-{sm[k]['max']:.0f})" if k in sm else "-"
                     for k, _ in SMALL_COLUMNS]
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: dict[str, Any], path: str, title: str = "") -> None:
    """One run's figures: steady and cold e2e GB/s per backend beside their references, and the small
    calls' µs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - matplotlib.ticker.ScalarFormatter below

    backends = [n for n in ("shm", "mooncake", "ray") if n in results]
    small = [n for n in backends if "small" in results[n]]
    fig, axes = plt.subplots(1, 2 if small else 1, figsize=(11 if small else 6, 4), squeeze=False)
    ax = axes[0][0]
    names = ["memcpy", "fresh_pages", *(n for n in ("shm_floor", "raw_mooncake") if n in results), *backends]
    x = np.arange(len(names))
    steady = [results[n]["e2e_gbps"]["median"] if n != "fresh_pages" else np.nan for n in names]
    cold = [results[n]["cold"]["e2e_gbps"] if "cold" in results[n] else
            (results[n]["e2e_gbps"]["median"] if n == "fresh_pages" else np.nan) for n in names]
    for k, (vals, label, color) in enumerate(((steady, "steady (median)", "#2a7"), (cold, "cold (first round)", "#c73"))):
        ax.bar(x + (k - 0.5) * 0.4, vals, 0.4, label=label, color=color)
        for i, v in enumerate(vals):
            if v == v:
                ax.text(x[i] + (k - 0.5) * 0.4, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [n.replace("_", "\n") for n in names], fontsize=8)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylabel("end-to-end GB/s (log)")
    w = results["workload"]
    ax.set_title(f"{w['samples']} samples, lengths {w['min_len']}-{w['max_len']}, {w['readers']} readers", fontsize=9)
    ax.legend(fontsize=8)
    if small:
        ax = axes[0][1]
        keys = [(k, label) for k, label in SMALL_COLUMNS if k in results[small[0]]["small"]]
        xs = np.arange(len(small))
        width = 0.8 / len(keys)
        for j, (key, label) in enumerate(keys):
            ax.bar(xs + (j - (len(keys) - 1) / 2) * width, [results[n]["small"][key]["median"] for n in small],
                   width, label=label)
        ax.axhline(SMALL_CALL_TARGET_US, color="#888", linestyle="--", linewidth=0.8)
        ax.set_xticks(xs, small)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_ylabel(f"µs per call (median, log); dashed: {SMALL_CALL_TARGET_US} µs target")
        ax.set_title(f"{results[small[0]]['small']['rows']}-row calls", fontsize=9)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
