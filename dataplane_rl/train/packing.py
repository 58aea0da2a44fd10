"""Token-budget microbatches: which rows go together (DESIGN §11). Pure index arithmetic, no tensors of data.

- `pack_rows`: sequence packing. Rows go into bins of at most `budget` tokens; a bin becomes one sequence whose
  positions restart at 0 per row and whose attention never crosses rows (model/logprobs.py `packed_logprobs`).
- `dynamic_cuts`: dynamic batching. Length-sorted rows are cut into padded microbatches whose padded size
  (rows x longest length rounded up) stays within `budget`.
- `balance_by_tokens`: rows to data-parallel ranks by tokens, not by row counts.
The microbatch tensors themselves are built by train/batch.py `plan_microbatches`, the one builder.
"""

from __future__ import annotations

import numpy as np

ALGORITHMS = ("first_fit_decreasing", "concatenative")


def pack_rows(lengths: np.ndarray, budget: int, algorithm: str = "first_fit_decreasing") -> list[np.ndarray]:
    """Positions 0..n-1 grouped into bins of total length <= budget; deterministic.

    first_fit_decreasing: longest row first, each into the first bin it fits (fewest bins in practice, the
    NeMo-RL default). concatenative: rows in order, a new bin when the next one does not fit (keeps order).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > budget:
        raise ValueError(f"a row of {int(lengths.max())} tokens does not fit a budget of {budget}")
    bins: list[list[int]] = []
    load: list[int] = []
    if algorithm == "first_fit_decreasing":
        for i in np.argsort(-lengths, kind="stable"):
            n = int(lengths[i])
            b = next((k for k, used in enumerate(load) if used + n <= budget), None)
            if b is None:
                bins.append([])
                load.append(0)
                b = len(bins) - 1
            bins[b].append(int(i))
            load[b] += n
    elif algorithm == "concatenative":
        for i, n in enumerate(lengths.tolist()):
            if not bins or load[-1] + n > budget:
                bins.append([])
                load.append(0)
            bins[-1].append(i)
            load[-1] += n
    else:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    return [np.array(b, dtype=np.int64) for b in bins]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def dynamic_cuts(lengths: np.ndarray, budget: int, round_to: int) -> list[np.ndarray]:
    """Positions 0..n-1, sorted by length (longest first), cut into microbatches whose padded size
    rows * round_up(longest, round_to) is <= budget (a single row always fits: its length was checked)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    cuts: list[list[int]] = []
    width = 0
    for i in order:
        w = round_up(int(lengths[i]), round_to)
        if cuts and (len(cuts[-1]) + 1) * max(width, w) <= budget:
            cuts[-1].append(int(i))
            width = max(width, w)
        else:
            cuts.append([int(i)])
            width = w
    return [np.array(c, dtype=np.int64) for c in cuts]


def refuse_over_budget(lengths: np.ndarray, rs, policy) -> None:
    """Before training: a ConfigError naming the partition, row, length and key of a row that cannot fit the
    token budget of `policy` (a PolicyConfig; dynamic batching pads a row up to its round, which must fit too)."""
    from dataplane_rl.errors import ConfigError

    if not lengths.size:
        return
    rnd = policy.dynamic_batching.sequence_length_round if policy.dynamic_batching.enabled else 1
    at = int(np.argmax(lengths))
    for key, budget in policy.token_budgets().items():
        if round_up(int(lengths[at]), rnd) > budget:
            starts = np.cumsum([0] + [len(rows) for _, rows in rs])
            pid, row = next((pid, rows[at - s]) for (pid, rows), s in zip(rs, starts) if s <= at < s + len(rows))
            padded = f" (padded to a multiple of {rnd})" if rnd > 1 else ""
            raise ConfigError(f"partition {pid} row {int(row)} has {int(lengths[at])} tokens{padded}, more than "
                              f"{key}={budget}; raise {key} or set policy.max_total_sequence_length <= {budget}")


def balance_by_tokens(lengths: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Positions 0..n-1 over `num_shards` ranks by tokens (longest first onto the lightest rank, no cap on row
    counts), each shard sorted; every rank gets at least one row when n >= num_shards."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size < num_shards:
        raise ValueError(f"{lengths.size} rows cannot give each of {num_shards} ranks a row")
    load = np.zeros(num_shards, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for i in np.argsort(-lengths, kind="stable"):
        # an empty rank first: a rank with no row would have no counts and nothing to train
        s = min(range(num_shards), key=lambda k: (len(members[k]) > 0, load[k], k))
        members[s].append(int(i))
        load[s] += int(lengths[i])
    return [np.array(sorted(m), dtype=np.int64) for m in members]
