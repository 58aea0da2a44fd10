"""Data failures in a rollout job (docs/architecture.md §7): a reward or environment call retried, then its whole group failed.

A task's reward function or environment is user code; an exception from it is retried up to
`fault_tolerance.max_data_retries` times (the calls are pure: the same prompt and response, or actions, each
time). One that still fails fails its whole group: the job writes none of the group's rows (never an empty or
zero-reward row) and its receipt names the group, the reason and the exception; the driver leaves the group out
(faults/data.py).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

REASONS = ("reward", "environment")


class DataFailure(Exception):
    """A reward or environment call that failed on every try; its group fails."""

    def __init__(self, reason: str, error: str) -> None:
        super().__init__(f"{reason}: {error}")
        self.reason, self.error = reason, error


def describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class Retries:
    """One job's data failures: calls retried (by reason) and the groups that failed."""

    def __init__(self, retries: int) -> None:
        self.retries = retries
        self.counts = dict.fromkeys(REASONS, 0)
        self.failed: dict[int, tuple[str, str]] = {}  # group id -> (reason, exception)

    def call(self, reason: str, fn, *args):
        """fn(*args), tried 1 + retries times; DataFailure when every try raised."""
        for attempt in range(self.retries + 1):
            try:
                return fn(*args)
            except (Exception, KeyboardInterrupt, SystemExit) as e:  # noqa: BLE001 - any failure of user code, named below
                if attempt == self.retries:
                    raise DataFailure(reason, describe(e)) from None
                self.counts[reason] += 1

    def fail(self, group: int, f: DataFailure) -> None:
        self.failed.setdefault(int(group), (f.reason, f.error))

    def drop_failed(self, table: pa.Table, rows: np.ndarray) -> tuple[pa.Table, np.ndarray, dict]:
        """The table and rows without the failed groups' rows, and what the receipt says of them."""
        out = {"data_retries": self.counts} if any(self.counts.values()) else {}
        if not self.failed:
            return table, rows, out
        keep = ~np.isin(table.column("group_id").to_numpy(), list(self.failed))  # [B]
        out["failed_groups"] = [[g, reason, error] for g, (reason, error) in self.failed.items()]
        out["failed_rows"] = rows[~keep].tolist()
        return table.filter(pa.array(keep)), rows[keep], out


def score_job(task, keys: list, group_ids: list[int], responses: list[str], G: int,
              retries: Retries) -> tuple[list[float], list[str]]:
    """The rewards and reward_extra_info (JSON) of a job's responses (G per key, in order): one call per sample, or
    one for the job with task.reward_manager=batch. A failure fails the sample's group (a batch call that fails on
    every try, every group of the job); the failed rows' values are placeholders that are never stored."""
    from dataplane_rl.tasks import score
    from dataplane_rl.tasks.values import to_json

    n = len(responses)
    rewards, extras = [0.0] * n, [{}] * n
    flat = [k for k in keys for _ in range(G)]
    if getattr(task, "batched", False):
        try:
            results = retries.call("reward", task.score_batch, flat, responses)
        except DataFailure as f:
            for gid in group_ids:
                retries.fail(gid, f)
            results = []
        for i, r in enumerate(results):
            if isinstance(r, Exception):
                retries.fail(group_ids[i // G], DataFailure("reward", describe(r)))
            else:
                rewards[i], extras[i] = r
    else:
        for i, (key, response) in enumerate(zip(flat, responses)):
            try:
                rewards[i], extras[i] = retries.call("reward", score, task, key, response)
            except DataFailure as f:
                retries.fail(group_ids[i // G], f)
    return rewards, [to_json(e) for e in extras]  # strict JSON, numpy/torch scalars as numbers
