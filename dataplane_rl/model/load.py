"""The policy model: the tiny local default or a local Hugging Face folder, its tokenizer, the device.

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
# The tiny model's chat template: every character in its vocabulary, so chat prompts render without a download.
TINY_CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")
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
    hf_tok.chat_template = TINY_CHAT_TEMPLATE
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
    if tok.chat_template is None and (Path(folder) / "dataplane_rl.json").is_file():
        tok.chat_template = TINY_CHAT_TEMPLATE  # a tiny folder built before the template was
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
