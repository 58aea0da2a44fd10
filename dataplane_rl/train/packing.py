"""Token-budget microbatches: which rows go together (docs/packing.md). Pure index arithmetic, no tensors of data.

- `pack_rows`: sequence packing. Rows go into bins of at most `budget` tokens; a bin becomes one sequence whose
  positions restart at 0 per row and whose attention never crosses rows (model/logprobs.py `packed_logprobs`).
- `dynamic_cuts`: dynamic batching. Length-sorted rows are cut into padded microbatches whose padded size
  (rows x `padded_width`) stays within `budget`, never computing more slots than plain microbatches.
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


def padded_width(longest: int, round_to: int, widest: int) -> int:
    """The padded length of a dynamic microbatch whose longest row is `longest`: rounded up to `round_to`, unless
    that is wider than `widest` (the batch's longest row, past which no plain microbatch pads); then `longest`.
    A round larger than the rows would otherwise pad every row up to it (measured: 0.60 padding against 0.48)."""
    rounded = round_up(longest, round_to)
    return rounded if rounded <= widest else longest


def dynamic_cuts(lengths: np.ndarray, budget: int, round_to: int, rows: int | None = None) -> list[np.ndarray]:
    """Positions 0..n-1, sorted by length (longest first), cut into microbatches whose padded size
    rows * padded_width(longest) is <= budget (a single row always fits: its length was checked).

    `rows` is plain microbatches' row count (policy.train_micro_batch_size; None: as many as the budget holds).
    Cuts of `rows` sorted rows, the one short cut (n % rows) where it costs least, then neighbours padded to
    the same width merged while they fit the budget: with no round in effect, that never computes more token
    slots, nor runs more passes, than plain microbatches of `rows` rows of the same batch in any order, when
    those fit the budget (tests/test_packing.py checks it over random batches). Filling every microbatch up to
    the budget instead pads a batch of short rows to its longest row in one pass."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = lengths.size
    order = np.argsort(-lengths, kind="stable")
    widest = int(lengths.max()) if n else 0
    width = np.array([padded_width(int(x), round_to, widest) for x in lengths[order]], dtype=np.int64)  # [n]
    k = n if rows is None else max(1, min(rows, n))
    if k * widest <= budget:
        sizes = _sizes_short_cut_cheapest(width, k)
    else:  # the budget binds: as many rows as it holds, at most k
        sizes = []
        while sum(sizes) < n:
            at, m = sum(sizes), 1
            while m < k and at + m < n and (m + 1) * width[at] <= budget:
                m += 1
            sizes.append(m)
    cuts: list[list[int]] = []
    at = 0
    for m in sizes:
        if cuts and width[at] == cuts[-1][1] and (len(cuts[-1][0]) + m) * width[at] <= budget:
            cuts[-1][0].extend(order[at:at + m].tolist())  # the same width: fewer passes for no slot more
        else:
            cuts.append((order[at:at + m].tolist(), int(width[at])))
        at += m
    return [np.array(c, dtype=np.int64) for c, _ in cuts]


def _sizes_short_cut_cheapest(width: np.ndarray, k: int) -> list[int]:
    """Cut sizes over rows sorted longest first (`width` [n] their padded widths, non-increasing): k each, and
    the n % k rows short cut at the place that computes the fewest slots (not always last: after 8 rows of
    31..8, one row of 5 costs 8 x 31 + 5; the row of 31 alone first costs 31 + 8 x 27)."""
    n = width.size
    full, short = divmod(n, k)
    if not short:
        return [k] * full
    a = width[0:full * k:k]  # [full]: first widths of the full cuts before the short one
    b = width[short::k][:full]  # [full]: first widths of the full cuts after it
    before = np.concatenate([[0], np.cumsum(a)])  # [full + 1]
    after = np.concatenate([np.cumsum(b[::-1])[::-1], [0]])  # [full + 1]
    cost = k * before + short * width[np.arange(full + 1) * k] + k * after  # [full + 1]: short cut at place p
    p = int(np.argmin(cost))
    return [k] * p + [short] + [k] * (full - p)


def refuse_over_budget(lengths: np.ndarray, rs, policy) -> None:
    """Before training: a ConfigError naming the partition, row, length and key of a row that cannot fit the
    token budget of `policy` (a PolicyConfig; dynamic batching never pads the longest row: `padded_width`)."""
    from dataplane_rl.errors import ConfigError

    if not lengths.size:
        return
    at = int(np.argmax(lengths))
    for key, budget in policy.token_budgets().items():
        if int(lengths[at]) > budget:
            starts = np.cumsum([0] + [len(rows) for _, rows in rs])
            pid, row = next((pid, rows[at - s]) for (pid, rows), s in zip(rs, starts) if s <= at < s + len(rows))
            raise ConfigError(f"partition {pid} row {int(row)} has {int(lengths[at])} tokens, more than "
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
