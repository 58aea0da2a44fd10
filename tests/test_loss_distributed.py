"""Two real gloo ranks under DDP give the single-process full-batch gradient and metrics (docs/architecture.md §6)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from dataplane_rl.algorithms.distillation import DistillationLoss
from dataplane_rl.algorithms.loss import ClippedPGLoss, GlobalCounts, LossConfig
from dataplane_rl.config.distillation import DistillationConfig
from dataplane_rl.train.counts import all_reduce_counts, local_counts, reduce_metrics
# pytest puts tests/ on sys.path (rootdir-relative "prepend" import mode), and spawn hands that path
# to the children, so both processes find the shared helpers here.
from ranks import leave
from test_loss import TinyPolicy, add_teacher, close, loss_of, make_batch, rows, run_sharded

WORLD = 2
B = 32
MICRO = 3  # per rank; uneven split, and rank 0's first microbatch holds no valid token
CFG = LossConfig(ratio_clip_min=0.1, ratio_clip_max=0.15, ratio_clip_c=2.0, reference_policy_kl_penalty=0.2,
                 positive_example_nll_weight=0.3, use_importance_sampling_correction=True)
# (the loss, grpo.seq_logprob_error_threshold, with a teacher's columns): the GRPO loss with the unbounded
# weight; on-policy distillation (mixed top-k KL) beside a bounded GRPO loss whose sequences are masked by their
# log-prob error, so its counts, max metric and KL mask cross the ranks
BOUNDED = CFG.model_copy(update=dict(truncated_importance_sampling_type="seq-mask-tis",
                                     truncated_importance_sampling_ratio=1.05, truncated_importance_sampling_ratio_min=0.95))
CASES = {"grpo": (lambda: ClippedPGLoss(CFG), None, False),
         "distill+seq-mask-tis": (lambda: DistillationLoss(DistillationConfig(kl_type="mixed", mixed_kl_weight=0.3,
                                                                              task_loss_weight=0.5, kl_loss_weight=2.0),
                                                           BOUNDED, 1.2), 1.2, True)}


def setup(teacher: bool = False):
    torch.manual_seed(0)
    policy = TinyPolicy()
    batch = make_batch(policy, B=B, seed=7)
    return policy, (add_teacher(batch, k=4, seed=8) if teacher else batch)


def worker(rank: int, rendezvous: str, out: str, case: str) -> None:
    # a file rendezvous: a free port picked here could be taken by another test's process before rank 0
    # binds it (CI runs two halves of the suite side by side), and gloo then aborts the ranks (SIGABRT)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        make, threshold, teacher = CASES[case]
        policy, batch = setup(teacher)
        shard = rows(batch, torch.tensor_split(torch.arange(B), WORLD)[rank])
        micro = [rows(shard, i) for i in torch.tensor_split(torch.arange(B // WORLD), MICRO)]
        counts = all_reduce_counts(local_counts(micro, threshold))
        ddp = DistributedDataParallel(policy)
        fn, metrics = make(), []
        for k, mb in enumerate(micro):
            # no_sync until the last microbatch: DDP then all-reduces the accumulated gradient once
            with ddp.no_sync() if k < MICRO - 1 else nullcontext():
                loss, m = loss_of(fn, ddp, mb, counts)
                loss.backward()
            metrics.append(m)
        reduced = reduce_metrics(metrics)
        if rank == 0:
            torch.save({"counts": counts, "metrics": reduced, "grads": [p.grad for p in policy.parameters()]}, out)
    finally:
        dist.destroy_process_group()
    leave()


def spawn_ranks(tmp_path, out: str, case: str) -> None:
    """The two ranks, once more if one was aborted by SIGABRT. The abort seen in 1 of 3 CI runs came from C++ static
    destructors at the ranks' interpreter exit, after their work was saved (1-2 in 40 spawns here); the ranks now
    leave without it (leave(): 0 in 40), and the retry stays for an abort of another cause. A second abort fails
    the test, and the numbers are checked in full after whichever run finished."""
    for attempt in range(2):
        try:
            mp.spawn(worker, args=(str(tmp_path / f"rendezvous-{attempt}"), out, case), nprocs=WORLD, join=True)
            return
        except mp.ProcessExitedException as e:
            if attempt or "SIGABRT" not in str(e):
                raise


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_gloo_ranks_match_full_batch(tmp_path, case):
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(tmp_path, out, case)
    got = torch.load(out, weights_only=False)

    make, threshold, teacher = CASES[case]
    policy, batch = setup(teacher)
    full = local_counts(batch, threshold)
    assert got["counts"] == GlobalCounts(full.tokens, full.sequences, full.positive_tokens, dp_size=WORLD,
                                         masked_sequences=full.masked_sequences)
    _, ref_metrics, ref_grads = run_sharded(policy, batch, make(), n_ranks=1, n_micro=1)
    if teacher:
        assert ref_metrics["distillation_loss"] > 0
    assert ref_metrics["positive_nll_loss"] > 0 and ref_metrics["clip_fraction"] > 0
    if threshold is not None:
        assert full.masked_sequences > 0 and ref_metrics["is_masked_seqs"] > 0 and ref_metrics["is_oob_ratio"] > 0
    assert got["metrics"].keys() == ref_metrics.keys()
    for k in ref_metrics:
        close(got["metrics"][k], ref_metrics[k])
    for g, ref in zip(got["grads"], ref_grads):
        close(g, ref)
