"""The policy model: the tiny local default or a local Hugging Face folder, and its log-probs.

The tiny model is a ~0.3M-parameter Qwen2 with a character tokenizer, built from the seed (no download)
and saved as an ordinary Hugging Face folder, so every engine loads it like a real model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dataplane_rl.errors import ConfigError

# Characters of the tiny tokenizer: enough for the built-in tasks' prompts and answers.
_CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=:?.,!() \n")
_SPECIAL = ["<pad>", "<bos>", "<eos>"]
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("DATAPLANE_RL_CACHE", Path.home() / ".cache" / "dataplane-rl"))


def build_tiny(seed: int, cache_dir: str | None = None) -> Path:
    """Build (once) the tiny model and tokenizer for `seed`; return its folder."""
    folder = cache_root(cache_dir) / f"tiny-qwen2-seed{seed}"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {tok: i for i, tok in enumerate(_SPECIAL + _CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    # one token per character; WordLevel alone would split on whitespace only
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                     unk_token="<pad>", clean_up_tokenization_spaces=False)
    cfg = Qwen2Config(vocab_size=len(vocab), tie_word_embeddings=True, bos_token_id=vocab["<bos>"],
                      eos_token_id=vocab["<eos>"], pad_token_id=vocab["<pad>"], **TINY)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    (tmp / "dataplane_rl.json").write_text(json.dumps({"seed": seed, "tiny": TINY}))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(folder)  # atomic: concurrent builders race harmlessly
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve_model(name: str, seed: int, cache_dir: str | None = None) -> Path:
    """'tiny' -> the built tiny folder; anything else must be a local Hugging Face folder."""
    if name == "tiny":
        return build_tiny(seed, cache_dir)
    p = Path(name).absolute()  # actors run in Ray's working directory: a relative folder would not be found there
    if not (p / "config.json").is_file():
        raise ConfigError(f"policy.model '{name}' is neither 'tiny' nor a local Hugging Face folder with config.json; "
                          "nothing is downloaded, so save the model locally first")
    missing = [what for what, patterns in (("weights", ("*.safetensors", "*.bin")),
                                           ("tokenizer", ("tokenizer.json", "tokenizer_config.json")))
               if not any(next(p.glob(pat), None) for pat in patterns)]
    if missing:
        raise ConfigError(f"policy.model '{name}' has config.json but no {' and no '.join(missing)} files; save the "
                          "whole model with save_pretrained(folder) and its tokenizer's save_pretrained(folder)")
    return p


def pick_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("policy.device=cuda but torch sees no CUDA device; use policy.device=auto or cpu")
    return torch.device(device)


def load_model(folder: Path, device: torch.device):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one bar per actor per load is noise in the driver's console

    # fp32 everywhere on CPU: the log-prob parity checks compare engines at 1e-5
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to(device)


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False):
    """Log-prob of each token given the tokens before it, aligned with positions; position 0 is 0.

    input_ids, attention_mask: [B, T], right-padded. with_entropy: also return, detached, the entropy of
    the temperature-scaled distribution each token was drawn from, aligned the same way.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [B, T, V]
    logp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]
    picked = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # [B, T-1]
    out = torch.zeros_like(input_ids, dtype=picked.dtype)  # [B, T]
    out[:, 1:] = picked
    if not with_entropy:
        return out * attention_mask
    with torch.no_grad():
        ent = torch.zeros_like(out)  # [B, T]
        for i in range(len(logp)):  # a row at a time: the temporary is [T-1, V], not another [B, T-1, V]
            ent[i, 1:] = -(logp[i].exp() * logp[i]).sum(-1)  # [T-1]
    return out * attention_mask, ent * attention_mask


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

    CPU choice, measured on the ~24.5M bench model (notes/packing.md): `segments` (one causal SDPA per row)
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
                    with_entropy: bool = False):
    """Per-token log-probs (and detached entropies) of one packed sequence, aligned like `token_logprobs`.

    input_ids: [1, L], the rows one after another; cu_seqlens: [n+1] row boundaries. Positions restart at 0
    per row and attention stays inside each row, so every row's numbers equal its unpadded forward's. Entry
    cu_seqlens[i] (a row's first token) is 0: the logit before it belongs to the previous row.
    """
    L = input_ids.shape[1]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # [n]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)  # [L]
    position_ids = (torch.arange(L, device=input_ids.device) - starts)[None]  # [1, L]
    cu = cu_seqlens.to(torch.int32)
    longest = int(lengths.max())
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, cu_seq_lens_q=cu,
                   cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest).logits  # [1, L, V]
    logp = torch.log_softmax(logits[0, :-1].float() / temperature, dim=-1)  # [L-1, V]
    picked = logp.gather(-1, input_ids[0, 1:, None]).squeeze(-1)  # [L-1]
    first = position_ids[0] == 0  # [L]
    out = torch.where(first, 0.0, torch.cat([picked.new_zeros(1), picked]))  # [L]
    if not with_entropy:
        return out
    with torch.no_grad():
        ent = torch.zeros_like(out)  # [L]
        for s in range(0, L - 1, 1024):  # chunks: the temporary is [1024, V], not another [L, V]
            chunk = logp[s:s + 1024]  # [c, V]
            ent[s + 1:s + 1 + len(chunk)] = -(chunk.exp() * chunk).sum(-1)  # [c]
        ent = torch.where(first, 0.0, ent)  # [L]
    return out, ent


def microbatch_logprobs(model, mb: dict, temperature: float = 1.0, with_entropy: bool = False):
    """`token_logprobs` of a microbatch from train/batch.py `plan_microbatches`: [b, t] in every mode; a
    packed microbatch runs one packed forward and is unpacked to its rows."""
    from dataplane_rl.train.batch import unpack

    if "packed_input_ids" not in mb:
        return token_logprobs(model, mb["input_ids"], mb["attention_mask"], temperature, with_entropy)
    got = packed_logprobs(model, mb["packed_input_ids"], mb["cu_seqlens"], temperature, with_entropy)
    if not with_entropy:
        return unpack(got, mb)
    return unpack(got[0], mb), unpack(got[1], mb)
