"""The policy's per-token log-probs: padded rows, packed rows (attention kept within each row) and microbatches."""

from __future__ import annotations

import functools
import inspect

import torch


def unpack(flat: torch.Tensor, mb: dict[str, torch.Tensor]) -> torch.Tensor:
    """[L, *inner] values of a packed microbatch -> [b, t, *inner] right-padded like its rows' tensors (zeros in
    padding)."""
    valid = mb["attention_mask"].bool()  # [b, t]
    out = flat.new_zeros((*valid.shape, *flat.shape[1:]))  # [b, t, *inner]
    out[valid] = flat  # row-major, the packing order
    return out


def _gather_at(logp: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs [..., V] at the given ids [..., k] -> [..., k] (the student's log-probs at the teacher's top-k)."""
    return logp.gather(-1, ids.long())


def _topk(logp: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probs [..., k] (float32) and their ids [..., k] (int32), most likely first."""
    vals, ids = logp.topk(k, dim=-1)
    return vals.float(), ids.to(torch.int32)


def _keeps_logits(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` (Hugging Face causal LMs do: the output layer then runs
    at those positions only)."""
    return _forward_takes_logits_to_keep(type(model))


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:  # once a class: every microbatch's forward asks
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def _needed_logits(need_next: torch.Tensor, width: int) -> torch.Tensor | None:
    """The logit positions [K] whose next token's log-prob is needed (need_next [..., width-1] bool: position p
    needed when the token at p+1 is), or None where that is every position (nothing to save). Never empty: a
    microbatch without a needed token still runs the output layer once, so its backward touches every parameter."""
    idx = need_next.reshape(-1, width - 1).any(0).nonzero().squeeze(-1)  # [K]
    if len(idx) == width - 1:
        return None
    return idx if len(idx) else idx.new_zeros(1)


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, at_ids: torch.Tensor | None = None, topk: int = 0,
                   need: torch.Tensor | None = None):
    """Log-prob of each token given the tokens before it, aligned with positions; position 0 is 0.

    input_ids, attention_mask: [B, T], right-padded. with_entropy: also return, detached, the entropy of
    the temperature-scaled distribution each token was drawn from, aligned the same way. at_ids [B, T, k]:
    also return the log-probs of that distribution at these ids, [B, T, k]. topk > 0: return instead its
    `topk` largest log-probs and their ids, each [B, T, k] (the teacher's columns). Zeros at position 0 and
    in padding.

    need [B, T] bool (the policy's tokens, token_mask): only these positions' log-probs (and entropies) are
    wanted; every other position is 0, and the output layer runs only at the positions some row needs
    (`logits_to_keep`): for a 49K-token vocabulary most of a forward's cost on short responses after long
    prompts. Not with at_ids or topk, which read every position.
    """
    B, T = input_ids.shape
    keep = attention_mask.bool()  # [B, T]
    idx = None
    if need is not None and at_ids is None and not topk and T > 1:
        keep = need.bool() & keep
        if _keeps_logits(model):
            idx = _needed_logits(keep[:, 1:], T)
    if idx is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]  # [B, T-1, V]
        targets = input_ids[:, 1:]  # [B, T-1]
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=idx).logits  # [B, K, V]
        targets = input_ids[:, idx + 1]  # [B, K]
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [B, T-1 or K, V]

    def aligned(t: torch.Tensor) -> torch.Tensor:  # [B, T-1 or K, *] -> [B, T, *], zero where not kept
        if idx is None:
            out = torch.cat([t.new_zeros(t[:, :1].shape), t], dim=1)
        else:
            out = t.new_zeros((B, T, *t.shape[2:])).index_copy(1, idx + 1, t)
        return torch.where(keep.view(*keep.shape, *[1] * (t.dim() - 2)), out, out.new_zeros(()))
    if topk:
        return tuple(aligned(t) for t in _topk(logp, topk))
    picked = logp.gather(-1, targets[..., None]).squeeze(-1)  # [B, T-1 or K]
    out = [aligned(picked)]  # [B, T]
    if with_entropy:
        with torch.no_grad():
            ent = torch.zeros_like(picked)  # [B, T-1 or K]
            for i in range(len(logp)):  # a row at a time: the temporary is [T-1, V], not another [B, T-1, V]
                ent[i] = -(logp[i].exp() * logp[i]).sum(-1)  # [T-1 or K]
        out.append(aligned(ent))
    if at_ids is not None:
        out.append(aligned(_gather_at(logp, at_ids[:, 1:])))  # [B, T, k]
    return out[0] if len(out) == 1 else tuple(out)


# -- packed sequences ------------------------------------------------------------------------------------
def _segment_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Causal attention within each packed row: one SDPA call per row (cu_seq_lens_q), so the cost is
    sum(n_i^2), not the L^2 of a block-diagonal mask over the whole pack. Unpacked calls fall back to sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    # query [1, H, L, d]; key, value [1, Hkv, L, d]
    gqa = query.shape[1] != key.shape[1]
    bounds = cu.tolist()
    outs = [torch.nn.functional.scaled_dot_product_attention(
        query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling, enable_gqa=gqa)
        for s, e in zip(bounds[:-1], bounds[1:])]  # each [1, H, n_i, d]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None  # [1, L, H, d]


def _segment_mask(*args, **kwargs):
    # a packed forward passes no 2-D mask: the rows are cut by cu_seq_lens, so no [L, L] mask is built
    from transformers.masking_utils import sdpa_mask

    return None if kwargs.get("attention_mask") is None else sdpa_mask(*args, **kwargs)


def packed_attention(model, device: torch.device, choice: str = "auto") -> str:
    """Set the attention a packed forward uses and return its name. auto: flash_attention_2 on CUDA when the
    flash-attn wheel is installed (transformers' variable-length path, cut by cu_seq_lens), else `segments`.

    CPU choice, measured on the ~24.5M bench model (docs/benchmarks.md, `bench train`): `segments` (one causal SDPA per row)
    beats `sdpa` (transformers builds a block-diagonal [L, L] mask from the restarting position ids and
    attends over the whole pack) because its attention costs sum(n_i^2) instead of L^2; both are exact.
    """
    from transformers import AttentionInterface, AttentionMaskInterface

    if choice == "auto":
        choice = "segments"
        if device.type == "cuda":
            import importlib.util

            if importlib.util.find_spec("flash_attn") is not None:
                choice = "flash_attention_2"
    if choice == "segments":
        AttentionInterface.register("segments", _segment_attention)
        AttentionMaskInterface.register("segments", _segment_mask)
    model.set_attn_implementation(choice)
    return choice


def packed_logprobs(model, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, temperature: float = 1.0,
                    with_entropy: bool = False, at_ids: torch.Tensor | None = None, topk: int = 0,
                    need: torch.Tensor | None = None):
    """Per-token log-probs (and detached entropies) of one packed sequence, aligned like `token_logprobs`.

    input_ids: [1, L], the rows one after another; cu_seqlens: [n+1] row boundaries. Positions restart at 0
    per row and attention stays inside each row, so every row's numbers equal its unpadded forward's. Entry
    cu_seqlens[i] (a row's first token) is 0: the logit before it belongs to the previous row. at_ids [L, k],
    topk and need ([L] bool) as in `token_logprobs`, packed.
    """
    L = input_ids.shape[1]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [n]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)  # [L]
    position_ids = (torch.arange(L, device=input_ids.device) - starts)[None]  # [1, L]
    cu = cu_seqlens.to(torch.int32)
    longest = int(lengths.max())
    first = position_ids[0] == 0  # [L]
    keep = ~first  # [L]
    idx = None
    if need is not None and at_ids is None and not topk and L > 1:
        keep = need.bool() & keep
        if _keeps_logits(model):
            idx = _needed_logits(keep[1:], L)
    extra = {} if idx is None else {"logits_to_keep": idx}
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest, **extra).logits[0]  # [L or K, V]
    logits, targets = (logits[:-1], input_ids[0, 1:]) if idx is None else (logits, input_ids[0, idx + 1])
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [L-1 or K, V]

    def aligned(t: torch.Tensor) -> torch.Tensor:  # [L-1 or K, *] -> [L, *], zero where not kept
        if idx is None:
            out = torch.cat([t.new_zeros(t[:1].shape), t])
        else:
            out = t.new_zeros((L, *t.shape[1:])).index_copy(0, idx + 1, t)
        return torch.where(keep.view(-1, *[1] * (t.dim() - 1)), out, out.new_zeros(()))
    if topk:
        return tuple(aligned(t) for t in _topk(logp, topk))
    picked = logp.gather(-1, targets[:, None]).squeeze(-1)  # [L-1 or K]
    out = [aligned(picked)]  # [L]
    if with_entropy:
        with torch.no_grad():
            ent = torch.zeros_like(picked)  # [L-1 or K]
            for s in range(0, len(logp), 1024):  # chunks: the temporary is [1024, V], not another [L, V]
                chunk = logp[s:s + 1024]  # [c, V]
                ent[s:s + len(chunk)] = -(chunk.exp() * chunk).sum(-1)  # [c]
        out.append(aligned(ent))
    if at_ids is not None:
        out.append(aligned(_gather_at(logp, at_ids[1:])))  # [L, k]
    return out[0] if len(out) == 1 else tuple(out)


def microbatch_logprobs(model, mb: dict, temperature: float = 1.0, with_entropy: bool = False,
                        at_ids: torch.Tensor | None = None, topk: int = 0):
    """`token_logprobs` of a microbatch from train/batch.py `plan_microbatches`: [b, t] (and [b, t, k]) in every
    mode; a packed microbatch runs one packed forward and is unpacked to its rows. Where the microbatch has a
    token_mask, only the policy's tokens get log-probs (`need`): the loss, the KL and the stored prev_logprobs and
    reference_policy_logprobs read no other."""
    need = mb.get("token_mask")
    if "packed_input_ids" not in mb:
        return token_logprobs(model, mb["input_ids"], mb["attention_mask"], temperature, with_entropy, at_ids, topk,
                              need=need)
    valid = mb["attention_mask"].bool()  # [b, t]
    packed_ids = None if at_ids is None else at_ids[valid]  # [L, k]
    got = packed_logprobs(model, mb["packed_input_ids"], mb["cu_seqlens"], temperature, with_entropy, packed_ids, topk,
                          need=None if need is None else need[valid])
    return unpack(got, mb) if torch.is_tensor(got) else tuple(unpack(t, mb) for t in got)


# torch's dropout modules: in train mode each zeroes activations at random with probability p
DROPOUTS = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
            torch.nn.FeatureAlphaDropout)


def dropout_modules(model) -> list[str]:
    """Names of the modules that drop activations in train mode: a torch dropout module with p > 0, or an attention
    whose `attention_dropout` rate is above 0 (Hugging Face's Llama and Qwen2 attentions apply it as a function, with
    no module). A train forward of such a model gives other log-probs than an eval forward of the same weights."""
    found = []
    for name, m in model.named_modules():
        rate = getattr(m, "attention_dropout", 0.0)
        if (isinstance(m, DROPOUTS) and m.p > 0) or (isinstance(rate, (int, float)) and rate > 0):
            found.append(name)
    return found
