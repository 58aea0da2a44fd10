"""The run config: one pydantic model per component, loaded from YAML with dotted key=value overrides."""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dataplane_rl.algorithms.loss import LossConfig
from dataplane_rl.config_types import CONFIG, StrictScalars
from dataplane_rl.errors import ConfigError
from dataplane_rl.resources import data_dir


class _Section(StrictScalars):
    model_config = CONFIG


class GRPOConfig(_Section):
    """`grpo.*`: rollout batch shape, advantages and dynamic sampling."""

    num_prompts_per_step: int = Field(16, ge=1, description="Prompts (groups) trained on per step.")
    num_generations_per_prompt: int = Field(8, ge=1, description="Samples per prompt (G); the group for the baseline.")
    max_num_steps: int = Field(100, ge=1, description="Rollout steps to run.")
    seed: int = Field(0, description="Seeds the model init, the prompts and every (step, prompt, sample) generation.")
    normalize_rewards: bool = Field(True, description="Divide advantages by the group std (+1e-6).")
    use_leave_one_out_baseline: bool = Field(False, description="Baseline = mean of the other samples in the group instead of the group mean.")
    use_dynamic_sampling: bool = Field(False, description="Keep only whole groups whose rewards are not all equal; generate more rounds until enough groups.")
    max_gen_batches: int = Field(4, ge=1, description="Most generation rounds per step with dynamic sampling before it fails.")
    overlong_filtering: bool = Field(False, description="Mask (sample_mask=0) samples that hit the generation length limit.")
    num_epochs: int = Field(1, ge=1, description="Passes over each step's rows (PPO epochs); prev_logprobs stay those from before the step, so later passes are clipped.")
    val_period: int = Field(10, ge=0, description="Validate on the task's held-out prompts every this many steps and after the last step; 0 turns validation off.")
    val_at_start: bool = Field(False, description="Also validate the initial policy, logged at step 0.")
    max_val_samples: int = Field(128, ge=1, description="Held-out prompts per validation (fewer if the task holds out fewer); one sample each.")
    val_batch_size: int = Field(64, ge=1, description="Held-out prompts per validation partition (one generate round each).")


class SchedulerConfig(_Section):
    """`policy.scheduler.*`: the learning-rate schedule, a torch LambdaLR stepped once per optimizer step."""

    name: Literal["constant", "cosine"] = Field("constant", description="After warmup: constant keeps policy.learning_rate; cosine decays it to min_lr_ratio * learning_rate at the last optimizer step.")
    warmup_steps: int = Field(0, ge=0, description="Optimizer steps of linear warmup from learning_rate / (warmup_steps + 1) up to learning_rate.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine only: the final learning rate as a fraction of policy.learning_rate.")


class PolicyConfig(_Section):
    """`policy.*`: the trained model and its optimizer."""

    model: str = Field("tiny", description="'tiny' builds a ~0.3M-parameter Qwen2-style model locally from the seed; otherwise a local Hugging Face folder.")
    model_cache_dir: Optional[str] = Field(None, description="Where the tiny model and tokenizer are cached; default ~/.cache/dataplane-rl.")
    train_global_batch_size: int = Field(32, ge=1, description="Samples per optimizer step, over all ranks.")
    train_micro_batch_size: int = Field(8, ge=1, description="Samples per forward/backward on one rank; does not change the numbers, only memory.")
    dp_size: int = Field(1, ge=1, description="Data-parallel training workers (torch.distributed ranks).")
    learning_rate: float = Field(1e-3, gt=0.0, description="AdamW learning rate (the peak, with policy.scheduler).")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0.0, description="Gradient norm clip.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: CUDA when available, else CPU.")
    precision: Literal["float32", "bfloat16"] = Field("float32", description="Train compute dtype; bfloat16 is an FSDP2 mixed-precision policy (fp32 master weights and gradient reduction), CUDA only.")
    activation_checkpointing: bool = Field(False, description="Recompute each decoder block's activations in backward: less memory, more compute; same numbers.")
    max_total_sequence_length: Optional[int] = Field(None, ge=2, description="Most prompt + response tokens per sample; longer responses are cut to fit and marked truncated. None: prompt + generation.max_new_tokens.")


class VLLMConfig(_Section):
    """`generation.vllm.*`: settings of the vLLM engine (only with generation.backend=vllm)."""

    kv_cache_space_gb: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU, in GiB.")
    gpu_memory_utilization: float = Field(0.3, gt=0.0, le=1.0, description="Fraction of GPU memory for vLLM on CUDA.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Engine dtype; 'auto' means float32 on CPU and bfloat16 on CUDA.")
    enforce_eager: bool = Field(True, description="Skip graph capture; faster start-up for small models.")


class GenerationConfig(_Section):
    """`generation.*`: the rollout engine."""

    backend: Literal["hf", "vllm"] = Field("hf", description="hf: Hugging Face generate (default, no extra install); vllm: needs the vllm extra.")
    num_workers: int = Field(1, ge=1, description="Rollout actors (Ray).")
    max_new_tokens: int = Field(8, ge=1, description="Response length limit; longer responses are truncated.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 disables it.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling: sample from the smallest set of tokens whose probability reaches top_p; 1.0 disables it. Log-probs stay full-vocabulary.")
    val_temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of validation; 0 decodes greedily.")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)

    @model_validator(mode="after")
    def _vllm_logprobs(self) -> "GenerationConfig":
        if self.backend == "vllm":
            from dataplane_rl.rollout.vllm_engine import logprobs_mode

            mode = logprobs_mode(self.temperature, self.top_k, self.top_p)  # raises, naming the keys, when no vLLM mode fits
            if self.val_temperature > 0 and logprobs_mode(self.val_temperature, self.top_k, self.top_p) != mode:
                raise ValueError(f"generation.val_temperature={self.val_temperature} needs another vLLM logprobs mode "
                                 f"than generation.temperature={self.temperature} with top_k={self.top_k}, "
                                 f"top_p={self.top_p}; use val_temperature=0 (greedy) or top_k=0 and top_p=1")
        return self


class MooncakeConfig(_Section):
    """`data_plane.mooncake.*`: sizes and transport of the Mooncake store."""

    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Transfer protocol; rdma needs an RDMA NIC and device_name.")
    device_name: str = Field("", description="RDMA device, e.g. mlx5_0; empty for tcp.")
    num_holders: int = Field(1, ge=1, description="Holder processes started when no address is given.")
    global_segment_size_mb: int = Field(512, ge=16, description="Memory each holder contributes to the store.")
    local_buffer_size_mb: int = Field(128, ge=16, description="Registered buffer per client for zero-copy puts and gets.")
    metadata_server: str = Field("P2PHANDSHAKE", description="Transfer-engine metadata server; P2PHANDSHAKE needs none.")
    local_hostname: Optional[str] = Field(None, description="Address every Mooncake client of the run advertises to its peers; None: each client's own node IP (the Ray node IP; 127.0.0.1 when the master is on loopback). Per node: env DATAPLANE_RL_MOONCAKE_HOST.")


class DataPlaneConfig(_Section):
    """`data_plane.*`: where the per-sample columns travel."""

    enabled: bool = Field(False, description="true: columns go through the column store; false: the driver passes them by reference.")
    backend: str = Field("shm://", description="Store URL: shm://[DIR] (one machine), mooncake://[HOST:PORT] (many; empty starts a local one), memory://, ray://.")
    schema_name: str = Field("grpo", alias="schema", description="Built-in schema name or path to a schema YAML file.")
    train_fields: Optional[list[str]] = Field(None, description="Columns each train worker fetches; default: the schema's DP_TRAIN_FIELDS.")
    keep_partitions: bool = Field(False, description="Keep each step's partition after training, for `dataplane-rl store ls RUN_DIR`; an auto-made shm:// folder then outlives the run (summary.json kept_store_url).")
    mooncake: MooncakeConfig = Field(default_factory=MooncakeConfig)

    model_config = ConfigDict(**CONFIG, populate_by_name=True)

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, url: str) -> str:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if scheme not in ("shm", "memory", "mooncake", "ray"):
            raise ValueError(f"'{url}' is not a store URL; use shm://, mooncake://HOST:PORT, memory:// or ray://")
        return url


class TaskConfig(_Section):
    """`task.*`: the prompts and the reward function."""

    name: str = Field("repeat", description="Registered task (see dataplane_rl.tasks): repeat, next, count, math_jsonl.")
    path: Optional[str] = Field(None, description="Data file for file-based tasks (math_jsonl: JSONL with question and answer fields).")


class LoggerConfig(_Section):
    """`logger.*`: the run folder and console output."""

    run_dir: Optional[str] = Field(None, description="Run folder: config.yaml, metrics.jsonl, train_data/, reward.png, summary.json. Unset: a fresh runs/YYYYmmdd-HHMMSS, with runs/latest pointing at it.")
    overwrite: bool = Field(False, description="Let a run replace the run already in logger.run_dir (its files go once the new run has started).")
    progress: bool = Field(True, description="Show a progress bar.")
    tensorboard_enabled: bool = Field(True, description="Write every metric to RUN_DIR/tensorboard/ (`tensorboard --logdir runs/`).")
    wandb_enabled: bool = Field(False, description="Also log to Weights & Biases, offline, into RUN_DIR/wandb/; needs `pip install wandb`.")
    wandb_project: str = Field("dataplane-rl", description="W&B project name (with wandb_enabled).")

    @field_validator("wandb_enabled")
    @classmethod
    def _wandb_installed(cls, on: bool) -> bool:
        import importlib.util

        if on and importlib.util.find_spec("wandb") is None:
            raise ValueError("logger.wandb_enabled=true needs the wandb package, which is not installed: "
                             "pip install wandb (or set logger.wandb_enabled=false)")
        return on


class CheckpointingConfig(_Section):
    """`checkpointing.*`: distributed checkpoints for --resume and export (NeMo-RL's key names)."""

    enabled: bool = Field(False, description="Save checkpoints (model, optimizer, RNG of every process, step, driver state, config).")
    checkpoint_dir: Optional[str] = Field(None, description="Where checkpoints go; default RUN_DIR/checkpoints.")
    save_period: int = Field(10, ge=1, description="Save every this many steps (and at the last step and on SIGTERM/SIGINT).")
    keep_top_k: Optional[int] = Field(3, ge=1, description="Keep the k most recent checkpoints; null keeps all.")


class ClusterConfig(_Section):
    """`cluster.*`: the Ray cluster."""

    address: Optional[str] = Field(None, description="Address of an existing Ray cluster ('auto' or host:port); None starts a local one.")
    num_cpus: Optional[int] = Field(None, ge=1, description="CPUs for a local Ray instance; default all.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field("SPREAD", description="Ray placement-group strategy for the rollout actors and, separately, the train workers: SPREAD puts them on as many nodes as it can.")


class Config(_Section):
    """The whole run."""

    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss_fn: LossConfig = Field(default_factory=LossConfig)
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        from dataplane_rl.schema import load_schema

        g, p = self.grpo, self.policy
        rows = g.num_prompts_per_step * g.num_generations_per_prompt
        if p.train_global_batch_size % (p.train_micro_batch_size * p.dp_size):
            raise ValueError(
                f"policy.train_global_batch_size={p.train_global_batch_size} must be a multiple of "
                f"policy.train_micro_batch_size * policy.dp_size = {p.train_micro_batch_size} * {p.dp_size}"
            )
        if rows % p.train_global_batch_size:
            raise ValueError(
                f"policy.train_global_batch_size={p.train_global_batch_size} must divide the rows per step "
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt = {rows}"
            )
        if (g.use_leave_one_out_baseline or g.use_dynamic_sampling or g.normalize_rewards) and g.num_generations_per_prompt < 2:
            raise ValueError("grpo.num_generations_per_prompt must be >= 2 for group baselines, normalisation and dynamic sampling")
        dp = self.data_plane
        if dp.keep_partitions:
            url = dp.backend
            gone = ("with data_plane.enabled=false the columns live in the driver's memory" if not dp.enabled else
                    "memory:// lives in the driver's process" if url.startswith("memory://") else
                    "mooncake:// without an address is a store the run starts and stops" if url.rstrip("/") == "mooncake:" else
                    "ray:// lives in the run's own Ray instance" if url.startswith("ray://") and not self.cluster.address
                    else None)
            if gone:
                raise ValueError(f"data_plane.keep_partitions=true would keep nothing: {gone}, which ends with the run; "
                                 "use data_plane.enabled=true with shm:// (the default) or a long-running "
                                 "mooncake://HOST:PORT store")
        schema = load_schema(self.data_plane.schema_name)
        fields = self.train_fields(schema)
        for f in fields:
            schema.column(f)
        need = {"input_ids", "input_lengths", "token_mask", "sample_mask", "prev_logprobs", "advantages"}
        loss = self.loss_fn
        rewards = schema.storage_name("rewards")
        if loss.positive_example_nll_weight > 0 and rewards not in fields:
            raise ValueError(
                f"loss_fn.positive_example_nll_weight={loss.positive_example_nll_weight} needs the column aliased to "
                f"'rewards' ('{rewards}') in the train fields {list(fields)}; add it to data_plane.train_fields "
                "(or DP_TRAIN_FIELDS) or set the weight to 0"
            )
        if loss.reference_policy_kl_penalty > 0:
            need.add("reference_policy_logprobs")
        if loss.use_importance_sampling_correction:
            need.add("generation_logprobs")
        missing = sorted(need - set(fields))
        if missing:
            raise ValueError(f"the train fields {list(fields)} lack {missing}, which the loss needs with this config; "
                             "add them to data_plane.train_fields")
        return self

    def train_fields(self, schema=None) -> tuple[str, ...]:
        """The columns each train worker fetches."""
        if self.data_plane.train_fields is not None:
            return tuple(self.data_plane.train_fields)
        from dataplane_rl.schema import load_schema

        fields = (schema or load_schema(self.data_plane.schema_name)).field_set("DP_TRAIN_FIELDS")
        if self.loss_fn.reference_policy_kl_penalty == 0:
            # beta = 0 skips the reference pass, so nothing writes the column: do not fetch it
            fields = tuple(f for f in fields if f != "reference_policy_logprobs")
        return fields


DEFAULT_CONFIG = "grpo_tiny.yaml"


def default_config_path() -> Path:
    return data_dir("configs") / DEFAULT_CONFIG


def _model_keys(model: type[BaseModel], prefix: str = "") -> dict[str, Any]:
    """Every dotted key of a model, mapped to its field info (sections included)."""
    out: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        out[prefix + key] = field
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_model_keys(ann, prefix + key + "."))
    return out


ALL_KEYS = _model_keys(Config)


def _unknown_key_error(key: str, source: str) -> ConfigError:
    # suggest a sibling first (loss_fn.ratio_clip_mx -> loss_fn.ratio_clip_max), then any key
    section = key.rsplit(".", 1)[0] + "." if "." in key else ""
    siblings = [k for k in ALL_KEYS if k.startswith(section) and k.count(".") == key.count(".")]
    match = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6) or difflib.get_close_matches(
        key, list(ALL_KEYS), n=1, cutoff=0.6)
    hint = f"; did you mean '{match[0]}'?" if match else "; run `dataplane-rl config show` for the valid keys"
    return ConfigError(f"unknown config key '{key}' ({source}){hint}")


def _check_keys(tree: dict, source: str, prefix: str = "") -> None:
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if key not in ALL_KEYS:
            raise _unknown_key_error(key, source)
        if isinstance(v, dict):
            _check_keys(v, source, key + ".")


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not key=value; write e.g. data_plane.enabled=true")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    for text in overrides:
        key, value = parse_override(text)
        if key not in ALL_KEYS:
            raise _unknown_key_error(key, f"override '{text}'")
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
    return tree


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (default: the embedded grpo_tiny.yaml), apply overrides, validate.

    Raises ConfigError naming the file or override, the key and the fix.
    """
    path = Path(path) if path is not None else default_config_path()
    if not path.is_file():
        raise ConfigError(f"config file '{path}' not found; pass an existing YAML file with --config")
    try:
        tree = yaml.safe_load(path.read_bytes().decode()) or {}
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file '{path}' is not UTF-8 text ({e.reason} at byte {e.start}); pass a YAML "
                          "file with --config") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file '{path}' must hold a mapping of sections (grpo:, policy:, ...)")
    _check_keys(tree, f"in {path}")
    apply_overrides(tree, list(overrides or []))
    return validate_tree(tree, str(path))


def validate_tree(tree: dict, source: str = "<dict>") -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as e:
        msgs = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"].removeprefix("Value error, ")
            got = err.get("input")
            shown = f" (got {got!r})" if loc and not isinstance(got, dict) else ""
            msgs.append(f"{loc}: {msg}{shown}" if loc else msg)
        raise ConfigError(f"invalid config ({source}): " + "; ".join(msgs)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)


def config_reference() -> str:
    """A Markdown table of every key, its default and its doc, generated from the models."""
    rows = ["| key | default | description |", "| --- | --- | --- |"]
    defaults = Config().model_dump(mode="json", by_alias=True)
    for key, field in ALL_KEYS.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            continue
        node: Any = defaults
        for part in key.split("."):
            node = node[part]
        rows.append(f"| `{key}` | `{json.dumps(node)}` | {field.description or ''} |")
    return "\n".join(rows)
