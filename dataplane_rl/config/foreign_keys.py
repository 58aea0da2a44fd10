"""verl's and NeMo-RL's config keys, named by where they live here, for the unknown-key error.

A look-alike is no answer for them: difflib matched verl's data.train_files to data_plane.train_fields and
data.prompt_key to task.output_key. A key maps here only where the meaning is the same (or the difference is said).
"""

from __future__ import annotations

VERL, NEMO_RL = "verl", "NeMo-RL"

# key -> (whose, where it is here)
KEYS: dict[str, tuple[str, str]] = {
    "data.train_files": (VERL, "task.path here (with task.name=dataset)"),
    "data.val_files": (VERL, "task.val_path here"),
    "data.prompt_key": (VERL, "task.input_key here"),
    "data.reward_fn_key": (VERL, "not a key here: a row's source is always its data_source column"),
    "data.max_prompt_length": (VERL, "task.max_prompt_length here"),
    "data.max_response_length": (VERL, "generation.max_new_tokens here"),
    "data.filter_overlong_prompts": (VERL, "task.filter_overlong_prompts here"),
    "data.truncation": (VERL, "task.truncation here (error, left or right)"),
    "data.train_batch_size": (VERL, "grpo.num_prompts_per_step here"),
    "data.shuffle": (f"{VERL}'s and {NEMO_RL}", "task.shuffle here"),
    "custom_reward_function.path": (VERL, "task.reward_function=FILE.py:NAME here (path and name in one key)"),
    "custom_reward_function.name": (VERL, "task.reward_function=FILE.py:NAME here (path and name in one key)"),
    "custom_reward_function.reward_kwargs": (VERL, "task.reward_kwargs here"),
    "reward_model.reward_manager": (VERL, "task.reward_manager here (naive or batch)"),
    "actor_rollout_ref.model.path": (VERL, "policy.model here (a local Hugging Face folder)"),
    "actor_rollout_ref.rollout.n": (VERL, "grpo.num_generations_per_prompt here"),
    "actor_rollout_ref.rollout.temperature": (VERL, "generation.temperature here"),
    "actor_rollout_ref.rollout.top_p": (VERL, "generation.top_p here"),
    "actor_rollout_ref.rollout.top_k": (VERL, "generation.top_k here (0 turns it off, not -1)"),
    "actor_rollout_ref.rollout.response_length": (VERL, "generation.max_new_tokens here"),
    "actor_rollout_ref.actor.optim.lr": (VERL, "policy.learning_rate here"),
    "actor_rollout_ref.actor.grad_clip": (VERL, "policy.max_grad_norm here"),
    "actor_rollout_ref.actor.ppo_epochs": (VERL, "grpo.num_epochs here"),
    "actor_rollout_ref.actor.ppo_mini_batch_size": (
        VERL, "policy.train_global_batch_size here, counted in samples (verl's counts prompts: times rollout.n)"),
    "actor_rollout_ref.actor.clip_ratio_low": (VERL, "loss_fn.ratio_clip_min here"),
    "actor_rollout_ref.actor.clip_ratio_high": (VERL, "loss_fn.ratio_clip_max here"),
    "actor_rollout_ref.actor.clip_ratio_c": (VERL, "loss_fn.ratio_clip_c here"),
    "actor_rollout_ref.actor.kl_loss_coef": (VERL, "loss_fn.reference_policy_kl_penalty here"),
    "trainer.total_training_steps": (VERL, "grpo.max_num_steps here"),
    "trainer.test_freq": (VERL, "grpo.val_period here"),
    "trainer.val_before_train": (VERL, "grpo.val_at_start here"),
    "trainer.save_freq": (VERL, "checkpointing.save_period here"),
    # NeMo-RL's GRPO math example config, grpo_math_1B (its other sections are named as ours)
    "data.dataset_name": (NEMO_RL, "task.name here (task.name=dataset for a file of your own)"),
    "data.train_data_path": (NEMO_RL, "task.path here (with task.name=dataset)"),
    "data.val_data_path": (NEMO_RL, "task.val_path here"),
    "data.input_key": (NEMO_RL, "task.input_key here"),
    "data.output_key": (NEMO_RL, "task.output_key here"),
    "data.max_input_seq_length": (NEMO_RL, "task.max_prompt_length here"),
    "policy.model_name": (NEMO_RL, "policy.model here (a local Hugging Face folder)"),
    "loss_fn.force_on_policy_ratio": (
        NEMO_RL, "policy.force_prev_logprobs_pass=false here, the default: a step whose rows the training weights "
                 "generated (one optimizer step, one epoch, synchronous) takes prev_logprobs from the train forward "
                 "(ratio 1) by itself; every other step keeps the log-prob pass (docs/grpo.md)"),
}

# verl's top-level sections (none is a section here) -> where their keys live here
SECTIONS: dict[str, str] = {
    "data": "a dataset is task.* here (task.path, task.val_path, task.input_key, task.max_prompt_length)",
    "custom_reward_function": "the reward function is task.reward_function=FILE.py:NAME here",
    "reward_model": "a reward function is task.reward_function here, called per sample or batched (task.reward_manager)",
    "reward": "the reward function is task.reward_function=FILE.py:NAME here (task.reward_kwargs, task.reward_manager)",
    "actor_rollout_ref": "the model and optimizer are policy.*, sampling generation.*, the clip and KL loss_fn.* here",
    "algorithm": "the algorithm is GRPO here: grpo.* and loss_fn.*",
    "trainer": "a run's steps and validation are grpo.*, its saves checkpointing.*, its logs logger.* here",
    "critic": "GRPO has no critic",
    "ray_init": "Ray is started by the run itself here (cluster.*)",
}


def foreign_hint(key: str) -> str | None:
    """'; verl's data.train_files is task.path here ...' for a key of verl's or NeMo-RL's config; else None."""
    bare = key.lstrip("+")  # Hydra's +key= / ++key= (add or force a key); a key is just its name here
    if bare.startswith("reward.custom_reward_function."):  # newer verl nests it under reward.
        bare = bare.removeprefix("reward.")
    kwargs = "custom_reward_function.reward_kwargs."
    if bare.startswith(kwargs):
        return f"; verl's {bare} is task.reward_kwargs.{bare.removeprefix(kwargs)} here"
    if bare in KEYS:
        whose, here = KEYS[bare]
        return f"; {whose}'s {bare} is {here}"
    section = bare.split(".", 1)[0]
    if section in SECTIONS:
        whose = "verl's and NeMo-RL's configs" if section == "data" else "verl's config"
        return f"; '{section}' is a section of {whose}, not of this one: {SECTIONS[section]}"
    return None
