"""Config: YAML + dotted overrides, validated before anything starts; errors name the key."""

import pytest

from dataplane_rl.config import config_reference, load_config
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
    from dataplane_rl.resources import data_dir

    for p in data_dir("configs").glob("*.yaml"):
        load_config(p)


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
    from the driver's preflight, before ray.init (round-3 probe)."""
    from dataplane_rl.driver.preflight import preflight

    with pytest.raises(ConfigError, match=match):
        preflight(load_config(None, overrides))
