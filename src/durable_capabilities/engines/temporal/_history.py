"""Temporal histories: the activities a run recorded, exporting a run's history, and replaying exported ones.

Used by `engines.temporal` (`TemporalAdapter.run`, `.replayer`, `.export_history`), which re-exports these
names. This module never imports `engines.temporal`: a replay is handed the workflow classes and sandbox runner.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.worker import Replayer, WorkflowRunner

from ..store._claim_check import default_codec

if TYPE_CHECKING:
    from ..agent import DurableAgent


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
        interceptors: The worker's workflow interceptors that change commands (`engines.temporal.LocalToolActivities`).
    """

    def __init__(self, agents: Sequence[DurableAgent[Any, Any]], workflows: Sequence[type], workflow_runner: WorkflowRunner,
                 store: str | None = None, interceptors: Sequence[Any] = ()):
        self.agents = list(agents)
        self._replayer = Replayer(
            workflows=list(workflows),
            interceptors=list(interceptors),
            plugins=[PydanticAIPlugin()],
            workflow_runner=workflow_runner,
            data_converter=DataConverter(payload_codec=default_codec(store)),  # decodes claim checks
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
