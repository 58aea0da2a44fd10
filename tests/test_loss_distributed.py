"""Two real gloo ranks under DDP give the single-process full-batch gradient and metrics (DESIGN §5)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from dataplane_rl.algorithms.loss import ClippedPGLoss, GlobalCounts, LossConfig
from dataplane_rl.train.counts import all_reduce_counts, local_counts, reduce_metrics
# pytest puts tests/ on sys.path (rootdir-relative "prepend" import mode), and spawn hands that path
# to the children, so both processes find the shared helpers here.
from test_loss import TinyPolicy, close, make_batch, rows, run_sharded

WORLD = 2
B = 32
MICRO = 3  # per rank; uneven split, and rank 0's first microbatch holds no valid token
CFG = LossConfig(ratio_clip_min=0.1, ratio_clip_max=0.15, ratio_clip_c=2.0, reference_policy_kl_penalty=0.2,
                 positive_example_nll_weight=0.3, use_importance_sampling_correction=True)
# (loss config, grpo.seq_logprob_error_threshold): the unbounded weight, and a bounded one with sequences masked
# by their log-prob error, whose counts and max metric cross the ranks (issue 39)
CASES = {"unbounded": (CFG, None),
         "seq-mask-tis+threshold": (CFG.model_copy(update=dict(truncated_importance_sampling_type="seq-mask-tis",
                                                              truncated_importance_sampling_ratio=1.05,
                                                              truncated_importance_sampling_ratio_min=0.95)), 1.2)}


def setup():
    torch.manual_seed(0)
    policy = TinyPolicy()
    return policy, make_batch(policy, B=B, seed=7)


def worker(rank: int, rendezvous: str, out: str, case: str) -> None:
    # a file rendezvous: a free port picked here could be taken by another test's process before rank 0
    # binds it (CI runs two halves of the suite side by side), and gloo then aborts the ranks (SIGABRT)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        policy, batch = setup()
        shard = rows(batch, torch.tensor_split(torch.arange(B), WORLD)[rank])
        micro = [rows(shard, i) for i in torch.tensor_split(torch.arange(B // WORLD), MICRO)]
        cfg, threshold = CASES[case]
        counts = all_reduce_counts(local_counts(micro, threshold))
        ddp = DistributedDataParallel(policy)
        fn, metrics = ClippedPGLoss(cfg, threshold), []
        for k, mb in enumerate(micro):
            # no_sync until the last microbatch: DDP then all-reduces the accumulated gradient once
            with ddp.no_sync() if k < MICRO - 1 else nullcontext():
                loss, m = fn(ddp(mb["input_ids"]), mb, counts)
                loss.backward()
            metrics.append(m)
        reduced = reduce_metrics(metrics)
        if rank == 0:
            torch.save({"counts": counts, "metrics": reduced, "grads": [p.grad for p in policy.parameters()]}, out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_gloo_ranks_match_full_batch(tmp_path, case):
    out = str(tmp_path / "rank0.pt")
    mp.spawn(worker, args=(str(tmp_path / "rendezvous"), out, case), nprocs=WORLD, join=True)
    got = torch.load(out, weights_only=False)

    cfg, threshold = CASES[case]
    policy, batch = setup()
    full = local_counts(batch, threshold)
    assert got["counts"] == GlobalCounts(full.tokens, full.sequences, full.positive_tokens, dp_size=WORLD,
                                         masked_sequences=full.masked_sequences)
    _, ref_metrics, ref_grads = run_sharded(policy, batch, cfg, n_ranks=1, n_micro=1, threshold=threshold)
    assert ref_metrics["positive_nll_loss"] > 0 and ref_metrics["clip_fraction"] > 0
    if threshold is not None:
        assert full.masked_sequences > 0 and ref_metrics["is_masked_seqs"] > 0 and ref_metrics["is_oob_ratio"] > 0
    assert got["metrics"].keys() == ref_metrics.keys()
    for k in ref_metrics:
        close(got["metrics"][k], ref_metrics[k])
    for g, ref in zip(got["grads"], ref_grads):
        close(g, ref)
