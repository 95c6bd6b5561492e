"""How long each leaf toolset's tool calls took in recorded Temporal runs (`durcap lock --measure`).

A tool activity's history records when its last attempt started (`ActivityTaskStarted`, whose `attempt` says how
many attempts there were) and when it completed, failed or timed out. That is the execution time a local activity
would spend inside the workflow task, which is what decides whether a tool may run as one (`LOCAL_TOOLSETS_OPTION`).
Tools that already run as local activities record a marker instead, with no start time: they are counted as
`local_calls` and not timed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client

from ._durability import durable_names

if TYPE_CHECKING:
    from ...agent import DurableAgent

_TOOL_SUFFIX = '__call_tool'
_LOCAL_MARKER = 'core_local_activity'


@dataclass
class ToolTiming:
    """One leaf toolset's tool calls in the runs read.

    Attributes:
        leaf: The leaf toolset id (for a capability's own tools: the capability id).
        seconds: Execution time of each completed call's last attempt, in seconds, in history order.
        retried: Calls that needed more than one attempt (a failure, a timeout or a killed worker).
        failed: Calls that ended failed, timed out or cancelled.
        local_calls: Calls recorded as local-activity markers (already local: not timed).
        runs: Workflow runs read that called this leaf at least once.
    """

    leaf: str
    seconds: list[float] = field(default_factory=list)
    retried: int = 0
    failed: int = 0
    local_calls: int = 0
    runs: int = 0

    @property
    def calls(self) -> int:
        """Calls timed (completed regular activities)."""
        return len(self.seconds)


def _leaf_of(activity_type: str, agent_prefix: str) -> str | None:
    """`agent__support__toolset__orders__call_tool` -> `orders` (None for any other activity type)."""
    head = f'{agent_prefix}__toolset__'
    if not (activity_type.startswith(head) and activity_type.endswith(_TOOL_SUFFIX)):
        return None
    return activity_type[len(head):-len(_TOOL_SUFFIX)]


async def measure_tool_calls(
    client: Client, agents: Sequence[DurableAgent[Any, Any]], *, runs: int = 50,
) -> dict[str, dict[str, ToolTiming]]:
    """Read the histories of each agent's most recent closed workflow runs and time their tool activities.

    Args:
        client: A connected client (`_client.connect`) on the namespace the runs were recorded in.
        agents: The definitions; a run counts for an agent when its workflow type is the agent's workflow.
        runs: At most this many most recent closed runs per agent (newest first, as the server lists them).

    Returns:
        `{agent name: {leaf id: ToolTiming}}` for every leaf a read run called (agents with no run: `{}`).

    Raises:
        temporalio.service.RPCError: the server refused the list or a history fetch (visibility not enabled, a
            namespace that does not exist).
    """
    found: dict[str, dict[str, ToolTiming]] = {}
    for agent in agents:
        per_leaf: dict[str, ToolTiming] = {}
        found[agent.name] = per_leaf
        names = durable_names(agent)
        [workflow_type] = names['workflows']
        prefix = next((n.split('__toolset__')[0] for n in names['activities'] if '__toolset__' in n), None)
        if prefix is None:
            continue  # no tool activities
        query = f'WorkflowType = "{workflow_type}" AND ExecutionStatus != "Running"'
        read = 0
        async for execution in client.list_workflows(query, limit=runs):
            read += 1
            handle = client.get_workflow_handle(execution.id, run_id=execution.run_id)
            scheduled: dict[int, str] = {}  # scheduled event id -> leaf
            started: dict[int, tuple[float, int]] = {}  # scheduled event id -> (start time, attempt)
            called: set[str] = set()
            async for event in handle.fetch_history_events():
                kind = event.event_type
                if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                    leaf = _leaf_of(event.activity_task_scheduled_event_attributes.activity_type.name, prefix)
                    if leaf is not None:
                        scheduled[event.event_id] = leaf
                elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                    attrs = event.activity_task_started_event_attributes
                    if attrs.scheduled_event_id in scheduled:
                        started[attrs.scheduled_event_id] = (event.event_time.ToDatetime().timestamp(), attrs.attempt)
                elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                    sid = event.activity_task_completed_event_attributes.scheduled_event_id
                    if sid in scheduled and sid in started:
                        timing = per_leaf.setdefault(scheduled[sid], ToolTiming(scheduled[sid]))
                        begin, attempt = started[sid]
                        timing.seconds.append(max(0.0, event.event_time.ToDatetime().timestamp() - begin))
                        timing.retried += attempt > 1
                        called.add(scheduled[sid])
                elif kind in (EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED, EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT,
                              EventType.EVENT_TYPE_ACTIVITY_TASK_CANCELED):
                    attrs = (event.activity_task_failed_event_attributes
                             if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED else
                             event.activity_task_timed_out_event_attributes
                             if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT else
                             event.activity_task_canceled_event_attributes)
                    sid = attrs.scheduled_event_id
                    if sid in scheduled:
                        per_leaf.setdefault(scheduled[sid], ToolTiming(scheduled[sid])).failed += 1
                        called.add(scheduled[sid])
                elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
                    attrs = event.marker_recorded_event_attributes
                    if attrs.marker_name == _LOCAL_MARKER:
                        leaf = _local_marker_leaf(attrs, prefix)
                        if leaf is not None:
                            per_leaf.setdefault(leaf, ToolTiming(leaf)).local_calls += 1
                            called.add(leaf)
            for leaf in called:
                per_leaf[leaf].runs += 1
            if read >= runs:
                break
    return found


def _local_marker_leaf(attrs: Any, prefix: str) -> str | None:
    """The leaf of a local-activity marker, from the activity type in its `data` payloads (JSON), if it is a tool's."""
    import json

    payloads = attrs.details.get('data')
    if payloads is None:
        return None
    for payload in payloads.payloads:
        try:
            data = json.loads(payload.data)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(data, dict) and isinstance(data.get('activity_type'), str):
            return _leaf_of(data['activity_type'], prefix)
    return None
