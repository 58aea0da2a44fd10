"""`multi_turn.*`: the multi-turn rollout's limits (its own model; config.py's Config holds it as `multi_turn`)."""

from __future__ import annotations

from pydantic import Field

from dataplane_rl.config_types import CONFIG, StrictScalars


class MultiTurnConfig(StrictScalars):
    """`multi_turn.*`: how long an episode of a multi-turn task may run (single-turn tasks ignore it).

    An episode alternates policy turns (each at most generation.max_new_tokens tokens) and environment
    observations; it ends when the environment says done, after max_turns policy turns, or when the next
    turn or observation would pass policy.max_total_sequence_length (required for multi-turn tasks)."""

    model_config = CONFIG

    max_turns: int = Field(8, ge=1, description="Most policy turns per episode (verl: multi_turn.max_assistant_turns; NeMo-RL: grpo.max_rollout_turns; SkyRL: generator.max_turns); an episode stopped here ends as max_turns. Only multi-turn tasks (task.name=guess, tool) use it.")
