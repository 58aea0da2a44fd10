"""A task's prompts split into a train pool and a held-out validation pool, the same on every machine."""

from __future__ import annotations

import hashlib

from dataplane_rl.errors import ConfigError

VAL_SHARE = 0.2  # share of a task's distinct prompts held out for validation


def split_held_out(keys: list[str]) -> tuple[list[str], list[str]]:
    """(train, held-out): the VAL_SHARE of distinct keys with the smallest blake2b hash are held out.

    A hash, not a seeded shuffle: the split of a prompt never depends on the run's seed or on the other
    prompts' order, so the held-out set stays held out across runs. Both parts keep >= 1 key.
    """
    uniq = sorted(set(keys))
    if len(uniq) < 2:
        raise ConfigError(f"a task needs at least 2 distinct prompts to hold one out for validation, got {len(uniq)}")
    ranked = sorted(uniq, key=lambda k: hashlib.blake2b(k.encode(), digest_size=8).digest())
    n_val = min(len(uniq) - 1, max(1, round(VAL_SHARE * len(uniq))))
    held = set(ranked[:n_val])
    return [k for k in uniq if k not in held], [k for k in ranked[:n_val]]
