"""HFEngine greedy decoding (temperature 0, the validation default) on the tiny model."""

from __future__ import annotations

import torch

from dataplane_rl.rollout.engine import HFEngine
from dataplane_rl.model.load import load_model, load_tokenizer, resolve_model


def test_greedy_is_the_argmax_whatever_the_seed(tmp_path):
    folder = resolve_model("tiny", 0, str(tmp_path))
    tok = load_tokenizer(folder)
    model = load_model(folder, torch.device("cpu"))
    engine = HFEngine(model, [tok.eos_token_id], tok.pad_token_id)
    prompts = [tok("407", add_special_tokens=False).input_ids, tok("12", add_special_tokens=False).input_ids]
    a = engine.generate(prompts, [1, 2], 6, temperature=0.0)
    b = engine.generate(prompts, [3, 4], 6, temperature=0.0, top_k=3)
    assert [g.tokens for g in a] == [g.tokens for g in b]
    for p, g in zip(prompts, a):  # each token is the argmax of the untempered distribution, and its log-prob
        ids = list(p)
        for t, lp in zip(g.tokens, g.logprobs):
            with torch.no_grad():
                logp = model(input_ids=torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            assert t == int(logp.argmax()) and abs(lp - float(logp[t])) < 1e-4
            ids.append(t)
    sampled = [engine.generate(prompts, [s, s + 1], 6, temperature=1.0) for s in (1, 2)]
    assert [g.tokens for g in sampled[0]] != [g.tokens for g in sampled[1]], "sampling must depend on the seed"
