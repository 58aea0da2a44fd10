"""GRPO's driver-side math (docs/grpo.md): group advantages and whole-group dynamic sampling.

Pure numpy on per-sample scalars; the driver never needs a token column for any of it.
"""

from __future__ import annotations

import numpy as np


def _groups(group_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique group ids in first-seen order, inverse index of each row)."""
    uniq, first, inverse = np.unique(group_ids, return_index=True, return_inverse=True)
    order = np.argsort(first)
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    return uniq[order], rank[inverse]


def group_std(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Per-row std (population, ddof=0) of the row's whole group."""
    _, inv = _groups(group_ids)
    count = np.bincount(inv).astype(np.float64)
    mean = np.bincount(inv, weights=rewards) / count
    var = np.bincount(inv, weights=(rewards - mean[inv]) ** 2) / count
    return np.sqrt(var)[inv]


def advantages(rewards: np.ndarray, group_ids: np.ndarray, *, normalize: bool = True,
               leave_one_out: bool = False) -> np.ndarray:
    """A_i = (R_i - b_i) / (s + 1e-6) if normalize else R_i - b_i.

    b_i is the group mean, or with leave_one_out the mean of the other samples of the group;
    s is the std of the whole group.
    """
    r = np.asarray(rewards, dtype=np.float64)
    _, inv = _groups(np.asarray(group_ids))
    count = np.bincount(inv).astype(np.float64)
    total = np.bincount(inv, weights=r)
    if leave_one_out:
        if (count < 2).any():
            raise ValueError("leave-one-out baseline needs at least 2 samples per group")
        baseline = (total[inv] - r) / (count[inv] - 1)
    else:
        baseline = (total / count)[inv]
    adv = r - baseline
    if normalize:
        adv = adv / (group_std(r, group_ids) + 1e-6)
    return adv.astype(np.float32)


def informative_groups(rewards: np.ndarray, group_ids: np.ndarray) -> np.ndarray:
    """Group ids (first-seen order) whose rewards are not all equal: the std of the full group > 0."""
    uniq, inv = _groups(np.asarray(group_ids))
    lo = np.full(uniq.size, np.inf)
    hi = np.full(uniq.size, -np.inf)
    np.minimum.at(lo, inv, rewards)
    np.maximum.at(hi, inv, rewards)
    return uniq[hi > lo]
