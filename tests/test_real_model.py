"""A real pre-trained model as users bring one: SmolLM2-135M-Instruct from a GGUF file (tests/real_model.py).

It catches what the tiny character model cannot: a byte-level BPE of 49,152 tokens, a ChatML template, BOS that
the tokenizer does not add, EOS equal to pad, a learning rate that suits a pre-trained model. One GRPO run of 3
steps with the data plane on, docs/models.md's command run through the CLI as a user starts it, is audited row by
row from its stored columns.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from real_model import BOS, EOS, PAD, PARAMETERS, VOCABULARY, gguf_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def real():
    from dataplane_rl.model.load import load_tokenizer, resolve_model

    folder = resolve_model(str(gguf_file()), 0)
    return folder, load_tokenizer(folder)


def test_the_gguf_file_becomes_an_fp32_folder_once(real):
    from safetensors import safe_open

    from dataplane_rl.model.describe import parameter_count
    from dataplane_rl.model.load import eos_token_ids, resolve_model

    folder, tok = real
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config  # a plain model, not a GGUF one
    with safe_open(folder / "model.safetensors", "pt") as st:
        assert {str(st.get_slice(k).get_dtype()) for k in st.keys()} == {"F32"}
    assert parameter_count(folder) == PARAMETERS and len(tok) == VOCABULARY
    assert (tok.bos_token_id, eos_token_ids(folder, tok), tok.pad_token_id) == (BOS, [EOS], PAD)
    assert "<|im_start|>" in tok.chat_template
    t0 = time.perf_counter()
    assert resolve_model(str(gguf_file()), 0) == folder  # converted once: the cached folder, by the file's content
    assert time.perf_counter() - t0 < 5  # a hash of 98 MB, not a second conversion (~20 s)


def test_prompts_are_tokenized_as_the_tokenizer_means_them(real):
    from dataplane_rl.tasks import get_task
    from dataplane_rl.tasks.prompts import encode_prompt, prompt_ids

    _, tok = real
    task = get_task("repeat")
    text = task.prompts(0, 1, 0, 1)[0]
    ids, shown = prompt_ids(task, text, tok, apply_chat_template=False)
    # this tokenizer adds no BOS to a text, so a text prompt carries none (BOS here is <|im_start|>, which would
    # open a turn with no role)
    assert ids == tok(text).input_ids == tok(text, add_special_tokens=False).input_ids and BOS not in ids
    assert shown == text
    ids, shown = prompt_ids(task, text, tok, apply_chat_template=True)  # task.apply_chat_template: one user turn
    assert shown == tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=False)
    assert shown.endswith("<|im_start|>assistant\n") and f"<|im_start|>user\n{text}<|im_end|>" in shown
    # the template writes its own turns; nothing is added in front of them
    assert ids == encode_prompt(tok, shown, chat=True) and ids[0] == BOS and ids[1] != BOS


PAGE, ME = "docs/models.md", "tests/test_real_model.py"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """docs/models.md's command: 3 GRPO steps on SmolLM2 at the default learning rate, data plane on, validated
    greedily before and after; the page's link to the model is the wheel's file, and the stored partitions are
    exported (logger.save_rollouts) for the audit."""
    run_dir = tmp_path_factory.mktemp("real") / "run"
    from test_readme import page_command

    argv = page_command(PAGE, ME)  # docs/models.md's command (tests/test_readme.py hands that block to this file)
    model = [w for w in argv if w.startswith("policy.model=")]
    assert model == ["policy.model=models/SmolLM2-135M-Instruct.Q4_1.gguf"], argv
    argv = [f"policy.model={gguf_file()}" if w in model else w for w in argv]
    argv += ["logger.save_rollouts=true", "logger.progress=false", f"logger.run_dir={run_dir}"]
    p = subprocess.run([sys.executable, "-m", "dataplane_rl.cli.main", *argv], capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    return run_dir, p.stderr


def test_the_start_names_the_model_and_its_learning_rate(run):
    run_dir, stderr = run
    line = next(x for x in stderr.splitlines() if x.startswith("model "))
    assert "134.5M parameters, vocabulary 49152, bos 1 eos [2] pad 2, chat template yes, BOS added to text no" in line
    assert "WARNING" not in stderr
    config = (run_dir / "config.yaml").read_text()
    assert re.search(r"^  learning_rate: 1\.0e-06$", config, re.M), "a real model's default lr is 1e-6"


def test_every_stored_row_audits_clean(run, real):
    from dataplane_rl.config import load_config
    from dataplane_rl.tasks import load_task

    run_dir, _ = run
    _, tok = real
    cfg = load_config(run_dir / "config.yaml", [])
    task = load_task(cfg.task, tok)
    files = sorted((run_dir / "rollouts").glob("step_*.parquet"))
    assert len(files) == 3
    gaps, tokens = 0.0, 0
    for f in files:
        rows = pq.read_table(f).to_pylist()
        assert len(rows) == 8  # the page's 2 prompts x 4 samples
        for r in rows:
            ids, L = r["input_ids"], r["input_lengths"]
            assert len(ids) == len(r["token_mask"]) == len(r["generation_logprobs"]) == L
            plen = L - sum(r["token_mask"])
            prompt, response = ids[:plen], ids[plen:]
            # the prompt is the row's chat messages through the template, tokenized without added specials
            assert prompt == tok(r["prompt_text"], add_special_tokens=False).input_ids
            assert r["prompt_text"] == task.text(r["dataset_row"])
            assert r["token_mask"] == [0] * plen + [1] * len(response)  # masks from lengths: EOS == pad is kept
            assert tok.decode(response, skip_special_tokens=True) == r["response_text"]
            # EOS ends a response or nothing: it stops at the first one; truncated means it never came
            assert EOS not in response[:-1] and r["truncated"] == (response[-1] != EOS)
            assert r["total_reward"] == task.reward(r["dataset_row"], r["response_text"])
            # the trainer's log-probs are the policy's tokens' alone: the output layer never ran at the prompt
            assert r["prev_logprobs"][:plen] == r["reference_policy_logprobs"][:plen] == [0.0] * plen
            for a, b in zip(r["generation_logprobs"][plen:], r["prev_logprobs"][plen:]):
                gaps += abs(a - b)
            tokens += len(response)
    assert gaps / tokens < 1e-4, f"generation vs trainer log-prob mean |diff| {gaps / tokens:.2e}"


def test_the_default_learning_rate_does_not_collapse_it(run):
    run_dir, _ = run
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [m["validation/reward"] for m in metrics if "validation/reward" in m]
    train = [m for m in metrics if "train/entropy" in m]
    assert len(val) == 2 and len(train) == 3
    assert train[0]["train/lr"] == pytest.approx(1e-6)
    assert val[1] >= val[0] - 0.125, f"greedy held-out reward fell from {val[0]} to {val[1]}"
    # a collapse (lr 1e-3: 4.24 -> 0.92 in one step) cuts the entropy of the sampled tokens to a fifth; at 1e-6 the
    # weights barely move and each step's 2 prompts differ: 2.82 -> 2.15 (step 1 -> 3) was measured on such a run
    assert train[-1]["train/entropy"] > 0.5 * train[0]["train/entropy"]
    responses = [json.loads(x)["response"] for x in (run_dir / "train_data" / "step_000003.jsonl").read_text().splitlines()]
    assert len(set(responses)) > len(responses) // 2  # not one repeated answer
