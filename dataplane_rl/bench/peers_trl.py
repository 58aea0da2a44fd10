"""The TRL side of `dataplane-rl bench peers`, run as its own process: `python -m dataplane_rl.bench.peers_trl SPEC`.

SPEC is a JSON file: `overrides`, the dataplane-rl config of the run (bench/peers.py base_overrides), `out`, where the
result goes, and `output_dir`, TRL's scratch folder. The GRPOConfig is derived from that same config, key by key, and
the dataset is the rows the dataplane-rl run draws at steps 1..N in the order it draws them (the dataset task's
seeded epochs), so both sides train on the same prompts step for step; the reward is the dataset task's own
(`DatasetTask.reward`: the answer-match reward against the row's ground truth). Needs the `peers` extra (TRL).
"""

from __future__ import annotations

import json
import sys
import time


def prompt_rows(cfg) -> tuple[list[int], list]:
    """The dataset rows the dataplane-rl run trains at steps 1..N, in its order, and their prompts as the file holds
    them (chat messages as {role, content} lists: TRL's conversational format; text as text)."""
    from dataplane_rl.tasks import load_task

    task = load_task(cfg.task)
    n = cfg.grpo.num_prompts_per_step
    rows = [r for step in range(1, cfg.grpo.max_num_steps + 1) for r in task.prompts(cfg.grpo.seed, step, 0, n)]
    prompts = []
    for r in rows:
        p = task.files[0].value(r, task.input_key)
        # Parquet structs may carry keys of other rows as nulls: only role and content, as the dataplane-rl run renders
        prompts.append(p if isinstance(p, str) else [{"role": m["role"], "content": m["content"]} for m in p])
    return rows, prompts


def grpo_config(cfg, output_dir: str):
    """TRL's GRPOConfig for the same run: one optimizer step of a step's samples, in its micro-batches."""
    from trl import GRPOConfig

    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    micro = cfg.policy.train_micro_batch_size
    return GRPOConfig(
        output_dir=output_dir, max_steps=cfg.grpo.max_num_steps, seed=cfg.grpo.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=samples // micro,
        num_generations=cfg.grpo.num_generations_per_prompt, generation_batch_size=samples,
        max_completion_length=cfg.generation.max_new_tokens, temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p, top_k=cfg.generation.top_k, use_vllm=False,
        learning_rate=cfg.policy.learning_rate, lr_scheduler_type=cfg.policy.scheduler.name,
        weight_decay=cfg.policy.weight_decay, max_grad_norm=cfg.policy.max_grad_norm,
        beta=cfg.loss_fn.reference_policy_kl_penalty,  # TRL's KL is the k3 estimator
        epsilon=cfg.loss_fn.ratio_clip_min, epsilon_high=cfg.loss_fn.ratio_clip_max,
        loss_type="dapo" if cfg.loss_fn.token_level_loss else "grpo", num_iterations=cfg.grpo.num_epochs,
        scale_rewards="group" if cfg.grpo.normalize_rewards else "none",
        shuffle_dataset=False,  # the rows are already in the dataplane-rl run's order
        # TRL's base config turns gradient checkpointing on and bf16 on by default; dataplane-rl's run has neither
        gradient_checkpointing=cfg.policy.activation_checkpointing, bf16=False, use_cpu=True,
        model_init_kwargs={"dtype": "float32"},
        report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)


def main(argv: list[str]) -> int:
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from dataplane_rl.config import load_config
    from dataplane_rl.model.load import resolve_model
    from dataplane_rl.tasks import load_task

    spec = json.loads(open(argv[0]).read())
    cfg = load_config(None, spec["overrides"])
    torch.manual_seed(cfg.grpo.seed)
    rows, prompts = prompt_rows(cfg)
    task = load_task(cfg.task, draws=False)

    def answer_match(completions, row, **_):
        """The dataset task's reward of each completion against its row (TRL passes dataset columns by name)."""
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [task.reward(r, t) for r, t in zip(row, texts)]

    class StepTimes(TrainerCallback):
        """Each optimizer step's seconds (generation, scoring, forwards and backwards, the update) and end time."""

        def __init__(self) -> None:
            self.begin, self.seconds, self.ends = 0.0, [], []

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.seconds.append(now - self.begin)
            self.ends.append(now)

    folder = resolve_model(cfg.policy.model, cfg.grpo.seed, cfg.policy.model_cache_dir)
    times = StepTimes()
    trainer = GRPOTrainer(model=str(folder), reward_funcs=answer_match, args=grpo_config(cfg, spec["output_dir"]),
                          train_dataset=Dataset.from_dict({"prompt": prompts, "row": rows}), callbacks=[times])
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    samples = cfg.grpo.num_prompts_per_step * cfg.grpo.num_generations_per_prompt
    with open(spec["out"], "w") as f:
        json.dump({"trl_version": trl.__version__, "step_s": times.seconds, "step_end": times.ends,
                   "samples_per_step": samples, "reward": rewards}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
