"""Config: YAML + dotted overrides, validated before anything starts; errors name the key."""

import os
import re

import pytest

from dataplane_rl.config import config_reference, load_config
from dataplane_rl.config.load import check_overrides
from dataplane_rl.errors import ConfigError


def test_embedded_default_loads():
    cfg = load_config()
    assert cfg.policy.model == "tiny" and cfg.data_plane.backend.startswith("shm://")
    assert "total_reward" in cfg.train_fields()


def test_overrides_are_typed():
    cfg = load_config(None, ["data_plane.enabled=true", "grpo.seed=7", "loss_fn.ratio_clip_c=3.0",
                             "data_plane.backend=mooncake://"])
    assert cfg.data_plane.enabled is True and cfg.grpo.seed == 7 and cfg.loss_fn.ratio_clip_c == 3.0


def test_unknown_key_suggests_the_closest():
    with pytest.raises(ConfigError, match="'loss_fn.nope'"):
        load_config(None, ["loss_fn.nope=1"])
    with pytest.raises(ConfigError, match="did you mean 'loss_fn.ratio_clip_max'"):
        load_config(None, ["loss_fn.ratio_clip_mx=0.3"])


@pytest.mark.parametrize("override,says", [
    ("data.train_files=train.parquet", "verl's data.train_files is task.path here (with task.name=dataset)"),
    ("data.val_files=val.parquet", "verl's data.val_files is task.val_path here"),
    ("data.prompt_key=prompt", "verl's data.prompt_key is task.input_key here"),
    ("data.max_prompt_length=512", "verl's data.max_prompt_length is task.max_prompt_length here"),
    ("data.filter_overlong_prompts=true", "is task.filter_overlong_prompts here"),
    ("data.truncation=left", "is task.truncation here"),
    ("data.reward_fn_key=data_source", "not a key here: a row's source is always its data_source column"),
    ("custom_reward_function.path=r.py", "is task.reward_function=FILE.py:NAME here"),
    ("custom_reward_function.name=compute_score", "is task.reward_function=FILE.py:NAME here"),
    ("+custom_reward_function.reward_kwargs.format_score=0.25", "is task.reward_kwargs.format_score here"),
    ("reward.custom_reward_function.path=r.py", "is task.reward_function=FILE.py:NAME here"),
    ("reward_model.reward_manager=batch", "verl's reward_model.reward_manager is task.reward_manager here"),
    ("actor_rollout_ref.rollout.n=8", "is grpo.num_generations_per_prompt here"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "counted in samples (verl's counts prompts: times rollout.n)"),
    ("data.dataset_name=OpenMathInstruct-2", "NeMo-RL's data.dataset_name is task.name here"),
    ("data.train_data_path=t.jsonl", "NeMo-RL's data.train_data_path is task.path here"),
    ("loss_fn.force_on_policy_ratio=true", "NeMo-RL's loss_fn.force_on_policy_ratio is policy.force_prev_logprobs_pass"
                                           "=false here, the default"),
    # a verl key without a counterpart: its section's, never a look-alike
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "'actor_rollout_ref' is a section of verl's config"),
    ("data.tokenizer=x", "'data' is a section of verl's and NeMo-RL's configs, not of this one: a dataset is task.*"),
])
def test_a_verl_or_nemo_rl_key_is_named_by_where_it_lives_here(override, says):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert msg.startswith(f"unknown config key '{override.split('=')[0]}' (override '{override}'); ") and says in msg, msg
    assert "did you mean" not in msg and "data_plane" not in msg and "output_key" not in msg, msg


def test_a_verl_config_file_is_named_by_its_section(tmp_path):
    p = tmp_path / "verl.yaml"
    p.write_text("data:\n  train_files: train.parquet\n  prompt_key: prompt\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'data' \(in .*verl.yaml\); 'data' is a section of "
                                          r"verl's and NeMo-RL's configs.*task.path"):
        load_config(p)


def test_every_foreign_key_is_named_by_a_key_of_ours():
    import re

    from dataplane_rl.config.foreign_keys import KEYS
    from dataplane_rl.config.load import ALL_KEYS

    named = {m.group(1) for _, here in KEYS.values() if (m := re.match(r"([a-z_]+(?:\.[a-z_]+)+)", here))}
    assert len(named) >= 20 and named - set(ALL_KEYS) == set()
    assert not set(KEYS) & set(ALL_KEYS)  # none of them is a key here too


def test_unknown_key_in_file_names_the_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("grpo:\n  num_prompts_per_stepp: 4\n")
    with pytest.raises(ConfigError, match=r"grpo.num_prompts_per_stepp.*c.yaml.*num_prompts_per_step"):
        load_config(p)


@pytest.mark.parametrize("override,match", [
    ("grpo.seed=abc", "grpo.seed"),                       # wrong type
    ("loss_fn.ratio_clip_c=0.5", "loss_fn.ratio_clip_c"),  # out of range (must be > 1)
    ("policy.dp_size=0", "policy.dp_size"),
    ("generation.backend=trt", "generation.backend"),
    ("data_plane.backend=redis://x", "data_plane.backend"),
    ("policy.train_micro_batch_size=7", "train_micro_batch_size"),  # 64 % 7
    ("grpo.num_generations_per_prompt=1", "num_generations_per_prompt"),
])
def test_bad_values(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_nll_weight_needs_rewards_in_train_fields():
    fields = "[input_ids,input_lengths,token_mask,sample_mask,prev_logprobs,reference_policy_logprobs,advantages]"
    load_config(None, [f"data_plane.train_fields={fields}"])  # fine without the NLL term
    with pytest.raises(ConfigError, match="aliased to 'rewards' \\('total_reward'\\)"):
        load_config(None, ["loss_fn.positive_example_nll_weight=0.1", f"data_plane.train_fields={fields}"])


def test_kl_needs_reference_logprobs():
    fields = "[input_ids,input_lengths,token_mask,sample_mask,prev_logprobs,advantages,total_reward]"
    load_config(None, ["loss_fn.reference_policy_kl_penalty=0", f"data_plane.train_fields={fields}"])
    with pytest.raises(ConfigError, match="reference_policy_logprobs"):
        load_config(None, [f"data_plane.train_fields={fields}"])


def test_override_syntax_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["grpo.seed"])


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_validate():
    """Every shipped config loads, and every value it writes is the loaded config's (none dropped, renamed or
    coerced to another value on the way)."""
    import yaml

    from dataplane_rl.resources import data_dir

    def leaves(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict) and v:
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v

    files = sorted(data_dir("configs").glob("*.yaml"))
    assert {"grpo_tiny.yaml", "grpo_mooncake.yaml", "grpo_multiturn.yaml"} <= {p.name for p in files}, files
    for p in files:
        loaded = load_config(p).model_dump()
        written = list(leaves(yaml.safe_load(p.read_text())))
        assert written, p
        for key, value in written:
            if value is None:
                continue  # null asks for the default, which loading resolves (policy.learning_rate by the model)
            got = loaded
            for part in key.split("."):
                got = got[part]
            assert got == value, f"{p.name}: {key} is {got!r} loaded, {value!r} written"


def test_readme_config_reference_is_current():
    """docs/config.md's table is generated from the models; regenerate with
    `dataplane-rl config show --reference` when a field changes."""
    from pathlib import Path

    page = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    assert config_reference() in page, "docs/config.md is stale: paste `dataplane-rl config show --reference`"


def test_every_field_has_a_doc():
    from pydantic import BaseModel

    from dataplane_rl.config import ALL_KEYS

    undocumented = [k for k, f in ALL_KEYS.items() if not f.description
                    and not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))]
    assert undocumented == []


def test_wandb_without_the_package_is_refused_with_an_install_hint():
    import importlib.util

    assert importlib.util.find_spec("wandb") is None, "this test checks the refusal where wandb is not installed"
    assert load_config().logger.wandb_enabled is False
    with pytest.raises(ConfigError, match=r"logger.wandb_enabled.*pip install wandb"):
        load_config(None, ["logger.wandb_enabled=true"])


def test_validation_keys():
    cfg = load_config(None, ["grpo.val_period=0", "grpo.val_at_start=true", "grpo.max_val_samples=5",
                             "grpo.val_batch_size=2", "generation.val_temperature=0.7"])
    assert (cfg.grpo.val_period, cfg.grpo.val_at_start, cfg.grpo.max_val_samples, cfg.grpo.val_batch_size) == (0, True, 5, 2)
    assert load_config().generation.val_temperature == 0.0  # greedy by default
    for bad in ("grpo.val_period=-1", "grpo.max_val_samples=0", "grpo.val_batch_size=0", "generation.val_temperature=-1"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            load_config(None, [bad])


def test_kl_off_does_not_fetch_reference_logprobs():
    # beta = 0 skips the reference pass; the default train fields must not ask for its column
    assert "reference_policy_logprobs" in load_config().train_fields()
    assert "reference_policy_logprobs" not in load_config(None, ["loss_fn.reference_policy_kl_penalty=0"]).train_fields()


def test_on_policy_steps_skip_the_prev_logprobs_pass_and_every_other_step_says_why():
    """config/on_policy.py: the default run (4 optimizer steps per step) keeps the pass; one optimizer step per
    synchronous single-epoch step without the threshold skips it; each other setting names its key. The ranks add a
    policy with dropout: its train forward's log-probs are not the pass's."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dataplane_rl.config.on_policy import prev_pass_reasons
    from dataplane_rl.model.load import TINY
    from dataplane_rl.model.logprobs import dropout_modules

    assert prev_pass_reasons(load_config()) == ["4 optimizer steps per step (grpo.num_prompts_per_step x "
                                                "grpo.num_generations_per_prompt = 128 rows, "
                                                "policy.train_global_batch_size=32)"]
    one = ["policy.train_global_batch_size=128"]
    assert prev_pass_reasons(load_config(None, one)) == []
    assert prev_pass_reasons(load_config(None, [*one, "grpo.use_dynamic_sampling=true", "data_plane.enabled=true",
                                                "policy.dp_size=2",
                                                "loss_fn.use_importance_sampling_correction=true"])) == []
    for extra, key in ((["policy.force_prev_logprobs_pass=true"], "policy.force_prev_logprobs_pass=true"),
                       (["grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=0"],
                        "grpo.async_grpo.enabled=true"),
                       (["grpo.num_epochs=2"], "grpo.num_epochs=2"),
                       (["grpo.seq_logprob_error_threshold=2.0", "loss_fn.use_importance_sampling_correction=true"],
                        "grpo.seq_logprob_error_threshold=2.0")):
        [why] = prev_pass_reasons(load_config(None, [*one, *extra]))
        assert why.startswith(key), why
    tiny = dict(TINY, vocab_size=16)
    assert dropout_modules(Qwen2ForCausalLM(Qwen2Config(**tiny))) == []
    assert dropout_modules(Qwen2ForCausalLM(Qwen2Config(**tiny, attention_dropout=0.1))) == [
        "model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert dropout_modules(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1))) == ["1"]
    assert dropout_modules(torch.nn.Sequential(torch.nn.Dropout(0.0))) == []


def test_a_bad_override_names_the_command_line_not_the_embedded_file():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["grpo.seed=abc"])
    assert "override 'grpo.seed=abc'" in str(e.value) and "grpo_tiny.yaml" not in str(e.value)


def test_a_backend_without_the_data_plane_is_refused_naming_enabled():
    for url in ("mooncake://", "shm:///dev/shm/x", "memory://"):
        with pytest.raises(ConfigError, match=rf"data_plane.backend={url} is unused.*data_plane.enabled=true"):
            load_config(None, [f"data_plane.backend={url}"])
    load_config(None, ["data_plane.backend=mooncake://", "data_plane.enabled=true"])


def test_math_jsonl_without_a_path_is_refused_naming_the_sample():
    with pytest.raises(ConfigError, match=r"task.name=math_jsonl needs task.path.*task.path=\S+math_sample.jsonl"):
        load_config(None, ["task.name=math_jsonl"])


@pytest.mark.parametrize("overrides,match", [
    (["policy.max_total_sequence_length=3"], "a prompt of 4 tokens leaves no room for a response within "
                                             "policy.max_total_sequence_length=3"),
    (["policy.precision=bfloat16", "policy.device=cpu"], "policy.precision=bfloat16 needs CUDA"),
    pytest.param(["policy.device=cuda"], "policy.device=cuda but torch sees no CUDA device",
                 marks=pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")),
], ids=["prompt-too-long", "bf16-cpu", "cuda-none"])
def test_machine_dependent_config_is_refused_before_ray(overrides, match):
    """Once a RayTaskError from inside an actor (remote traceback, ANSI colours); now one ConfigError
    from the driver's preflight, before ray.init."""
    from dataplane_rl.driver.preflight import preflight

    with pytest.raises(ConfigError, match=match):
        preflight(load_config(None, overrides))


@pytest.mark.parametrize("typed,value", [
    ("no", "no"), ("yes", "yes"), ("on", "on"), ("Off", "Off"), ("y", "y"),  # YAML 1.1 booleans: strings
    ("true", True), ("False", False), ("TRUE", True),
    ("0123", 123), ("0o17", 15), ("0x1F", 31), ("-7", -7),                  # 1.1 read 0123 as octal 83
    ("1:30", "1:30"), ("1_000", "1_000"), ("2024-01-01", "2024-01-01"),     # 1.1: sexagesimal 90, 1000, a date
    ("1e-6", 1e-6), ("2.5", 2.5), (".inf", float("inf")), ("~", None), ("null", None), ("", None),
    ("[no, 1e3]", ["no", 1000.0]), ("{lang: no}", {"lang": "no"}),
])
def test_override_values_are_read_by_yaml_1_2s_core_schema(typed, value):
    """`task.reward_kwargs.lang=no` became False and `=0123` became 83 (YAML 1.1, PyYAML's default)."""
    cfg = load_config(None, [f"task.reward_kwargs.k={typed}"])
    assert cfg.task.reward_kwargs["k"] == value and type(cfg.task.reward_kwargs["k"]) is type(value)


def test_config_files_follow_the_same_rule_and_round_trip(tmp_path):
    from dataplane_rl.config import dump_config

    p = tmp_path / "c.yaml"
    p.write_text("task:\n  reward_kwargs:\n    lang: no\n    code: 0123\n    at: 1:30\n    tag: '1e3'\n    lr: 1e-3\n")
    cfg = load_config(p)
    assert cfg.task.reward_kwargs == {"lang": "no", "code": 123, "at": "1:30", "tag": "1e3", "lr": 1e-3}
    # config.yaml (what --resume reads) quotes every string either YAML version would read as something else
    again = tmp_path / "again.yaml"
    again.write_text(dump_config(cfg))
    assert load_config(again).task.reward_kwargs == cfg.task.reward_kwargs
    import yaml

    assert yaml.safe_load(again.read_text())["task"]["reward_kwargs"] == cfg.task.reward_kwargs


def test_yaml_merge_keys_are_accepted_and_explicit_keys_win(tmp_path):
    """`<<: *anchor` was refused as invalid YAML. A merged key is overridden by one written in the mapping; a key
    written twice is still refused."""
    p = tmp_path / "merge.yaml"
    p.write_text("policy:\n  sequence_packing: &budget\n    train_mb_tokens: 64\n    logprob_mb_tokens: 96\n"
                 "  dynamic_batching:\n    <<: *budget\n    train_mb_tokens: 128\n")
    policy = load_config(p).policy
    assert (policy.sequence_packing.train_mb_tokens, policy.sequence_packing.logprob_mb_tokens) == (64, 96)
    assert (policy.dynamic_batching.train_mb_tokens, policy.dynamic_batching.logprob_mb_tokens) == (128, 96)
    p.write_text(p.read_text() + "    train_mb_tokens: 256\n")
    with pytest.raises(ConfigError, match=r"found key 'train_mb_tokens' twice \(line 8\)"):
        load_config(p)


@pytest.mark.parametrize("overrides,says", [
    (["grpo.seed=1", "grpo.seed=2"], "override key 'grpo.seed' is given twice ('grpo.seed=1' and 'grpo.seed=2')"),
    (["grpo.async_grpo.enabled=true", "grpo.async_grpo={}"],
     "overrides 'grpo.async_grpo.enabled=true' and 'grpo.async_grpo={}' overlap: 'grpo.async_grpo.enabled' is "
     "inside 'grpo.async_grpo'"),
    (["grpo.async_grpo={}", "grpo.async_grpo.enabled=true"], "overlap"),
    (["task.reward_kwargs={a: 1, a: 2}"], "override 'task.reward_kwargs={a: 1, a: 2}': found key 'a' twice"),
])
def test_a_command_line_sets_each_key_once(overrides, says):
    """The last of two `key=value` for one key won silently, and a section given after one of its keys reset it."""
    from dataplane_rl.cli.main import main

    with pytest.raises(ConfigError, match=re.escape(says)):
        check_overrides(overrides)
    assert main(["config", "show", *overrides]) == 2
    check_overrides(["grpo.seed=1", "grpo.seed_x=2", "grpo.async_grpo.enabled=true", "grpo.async_grpo_x=1"])


def test_torch_threads_follow_the_model_the_caller_and_async_steps():
    """One thread a process for a small model (its matmuls too small for a second thread's barriers), every core a
    phase for a large one (halved when async GRPO generates while it trains), the caller's OMP_NUM_THREADS over
    both; a bad OMP_NUM_THREADS is refused before Ray starts."""
    from dataplane_rl.driver.preflight import SMALL_MODEL_PARAMETERS, preflight, torch_threads

    cfg = load_config(None, [])
    big = SMALL_MODEL_PARAMETERS
    assert torch_threads(cfg, 8, 300_000, {}) == (1, 1)
    assert torch_threads(cfg, 8, big, {}) == (8, 8)
    assert torch_threads(load_config(None, ["generation.num_workers=2", "policy.dp_size=4"]), 8, big, {}) == (4, 2)
    overlapped = load_config(None, ["grpo.async_grpo.enabled=true", "loss_fn.use_importance_sampling_correction=true"])
    assert torch_threads(overlapped, 8, big, {}) == (4, 4)
    assert torch_threads(cfg, 8, 300_000, {"OMP_NUM_THREADS": "3"}) == (3, 3)
    assert torch_threads(cfg, 2, big, {"OMP_NUM_THREADS": " 1 "}) == (1, 1)
    for bad in ("0", "two", "-1", "1.5"):
        with pytest.raises(ConfigError, match=rf"OMP_NUM_THREADS='{re.escape(bad)}' is not a positive whole number"):
            torch_threads(cfg, 8, big, {"OMP_NUM_THREADS": bad})
    os.environ["OMP_NUM_THREADS"] = "many"
    try:
        with pytest.raises(ConfigError, match="OMP_NUM_THREADS='many'"):
            preflight(cfg)
    finally:
        del os.environ["OMP_NUM_THREADS"]
