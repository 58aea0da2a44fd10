"""What a step reports of its samples: the run folder's train_data/ rows and the reward per data_source."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

# train_data/ key -> (TRAIN_DATA_FIELDS column, conversion): the rows keep the names they always had
_KEYS = {"group_id": ("group_id", int), "prompt": ("prompt_text", str), "response": ("response_text", str),
         "total_reward": ("total_reward", float), "advantage": ("advantages", float),
         "sample_mask": ("sample_mask", int), "generation_policy_version": ("generation_policy_version", int),
         "num_turns": ("num_turns", int), "end_reason": ("end_reason", str), "data_source": ("data_source", str),
         "extra_info": ("extra_info", str), "dataset_row": ("dataset_row", int),
         "ground_truth": ("ground_truth", str), "reward_extra_info": ("reward_extra_info", str)}


def train_data_rows(rs, data: pa.Table) -> list[dict]:
    """One dict per trained row of `rs` (in its order), from the TRAIN_DATA_FIELDS columns `data`."""
    cols = {key: (conv, data.column(col).to_pylist()) for key, (col, conv) in _KEYS.items()}
    ids = [f"{pid}/{int(row)}" for pid, rows in rs for row in rows]
    return [{"sample_id": sid, **{key: conv(values[i]) for key, (conv, values) in cols.items()}}
            for i, sid in enumerate(ids)]


def source_rewards(rewards: np.ndarray, sources: list[str]) -> dict:
    """train/reward/<data_source>: the mean reward of each data source's generated samples (verl, prime-rl)."""
    src = np.asarray(sources, dtype=object)  # [n]
    return {f"train/reward/{s}": float(rewards[src == s].mean()) for s in sorted(set(sources))}


def reward_extras(extras: list[str]) -> dict:
    """train/reward_extra/<key>: the mean of each numeric key of the reward functions' dicts (verl's
    reward_extra_info), over the samples that have it."""
    import json

    values: dict[str, list[float]] = {}
    for text in extras:
        for k, v in json.loads(text).items():
            if isinstance(v, (int, float)):  # a bool too: its mean is the share of true
                values.setdefault(k, []).append(float(v))
    return {f"train/reward_extra/{k}": float(np.mean(v)) for k, v in sorted(values.items())}
