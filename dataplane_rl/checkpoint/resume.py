"""`train --resume RUN_DIR`: the run's own config.yaml plus overrides, refusing any that change the numbers."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from dataplane_rl.config import ALL_KEYS, Config, load_config
from dataplane_rl.errors import ConfigError

# Keys a resumed run may change: where and how data moves, how often it saves, how long it runs, memory,
# how long it waits, its fault budgets (each only decides whether a run stops, never what a step that
# completes computes), when it validates, and the shape (train ranks and rollout actors: DCP reshards the
# state, normalisers are global and every sample is seeded by itself, so only the reduction order changes).
# Everything else (seed, batch sizes, loss, model, task, generation sampling, device and precision) would
# make the resumed steps differ from an uninterrupted run. grpo.max_num_steps is here although a cosine
# schedule decays over it: the schedule follows the resumed config (train/scheduler.py, docs/checkpoints.md).
SAFE_PREFIXES = ("logger.", "cluster.", "checkpointing.", "data_plane.enabled", "data_plane.backend",
                 "policy.dp_size", "generation.num_workers",
                 "data_plane.keep_partitions", "data_plane.mooncake.", "data_plane.shm.", "grpo.max_num_steps",
                 "policy.train_micro_batch_size", "policy.activation_checkpointing", "policy.model_cache_dir",
                 "generation.vllm.kv_cache_space_gb", "generation.vllm.gpu_memory_utilization",
                 "generation.vllm.enforce_eager", "fault_tolerance.", "grpo.async_grpo.wait_timeout_s",
                 "grpo.max_gen_batches", "grpo.val_period", "grpo.val_at_start")


def numbers(cfg: Config) -> dict[str, object]:
    """The value of every key that changes a run's numbers (every key outside SAFE_PREFIXES), by dotted name."""
    node = cfg.model_dump(mode="json", by_alias=True)
    out = {}
    for key, field in ALL_KEYS.items():
        if key.startswith(SAFE_PREFIXES) or isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue
        value = node
        for part in key.split("."):
            value = value[part]
        out[key] = value
    return out


def resume_config(run_dir: str | Path, overrides: list[str]) -> Config:
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; pass the folder of an earlier run")
    pinned = [f"logger.run_dir={run_dir}"]
    new = load_config(path, [*overrides, *pinned])
    old, now = numbers(load_config(path, pinned)), numbers(new)
    for key, value in now.items():
        if old[key] != value:
            raise ConfigError(f"--resume {run_dir}: {key}={value!r} differs from the run's {old[key]!r} and would "
                              "change the resumed steps' numbers; drop the override, or start a new run")
    return new
