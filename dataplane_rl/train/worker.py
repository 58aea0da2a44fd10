"""The training worker: one torch.distributed rank as a Ray actor.

It computes its shard's policy and reference log-probs (written back as columns), then runs the
microbatch loop: global counts all-reduced once per optimizer step, ClippedPGLoss, FSDP2's gradient
reduce-scatter, norm clipping over the sharded gradients, AdamW on the shards and the learning-rate
schedule; grpo.num_epochs times.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from dataplane_rl.store import list_array
from dataplane_rl.train.batch import RowSet, build_train_batch, microbatches
from dataplane_rl.train.fsdp import to_float
from dataplane_rl.train.transport import ActorIO


class TrainWorker:
    def __init__(self, cfg: dict, model_folder: str, store_url: str | None, rank: int, world: int,
                 threads: int) -> None:
        from dataplane_rl.algorithms.loss import ClippedPGLoss
        from dataplane_rl.config import Config
        from dataplane_rl.schema import load_schema
        from dataplane_rl.train.model import load_model, pick_device

        torch.set_num_threads(threads)
        self.cfg = Config.model_validate(cfg)
        self.schema = load_schema(self.cfg.data_plane.schema_name)
        self.train_fields = self.cfg.train_fields(self.schema)
        self.rank, self.world = rank, world
        self.device = pick_device(self.cfg.policy.device)
        torch.manual_seed(self.cfg.grpo.seed)
        self.model = load_model(model_folder, self.device)
        self.ref = None
        if self.cfg.loss_fn.reference_policy_kl_penalty > 0:
            self.ref = load_model(model_folder, self.device).eval().requires_grad_(False)
        self.opt = None  # made in init_dist, over the sharded parameters
        self.loss_fn = ClippedPGLoss(self.cfg.loss_fn)
        self.io = ActorIO(store_url)

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
        if self.ref is not None:
            shard(self.ref, mesh, self.device, p.precision)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=p.learning_rate, weight_decay=p.weight_decay)
        self.scheduler = build_scheduler(self.opt, self.cfg)  # a torch LRScheduler: a checkpoint saves its state
        return os.getpid()

    def take_io(self) -> dict:
        return self.io.take()

    # -- log-prob pass ------------------------------------------------------------------------------
    @torch.no_grad()
    def logprobs(self, rs: RowSet, table: pa.Table | None = None) -> pa.Table | None:
        """prev_logprobs (the policy's current weights, before this step: in async mode newer than the rows'
        generation_policy_version, whose generation_logprobs stay the behaviour policy's) and
        reference_policy_logprobs for the shard."""
        from dataplane_rl.train.model import token_logprobs

        seed_fields = self.schema.field_set("LOGPROB_SEED_FIELDS")
        table = self.io.fetch(rs, seed_fields, table)
        batch = build_train_batch(table, self.schema, self.device)
        lengths = batch["input_lengths"].cpu().numpy()
        models = {"prev_logprobs": self.model}
        if self.ref is not None:
            models["reference_policy_logprobs"] = self.ref
        out = {}
        temp = self.cfg.generation.temperature
        self.model.eval()
        for name, model in models.items():
            parts = []
            for mb in microbatches(batch, self.cfg.policy.train_micro_batch_size):
                parts.append(token_logprobs(model, mb["input_ids"], mb["attention_mask"], temp).float().cpu())  # [b, t]
            rows = [row for part in parts for row in part.numpy()]  # padded, in batch order
            flat = np.concatenate([row[:int(n)] for row, n in zip(rows, lengths)])
            out[name] = list_array(flat, lengths, pa.float32())
        return self.io.emit(rs, pa.table(out))

    # -- train pass ---------------------------------------------------------------------------------
    def train(self, steps: list[RowSet], tables: list[pa.Table] | None = None) -> dict:
        """grpo.num_epochs passes over this rank's shards of the step's global batches, one optimizer step
        per shard per pass; prev_logprobs stay those of the log-prob pass. Returns global metrics."""
        from dataplane_rl.algorithms.loss import batch_masks
        from dataplane_rl.train.counts import all_reduce_counts, local_counts, reduce_metrics
        from dataplane_rl.train.model import token_logprobs

        p = self.cfg.policy
        self.model.train()
        batches = [build_train_batch(self.io.fetch(rs, self.train_fields, tables[i] if tables is not None else None),
                                     self.schema, self.device) for i, rs in enumerate(steps)]
        history = []
        mismatch = torch.zeros(2, dtype=torch.float64)  # [sum |gen - prev| over valid tokens, count]
        for batch in batches:
            if "generation_logprobs" in batch:
                m = batch["token_mask"] * batch["sample_mask"][:, None]  # [B, T]
                mismatch[0] += float(((batch["generation_logprobs"] - batch["prev_logprobs"]).abs() * m).sum())
                mismatch[1] += float(m.sum())
        for _ in range(self.cfg.grpo.num_epochs):
            for batch in batches:
                counts = all_reduce_counts(local_counts(batch))
                self.opt.zero_grad(set_to_none=True)
                per_mb = []
                # every microbatch's backward reduce-scatters into the sharded grads (FSDP2's default):
                # skipping the sync would accumulate full-size unsharded grads, the memory FSDP saves
                for mb in microbatches(batch, p.train_micro_batch_size):
                    lp, ent = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"],
                                             self.cfg.generation.temperature, with_entropy=True)  # [b, t] each
                    # FSDP2 averages gradients over the D ranks; the loss carries the factor D, so the
                    # reduced gradient is the global one (sum over all tokens / the global counts)
                    loss, metrics = self.loss_fn(lp, mb, counts)
                    loss.backward()
                    valid = batch_masks(mb)[0]  # [b, t]
                    metrics["entropy"] = (ent * valid).sum() / max(counts.tokens, 1)  # this mb's share, like the loss's
                    per_mb.append(metrics)
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
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(mismatch)
        out = {k: float(np.mean([h[k] for h in history])) for k in history[0]}
        # the step's trained tokens: N_tok of every optimizer step (all epochs) added up, not their mean
        out["global_valid_toks"] = float(sum(h["global_valid_toks"] for h in history))
        out["logprob_mismatch"] = float(mismatch[0] / max(float(mismatch[1]), 1.0))
        out["optimizer_steps"] = len(history)
        return out

    def state_dict(self) -> dict:
        """The full policy for refit, gathered once: rank 0 returns it, the other ranks {} (collective)."""
        from dataplane_rl.train.fsdp import full_state_dict

        return full_state_dict(self.model)

    def save_checkpoint(self, path: str) -> None:
        from dataplane_rl.train.checkpoint import save_worker

        save_worker(self, path)

    def load_checkpoint(self, path: str) -> None:
        from dataplane_rl.train.checkpoint import load_worker

        load_worker(self, path)

    def close(self) -> None:
        self.io.close()
        if dist.is_initialized():
            dist.destroy_process_group()
