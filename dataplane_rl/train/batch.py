"""Row sets, column movement and THE train-batch builder (one place, driven by the schema).

A row set is a list of (partition, rows) segments: rows are identities, so a batch is named by the rows
it holds, never by position in some array. `fetch`/`write` move a row set's columns through any store;
the driver's in-memory store (data plane off) and the real stores (data plane on) use the same code.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa
import torch

from dataplane_rl.schema import Schema
from dataplane_rl.store import ColumnStore, pad_tokens, to_numpy

RowSet = list[tuple[str, np.ndarray]]  # [(partition id, rows)]


def rowset_size(rs: RowSet) -> int:
    return sum(len(r) for _, r in rs)


def fetch(store: ColumnStore, rs: RowSet, fields: Sequence[str]) -> pa.Table:
    """The fields of a row set, in row-set order (zero-copy chunks where the store allows)."""
    tables = [store.get(pid, fields, rows) for pid, rows in rs if len(rows)]
    if len(tables) == 1:
        return tables[0]
    return pa.concat_tables(tables) if tables else pa.table({})


def write(store: ColumnStore, rs: RowSet, table: pa.Table) -> int:
    """Put a table whose rows follow the row set; returns bytes written."""
    start = 0
    for pid, rows in rs:
        part = table.slice(start, len(rows))
        store.put(pid, {name: part.column(name) for name in part.column_names}, rows)
        start += len(rows)
    if start != table.num_rows:
        raise ValueError(f"write: table has {table.num_rows} rows, the row set {start}")
    return table.nbytes


def shard_balanced(lengths: np.ndarray, num_shards: int) -> list[np.ndarray]:
    """Split positions 0..n-1 into `num_shards` equal-count shards with balanced token totals.

    Greedy longest-first onto the lightest shard that still has room; deterministic. Each shard's
    positions are returned sorted, so shards read contiguous runs where they can.
    """
    n = lengths.size
    if n % num_shards:
        raise ValueError(f"{n} rows do not split evenly over {num_shards} ranks")
    cap = n // num_shards
    load = np.zeros(num_shards, dtype=np.int64)
    members: list[list[int]] = [[] for _ in range(num_shards)]
    for i in np.argsort(-lengths, kind="stable"):
        open_ = [s for s in range(num_shards) if len(members[s]) < cap]
        s = min(open_, key=lambda k: (load[k], k))
        members[s].append(int(i))
        load[s] += int(lengths[i])
    return [np.array(sorted(m), dtype=np.int64) for m in members]


def merge(parts: list[RowSet]) -> RowSet:
    """The row sets one after another, adjacent segments of one partition joined."""
    out: RowSet = []
    for rs in parts:
        for pid, rows in rs:
            if out and out[-1][0] == pid:
                out[-1] = (pid, np.concatenate([out[-1][1], rows]))
            else:
                out.append((pid, rows))
    return out


def select(rs: RowSet, positions: np.ndarray) -> RowSet:
    """The sub-row-set at flat positions (sorted), keeping segment boundaries."""
    out: RowSet = []
    start = 0
    for pid, rows in rs:
        mine = positions[(positions >= start) & (positions < start + len(rows))] - start
        if mine.size:
            out.append((pid, rows[mine]))
        start += len(rows)
    return out


def build_train_batch(table: pa.Table, schema: Schema, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors for the loss from a table of train fields: aliases applied (total_reward -> rewards),
    token columns right-padded to [B, T], sample columns [B], plus attention_mask [B, T].

    Every train path, with the data plane on or off, goes through here.
    """
    out: dict[str, torch.Tensor] = {}
    T = None
    for name in table.column_names:
        col = schema.column(name)
        data = table.column(name)
        if col.kind == "token":
            values, mask = pad_tokens(data, pad_value=0)
            T = values.shape[1]
            t = values.long() if name == "input_ids" else values.float()  # [B, T]
            out[name] = t
            out.setdefault("attention_mask", mask.long())  # [B, T]
        else:
            arr = to_numpy(data)
            t = torch.tensor(arr)  # [B]; a copy: store buffers are read-only
            out[name] = t.long() if np.issubdtype(arr.dtype, np.integer) and name != "sample_mask" else t.float()  # [B]
    if T is not None and schema.length_column in out:
        if int(out[schema.length_column].max()) != T:
            raise ValueError("token columns are not as long as input_lengths")  # the store already checks this
    return {k: v.to(device) for k, v in schema.apply_aliases(out).items()}


def _rows(batch: dict[str, torch.Tensor], idx: torch.Tensor | slice, width: int | None = None) -> dict[str, torch.Tensor]:
    """Those rows, token tensors trimmed to their longest row, or right-padded with zeros to `width`."""
    mb = {k: v[idx] for k, v in batch.items()}
    T = int(mb["attention_mask"].sum(-1).max()) if "attention_mask" in mb else None
    if T is None:
        return mb
    W = width if width is not None else T
    return {k: (torch.nn.functional.pad(v[:, :T], (0, W - T)) if v.dim() == 2 else v) for k, v in mb.items()}


def microbatches(batch: dict[str, torch.Tensor], size: int) -> list[dict[str, torch.Tensor]]:
    """Split along rows; each microbatch is trimmed to its own longest row."""
    B = next(iter(batch.values())).shape[0]
    return [_rows(batch, slice(s, s + size)) for s in range(0, B, size)]


def plan_microbatches(batch: dict[str, torch.Tensor], policy, pass_: str = "train") -> list[dict[str, torch.Tensor]]:
    """The microbatches of a rank's batch, as `policy` (a PolicyConfig) asks, for the train or logprob pass.

    Padded (the default): `train_micro_batch_size` rows each, right-padded to their longest row.
    `dynamic_batching`: length-sorted rows cut by `*_mb_tokens`, padded to `sequence_length_round` (never past
    the batch's longest row), never more token slots than padded microbatches (train/packing.py `dynamic_cuts`).
    `sequence_packing`: rows packed into `*_mb_tokens`; each microbatch keeps its rows' padded tensors for
    the loss plus `packed_input_ids` [1, L] and `cu_seqlens` [n+1], which the forward uses instead
    (train/model.py `microbatch_logprobs`). The loss sees [b, t] tensors in every mode. `row_index` [b]
    says which rows of `batch` a microbatch holds (packing and dynamic batching reorder them).
    """
    from dataplane_rl.train.packing import dynamic_cuts, pack_rows, padded_width

    sp, db = policy.sequence_packing, policy.dynamic_batching
    any_ = next(iter(batch.values()))
    batch = {**batch, "row_index": torch.arange(any_.shape[0], device=any_.device)}  # [B]: where each row came from
    if not (sp.enabled or db.enabled):
        return microbatches(batch, policy.train_micro_batch_size)
    lengths = batch["attention_mask"].sum(-1).cpu().numpy()  # [B]
    if db.enabled:
        budget = db.train_mb_tokens if pass_ == "train" else db.logprob_mb_tokens
        cuts = dynamic_cuts(lengths, budget, db.sequence_length_round, policy.train_micro_batch_size)
        return [_rows(batch, torch.as_tensor(c), padded_width(int(lengths[c].max()), db.sequence_length_round,
                                                              int(lengths.max()))) for c in cuts]
    budget = sp.train_mb_tokens if pass_ == "train" else sp.logprob_mb_tokens
    out = []
    for b in pack_rows(lengths, budget, sp.algorithm):
        mb = _rows(batch, torch.as_tensor(b))
        valid = mb["attention_mask"].bool()  # [b, t]
        mb["packed_input_ids"] = mb["input_ids"][valid][None]  # [1, L]: row-major, so rows stay in order
        n = torch.as_tensor(lengths[b], device=valid.device)  # [b]
        mb["cu_seqlens"] = torch.cat([n.new_zeros(1), n.cumsum(0)])  # [b+1]
        out.append(mb)
    return out


def slots(mb: dict[str, torch.Tensor]) -> int:
    """Token slots the forward pass of a microbatch computes (valid + padding)."""
    return int(mb["packed_input_ids"].shape[1]) if "packed_input_ids" in mb else int(mb["input_ids"].numel())


def unpack(flat: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[L] values of a packed microbatch -> [b, t] right-padded like its rows' tensors (zeros in padding)."""
    valid = mb["attention_mask"].bool()  # [b, t]
    out = flat.new_zeros(valid.shape)  # [b, t]
    return out.masked_scatter(valid, flat)  # row-major, the packing order
