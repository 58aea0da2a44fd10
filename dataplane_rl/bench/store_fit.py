"""`bench store`'s fit of time = calls x per_call + bytes / bandwidth, and the store's throughput targets."""

from __future__ import annotations

import statistics
from typing import Any

import numpy as np

PUT_TARGET_ROWS, PUT_TARGET_US = 16, 100.0  # a GRPO group put of 16 rows: at most 100 µs plus its bytes
RATIO_TARGET = 0.9                          # shm / shm floor and Mooncake / raw Mooncake, steady e2e
TARGET_WORKLOAD = {"samples": 4096, "min_len": 512, "max_len": 4096, "writers": 4, "readers": 4}


def observations(rounds: list[dict]) -> list[dict]:
    """One per process and round: op (put, get), rows per call, calls, bytes, the seconds its calls took
    and the CPU seconds its thread spent in them (each timed in its process; a reader's touch is not in it)."""
    out = []
    for r in rounds:
        for op, key, size in (("put", "writers", r["put_size"]), ("get", "readers", r["get_size"])):
            for p in r[key]:
                if p["calls"]:
                    out.append({"op": op, "rows": size, "calls": p["calls"], "bytes": p["bytes"], "seconds": p["busy"],
                                "cpu_seconds": p["cpu"]})
    return out


def fit(obs: list[dict], key: str = "seconds") -> dict[str, Any]:
    """Least squares over the sizes: for each rows-per-call size the median time per call and bytes per call
    (medians: one descheduled process does not tilt the line), then per_call and 1 / bandwidth from
    time/call = per_call + (bytes/call) / bandwidth, i.e. time = calls x per_call + bytes / bandwidth."""
    sizes = sorted({o["rows"] for o in obs})
    points = []
    for s in sizes:
        mine = [o for o in obs if o["rows"] == s]
        points.append({"rows": s, "us_per_call": statistics.median(o[key] / o["calls"] for o in mine) * 1e6,
                       "bytes_per_call": statistics.median(o["bytes"] / o["calls"] for o in mine),
                       "observations": len(mine)})
    a = np.array([[1.0, p["bytes_per_call"]] for p in points])
    t = np.array([p["us_per_call"] * 1e-6 for p in points])
    (per_call, per_byte), *_ = np.linalg.lstsq(a, t, rcond=None)
    pred = a @ np.array([per_call, per_byte])
    ss = float(np.sum((t - t.mean()) ** 2))
    return {"per_call_us": float(per_call) * 1e6,
            "bandwidth_gbps": 1 / float(per_byte) / 1e9 if per_byte > 0 else None,  # None: no per-byte cost seen
            "r2": 1 - float(np.sum((t - pred) ** 2)) / ss if ss > 0 else 1.0, "points": points}


def fit_all(obs: list[dict]) -> dict[str, Any]:
    """The fit of put and of get, where at least two sizes were measured: of the seconds the calls took, and
    (`cpu`) of the CPU seconds the calling thread spent in them: the process's own work, without waiting
    for a core, a lock or another process (Mooncake's transfers and master), so the load of other jobs
    blurs it far less."""
    out = {}
    for op in ("put", "get"):
        mine = [o for o in obs if o["op"] == op]
        if len({o["rows"] for o in mine}) >= 2:
            out[op] = {**fit(mine), "cpu": fit(mine, "cpu_seconds")}
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each store target this run can judge: what, the measured value, the bound, pass or miss, and
    whether the run had the target's workload (if not, the verdict is this workload's, not the target's)."""
    w = results["workload"]
    at_target = all(w.get(k) == v for k, v in TARGET_WORKLOAD.items())
    out = []
    for name, ref, label in (("shm", "shm_floor", "shm steady e2e / shm floor"),
                             ("mooncake", "raw_mooncake", "mooncake steady e2e / raw Mooncake")):
        if name in results and ref in results:
            ratio = results[name]["e2e_gbps"]["median"] / results[ref]["e2e_gbps"]["median"]
            out.append({"target": label, "measured": round(ratio, 3), "bound": f">= {RATIO_TARGET}",
                        "pass": ratio >= RATIO_TARGET, "target_workload": at_target})
    put = results.get("shm", {}).get("fit", {}).get("put")
    if put:
        point = next((p for p in put["points"] if p["rows"] == PUT_TARGET_ROWS), None)
        if point and put["bandwidth_gbps"]:
            bound = PUT_TARGET_US + point["bytes_per_call"] / (put["bandwidth_gbps"] * 1e9) * 1e6
            out.append({"target": f"shm put of {PUT_TARGET_ROWS} rows, µs", "measured": round(point["us_per_call"], 1),
                        "bound": f"<= {bound:.1f} ({PUT_TARGET_US:.0f} + {point['bytes_per_call'] / 1e6:.3f} MB at "
                                 f"{put['bandwidth_gbps']:.2f} GB/s)",
                        "pass": point["us_per_call"] <= bound, "target_workload": True})
        else:
            out.append({"target": f"shm put of {PUT_TARGET_ROWS} rows, µs", "measured": None,
                        "bound": f"needs {PUT_TARGET_ROWS} in --fit-sizes and a positive fitted bandwidth",
                        "pass": None, "target_workload": True})
    return out
