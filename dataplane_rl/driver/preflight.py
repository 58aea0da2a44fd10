"""The checks a run makes before Ray starts (one ConfigError naming the key), the run's store and its threads."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from dataplane_rl.config import Config
from dataplane_rl.model.load import cache_root, load_tokenizer, resolve_model
from dataplane_rl.store import MemoryStore, open_store
from dataplane_rl.run import private_ray
from dataplane_rl.rollout.multiturn import check_config as check_multi_turn
from dataplane_rl.tasks import load_modules, load_task
from dataplane_rl.tasks.prompts import PromptSampler
from dataplane_rl.tasks.multiturn import is_multi_turn


def open_run_store(cfg: Config):
    """The step store: the configured backend when the data plane is on, else the driver's own memory."""
    url = cfg.data_plane.url
    if url is None:
        return MemoryStore("driver")
    if url.startswith("mooncake://"):
        return open_store(url, config=cfg.data_plane.mooncake)
    if url.startswith("shm://"):  # the URL (store.url, which every actor opens) carries them on
        return open_store(url, arena_mb=cfg.data_plane.shm.arena_mb, prefault_mb=cfg.data_plane.shm.prefault_mb)
    return open_store(url)


def preflight(cfg: Config):
    """Every check that needs no Ray, made before Ray starts, so a mistake is one clear ConfigError and not
    an actor's traceback: task.module, the task and its file, the model folder, the engine. Returns (task, model
    folder, the PromptSampler that draws the steps' prompts within task.max_prompt_length)."""
    check_imports_return(cfg)  # before this process imports them: an import may end the process it runs in
    load_modules(cfg.task)  # first: a task.module that fails to import is the one error, not an unknown task.name
    check_folders(cfg)
    folder = resolve_model(cfg.policy.model, cfg.grpo.seed, cfg.policy.model_cache_dir)
    tokenizer = load_tokenizer(folder)
    task = load_task(cfg.task, tokenizer)
    if is_multi_turn(task):
        check_multi_turn(cfg, task)
    check_device(cfg)
    threads_given()
    private_ray.check_dashboard(cfg)
    check_prompt_lengths(cfg, task, tokenizer)
    sampler = PromptSampler(cfg, task, tokenizer, str(folder))
    validates = (cfg.grpo.val_period or cfg.grpo.val_at_start) and callable(getattr(task, "val_prompts", None))
    sampler.check_first(cfg.grpo.seed, cfg.grpo.num_prompts_per_step, cfg.grpo.max_val_samples if validates else 0)
    check_distillation(cfg, tokenizer)
    if cfg.generation.backend == "vllm":
        from dataplane_rl.rollout.vllm_engine import require_vllm

        require_vllm()
    announce_model(cfg, folder, tokenizer)  # last: a run refused before it prints one line, its error
    return task, str(folder), sampler


# run in a child: import the user's module, then say so; an exception is left to the import in the driver,
# which names its file and line (tasks/user_code.py)
_IMPORT_CHILD = """
import sys
from dataplane_rl.tasks.user_code import import_user_module
try:
    import_user_module(sys.argv[1], sys.argv[2])
except BaseException as e:
    print("dataplane-rl-import: raised", type(e).__name__, flush=True)
    sys.exit(0)
print("dataplane-rl-import: returned", flush=True)
"""


def check_imports_return(cfg: Config) -> None:
    """task.module and task.reward_function's module, each imported first in a child process: one that calls
    os._exit (or otherwise ends its process) at import made `train` exit 0 with no output and no run folder,
    a success that did nothing. A ConfigError naming the key if the child's import did not return."""
    import subprocess
    import sys

    from dataplane_rl.errors import ConfigError

    specs = [("task.module", cfg.task.module)]
    if cfg.task.reward_function:
        specs.append(("task.reward_function", cfg.task.reward_function.rpartition(":")[0]))
    for key, spec in specs:
        if not spec:
            continue
        try:
            p = subprocess.run([sys.executable, "-c", _IMPORT_CHILD, spec, key], capture_output=True, text=True,
                               stdin=subprocess.DEVNULL, timeout=IMPORT_CHECK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"{key}={spec}: importing it did not finish within {IMPORT_CHECK_TIMEOUT_S} s; an "
                              "import must not block (move slow work into the functions it defines)") from None
        said = next((line.split()[1:] for line in p.stdout.splitlines() if line.startswith("dataplane-rl-import:")), [])
        if said[:1] == ["returned"] or said[:1] == ["raised"] and said[1:] not in (["SystemExit"], ["KeyboardInterrupt"]):
            continue  # imported, or raised an error the import in this process names with its file and line
        how = f"raised {said[1]}" if said else (f"ended its process (exit code {p.returncode}: os._exit or a "
                                                 "signal?)" if p.returncode >= 0 else f"was killed by signal {-p.returncode}")
        raise ConfigError(f"{key}={spec}: importing it {how} instead of returning; a module must not end the "
                          "process that imports it (the driver, each rollout actor and train worker)")


IMPORT_CHECK_TIMEOUT_S = 120


def check_folders(cfg: Config) -> None:
    """Every folder the run writes, checked as logger.run_dir is (run/folder.py), before anything starts:
    checkpointing.checkpoint_dir=/proc/x once failed only at the first save, after a step had trained, and
    a bad policy.model_cache_dir or shm:// folder with a bare FileNotFoundError."""
    import os

    from dataplane_rl.checkpoint.manager import CheckpointManager
    from dataplane_rl.store.shm import owners

    if cfg.checkpointing.enabled:
        key = "checkpointing.checkpoint_dir" if cfg.checkpointing.checkpoint_dir else "checkpointing (RUN_DIR/checkpoints)"
        check_writable(key, CheckpointManager.for_config(cfg).root)
    cache = cache_root(cfg.policy.model_cache_dir)
    if cfg.policy.model == "tiny" and not (cache / f"tiny-qwen2-seed{cfg.grpo.seed}").is_dir():  # built there now
        check_writable("policy.model_cache_dir", cache)
    url = cfg.data_plane.url or ""
    if url.startswith("shm://"):
        path = url[len("shm://"):].partition("?")[0]
        # a named store's folder is made by the store; its parent must take it
        folder = Path(path).absolute().parent if path and not os.path.isdir(path) else Path(path or owners.auto_root())
        check_writable(f"data_plane.backend={url}", folder)


def check_writable(key: str, folder: Path) -> None:
    """A ConfigError naming `key` unless a file can be made in `folder` (made, with any parent, if missing). The
    file is removed, and so is every folder made for it: a refused run leaves nothing."""
    import os
    import tempfile

    from dataplane_rl.errors import ConfigError

    folder = Path(folder)
    made = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".dataplane-rl-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"{key}: cannot write to {folder} ({e.strerror or e}); choose a writable folder") from None
    finally:
        for p in made:  # deepest first; the run makes them again when it writes there
            with contextlib.suppress(OSError):
                p.rmdir()


def check_device(cfg: Config) -> None:
    """policy.device and policy.precision against this machine's torch, when the run is all on it (a
    joined cluster's workers may have GPUs the driver lacks). Else the train actors fail on start-up."""
    if cfg.cluster.address:
        return
    from dataplane_rl.errors import ConfigError
    from dataplane_rl.model.load import pick_device

    device = pick_device(cfg.policy.device)  # device=cuda without one: the ConfigError the actors would raise
    if cfg.policy.precision == "bfloat16" and device.type != "cuda":
        raise ConfigError(f"policy.precision=bfloat16 needs CUDA (an FSDP mixed-precision policy), and the run is on "
                          f"{device.type} (policy.device={cfg.policy.device}); use policy.precision=float32")


def announce_model(cfg: Config, folder: Path, tokenizer) -> None:
    """The start-up line naming the model (model/describe.py), and the loud warning a real model's lr may earn."""
    import sys

    from dataplane_rl.model.describe import lr_warning, model_line
    from dataplane_rl.model.load import eos_token_ids

    reference = cfg.loss_fn.reference_policy_kl_penalty > 0
    print(model_line(cfg.policy.model, folder, tokenizer, eos_token_ids(folder, tokenizer), reference),
          file=sys.stderr, flush=True)
    warning = lr_warning(cfg.policy.model, cfg.policy.learning_rate)
    if warning:
        print(warning, file=sys.stderr, flush=True)


def check_prompt_lengths(cfg: Config, task, tok) -> None:
    """Every prompt of a task's text pools (the built-in tasks') leaves room for a response within
    policy.max_total_sequence_length (else the rollout actor fails mid-run on the first long prompt it draws).
    Other tasks' prompts (a dataset's rows) are checked as they are drawn (tasks/prompts.py)."""
    max_total = cfg.policy.max_total_sequence_length
    pools = [getattr(task, name, None) for name in ("train_pool", "val_pool")]
    if max_total is None or not any(pools):
        return
    from dataplane_rl.rollout.worker import prompt_ids, response_rooms

    for prompt in (p for pool in pools if pool for p in pool if isinstance(p, str)):
        ids = prompt_ids(task, prompt, tok, cfg.task.apply_chat_template)[0]
        if len(ids) >= max_total:
            response_rooms([ids], cfg.generation.max_new_tokens, max_total)  # its ConfigError, naming the limit


def check_distillation(cfg: Config, student_tokenizer) -> None:
    """distillation.teacher before the run: a Hugging Face folder that loads, with the student's vocabulary (the
    columns hold token ids both models share), distillation.topk_logits_k within it, and the schema's shape of the
    teacher columns equal to that k."""
    d = cfg.distillation
    if not d.enabled:
        return
    from pathlib import Path

    from transformers import AutoConfig

    from dataplane_rl.errors import ConfigError, SchemaError
    from dataplane_rl.model.load import load_tokenizer

    folder = Path(d.teacher)
    if not (folder / "config.json").is_file() or not any(next(folder.glob(p), None) for p in ("*.safetensors", "*.bin")):
        raise ConfigError(f"distillation.teacher={d.teacher} is not a Hugging Face model folder (config.json and "
                          "weights); use a run's RUN_DIR/policy or the output of `dataplane-rl export RUN_DIR OUT`")
    try:
        vocab_size = int(AutoConfig.from_pretrained(folder).vocab_size)
        teacher_vocab = load_tokenizer(folder).get_vocab()
    except Exception as e:  # transformers raises many kinds: one error naming the key
        raise ConfigError(f"distillation.teacher={d.teacher} does not load: {type(e).__name__}: {e}") from e
    student_vocab = student_tokenizer.get_vocab()  # the student's tokenizer preflight already loaded
    if teacher_vocab != student_vocab:
        differ = sorted(set(teacher_vocab.items()) ^ set(student_vocab.items()))[:3]
        raise ConfigError(f"distillation.teacher={d.teacher} has another vocabulary than the student "
                          f"{cfg.policy.model} ({len(teacher_vocab)} vs {len(student_vocab)} tokens; differing "
                          f"(token, id) pairs include {differ}): the teacher's top-k ids must be the student's "
                          "token ids; distil from a teacher with the student's tokenizer")
    if d.topk_logits_k > vocab_size:
        raise ConfigError(f"distillation.topk_logits_k={d.topk_logits_k} is more than the teacher's vocabulary "
                          f"({vocab_size} tokens); set distillation.topk_logits_k <= {vocab_size}")
    schema = cfg.run_schema()
    for name in schema.field_set("DISTILL_FIELDS"):
        try:
            schema.require_shape(name, [d.topk_logits_k], f"distillation.topk_logits_k={d.topk_logits_k}")
        except SchemaError as e:
            raise ConfigError(str(e)) from None


# Below this many parameters a model's matmuls are too small for a second torch thread to pay for its barriers:
# the embedded defaults' model (0.3M) ran 30 steps in 27.9 s with one thread a process against 29.7 s with two,
# and beside 2 busy loops in 35.5 s against 67.9 s (2-core AMD VM, 2026-12-06); SmolLM2-135M, whose matmuls are
# 576 wide, took 70 s for 3 steps with two threads against 92 s with one.
SMALL_MODEL_PARAMETERS = 10_000_000


def threads_given(env: dict[str, str] | None = None) -> int | None:
    """The caller's OMP_NUM_THREADS (torch threads per process), or None where unset; a ConfigError for a value
    that is not a count."""
    from dataplane_rl.errors import ConfigError

    given = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    if not given:
        return None
    if not given.isdigit() or int(given) < 1:
        raise ConfigError(f"OMP_NUM_THREADS={given!r} is not a positive whole number; set it to the torch threads "
                          "each process of the run should use, or unset it to let the run choose")
    return int(given)


def torch_threads(cfg: Config, cpus: int, parameters: int, env: dict[str, str] | None = None) -> tuple[int, int]:
    """torch threads per rollout actor and per train rank. The caller's OMP_NUM_THREADS, where set, is every
    process's count (the convention torch and OpenMP share). A small model gets one thread a process. Otherwise
    sync phases take turns, so each group gets every core; async GRPO with an age above 0 generates while it
    trains, so the groups split the cores: on CPU, 4 busy torch threads on 2 cores made both phases 2-3x slower
    than alone (bench e2e --async)."""
    given = threads_given(env)
    if given:
        return given, given
    if parameters < SMALL_MODEL_PARAMETERS:
        return 1, 1
    N, D = cfg.generation.num_workers, cfg.policy.dp_size
    a = cfg.grpo.async_grpo
    if a.enabled and a.max_trajectory_age_steps > 0:
        cpus = max(1, cpus // 2)
    return max(1, cpus // N), max(1, cpus // D)
