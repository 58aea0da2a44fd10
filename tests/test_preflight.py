"""Every check that needs no Ray is made before Ray starts: one clear ConfigError, no actor traceback."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError


@pytest.fixture
def no_ray(monkeypatch):
    """ray.init made to fail: a test passes only if the error comes before Ray would start."""
    import ray

    def refuse(*a, **k):
        raise AssertionError("Ray was started before the pre-start checks failed")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)


def train(tmp_path, *overrides):
    from dataplane_rl.driver.loop import train as run

    return run(load_config(None, ["grpo.max_num_steps=1", "logger.progress=false",
                                  f"logger.run_dir={tmp_path / 'run'}", *overrides]))


def test_vllm_backend_without_vllm_is_refused_before_ray(tmp_path, no_ray, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # not installed, whatever this environment holds
    with pytest.raises(ConfigError, match="install the `vllm` extra"):
        train(tmp_path, "generation.backend=vllm")


def test_model_folder_without_weights_or_tokenizer_is_refused_before_ray(tmp_path, no_ray):
    folder = tmp_path / "model"
    folder.mkdir()
    with pytest.raises(ConfigError, match="neither 'tiny', a .gguf file nor a local Hugging Face folder"):
        train(tmp_path, f"policy.model={folder}")
    (folder / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="no weights and no tokenizer files"):
        train(tmp_path, f"policy.model={folder}")


def test_a_gguf_file_missing_or_unreadable_is_refused_before_ray(tmp_path, no_ray):
    with pytest.raises(ConfigError, match="names a .gguf file that does not exist"):
        train(tmp_path, f"policy.model={tmp_path / 'nope.gguf'}")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)  # a header and nothing after it
    with pytest.raises(ConfigError, match="could not read this GGUF file"):
        train(tmp_path, f"policy.model={bad}", f"policy.model_cache_dir={tmp_path / 'cache'}")
    assert not any((tmp_path / "cache").glob("gguf-*")), "a failed conversion leaves no folder in the cache"


def test_task_file_missing_or_unreadable_is_refused_before_ray(tmp_path, no_ray):
    with pytest.raises(ConfigError, match="task.path .* not found"):
        train(tmp_path, "task.name=math_jsonl", f"task.path={tmp_path / 'nope.jsonl'}")
    binary = tmp_path / "q.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="cannot be read|not UTF-8"):  # main words the decode error its own way
        train(tmp_path, "task.name=math_jsonl", f"task.path={binary}")


def test_cli_prints_one_error_line_and_no_traceback(tmp_path):
    """`dataplane-rl train generation.backend=vllm` without vllm: exit 2, the hint, no ActorDiedError."""
    code = ("import sys; sys.modules['vllm'] = None; from dataplane_rl.cli.main import main; "
            f"sys.exit(main(['train', 'generation.backend=vllm', 'logger.run_dir={tmp_path / 'run'}']))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "error: ConfigError: generation.backend=vllm but vllm is not installed" in p.stderr
    assert "Traceback" not in p.stderr and "ActorDiedError" not in p.stderr, p.stderr[-3000:]


def _teacher(tmp_path, vocab_swap: bool = False):
    """A teacher folder: the seed's tiny model (weights and tokenizer), optionally with two token ids swapped."""
    import json
    import shutil

    from dataplane_rl.model.load import build_tiny

    folder = tmp_path / "teacher"
    shutil.copytree(build_tiny(0), folder)
    if vocab_swap:
        tok = json.loads((folder / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        vocab["a"], vocab["b"] = vocab["b"], vocab["a"]
        (folder / "tokenizer.json").write_text(json.dumps(tok))
    return folder


@pytest.mark.parametrize("case,want", [
    ("missing", "is not a Hugging Face model folder"),
    ("vocab", "another vocabulary than the student"),
    ("k_over_vocab", r"topk_logits_k=60 is more than the teacher's vocabulary \(53 tokens\)"),
    ("shape", r"column 'teacher_topk_logprobs' has shape \[64\], but distillation.topk_logits_k=8 needs shape \[8\]"),
])
def test_distillation_teacher_is_checked_before_ray(tmp_path, no_ray, case, want):
    """The built-in schema's teacher columns take the run's k; a schema file of one's own that writes a number
    there must match it."""
    from dataplane_rl.schema import schema_path

    teacher = tmp_path / "nothing" if case == "missing" else _teacher(tmp_path, vocab_swap=case == "vocab")
    k = {"k_over_vocab": 60, "shape": 8}.get(case, 16)
    fixed = tmp_path / "fixed.yaml"
    fixed.write_text(schema_path("grpo").read_text().replace("shape: [distillation.topk_logits_k]", "shape: [64]"))
    schema = [f"data_plane.schema={fixed}"] if case == "shape" else []
    with pytest.raises(ConfigError, match=want):
        train(tmp_path, "distillation.enabled=true", f"distillation.teacher={teacher}", f"distillation.topk_logits_k={k}",
              *schema)


def test_distillation_needs_a_teacher():
    with pytest.raises(ConfigError, match="distillation.enabled=true needs distillation.teacher"):
        load_config(None, ["distillation.enabled=true"])


def test_every_folder_the_run_writes_is_checked_before_ray(tmp_path, no_ray):
    """checkpointing.checkpoint_dir=/proc/x once failed only at the first save, after a step had trained; a bad
    policy.model_cache_dir or shm:// folder with a bare FileNotFoundError naming no key."""
    for override, key in (("checkpointing.checkpoint_dir=/proc/x", "checkpointing.checkpoint_dir"),
                          ("policy.model_cache_dir=/proc/x", "policy.model_cache_dir"),
                          ("data_plane.backend=shm:///proc/x/store", "data_plane.backend=shm:///proc/x/store")):
        with pytest.raises(ConfigError, match=rf"{re.escape(key)}: cannot write to /proc/x \("):
            train(tmp_path, "checkpointing.enabled=true", "data_plane.enabled=true", override)
    made = tmp_path / "new" / "ckpt"  # checked by making it; a refused run leaves it as it was
    with pytest.raises(ConfigError, match="task.path"):  # a later check refuses: nothing of the probe is left
        train(tmp_path, "checkpointing.enabled=true", f"checkpointing.checkpoint_dir={made}", "task.name=math_jsonl",
              f"task.path={tmp_path / 'nope.jsonl'}")
    assert not (tmp_path / "new").exists()


def test_a_module_that_exits_at_import_is_one_line_and_leaves_no_token_folder(tmp_path):
    """`task.module` calling os._exit(0) at import: `train` once exited 0 with no output and no run folder, a
    success that did nothing. Its import is tried in a child first: exit 2, one line naming task.module. The
    refused run's Ray token folder (made before the re-exec, run/private_ray.py) does not outlive it."""
    import os

    module = tmp_path / "quits.py"
    module.write_text("import os\nos._exit(0)\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", "train", f"task.module={module}",
                        f"logger.run_dir={tmp_path / 'run'}", "grpo.max_num_steps=1"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, TMPDIR=str(tmp)))
    lines = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith(f"error: ConfigError: task.module={module}: importing it ended its process "
                               "(exit code 0"), lines[0]
    assert "Traceback" not in p.stderr
    assert not [x.name for x in tmp.iterdir() if x.name.startswith("dataplane-rl-ray-")]
