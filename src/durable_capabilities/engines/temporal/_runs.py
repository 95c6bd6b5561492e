"""Temporal, operator side: the runs (`durcap runs list|show|cancel|resume`) and the approvals (`durcap approvals`)
of `durcap.*` workflows, read and driven from a client.

`TemporalAdapter` (its `operator`) delegates to these functions: the shared operator methods of `EngineAdapter`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import replace
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowUpdateFailedError, WorkflowUpdateRPCTimeoutOrCancelledError
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from ...approvals import (
    ApprovalError,
    Decision,
    DecisionNotDeliveredError,
    PendingCall,
    already_decided,
    check_decision,
    decision_wait,
    utc_now,
)
from ...report import RunReport
from .._adapter import (
    RunInfo,
    RunNotFoundError,
    RunOptions,
    RunState,
    RunStates,
    RunUnit,
    loaded_capabilities_in,
    unit_kind,
)
from ._client import await_result, connect, task_queue_pollers
from ._history import units_recorded
from ._spec import (
    CAPABILITIES_MEMO,
    DECIDE_UPDATE,
    DEFAULT_ADDRESS,
    DEFAULT_NAMESPACE,
    ENGINE,
    PENDING_MEMO,
    WORKFLOW_NAME_PREFIX,
)
from ._versioning import WorkerVersion
from ._worker import make_worker, worker_version
from ._workflow import AgentRunInput, AgentRunOutput

if TYPE_CHECKING:
    from ...agent import DurableAgent

logger = logging.getLogger('durable_capabilities.temporal')

_TEMPORAL_STATUS = {
    'RUNNING': 'running', 'COMPLETED': 'completed', 'FAILED': 'failed', 'CANCELED': 'cancelled',
    'TERMINATED': 'cancelled', 'CONTINUED_AS_NEW': 'running', 'TIMED_OUT': 'failed',
}
_STATUS_QUERY = {'running': "ExecutionStatus = 'Running'", 'completed': "ExecutionStatus = 'Completed'",
                 'failed': "(ExecutionStatus = 'Failed' OR ExecutionStatus = 'TimedOut')",
                 'cancelled': "(ExecutionStatus = 'Canceled' OR ExecutionStatus = 'Terminated')"}


# ---- approvals (`durcap approvals`) -------------------------------------------------------------------


async def pending_approvals(settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
    """Pending calls from the `PENDING_MEMO` memo of running `durcap.*` workflows (no worker needed)."""
    client = await connect(settings.get('address') or DEFAULT_ADDRESS, settings.get('namespace') or DEFAULT_NAMESPACE,
                           store=settings.get('store'))
    if run_id is not None:
        return await _memo_pending(client.get_workflow_handle(run_id))
    calls: list[PendingCall] = []
    async for execution in client.list_workflows("ExecutionStatus = 'Running'"):
        if execution.workflow_type.startswith(WORKFLOW_NAME_PREFIX):
            try:
                memo = await execution.memo()
            except Exception as exc:  # noqa: BLE001 - one unreadable run never hides the others' pending calls
                # e.g. a memo stored by claim check in a store this client does not use (CorruptedRowError)
                logger.warning('temporal workflow %s: its pending calls cannot be read (%s: %s); skipped',
                               execution.id, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else '')
                continue
            calls += [PendingCall.from_json({**d, 'engine': ENGINE}) for d in memo.get(PENDING_MEMO) or []]
    return calls


DECISION_GRACE_SECONDS = 10.0
"""How long before its command gives up a decision expires (`not_after`; at most a third of the wait): a worker that
accepted the decision just in time answers within it, so the command never reports "not delivered" for a delivered
decision."""


async def decide(run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
    """Check `decision` against the memo, then send the `DECIDE_UPDATE` update (its validator checks again).

    An update waits for a worker to accept it. So that a decision never blocks silently, and never reaches the run
    later, after its command gave up (killed, or out of patience), the decision is refused before it is sent when
    no worker polls the run's task queue, and the command gives up `approvals.decision_wait()` seconds after it
    started; the decision carries a `not_after` `DECISION_GRACE_SECONDS` (at most a third of the wait) before that,
    after which the workflow's validator refuses it (`approvals.check_not_expired`).

    Raises:
        ApprovalError: unknown run (no such workflow, or not waiting), unknown call, stale fingerprint.
        AlreadyDecidedError: DC054, the run accepted a decision on the call already (`_earlier_decision`: its
            history holds it); nothing sent.
        DecisionNotDeliveredError: DC052, no worker polls the task queue (`no-worker`, nothing sent), or none accepted
            the decision in time (`not-delivered`: it expires and is never delivered).
        InputError: DC040, `$DURCAP_DECISION_WAIT` is not a number of seconds above 0 (nothing sent).
    """
    wait = decision_wait()
    started = asyncio.get_running_loop().time()
    client = await connect(settings.get('address') or DEFAULT_ADDRESS, settings.get('namespace') or DEFAULT_NAMESPACE,
                           store=settings.get('store'))
    handle = client.get_workflow_handle(run_id)
    pending = await _memo_pending(handle)
    if all(call.call_id != decision.call_id for call in pending):
        await _refuse_if_decided(client, handle, decision.call_id)
    if not pending:
        raise ApprovalError('unknown-run', f'Temporal workflow {run_id!r} is not waiting for approval')
    check_decision(pending, decision, run_id)
    queue = (await handle.describe()).task_queue
    if not await task_queue_pollers(client, client.namespace, queue):
        raise DecisionNotDeliveredError('no-worker', (
            f'DC052 run {run_id!r} waits on Temporal task queue {queue!r}, which no worker polls: the decision was not '
            f'sent. Fix: start `durcap worker temporal TARGET --task-queue {queue}`, then decide again.'))
    # The command gives up `wait` s after it started (as documented), the reads above included: the run refuses the
    # decision after `not_after`, a margin (`DECISION_GRACE_SECONDS`, at most a third of the wait) before that, so a
    # worker that accepts it just in time still answers within the wait. Before, the command waited the whole wait
    # after the reads and the margin on top (~40 s by default under load).
    left = max(0.0, wait - (asyncio.get_running_loop().time() - started))
    margin = min(DECISION_GRACE_SECONDS, wait / 3)
    not_after = (utc_now() + timedelta(seconds=max(left - margin, 0.0))).isoformat()
    try:
        result = await asyncio.wait_for(
            handle.execute_update(DECIDE_UPDATE, replace(decision, not_after=not_after).to_json(), result_type=dict),
            max(left, margin))
    except (TimeoutError, WorkflowUpdateRPCTimeoutOrCancelledError):  # the SDK's form of a cancelled wait
        raise DecisionNotDeliveredError('not-delivered', (
            f'DC052 run {run_id!r}: no worker on Temporal task queue {queue!r} accepted the decision within {wait:g} s; '
            f'it expires at {not_after} and the run will refuse it if it arrives later (the call is still pending). '
            f'Fix: check the workers (`durcap runs show {run_id}`), then decide again.')) from None
    except WorkflowUpdateFailedError as exc:
        cause = exc.cause
        if isinstance(cause, ApplicationError) and cause.type == DecisionNotDeliveredError.__name__:
            raise DecisionNotDeliveredError('expired', str(cause.message)) from None
        await _refuse_if_decided(client, handle, decision.call_id)  # another decision was accepted meanwhile
        raise ApprovalError('unknown-call', f'run {run_id!r} refused the decision: {exc.cause}') from None
    return PendingCall.from_json(result)


async def _refuse_if_decided(client: Client, handle: Any, call_id: str) -> None:
    """Raise `approvals.already_decided` (DC054) when the run accepted a decision on `call_id` (`_earlier_decision`)."""
    earlier = await _earlier_decision(client, handle, call_id)
    if earlier is not None:
        raise already_decided(handle.id, call_id, earlier)


async def _earlier_decision(client: Client, handle: Any, call_id: str) -> Decision | None:
    """The decision on `call_id` the workflow accepted: the `DECIDE_UPDATE` update whose
    `WorkflowExecutionUpdateAccepted` event is in its history (a rejected update leaves no event), else `None` (no
    such workflow, or no decision on that call). Read only when a decision is refused, so the history's length
    costs nothing on the decision's own path."""
    try:
        async for event in handle.fetch_history_events():
            if event.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED:
                continue
            update = event.workflow_execution_update_accepted_event_attributes.accepted_request.input
            if update.name != DECIDE_UPDATE:
                continue
            try:
                (data,) = await client.data_converter.decode(update.args.payloads, [dict])
            except Exception:  # noqa: BLE001, S112 - not a decision this version can read
                continue
            if isinstance(data, dict) and data.get('call_id') == call_id:
                return Decision.from_json(data)
    except RPCError:
        return None
    return None


# ---- runs (`durcap runs`) ------------------------------------------------------------------------------


async def _connect(settings: Mapping[str, Any]) -> Client:
    return await connect(settings.get('address') or DEFAULT_ADDRESS, settings.get('namespace') or DEFAULT_NAMESPACE,
                           store=settings.get('store'))


async def _info(client: Client, description: Any, with_history: bool = True, with_units: bool = False,
                settings: Mapping[str, Any] | None = None) -> RunInfo:
    workflow_type = description.workflow_type or ''
    agent = workflow_type[len(WORKFLOW_NAME_PREFIX):] if workflow_type.startswith(WORKFLOW_NAME_PREFIX) else None
    engine_status = description.status.name if description.status is not None else 'UNKNOWN'
    notes: list[str] = []
    try:
        memo = await description.memo()
    except Exception as exc:  # noqa: BLE001 - one unreadable run never hides the others from `runs list`
        # e.g. a memo stored by claim check in a store this client does not use (CorruptedRowError)
        memo = {}
        notes.append(f'its memo cannot be read with this store ({type(exc).__name__}): it was started through '
                     'another conversation store; pass that one with --store to see its capabilities and pending calls')
    caps = list(memo.get(CAPABILITIES_MEMO) or [])
    units_done, conversation = None, None
    units: dict[int, RunUnit] = {}  # by the ActivityTaskScheduled event id
    # A running workflow has no result and no memo yet: its units' outputs say what it loaded so far.
    track = with_units or (not caps and engine_status == 'RUNNING')
    if with_history:
        units_done = 0
        handle = client.get_workflow_handle(description.id, run_id=description.run_id)
        async for event in handle.fetch_history_events():
            if track:
                await _track_unit(client, event, units)
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
                units_done += 1
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
                payloads = event.workflow_execution_started_event_attributes.input.payloads
                if payloads:
                    try:
                        (params,) = await client.data_converter.decode(payloads, [AgentRunInput])
                        conversation = params.conversation_id
                    except Exception:  # noqa: BLE001, S110 - not a durcap input: nothing to show
                        pass
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED and not caps:
                payloads = event.workflow_execution_completed_event_attributes.result.payloads
                try:
                    (output,) = await client.data_converter.decode(payloads, [AgentRunOutput])
                    caps = loaded_capabilities_in([output.new_messages])
                except Exception:  # noqa: BLE001, S110 - not a durcap result: no capabilities to show
                    pass
    if not caps and units:
        caps = list(dict.fromkeys(c for unit in units.values() for c in unit.capabilities))
    pinned = _pinned_version(description)
    if pinned and engine_status == 'RUNNING':
        notes.append(f'pinned to worker version {pinned["deployment_name"]}/{pinned["build_id"]}: only a worker of '
                     'that build id takes its tasks (the code that started it: the same durable names give the same '
                     'build id; `durcap runs resume --target TARGET` serves it as that version)')
    if engine_status == 'RUNNING':
        try:
            if not await task_queue_pollers(client, client.namespace, description.task_queue):
                # The server the caller named goes into the commands, so they reach the same run.
                at = f' --address {settings["address"]}' if settings and settings.get('address') else ''
                notes.append(f'no worker polls task queue {description.task_queue!r}: start `durcap worker temporal '
                             f'TARGET{at} --task-queue {description.task_queue}` or `durcap runs resume {description.id} '
                             f'--engine temporal{at} --target TARGET`')
        except Exception:  # noqa: BLE001, S110 - a hint only
            pass
    return RunInfo(
        ENGINE, description.id, agent, _TEMPORAL_STATUS.get(engine_status, 'running'), engine_status,
        description.start_time, caps, conversation, units_done, notes,
        {'task_queue': description.task_queue, 'run_id': description.run_id, 'workflow_type': workflow_type,
         **({'worker_version': pinned} if pinned else {})},
        list(units.values()) if with_units else [],
    )


def _pinned_version(description: Any) -> dict[str, str] | None:
    """`{'deployment_name', 'build_id'}` of the worker version the run is pinned to (Worker Versioning's
    `versioning_info`, PINNED behaviour), or `None`: unversioned, auto-upgrade, or no workflow task done yet."""
    from temporalio.api.enums.v1 import VersioningBehavior

    raw = getattr(description, 'raw_description', None)  # describe(); a listed execution has `raw_info`
    execution = raw.workflow_execution_info if raw is not None else getattr(description, 'raw_info', None)
    info = execution.versioning_info if execution is not None and execution.HasField('versioning_info') else None
    if info is None or info.behavior != VersioningBehavior.VERSIONING_BEHAVIOR_PINNED:
        return None
    version = info.deployment_version
    if not version.build_id:
        return None
    return {'deployment_name': version.deployment_name, 'build_id': version.build_id}


async def list_runs(settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
    client = await _connect(settings)
    if status in ('queued', 'orphaned'):
        # Temporal has no queued state (a run waiting for a worker is Running) and no orphaned one (any worker polling
        # the task queue takes a run whose worker died).
        return []
    query = f"WorkflowType STARTS_WITH '{WORKFLOW_NAME_PREFIX}'"
    if status:
        query += f' AND {_STATUS_QUERY[status]}'
    found = [d async for d in client.list_workflows(query, limit=limit)]
    return [await _info(client, d, settings=settings) for d in found]


async def show_run(run_id: str, settings: Mapping[str, Any]) -> RunInfo:
    client = await _connect(settings)
    try:
        description = await client.get_workflow_handle(run_id).describe()
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise RunNotFoundError(f'no Temporal workflow {run_id!r} in namespace {client.namespace!r}') from None
        raise
    return await _info(client, description, with_units=True, settings=settings)


async def cancel(run_id: str, settings: Mapping[str, Any]) -> RunInfo:
    """Request cancellation; when no worker polls the run's task queue (nobody would act on the request),
    terminate it instead."""
    info = await show_run(run_id, settings)
    client = await _connect(settings)
    handle = client.get_workflow_handle(run_id)
    if info.status in ('running', 'queued'):
        if await task_queue_pollers(client, client.namespace, info.detail['task_queue']):
            await handle.cancel()
            for _ in range(50):
                status = (await handle.describe()).status
                if status is not None and status.name != 'RUNNING':
                    break
                await asyncio.sleep(0.2)
        else:
            await handle.terminate(reason='durcap runs cancel: no worker polls its task queue')
    return await show_run(run_id, settings)


async def delete_run(run_id: str, settings: Mapping[str, Any]) -> None:
    """Delete the workflow's executions and their histories (Temporal's DeleteWorkflowExecution; a running one is
    terminated first by the server)."""
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.workflowservice.v1 import DeleteWorkflowExecutionRequest

    client = await _connect(settings)
    try:
        await client.workflow_service.delete_workflow_execution(DeleteWorkflowExecutionRequest(
            namespace=client.namespace, workflow_execution=WorkflowExecution(workflow_id=run_id)))
    except RPCError as exc:
        if exc.status == RPCStatusCode.NOT_FOUND:
            raise RunNotFoundError(f'no Temporal workflow {run_id!r} in namespace {client.namespace!r}') from None
        raise


_DESCRIBE_CONCURRENCY = 16
"""Workflows described at once by `run_states`."""


async def run_states(run_ids: Sequence[str], settings: Mapping[str, Any]) -> RunStates:
    """Each workflow's latest execution as DescribeWorkflowExecution reports it (strongly consistent, unlike the
    visibility listing, which a just-started workflow may not be in yet), and the namespace's retention period
    (DescribeNamespace). A workflow id the namespace no longer has (deleted, or past retention) is left out."""
    from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest

    client = await _connect(settings)
    namespace = await client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=client.namespace))
    ttl = namespace.config.workflow_execution_retention_ttl
    retention = ttl.ToTimedelta() if ttl.seconds or ttl.nanos else None
    gate = asyncio.Semaphore(_DESCRIBE_CONCURRENCY)

    async def state(run_id: str) -> RunState | None:
        async with gate:
            try:
                description = await client.get_workflow_handle(run_id).describe()
            except RPCError as exc:
                if exc.status == RPCStatusCode.NOT_FOUND:
                    return None
                raise
        status = description.status.name if description.status is not None else 'RUNNING'
        if status == 'RUNNING' or description.close_time is None:
            return RunState(run_id, True)
        return RunState(run_id, False, description.close_time.astimezone(UTC))

    found = await asyncio.gather(*(state(run_id) for run_id in dict.fromkeys(run_ids)))
    where = f'namespace {client.namespace!r} at {settings.get("address") or DEFAULT_ADDRESS}'
    return RunStates(ENGINE, where, retention, {s.run_id: s for s in found if s is not None})


async def resume(run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
    """Wait for the run; with `agents` (`runs resume --target`), serve its task queue from this process until it
    finishes, whether or not a poller is listed (Temporal keeps listing a killed worker as a poller for a while).
    Without `agents`: say which queue has no worker, or wait for the worker that polls it.

    A run pinned to a worker version (started by a versioned `durcap worker temporal`) takes tasks only from a
    worker of that version, so the worker served here declares the run's version: when `agents` give that build
    id (the same durable names; or the `build_id` setting names it), it is served as that version, without
    making it the deployment's current one. An unversioned worker would wait for ever (issue 29 item 2).

    Raises:
        RuntimeError: no worker polls the run's queue and no TARGET was given; or the run is pinned to a build id
            `agents` do not give (the message names both and the way out).
    """
    info = await show_run(run_id, options.settings)
    address = options.setting('address', DEFAULT_ADDRESS)
    namespace = options.setting('namespace', DEFAULT_NAMESPACE)
    store = options.setting('store')
    client = await connect(address, namespace, store=store)
    queue = info.detail['task_queue']

    async with AsyncExitStack() as stack:
        if info.status in ('running', 'queued'):
            pollers = await task_queue_pollers(client, namespace, queue)
            if agents:
                version = _resume_version(run_id, info, agents, options.setting('build_id'))
                # Served from here even when a poller is listed: Temporal lists a worker killed with SIGKILL as a
                # poller for a while after it died, and a second worker on the queue is harmless.
                seen = f' ({pollers} other poller(s) seen recently)' if pollers else ''
                as_version = f' as worker version {version}' if version else ''
                options.notify(f'{"no worker polls" if not pollers else "serving"} task queue {queue!r}'
                               f'{": serving it" if not pollers else seen}{as_version} from this process until '
                               f'{run_id} finishes')
                await stack.enter_async_context(make_worker(client, agents, queue, store=store, version=version))
            elif not pollers:
                raise RuntimeError(f'no worker polls task queue {queue!r}: start `durcap worker temporal TARGET '
                                   f'--task-queue {queue}`, or pass --target TARGET to serve it from here')
            else:
                options.notify(f'a worker polled task queue {queue!r} recently: waiting for it to finish {run_id} '
                               '(if that worker is gone, stop this and pass --target TARGET to serve the queue from here)')
        client, result = await await_result(client, address, namespace, run_id, options.notify)
        units = await units_recorded(client, run_id, None)
    return RunReport(ENGINE, run_id, result.output, result.messages(), result.usage, units)


def _resume_version(run_id: str, info: RunInfo, agents: Sequence[DurableAgent[Any, Any]],
                    build_id: str | None) -> WorkerVersion | None:
    """The worker version `runs resume --target` serves the run as: `None` for an unpinned run, else the run's own
    version when `agents` derive its build id (or `build_id` names it).

    Raises:
        RuntimeError: the run is pinned to a build id that `agents` do not derive and `build_id` does not name.
    """
    pinned = info.detail.get('worker_version')
    if not pinned:
        return None
    deployment, pinned_build = str(pinned['deployment_name']), str(pinned['build_id'])
    derived = worker_version(agents, info.detail['task_queue'], deployment_name=deployment)
    if pinned_build in (derived.build_id, build_id):
        return WorkerVersion(deployment, pinned_build, derived=pinned_build == derived.build_id)
    raise RuntimeError(
        f'run {run_id} is pinned to worker version {deployment}/{pinned_build}: only a worker of that build id takes '
        f'its tasks, and TARGET gives {derived.build_id} (its durable names differ from the code that started the '
        f'run). Resume with the TARGET of that code, or, if the build id was given by hand (--build-id), pass '
        f'--build-id {pinned_build} with the code it names'
    )


async def _track_unit(client: Client, event: Any, units: dict[int, RunUnit]) -> None:
    """Fold one history event into `units` (activities by their scheduled event id): scheduled -> `started`,
    completed -> `done` (with the capabilities its decoded result asked to load), failed / timed out -> `failed`."""
    kind = event.event_type
    if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
        name = event.activity_task_scheduled_event_attributes.activity_type.name
        units[event.event_id] = RunUnit(name, unit_kind(name), 'started', event.event_time.ToDatetime().replace(tzinfo=UTC))
    elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED:
        attrs = event.activity_task_completed_event_attributes
        unit = units.get(attrs.scheduled_event_id)
        if unit is not None:
            unit.status = 'done'
            if unit.kind == 'model request':
                try:
                    unit.capabilities = loaded_capabilities_in(await client.data_converter.decode(attrs.result.payloads))
                except Exception:  # noqa: BLE001, S110 - a result stored by reference: no capabilities to show
                    pass
    elif kind in (EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED, EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT):
        attrs = (event.activity_task_failed_event_attributes if kind == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED
                 else event.activity_task_timed_out_event_attributes)
        if (unit := units.get(attrs.scheduled_event_id)) is not None:
            unit.status = 'failed'


async def _memo_pending(handle: Any) -> list[PendingCall]:
    try:
        description = await handle.describe()
    except RPCError:
        raise ApprovalError('unknown-run', f'no Temporal workflow {handle.id!r}') from None
    if description.status is None or description.status.name != 'RUNNING':
        return []
    memo = await description.memo()
    return [PendingCall.from_json({**d, 'engine': ENGINE}) for d in memo.get(PENDING_MEMO) or []]
