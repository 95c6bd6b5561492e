"""Temporal histories: the activities a run recorded, exporting a run's history, replaying exported ones, and
repairing a turn whose conversation append never completed (`repair_temporal`, `durcap history repair`).

A replay is handed the workflow classes and sandbox runner (the adapter's `replayer`).

Repair: Recover a turn whose conversation append never completed, from Temporal's own record of the run.

A Temporal workflow records the input of every activity it schedules. When a turn's append activity never
completed (the workflow was terminated or timed out while the store was down, or the append was refused),
its input still holds the turn's new messages. `repair_temporal` reads them from the workflow's history
(through the claim-check codec of the client) and appends them with the same idempotency key the workflow
used, so running it twice, or after the workflow's own append finally succeeded, stores nothing twice.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse, TextPart
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.worker import Replayer, WorkflowRunner

from ...report import usage_from_json
from ...store import SQLConversationStore, resolve_url
from ._conversation import AppendInput
from ._payloads import default_data_converter
from ._spec import CONVERSATION_APPEND_SUFFIX

if TYPE_CHECKING:
    from ...agent import DurableAgent


def local_activity_type(marker: Any) -> str | None:
    """The activity type of a local-activity marker (`MarkerRecordedEventAttributes` named `core_local_activity`),
    read from the JSON of its `data` detail; None for any other marker."""
    if marker.marker_name != 'core_local_activity':
        return None
    payloads = marker.details.get('data')
    for payload in payloads.payloads if payloads is not None else ():
        try:
            data = json.loads(payload.data)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and isinstance(data.get('activity_type'), str):
            return data['activity_type']
    return None


async def units_recorded(client: Client, workflow_id: str, first_run_id: str | None) -> list[str]:
    """Activity types scheduled by every run of the chain (continue-as-new starts a run with its own history).

    Args:
        client: A connected client.
        workflow_id: The workflow id.
        first_run_id: The run id of the chain's first run (`None`: asked from the server).
    """
    units: list[str] = []
    run_id = first_run_id or (await client.get_workflow_handle(workflow_id).describe()).raw_description \
        .workflow_execution_info.first_run_id or None
    while run_id:
        run_handle = client.get_workflow_handle(workflow_id, run_id=run_id)
        run_id = None
        async for event in run_handle.fetch_history_events():
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                units.append(event.activity_task_scheduled_event_attributes.activity_type.name)
            elif event.event_type == EventType.EVENT_TYPE_MARKER_RECORDED:
                name = local_activity_type(event.marker_recorded_event_attributes)
                if name is not None and name.startswith('agent__'):  # a tool run as a local activity (not our own)
                    units.append(name)
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                run_id = event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return units


async def export_history(client: Client, workflow_id: str, output: str | Path) -> Path:
    """Write a workflow's history as JSON (`{"workflowId": ..., "history": {...}}`) to `output`; returns its path.

    Payloads are written as Temporal holds them: a large one is a claim-check reference (encoding
    `binary/durcap-claim-check`), which `replay.replay_histories` decodes from the store.

    Raises:
        temporalio.service.RPCError: no such workflow, or the server is unreachable.
    """
    handle = client.get_workflow_handle(workflow_id)
    history = await handle.fetch_history()
    output = Path(output)
    output.write_text(
        json.dumps({'workflowId': workflow_id, 'history': json.loads(history.to_json())}, indent=1), encoding='utf-8'
    )
    return output


_ACTIVITY_RE = re.compile(
    r'agent__(?P<agent>.+?)__(?:toolset__(?P<toolset>.+?)__(?:call_tool|validate_args|get_tools)|model_\w+)'
)


class HistoryReplayer:
    """Replays exported histories against the agents' workflow classes (temporalio's `Replayer`).

    Args:
        agents: The current definitions.
        workflows: Their workflow classes (`engines.temporal.workflow_classes`).
        workflow_runner: The sandbox runner the worker uses (`engines.temporal.sandbox_runner()`).
        store: Conversation store the claim-check references are read from (default `$DURCAP_STORE`).
        interceptors: The worker's workflow interceptors that change commands (`engines.temporal.LocalToolActivities`;
            `_streams.CarryStreamEvents` is always added).
    """

    def __init__(self, agents: Sequence[DurableAgent[Any, Any]], workflows: Sequence[type], workflow_runner: WorkflowRunner,
                 store: str | None = None, interceptors: Sequence[Any] = ()):
        from ._streams import CarryStreamEvents  # the event schemas

        self.agents = list(agents)
        if not any(isinstance(i, CarryStreamEvents) for i in interceptors):  # the worker's stream commands
            interceptors = [*interceptors, CarryStreamEvents()]
        self._replayer = Replayer(
            workflows=list(workflows),
            interceptors=list(interceptors),
            plugins=[PydanticAIPlugin()],
            workflow_runner=workflow_runner,
            data_converter=default_data_converter(store),  # decodes claim checks
        )

    async def replay(self, history_json: dict[str, Any], workflow_id: str) -> str | None:
        """temporalio's failure text for the history, `None` when it replays.

        Raises:
            ValueError: an event's `eventType` is not one Temporal knows (the replayer would report it as
                nondeterminism, as if the code had changed), or the JSON does not parse as a history.
        """
        known = set(EventType.keys())
        for index, event in enumerate(history_json.get('events', [])):
            kind = event.get('eventType') if isinstance(event, dict) else None
            if kind not in known or kind == 'EVENT_TYPE_UNSPECIFIED':
                raise ValueError(f'event {index + 1} has eventType {str(kind)[:60]!r}, which is not a Temporal event type')
        history = WorkflowHistory.from_json(workflow_id, history_json)
        result = await self._replayer.replay_workflow(history, raise_on_replay_failure=False)
        return None if result.replay_failure is None else str(result.replay_failure)

    def explain(self, error: str) -> str:
        """What changed, from the activity type names in temporalio's message: the agent or leaf toolset whose
        name the current definitions no longer produce, and the fix."""
        current_leaves = {leaf for agent in self.agents for leaves in agent.leaf_ids().values() for leaf in leaves}
        current_agents = {agent.durable_name for agent in self.agents}
        for match in _ACTIVITY_RE.finditer(error):
            agent_name, toolset = match.group('agent'), match.group('toolset')
            if agent_name not in current_agents:
                return (
                    f'the history was recorded by agent {agent_name!r}, whose durable name changed; '
                    f"declare it: `DurableAgent(..., previous_names=['{agent_name}'])`."
                )
            if toolset and toolset not in current_leaves and toolset != '<agent>':
                return (
                    f'the history used leaf toolset {toolset!r} (capability {toolset!r} or a toolset under it), which '
                    "the current definition no longer has; if the capability was renamed, declare it: "
                    f"`DurableAgent(..., aliases={{'<new id>': '{toolset}'}})`."
                )
        return 'the workflow code no longer matches the recorded history (nondeterminism); see the temporal message.'


# ---- repair: a turn whose append never completed ---------------------------------------------------------


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
        client: A client from `connect` (its codec reads claim-checked inputs).
        workflow_id / run_id: The workflow (its latest run by default).
        store: The conversation store URL (default `$DURCAP_STORE`, else the default store).

    Returns:
        One `Repaired` per append recovered (empty: nothing was pending).

    Raises:
        ConversationConflictError: the conversation moved on since the turn loaded it; nothing was written.
        StoreError: the store is unusable.
        temporalio.service.RPCError: no such workflow.
    """
    handle = client.get_workflow_handle(workflow_id, run_id=run_id)
    scheduled: dict[int, Any] = {}
    async for event in handle.fetch_history_events():
        if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            attributes = event.activity_task_scheduled_event_attributes
            if attributes.activity_type.name.endswith(CONVERSATION_APPEND_SUFFIX):
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
                append_id=params.append_id, usage=usage_from_json(params.usage) if params.usage else None,
            )
            answer = next(
                (part.content for message in reversed(messages) if isinstance(message, ModelResponse)
                 for part in message.parts if isinstance(part, TextPart)),
                None,
            )
            repaired.append(Repaired(params.conversation_id, params.append_id, len(messages), result.revision,
                                     result.replayed, answer))
    return repaired
