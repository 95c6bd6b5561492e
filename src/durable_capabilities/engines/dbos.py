"""DBOS: capability function tools as DBOS steps, and a decorator for the user's own workflows.

Upstream `DBOSDurability` checkpoints model requests and MCP / dynamic toolsets as steps but runs
function tools inline in workflow code: after a crash a finished tool runs again, and a one-off tool
error fails the workflow. `DBOSToolSteps` closes that gap: every call to a function-toolset tool
inside a DBOS workflow runs as one step named `{agent}__function_toolset__{toolset id}.call_tool` (the name
upstream's `DBOSOperationNamer` gives the same operation) with DBOS's retry policy.

Control-flow exceptions a tool raises on purpose (`ModelRetry`, `ApprovalRequired`, `CallDeferred`)
are recorded as the step's result and re-raised after it, so DBOS neither retries them nor records
them as failures; recovery replays them as they happened.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from dbos import DBOS
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.durable_exec import ToolsetCallToolId
from pydantic_ai.durable_exec.dbos import DBOSOperationNamer
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelRetry
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, WrapperToolset

if TYPE_CHECKING:
    from ..agent import DurableAgent

DEFAULT_SQLITE_PATH = Path('.durcap') / 'dbos.sqlite'
"""System database used when no URL is given: `sqlite:///.durcap/dbos.sqlite` (DBOS supports SQLite
for development; use PostgreSQL in production)."""

_CONTROL_FLOW = (ModelRetry, ApprovalRequired, CallDeferred)


@dataclass(frozen=True)
class ToolStepConfig:
    """Retry policy for tool steps (DBOS `StepOptions`).

    Attributes:
        retries_allowed: Retry a failing tool step (DBOS default: False; ours: True).
        max_attempts: Attempts in total, first included.
        interval_seconds: Delay before the first retry, in seconds.
        backoff_rate: Multiplier applied to the delay after each retry.
    """

    retries_allowed: bool = True
    max_attempts: int = 3
    interval_seconds: float = 1.0
    backoff_rate: float = 2.0


@dataclass
class _Raised:
    """A control-flow exception recorded as a step result (pickled by DBOS)."""

    error: BaseException


def _in_workflow_code() -> bool:
    return DBOS.workflow_id is not None and DBOS.step_id is None


class StepToolset(WrapperToolset[Any]):
    """Runs each tool call of the wrapped function toolset as one DBOS step when in workflow code."""

    def __init__(self, wrapped: AbstractToolset[Any], step_name: str, config: ToolStepConfig):
        super().__init__(wrapped)
        self.step_name = step_name
        self.config = config

    def visit_and_replace(self, visitor: Callable[[AbstractToolset[Any]], AbstractToolset[Any]]) -> AbstractToolset[Any]:
        # Upstream's durability visits leaves to wrap them; keep ourselves around whatever it returns.
        replaced = self.wrapped.visit_and_replace(visitor)
        return self if replaced is self.wrapped else StepToolset(replaced, self.step_name, self.config)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        if not _in_workflow_code():
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)

        async def step() -> Any:
            try:
                return await self.wrapped.call_tool(name, tool_args, ctx, tool)
            except _CONTROL_FLOW as error:
                return _Raised(error)

        options = {
            'name': self.step_name,
            'retries_allowed': self.config.retries_allowed,
            'max_attempts': self.config.max_attempts,
            'interval_seconds': self.config.interval_seconds,
            'backoff_rate': self.config.backoff_rate,
        }
        result = await DBOS.run_step_async(options, step)  # type: ignore[arg-type]
        if isinstance(result, _Raised):
            raise result.error
        return result


@dataclass
class DBOSToolSteps(AbstractCapability[Any]):
    """Always-on capability that wraps every function-toolset leaf in a `StepToolset`.

    Attributes:
        agent_name: The agent's name (first part of every step name).
        config: Retry policy for the steps.
    """

    agent_name: str = ''
    config: ToolStepConfig = field(default_factory=ToolStepConfig)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        namer = DBOSOperationNamer(self.agent_name)

        def wrap(leaf: AbstractToolset[Any]) -> AbstractToolset[Any]:
            if isinstance(leaf, FunctionToolset):
                toolset_id = leaf.id or '<agent>'  # upstream's id for the agent's own tools
                step = namer.operation_name(ToolsetCallToolId('function', toolset_id=toolset_id))
                return StepToolset(leaf, step, self.config)
            return leaf

        return toolset.visit_and_replace(wrap)


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`DBOSDurability(...)` keyword arguments (`options` minus our `tool_steps` key) and our `DBOSToolSteps`.

    `options['tool_steps']` may be a `ToolStepConfig`, or `False` to leave function tools inline as upstream does.
    """
    options = dict(options)
    tool_steps = options.pop('tool_steps', ToolStepConfig())
    extra = [] if tool_steps is False else [DBOSToolSteps(agent_name=agent.durable_name, config=tool_steps)]
    from . import (
        _mcp,  # MCP: bounded `mcp_step_config` retries, and the guard (see _mcp.py)
    )

    extra += _mcp.dbos_defaults(agent, options)
    return options, extra


def system_database_url(url: str | None = None) -> str:
    """`url`, or SQLite at `.durcap/dbos.sqlite` (folder created, WAL journal mode)."""
    if url:
        return url
    DEFAULT_SQLITE_PATH.parent.mkdir(parents=True, exist_ok=True)
    # WAL journal mode (persistent in the file): each step commit no longer syncs the whole journal,
    # measured 1.5-2.1 ms per step against 2-16 ms under other I/O in the default mode.
    with closing(sqlite3.connect(DEFAULT_SQLITE_PATH)) as conn:
        conn.execute('PRAGMA journal_mode=WAL')
    return f'sqlite:///{DEFAULT_SQLITE_PATH.resolve()}'


def launch(
    name: str = 'durcap',
    *,
    system_database_url_: str | None = None,
    agents: Sequence[DurableAgent[Any, Any]] = (),
    lock: str | Path | None = None,
    allow_drift: bool = False,
    **config: Any,
) -> DBOS:
    """Configure and launch DBOS (call after every agent was built and every workflow decorated).

    Args:
        name: DBOS application name.
        system_database_url_: PostgreSQL or SQLite URL; default SQLite at `.durcap/dbos.sqlite`.
        agents: The definitions this app serves; checked against `lock` (or `./durable.lock`) first, so a
            rename cannot strand workflows DBOS would recover at launch.
        lock / allow_drift: See `lockfile.enforce_lock`.
        config: Other `DBOSConfig` keys (`log_level` defaults to `'WARNING'`).

    Returns:
        The `DBOS` instance.
    """
    if agents:
        from ..lockfile import enforce_lock

        enforce_lock(agents, lock, allow_drift=allow_drift)
    config.setdefault('log_level', 'WARNING')
    dbos = DBOS(config={'name': name, 'system_database_url': system_database_url(system_database_url_), **config})  # type: ignore[typeddict-item]
    DBOS.launch()
    return dbos


P = ParamSpec('P')
R = TypeVar('R')


class BoundAgent:
    """What a `@workflow(agent)` function receives as its first argument: `run()` durably inside the workflow."""

    def __init__(self, definition: DurableAgent[Any, Any]):
        self.definition = definition
        self.agent = definition.build('dbos')

    async def run(self, prompt: str | None = None, **kwargs: Any) -> Any:
        """`pydantic_ai.Agent.run` on the DBOS-built agent; returns `AgentRunResult`.

        Raises:
            DurableConfigError: capabilities passed per run (DC012).
        """
        from ..aliases import rewrite_history

        self.definition.check_run_capabilities(kwargs.pop('capabilities', None))
        if kwargs.get('message_history') is not None:
            kwargs['message_history'] = rewrite_history(kwargs['message_history'], self.definition.aliases)
        return await self.agent.run(prompt, **kwargs)


def workflow(agent: DurableAgent[Any, Any], *, name: str | None = None, **dbos_workflow_kwargs: Any) -> Callable[
    [Callable[..., Awaitable[R]]], Callable[..., Awaitable[R]]
]:
    """Decorate an async function as a `@DBOS.workflow` that receives the agent first.

    ```python
    @durable_capabilities.dbos.workflow(support)
    async def handle_ticket(agent, ticket_id: str) -> str:
        return (await agent.run(f'Ticket {ticket_id}')).output
    ```

    The agent is built (its steps registered with DBOS) when the decorator runs, so decorate at
    import time, before `DBOS.launch()`, as DBOS requires for every workflow and step. Call the
    decorated function without the agent argument: `await handle_ticket('T-1')`.

    Args:
        agent: The definition to run.
        name: DBOS workflow name (default: the function's qualified name, as `@DBOS.workflow`).
        dbos_workflow_kwargs: Passed to `DBOS.workflow` (e.g. `max_recovery_attempts`).
    """
    bound = BoundAgent(agent)

    def decorate(func: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        async def body(*args: Any, **kwargs: Any) -> R:
            return await func(bound, *args, **kwargs)

        # Not `functools.wraps`: its `__wrapped__` would show the agent parameter to callers.
        for attr in ('__module__', '__name__', '__qualname__', '__doc__'):
            setattr(body, attr, getattr(func, attr))
        return DBOS.workflow(name=name or func.__qualname__, **dbos_workflow_kwargs)(body)

    return decorate


_WORKFLOWS: dict[str, Any] = {}

APPEND_STEP_RETRIES: dict[str, Any] = {'retries_allowed': True, 'interval_seconds': 1.0, 'backoff_rate': 1.5, 'max_attempts': 40}
"""Retries of the conversation-append step: the run's side effects happened, so keep trying while the store is
down: 1 s, then x1.5 each time (DBOS caps a wait at 1 h), 40 attempts, about 22 hours in all."""


def _permanent_store_errors() -> tuple[type[BaseException], ...]:
    from ..store import (
        AppendIdReuseError,
        ConversationConflictError,
        CorruptedRowError,
        NewerHistoryError,
        SchemaVersionError,
    )
    from ..validation import DurableConfigError

    return (ConversationConflictError, AppendIdReuseError, CorruptedRowError, NewerHistoryError, SchemaVersionError,
            DurableConfigError)


PERMANENT_STORE_ERRORS = _permanent_store_errors()
"""Store errors a retried append cannot fix: the append step records them as its result and raises them after."""


def agent_workflow(agent: DurableAgent[Any, Any]) -> Callable[..., Awaitable[dict[str, Any]]]:
    """A DBOS workflow named `durcap.{agent name}` that runs `agent` once (registered on first call).

    Call before `DBOS.launch()`. Arguments: `prompt: str | None`, `deps: dict | None` (validated into
    `deps_type`), `message_history: list[dict] | None` (pydantic-ai message JSON), `conversation_id`
    (load the stored history in step `durcap__{name}__conversation.load`, append the new messages in
    step `...append`, idempotent by workflow id). Returns
    `{'output', 'new_messages', 'usage'}` as JSON-compatible data.
    """
    existing = _WORKFLOWS.get(agent.name)
    if existing is not None:
        return existing
    from ..conversations import append_conversation, load_conversation, run_turn

    bound = BoundAgent(agent)
    step_prefix = f'durcap__{agent.durable_name}__conversation'

    # Store I/O runs as steps: recovery returns the recorded history instead of reading again, and the
    # append (idempotent by workflow id) is retried by DBOS.
    async def load(conversation_id: str) -> Any:
        return await DBOS.run_step_async({'name': f'{step_prefix}.load'}, load_conversation, agent, conversation_id)

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> Any:
        async def body() -> Any:
            try:
                return await append_conversation(
                    agent, conversation_id, messages, expected_revision=revision,
                    append_id=f'dbos:{DBOS.workflow_id}', usage=usage,
                )
            except PERMANENT_STORE_ERRORS as error:
                return _Raised(error)  # a conflict cannot succeed: recorded, not retried

        result = await DBOS.run_step_async({'name': f'{step_prefix}.append', **APPEND_STEP_RETRIES}, body)  # type: ignore[arg-type]
        if isinstance(result, _Raised):
            raise result.error
        return result

    async def run_agent(
        prompt: str | None, deps: Any = None, message_history: Any = None, conversation_id: str | None = None
    ) -> dict[str, Any]:
        return await run_turn(
            agent, bound.run, prompt=prompt, deps=deps, message_history=message_history,
            conversation_id=conversation_id, load=load, append=append,
        )

    registered = DBOS.workflow(name=f'durcap.{agent.name}')(run_agent)
    for previous in agent.previous_names:
        # Workflows recorded under an earlier agent name recover through the same body.
        async def run_previous(
            prompt: str | None, deps: Any = None, message_history: Any = None, conversation_id: str | None = None
        ) -> dict[str, Any]:
            return await run_agent(prompt, deps, message_history, conversation_id)

        DBOS.workflow(name=f'durcap.{previous}')(run_previous)
    _WORKFLOWS[agent.name] = registered
    return registered
