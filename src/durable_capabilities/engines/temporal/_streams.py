"""Temporal runs' event streams, kept in the conversation store like every engine's (docs/watching.md).

Measured choice (over upstream 2.68's `TemporalDurability.stream_agent_events` on Temporal's experimental Workflow
Streams, see docs/watching.md): the events are written to the store's event log from inside activities, never from
workflow code, so the workflow's history holds no event and a finished run is watched without a worker.

- The model request activity (`agent__{name}__model_request`): `PublishFromActivities`, a worker interceptor, enters
  `streams.publishing(workflow id, ...)` around it with the activity's attempt, and the agent's model
  (`streams.StreamingModel`, wrapped by `DurableAgent.build` for an engine with the `streams` feature) sends the
  request streamed and publishes its events; a retried attempt's first event is the `retry` marker.
- The workflow's own events (run started, approval waiting / decided, turn stored, run completed / failed):
  `WorkflowStream`, the workflow's `StreamContext`. Behind the patch marker `CARRY_PATCH_ID` (a run started by this
  version), those that can wait ride with the workflow's next activity instead of a local activity of their own
  (`CarryStreamEvents`, a workflow outbound interceptor, puts them in the activity's header `CARRY_HEADER`):
  `run_started` + `capability_catalog` with the first model request activity, which stores them before its own
  events, in its first write (`StreamContext.carried`); `turn_stored` + `run_completed` with the conversation append
  activity, which stores them once the append succeeded. A retried activity stores them again under the same keys,
  which the log skips. Where no activity follows (a run without a conversation ends, a run fails, an approval
  waits, the run continues as new) or the events are large (`CARRY_MAX_BYTES`), the local activity
  `PUBLISH_ACTIVITY` writes them, with any carried events not confirmed yet (an activity that failed) first. A local
  activity's result is in the history (a marker): a replayed workflow does not publish again. Histories recorded
  before `STREAMS_PATCH_ID` replay without stream events; those recorded before `CARRY_PATCH_ID` with a local
  activity per publish, as they ran.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic_core import to_json
from temporalio import activity, workflow
from temporalio.api.common.v1 import Payload
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    StartActivityInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from ... import interrupts, streams
from ...conversations import store_url
from ...store import resolve_url
from ...streams._log import EventLog, Item
from ...streams._publish import enabled
from . import _patches
from ._spec import (
    CARRY_PATCH_ID,
    CONVERSATION_APPEND_SUFFIX,
    ENGINE,
    FAILED_APPEND_PATCH_ID,
    LATE_CLOSING_PATCH_ID,
    MODEL_REQUEST_ACTIVITIES,
    STREAMS_PATCH_ID,
)

if TYPE_CHECKING:
    from ...agent import DurableAgent

PUBLISH_ACTIVITY = 'durcap.stream_publish'
"""The local activity that writes a workflow's own events to its stream (one per worker, for every agent it serves;
not in `durable.lock`: a local activity is no task another worker may take)."""

PUBLISH_TIMEOUT = timedelta(seconds=10)
"""`start_to_close_timeout` of `PUBLISH_ACTIVITY`; it is not retried (a store that cannot be written stops the
run's stream, never the run)."""

_OPENING_KINDS = frozenset({'run_started', 'capability_catalog'})

CARRY_HEADER = 'durcap-stream-events'
"""The activity header holding a workflow's own events for the activity to store (`CarryStreamEvents`): JSON
`{"agent": durable name, "before": [rows], "after": [rows], "close": bool}`, each row `[unit, attempt, seq, kind,
body]`; `before` stored before the activity's own events, `after` once it succeeded (then the stream closes with
`close`)."""

CARRY_MAX_BYTES = 16 * 1024
"""Events whose JSON is larger than this are written by `PUBLISH_ACTIVITY`, not carried in an activity header (a
header is in the workflow's history as it is, without the claim check of `_payloads`)."""

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
    """The workflow's `StreamContext` (workflow code, deterministic): events that can wait ride with the workflow's
    next model request or append activity (`defers`, see the module docstring), the others are written by
    `PUBLISH_ACTIVITY`.

    Attributes:
        agent: The agent's durable name.
        continued: This run continues an earlier one (continue-as-new): its `run_started` and `capability_catalog`
            were published by the first run and are not repeated.
        defers: Events may ride with the next activity (`CARRY_PATCH_ID`; false while replaying a history recorded
            before it, which wrote each through `PUBLISH_ACTIVITY`).
        before: Rows to store before the next activity's own events, not known stored yet (no activity carrying
            them succeeded).
        after: Rows to store once the next append activity succeeded, and whether the stream closes with them.
        handed: `(activity handle, rows it carries before, whether it carries `after`)` of each carrying activity
            not settled yet.
        late: Closing events too large to carry (`CARRY_MAX_BYTES`), and whether the stream closes with them:
            written by `finish` once the append succeeded (`LATE_CLOSING_PATCH_ID`).
    """

    agent: str = ''
    continued: bool = False
    before: list[list[Any]] = field(default_factory=list)
    after: tuple[list[list[Any]], bool] | None = None
    handed: list[tuple[Any, list[list[Any]], bool]] = field(default_factory=list)
    late: tuple[list[list[Any]], bool] | None = None

    def _rows(self, items: list[Any]) -> list[list[Any]]:
        return [[i.unit, i.attempt, i.seq, i.kind, i.body] for i in items
                if not (self.continued and i.kind in _OPENING_KINDS)]

    async def write(self, items: list[Any], *, close: bool = False, carry: str | None = None) -> None:
        if self.failed:
            return
        rows = self._rows(items)
        if carry is not None and self.defers and len(to_json(rows, fallback=repr)) <= CARRY_MAX_BYTES:
            if carry == 'after':
                self.after = (rows, close)
            else:
                self.before += rows
            return
        if carry == 'after' and self.defers and _patches.patched(LATE_CLOSING_PATCH_ID):
            # Too large to carry: written once the append succeeded (`finish`), never before it (they say the turn
            # is stored); an append that fails leaves them unwritten and the stream open for `run_failed`.
            self.late = (rows, close)
            return
        await self._now(rows, close)

    async def _now(self, rows: list[list[Any]], close: bool) -> None:
        """Write the unconfirmed `before` rows, then `rows`, through `PUBLISH_ACTIVITY` (none: nothing scheduled)."""
        self._settle()
        rows = [*self.before, *rows]
        if close:
            self.late = None  # the stream ends with `rows` (`run_failed`): the turn's closing events never are
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
        self.before = []

    def settle(self) -> None:
        """Before the workflow publishes (`streams.publish_run`): settle the carrying activities (`_settle`). The
        closing events of a failed append reopen the stream for `run_failed` only behind `FAILED_APPEND_PATCH_ID`: a
        history recorded before it replays with the stream left closed (no local activity)."""
        failed_after = any(after and handle.done() and (handle.cancelled() or handle.exception() is not None)
                           for handle, _rows, after in self.handed)
        if failed_after and not _patches.patched(FAILED_APPEND_PATCH_ID):
            return
        self._settle()
        if self.late is not None:  # its closing events are not written yet: only `run_failed` can come now
            self.closed = False

    def _settle(self) -> None:
        """Forget the `before` rows of each carrying activity that succeeded (they are stored); an `after` whose
        activity failed was not stored, and the stream is open again."""
        for entry in list(self.handed):
            handle, rows, after = entry
            if not handle.done():
                continue
            self.handed.remove(entry)
            if not handle.cancelled() and handle.exception() is None:
                self.before = [row for row in self.before if row not in rows]
            elif after:
                self.closed = False

    def hand_over(self, activity_type: str) -> dict[str, Any] | None:
        """In `CarryStreamEvents`, as the workflow starts activity `activity_type`: the header value (`CARRY_HEADER`)
        of what it carries (a model request: the `before` rows; an append: those and `after`), `None`: nothing."""
        if not self.defers or self.failed:
            return None
        append = activity_type.endswith(CONVERSATION_APPEND_SUFFIX)
        if not (append or activity_type.endswith(MODEL_REQUEST_ACTIVITIES)):
            return None
        self._settle()
        after = self.after if append else None
        if not self.before and after is None:
            return None
        if after is not None:
            self.after = None
        return {'agent': self.agent, 'before': list(self.before), 'after': after[0] if after else [],
                'close': bool(after and after[1])}

    async def finish(self) -> None:
        """At the end of the workflow's turn (or before it continues as new): write what no activity carried (an
        `after` no append took, `before` rows no activity stored)."""
        if not self.defers or self.failed:
            return
        self._settle()
        after, self.after = self.after, None
        if after is None and self.late is not None:  # too large to carry: written now that the append succeeded
            after, self.late = self.late, None
        if self.before or after is not None:
            await self._now(after[0] if after else [], bool(after and after[1]))


def workflow_stream(agent: DurableAgent[Any, Any], continued_seq: int | None) -> WorkflowStream | None:
    """In workflow code, at the start of the run: the run's `WorkflowStream`, or `None` for a run recorded before
    streams (`patched(STREAMS_PATCH_ID)` is false while replaying its history).

    Args:
        agent: The run's agent.
        continued_seq: For a continued run, the next sequence number of the earlier runs' own events.
    """
    if not _patches.patched(STREAMS_PATCH_ID):
        return None
    stream = WorkflowStream(workflow.info().workflow_id, ENGINE, None, seq=continued_seq or 0,  # type: ignore[arg-type]
                            agent=agent.durable_name, continued=continued_seq is not None)
    stream.defers = _patches.patched(CARRY_PATCH_ID)
    return stream


class CarryStreamEvents(Interceptor):
    """Worker (and replayer) interceptor, workflow side: a model request or conversation append activity the
    workflow starts carries the workflow's own stream events that can wait (`WorkflowStream.hand_over`) in its
    header `CARRY_HEADER`; `PublishFromActivities` stores them in the worker. A worker or replayer without it runs
    a workflow's stream events through `PUBLISH_ACTIVITY` instead: another command sequence, so `make_worker` and
    `HistoryReplayer` both install it."""

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        return _CarryInbound


class _CarryOutbound(WorkflowOutboundInterceptor):
    def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
        stream = streams.current_stream()
        carried = stream.hand_over(input.activity) if isinstance(stream, WorkflowStream) else None
        if carried is None:
            return self.next.start_activity(input)
        input.headers = {**input.headers, CARRY_HEADER: Payload(metadata={'encoding': b'json/plain'},
                                                                data=to_json(carried, fallback=repr))}
        handle = self.next.start_activity(input)
        stream.handed.append((handle, carried['before'], bool(carried['after'] or carried['close'])))  # type: ignore[union-attr]
        return handle


class _CarryInbound(WorkflowInboundInterceptor):
    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        super().init(_CarryOutbound(outbound))


class PublishFromActivities(Interceptor):
    """Worker interceptor: each model request activity of `agents` runs inside `streams.publishing` on its
    workflow's stream, with the activity's attempt; an activity carrying its workflow's own events (`CARRY_HEADER`)
    stores them: those to go first with the model request's first write (or before the activity runs), those to go
    after once it succeeded (see the module docstring).

    Args:
        store: The worker's conversation store (`None`: `$DURCAP_STORE`, else the default store).
        activity_agents: `{model request activity type: agent}` (from the agents' durable names).
        agents: The agents the worker serves (the store of a carrying activity's agent, by durable name).
    """

    def __init__(self, store: str | None, activity_agents: Mapping[str, DurableAgent[Any, Any]],
                 agents: Sequence[DurableAgent[Any, Any]] = ()):
        self.store, self.activity_agents = store, dict(activity_agents)
        self.by_name = {agent.durable_name: agent for agent in [*agents, *activity_agents.values()]}

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _Publishing(next, self)


def _carried(input: ExecuteActivityInput) -> dict[str, Any] | None:
    payload = (input.headers or {}).get(CARRY_HEADER)
    return json.loads(payload.data) if payload is not None else None


async def _store_carried(url: str, run_id: str, rows: list[list[Any]], close: bool) -> None:
    """Store a workflow's carried events (keys already stored are skipped), awaited; a store that cannot be written
    stops the stream (one warning), never the activity."""
    try:
        await EventLog(url).append(run_id, ENGINE, [Item(*row) for row in rows], close=close)
    except Exception as error:  # noqa: BLE001 - the run goes on without its stream
        _logger.warning('run %s: its event stream stops here (the store could not be written: %s: %s); the run '
                        'goes on', run_id, type(error).__name__, str(error).splitlines()[0] if str(error) else '')


class _Publishing(ActivityInboundInterceptor):
    def __init__(self, next: ActivityInboundInterceptor, owner: PublishFromActivities):
        super().__init__(next)
        self.owner = owner

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        agent = self.owner.activity_agents.get(info.activity_type)
        if not info.workflow_id:
            return await self.next.execute_activity(input)
        carried = _carried(input)
        if agent is None:
            if carried is None:
                return await self.next.execute_activity(input)
            return await self._carrying(input, carried, info.workflow_id)
        url = store_url(agent, self.owner.store)
        # The model request checks whether a newer turn asked the workflow's turn to stop (`interrupts`): a workflow
        # without a conversation holds no claim, and the check reads nothing for it.
        with streams.publishing(info.workflow_id, ENGINE, url, attempt=info.attempt) as context, \
                interrupts.watching(info.workflow_id, url):
            if context is None or carried is None:
                return await self.next.execute_activity(input)
            context.carried = [Item(*row) for row in carried['before']]
            try:
                result = await self.next.execute_activity(input)
            finally:
                if context.carried:  # the request wrote no event of its own
                    rows, context.carried = context.carried, []
                    await _store_carried(url, info.workflow_id, [[i.unit, i.attempt, i.seq, i.kind, i.body]
                                                                 for i in rows], False)
            if carried['after'] or carried['close']:
                await _store_carried(url, info.workflow_id, carried['after'], carried['close'])
            return result

    async def _carrying(self, input: ExecuteActivityInput, carried: dict[str, Any], run_id: str) -> Any:
        """An activity other than a model request (the conversation append) carrying its workflow's events."""
        if not enabled():
            return await self.next.execute_activity(input)
        agent = self.owner.by_name.get(carried.get('agent', ''))
        url = store_url(agent, self.owner.store) if agent is not None else resolve_url(self.owner.store)
        if carried['before']:
            await _store_carried(url, run_id, carried['before'], False)
        result = await self.next.execute_activity(input)
        if carried['after'] or carried['close']:
            await _store_carried(url, run_id, carried['after'], carried['close'])
        return result


def model_request_activities(agents: Sequence[DurableAgent[Any, Any]], names: Any) -> dict[str, DurableAgent[Any, Any]]:
    """`{model request activity type: agent}` of `agents`, from `names(agent)['activities']` (`durable_names`)."""
    return {name: agent for agent in agents for name in names(agent)['activities']
            if name.endswith(MODEL_REQUEST_ACTIVITIES)}
