"""The knobs users of NeMo-RL, TRL and verl look for: policy.scheduler, generation.top_p,
policy.max_total_sequence_length, grpo.num_epochs. Units first, then one tiny GRPO run that uses them all."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dataplane_rl.config import load_config
from dataplane_rl.errors import ConfigError
from dataplane_rl.rollout.engine import HFEngine, nucleus
from dataplane_rl.rollout.generation import Generation, sample_seed
from dataplane_rl.rollout.worker import cut, response_rooms
from dataplane_rl.train.scheduler import WarmupSchedule, build_scheduler, optimizer_steps_per_run


@pytest.mark.parametrize("override,key", [
    ("policy.scheduler.name=linear", "policy.scheduler.name"),
    ("policy.scheduler.warmup_steps=-1", "policy.scheduler.warmup_steps"),
    ("policy.scheduler.min_lr_ratio=1.5", "policy.scheduler.min_lr_ratio"),
    ("generation.top_p=0", "generation.top_p"),
    ("generation.top_p=1.2", "generation.top_p"),
    ("policy.max_total_sequence_length=1", "policy.max_total_sequence_length"),
    ("grpo.num_epochs=0", "grpo.num_epochs"),
])
def test_bad_knob_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_knobs_load_with_their_defaults_and_overrides():
    cfg = load_config()
    assert (cfg.policy.scheduler.name, cfg.policy.scheduler.warmup_steps, cfg.generation.top_p,
            cfg.policy.max_total_sequence_length, cfg.grpo.num_epochs) == ("constant", 0, 1.0, None, 1)
    cfg = load_config(None, ["policy.scheduler.name=cosine", "policy.scheduler.warmup_steps=3", "generation.top_p=0.9",
                             "policy.max_total_sequence_length=64", "grpo.num_epochs=2"])
    assert cfg.policy.scheduler.name == "cosine" and cfg.generation.top_p == 0.9 and cfg.grpo.num_epochs == 2


def test_vllm_top_p_needs_temperature_one():
    """vLLM's processed log-probs are top-p renormalised, its raw ones unscaled: top_p < 1 with
    temperature != 1 has no mode that equals the trainer's, so the config is refused, naming top_p."""
    with pytest.raises(ConfigError, match=r"generation\.top_p"):
        load_config(None, ["generation.backend=vllm", "generation.top_p=0.9", "generation.temperature=0.7"])
    from dataplane_rl.rollout.vllm_engine import logprobs_mode

    assert logprobs_mode(1.0, 0, 0.9) == "raw_logprobs" and logprobs_mode(0.7, 0, 1.0) == "processed_logprobs"


def test_keep_partitions_with_a_store_that_ends_with_the_run_is_refused():
    for overrides in (["data_plane.keep_partitions=true"],  # data plane off
                      ["data_plane.keep_partitions=true", "data_plane.enabled=true", "data_plane.backend=memory://"],
                      ["data_plane.keep_partitions=true", "data_plane.enabled=true", "data_plane.backend=mooncake://"]):
        with pytest.raises(ConfigError, match="keep_partitions=true would keep nothing"):
            load_config(None, overrides)
    load_config(None, ["data_plane.keep_partitions=true", "data_plane.enabled=true"])  # shm:// keeps its folder


def test_warmup_then_constant_or_cosine():
    # warmup W=3: (s+1)/(W+1) = 1/4, 2/4, 3/4, then 1; cosine over s=3..9 (6 intervals) to min 0.1:
    # s=6 is half-way: 0.1 + 0.9 * (1 + cos(pi/2)) / 2 = 0.55; s=9 (last) is 0.1
    const = WarmupSchedule("constant", 3, 10)
    assert [const(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = WarmupSchedule("cosine", 3, 10, min_lr_ratio=0.1)
    assert cos(2) == 0.75 and cos(3) == 1.0
    assert cos(6) == pytest.approx(0.55) and cos(9) == pytest.approx(0.1) and cos(20) == pytest.approx(0.1)


def test_scheduler_is_a_torch_lr_scheduler_whose_state_round_trips():
    cfg = load_config(None, ["policy.scheduler.name=cosine", "policy.scheduler.warmup_steps=2",
                             "grpo.max_num_steps=3", "grpo.num_epochs=2"])
    assert optimizer_steps_per_run(cfg) == 3 * (16 * 8 // 32) * 2  # steps x global batches x epochs = 24
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=0.01)
    sched = build_scheduler(opt, cfg)
    assert isinstance(sched, torch.optim.lr_scheduler.LRScheduler)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.01 / 3)  # first warmup step: never lr 0
    for _ in range(5):
        opt.step()
        sched.step()
    state = sched.state_dict()
    opt2 = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01)
    sched2 = build_scheduler(opt2, cfg)
    sched2.load_state_dict(state)
    opt2.step()
    sched2.step()
    opt.step()
    sched.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"] < 0.01


def test_a_resumed_cosine_schedule_follows_the_resumed_runs_total_steps(tmp_path):
    """A 2-step cosine run extended to 4 steps on resume once trained at lr 0 from step 3 on: the checkpoint
    brought back the schedule's old total. Saved and loaded as a train rank does (DCP, the optimizer under
    "policy" and the scheduler beside it), the rates after the checkpoint are the 4-step schedule's."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import torch.distributed.checkpoint as dcp

    from dataplane_rl.checkpoint.files import dcp_load
    from dataplane_rl.checkpoint.manager import single_process
    from dataplane_rl.train.state import PolicyState

    # 4 prompts x 4 samples / a global batch of 8: 2 optimizer steps per rollout step
    small = ["policy.scheduler.name=cosine", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
             "policy.train_global_batch_size=8", "policy.learning_rate=0.001"]
    two, four = (load_config(None, [*small, f"grpo.max_num_steps={n}"]) for n in (2, 4))

    def rank(cfg):
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.policy.learning_rate)
        return model, opt, build_scheduler(opt, cfg)

    model, opt, sched = rank(two)
    rates = []
    for _ in range(4):  # the 2-step run: optimizer steps 0..3, cosine over 4
        rates.append(opt.param_groups[0]["lr"])
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        sched.step()
    assert rates == pytest.approx([1e-3, 7.5e-4, 2.5e-4, 0.0])
    with single_process():
        dcp.save({"policy": PolicyState(model, opt), "scheduler": sched}, checkpoint_id=tmp_path, no_dist=True)
    model2, opt2, sched2 = rank(four)
    with single_process():
        dcp_load({"policy": PolicyState(model2, opt2), "scheduler": sched2}, tmp_path, no_dist=True)
    assert sched2.last_epoch == 4 and torch.equal(model2.weight, model.weight)
    assert get_state_dict(model2, opt2)[1]["state"], "the AdamW moments came back"
    resumed = []
    for _ in range(4):  # steps 3-4 of the 4-step run: optimizer steps 4..7, cosine over 8
        resumed.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    schedule = WarmupSchedule("cosine", 0, 8)
    assert resumed == pytest.approx([1e-3 * schedule(s) for s in range(4, 8)]) and resumed[0] > 3e-4
    # a state saved by a scheduler that kept its settings (LambdaLR's lr_lambdas) loads, its total not taken
    old = torch.optim.lr_scheduler.LambdaLR(opt, WarmupSchedule("cosine", 0, 4)).state_dict()
    assert "lr_lambdas" in old
    sched3 = rank(four)[2]
    sched3.load_state_dict({**old, "last_epoch": 4})
    assert sched3.get_last_lr() == pytest.approx([1e-3 * schedule(4)])


def test_nucleus_keeps_the_smallest_set_reaching_top_p():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps 0.5 + 0.3 (0.5 alone < 0.7); top_p=0.5 keeps 0.5 only
    logp = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()  # [1, 4]
    assert torch.isfinite(nucleus(logp, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(nucleus(logp, 0.5)).tolist() == [[True, False, False, False]]
    assert torch.isfinite(nucleus(logp, 1.0 - 1e-9)).all()
    shuffled = logp[:, [2, 0, 3, 1]]  # vocab order does not matter
    assert torch.isfinite(nucleus(shuffled, 0.7)).tolist() == [[False, True, False, True]]


@pytest.fixture(scope="module")
def tiny():
    from dataplane_rl.model.load import build_tiny, load_model, load_tokenizer

    folder = build_tiny(0)
    return folder, load_tokenizer(folder), load_model(folder, torch.device("cpu"))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 0.5), (0.7, 0, 0.6), (1.0, 5, 0.8)])
def test_hf_top_p_samples_the_nucleus_with_full_vocab_logprobs(tiny, temperature, top_k, top_p):
    """HF engine: every sampled token lies in the (top-k) nucleus of the step's distribution, and its
    log-prob is the trainer's token_logprobs (full vocabulary, temperature-scaled)."""
    from dataplane_rl.model.logprobs import token_logprobs

    _, tok, model = tiny
    engine = HFEngine(model, [tok.eos_token_id], tok.pad_token_id)
    prompts = [[tok.bos_token_id, 4 + d] for d in range(6) for _ in range(4)]
    seeds = [sample_seed(0, 1, 0, i, 0) for i in range(len(prompts))]
    gens = engine.generate(prompts, seeds, 6, temperature, top_k, top_p)
    for prompt, g in zip(prompts, gens):
        ids = torch.tensor([prompt + g.tokens])  # [1, T]
        with torch.no_grad():
            lp = token_logprobs(model, ids, torch.ones_like(ids), temperature)[0, len(prompt):]  # [n]
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / temperature  # [n, V]
        assert torch.allclose(lp, torch.tensor(g.logprobs), atol=1e-5)
        scores = torch.log_softmax(logits, -1)  # [n, V]
        if top_k:
            kth = scores.topk(top_k, dim=-1).values[:, -1:]  # [n, 1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        allowed = torch.isfinite(nucleus(scores, top_p))  # [n, V]
        assert allowed[torch.arange(len(g.tokens)), torch.tensor(g.tokens)].all(), "a token outside the nucleus"
    with torch.no_grad():
        first = torch.log_softmax(model(input_ids=torch.tensor(prompts[:1])).logits[:, -1].float() / temperature, -1)
    assert not torch.isfinite(nucleus(first, top_p)).all(), "this top_p must cut something, or the test proves nothing"


def test_max_total_sequence_length_cuts_and_marks_truncated():
    assert response_rooms([[1, 2], [1, 2, 3, 4]], 8, None) == [8, 8]
    assert response_rooms([[1, 2], [1, 2, 3, 4]], 8, 6) == [4, 2]
    with pytest.raises(ConfigError, match="policy.max_total_sequence_length=4"):
        response_rooms([[1, 2, 3, 4]], 8, 4)
    ended = Generation([5, 6, 2], [-1.0, -2.0, -3.0], truncated=False)  # 2 = eos
    assert cut(ended, 3) is ended
    assert cut(ended, 2) == Generation([5, 6], [-1.0, -2.0], truncated=True)


SMALL = ["grpo.num_prompts_per_step=8", "grpo.num_generations_per_prompt=4", "grpo.max_num_steps=2",
         "policy.train_global_batch_size=16", "policy.train_micro_batch_size=4", "generation.max_new_tokens=6",
         "logger.progress=false"]


def test_grpo_run_with_every_knob(tmp_path, ray_session):
    """2 steps, 2 epochs, cosine after 1 warmup step, top_p, a total-length cap, partitions kept on shm."""
    from dataplane_rl.store import open_store
    from dataplane_rl.driver.loop import train

    run_dir = tmp_path / "knobs"
    cfg = load_config(None, [*SMALL, f"logger.run_dir={run_dir}", "grpo.num_epochs=2", "policy.scheduler.name=cosine",
                             "policy.scheduler.warmup_steps=1", "policy.scheduler.min_lr_ratio=0.1",
                             "generation.top_p=0.9", "policy.max_total_sequence_length=6", "data_plane.enabled=true",
                             "data_plane.keep_partitions=true"])
    summary = train(cfg)
    url = summary["kept_store_url"]
    assert summary["status"] == "completed" and url and url.startswith("shm:///")
    folder = Path(url[len("shm://"):])
    try:
        assert json.loads((run_dir / "summary.json").read_text())["kept_store_url"] == url
        metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        # 32 rows / 16 per global batch = 2 optimizer steps per pass, 2 passes: 4 per step, 8 in the run
        assert [m["train/optimizer_steps"] for m in metrics] == [4, 4]
        lrs = [cfg.policy.learning_rate * WarmupSchedule("cosine", 1, 8, 0.1)(s) for s in range(8)]
        assert metrics[0]["train/lr"] == pytest.approx(sum(lrs[:4]) / 4)
        assert metrics[1]["train/lr"] == pytest.approx(sum(lrs[4:]) / 4)
        for m in metrics:
            # later passes see a moved policy against the step's fixed prev_logprobs: the clip acts
            assert m["train/clip_fraction"] > 0 and m["train/probs_ratio_mean"] != 1.0, m
            assert 0 < m["train/entropy"] <= math.log(53) + 1e-6  # at most ln(vocabulary size)
            assert m["train/logprob_mismatch"] < 1e-4  # top_p leaves the generation log-probs full-vocab
        store = open_store(url, create=False)
        try:
            assert sorted(store.list_partitions()) == ["step-000001", "step-000002"]
            t = store.get("step-000001", ["input_lengths", "truncated", "input_ids"], list(range(32)))
            masks = store.get("step-000001", ["token_mask", "sample_mask"], list(range(32)))
        finally:
            store.close()
        # train/global_valid_toks: the step's trained tokens, N_tok of each of its 4 optimizer steps added up
        # (2 epochs over every row), not their mean
        n_tok = sum(sum(tm) * sm for tm, sm in zip(masks.column("token_mask").to_pylist(),
                                                   masks.column("sample_mask").to_pylist()))
        assert metrics[0]["train/global_valid_toks"] == 2 * n_tok > 0
        lengths, truncated = t.column("input_lengths").to_pylist(), t.column("truncated").to_pylist()
        assert max(lengths) <= 6 and any(truncated)
        eos = 2
        for n, tr, ids in zip(lengths, truncated, t.column("input_ids").to_pylist()):
            assert tr == (ids[-1] != eos), "truncated means: the response did not end with eos"
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
