"""The prompts a step sends: the task's draw, checked, each within task.max_prompt_length.

The driver draws a step's prompt keys (row ids of a dataset, or prompt texts) from the task and checks them before
any actor sees them: a task's prompts() that raises or returns the wrong thing is one error naming the task and the
method, and a prompt longer than task.max_prompt_length is refused by row (task.truncation=error), replaced by a
seeded draw and counted (task.filter_overlong_prompts), or let through for the rollout actor to cut
(task.truncation=left|right: `truncate`). A replacement is a pure function of (seed, step, round, position), so a
resumed run draws the same prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

from dataplane_rl.errors import ConfigError
from dataplane_rl.tasks import prompt_text, task_label
from dataplane_rl.tasks.user_code import where_raised

REPLACEMENT_ROUND = 1 << 20  # task.prompts(..., round_) from here on: the draws that replace filtered prompts
MAX_REPLACEMENT_TRIES = 1000


def prompt_limit(cfg, model_folder: str | None) -> int | None:
    """task.max_prompt_length, else the most prompt tokens the run can take: what the model's positions (config.json
    max_position_embeddings) leave after generation.max_new_tokens, and less than policy.max_total_sequence_length
    (a response is cut to fit it, but needs one token); None for a model that states no positions and no total."""
    if cfg.task.max_prompt_length is not None:
        return cfg.task.max_prompt_length
    limits = []
    max_total = cfg.policy.max_total_sequence_length
    if max_total is not None:
        limits.append(max_total - 1)
    try:
        positions = json.loads((Path(model_folder) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, TypeError, ValueError):
        positions = None
    if isinstance(positions, int):
        if positions - cfg.generation.max_new_tokens < 1:
            raise ConfigError(f"generation.max_new_tokens={cfg.generation.max_new_tokens} leaves no room for a prompt "
                              f"in policy.model's {positions} positions (max_position_embeddings); lower it")
        limits.append(positions - cfg.generation.max_new_tokens)
    return min(limits) if limits else None


def encode_prompt(tokenizer, prompt: str, chat: bool = False) -> list[int]:
    """A prompt's token ids as the tokenizer means them: a text is `tokenizer(text)`, with BOS only where the
    tokenizer itself adds one; a chat prompt rendered by the model's template is tokenized without adding special
    tokens (a template that wants BOS writes it, as apply_chat_template(tokenize=True) does)."""
    return list(tokenizer(prompt, add_special_tokens=not chat).input_ids)


def render(task, key, tokenizer, apply_chat_template: bool) -> tuple[str, bool]:
    """Prompt `key`'s text as the engine gets it, and whether a chat template rendered it: chat messages through the
    model's template (the task's `is_chat(key)`), and with task.apply_chat_template a text prompt as one user turn."""
    text = prompt_text(task, key)
    is_chat = getattr(task, "is_chat", None)
    if callable(is_chat) and is_chat(key):
        return text, True
    if not apply_chat_template:
        return text, False
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("task.apply_chat_template=true but policy.model's tokenizer has no chat template; use a "
                          "model whose tokenizer_config.json has a chat_template, or set task.apply_chat_template=false")
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False), True


def prompt_ids(task, key, tokenizer, apply_chat_template: bool) -> tuple[list[int], str]:
    """Prompt `key`'s token ids (encode_prompt) and its rendered text."""
    text, chat = render(task, key, tokenizer, apply_chat_template)
    return encode_prompt(tokenizer, text, chat), text


def truncate(ids: list[int], limit: int | None, side: str) -> list[int]:
    """task.truncation=left keeps the last `limit` tokens, right the first (verl's data.truncation)."""
    if limit is None or len(ids) <= limit or side == "error":
        return ids
    return ids[-limit:] if side == "left" else ids[:limit]


class PromptSampler:
    """Draws a step's (or validation's) prompt keys from the task, checked and within the prompt limit."""

    def __init__(self, cfg, task, tokenizer, model_folder: str | None) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.template = cfg.task.apply_chat_template
        self.limit = prompt_limit(cfg, model_folder)
        self.filter, self.truncation = cfg.task.filter_overlong_prompts, cfg.task.truncation
        self.filtered = 0  # overlong prompts replaced (train) or left out (validation)

    def check_first(self, seed: int, n_train: int, n_val: int) -> None:
        """Step 1's prompts and the held-out ones, checked as the run will check them, before Ray starts: a prompt
        refused by row (too long with task.truncation=error, a template the tokenizer lacks) is refused now, not
        minutes later when the first step draws it. Counts nothing: the run draws them again."""
        filtered = self.filtered
        try:
            self.draw(seed, 1, 0, n_train)
            if n_val:
                self.val(n_val)
        finally:
            self.filtered = filtered

    def counters(self) -> dict:
        return {"rollout/overlong_prompts_filtered_total": self.filtered}

    def draw(self, seed: int, step: int, round_: int, n: int) -> list:
        keys = self._call("prompts", n, seed, step, round_, n)
        return [self._fit(k, seed, step, round_, i) for i, k in enumerate(keys)]

    def val(self, n: int) -> list:
        keys = self._call("val_prompts", None, n)
        return [k for k in keys if self.length_ok(k, "validation")]

    def length_ok(self, key, where: str) -> bool:
        """Whether prompt `key` fits; an overlong one is refused (truncation=error), counted (filter) or cut later."""
        if self.limit is None:
            return True
        n = len(prompt_ids(self.task, key, self.tokenizer, self.template)[0])
        if n <= self.limit:
            return True
        if self.filter:
            self.filtered += 1
            return False
        if self.truncation == "error":
            what = self.task.where(key) if callable(getattr(self.task, "where", None)) else \
                f"{task_label(self.task)} prompt {prompt_text(self.task, key)[:40]!r}"
            raise ConfigError(f"{what} ({where}): the prompt has {n} tokens, more than task.max_prompt_length="
                              f"{self.limit}; set task.filter_overlong_prompts=true to leave such prompts out, "
                              "task.truncation=left|right to cut them, or raise task.max_prompt_length")
        return True  # the rollout actor cuts it (truncate)

    def _fit(self, key, seed: int, step: int, round_: int, i: int):
        where = f"step {step}"
        if self.length_ok(key, where):
            return key
        for t in range(MAX_REPLACEMENT_TRIES):
            (other,) = self._call("prompts", 1, seed, step, REPLACEMENT_ROUND + (round_ * 4096 + i) * 1024 + t, 1)
            if self.length_ok(other, where):
                return other
        raise ConfigError(f"step {step}: {MAX_REPLACEMENT_TRIES} draws found no prompt within task.max_prompt_length="
                          f"{self.limit} (task.filter_overlong_prompts); raise the limit")

    def _call(self, method: str, n: int | None, *args) -> list:
        """task.<method>(*args), its failure one ConfigError naming the task and the method."""
        shown = f"{task_label(self.task)} {method}({', '.join(map(str, args))})"
        try:
            keys = getattr(self.task, method)(*args)
        except ConfigError:
            raise
        except BaseException as e:  # noqa: BLE001 - user code: any failure becomes the one line
            raise ConfigError(f"{shown} raised {type(e).__name__}: {' '.join(str(e).split())[:200]} ({where_raised(e, None)})"
                              "; fix the task") from None
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__len__") or (n is not None and len(keys) != n):
            got = f"{len(keys)} prompts" if hasattr(keys, "__len__") and not isinstance(keys, (str, bytes)) else \
                f"a {type(keys).__name__}"
            raise ConfigError(f"{shown} returned {got}; it must return a list of {n if n is not None else 'up to n'} "
                              "prompts")
        keys = list(keys)
        for k in keys:
            prompt_text(self.task, k)  # a key that is no prompt: one line naming the task (tasks.prompt_text)
        return keys
