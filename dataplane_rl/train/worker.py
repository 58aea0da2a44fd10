"""The training worker: one torch.distributed rank as a Ray actor.

It computes its shard's policy and reference log-probs (written back as columns), then runs the
microbatch loop: global counts all-reduced once per optimizer step, ClippedPGLoss, FSDP2's gradient
reduce-scatter, norm clipping over the sharded gradients, AdamW on the shards and the learning-rate
schedule; grpo.num_epochs times. An exactly on-policy step (config/on_policy.py) takes its policy log-probs
from the train forward instead, detached, and writes them as the column once the optimizer has stepped.
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from dataplane_rl import trace
from dataplane_rl.store import list_array, pad_tokens
from dataplane_rl.columns.rowsets import RowSet
from dataplane_rl.train.batch import build_train_batch, plan_microbatches, slots
from dataplane_rl.train.fsdp import to_float
from dataplane_rl.columns.actor_io import ActorIO


def _all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small CPU tensor over the world on the group's device (NCCL reduces CUDA tensors only)."""
    from dataplane_rl.train.counts import _group_device

    on = t.to(_group_device(None))
    dist.all_reduce(on, op=op)
    return on.cpu()


def token_column(per_mb: list, lengths: np.ndarray, value_type: pa.DataType) -> pa.Array:
    """A token column of a rank's rows from its microbatches' values [(microbatch, [b, t, *] array)]: rows back in
    batch order (each microbatch's `row_index`), each cut to its length."""
    rows: list = [None] * len(lengths)
    for mb, values in per_mb:
        for i, row in zip(mb["row_index"].tolist(), values):
            rows[i] = row
    return list_array(np.concatenate([row[:int(n)] for row, n in zip(rows, lengths)]), lengths, value_type)


@trace.traced("forward_backward")
def train_microbatches(model, loss_fn, mbs: list[dict], counts, temperature: float,
                       prev_from_forward: bool = False) -> tuple[list[dict], torch.Tensor]:
    """Forward and backward of one optimizer step's microbatches (gradients accumulate in `model`).
    Returns each microbatch's metrics (shares of the global values) and [valid, all] token slots computed.
    prev_from_forward (an exactly on-policy step, config/on_policy.py): each microbatch's prev_logprobs are its own
    forward's log-probs, detached, set on the microbatch before the loss reads them (the ratio is exactly 1)."""
    from dataplane_rl.model.logprobs import microbatch_logprobs

    per_mb = []
    used = torch.zeros(2, dtype=torch.float64)  # [valid token slots, all token slots]
    # every microbatch's backward reduce-scatters into the sharded grads (FSDP2's default):
    # skipping the sync would accumulate full-size unsharded grads, the memory FSDP saves
    for mb in mbs:
        ids = mb.get("teacher_topk_ids")  # [b, t, k] with distillation: the student's log-probs there too
        got = microbatch_logprobs(model, mb, temperature, with_entropy=True, at_ids=ids)  # [b, t] each (+ [b, t, k])
        lp, ent = got[0], got[1]
        if prev_from_forward:  # the weights of this forward generated the rows: the pass would score them so
            mb["prev_logprobs"] = lp.detach()  # [b, t]
        used += torch.tensor([float(mb["attention_mask"].sum()), float(slots(mb))], dtype=torch.float64)
        # FSDP2 averages gradients over the D ranks; the loss carries the factor D, so the
        # reduced gradient is the global one (sum over all tokens / the global counts)
        masks = loss_fn.masks(mb)  # derived once: the loss's terms and the entropy below share them
        loss, metrics = loss_fn(lp, mb, counts, got[2] if ids is not None else None, masks=masks)
        loss.backward()
        metrics["entropy"] = (ent * masks.valid).sum() / max(counts.tokens, 1)  # this mb's share, like the loss's
        per_mb.append(metrics)
    return per_mb, used


class TrainWorker:
    def __init__(self, cfg: dict, model_folder: str, store_url: str | None, rank: int, world: int,
                 threads: int) -> None:
        from dataplane_rl.algorithms.loss import ClippedPGLoss
        from dataplane_rl.config import Config
        from dataplane_rl.model.load import load_model, pick_device

        torch.set_num_threads(threads)
        self.weights_folder = None  # rank 0's refits in shared memory (publish_weights)
        self.cfg = Config.model_validate(cfg)
        from dataplane_rl.tasks import load_modules

        load_modules(self.cfg.task)  # the user's task.module, in every process of the run
        self.schema = self.cfg.run_schema()
        self.train_fields = self.cfg.train_fields(self.schema)
        self.rank, self.world = rank, world
        self.device = pick_device(self.cfg.policy.device)
        torch.manual_seed(self.cfg.grpo.seed)
        self.model = load_model(model_folder, self.device)
        from dataplane_rl.config.on_policy import prev_pass_reasons
        from dataplane_rl.model.logprobs import dropout_modules

        dropping = dropout_modules(self.model)
        # why this rank scores prev_logprobs in the log-prob pass; []: an on-policy step takes them from its
        # train forward
        self.prev_pass = prev_pass_reasons(self.cfg) + (
            [f"the policy drops activations in training ({', '.join(dropping[:3])})"] if dropping else [])
        self.prev_out: list = []  # such a step's prev_logprobs, (row set, table) per optimizer step, until emitted
        self.ref = None
        if self.cfg.loss_fn.reference_policy_kl_penalty > 0:
            self.ref = load_model(model_folder, self.device).eval().requires_grad_(False)
        d = self.cfg.distillation
        # the frozen teacher scores the rows in the log-prob pass, beside the reference (docs/distillation.md)
        self.teacher = load_model(d.teacher, self.device).eval().requires_grad_(False) if d.enabled else None
        if self.cfg.policy.sequence_packing.enabled:
            from dataplane_rl.model.logprobs import packed_attention

            for m in (self.model, self.ref, self.teacher):
                if m is not None:
                    packed_attention(m, self.device)
        self.opt = None  # made in init_dist, over the sharded parameters
        threshold = self.cfg.grpo.seq_logprob_error_threshold
        self.loss_fn = ClippedPGLoss(self.cfg.loss_fn, threshold)
        if d.enabled:
            from dataplane_rl.algorithms.distillation import DistillationLoss

            self.loss_fn = DistillationLoss(d, self.cfg.loss_fn, threshold)
        self.io = ActorIO(store_url)
        trace.configure(self.cfg.logger.trace_max_events > 0)

    def address(self) -> str:
        """tcp://IP:PORT on this actor's node, for rank 0 to host the process-group rendezvous."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def init_dist(self, init_method: str) -> int:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        dist.init_process_group(backend, init_method=init_method, rank=self.rank, world_size=self.world,
                                timeout=timedelta(minutes=10))
        from torch.distributed.device_mesh import init_device_mesh

        from dataplane_rl.train.fsdp import shard
        from dataplane_rl.train.scheduler import build_scheduler

        p = self.cfg.policy
        mesh = init_device_mesh(self.device.type, (self.world,), mesh_dim_names=("dp",))
        shard(self.model, mesh, self.device, p.precision, p.activation_checkpointing)
        for frozen in (self.ref, self.teacher):
            if frozen is not None:
                shard(frozen, mesh, self.device, p.precision)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=p.learning_rate, weight_decay=p.weight_decay)
        self.scheduler = build_scheduler(self.opt, self.cfg)  # a torch LRScheduler: a checkpoint saves its state
        return os.getpid()

    def prev_logprobs_pass(self) -> list[str]:
        """Why this rank's steps score prev_logprobs in the log-prob pass; []: they take them from the train forward."""
        return self.prev_pass

    def take_io(self) -> dict:
        """The step's data-plane bytes and seconds, and its trace events (`trace`)."""
        return {**self.io.take(), "trace": trace.take()}

    # -- log-prob pass ------------------------------------------------------------------------------
    @trace.traced("logprobs")
    @torch.no_grad()
    def logprobs(self, rs: RowSet, table: pa.Table | None = None) -> pa.Table | None:
        """prev_logprobs (the policy's current weights, before this step: in async mode newer than the rows'
        generation_policy_version, whose generation_logprobs stay the behaviour policy's; not on an exactly
        on-policy step, whose train forward gives them), reference_policy_logprobs and, with distillation, the
        teacher's top-k columns for the shard."""
        from dataplane_rl.model.logprobs import microbatch_logprobs

        seed_fields = self.schema.field_set("LOGPROB_SEED_FIELDS")
        (batch,), (mbs,), (extra,) = self._read_together(
            lambda: [build_train_batch(self.io.fetch(rs, seed_fields, table), self.schema, self.device)], "logprob", 1)
        lengths = batch["input_lengths"].cpu().numpy()
        models = {"prev_logprobs": self.model} if self.prev_pass else {}
        if self.ref is not None:
            models["reference_policy_logprobs"] = self.ref
        out = {}
        temp = self.cfg.generation.temperature
        self.model.eval()
        for name, model in models.items():
            per_mb = [(mb, microbatch_logprobs(model, mb, temp).float().cpu().numpy()) for mb in mbs]  # [b, t] each
            for _ in range(extra):
                self._empty_pass(model, backward=False)
            out[name] = token_column(per_mb, lengths, pa.float32())
        if self.teacher is not None:
            out.update(self._teacher_topk(mbs, lengths, extra))
        return self.io.emit(rs, pa.table(out))

    def _teacher_topk(self, mbs: list[dict], lengths: np.ndarray, extra: int) -> dict:
        """The teacher's top-k log-probs and ids at every position of the student's rows (position t: the
        distribution of token t given the tokens before it; zeros at position 0), as shaped token columns."""
        from dataplane_rl.model.logprobs import microbatch_logprobs

        k, temp = self.cfg.distillation.topk_logits_k, self.cfg.generation.temperature
        vals, ids = [], []
        for mb in mbs:
            v, i = microbatch_logprobs(self.teacher, mb, temp, topk=k)  # [b, t, k] each
            vals.append((mb, v.cpu().numpy()))
            ids.append((mb, i.cpu().numpy()))
        for _ in range(extra):
            self._empty_pass(self.teacher, backward=False)
        return {name: token_column(per_mb, lengths, self.schema.column(name).token_type)  # [L_i, k] per row
                for name, per_mb in (("teacher_topk_logprobs", vals), ("teacher_topk_ids", ids))}

    def _read_together(self, read, kind: str, n: int) -> tuple[list[dict], list[list], list[int]]:
        """`read()` (this rank's n batches from the store), their microbatches and, per batch, the empty passes
        that even this rank's passes with the busiest rank's (FSDP2's all-gathers and reduce-scatters are
        collectives: a rank short of passes would hang). The pass counts' all-reduce also carries whether every
        rank read its rows, before any collective of the pass: when one rank's read fails (a lost Mooncake
        holder), every rank raises instead of waiting for it in a collective until gloo's timeout. One
        all-reduce, the one the pass counts needed anyway."""
        from dataplane_rl.errors import DataPlaneError, StoreUnavailableError

        batches, plans, err = [], [], None
        try:
            batches = read()
            plans = [plan_microbatches(b, self.cfg.policy, kind) for b in batches]
        except DataPlaneError as e:
            err = e
        mine = [len(mbs) for mbs in plans] if err is None else [0] * n
        extras = [0] * n
        if dist.is_initialized() and self.world > 1:
            most = _all_reduce(torch.tensor([int(err is not None), *mine], dtype=torch.int64), dist.ReduceOp.MAX)
            if err is None and most[0]:
                raise StoreUnavailableError(f"train rank {self.rank}: another rank could not read its rows of this "
                                            "step (its error is the one the driver reports)")
            extras = [int(m) - k for m, k in zip(most[1:].tolist(), mine)]
        if err is not None:
            raise err
        return batches, plans, extras

    def reopen_store(self, url: str | None) -> None:
        """Open the run's store again at `url` (the driver replaced a store that lost a holder: faults/restart.py).
        The old client is dropped without close(): its master may be gone, and the client's close would wait on it."""
        self.io = ActorIO(url)

    def _empty_pass(self, model, backward: bool) -> None:
        """A one-token forward (and backward) that contributes nothing: zero gradient, no metrics."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)  # [1, 1]
        with torch.set_grad_enabled(backward):
            logits = model(input_ids=ids, use_cache=False).logits  # [1, 1, V]
            if backward:
                (logits.sum() * 0.0).backward()

    # -- train pass ---------------------------------------------------------------------------------
    @trace.traced("train")
    def train(self, steps: list[RowSet], tables: list[pa.Table] | None = None) -> dict:
        """grpo.num_epochs passes over this rank's shards of the step's global batches, one optimizer step
        per shard per pass; prev_logprobs stay those of the log-prob pass, or, on an exactly on-policy step,
        are the train forward's (kept for `emit_prev_logprobs`). Returns global metrics."""
        from dataplane_rl.algorithms.loss import MAX_METRICS
        from dataplane_rl.train.counts import all_reduce_counts, local_counts, reduce_metrics

        p = self.cfg.policy
        self.model.train()
        from_forward = not self.prev_pass
        fields = [f for f in self.train_fields if not (from_forward and f == "prev_logprobs")]  # not written yet

        def read() -> list[dict]:
            return [build_train_batch(self.io.fetch(rs, fields, tables[i] if tables is not None else None),
                                      self.schema, self.device) for i, rs in enumerate(steps)]

        batches, plans, extras = self._read_together(read, "train", len(steps))
        history = []
        used = torch.zeros(2, dtype=torch.float64)  # [valid token slots, all token slots] of the train passes
        self.prev_out = []
        for _ in range(self.cfg.grpo.num_epochs):
            for batch, mbs, extra in zip(batches, plans, extras):
                counts = all_reduce_counts(local_counts(batch, self.loss_fn.seq_logprob_error_threshold))
                self.opt.zero_grad(set_to_none=True)
                per_mb, mb_used = train_microbatches(self.model, self.loss_fn, mbs, counts,
                                                     self.cfg.generation.temperature, prev_from_forward=from_forward)
                used += mb_used
                for _ in range(extra):
                    self._empty_pass(self.model, backward=True)
                # the grads are DTensor shards: clip_grad_norm_ reduces the norm over ranks (a DTensor)
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.max_grad_norm)
                lr = self.opt.param_groups[0]["lr"]
                self.opt.step()
                self.scheduler.step()
                metrics = reduce_metrics(per_mb)  # sums this rank's microbatches, all-reduces over ranks
                metrics["grad_norm"] = to_float(grad_norm)
                metrics["global_valid_toks"] = float(counts.tokens)
                metrics["lr"] = lr
                # a step can leave the weights non-finite while its loss and grad norm were finite (a huge
                # learning rate): the norm of the updated weights shows it before the next rollout uses them
                metrics["param_norm"] = to_float(torch.nn.utils.get_total_norm([q.detach() for q in self.model.parameters()]))
                history.append(metrics)
        if from_forward:  # the column as the pass would have written it, and the tensor a read of it would give
            for rs, batch, mbs in zip(steps, batches, plans):
                col = token_column([(mb, mb["prev_logprobs"].float().cpu().numpy()) for mb in mbs],
                                   batch["input_lengths"].cpu().numpy(), pa.float32())
                batch["prev_logprobs"] = pad_tokens(col)[0].float().to(self.device)  # [B, T]
                self.prev_out.append((rs, pa.table({"prev_logprobs": col})))
        # [sum |gen - prev|, count, sum exp|gen - prev|] over valid tokens
        mismatch = torch.zeros(3, dtype=torch.float64)
        for batch in batches:
            if "generation_logprobs" in batch:
                m = batch["token_mask"] * batch["sample_mask"][:, None]  # [B, T]
                gap = (batch["generation_logprobs"] - batch["prev_logprobs"]).abs()  # [B, T]
                mismatch[0] += float((gap * m).sum())
                mismatch[1] += float(m.sum())
                # gap masked before exp: off-mask gaps (prompt log-probs vs 0.0) could overflow to inf * 0 = NaN
                mismatch[2] += float((torch.where(m > 0, gap, 0.0).double().exp() * m).sum())
        rows = self._row_stats(batches)
        if dist.is_initialized() and self.world > 1:
            mismatch, used = _all_reduce(mismatch), _all_reduce(used)
        out = {k: float((np.max if k in MAX_METRICS else np.mean)([h[k] for h in history])) for k in history[0]}
        # the step's trained tokens: N_tok of every optimizer step (all epochs) added up, not their mean
        out["global_valid_toks"] = float(sum(h["global_valid_toks"] for h in history))
        out["logprob_mismatch"] = float(mismatch[0] / max(float(mismatch[1]), 1.0))
        # NeMo-RL's token_mult_prob_error: mean of exp|gen - prev| (>= 1; above ~1.05 the engines disagree)
        out["token_mult_prob_error"] = float(mismatch[2] / float(mismatch[1])) if mismatch[1] else 1.0
        out["padding_fraction"] = float(1.0 - used[0] / max(float(used[1]), 1.0))
        out.update(rows)
        out["optimizer_steps"] = len(history)
        return out

    @trace.traced("prev_logprobs")
    def emit_prev_logprobs(self, rs: RowSet, table: pa.Table | None = None) -> pa.Table | None:
        """Put the prev_logprobs an on-policy step's train forward gave for this rank's rows `rs` (the policy's
        column; data plane off: return them for the driver to write). Called after the optimizer step, so a store
        error here cannot leave the driver thinking the weights are those that generated the rows."""
        out, self.prev_out = self.prev_out, []
        if not out:
            return None
        return self.io.emit(rs, pa.concat_tables([t for _, t in out]))

    def _row_stats(self, batches: list[dict]) -> dict:
        """Global prompt and response lengths of the step's rows and the ranks' token imbalance (max / mean)."""
        resp = torch.cat([b["token_mask"].sum(-1) for b in batches]).double().cpu()  # [n]
        total = torch.cat([b["input_lengths"] for b in batches]).double().cpu()  # [n]
        sums = torch.stack([resp.sum(), (total - resp).sum(), torch.tensor(float(len(resp))), total.sum()])  # [4]
        peak = torch.stack([resp.max(), total.sum()])  # [2]: longest response, this rank's tokens
        if dist.is_initialized() and self.world > 1:
            sums, peak = _all_reduce(sums), _all_reduce(peak, dist.ReduceOp.MAX)
        n = max(float(sums[2]), 1.0)
        return {"response_length_mean": float(sums[0]) / n, "response_length_max": float(peak[0]),
                "prompt_length_mean": float(sums[1]) / n, "response_tokens": float(sums[0]), "total_tokens": float(sums[3]),
                "rank_token_imbalance": float(peak[1]) / max(float(sums[3]) / self.world, 1.0)}

    @trace.traced("gather_weights")
    def state_dict(self) -> dict:
        """The full policy for refit, gathered once: rank 0 returns it, the other ranks {} (collective)."""
        from dataplane_rl.train.fsdp import full_state_dict

        return full_state_dict(self.model)

    @trace.traced("publish_weights")
    def publish_weights(self, version: int, keep: list[int], live: bool = False):
        """The full policy for a refit on this node, in shared memory: rank 0 writes it as `version` and returns
        its SharedWeights, unlinking the versions not in `keep` (model/shared_weights.py); the other ranks return
        None (collective). live (the driver's promise that no actor reads while this rank trains): one rank's
        own parameters are the shared file, and the refit copies nothing (`WeightsFolder.publish_live`)."""
        from dataplane_rl.model.shared_weights import WeightsFolder
        from dataplane_rl.train.fsdp import full_state_dict

        if self.weights_folder is None:
            self.weights_folder = WeightsFolder()
        if live and self.world == 1:
            with contextlib.suppress(ValueError):  # not the module's own CPU tensors (FSDP's): a copy, below
                return self.weights_folder.publish_live(self.model, version)
        state = full_state_dict(self.model)
        if self.rank != 0:
            return None
        return self.weights_folder.publish(state, version, set(keep))

    @trace.traced("save_checkpoint")
    def save_checkpoint(self, path: str) -> None:
        from dataplane_rl.train.state import save_worker

        save_worker(self, path)

    @trace.traced("load_checkpoint")
    def load_checkpoint(self, path: str) -> None:
        from dataplane_rl.train.state import load_worker

        load_worker(self, path)

    def close(self) -> list[dict]:
        """Close the store client and the process group; returns the trace events not yet taken."""
        self.io.close()
        if self.weights_folder is not None:
            self.weights_folder.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        return trace.take()
