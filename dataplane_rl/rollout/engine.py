"""Generation engines behind one interface (rollout/generation.py). Hugging Face is the zero-install
default; `make_engine` picks the engine `generation.backend` names.
"""

from __future__ import annotations

import torch

from dataplane_rl.rollout.generation import Generation, GenerationEngine


class HFEngine:
    """Batched sampling with a Hugging Face causal LM and its KV cache.

    Sampling is Gumbel-max with per-row noise from the row's own generator; the log-prob of each sampled
    token comes from the same forward pass, at the temperature-scaled full distribution (what the trainer
    recomputes), not the top-k/top-p renormalised one. temperature=0 decodes greedily (validation).
    """

    def __init__(self, model, eos_token_id: int | None, pad_token_id: int) -> None:
        self.model = model.eval()
        self.eos = eos_token_id
        self.pad = pad_token_id
        self.device = next(model.parameters()).device

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    @torch.no_grad()
    def generate(self, prompts, seeds, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0):
        B = len(prompts)
        if B == 0:
            return []
        P = max(len(p) for p in prompts)
        ids = torch.full((B, P), self.pad, dtype=torch.long)  # [B, P] left-padded
        attn = torch.zeros((B, P), dtype=torch.long)  # [B, P]
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, P - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P]
        gens = [torch.Generator().manual_seed(s) for s in seeds]
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True)
        logits, past = out.logits[:, -1], out.past_key_values  # [B, V]
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        greedy = temperature == 0
        for _ in range(max_new_tokens):
            # greedy: argmax, log-probs of the untempered distribution (temperature 0 has none)
            logp = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1).cpu()  # [B, V]
            if greedy:
                nxt = logp.argmax(-1)  # [B]
            else:
                scores = logp.clone()
                if top_k and top_k < scores.shape[-1]:
                    kth = scores.topk(top_k, dim=-1).values[:, -1:]  # [B, 1]
                    scores[scores < kth] = float("-inf")
                if top_p < 1.0:
                    scores = nucleus(scores, top_p)
                V = scores.shape[-1]
                u = torch.stack([torch.rand(V, generator=g, dtype=torch.float64) for g in gens])  # [B, V]
                gumbel = -torch.log(-torch.log(u.clamp_min(1e-300)))
                nxt = (scores.double() + gumbel).argmax(-1)  # [B]
            for i in range(B):
                if not done[i]:
                    t = int(nxt[i])
                    tokens[i].append(t)
                    logps[i].append(float(logp[i, t]))
                    if t == self.eos:
                        done[i] = True
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], dim=1)  # [B, P+t]
            pos = pos[:, -1:] + 1  # [B, 1]
            out = self.model(input_ids=nxt[:, None].to(self.device), attention_mask=attn, position_ids=pos,
                             past_key_values=past, use_cache=True)
            logits, past = out.logits[:, -1], out.past_key_values
        return [Generation(tokens[i], logps[i], truncated=not (tokens[i] and tokens[i][-1] == self.eos))
                for i in range(B)]


def nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep, per row, the most likely tokens until their probability reaches top_p (at least one); the rest
    become -inf. Applied after top-k, on its renormalised distribution, as vLLM and HF's TopPLogitsWarper do.

    scores: [B, V] log-probs or logits.
    """
    probs, order = torch.softmax(scores, dim=-1).sort(dim=-1, descending=True)  # [B, V]
    before = probs.cumsum(-1) - probs  # [B, V] mass of the more likely tokens
    drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)  # [B, V] in vocab order
    return scores.masked_fill(drop, float("-inf"))


def make_engine(cfg, model_folder, tokenizer) -> GenerationEngine:
    """The engine `generation.backend` names, for the model in `model_folder`; the rest of the loop sees
    only the GenerationEngine interface. `cfg` is the whole run Config."""
    gen = cfg.generation
    if gen.backend == "vllm":
        from dataplane_rl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_folder, gen, tokenizer.eos_token_id, seed=cfg.grpo.seed)
    if gen.backend == "hf":
        from dataplane_rl.model.load import load_model, pick_device

        model = load_model(model_folder, pick_device(cfg.policy.device))
        return HFEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    from dataplane_rl.errors import ConfigError

    raise ConfigError(f"generation.backend={gen.backend!r} is not an engine; use hf or vllm")
