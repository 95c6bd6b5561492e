"""Temporal workflow code: the workflow class per `DurableAgent`, its input and output, the approval gate, the
conversation store activities and continue-as-new.

What runs where (Temporal's own split): the workflow class's `run` (the agent graph, `load_capability`, capability
hooks, the approval wait) is workflow code, deterministic and without I/O; the store activities run in the worker.

Workflow classes are generated into this module's namespace (`DurcapWorkflow_<name>`) and the worker passes
`durable_capabilities` through Temporal's sandbox, so the sandbox finds the class by
`from durable_capabilities.engines._temporal_workflow import DurcapWorkflow_<name>` without re-importing the user's
agent module.

This module never imports `engines.temporal`, which re-exports its public names (`AgentRunInput`, `AgentRunOutput`,
`workflow_class`, `DECIDE_UPDATE`, ...) and builds on them (durability options, worker, client, adapter).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.usage import RunUsage
from pydantic_core import to_jsonable_python
from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError

from .. import _registry
from .._servers import CAPABILITIES_SEARCH_ATTRIBUTE
from ..approvals import ApprovalGate, Decision, PendingCall, check_decision
from ..conversations import LoadedConversation, append_conversation, load_conversation
from ..store import StoreError
from ..turn import current_turn, run_turn
from . import _payload_guard
from ._adapter import loaded_capabilities_in
from ._payload_guard import current_run as _current_run

if TYPE_CHECKING:
    from ..agent import DurableAgent

WORKFLOW_NAME_PREFIX = 'durcap.'
"""Workflow type name: `durcap.{agent name}`. Compatibility data, listed in `durable.lock`."""


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

CAPABILITIES_MEMO = 'durcap_capabilities'
"""Memo key holding a run's loaded capability ids."""
