"""Export the policy as a Hugging Face folder (config, safetensors weights, tokenizer).

Written under a temporary name and renamed, so OUT is either whole or absent. The architecture and the
tokenizer come from the run's model folder; only the weights come from the checkpoint.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from dataplane_rl.errors import ConfigError
from dataplane_rl.store.targets import writing


def export_hf(state_dict: dict[str, torch.Tensor], model_folder: str | Path, out: str | Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from dataplane_rl.model.load import read_tokenizer

    out = Path(out)
    # a model of no memory whose parameters become the state dict's own tensors (assign): the export does not
    # build a randomly initialised model beside the weights and copy them into it
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_folder), dtype=torch.float32)
    result = model.load_state_dict(state_dict, strict=False, assign=True)
    tied = {k for k in result.missing_keys if model.config.tie_word_embeddings and k.startswith("lm_head.")}
    if set(result.missing_keys) - tied or result.unexpected_keys:
        raise ConfigError(f"the checkpoint does not match the model in {model_folder}: missing "
                          f"{sorted(set(result.missing_keys) - tied)[:5]}, unexpected {result.unexpected_keys[:5]}")
    model.tie_weights()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with writing(out, "the Hugging Face folder"):  # a full disk: one line, no half folder left
            model.save_pretrained(tmp, safe_serialization=True)
            read_tokenizer(model_folder).save_pretrained(tmp)  # as saved: AutoTokenizer would rebuild the tiny one
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def checkpoint_model_state(path: Path, model_folder: str | Path) -> dict[str, torch.Tensor]:
    """Full (unsharded) model weights from a checkpoint's train/ shards, read in this process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dataplane_rl.checkpoint.manager import single_process
    from dataplane_rl.checkpoint.files import dcp_load, read_dcp_metadata

    train = path / "train"
    saved = read_dcp_metadata(train).state_dict_metadata  # no pickled code runs (checkpoint/files.py)
    with torch.device("meta"):  # shapes only; dcp.load needs real tensors, made below
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_folder), dtype=torch.float32)
    target = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()
              if f"policy.model.{k}" in saved}
    with single_process():
        dcp_load({"policy": {"model": target}}, train, no_dist=True)
    return target


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None) -> tuple[Path, int]:
    """`dataplane-rl export`: the checkpoint of `step` (default the latest) of a run, as a HF folder."""
    from dataplane_rl.config import load_config
    from dataplane_rl.checkpoint.identity import read_run_id
    from dataplane_rl.checkpoint.manager import CheckpointManager, step_of
    from dataplane_rl.model.load import resolve_model

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run folder (no config.yaml); pass the RUN_DIR of a training run")
    cfg = load_config(run_dir / "config.yaml", [f"logger.run_dir={run_dir}"])
    path = CheckpointManager.for_config(cfg, read_run_id(run_dir)).find(step)  # verified before any load
    folder = resolve_model(cfg.policy.model, cfg.grpo.seed, cfg.policy.model_cache_dir)
    return export_hf(checkpoint_model_state(path, folder), folder, out), step_of(path)
