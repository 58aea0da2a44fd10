"""Generation engines behind one interface (rollout/generation.py). Hugging Face is the zero-install
default; `make_engine` picks the engine `generation.backend` names.
"""

from __future__ import annotations

import torch

from dataplane_rl.model.shared_weights import SharedWeights, attach
from dataplane_rl.rollout.generation import Generation, GenerationEngine
from dataplane_rl.rollout.refit_slot import RefitSlot


class HFEngine:
    """Batched sampling with a Hugging Face causal LM and its KV cache.

    Sampling is Gumbel-max with per-row noise from the row's own generator; the log-prob of each sampled
    token comes from the same forward pass, at the temperature-scaled full distribution (what the trainer
    recomputes), not the top-k/top-p renormalised one. temperature=0 decodes greedily (validation).

    In-flight weight updates (grpo.async_grpo.in_flight_weight_updates): `slot.offer` hands it a refit from another
    thread; during a generation the refit waits in the slot and the decode loop loads it before its next forward,
    so the tokens after it are sampled from the new weights. Each token records the version whose forward gave
    its logits. recompute_kv_cache: that forward runs over prompt + tokens so far (the KV cache rebuilt under
    the new weights, so every log-prob is exactly its version's); else it feeds only the last token and keeps
    the old weights' keys and values (cheaper, and no token's log-prob is exactly any one version's).
    """

    def __init__(self, model, eos_token_ids: list[int], pad_token_id: int, recompute_kv_cache: bool = False) -> None:
        self.model = model.eval()
        self.eos = tuple(eos_token_ids)  # any of them ends a response (model/load.py eos_token_ids)
        self.pad = pad_token_id
        self.device = next(model.parameters()).device
        self.recompute_kv_cache = recompute_kv_cache
        self.slot = RefitSlot(self.load_weights)  # in-flight refits (rollout/refit_slot.py)
        self.live: str | None = None  # the live shared file the parameters view (model/shared_weights.py)

    def load_weights(self, weights: dict[str, torch.Tensor] | SharedWeights) -> None:
        """A state dict (copied into the parameters), or a version in shared memory on this machine: there a
        parameter of the file's dtype on the CPU becomes a view of the file (model/shared_weights.py), so the
        node's actors hold one copy between them and the refit copies nothing; any other is copied from it. A live
        version (the trainer's own parameters) is attached once: its next versions change it in place."""
        if not isinstance(weights, SharedWeights):
            self.model.load_state_dict(weights)
            self.live = None
            return
        if weights.live and self.live == weights.path:
            return  # the parameters are views of the trainer's own, which this version changed in place
        views = attach(weights)
        missing = set(self.model.state_dict()) - set(views)
        if missing:
            raise RuntimeError(f"shared weights of version {weights.version} lack {sorted(missing)[:3]}")
        copied = False
        for name, t in [*self.model.named_parameters(remove_duplicate=False),
                        *self.model.named_buffers(remove_duplicate=False)]:
            if name not in views:
                continue  # a non-persistent buffer (rotary frequencies): not in a state dict
            view = views[name]
            if t.shape != view.shape:
                raise RuntimeError(f"shared weights of version {weights.version}: {name} is {tuple(view.shape)}, "
                                   f"the model's {tuple(t.shape)}")
            if t.device.type == "cpu" and t.dtype == view.dtype:
                t.data = view
            else:
                t.data.copy_(view)
                copied = True
        # every parameter a view: the next versions of a live file are already here (a copy would not follow them)
        self.live = weights.path if weights.live and not copied else None

    def generate(self, prompts, seeds, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0):
        with self.slot.generating():
            return self._generate(prompts, seeds, max_new_tokens, temperature, top_k, top_p)

    @torch.no_grad()
    def _generate(self, prompts, seeds, max_new_tokens, temperature, top_k, top_p):
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
        version = self.slot.version  # of the weights that computed `logits`
        seq = ids  # [B, P+t] every token fed so far: what a KV-cache recompute runs over
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        vers: list[list[int]] = [[] for _ in range(B)]
        done = torch.zeros(B, dtype=torch.bool)
        greedy = temperature == 0
        for step in range(max_new_tokens):
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
                    vers[i].append(version)
                    if t in self.eos:
                        done[i] = True
            if bool(done.all()):
                break
            attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=self.device)], dim=1)  # [B, P+t]
            if self.recompute_kv_cache:
                seq = torch.cat([seq, nxt[:, None].to(self.device)], dim=1)  # [B, P+t]
            # the last step's forward feeds no sampled token: a refit then lands after the generation
            if step < max_new_tokens - 1 and self.slot.land() and self.recompute_kv_cache:
                pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [B, P+t] the positions the cache was built with
                out = self.model(input_ids=seq, attention_mask=attn, position_ids=pos, use_cache=True)
                pos = pos[:, -1:]  # [B, 1]
            else:
                pos = pos[:, -1:] + 1  # [B, 1]
                out = self.model(input_ids=nxt[:, None].to(self.device), attention_mask=attn, position_ids=pos,
                                 past_key_values=past, use_cache=True)
            logits, past = out.logits[:, -1], out.past_key_values
            version = self.slot.version
        return [Generation.ended(tokens[i], logps[i], self.eos, vers[i]) for i in range(B)]


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
    from dataplane_rl.model.load import eos_token_ids

    gen = cfg.generation
    if gen.backend == "vllm":
        from dataplane_rl.rollout.vllm_engine import VLLMEngine

        a = cfg.grpo.async_grpo
        return VLLMEngine(model_folder, gen, eos_token_ids(model_folder, tokenizer), seed=cfg.grpo.seed,
                          in_flight=a.in_flight_weight_updates,
                          recompute_kv_cache=a.recompute_kv_cache_after_weight_updates)
    if gen.backend == "hf":
        from dataplane_rl.model.load import load_model, pick_device

        model = load_model(model_folder, pick_device(cfg.policy.device))
        return HFEngine(model, eos_token_ids(model_folder, tokenizer), tokenizer.pad_token_id,
                        recompute_kv_cache=cfg.grpo.async_grpo.recompute_kv_cache_after_weight_updates)
    from dataplane_rl.errors import ConfigError

    raise ConfigError(f"generation.backend={gen.backend!r} is not an engine; use hf or vllm")
