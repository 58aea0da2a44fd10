"""One GRPO step's metrics (docs/run-folder.md): the train ranks' reduced numbers, the rewards of every generated
sample, generation lengths, staleness, faults, data-plane traffic, timings and throughput."""

from __future__ import annotations

import numpy as np

from dataplane_rl.columns.rowsets import rowset_size
from dataplane_rl.driver.samples import reward_extras, source_rewards
from dataplane_rl.driver.step_io import Groups, StepIO
from dataplane_rl.rollout.multiturn import episode_metrics
from dataplane_rl.store import to_numpy

# the train ranks' reduced metrics logged as train/<name> (distillation_* and task_loss are added when present)
TRAIN_KEYS = ("loss", "pg_loss", "kl_penalty", "positive_nll_loss", "clip_fraction", "dual_clip_fraction",
              "probs_ratio_mean", "approx_entropy", "entropy", "grad_norm", "global_valid_toks", "logprob_mismatch",
              "token_mult_prob_error", "lr", "param_norm", "clip_fraction_lower", "clip_fraction_upper", "ppo_kl",
              "padding_fraction", "rank_token_imbalance", "sampling_importance_ratio", "is_oob_ratio",
              "is_eff_sample_size", "is_masked_seqs", "mean_seq_mult_prob_error", "max_seq_mult_prob_error",
              "num_masked_seqs")


def step_metrics(step: int, train: dict, got: Groups, kept_rewards: np.ndarray, io: StepIO, *, since: float,
                 epochs: int, async_on: bool, data_plane: bool, counters: dict) -> dict:
    """The metrics of `step`. since: wall seconds since the previous step ended; counters: the fault counters."""
    m = {"step": step}
    obs_tokens = to_numpy(got.scalars.column("observation_tokens")).astype(np.float64)  # [n]
    m.update({f"train/{k}": train[k] for k in TRAIN_KEYS})
    m.update({f"train/{k}": v for k, v in train.items() if k.startswith("distillation_") or k == "task_loss"})
    generated = np.concatenate(got.rounds_rewards)
    m["train/reward"] = float(np.mean(generated))
    m["train/reward_std"] = float(np.std(generated))
    m["train/reward_min"] = float(np.min(generated))
    m["train/reward_max"] = float(np.max(generated))
    m.update(source_rewards(generated, got.rounds_sources))
    m.update(reward_extras(got.scalars.column("reward_extra_info").to_pylist()))  # of the trained samples
    m["train/zero_advantage_group_fraction"] = got.zero_advantage_groups / max(got.groups_generated, 1)
    m["generation/response_length_mean"] = train["response_length_mean"]
    m["generation/response_length_max"] = train["response_length_max"]
    m["generation/prompt_length_mean"] = train["prompt_length_mean"] - float(obs_tokens.mean())
    m["generation/truncated_fraction"] = float(to_numpy(got.scalars.column("truncated")).astype(bool).mean())
    m.update(episode_metrics(got.scalars, train["response_tokens"]))
    m["train/filtered_reward"] = float(np.mean(kept_rewards))
    m["train/generation_rounds"] = len(got.pids)
    m["train/optimizer_steps"] = train["optimizer_steps"]
    staleness = (step - 1) - to_numpy(got.scalars.column("generation_policy_version"))  # [n]
    m["async/enabled"] = async_on
    m["async/staleness_mean"] = float(staleness.mean())
    m["async/staleness_max"] = int(staleness.max())
    m["async/dropped_stale"] = got.dropped_stale
    if got.token_versions is not None:
        m.update(token_ages(step, got.token_versions, got.in_flight_refits))
    m.update(counters)
    m["data_plane/enabled"] = data_plane
    m["data_plane/bytes_written"] = io.bytes_written
    m["data_plane/bytes_read"] = io.bytes_read
    m["data_plane/put_seconds"] = io.put_s
    m["data_plane/get_seconds"] = io.get_s
    m["data_plane/seconds"] = io.put_s + io.get_s
    m["data_plane/driver_bytes_read"] = io.driver_bytes_read
    for k, v in io.timing.items():
        m[f"timing/{k}"] = v
    # samples trained per second of wall time since the previous step ended: with async GRPO the next steps'
    # generation overlaps this step, so this, not 1/timing/step, is the run's rate
    m["throughput/samples_per_s"] = rowset_size(got.rs) / since
    # prompt + response tokens through the train passes (every epoch) per second of the train phase, and response
    # tokens of the trained rows per second of generation (verl's and NeMo-RL's throughput keys)
    m["throughput/train_tokens_per_s"] = train["total_tokens"] * epochs / max(io.timing["train"], 1e-9)
    m["throughput/generation_tokens_per_s"] = train["response_tokens"] / max(io.timing["generate"], 1e-9)
    return m


def token_ages(step: int, versions, in_flight_refits: int) -> dict:
    """async/* metrics of in-flight weight updates from the trained rows' token_policy_version (a list array): a
    generated token's age is step-1 minus the version that sampled it; -1 (prompt, observation) is no generated
    token. A sample is mixed when its generated tokens span more than one version."""
    offsets = to_numpy(versions.offsets).astype(np.int64)  # [n+1]
    values = to_numpy(versions.values).astype(np.int64)[offsets[0]:offsets[-1]]  # [T]
    row = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))  # [T] each token's row
    gen = values >= 0
    oldest = np.full(len(offsets) - 1, np.iinfo(np.int64).max)  # [n]
    newest = np.full(len(offsets) - 1, -1)  # [n]
    np.minimum.at(oldest, row[gen], values[gen])
    np.maximum.at(newest, row[gen], values[gen])
    age = (step - 1) - values[gen]  # [T_gen]
    return {
        "async/mixed_version_samples": int(((newest >= 0) & (newest > oldest)).sum()),
        "async/in_flight_refits": in_flight_refits,
        "async/token_age_mean": float(age.mean()) if len(age) else 0.0,
        "async/token_age_max": int(age.max()) if len(age) else 0,
    }
