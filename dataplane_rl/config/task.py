"""`task.*`: the prompts, the reward and the user's own code (its own model; models.py's Config holds it as `task`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from dataplane_rl.config_types import CONFIG, StrictScalars


def _absolute(p: str) -> str:
    """A path as every process sees it: actors run in Ray's working directory, not the driver's."""
    return str(Path(p).expanduser().absolute())


def is_file_spec(spec: str) -> bool:
    """task.module / task.reward_function name a file (FILE.py, a/b) rather than an importable module."""
    return spec.endswith(".py") or "/" in spec or "\\" in spec


class TaskConfig(StrictScalars):
    """`task.*`: the prompts and the reward function; your own data, reward and environment (docs/tasks.md)."""

    model_config = CONFIG

    name: str = Field("repeat", description="Registered task (see dataplane_rl.tasks): repeat, next, count, math_jsonl, dataset (prompts from task.path); multi-turn: guess, tool (docs/multiturn.md); or one a task.module registers.")
    path: Optional[str] = Field(None, description="Data for file-based tasks: math_jsonl, a JSONL file with question and answer fields; dataset, a Parquet or JSONL file, a folder of them, or a Hugging Face `datasets` folder saved to disk (verl's layout: data_source, prompt, reward_model.ground_truth, extra_info).")
    val_path: Optional[str] = Field(None, description="task.name=dataset: held-out prompts for validation, in the same layout (verl: data.val_files). Unset: a fifth of task.path's prompts, chosen by a hash of the prompt, are held out.")
    input_key: str = Field("prompt", description="task.name=dataset: the column holding the prompt, text or chat messages (a list of {role, content}); a dotted name reaches into a struct (NeMo-RL: input_key).")
    output_key: str = Field("reward_model.ground_truth", description="task.name=dataset: the column holding the ground truth handed to the reward function; dotted names reach into structs (NeMo-RL: output_key).")
    shuffle: bool = Field(True, description="task.name=dataset: each epoch visits the training prompts in an order seeded by grpo.seed and the epoch (false: file order). Steps take consecutive prompts of that order, so a resumed run draws exactly the prompts it would have (verl: data.shuffle).")
    module: Optional[str] = Field(None, description="Your code: a FILE.py or an importable module name, imported in the driver and in every rollout actor and train worker before the task is looked up, so its register_task calls (tasks and multi-turn environments) work with task.name. On a cluster the file must exist at the same path on every host.")
    reward_function: Optional[str] = Field(None, description="FILE.py:NAME (or module:NAME; NAME defaults to compute_score), called as verl calls it: by keyword, data_source=, solution_str=, ground_truth=, extra_info= and task.reward_kwargs, passing only the parameters the function declares (all with **kwargs), checked before the run starts. It returns a float or a dict with 'score' (its other keys are the sample's reward_extra_info column, numeric ones, numpy and torch scalars too, logged as train/reward_extra/<key>); it replaces the task's reward, for multi-turn tasks at the end of each episode. An exception, NaN, a bool (Python's, numpy's or torch's) or non-number is a data failure (RewardFunctionError): retried, then its whole group fails (fault_tolerance.*).")
    reward_kwargs: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for task.reward_function, e.g. task.reward_kwargs.format_score=0.25 (verl: custom_reward_function.reward_kwargs). A key the function does not declare is refused before the run starts.")
    reward_manager: Literal["naive", "batch"] = Field("naive", description="How task.reward_function is called (verl: reward_model.reward_manager): naive, once per sample; batch, once per rollout job with lists (data_sources=, solution_strs=, ground_truths=, extra_infos=), returning one score or dict per sample. A batch call that raises is retried, then fails every group of the job.")
    apply_chat_template: bool = Field(False, description="Wrap a text prompt as one user turn and render it with policy.model's chat template (with the generation prompt), as chat prompts always are (verl: data.apply_chat_template). false: a text prompt is tokenized as it is, with BOS only where the tokenizer itself adds one. Needs a model whose tokenizer has a chat template.")
    max_prompt_length: Optional[int] = Field(None, ge=1, description="Most prompt tokens (verl: data.max_prompt_length). None: the least of what the model's positions (max_position_embeddings) leave after generation.max_new_tokens and policy.max_total_sequence_length - 1 (a response is cut to fit it but needs a token). A longer prompt is refused by row (task.truncation=error), filtered (task.filter_overlong_prompts) or cut (task.truncation=left|right); never trained silently.")
    filter_overlong_prompts: bool = Field(False, description="Leave out prompts longer than task.max_prompt_length (verl: data.filter_overlong_prompts): the step takes a seeded replacement row in its place, and rollout/overlong_prompts_filtered_total counts them.")
    truncation: Literal["error", "left", "right"] = Field("error", description="A prompt longer than task.max_prompt_length when task.filter_overlong_prompts is false (verl: data.truncation): error, the run stops naming the row; left, its first tokens are cut (the end is kept); right, its last tokens are cut.")

    @field_validator("path", "val_path")
    @classmethod
    def _absolute_path(cls, p: Optional[str]) -> Optional[str]:
        return _absolute(p) if p else p

    @field_validator("module")
    @classmethod
    def _absolute_module(cls, spec: Optional[str]) -> Optional[str]:
        return _absolute(spec) if spec and is_file_spec(spec) else spec

    @field_validator("reward_function")
    @classmethod
    def _absolute_reward(cls, spec: Optional[str]) -> Optional[str]:
        if not spec:
            return spec
        where, sep, name = spec.rpartition(":")
        if not sep or (len(where) == 1 and where.isalpha()) or "/" in name or "\\" in name:  # FILE.py, or C:\...
            where, name = spec, "compute_score"
        if not name.isidentifier():
            raise ValueError(f"task.reward_function '{spec}': '{name}' is not a Python name; use FILE.py:NAME")
        return f"{_absolute(where) if is_file_spec(where) else where}:{name}"

    @model_validator(mode="after")
    def _path_given(self) -> "TaskConfig":
        if self.name == "math_jsonl" and self.path is None:
            # refused rather than defaulted: a forgotten task.path would silently train on the sample
            sample = Path(__file__).resolve().parent.parent / "tasks" / "math_sample.jsonl"
            raise ValueError(f"task.name=math_jsonl needs task.path, a JSONL file with question and answer "
                             f"fields; e.g. the bundled sample: task.path={sample}")
        if self.name == "dataset" and self.path is None:
            raise ValueError("task.name=dataset needs task.path, a Parquet or JSONL file (or a folder of them) in "
                             "verl's layout; e.g. task.path=examples/data/train.parquet")
        return self
