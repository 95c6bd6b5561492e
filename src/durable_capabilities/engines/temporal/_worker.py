"""Temporal worker: `make_worker` (the workflows and activities of some agents on a task queue, with durcap's
worker options and interceptors), `run_worker`, the Worker Versioning version a worker declares, and what
`durcap worker temporal` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic_ai.models import infer_model
from temporalio import activity, workflow
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.worker import (
    ActivityInboundInterceptor,
    ActivityOutboundInterceptor,
    ExecuteActivityInput,
    Interceptor,
    StartActivityInput,
    StartLocalActivityInput,
    Worker,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from ... import _upstream, budgets, telemetry
from ..._limits import InputError
from .. import _mcp, _retry_after, _retry_log
from .._adapter import RunOptions
from .._retry_after import MAX_RETRY_AFTER_SECONDS
from . import _patches
from ._client import connect
from ._conversation import conversation_activities
from ._durability import DEFAULT_LOCAL_TOOL_CONFIG, durable_names, sandbox_runner
from ._spec import (
    DEADLOCK_TIMEOUT_ENV,
    DEFAULT_ADDRESS,
    DEFAULT_DEADLOCK_TIMEOUT,
    DEFAULT_NAMESPACE,
    DEFAULT_STICKY_SCHEDULE_TO_START,
    DEFAULT_TASK_QUEUE,
    ENGINE,
    HEARTBEAT_THROTTLE,
    LOCAL_TOOLS_PATCH_ID,
    LOCAL_TOOLSETS_OPTION,
    MODEL_REQUEST_ACTIVITIES,
    WORKFLOW_REVISION,
)
from ._versioning import WorkerVersion, make_current
from ._versioning import worker_version as _worker_version
from ._workflow import workflow_classes

if TYPE_CHECKING:
    from ...agent import DurableAgent

def local_tool_activities(agent: DurableAgent[Any, Any]) -> dict[str, dict[str, Any]]:
    """Activity type name -> local-activity options, for the tool activities of the leaves `agent` marks short
    (`LOCAL_TOOLSETS_OPTION`).

    Raises:
        ValueError: a marked leaf id is not one of the agent's leaf toolsets with tool activities, or is an MCP leaf
            (MCP calls are network calls: never short by contract); the message names the leaf and the ids that fit.
    """
    marked = (agent.engine_options.get(ENGINE) or {}).get(LOCAL_TOOLSETS_OPTION) or {}
    if not marked:
        return {}
    leaves = [leaf for ids in agent.leaf_ids().values() for leaf in ids]
    mcp = set(_mcp.mcp_leaves(agent))
    names = durable_names(agent)['activities']
    found: dict[str, dict[str, Any]] = {}
    for leaf, config in marked.items():
        name = next((n for n in names if n.endswith(f'__toolset__{leaf}__call_tool')), None)
        if leaf not in leaves or leaf in mcp or name is None:
            why = 'is an MCP leaf (never short)' if leaf in mcp else 'is not a leaf toolset with tool activities'
            fits = ', '.join(sorted(set(leaves) - mcp)) or 'none'
            raise ValueError(f'agent {agent.name!r}: engine_options.temporal.{LOCAL_TOOLSETS_OPTION}[{leaf!r}] {why}; '
                             f'leaf ids that fit: {fits}')
        found[name] = {**DEFAULT_LOCAL_TOOL_CONFIG, **(config or {})}
    return found


class LocalToolActivities(Interceptor):
    """Worker interceptor: in workflow code, the start of a marked tool activity (`local_tool_activities`) becomes
    the start of a local activity of the same registered activity, with the leaf's local options. Upstream's
    toolset schedules every tool call as an activity; this is where that choice is made, so upstream's call path
    (argument serialization, cancellation handling) stays as it is. See `LOCAL_TOOLSETS_OPTION` for the trade-offs."""

    def __init__(self, local: Mapping[str, Mapping[str, Any]]):
        self.local = dict(local)

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _NoLocalHeartbeats(next)

    def workflow_interceptor_class(self, input: WorkflowInterceptorClassInput) -> type[WorkflowInboundInterceptor]:
        local = self.local

        class Outbound(WorkflowOutboundInterceptor):
            def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
                config = local.get(input.activity)
                if config is None or not _patches.patched(LOCAL_TOOLS_PATCH_ID):
                    return self.next.start_activity(input)
                return self.next.start_local_activity(StartLocalActivityInput(
                    activity=input.activity, args=input.args, activity_id=input.activity_id,
                    schedule_to_close_timeout=config.get('schedule_to_close_timeout'),
                    schedule_to_start_timeout=None,
                    start_to_close_timeout=config.get('start_to_close_timeout'),
                    retry_policy=config.get('retry_policy'),
                    local_retry_threshold=config.get('local_retry_threshold'),
                    cancellation_type=input.cancellation_type, headers=input.headers, summary=input.summary,
                    arg_types=input.arg_types, ret_type=input.ret_type,
                ))

        class Inbound(WorkflowInboundInterceptor):
            def init(self, outbound: WorkflowOutboundInterceptor) -> None:
                super().init(Outbound(outbound))

        return Inbound


class _NoLocalHeartbeats(ActivityInboundInterceptor):
    """Upstream's tool activity heartbeats from a background task; a local activity cannot heartbeat (the SDK logs
    a warning per beat), so in a local activity the beats are dropped here."""

    def init(self, outbound: ActivityOutboundInterceptor) -> None:
        super().init(_LocalHeartbeatsDropped(outbound))


class _LocalHeartbeatsDropped(ActivityOutboundInterceptor):
    """`_NoLocalHeartbeats`' outbound side (one class for every activity: a class built per activity cost ~0.5% of a
    worker's CPU in `bench_throughput.py`)."""

    def heartbeat(self, *details: Any) -> None:
        if not activity.info().is_local:
            self.next.heartbeat(*details)


def model_request_attempt(record: logging.LogRecord) -> tuple[str, str | None] | None:
    """temporalio's "Completing activity as failed" warning of a model request activity (the streamed request's
    `__model_request_stream` too) as `agent__support__model_request attempt 2`; other activities' failures keep their
    tracebacks (`None`)."""
    info = getattr(record, 'temporal_activity', None) or {}
    if str(info.get('activity_type', '')).endswith(MODEL_REQUEST_ACTIVITIES):
        return f"{info.get('activity_type')} attempt {info.get('attempt')}", None
    return None


_MODEL_RETRY_LOG_LINE = _retry_log.ModelRetryLogLine(model_request_attempt)
"""Installed on the `temporalio.activity` logger by `make_worker`."""


_BACKGROUND: set[asyncio.Task[Any]] = set()


async def _reset_sticky(client: Client, namespace: str, workflow_id: str, run_id: str) -> None:
    try:
        await client.workflow_service.reset_sticky_task_queue(ResetStickyTaskQueueRequest(
            namespace=namespace, execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id)))
    except Exception:  # noqa: BLE001, S110 - a speed-up only: the sticky timeout still moves the task
        pass


class UnstickOnRetry(Interceptor):
    """Worker interceptor: when an activity attempt after the first starts here, reset its workflow's sticky task
    queue (Temporal's ResetStickyTaskQueue), in the background, without delaying the activity.

    Why: a retry usually means the previous attempt's worker died (heartbeat timeout after a SIGKILL). That worker
    also held the workflow on its sticky queue, so the workflow task recording this attempt's result would wait
    `DEFAULT_STICKY_SCHEDULE_TO_START` (measured: ~1 s on the dev server, whatever shorter value is asked) before any
    other worker may take it. Reset, it goes to the normal task queue at once. Trade-off: when the previous attempt
    failed with an exception on a live worker, that worker loses its cached copy and the next workflow task replays
    the history (CPU only; same result). Retries are rare, so this costs little."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _UnstickOnRetry(next)


class _UnstickOnRetry(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        info = activity.info()
        if info.attempt > 1 and not info.is_local and info.workflow_namespace and info.workflow_id and info.workflow_run_id:
            task = asyncio.create_task(_reset_sticky(activity.client(), info.workflow_namespace, info.workflow_id,
                                                     info.workflow_run_id))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
        return await self.next.execute_activity(input)


class RetryAfterCap(Interceptor):
    """Worker interceptor: a model request activity whose provider asked to wait longer than the retry policy's
    `maximum_interval` (`MAX_RETRY_AFTER_SECONDS` by default) fails without another attempt, with one log line saying
    so. pydantic-ai caps the attempt's `next_retry_delay` at `maximum_interval`, so the next attempt would go out
    before the provider's window ends and meet the same refusal; DBOS and Prefect fail such a run the same way."""

    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _RetryAfterCap(next)


class _RetryAfterCap(ActivityInboundInterceptor):
    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        try:
            return await self.next.execute_activity(input)
        except ApplicationError as error:
            info = activity.info()
            seconds = _retry_after.retry_after(error)
            if error.non_retryable or seconds is None or not info.activity_type.endswith(MODEL_REQUEST_ACTIVITIES):
                raise
            policy = info.retry_policy
            cap = ((policy.maximum_interval or policy.initial_interval * 100).total_seconds() if policy is not None
                   else MAX_RETRY_AFTER_SECONDS)
            if seconds <= cap:
                raise
            activity.logger.warning('%s attempt %d failed: %s', info.activity_type, info.attempt,
                                    _retry_after.over_cap_message(error, seconds, cap))
            raise ApplicationError(error.message, *error.details, type=error.type, non_retryable=True) from error.__cause__


def warm_model(model: Any) -> None:
    """Build a model named by a string once in this process, outside any workflow, so the provider SDK's modules
    are imported before the first workflow task. The workflow builds the model from its name (pydantic-ai's
    `infer_model` in workflow code), and a first import of the openai SDK's resource modules there took over 2 s on
    a loaded 2-core machine: Temporal's deadlock detector (TMPRL1101) failed the workflow task with a traceback.
    A model that cannot be built here (no API key) is left for the run to report."""
    if not isinstance(model, str):
        return
    with contextlib.suppress(Exception):
        infer_model(model)


def _telemetry_interceptors() -> list[Any]:
    """The tool span interceptor when telemetry is on (`_telemetry.ToolSpans`), else none."""
    if not telemetry.enabled():
        return []
    from ._telemetry import ToolSpans

    return [ToolSpans()]


def make_worker(
    client: Client, agents: Sequence[DurableAgent[Any, Any]], task_queue: str, *, version: WorkerVersion | None = None,
    store: str | None = None, **worker_kwargs: Any,
) -> Worker:
    """A `temporalio.worker.Worker` registering each agent's workflow and activities on `task_queue`.

    The conversation activities use the store `store` (the worker's `--store`; `None`: `$DURCAP_STORE`, else the
    default store); give `client` the same one (`connect(store=...)`): its codec reads and writes claim checks there.

    With `version` (see `worker_version`), the worker uses Worker Versioning and its workflows are pinned to the
    version that started them. Keyword arguments are passed to `Worker` (ours by default: the sandbox runner,
    `DEFAULT_STICKY_SCHEDULE_TO_START`, `HEARTBEAT_THROTTLE`; `UnstickOnRetry`, `RetryAfterCap` and
    `_streams.PublishFromActivities` and `_streams.CarryStreamEvents` are added to any `interceptors` given). The
    runs publish their event streams to `store` (`_streams`, docs/watching.md): from the model request and append
    activities, and through the local activity `_streams.PUBLISH_ACTIVITY` registered here.
    """
    if version is not None:
        worker_kwargs.setdefault('deployment_config', version.deployment_config())
    worker_kwargs.setdefault('sticky_queue_schedule_to_start_timeout', DEFAULT_STICKY_SCHEDULE_TO_START)
    worker_kwargs.setdefault('max_heartbeat_throttle_interval', HEARTBEAT_THROTTLE)
    from ._streams import (  # the event schemas
        CarryStreamEvents,
        PublishFromActivities,
        model_request_activities,
        publish_activity,
    )

    local = {name: config for agent in agents for name, config in local_tool_activities(agent).items()}
    worker_kwargs['interceptors'] = [*worker_kwargs.get('interceptors', ()), UnstickOnRetry(), RetryAfterCap(),
                                     *([LocalToolActivities(local)] if local else []),
                                     PublishFromActivities(store, model_request_activities(agents, durable_names),
                                                           agents),
                                     CarryStreamEvents(), *_telemetry_interceptors()]
    worker_kwargs.setdefault('workflow_runner', sandbox_runner())
    logging.getLogger('temporalio.activity').addFilter(_MODEL_RETRY_LOG_LINE)  # a set: adding it again is a no-op
    for agent in agents:
        warm_model(agent.model)
    activities = [fn for agent in agents for fn in conversation_activities(agent, store)]
    activities.append(publish_activity(agents, store))
    for agent in agents:  # a budget's ledger: the model request activity receives no store from its workflow
        if agent.budget is not None:
            budgets.set_worker_store(agent, store)
    activities += worker_kwargs.pop('activities', [])
    deadlock = worker_kwargs.pop('deadlock_timeout', None)
    worker = Worker(
        client,
        task_queue=task_queue,
        workflows=[cls for agent in agents for cls in workflow_classes(agent)],
        activities=activities,
        **worker_kwargs,
    )
    _upstream.temporal_set_deadlock_timeout(worker, deadlock_timeout(deadlock))
    return worker


def deadlock_timeout(value: float | None = None) -> float:
    """The deadlock timeout in seconds: `value`, else `$DURCAP_TEMPORAL_DEADLOCK_TIMEOUT`, else
    `DEFAULT_DEADLOCK_TIMEOUT`.

    Raises:
        InputError: not a number of seconds in (0, 600] (DC040, naming the variable).
    """
    raw: Any = value if value is not None else os.environ.get(DEADLOCK_TIMEOUT_ENV)
    if raw is None or raw == '':
        return DEFAULT_DEADLOCK_TIMEOUT
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float('nan')
    if not 0 < seconds <= 600:
        where = f'${DEADLOCK_TIMEOUT_ENV}' if value is None else 'make_worker(deadlock_timeout=...)'
        raise InputError(where, f'{raw!r} is not a number of seconds in (0, 600]; set it to seconds, e.g. '
                                f'{DEFAULT_DEADLOCK_TIMEOUT:g}, or unset it for the default')
    return seconds


async def run_worker(
    agents: Sequence[DurableAgent[Any, Any]],
    *,
    task_queue: str,
    address: str = DEFAULT_ADDRESS,
    namespace: str = DEFAULT_NAMESPACE,
    ready: asyncio.Event | None = None,
    graceful_shutdown_seconds: float = 30.0,
    version: WorkerVersion | None = None,
    set_current: bool = True,
    store: str | None = None,
    concurrency: int | None = None,
) -> None:
    """Run a worker until SIGTERM or SIGINT, then drain: in-flight activities get up to
    `graceful_shutdown_seconds` to finish before the worker stops (Temporal's graceful shutdown).

    With `version`, the worker is versioned (see `make_worker`) and, unless `set_current` is false, makes its
    version the deployment's current one once it polls, before `ready` is set: new runs go to it, runs started
    on another version stay there.

    `store`: the conversation store of the worker's activities and claim-check codec (`None`: `$DURCAP_STORE`,
    else the default store). `concurrency`: activities (model requests, tool calls) this worker runs at once
    (temporalio's `max_concurrent_activities`; `None`: the SDK's default, 100), so a worker at its limit leaves
    the next activities to the other workers of the task queue.
    """
    client = await connect(address, namespace, store=store)
    limits = {'max_concurrent_activities': concurrency} if concurrency else {}
    worker = make_worker(
        client, agents, task_queue, version=version, store=store,
        graceful_shutdown_timeout=timedelta(seconds=graceful_shutdown_seconds), **limits,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        if version is not None and set_current:
            await make_current(client, namespace, version)
        if ready is not None:
            ready.set()
        await stop.wait()


def worker_version(
    agents: Sequence[DurableAgent[Any, Any]], task_queue: str = DEFAULT_TASK_QUEUE, *, deployment_name: str | None = None,
    build_id: str | None = None,
) -> WorkerVersion:
    """The Worker Deployment Version a worker of `agents` on `task_queue` declares.

    Args:
        agents: The definitions the worker serves.
        task_queue: Its task queue; the default deployment name is `durcap-{task queue}`.
        deployment_name: Another deployment name.
        build_id: A build id of your own (a release tag, a commit); default: `durcap-` + 12 hex digits of a
            SHA-256 over the worker's durable names and durcap's workflow revision (`WORKFLOW_REVISION`), so it
            changes when a name in `durable.lock` would or a durcap upgrade changed its workflow's commands (a
            rename declared with `aliases` or `previous_names` keeps it).
    """
    return _worker_version(agents, task_queue, durable_names, deployment_name=deployment_name,
                           build_id_=build_id)


def _version_line(version: WorkerVersion | None, set_current: bool) -> str:
    """What `durcap worker temporal` prints about its version."""
    if version is None:
        return 'worker version: unversioned (--no-versioning): any worker on this task queue may take any task'
    how = (f"derived from the durable names and durcap's workflow revision {WORKFLOW_REVISION}" if version.derived
           else 'given')
    current = ('it is the current version: new runs go to it' if set_current else
               f'not made current (--no-set-current): `temporal worker deployment set-current-version '
               f'--deployment-name {version.deployment_name} --build-id {version.build_id}` to send new runs to it')
    return (f'worker version: deployment {version.deployment_name!r}, build id {version.build_id!r} ({how}); runs '
            f'stay pinned to the version that started them; {current}')


def serve_worker(agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
    """Serve `agents` on a task queue until SIGTERM / SIGINT.

    Settings: `address`, `namespace`, `task_queue`, `store` (conversation store URL of the activities and the
    claim-check codec), `graceful_shutdown` (seconds), `concurrency` (activities at once), `versioning` (default
    true: Worker Versioning, see `worker_version`), `deployment_name`, `build_id`, `set_current` (default
    true: the worker's version becomes the deployment's current version).
    """
    address = options.setting('address', DEFAULT_ADDRESS)
    task_queue = options.setting('task_queue', DEFAULT_TASK_QUEUE)
    version = None
    if options.setting('versioning', True):
        version = worker_version(agents, task_queue, deployment_name=options.setting('deployment_name'),
                                 build_id=options.setting('build_id'))
    set_current = bool(options.setting('set_current', True))

    async def serve() -> None:
        ready = asyncio.Event()
        task = asyncio.create_task(run_worker(
            agents, task_queue=task_queue, address=address, namespace=options.setting('namespace', DEFAULT_NAMESPACE),
            ready=ready, graceful_shutdown_seconds=options.setting('graceful_shutdown', 30.0), version=version,
            set_current=set_current, store=options.setting('store'), concurrency=options.setting('concurrency'),
        ))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            options.notify(f'worker ready: {", ".join(a.name for a in agents)} on task queue {task_queue!r} at {address}')
            options.notify(_version_line(version, set_current))
        await task

    asyncio.run(serve())
