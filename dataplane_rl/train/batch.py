"""THE train-batch builder (one place, driven by the schema) and the microbatches cut from its rows.

The rows arrive as a row set's columns (columns/rowsets.py); padding is made here, per microbatch, never in
the data (docs/packing.md).
"""

from __future__ import annotations


import numpy as np
import pyarrow as pa
import torch

from dataplane_rl.schema import Schema
from dataplane_rl.store import pad_tokens, to_numpy


def build_train_batch(table: pa.Table, schema: Schema, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Tensors for the loss from a table of train fields: aliases applied (total_reward -> rewards),
    token columns right-padded to [B, T] (a shaped one to [B, T, *shape]; its integers as int64, ids to
    gather with), sample columns [B], plus attention_mask [B, T].

    Every train path, with the data plane on or off, goes through here.
    """
    out: dict[str, torch.Tensor] = {}
    T = None
    for name in table.column_names:
        col = schema.column(name)
        data = table.column(name)
        if col.kind == "token":
            values, mask = pad_tokens(data, pad_value=0)  # [B, T], or [B, T, *shape] for a shaped column
            T = values.shape[1]
            ids = name == "input_ids" or col.shape and col.dtype.startswith(("int", "uint"))  # token ids gather
            out[name] = values.long() if ids else values.float()  # [B, T, *shape]
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
    """Those rows, token tensors ([b, T] or [b, T, *shape]: the inner dimensions ride along) trimmed to their
    longest row, or right-padded with zeros to `width`."""
    mb = {k: v[idx] for k, v in batch.items()}
    T = int(mb["attention_mask"].sum(-1).max()) if "attention_mask" in mb else None
    if T is None:
        return mb
    W = width if width is not None else T

    def fit(v: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(v[:, :T], (0, 0) * (v.dim() - 2) + (0, W - T))  # pads dim 1 only

    return {k: (fit(v) if v.dim() >= 2 else v) for k, v in mb.items()}


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
    (model/logprobs.py `microbatch_logprobs`). The loss sees [b, t] tensors in every mode. `row_index` [b]
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
