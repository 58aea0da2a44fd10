"""`bench store`'s output: markdown tables and a bar chart of one run's results."""

from __future__ import annotations

from typing import Any

import numpy as np

SMALL_COLUMNS = (("put_us", "put"), ("put_full_us", "put into 200"), ("get_us", "get"),
                 ("remote_get_us", "get, other process"), ("remote_get_full_us", "get of 200, other process"))
SMALL_CALL_TARGET_US = 150  # the target for each 64-row call a streaming trainer makes, drawn as the dashed line


def table(results: dict[str, Any]) -> str:
    """Two markdown tables: throughput (steady and cold) and the small calls' µs."""
    mem, fresh = results["memcpy"]["e2e_gbps"]["median"], results["fresh_pages"]["e2e_gbps"]["median"]
    raw = results.get("raw_mooncake", {}).get("e2e_gbps", {}).get("median")
    floor = results.get("shm_floor", {}).get("e2e_gbps", {}).get("median")
    mfloor = results.get("mooncake_floor", {}).get("e2e_gbps", {}).get("median")
    rows = ["| backend | write GB/s | read GB/s | steady e2e GB/s (min-max) | x memcpy | x shm floor | x raw Mooncake | "
            "x Mooncake floor | cold e2e GB/s | cold x fresh pages |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("memcpy", "fresh_pages", "shm_floor", "raw_mooncake", "mooncake_floor", "shm", "mooncake", "ray"):
        if name not in results:
            continue
        r = results[name]
        e = r["e2e_gbps"]
        w = f"{r['write_gbps']['median']:.3f}" if "write_gbps" in r else "-"
        rd = f"{r['read_gbps']['median']:.3f}" if "read_gbps" in r else "-"
        ratio_r = f"{e['median'] / raw:.2f}" if raw else "-"
        ratio_f = f"{e['median'] / floor:.2f}" if floor and name != "fresh_pages" else "-"
        ratio_m = f"{e['median'] / mfloor:.2f}" if mfloor else "-"
        cold = r.get("cold")
        c = f"{cold['e2e_gbps']:.3f} | {cold['e2e_gbps'] / fresh:.2f}" if cold else "- | -"
        rows.append(f"| {name} | {w} | {rd} | {e['median']:.3f} ({e['min']:.3f}-{e['max']:.3f}) | "
                    f"{e['median'] / mem:.2f} | {ratio_f} | {ratio_r} | {ratio_m} | {c} |")
    rows += fit_table(results) + process_table(results) + target_table(results)
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


LABELS = ("memcpy", "shm_floor", "raw_mooncake", "mooncake_floor", "shm", "mooncake", "ray")


def fit_table(results: dict[str, Any]) -> list[str]:
    fits = [(n, op, results[n]["fit"][op]) for n in LABELS if "fit" in results.get(n, {})
            for op in ("put", "get") if op in results[n]["fit"]]
    if not fits:
        return []
    rows = ["", "Fit of time = calls x per_call + bytes / bandwidth over rows per call (medians per size; each "
            "process's own calls, a reader's touch not in them; CPU: its thread's CPU time in them):", "",
            "| backend | op | per call µs | bandwidth GB/s | r² | µs per call at rows (MB per call) |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, op, f in fits:
        for label, g in ((op, f), (f"{op}, CPU", f.get("cpu"))):
            if g:
                bw = f"{g['bandwidth_gbps']:.3f}" if g["bandwidth_gbps"] else "not resolved"
                pts = ", ".join(f"{p['us_per_call']:.0f} at {p['rows']} ({p['bytes_per_call'] / 1e6:.3f})"
                                for p in g["points"])
                rows.append(f"| {name} | {label} | {g['per_call_us']:.0f} | {bw} | {g['r2']:.3f} | {pts} |")
    return rows


def process_table(results: dict[str, Any]) -> list[str]:
    """Every process's exit status and memory; a reader over its mapping is flagged."""
    rows = ["", "Processes: RSS at start, at the end of a round (a reader still holding its shard) and at its "
            "peak (VmHWM, small calls included); held: the most bytes one round handed it; beyond: RSS growth "
            "past that (store pages mapped but not read: shared, not a copy); anon: growth of private memory, "
            "where a copy lands. A reader whose anon grew by a copy of its shard (Mooncake: by a second copy; "
            "+25% and 24 MiB) is flagged:", "",
            "| run | process | exit | start RSS MB | round RSS MB | peak RSS MB | held MB | beyond MB | anon growth MB | |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    n = len(rows)
    for name in LABELS:
        for p in results.get(name, {}).get("processes", []):
            flag = "**copies its shard**" if p["copies_shard"] else ""
            rows.append(f"| {name} | {p['role']} | {p['exitcode']} | {p['start_rss_mb']:.0f} | {p['round_rss_mb']:.0f} | "
                        f"{p['peak_rss_mb']:.0f} | {p['held_mb']:.1f} | {p['mapped_beyond_mb']:.1f} | "
                        f"{p['anon_growth_mb']:.1f} | {flag} |")
    return rows if len(rows) > n else []


def target_table(results: dict[str, Any]) -> list[str]:
    ts = results.get("targets", [])
    if not ts:
        return []
    rows = ["", "Targets (the ratios' target workload is 4096 samples of 512-4096 tokens, 4 writers, "
            "4 readers):", "", "| target | measured | bound | |", "| --- | --- | --- | --- |"]
    for t in ts:
        verdict = "-" if t["pass"] is None else ("pass" if t["pass"] else "**miss**")
        if t["pass"] is not None and not t["target_workload"]:
            verdict += " (another workload)"
        rows.append(f"| {t['target']} | {'-' if t['measured'] is None else t['measured']} | {t['bound']} | {verdict} |")
    return rows


def print_profiles(results: dict[str, Any], work, top: int = 15) -> None:
    """The top entries (own time) of writer 0's and reader 0's cProfile stats of each backend."""
    import io
    import os
    import pstats

    for name in ("shm", "mooncake", "ray", "shm_floor"):
        for role in ("writer 0", "reader 0"):
            path = work.profile_path(name, role)
            if name not in results or not os.path.exists(path):
                continue
            out = io.StringIO()
            pstats.Stats(path, stream=out).strip_dirs().sort_stats("tottime").print_stats(top)
            text = out.getvalue()
            print(f"\ncProfile of {name} {role} ({path}), top {top} by own time:")
            print(text[text.find("   ncalls"):].rstrip())


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
    names = ["memcpy", "fresh_pages", *(n for n in ("shm_floor", "raw_mooncake", "mooncake_floor") if n in results),
             *backends]
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
    ax.set_title(f"{w['samples']} samples, lengths {w['min_len']}-{w['max_len']}, {w.get('writers', 1)} writers, "
                 f"{w['readers']} readers", fontsize=9)
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
