"""`train --resume RUN_DIR`: the run's own config.yaml plus overrides, refusing any that change the numbers."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from dataplane_rl.config import ALL_KEYS, Config, load_config
from dataplane_rl.errors import ConfigError

# Keys a resumed run may change: where and how data moves, how often it saves, how long it runs, memory,
# and the shape (train ranks and rollout actors: DCP reshards the state, normalisers are global and every
# sample is seeded by itself, so only the reduction order changes). Everything else (seed, batch sizes,
# loss, model, task, generation sampling) would make the resumed steps differ from an uninterrupted run.
SAFE_PREFIXES = ("logger.", "cluster.", "checkpointing.", "data_plane.enabled", "data_plane.backend",
                 "policy.dp_size", "generation.num_workers",
                 "data_plane.keep_partitions", "data_plane.mooncake.", "grpo.max_num_steps",
                 "policy.train_micro_batch_size", "policy.activation_checkpointing", "policy.model_cache_dir",
                 "generation.vllm.kv_cache_space_gb", "generation.vllm.gpu_memory_utilization",
                 "generation.vllm.enforce_eager")


def _value(cfg: Config, key: str):
    node = cfg.model_dump(mode="json", by_alias=True)
    for part in key.split("."):
        node = node[part]
    return node


def resume_config(run_dir: str | Path, overrides: list[str]) -> Config:
    run_dir = Path(run_dir)
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"--resume {run_dir}: no config.yaml there; pass the folder of an earlier run")
    pinned = [f"logger.run_dir={run_dir}"]
    old = load_config(path, pinned)
    new = load_config(path, [*overrides, *pinned])
    for key, field in ALL_KEYS.items():
        if key.startswith(SAFE_PREFIXES) or isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue
        if _value(old, key) != _value(new, key):
            raise ConfigError(f"--resume {run_dir}: {key}={_value(new, key)!r} differs from the run's "
                              f"{_value(old, key)!r} and would change the resumed steps' numbers; drop the "
                              "override, or start a new run")
    return new
