"""Recover a turn whose conversation append never completed, from Temporal's own record of the run.

A Temporal workflow records the input of every activity it schedules. When a turn's append activity never
completed (the workflow was terminated or timed out while the store was down, or the append was refused),
its input still holds the turn's new messages. `repair_temporal` reads them from the workflow's history
(through the claim-check codec of the client) and appends them with the same idempotency key the workflow
used, so running it twice, or after the workflow's own append finally succeeded, stores nothing twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse, TextPart
from pydantic_ai.usage import RunUsage

from .store import SQLConversationStore, resolve_url


@dataclass
class Repaired:
    """What `repair_temporal` did for one pending append.

    Attributes:
        conversation_id: The conversation appended to.
        append_id: The idempotency key of the workflow's append.
        messages: How many messages the append carries.
        revision: The conversation's revision after it.
        already_stored: True when the store already had this append (nothing written).
        answer: The text of the turn's last model response (`None` when it has none).
    """

    conversation_id: str
    append_id: str
    messages: int
    revision: int
    already_stored: bool
    answer: str | None


async def repair_temporal(client: Any, workflow_id: str, *, store: str | None = None, run_id: str | None = None) -> list[Repaired]:
    """Append every conversation append the workflow scheduled but never completed, oldest first.

    Args:
        client: A client from `engines.temporal.connect` (its codec reads claim-checked inputs).
        workflow_id / run_id: The workflow (its latest run by default).
        store: The conversation store URL (default `$DURCAP_STORE`, else the default store).

    Returns:
        One `Repaired` per append recovered (empty: nothing was pending).

    Raises:
        ConversationConflictError: the conversation moved on since the turn loaded it; nothing was written.
        StoreError: the store is unusable.
        temporalio.service.RPCError: no such workflow.
    """
    from temporalio.api.enums.v1 import EventType  # lazily: temporalio is an optional extra

    from .engines.temporal import AppendInput

    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    scheduled: dict[int, Any] = {}
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attributes = event.activity_task_scheduled_event_attributes
            if attributes.activity_type.name.endswith('__conversation_append'):
                scheduled[event.event_id] = attributes
        elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
            scheduled.pop(event.activity_task_completed_event_attributes.scheduled_event_id, None)
    repaired: list[Repaired] = []
    async with SQLConversationStore(resolve_url(store)) as opened:
        for attributes in scheduled.values():
            [params] = await client.data_converter.decode(attributes.input.payloads, [AppendInput])
            messages = ModelMessagesTypeAdapter.validate_python(params.messages)
            result = await opened.append(
                params.conversation_id, messages, expected_revision=params.expected_revision,
                append_id=params.append_id, usage=RunUsage(**params.usage) if params.usage else None,
            )
            answer = next(
                (part.content for message in reversed(messages) if isinstance(message, ModelResponse)
                 for part in message.parts if isinstance(part, TextPart)),
                None,
            )
            repaired.append(Repaired(params.conversation_id, params.append_id, len(messages), result.revision,
                                     result.replayed, answer))
    return repaired
