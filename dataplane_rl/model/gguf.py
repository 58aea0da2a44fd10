"""A GGUF file as a policy model: dequantized to fp32 once into an ordinary Hugging Face folder in the model cache.

transformers reads GGUF itself (`gguf_file=`, through the `gguf` package): the weights dequantized to fp32, the
config, the tokenizer with its chat template. Converting once and keeping the folder means every process of a run
(and every later run) loads plain safetensors in a second instead of dequantizing the file again (~20 s for a 135M
model), and engines that do not read GGUF (vLLM on CPU) load it too. The folder's name carries the file's content
hash, so a file rewritten in place is converted again, never confused with the old one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dataplane_rl.errors import ConfigError

# Part of the cached folder's name: bump it when what convert_gguf writes changes.
GGUF_VERSION = 1
_HASH_BLOCK = 1 << 24


def file_digest(path: Path) -> str:
    """xxh3-128 of the file's bytes (~10 GB/s here: a 100 MB model in ~10 ms)."""
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while block := f.read(_HASH_BLOCK):
            h.update(block)
    return h.hexdigest()


def require_gguf() -> None:
    """transformers reads GGUF through the `gguf` package and refuses to without accelerate: an actionable error
    naming the extra when either is missing."""
    import importlib.util

    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"policy.model is a .gguf file, which needs {' and '.join(missing)}: "
                          "pip install 'dataplane-rl[gguf]' (or pip install -e '.[gguf]' in a checkout)")


def convert_gguf(path: Path, cache: Path) -> Path:
    """The cached fp32 Hugging Face folder of GGUF file `path`, converting it first if there is none."""
    if not path.is_file():
        raise ConfigError(f"policy.model '{path}' names a .gguf file that does not exist; give the path of a local "
                          "GGUF file (nothing is downloaded)")
    digest = file_digest(path)
    folder = cache / f"gguf-v{GGUF_VERSION}-{path.stem}-{digest[:16]}"
    if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
        return folder
    require_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except (ValueError, OSError, KeyError, RuntimeError) as e:
        raise ConfigError(f"policy.model '{path}': transformers could not read this GGUF file "
                          f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); its architecture or "
                          "quantization may be one transformers does not dequantize") from None
    # The loaded weights are plain fp32 tensors, but the model still carries the GGUF quantization config and
    # quantizer, and save_pretrained refuses a quantized model: drop both, the folder is an unquantized model.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.is_quantized = False
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "dataplane_rl.json").write_text(json.dumps({"gguf": str(path), "xxh3_128": digest,
                                                           "version": GGUF_VERSION}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written folder is never left for a later run to find
        raise
    try:
        tmp.rename(folder)  # atomic: concurrent converters race harmlessly
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
