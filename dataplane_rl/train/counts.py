"""Global loss normalisers and metric reduction over the data-parallel group (docs/architecture.md §6).

Once per optimizer step, each rank counts its own shard (`local_counts`) and one all-reduce sums the
counts over the group (`all_reduce_counts`); the pure loss then divides by these global counts. After
the microbatch loop, `reduce_metrics` sums each loss metric over microbatches and ranks.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from dataplane_rl.algorithms.loss import MAX_METRICS, GlobalCounts, derived_masks, finish_metrics

Batch = Mapping[str, torch.Tensor]


def local_counts(batches: Union[Batch, Iterable[Batch]], seq_logprob_error_threshold: Optional[float] = None) -> GlobalCounts:
    """Counts of this rank's shard for one optimizer step, with dp_size=1.

    `batches` is the shard's train batch, or its microbatches (which may be padded to different T).
    positive_tokens is 0 when the batch has no `rewards`; the loss refuses mu > 0 in that case.
    `seq_logprob_error_threshold` must be the loss's (`ClippedPGLoss.seq_logprob_error_threshold`): the counts
    then leave out the sequences it masks, from the same derived mask the loss uses.
    """
    if isinstance(batches, Mapping):
        batches = [batches]
    tokens = sequences = positive = masked = 0
    for batch in batches:
        valid, sample, pos, written, _ = derived_masks(batch, seq_logprob_error_threshold)
        tokens += int(valid.sum())
        sequences += int(sample.sum())
        positive += int(pos.sum()) if pos is not None else 0
        masked += int((written & ~sample).sum())
    return GlobalCounts(tokens=tokens, sequences=sequences, positive_tokens=positive, dp_size=1, masked_sequences=masked)


def _group_device(group) -> torch.device:
    # NCCL only reduces CUDA tensors; gloo only CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def all_reduce_counts(local: GlobalCounts, group: Optional[dist.ProcessGroup] = None) -> GlobalCounts:
    """Sum `local` over `group` (default: the world) in one all-reduce; dp_size = the group size.

    Without an initialised process group this returns `local` (one rank, D = 1).
    """
    if local.dp_size != 1:
        raise ValueError(f"all_reduce_counts got counts with dp_size={local.dp_size}: they are already reduced; "
                         "pass the local_counts of this rank")
    if not _distributed():
        return local
    t = torch.tensor([local.tokens, local.sequences, local.positive_tokens, local.masked_sequences], dtype=torch.int64,
                     device=_group_device(group))  # [4]
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    tokens, sequences, positive, masked = (int(v) for v in t.tolist())
    return GlobalCounts(tokens=tokens, sequences=sequences, positive_tokens=positive,
                        dp_size=dist.get_world_size(group), masked_sequences=masked)


def reduce_metrics(metrics: Iterable[Mapping[str, Union[torch.Tensor, float]]],
                   group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """Global values of the loss metrics: SUM over this rank's microbatches, then all-reduce SUM.

    Each microbatch metric from `ClippedPGLoss` is already divided by its global count, so a plain
    sum is exact; never average. Those in `loss.MAX_METRICS` are microbatch maxima: MAX over
    microbatches, then all-reduce MAX. Ratios of the global values (`loss.finish_metrics`) are taken
    last, once. Every rank must pass the same metric names. Without an initialised process group
    only the local reduction is taken.
    """
    metrics = list(metrics)
    if not metrics:
        raise ValueError("reduce_metrics got no microbatch metrics; run at least one microbatch per step")
    names = sorted(metrics[0])
    for i, m in enumerate(metrics):
        if sorted(m) != names:
            raise ValueError(f"microbatch {i} has metrics {sorted(m)}, microbatch 0 has {names}")
    tensors = [v for m in metrics for v in m.values() if torch.is_tensor(v)]
    device = tensors[0].device if tensors else torch.device("cpu")
    # Stack on the metrics' own device: one host transfer and one all-reduce instead of one per value;
    # float64 so summing many small shares loses nothing.
    sums = [k for k in names if k not in MAX_METRICS]
    peaks = [k for k in names if k in MAX_METRICS]

    def stacked(keys: list[str]) -> torch.Tensor:
        return torch.stack([torch.stack([torch.as_tensor(m[k], dtype=torch.float64).to(device) for k in keys])
                            for m in metrics])  # [M, K]

    total = stacked(sums).sum(dim=0) if sums else torch.zeros(0, dtype=torch.float64, device=device)  # [K]
    peak = stacked(peaks).amax(dim=0) if peaks else torch.zeros(0, dtype=torch.float64, device=device)  # [K']
    if _distributed():
        total = total.to(_group_device(group))
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        if peaks:  # every rank has the same names, so every rank takes part in this collective or none does
            peak = peak.to(_group_device(group))
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return finish_metrics({**dict(zip(sums, total.tolist())), **dict(zip(peaks, peak.tolist()))})
