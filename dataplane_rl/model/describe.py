"""The start-up line that names the policy model, and the learning-rate check that goes with it.

Everything here reads the model folder's files (config.json, the safetensors headers, the tokenizer), never the
weights, so it costs milliseconds before Ray starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from dataplane_rl.units import human_bytes

# Above this a real (pre-trained) model's learning rate is a mistake more often than a choice: NeMo-RL's and verl's
# GRPO recipes train models of this size at ~1e-6, and 1e-3 (the tiny model's) collapsed a 135M model's entropy
# from 4.24 to 0.92 in one step.
REAL_MODEL_LR_WARN = 1e-4


def parameter_count(folder: Path) -> int:
    """Parameters in the folder's safetensors files, from their headers (a tied embedding is stored once)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                shape = st.get_slice(k).get_shape()
                size = 1
                for d in shape:
                    size *= d
                n += size
    return n


def bos_added(tokenizer) -> bool:
    """Whether `tokenizer(text)` puts BOS in front of a text (the tokenizer's own rule, not ours)."""
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def memory_estimate(params: int, reference: bool) -> dict[str, int]:
    """Bytes a process holds for the model, fp32, before activations and KV cache: a train rank holds weights,
    gradients and AdamW's two moments (4 copies) plus the reference model when the KL term needs one; a rollout
    actor one copy of the weights."""
    copy = 4 * params
    return {"train rank": copy * (4 + int(reference)), "rollout actor": copy}


def model_line(name: str, folder: Path, tokenizer, eos_ids: list[int], reference: bool) -> str:
    """One line: the model, its parameters and vocabulary, BOS/EOS/pad ids, chat template, BOS added, memory."""
    params = parameter_count(folder)
    cfg = json.loads((Path(folder) / "config.json").read_text())
    mem = ", ".join(f"{who} ~{human_bytes(b)}" for who, b in memory_estimate(params, reference).items())
    return (f"model {name} ({cfg.get('model_type', '?')}): {params / 1e6:.1f}M parameters, vocabulary {len(tokenizer)}, "
            f"bos {tokenizer.bos_token_id} eos {eos_ids} pad {tokenizer.pad_token_id}, chat template "
            f"{'yes' if getattr(tokenizer, 'chat_template', None) else 'no'}, BOS added to text "
            f"{'yes' if bos_added(tokenizer) else 'no'}; fp32 memory {mem} (plus activations and KV cache)")


def lr_warning(model: str, lr: float) -> str | None:
    """A loud line when a real model gets a learning rate that suits only the tiny one."""
    if model == "tiny" or lr < REAL_MODEL_LR_WARN:
        return None
    return (f"WARNING: policy.learning_rate={lr:g} for a pre-trained model ({model}) is >= {REAL_MODEL_LR_WARN:g}: "
            "GRPO at such rates collapses a real model within steps (responses of one repeated token); real models "
            "train at ~1e-6 (the default for any policy.model but tiny)")
