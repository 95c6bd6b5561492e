"""Temporal's client side: `connect` (with the claim-check codec), `start_run` / `run`, and the waits of `durcap run`
(no worker polling the task queue, the result through server restarts)."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_core import to_jsonable_python
from temporalio.api.enums.v1 import (
    PendingActivityState,
    PendingWorkflowTaskState,
    TaskQueueType,
    WorkflowExecutionStatus,
)
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflowservice.v1 import DescribeTaskQueueRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from ..._limits import InputError, redact_database_url
from .._adapter import EngineUnreachableError
from .._stall import Progress, WaitingForWorker, notice_stalls
from ._payloads import default_data_converter
from ._spec import (
    AGENT_MEMO,
    CAPABILITIES_SEARCH_ATTRIBUTE,
    CONNECT_TIMEOUT_ENV,
    CONNECT_TIMEOUT_SECONDS,
    DEFAULT_ADDRESS,
    DEFAULT_NAMESPACE,
    HEALTH_TIMEOUT_SECONDS,
    NO_POLLER_NOTICE_SECONDS,
    RECONNECT_SECONDS,
    SEARCH_ATTRIBUTE_MEMO,
)
from ._workflow import AgentRunInput, AgentRunOutput, workflow_name

if TYPE_CHECKING:
    from ...agent import DurableAgent


async def connect(address: str = DEFAULT_ADDRESS, namespace: str = DEFAULT_NAMESPACE, *, store: str | None = None) -> Client:
    """A Temporal client with pydantic-ai's payload converter (`PydanticAIPlugin`) and the claim-check codec
    (`_payloads.ClaimCheckCodec`) on `store` (the `--store` of the run or worker; `None`: `$DURCAP_STORE`, else the
    default store): payloads over 16 KiB travel by reference. Workers made from this client use the same codec.

    Waits at most `connect_timeout()` seconds (`$DURCAP_TEMPORAL_CONNECT_TIMEOUT`, default 10) for the server to
    answer.

    Raises:
        EngineUnreachableError: no Temporal server answers at `address` (refused, or no answer within the timeout).
        InputError: `$DURCAP_TEMPORAL_CONNECT_TIMEOUT` is not a number of seconds above 0 (DC040).
    """
    codec = default_data_converter(store)  # PydanticAIPlugin keeps it and its codec, swaps the payload converter
    timeout = connect_timeout()
    try:
        return await asyncio.wait_for(
            Client.connect(address, namespace=namespace, plugins=[PydanticAIPlugin()], data_converter=codec), timeout)
    except TimeoutError as exc:
        raise EngineUnreachableError(
            f'no answer from a Temporal server at {address} within {timeout:g} s: something accepts connections there '
            'but does not answer Temporal\'s gRPC (another service, a proxy, or a server still starting). Point '
            f'--address / $DURCAP_TEMPORAL_ADDRESS at the Temporal frontend, or wait longer with ${CONNECT_TIMEOUT_ENV}'
        ) from exc
    except RuntimeError as exc:
        if 'client connect' not in str(exc):
            raise
        # temporalio's message is the Rust transport error's debug form; its `message: "..."` is the readable reason.
        reason = re.findall(r'message: "([^"]+)"', str(exc))
        raise EngineUnreachableError(
            f'cannot reach the Temporal server at {address} ({reason[-1] if reason else str(exc).splitlines()[0][:200]}): '
            'start one (`durcap dev temporal`) or point --address / $DURCAP_TEMPORAL_ADDRESS at yours'
        ) from exc


def connect_timeout() -> float:
    """Seconds `connect` waits for the server: `$DURCAP_TEMPORAL_CONNECT_TIMEOUT` when set, else
    `CONNECT_TIMEOUT_SECONDS` (10).

    Raises:
        InputError: the variable is set to something that is not a number above 0 (DC040; the message names it).
    """
    raw = os.environ.get(CONNECT_TIMEOUT_ENV, '').strip()
    if not raw:
        return CONNECT_TIMEOUT_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = float('nan')
    if not value > 0 or value == float('inf'):
        raise InputError(f'${CONNECT_TIMEOUT_ENV}', f'{raw!r} is not a number of seconds above 0: set it to e.g. 30, '
                         'or unset it for the default (10)')
    return value


def codec_store(client: Client) -> str | None:
    """The store URL of `client`'s claim-check codec (`connect(store=...)`), `None` for a client without one."""
    return getattr(client.data_converter.payload_codec, 'store_url', None)


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
    busy: str | None = None,
) -> Any:
    """Start the agent's workflow; returns the `WorkflowHandle` (await `handle.result()` for `AgentRunOutput`).

    `eager=True` asks for Temporal's eager workflow start (`request_eager_start`): when a worker of this client
    runs in this process and polls `task_queue`, the server hands it the first workflow task in the start
    response instead of through a poll (one round trip less; issue 14 measured 5-14% of a 6-request run on the
    dev server). Without such a worker, or a server that disables it, the start is an ordinary one. Only ask
    for it with a worker in this process: `durcap run --inline-worker` and the embedded dev server do.

    `busy` (`'reject'` | `'enqueue'`, `None`: the agent's `busy`): what the turn does when another run's turn holds
    `conversation_id` (`conversations.claim_turn`).

    The workflow records its loaded capability ids as memo `durcap_capabilities`, and as search attribute
    `DurcapCapabilities` when the namespace has it registered (checked here).
    """

    params = AgentRunInput(
        prompt=prompt,
        conversation_id=conversation_id,
        deps=to_jsonable_python(deps) if deps is not None else None,
        message_history=ModelMessagesTypeAdapter.dump_python(message_history, mode='json') if message_history else None,
        busy=busy,
    )
    memo = {AGENT_MEMO: agent.name, SEARCH_ATTRIBUTE_MEMO: await capabilities_attribute_registered(client, namespace)}
    return await client.start_workflow(
        workflow_name(agent), params, id=workflow_id, task_queue=task_queue, result_type=AgentRunOutput, memo=memo,
        request_eager_start=eager,
    )


async def run(client: Client, agent: DurableAgent[Any, Any], prompt: str | None, **kwargs: Any) -> AgentRunOutput:
    """Start the agent's workflow and wait for its `AgentRunOutput`. Keyword arguments as for `start_run`."""
    handle = await start_run(client, agent, prompt, **kwargs)
    return await handle.result()

async def capabilities_attribute_registered(client: Client, namespace: str) -> bool:
    """Whether the namespace has the `DurcapCapabilities` search attribute (Temporal's ListSearchAttributes)."""
    try:
        response = await client.operator_service.list_search_attributes(ListSearchAttributesRequest(namespace=namespace))
    except Exception:  # noqa: BLE001 - not allowed to ask (cloud): do not upsert
        return False
    return CAPABILITIES_SEARCH_ATTRIBUTE in response.custom_attributes



async def task_queue_pollers(client: Client, namespace: str, task_queue: str) -> int:
    """How many workers polled `task_queue` (workflow tasks) recently (Temporal's DescribeTaskQueue)."""
    response = await client.workflow_service.describe_task_queue(DescribeTaskQueueRequest(
        namespace=namespace, task_queue=TaskQueue(name=task_queue),
        task_queue_type=TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW))
    return len(response.pollers)


def worker_command(task_queue: str, address: str | None = None, store: str | None = None) -> str:
    """The `durcap worker temporal` command line that serves this run: `--address` and `--store` named when given
    (`store` shown without its password), since a worker on another conversation store runs the turn but writes its
    events and messages where `durcap serve` never reads them."""
    where = f' --address {address}' if address else ''
    stored = f' --store {redact_database_url(store)}' if store else ''
    return f'durcap worker temporal TARGET{where} --task-queue {task_queue}{stored}'


async def notice_no_poller(client: Client, namespace: str, task_queue: str, notify: Callable[[str], None],
                           command: str | None = None) -> None:
    """Say, within `NO_POLLER_NOTICE_SECONDS`, when no worker polls `task_queue` (the run waits for one); `command`:
    the worker command the line names (default `worker_command(task_queue)`)."""
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
    said = (f'no worker polls task queue {task_queue!r}: the run waits until one does (start '
            f'`{command or worker_command(task_queue)}`')
    notify(WaitingForWorker(f'{said}, or run with --inline-worker)', api=f'{said}; the run is durable: a worker started '
                            'now runs it)'))


async def notice_no_progress(client: Client, workflow_id: str, task_queue: str, notify: Callable[[str], None],
                             seconds: float, command: str | None = None) -> None:
    """Say once, on `notify`, when the run has waited `seconds` for a worker without progress (`_stall`), and keep
    watching until it ends or this task is cancelled.

    The check is on progress, not on the queue's pollers: a killed worker stays listed as a poller for minutes. The run
    waits for a worker while its workflow task or an activity is SCHEDULED (not taken by any worker; an activity in
    its retry backoff counts from its next attempt's time), and it made no progress while its history length, its
    pending activities' attempts and states and its workflow task's stay the same. A worker killed inside an
    activity shows as that activity SCHEDULED again once its heartbeat timeout passes (1 s for tools, 5 s for model
    requests). The line also says how many pollers the queue lists (DescribeTaskQueue).
    """
    handle = client.get_workflow_handle(workflow_id)

    async def probe() -> Progress:
        raw = (await handle.describe()).raw_description
        info = raw.workflow_execution_info
        if info.status != WorkflowExecutionStatus.WORKFLOW_EXECUTION_STATUS_RUNNING:
            return Progress(None, None, done=True)
        now, waiting = datetime.now(UTC), []
        task = raw.pending_workflow_task
        if (raw.HasField('pending_workflow_task')
                and task.state == PendingWorkflowTaskState.PENDING_WORKFLOW_TASK_STATE_SCHEDULED):
            waiting.append(f'its workflow task (attempt {task.attempt})')
        for activity in raw.pending_activities:
            due = not activity.HasField('scheduled_time') or activity.scheduled_time.ToDatetime(UTC) <= now
            if activity.state == PendingActivityState.PENDING_ACTIVITY_STATE_SCHEDULED and due:
                waiting.append(f'activity {activity.activity_type.name} (attempt {activity.attempt})')
        signature = (info.history_length, (task.state, task.attempt),
                     tuple((a.activity_id, a.attempt, a.state) for a in raw.pending_activities))
        return Progress(signature, ', '.join(waiting) or None)

    async def line(waiting: str, waited: float) -> str:
        try:
            pollers = await task_queue_pollers(client, client.namespace, task_queue)
            listed = (f'{pollers} poller(s) listed on the queue, which can include a killed worker for a few minutes'
                      if pollers else 'no worker polls the queue')
        except Exception:  # noqa: BLE001 - the notice goes out without the count
            listed = 'pollers unknown'
        return (f'still waiting: no worker has picked up run {workflow_id} on task queue {task_queue!r} for '
                f'{waited:g} s ({waiting} scheduled, the history not growing; {listed}): is a worker running? '
                f'`{command or worker_command(task_queue)}` (the run is durable: a worker started now '
                'finishes it)')

    await notice_stalls(probe, line, notify, seconds)


async def await_result(client: Client, address: str, namespace: str, workflow_id: str,
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
                        client = await connect(address, namespace, store=codec_store(client))
                    except Exception:  # noqa: BLE001, S112 - still down: keep trying
                        continue
    finally:
        watch.cancel()



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
    answered = False
    while True:
        await asyncio.sleep(RECONNECT_SECONDS)
        try:
            # The SDK's own retries can keep a call waiting past its timeout while the server is down (seen in CI: a
            # 6 s outage that no check reported); no answer within the timeout is an outage here.
            healthy = await asyncio.wait_for(
                current().service_client.check_health(timeout=timedelta(seconds=HEALTH_TIMEOUT_SECONDS)),
                HEALTH_TIMEOUT_SECONDS + 0.5)
        except RPCError as exc:
            # Only a server that refuses the health service itself stops the watch: a server stopped before the first
            # check passed may end it with CANCELLED or UNKNOWN too (seen in CI: the outage went unreported).
            if not answered and exc.status in (RPCStatusCode.UNIMPLEMENTED, RPCStatusCode.PERMISSION_DENIED,
                                               RPCStatusCode.UNAUTHENTICATED):
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
