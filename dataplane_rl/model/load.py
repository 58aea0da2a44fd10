"""The policy model: the tiny local default, a local Hugging Face folder or a GGUF file, its tokenizer, the device.

The tiny model is a ~0.3M-parameter Qwen2 with a character tokenizer, built from the seed (no download)
and saved as an ordinary Hugging Face folder, so every engine loads it like a real model. Its tokenizer reads
every character: one token per code point, `<unk>` (id 0, also the padding id) for one outside the vocabulary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from dataplane_rl.errors import ConfigError

# Characters of the tiny tokenizer: enough for the built-in tasks' prompts and answers.
_CHARS = list("0123456789abcdefghijklmnopqrstuvwxyz+-*/=:?.,!() \n")
# Id 0 is both the unknown character and the padding (padding is masked by length, never by id): a token of its
# own would change the model's shape, and with it the seed's weights and every figure measured on them.
_SPECIAL = ["<unk>", "<bos>", "<eos>"]
# Part of the cached folder's name: bump it when what build_tiny writes changes, so no older build is reused
# (version 1, "tiny-qwen2-seed{seed}", named id 0 <pad>, and transformers dropped its spaces; see read_tokenizer;
# version 2's tokenizer added no BOS of its own, which the prompt encoder then prepended to every tokenizer's text).
# The weights are the seed's in every version.
TINY_VERSION = 3
# The tiny model's chat template: every character in its vocabulary, so chat prompts render without a download. It
# opens with BOS, as Llama's templates do: a rendered chat prompt is tokenized without adding special tokens.
TINY_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                      "{% if add_generation_prompt %}assistant: {% endif %}")
TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("DATAPLANE_RL_CACHE", Path.home() / ".cache" / "dataplane-rl"))


def build_tiny(seed: int, cache_dir: str | None = None) -> Path:
    """Build (once) the tiny model and tokenizer for `seed`; return its folder."""
    folder = cache_root(cache_dir) / f"tiny-qwen2-v{TINY_VERSION}-seed{seed}"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hf_tok = tiny_tokenizer()
    vocab = hf_tok.get_vocab()
    cfg = Qwen2Config(vocab_size=len(vocab), tie_word_embeddings=True, bos_token_id=vocab["<bos>"],
                      eos_token_id=vocab["<eos>"], pad_token_id=vocab["<unk>"], **TINY)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    hf_tok.save_pretrained(tmp)
    (tmp / "dataplane_rl.json").write_text(json.dumps({"seed": seed, "tiny": TINY, "version": TINY_VERSION}))
    tmp.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(folder)  # atomic: concurrent builders race harmlessly
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def tiny_tokenizer():
    """The tiny model's character tokenizer: one token per Unicode code point (an emoji with a skin tone is two),
    `<unk>` for a character outside the vocabulary; decoding joins the tokens as they are."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(_SPECIAL + _CHARS)}, unk_token="<unk>"))
    # WordLevel alone would split on whitespace and drop it; "." would miss newlines (and fuse "\n\n" into one <unk>)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # without a decoder, tokenizers joins tokens with a space: "a b" for "ab"
    # the tokenizer itself adds BOS to a text (as Llama's and Gemma's do): `tokenizer(text)` is what the model means
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", _SPECIAL.index("<bos>"))])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                                     unk_token="<unk>", clean_up_tokenization_spaces=False)
    hf_tok.chat_template = TINY_CHAT_TEMPLATE
    return hf_tok


def resolve_model(name: str, seed: int, cache_dir: str | None = None) -> Path:
    """'tiny' -> the built tiny folder; a `.gguf` file -> its fp32 Hugging Face folder in the model cache (converted
    once); anything else must be a local Hugging Face folder."""
    if name == "tiny":
        return build_tiny(seed, cache_dir)
    p = Path(name).absolute()  # actors run in Ray's working directory: a relative folder would not be found there
    if p.suffix.lower() == ".gguf":
        from dataplane_rl.model.gguf import convert_gguf

        return convert_gguf(p, cache_root(cache_dir))
    if not (p / "config.json").is_file():
        raise ConfigError(f"policy.model '{name}' is neither 'tiny', a .gguf file nor a local Hugging Face folder with "
                          "config.json; nothing is downloaded, so save the model locally first")
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


def read_tokenizer(folder: Path):
    """The folder's tokenizer as saved. transformers 5 rebuilds the tokenizer of every qwen2 folder as Qwen2's
    byte-level BPE from the vocabulary alone (AutoTokenizer ignores tokenizer_config's class for model types it
    lists in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS): a character tokenizer loses its pre-tokenizer and its
    unknown token there, and every space, newline and unknown character vanishes. So a WordLevel tokenizer.json
    (the tiny model's, and its exports') is loaded as it is written."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return (PreTrainedTokenizerFast if _word_level(Path(folder)) else AutoTokenizer).from_pretrained(folder)


def _word_level(folder: Path) -> bool:
    f = folder / "tokenizer.json"
    # a real model's tokenizer.json is megabytes of BPE: not parsed just to learn that
    if not f.is_file() or f.stat().st_size > 1 << 20:
        return False
    try:
        return json.loads(f.read_text()).get("model", {}).get("type") == "WordLevel"
    except (ValueError, AttributeError):
        return False  # AutoTokenizer names what is wrong with the file


def eos_token_ids(folder: Path, tokenizer) -> list[int]:
    """The ids that end a response: the model's generation config's eos_token_id (an id or a list: chat models often
    stop at the end-of-turn token and at the end of text) and the tokenizer's EOS, in that order."""
    ids: list[int] = []
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(folder).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS alone
        eos = None
    for i in ([eos] if isinstance(eos, int) else list(eos or [])) + [tokenizer.eos_token_id]:
        if isinstance(i, int) and i not in ids:
            ids.append(i)
    return ids


def load_tokenizer(folder: Path):
    tok = read_tokenizer(folder)
    if tok.chat_template is None and (Path(folder) / "dataplane_rl.json").is_file():
        tok.chat_template = TINY_CHAT_TEMPLATE  # a tiny folder built before the template was
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
