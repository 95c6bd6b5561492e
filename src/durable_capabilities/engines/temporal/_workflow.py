"""Temporal workflow code: the workflow class per `DurableAgent`, its input and output, continue-as-new and the
loaded-capabilities memo.

What runs where (Temporal's own split): the workflow class's `run` (the agent graph, `load_capability`, capability
hooks, the approval wait of `_approvals`) is workflow code, deterministic and without I/O; the store activities of
`_conversation` run in the worker.

Workflow classes are generated into this module's namespace (`DurcapWorkflow_<name>`) and the worker passes
`durable_capabilities` through Temporal's sandbox, so the sandbox finds the class by
`from durable_capabilities.engines.temporal._workflow import DurcapWorkflow_<name>` without re-importing the user's
agent module.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.usage import RunUsage
from pydantic_core import to_jsonable_python
from temporalio import workflow
from temporalio.common import SearchAttributeKey
from temporalio.exceptions import ActivityError

from ... import _registry
from ...report import usage_from_json
from ...store import StoreError
from ...turn import current_turn, run_turn
from .._adapter import loaded_capabilities_in
from . import _patches, _payloads
from ._approvals import TemporalApprovalGate, approval_handlers
from ._conversation import AppendInput, append_activity, workflow_units
from ._payloads import current_run as _current_run
from ._spec import (
    CAPABILITIES_MEMO,
    CAPABILITIES_PATCH_ID,
    CAPABILITIES_SEARCH_ATTRIBUTE,
    SEARCH_ATTRIBUTE_MEMO,
    WORKFLOW_CLASS_PREFIX,
    workflow_type,
)

if TYPE_CHECKING:
    from ...agent import DurableAgent

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
    busy: str | None = None


@dataclass
class ContinuedRun:
    """Carried by continue-as-new so the final result covers the whole run, not only its last part.

    Attributes:
        new_from: Index in the new run's starting history where this agent run's own messages begin (valid
            across compactions: the stored and the carried histories only grow).
        usage: Usage of the earlier parts.
        summaries: Compaction summaries (message JSON) the earlier parts wrote with no place yet in the stored
            or carried messages (`TurnLog.split`: a tool call was waiting at every point after them); the new run
            stores them where they fit (`run_turn(carried=)`). Empty in inputs recorded before this field.
        stream_seq: The next sequence number of the workflow's own stream events (`_streams.WorkflowStream`), so
            the new run's follow the earlier runs' in the same stream; `None` when the earlier run published none.
    """

    new_from: int = 0
    usage: RunUsage = field(default_factory=RunUsage)
    summaries: list[dict[str, Any]] = field(default_factory=list)
    stream_seq: int | None = None


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


_workflow_type = workflow_type  # the name this module had for it before `_spec`


def workflow_name(agent: DurableAgent[Any, Any]) -> str:
    """The agent's workflow type name, `durcap.{agent name}`."""
    return workflow_type(agent.name)


def _class_name(agent_name: str) -> str:
    return WORKFLOW_CLASS_PREFIX + re.sub(r'[^A-Za-z0-9_]', '_', agent_name)


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
    run = _run_method(agent, built, name)
    cls = type(
        name,
        (PydanticAIWorkflow,),
        {'run': workflow.run(run), '__pydantic_ai_agents__': [built], '__durcap_agent__': agent, '__module__': __name__,
         **approval_handlers(name, __name__)},
    )
    # A stored row this pydantic-ai cannot read (CorruptedRowError, NewerHistoryError) is found where the workflow
    # decodes the history: fail the run naming the conversation instead of retrying the workflow task forever.
    defined = workflow.defn(name=workflow_type(agent_name), failure_exception_types=[StoreError])(cls)
    setattr(module, name, defined)
    return defined


def _run_method(agent: DurableAgent[Any, Any], built: Any, class_name: str) -> Any:
    """The workflow class's `run`: one turn of `agent` (`built` for Temporal) with the conversation activities and
    the approval gate, reporting the whole agent run when it was continued as new."""
    deps_adapter: TypeAdapter[Any] = TypeAdapter(agent.deps_type)
    load, append = workflow_units(agent)

    async def run(self: Any, params: AgentRunInput) -> AgentRunOutput:
        try:  # claim-check refusals fail the turn naming the conversation (see _payloads)
            return await run_body(self, params)
        except ActivityError as exc:
            raise _payloads.named(exc, params.conversation_id) from exc

    async def run_body(self: Any, params: AgentRunInput) -> AgentRunOutput:
        from ... import streams
        from ._streams import workflow_stream

        _patches.current()  # first: the one marker of a new run (`_spec.CURRENT_PATCH_ID`), before any other command
        deps = deps_adapter.validate_python(params.deps) if params.deps is not None else None
        stream = workflow_stream(agent, params.continued.stream_seq if params.continued else None)
        token = _current_run.set(params)
        try:
            with streams.attached(stream):
                turn = await run_turn(agent, built.run, params.prompt, deps=deps, message_history=params.message_history,
                                      conversation_id=params.conversation_id, load=load, append=append,
                                      gate=TemporalApprovalGate(self),
                                      carried=params.continued.summaries if params.continued else None, busy=params.busy)
                if stream is not None:
                    await stream.finish()  # what no activity carried
        finally:
            _current_run.reset(token)
        _record_capabilities(turn.new_messages)
        usage = usage_from_json(turn.usage)
        if params.continued is None:
            return AgentRunOutput(turn.result.output, turn.new_messages, usage)
        # Continued as new: report the whole agent run, earlier parts included.
        earlier = ModelMessagesTypeAdapter.dump_python(turn.state.messages[params.continued.new_from:], mode='json')
        return AgentRunOutput(turn.result.output, [*earlier, *turn.new_messages], params.continued.usage + usage)

    # Temporal rejects run methods of local classes because it looks classes up by name; this one is
    # published under `class_name` in this module, so give the method the qualified name it will have.
    run.__qualname__ = f'{class_name}.run'
    run.__module__ = __name__
    run.__annotations__ = {'params': AgentRunInput, 'return': AgentRunOutput}
    return run


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
        # Summaries with no place yet (a tool call waits after them) ride along instead of being stored here.
        turn.log.observe(ctx.messages, getattr(ctx, 'run_id', None))
        placed, pending = turn.log.split()
        added = ModelMessagesTypeAdapter.dump_python(placed, mode='json')
        earlier = params.continued
        stream = _current_stream()
        continued = ContinuedRun(
            earlier.new_from if earlier else len(turn.messages), (earlier.usage if earlier else RunUsage()) + ctx.usage,
            ModelMessagesTypeAdapter.dump_python(pending, mode='json'), stream.seq if stream is not None else None,
        )
        if params.conversation_id is None:
            if stream is not None:
                await stream.finish()  # the new run is another workflow run: nothing carried over
            workflow.continue_as_new(AgentRunInput(None, None, params.deps, [*turn.history, *added], continued))
        info = workflow.info()
        await append_activity(agent, AppendInput(params.conversation_id, added, turn.revision,
                                                 f'{info.workflow_id}:{info.run_id}:continue-as-new',
                                                 to_jsonable_python(ctx.usage)))
        if stream is not None:
            await stream.finish()
        workflow.continue_as_new(AgentRunInput(None, params.conversation_id, params.deps, None, continued))

    return handler


def _current_stream() -> Any:
    """The run's `WorkflowStream` (`None` for a run recorded before streams, or outside a workflow's turn)."""
    from ... import streams

    return streams.current_stream()


def workflow_classes(agent: DurableAgent[Any, Any]) -> list[type]:
    """The agent's workflow class plus one per previous name (see `DurableAgent(previous_names=...)`)."""
    return [workflow_class(agent), *(workflow_class(agent, previous) for previous in agent.previous_names)]


def _record_capabilities(new_messages: list[dict[str, Any]]) -> None:
    """In workflow code, after the turn: the loaded capability ids as memo `durcap_capabilities` and, when the
    starting client found `DurcapCapabilities` registered (memo `durcap_search_attribute`), as that search
    attribute. Behind a patch marker, so histories recorded before replay unchanged."""
    caps = loaded_capabilities_in(new_messages)
    if not caps or not _patches.patched(CAPABILITIES_PATCH_ID):
        return
    workflow.upsert_memo({CAPABILITIES_MEMO: caps})
    if workflow.memo_value(SEARCH_ATTRIBUTE_MEMO, default=False):
        workflow.upsert_search_attributes([SearchAttributeKey.for_keyword_list(CAPABILITIES_SEARCH_ATTRIBUTE).value_set(caps)])
