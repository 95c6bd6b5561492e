"""Temporal runs' event streams, kept in the conversation store like every engine's (docs/watching.md).

Measured choice (over upstream 2.68's `TemporalDurability.stream_agent_events` on Temporal's experimental Workflow
Streams, see docs/watching.md): the events are written to the store's event log from inside activities, never from
workflow code, so the workflow's history holds no event and a finished run is watched without a worker.

- The model request activity (`agent__{name}__model_request`): `PublishFromActivities`, a worker interceptor, enters
  `streams.publishing(workflow id, ...)` around it with the activity's attempt, and the agent's model
  (`streams.StreamingModel`, wrapped by `DurableAgent.build` for an engine with the `streams` feature) sends the
  request streamed and publishes its events; a retried attempt's first event is the `retry` marker.
- The workflow's own events (run started, approval waiting / decided, turn stored, run completed / failed):
  `WorkflowStream`, the workflow's `StreamContext`, writes each through the local activity `PUBLISH_ACTIVITY`,
  behind the patch marker `STREAMS_PATCH_ID`, so histories recorded before it replay unchanged. A local activity's
  result is in the history (a marker): a replayed workflow does not publish again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.worker import ActivityInboundInterceptor, ExecuteActivityInput, Interceptor

from ... import interrupts, streams
from ...conversations import store_url
from ...store import resolve_url
from ...streams._log import EventLog, Item
from ...streams._publish import enabled
from ._spec import ENGINE, MODEL_REQUEST_ACTIVITIES, STREAMS_PATCH_ID

if TYPE_CHECKING:
    from ...agent import DurableAgent

PUBLISH_ACTIVITY = 'durcap.stream_publish'
"""The local activity that writes a workflow's own events to its stream (one per worker, for every agent it serves;
not in `durable.lock`: a local activity is no task another worker may take)."""

PUBLISH_TIMEOUT = timedelta(seconds=10)
"""`start_to_close_timeout` of `PUBLISH_ACTIVITY`; it is not retried (a store that cannot be written stops the
run's stream, never the run)."""

_OPENING_KINDS = frozenset({'run_started', 'capability_catalog'})

_logger = logging.getLogger('durable_capabilities.streams')


@dataclass
class PublishInput:
    """Input of `PUBLISH_ACTIVITY`.

    Attributes:
        agent: The agent's durable name (its conversation store, `DurableAgent(conversation_store=...)`).
        run_id: The stream (the workflow id).
        items: The events, each `[unit, attempt, seq, kind, body]`.
        close: Whether the stream ends with them.
    """

    agent: str
    run_id: str
    items: list[list[Any]] = field(default_factory=list)
    close: bool = False


def publish_activity(agents: Sequence[DurableAgent[Any, Any]], store: str | None) -> Any:
    """The `PUBLISH_ACTIVITY` function of a worker serving `agents` with the conversation store `store` (`None`:
    `$DURCAP_STORE`, else the default store). Returns `False`, with one warning, when the store cannot be written."""
    by_name = {agent.durable_name: agent for agent in agents}

    @activity.defn(name=PUBLISH_ACTIVITY)
    async def publish(params: PublishInput) -> bool:
        if not enabled():
            return True
        agent = by_name.get(params.agent)
        url = store_url(agent, store) if agent is not None else resolve_url(store)
        try:
            await EventLog(url).append(params.run_id, ENGINE, [Item(*row) for row in params.items], close=params.close)
        except Exception as error:  # noqa: BLE001 - the run goes on without its stream
            _logger.warning('run %s: its event stream stops here (the store could not be written: %s: %s); the run '
                            'goes on', params.run_id, type(error).__name__, str(error).splitlines()[0] if str(error) else '')
            return False
        return True

    return publish


@dataclass
class WorkflowStream(streams.StreamContext):
    """The workflow's `StreamContext`: `write` runs `PUBLISH_ACTIVITY` (workflow code, deterministic).

    Attributes:
        agent: The agent's durable name.
        continued: This run continues an earlier one (continue-as-new): its `run_started` and `capability_catalog`
            were published by the first run and are not repeated.
    """

    agent: str = ''
    continued: bool = False

    async def write(self, items: list[Any], *, close: bool = False) -> None:
        if self.failed:
            return
        rows = [[i.unit, i.attempt, i.seq, i.kind, i.body] for i in items
                if not (self.continued and i.kind in _OPENING_KINDS)]
        if not rows and not close:
            return
        try:
            ok = await workflow.execute_local_activity(
                PUBLISH_ACTIVITY, PublishInput(self.agent, self.run_id, rows, close), result_type=bool,
                start_to_close_timeout=PUBLISH_TIMEOUT, retry_policy=RetryPolicy(maximum_attempts=1))
        except ActivityError:
            ok = False
        if not ok:
            self.failed = True


def workflow_stream(agent: DurableAgent[Any, Any], continued_seq: int | None) -> WorkflowStream | None:
    """In workflow code, at the start of the run: the run's `WorkflowStream`, or `None` for a run recorded before
    streams (`workflow.patched(STREAMS_PATCH_ID)` is false while replaying its history).

    Args:
        agent: The run's agent.
        continued_seq: For a continued run, the next sequence number of the earlier runs' own events.
    """
    if not workflow.patched(STREAMS_PATCH_ID):
        return None
    return WorkflowStream(workflow.info().workflow_id, ENGINE, None, seq=continued_seq or 0,  # type: ignore[arg-type]
                          agent=agent.durable_name, continued=continued_seq is not None)


class PublishFromActivities(Interceptor):
    """Worker interceptor: each model request activity of `agents` runs inside `streams.publishing` on its
    workflow's stream, with the activity's attempt (see the module docstring).

    Args:
        agents: The agents the worker serves.
        store: The worker's conversation store (`None`: `$DURCAP_STORE`, else the default store).
        activity_agents: `{model request activity type: agent}` (from the agents' durable names).
    """

    def __init__(self, store: str | None, activity_agents: Mapping[str, DurableAgent[Any, Any]]):
        self.store, self.activity_agents = store, dict(activity_agents)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Publishing(next, self)


class _Publishing(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, owner: PublishFromActivities):
        super().__init__(next)
        self.owner = owner

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        agent = self.owner.activity_agents.get(info.activity_type)
        if agent is None or not info.workflow_id:
            return await self.next.execute_activity(input)
        url = store_url(agent, self.owner.store)
        # The model request checks whether a newer turn asked the workflow's turn to stop (`interrupts`): a workflow
        # without a conversation holds no claim, and the check reads nothing for it.
        with streams.publishing(info.workflow_id, ENGINE, url, attempt=info.attempt), \
                interrupts.watching(info.workflow_id, url):
            return await self.next.execute_activity(input)


def model_request_activities(agents: Sequence[DurableAgent[Any, Any]], names: Any) -> dict[str, DurableAgent[Any, Any]]:
    """`{model request activity type: agent}` of `agents`, from `names(agent)['activities']` (`durable_names`)."""
    return {name: agent for agent in agents for name in names(agent)['activities']
            if name.endswith(MODEL_REQUEST_ACTIVITIES)}
