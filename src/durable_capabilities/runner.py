"""Run a `DurableAgent` once on any registered engine and report what the engine recorded.

Used by `durcap run` and `durcap demo`. The engine is looked up in the registry (`engines.get`); each
adapter runs the path its users know (see `engines/<name>.py`) and returns a `turn.RunReport`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .agent import DurableAgent
from .engines import RunOptions, get
from .engines._adapter import _stderr
from .turn import RunReport

__all__ = ['RunReport', 'run']


async def run(
    agent: DurableAgent[Any, Any],
    prompt: str | None,
    *,
    engine: str = 'local',
    deps: Any = None,
    message_history: Sequence[Any] | None = None,
    conversation_id: str | None = None,
    run_id: str | None = None,
    notify: Callable[[str], None] = _stderr,
    on_start: Callable[[str], None] | None = None,
    **settings: Any,
) -> RunReport:
    """Run one turn of `agent` on `engine`.

    Args:
        agent: The definition (valid for `engine`).
        prompt: The user prompt.
        engine: A registered engine's name (`engines.ENGINES`).
        deps: The run's deps, of the agent's `deps_type`.
        message_history: Prior messages (ignored with `conversation_id`: the stored history is used).
        conversation_id: Conversation to load from and append to (any engine, the same store).
        run_id: The engine's id for the run (workflow id); default `{agent name}-{uuid4}` where the engine takes one.
        notify: Where the engine reports what it does on the user's behalf (default: stderr); the run's id among the
            first lines, the moment the engine has the run.
        on_start: Called with the run's id the moment the engine has the run (durable engines).
        settings: Engine settings (`address`, `task_queue`, `inline_worker`, `namespace`, `db`, ...); an engine
            ignores those it does not use.

    Returns:
        The `RunReport`.

    Raises:
        ValueError: unknown engine.
        DurableConfigError: the definition or the stored history has errors.
        Exception: whatever the engine raised when the run failed.
    """
    options = RunOptions(deps, message_history, conversation_id, run_id, settings, notify, on_start)
    return await get(engine).run(agent, prompt, options)
