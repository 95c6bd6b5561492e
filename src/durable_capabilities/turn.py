"""The one conversation turn: load the stored history, run the agent, append what the run added.

Every engine's durable container calls `run_turn` (the Temporal workflow body, the DBOS workflow and
`@dbos.workflow` functions through `BoundAgent`, the Prefect flow) and so does a local run; only the
two store units differ (an activity, a step, a task, or a plain call in-process). `RunReport` is what
every runner path returns and what `durcap run` prints.

Messages cross engine boundaries as pydantic-ai's message JSON (`ModelMessagesTypeAdapter`), which
every engine can record and which keeps instruction ids intact.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ToolCallPart
from pydantic_ai.usage import RunUsage
from pydantic_core import to_jsonable_python

from .aliases import rewrite_history
from .conversations import append_conversation, load_conversation

if TYPE_CHECKING:
    from .agent import DurableAgent
    from .conversations import LoadedConversation

LoadUnit = Callable[[str], Awaitable['LoadedConversation']]
"""`load(conversation_id) -> LoadedConversation`: the engine's durable unit that reads the store."""

AppendUnit = Callable[[str, list[dict[str, Any]], 'int | None', dict[str, Any]], Awaitable[Any]]
"""`append(conversation_id, new messages JSON, expected revision, usage JSON)`: the engine's unit that appends."""


@dataclass
class TurnState:
    """What a turn knows while its agent runs (read by engine hooks such as Temporal's continue-as-new).

    Attributes:
        conversation_id: The conversation the turn appends to, or `None`.
        revision: The stored revision the turn loaded (`None`: new conversation or none).
        history: The starting history as message JSON (stored, or given by the caller).
    """

    conversation_id: str | None
    revision: int | None
    history: list[dict[str, Any]]


_current: ContextVar[TurnState | None] = ContextVar('durcap_turn', default=None)


def current_turn() -> TurnState | None:
    """The `TurnState` of the turn running in this context (`None` outside `run_turn`)."""
    return _current.get()


@dataclass
class Turn:
    """What one turn produced.

    Attributes:
        result: Upstream's `AgentRunResult`.
        state: The turn's `TurnState` (starting history, loaded revision).
        new_messages: The messages the run added, as message JSON.
        usage: The run's usage as JSON-compatible data.
    """

    result: Any
    state: TurnState
    new_messages: list[dict[str, Any]]
    usage: dict[str, Any]

    def payload(self) -> dict[str, Any]:
        """`{'output', 'new_messages', 'usage'}` as JSON-compatible data (what DBOS and Prefect containers return)."""
        return {'output': to_jsonable_python(self.result.output), 'new_messages': self.new_messages, 'usage': self.usage}


def _as_json(messages: Sequence[Any] | None) -> list[dict[str, Any]]:
    if not messages:
        return []
    if all(isinstance(m, dict) for m in messages):
        return list(messages)
    return ModelMessagesTypeAdapter.dump_python(list(messages), mode='json')


async def run_turn(
    agent: DurableAgent[Any, Any],
    run: Callable[..., Awaitable[Any]],
    prompt: str | None,
    *,
    deps: Any = None,
    message_history: Sequence[Any] | None = None,
    conversation_id: str | None = None,
    load: LoadUnit | None = None,
    append: AppendUnit | None = None,
    **run_kwargs: Any,
) -> Turn:
    """One turn of `agent`: load the conversation, run, append the new messages.

    Args:
        agent: The definition (its aliases rewrite old capability ids in the history).
        run: The built agent's `run` (called with `prompt`, `deps=`, `message_history=`, `run_kwargs`).
        prompt: The user prompt (`None` to continue from the history alone).
        deps: The run's deps, already of `deps_type` (see `deps_from_json`).
        message_history: Prior messages (objects or message JSON); replaced by the stored history when
            `conversation_id` is given.
        conversation_id: Conversation to load from and append to, or `None`.
        load / append: The engine's durable units around the store (an activity, a step, a task);
            default: in-process calls (`load_conversation`, `append_conversation` with a fresh append id).

    Returns:
        The `Turn`.

    Raises:
        DurableConfigError: drift in the stored history (DC018/DC019), raised by `load`.
        ConversationConflictError: another run appended since this one loaded.
    """
    agent.check_run_capabilities(run_kwargs.pop('capabilities', None))
    history_json = _as_json(message_history)
    revision: int | None = None
    if conversation_id is not None:
        loaded = await (load or _local_load(agent))(conversation_id)
        history_json, revision = list(loaded.messages), loaded.revision
    state = TurnState(conversation_id, revision, history_json)
    history = ModelMessagesTypeAdapter.validate_python(history_json) if history_json else None
    token = _current.set(state)
    try:
        result = await run(prompt, deps=deps, message_history=rewrite_history(history, agent.aliases), **run_kwargs)
    finally:
        _current.reset(token)
    turn = Turn(result, state, ModelMessagesTypeAdapter.dump_python(result.new_messages(), mode='json'),
                to_jsonable_python(result.usage))
    if conversation_id is not None:
        await (append or _local_append(agent))(conversation_id, turn.new_messages, revision, turn.usage)
    return turn


def deps_from_json(agent: DurableAgent[Any, Any], deps: Any) -> Any:
    """JSON deps validated into the agent's `deps_type` (`None` stays `None`).

    Raises:
        pydantic.ValidationError: `deps` does not match `deps_type`.
    """
    return TypeAdapter(agent.deps_type).validate_python(deps) if deps is not None else None


def _local_load(agent: DurableAgent[Any, Any]) -> LoadUnit:
    return lambda conversation_id: load_conversation(agent, conversation_id)


def _local_append(agent: DurableAgent[Any, Any]) -> AppendUnit:
    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> int:
        return await append_conversation(agent, conversation_id, messages, expected_revision=revision,
                                         append_id=f'local:{uuid.uuid4()}', usage=usage)

    return append


@dataclass
class RunReport:
    """What one run produced, on any engine (returned by every runner path, printed by `durcap run`).

    Attributes:
        engine: The engine it ran on.
        run_id: The engine's id of the run (workflow id, flow run id); `None` locally.
        output: The agent's output.
        new_messages: Messages the run added.
        usage: Tokens and requests (`RunUsage`).
        durable_units: Names of the durable units the engine recorded, in order (activity types,
            step names, task run names).
    """

    engine: str
    run_id: str | None
    output: Any
    new_messages: list[ModelMessage]
    usage: RunUsage
    durable_units: list[str] = field(default_factory=list)

    @classmethod
    def from_payload(cls, engine: str, run_id: str | None, payload: dict[str, Any], units: list[str] | None = None) -> RunReport:
        """A report from a container's `{'output', 'new_messages', 'usage'}` JSON payload (see `Turn.payload`)."""
        return cls(engine, run_id, payload['output'], ModelMessagesTypeAdapter.validate_python(payload['new_messages']),
                   RunUsage(**payload['usage']), list(units or []))

    def loaded_capabilities(self) -> list[str]:
        """Capability ids the run loaded with `load_capability`, in order."""
        loaded: list[str] = []
        for message in self.new_messages:
            for part in getattr(message, 'parts', []):
                if isinstance(part, ToolCallPart) and part.tool_name == 'load_capability':
                    cap = part.args_as_dict().get('id')
                    if cap and cap not in loaded:
                        loaded.append(cap)
        return loaded
