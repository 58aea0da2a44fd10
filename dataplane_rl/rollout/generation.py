"""What every generation engine shares: the per-sample seed, one sampled response, and the interface.

Its own module so the engines (engine.py's HFEngine, vllm_engine.py's VLLMEngine) import it and not each other.
Every sample draws its randomness from its own seed, derived from (run seed, step, round, prompt,
sample), so a rollout does not depend on how samples are batched or spread over actors.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch


def sample_seed(seed: int, step: int, round_: int, prompt: int, sample: int) -> int:
    """A stable 63-bit seed per sample (Python's hash() is salted per process, so use blake2b)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{round_}/{prompt}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


@dataclass
class Generation:
    """One sampled response: its token ids, their log-probs from the sampling pass, and truncation; with in-flight
    weight updates (rollout/engine.py) also the version of the weights behind each token."""

    tokens: list[int]
    logprobs: list[float]
    truncated: bool
    versions: list[int] | None = None  # per token, the weight version that sampled it; None: the job's version

    @classmethod
    def ended(cls, tokens: list[int], logprobs: list[float], eos: tuple[int, ...],
              versions: list[int] | None = None) -> "Generation":
        """A response the engine stopped: truncated unless its last token is one of the `eos` ids (else the length
        limit cut it)."""
        return cls(tokens, logprobs, truncated=not (tokens and tokens[-1] in eos), versions=versions)


class GenerationEngine(Protocol):
    def generate(self, prompts: list[list[int]], seeds: list[int], max_new_tokens: int, temperature: float,
                 top_k: int, top_p: float = 1.0) -> list[Generation]:
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        ...
