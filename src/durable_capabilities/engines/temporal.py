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
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.durable_exec.temporal import PydanticAIPlugin, PydanticAIWorkflow
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.usage import RunUsage
from temporalio import workflow
from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from ..aliases import rewrite_history

if TYPE_CHECKING:
    from ..agent import DurableAgent

WORKFLOW_NAME_PREFIX = 'durcap.'
"""Workflow type name: `durcap.{agent name}`. Compatibility data, listed in `durable.lock`."""

DEFAULT_TOOL_HEARTBEAT_TIMEOUT = timedelta(seconds=5)
"""`heartbeat_timeout` given to every tool activity by default.

Upstream heartbeats every activity in the background (at half the timeout) but sets no timeout for
tool activities, so a tool whose worker was killed is retried only when `start_to_close_timeout`
(60 s) expires. With 5 s, Temporal retries it on another worker within about 5-7 s. A CPU-bound
*async* tool that blocks the event loop for longer than this will be failed as timed out: give its
toolset a longer `heartbeat_timeout` via `DurableAgent(engine_options={'temporal': {...}})`.
"""


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


def workflow_name(agent: DurableAgent[Any, Any]) -> str:
    return f'{WORKFLOW_NAME_PREFIX}{agent.name}'


def _class_name(agent_name: str) -> str:
    return 'DurcapWorkflow_' + re.sub(r'[^A-Za-z0-9_]', '_', agent_name)


def workflow_class(agent: DurableAgent[Any, Any], registered_name: str | None = None) -> type:
    """The Temporal workflow class that runs `agent` (created once per workflow name and process).

    Input `AgentRunInput`, output `AgentRunOutput`. `registered_name` is an earlier agent name (from
    `previous_names`) to register the same workflow under, so runs started under it recover.

    Raises:
        ValueError: another definition with the same name already has a workflow class in this process
            (duplicate agent names, DC011).
    """
    module = sys.modules[__name__]
    agent_name = registered_name or agent.name
    name = _class_name(agent_name)
    existing = getattr(module, name, None)
    if existing is not None:
        if getattr(existing, '__durcap_agent__', None) is agent:
            return existing
        raise ValueError(f'another DurableAgent named {agent_name!r} already has a Temporal workflow in this process')
    built = agent.build('temporal')
    deps_adapter: TypeAdapter[Any] = TypeAdapter(agent.deps_type)

    async def run(self: Any, params: AgentRunInput) -> AgentRunOutput:
        deps = deps_adapter.validate_python(params.deps) if params.deps is not None else None
        history = ModelMessagesTypeAdapter.validate_python(params.message_history) if params.message_history else None
        result = await built.run(params.prompt, deps=deps, message_history=rewrite_history(history, agent.aliases))
        return AgentRunOutput(
            result.output, ModelMessagesTypeAdapter.dump_python(result.new_messages(), mode='json'), result.usage
        )

    # Temporal rejects run methods of local classes because it looks classes up by name; this one is
    # published under `name` in this module below, so give the method the qualified name it will have.
    run.__qualname__ = f'{name}.run'
    run.__module__ = __name__
    run.__annotations__ = {'params': AgentRunInput, 'return': AgentRunOutput}
    cls = type(
        name,
        (PydanticAIWorkflow,),
        {'run': workflow.run(run), '__pydantic_ai_agents__': [built], '__durcap_agent__': agent, '__module__': __name__},
    )
    defined = workflow.defn(name=f'{WORKFLOW_NAME_PREFIX}{agent_name}')(cls)
    setattr(module, name, defined)
    return defined


def workflow_classes(agent: DurableAgent[Any, Any]) -> list[type]:
    """The agent's workflow class plus one per previous name (see `DurableAgent(previous_names=...)`)."""
    return [workflow_class(agent), *(workflow_class(agent, previous) for previous in agent.previous_names)]


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`TemporalDurability(...)` keyword arguments: ours (a heartbeat timeout for every tool activity)
    merged with `options` (the user's win, per toolset id), and no extra capability."""
    options = dict(options)
    configs: dict[str, Any] = {
        leaf: {'heartbeat_timeout': DEFAULT_TOOL_HEARTBEAT_TIMEOUT, 'start_to_close_timeout': timedelta(seconds=60)}
        for leaves in agent.leaf_ids().values()
        for leaf in leaves
    }
    for leaf, config in (options.pop('toolset_activity_config', None) or {}).items():
        configs[leaf] = {**configs.get(leaf, {}), **config}
    from . import _mcp  # MCP: bounded retry policy per MCP leaf, and the guard (see _mcp.py)

    extra = _mcp.temporal_defaults(agent, options, configs)
    return {'toolset_activity_config': configs, **options}, extra


def sandbox_runner() -> SandboxedWorkflowRunner:
    """Temporal's sandboxed runner with `durable_capabilities` passed through (PydanticAIPlugin adds pydantic-ai's)."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules('durable_capabilities')
    )


async def connect(address: str = '127.0.0.1:7233', namespace: str = 'default') -> Client:
    """A Temporal client with pydantic-ai's payload converter (`PydanticAIPlugin`)."""
    return await Client.connect(address, namespace=namespace, plugins=[PydanticAIPlugin()])


DEFAULT_STICKY_SCHEDULE_TO_START = timedelta(seconds=2)
"""How long a workflow task waits on a worker's sticky queue before any worker may take it.

Temporal's default is 5 s; after a worker is killed, every workflow it cached waits that long
before another worker continues it. 2 s trades a few more history replays under load for faster
recovery (pass `sticky_queue_schedule_to_start_timeout=` to `make_worker` to change it)."""


def make_worker(client: Client, agents: Sequence[DurableAgent[Any, Any]], task_queue: str, **worker_kwargs: Any) -> Worker:
    """A `temporalio.worker.Worker` registering each agent's workflow and activities on `task_queue`.

    Keyword arguments are passed to `Worker` (ours default: the sandbox runner, a 2 s sticky queue timeout).
    """
    worker_kwargs.setdefault('sticky_queue_schedule_to_start_timeout', DEFAULT_STICKY_SCHEDULE_TO_START)
    worker_kwargs.setdefault('workflow_runner', sandbox_runner())
    return Worker(
        client,
        task_queue=task_queue,
        workflows=[cls for agent in agents for cls in workflow_classes(agent)],
        **worker_kwargs,
    )


async def run_worker(
    agents: Sequence[DurableAgent[Any, Any]],
    *,
    task_queue: str,
    address: str = '127.0.0.1:7233',
    namespace: str = 'default',
    ready: asyncio.Event | None = None,
    graceful_shutdown_seconds: float = 30.0,
) -> None:
    """Run a worker until SIGTERM or SIGINT, then drain: in-flight activities get up to
    `graceful_shutdown_seconds` to finish before the worker stops (Temporal's graceful shutdown)."""
    client = await connect(address, namespace)
    worker = make_worker(
        client, agents, task_queue, graceful_shutdown_timeout=timedelta(seconds=graceful_shutdown_seconds)
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with worker:
        if ready is not None:
            ready.set()
        await stop.wait()


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
) -> Any:
    """Start the agent's workflow; returns the `WorkflowHandle` (await `handle.result()` for `AgentRunOutput`)."""
    from pydantic_core import to_jsonable_python

    params = AgentRunInput(
        prompt=prompt,
        conversation_id=conversation_id,
        deps=to_jsonable_python(deps) if deps is not None else None,
        message_history=ModelMessagesTypeAdapter.dump_python(message_history, mode='json') if message_history else None,
    )
    return await client.start_workflow(
        workflow_name(agent), params, id=workflow_id, task_queue=task_queue, result_type=AgentRunOutput
    )


async def run(client: Client, agent: DurableAgent[Any, Any], prompt: str | None, **kwargs: Any) -> AgentRunOutput:
    """Start the agent's workflow and wait for its `AgentRunOutput`. Keyword arguments as for `start_run`."""
    handle = await start_run(client, agent, prompt, **kwargs)
    return await handle.result()
