"""FSDP2 for the train workers: shard each decoder block, then the root, over one data-parallel mesh.

torch's `fully_shard` (not a hand-written gradient all-reduce): parameters, gradients and optimizer
state live as DTensor shards, and the full state dict comes from `torch.distributed.checkpoint.state_dict`.
One float32 rank keeps the plain module (`shard`).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from dataplane_rl.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def decoder_blocks(model) -> list[torch.nn.Module]:
    """The repeated blocks of a Hugging Face model: the classes it names in `_no_split_modules`."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise ConfigError(f"{type(model).__name__} names no decoder block class (_no_split_modules); "
                          "FSDP2 shards per block, so use a Hugging Face causal LM that declares them")
    return blocks


def shard(model, mesh, device: torch.device, precision: str = "float32", activation_checkpointing: bool = False):
    """fully_shard each decoder block, then the root; returns the same (now FSDP) module. On a one-rank mesh
    in float32 the module stays as it is: FSDP2 there has nothing to shard, average or cast, and would only copy
    (each forward all-gathers every block into a second buffer, each backward reduce-scatters every gradient
    into another). Checkpoints do not care: DCP saves the plain tensors whole and reshards either way on load."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "bfloat16" and device.type != "cuda":
        # gloo reduces no bf16 and CPU bf16 matmuls are slower than fp32: refuse instead of running slowly
        raise ConfigError("policy.precision=bfloat16 needs CUDA (an FSDP mixed-precision policy); on CPU use "
                          "policy.precision=float32")
    if activation_checkpointing:
        # HF's own hook: non-reentrant checkpointing re-runs each block's forward (and its FSDP all-gather)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mesh.size() == 1 and DTYPES[precision] == torch.float32:
        return model
    # bf16 compute, fp32 master weights and gradient reduction: the usual FSDP2 mixed-precision recipe
    mp = MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole model on rank 0's CPU (other ranks get {}); collective: every rank must call it. Each tensor owns
    its bytes: one that views a larger storage (a live refit's parameters all view one mapping of the whole model,
    model/shared_weights.py) is copied, since a pickle of a view carries its whole storage (Ray's object store
    would get the model once per tensor)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() if v.untyped_storage().nbytes() != v.nbytes else v for k, v in state.items()}


def to_float(t) -> float:
    """A scalar that may be a DTensor (e.g. the grad norm over sharded gradients)."""
    return float(t.full_tensor() if isinstance(t, DTensor) else t)
