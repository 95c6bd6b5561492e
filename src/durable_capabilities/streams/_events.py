"""`RunEvent`: one event of a run's stream, as a subscriber receives it (`durable_capabilities.watch`).

Model and tool events carry pydantic-ai's own `AgentStreamEvent` (`event`), so `pydantic_ai.ui` encoders apply; the
run's own events (started, capability loaded, approvals, turn stored, completed, failed, retry) carry `data`.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import pydantic
from pydantic_ai.messages import (
    AgentStreamEvent,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
    ThinkingPart,
    ThinkingPartDelta,
)

EventKind = Literal[
    'run_started', 'capability_catalog', 'text_delta', 'thinking_delta', 'model_event', 'tool_call', 'tool_result',
    'capability_loaded', 'approval_waiting', 'approval_decided', 'turn_stored', 'run_completed', 'run_failed', 'retry',
    'run_waiting',
]
"""What a `RunEvent` says:
- `run_started` (`data`: agent, engine, conversation_id), `capability_catalog` (`data['capabilities']`: the ids the
  run may load);
- `text_delta` / `thinking_delta`: a model text or thinking part starting with content, or a delta of one (`event`:
  `PartStartEvent` / `PartDeltaEvent`; `RunEvent.text` is its text);
- `model_event`: any other model stream event (`PartStartEvent` of a tool call part, `PartEndEvent`,
  `FinalResultEvent`, ...);
- `tool_call` / `tool_result`: `FunctionToolCallEvent` / `FunctionToolResultEvent` (a result over
  `TOOL_RESULT_SUMMARY_CHARS` is cut, `data['truncated']` then holds its full size and where to read it);
- `capability_loaded` (`data['capability']`), `approval_waiting` (`data['calls']`), `approval_decided`
  (`data['decisions']`), `turn_stored` (`data`: conversation_id, messages);
- `run_completed` (`data`: output, usage, new_messages count: what the run's `RunReport` holds) / `run_failed`
  (`data['error']`): the last event of the stream;
- `retry`: unit `unit` runs again as attempt `attempt`: discard the events of that unit with
  `data['discard_attempts']` (the failed attempts' partial deltas);
- `run_waiting` (`data['notice']`): published by `durcap serve` when the durable run it handed over waits for a worker
  (none polls its Temporal task queue or serves its DBOS queue, or none has taken it for `$DURCAP_WAIT_NOTICE`
  seconds); the run goes on once one does.
"""

TERMINAL_KINDS: frozenset[str] = frozenset({'run_completed', 'run_failed'})

_STREAM_EVENT: pydantic.TypeAdapter[AgentStreamEvent] = pydantic.TypeAdapter(AgentStreamEvent)


class RunEvent(pydantic.BaseModel):
    """One event of a run's stream.

    Attributes:
        run_id: The run (workflow id, flow run id, `local-...`).
        offset: Its position in the run's stream, from 1, increasing by one per event the store kept (a subscriber
            reconnects with the last offset it saw: `watch(run_id, from_offset=offset)`).
        unit: The durable unit that published it (`model_request:3`: the model request sent with 3 messages;
            `run`: the run's container code).
        attempt: The unit's attempt (1 for the first; 0 for container code, which is replayed, never retried).
        kind: What it says (`EventKind`).
        at: When it was published (UTC).
        event: pydantic-ai's stream event, for model and tool events.
        data: The event's other data (see `EventKind`).
    """

    model_config = pydantic.ConfigDict(frozen=True)

    run_id: str
    offset: int
    unit: str
    attempt: int
    kind: EventKind
    at: datetime
    event: AgentStreamEvent | None = None
    data: dict[str, Any] = pydantic.Field(default_factory=dict)

    @property
    def text(self) -> str:
        """The text this event adds to a model text part (`''` for any other event)."""
        event = self.event
        if isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
            return event.delta.content_delta
        if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
            return event.part.content
        return ''


def kind_of(event: AgentStreamEvent) -> EventKind:
    """The `EventKind` of a pydantic-ai stream event."""
    name = type(event).__name__
    if name == 'FunctionToolCallEvent':
        return 'tool_call'
    if name == 'FunctionToolResultEvent':
        return 'tool_result'
    if isinstance(event, PartDeltaEvent):
        if isinstance(event.delta, TextPartDelta):
            return 'text_delta'
        if isinstance(event.delta, ThinkingPartDelta):
            return 'thinking_delta'
    if isinstance(event, PartStartEvent):
        if isinstance(event.part, TextPart) and event.part.content:
            return 'text_delta'
        if isinstance(event.part, ThinkingPart) and event.part.content:
            return 'thinking_delta'
    return 'model_event'


def dump_event(event: AgentStreamEvent) -> Any:
    """`event` as JSON-compatible data (pydantic-ai's own serialization)."""
    return _STREAM_EVENT.dump_python(event, mode='json')


def load_event(data: Any) -> AgentStreamEvent:
    """The stream event `dump_event` wrote."""
    return _STREAM_EVENT.validate_python(data)


def answer_text(events: list[RunEvent]) -> str:
    """The text of the last model response of `events` that produced text, retry markers applied: the events of
    discarded attempts are dropped, so a retried request's half-streamed text never shows twice.

    Args:
        events: A run's events in offset order (any prefix of the stream).

    Returns:
        The joined `text` of the text events of the last model request unit that has any (`''` when none).
    """
    discarded: set[tuple[str, int]] = set()
    for event in events:
        if event.kind == 'retry':
            discarded.update((event.unit, attempt) for attempt in event.data.get('discard_attempts', []))
    last_unit, chunks = None, []
    for event in events:
        if event.kind != 'text_delta' or (event.unit, event.attempt) in discarded:
            continue
        if event.unit != last_unit:
            last_unit, chunks = event.unit, []
        chunks.append(event.text)
    return ''.join(chunks)
