"""DBOS: capability function tools as DBOS steps, and a decorator for the user's own workflows.

Upstream `DBOSDurability` checkpoints model requests and MCP / dynamic toolsets as steps but runs
function tools inline in workflow code: after a crash a finished tool runs again, and a one-off tool
error fails the workflow. `ToolStepDurability` (upstream's capability, subclassed) closes that gap: every call
to a function-toolset tool inside a DBOS workflow runs as one step named
`{agent}__function_toolset__{toolset id}.call_tool` (the name upstream's `DBOSOperationNamer` gives the same
operation) with DBOS's retry policy.

Control-flow exceptions a tool raises on purpose (`ModelRetry`, `ApprovalRequired`, `CallDeferred`)
are recorded as the step's result and re-raised after it, so DBOS neither retries them nor records
them as failures; recovery replays them as they happened.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar

from dbos import DBOS, SetWorkflowID
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.durable_exec import (
    ModelCancelSuspendedResponseId,
    ModelCompactMessagesId,
    ModelRequestId,
    ToolsetCallToolId,
    ToolsetGetInstructionsId,
    ToolsetGetToolsId,
)
from pydantic_ai.durable_exec.dbos import DBOSDurability, DBOSOperationNamer
from pydantic_ai.exceptions import ApprovalRequired, CallDeferred, ModelAPIError, ModelRetry, RetryModelRequest
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, WrapperToolset
from pydantic_core import to_jsonable_python

from .. import _registry, _upstream
from .._limits import private_file, redact_database_url
from ..conversations import append_conversation, load_conversation
from ..store import AppendIdReuseError, ConversationConflictError, CorruptedRowError, NewerHistoryError, SchemaVersionError
from ..turn import RunReport, Turn, deps_from_json, run_turn
from ..validation import DurableConfigError
from . import _mcp, _retry_after, _retry_log
from ._adapter import EngineAdapter, RunInfo, RunOptions, leaf_kinds
from ._dbos_approvals import (  # noqa: F401 - public here, as before the split
    DECISION_TOPIC,
    PENDING_EVENT,
    DBOSApprovalGate,
    approval_step_name,
)
from ._retry_after import MAX_RETRY_AFTER_SECONDS

if TYPE_CHECKING:
    from ..agent import DurableAgent
    from ..approvals import Decision, PendingCall

WORKFLOW_NAME_PREFIX = 'durcap.'
"""Workflow name of `agent_workflow`: `durcap.{agent name}`. Compatibility data, listed in `durable.lock`."""

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


@dataclass
class StepToolset(WrapperToolset[Any]):
    """Runs each tool call of the wrapped function toolset as one DBOS step when in workflow code.

    Built once per leaf (`ToolStepDurability` keeps one per leaf toolset): the step options are computed here,
    and every call runs the same bound method as its step (`DBOS.run_step_async(options, self._step, name, args,
    ctx, tool)`), with no closure or options built per call. The step is not registered with `@DBOS.step`: a
    registered step would enter DBOS's application version (`application_version`), so adding this wrapper would
    have changed the version of every deployed app and stranded its pending workflows.

    Attributes:
        wrapped: The function toolset (a leaf).
        step_name: `{agent}__function_toolset__{toolset id}.call_tool`.
        config: The retry policy.
    """

    step_name: str = ''
    config: ToolStepConfig = field(default_factory=ToolStepConfig)
    options: dict[str, Any] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.options = {
            'name': self.step_name,
            'retries_allowed': self.config.retries_allowed,
            'max_attempts': self.config.max_attempts,
            'interval_seconds': self.config.interval_seconds,
            'backoff_rate': self.config.backoff_rate,
        }

    def visit_and_replace(self, visitor: Callable[[AbstractToolset[Any]], AbstractToolset[Any]]) -> AbstractToolset[Any]:
        # Upstream's durability visits leaves to wrap them; keep ourselves around whatever it returns.
        replaced = self.wrapped.visit_and_replace(visitor)
        return self if replaced is self.wrapped else StepToolset(replaced, self.step_name, self.config)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        if not _in_workflow_code():
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        result = await DBOS.run_step_async(self.options, self._step, name, tool_args, ctx, tool)  # type: ignore[arg-type]
        if isinstance(result, _Raised):
            raise result.error
        return result

    async def _step(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        """The step body: the tool call, with control-flow exceptions returned as `_Raised` (recorded, not retried)."""
        try:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        except _CONTROL_FLOW as error:
            return _Raised(error)


class ToolSteps:
    """Wraps every function-toolset leaf of a toolset in its `StepToolset`, one per leaf, kept between runs.

    Args:
        agent_name: The agent's durable name (first part of every step name).
        config: Retry policy for the steps.
    """

    MAX_KEPT = 256
    """Leaves remembered at most; past it the memory is emptied and rebuilt (a toolset that makes new leaves
    on every run cannot grow it)."""

    def __init__(self, agent_name: str, config: ToolStepConfig | None = None):
        self.agent_name = agent_name
        self.config = config or ToolStepConfig()
        self._namer = DBOSOperationNamer(agent_name)
        self._kept: dict[int, StepToolset] = {}

    def step_name(self, toolset_id: str | None) -> str:
        """`{agent}__function_toolset__{toolset id}.call_tool`, upstream's `DBOSOperationNamer` name for the operation;
        `toolset_id=None` is the agent's own tools (upstream's id `<agent>`)."""
        return self._namer.operation_name(ToolsetCallToolId('function', toolset_id=toolset_id or '<agent>'))

    def wrap(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any]:
        """`toolset` with each `FunctionToolset` leaf replaced by its `StepToolset`."""
        return toolset.visit_and_replace(self._leaf)

    def _leaf(self, leaf: AbstractToolset[Any]) -> AbstractToolset[Any]:
        if not isinstance(leaf, FunctionToolset):
            return leaf
        kept = self._kept.get(id(leaf))
        if kept is None or kept.wrapped is not leaf:
            if len(self._kept) >= self.MAX_KEPT:
                self._kept.clear()
            kept = self._kept[id(leaf)] = StepToolset(leaf, self.step_name(leaf.id), self.config)
        return kept


class ToolStepDurability(DBOSDurability):
    """Upstream's `DBOSDurability` that also runs every function-toolset tool call as a DBOS step.

    The step wrapping happens in the durability capability's own `get_wrapper_toolset`, right after upstream
    wraps the leaves it makes durable (MCP, dynamic toolsets, child-workflow tools), so no capability is added to
    the agent's hook chain for it (an extra capability costs a `RunContext` copy and a pass-through call on every
    hook of every run). The agent's own tools (`DurableAgent(tools=...)`) are wrapped too.

    Args:
        tool_steps: The steps' retry policy (`ToolStepConfig`, default `ToolStepConfig()`), or `False`: function
            tools run inline in workflow code, as upstream runs them.
        tool_step_agent: The name step names start with (the agent's durable name); default: the agent's name.
        retry_after: The durable `retry-after` wait of the model request step (`RetryAfterSleep`), run from this
            capability's own `on_model_request_error` so that it adds no capability to the hook chain either.
        kwargs: `DBOSDurability`'s own arguments.
    """

    def __init__(self, *, tool_steps: ToolStepConfig | Literal[False] | None = None, tool_step_agent: str | None = None,
                 retry_after: RetryAfterSleep | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.tool_steps = tool_steps
        self._tool_step_agent = tool_step_agent
        self._steps: ToolSteps | None = None
        self.retry_after = retry_after

    async def on_model_request_error(self, ctx: Any, *, request_context: Any, error: Exception) -> Any:
        """`retry_after.on_model_request_error` (the provider's `retry-after` waited in `DBOS.sleep`), or re-raise
        `error` when no `retry_after` was given (`durability_parts` then adds `RetryAfterSleep` as its own
        capability)."""
        if self.retry_after is None:
            raise error
        return await self.retry_after.on_model_request_error(ctx, request_context=request_context, error=error)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        wrapped = super().get_wrapper_toolset(toolset)
        config = self.tool_steps
        if config is False:
            return wrapped
        steps = self._steps
        if steps is None:  # first use, on the bound copy (`for_agent` copies the instance and sets `name`)
            steps = self._steps = ToolSteps(self._tool_step_agent or self.name or '',
                                            config if isinstance(config, ToolStepConfig) else None)
        return steps.wrap(wrapped or toolset)


class ModelRetryLogLine(logging.Filter):
    """DBOS's "Step being automatically retried (attempt 2 of 3)" warning as one line without the traceback:
    `model request step (attempt 2 of 3) failed: ModelRateLimitError: ...` for a model error, `step (attempt 2 of 3)
    failed: RuntimeError: ...` for any other (a tool step). Installed on the `dbos` logger when this module is
    imported."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        if message.startswith('Step being automatically retried'):
            if not _retry_log.shorten(record, message.replace('Step being automatically retried', 'model request step')):
                _retry_log.shorten_any(record, message.replace('Step being automatically retried', 'step'))
        return True


logging.getLogger('dbos').addFilter(ModelRetryLogLine())


def retry_model_step(error: BaseException) -> bool:
    """DBOS `should_retry` of the model request step: retry it in the step (after the step's interval) unless another
    attempt cannot fix the error (401, 403, 404 model, exhausted quota: `_retry_after.unfixable`) or the provider
    asked for a wait (`retry-after`): that error ends the step, recorded, and `RetryAfterSleep` waits it in the
    workflow."""
    return not _retry_after.unfixable(error) and _retry_after.retry_after(error) is None


DEFAULT_MODEL_STEP_CONFIG: dict[str, Any] = {'retries_allowed': True, 'max_attempts': 3, 'interval_seconds': 2.0,
                                             'backoff_rate': 2.0, 'should_retry': retry_model_step}
"""The model request step's retries, under the keys of `engine_options['dbos']['model_step_config']` (the user's keys
win): 3 attempts, 2 s then 4 s apart, not for errors another attempt cannot fix nor for a provider's `retry-after`
(`retry_model_step`; `RetryAfterSleep` waits that one, within the same 3 attempts). DBOS's own default is no retry
(`@DBOS.step(retries_allowed=False)`), so a stream the provider cut half way would fail the workflow; each attempt
also carries the provider SDK's own retries (openai and anthropic SDKs: 2 retries, honouring `retry-after` on
429/503), so a provider that stays unreachable ends the run in about 10 s."""


@dataclass
class RetryAfterSleep(AbstractCapability[Any]):
    """Waits a provider's `retry-after` durably before the model request step runs again (`durability_parts` hands it
    to `ToolStepDurability(retry_after=...)`, whose `on_model_request_error` runs it, or adds it to the agent as a
    capability of its own when one of the agent's capabilities handles model request errors).

    A DBOS step retries at its own fixed interval, and only the step's final outcome is recorded. So the model request
    step does not retry an error carrying `retry_after` (`retry_model_step`): it fails, and its error is recorded as the
    step's result. In workflow code this capability's `on_model_request_error` then sleeps `retry_after` seconds with
    `DBOS.sleep_async` (a `DBOS.sleep` row in the workflow's steps, holding its wake-up time) and asks pydantic-ai for
    another attempt (`RetryModelRequest`), which runs the step again under a new step id. A workflow recovered after a
    crash replays the same sequence: the recorded error, the recorded sleep (only what was left of it), the next step.

    Attributes:
        max_attempts: Runs of the model request step for one request, the first included, when each run ends on a
            `retry-after` (the step's `max_attempts`; each run keeps its own retries of other errors); past it the
            error fails the run.
        max_wait: The longest `retry-after` waited, in seconds (`MAX_RETRY_AFTER_SECONDS`); a longer one fails the run.
    """

    max_attempts: int = 3
    max_wait: float = MAX_RETRY_AFTER_SECONDS

    async def on_model_request_error(self, ctx: Any, *, request_context: Any, error: Exception) -> Any:
        seconds = getattr(error, 'retry_after', None) if isinstance(error, ModelAPIError) else None
        if seconds is None or not _in_workflow_code():
            raise error
        attempt = int(getattr(request_context, 'attempt', 1))
        detail = str(error).splitlines()[0] if str(error) else ''
        where = f'model request step (attempt {attempt} of {self.max_attempts})'
        if seconds > self.max_wait:
            _dbos_logger.warning('%s failed: %s', where, _retry_after.over_cap_message(error, seconds, self.max_wait))
            raise error
        if attempt >= self.max_attempts:
            raise error
        _dbos_logger.warning('%s failed: %s: %s; waiting %g s (retry-after) in DBOS.sleep before attempt %d', where,
                             type(error).__name__, detail, seconds, attempt + 1)
        await DBOS.sleep_async(seconds)
        raise RetryModelRequest()


_dbos_logger = logging.getLogger('dbos')


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`ToolStepDurability(...)` keyword arguments (upstream's `DBOSDurability` ones plus the tool steps and the
    `retry_after` wait, `RetryAfterSleep` bounded by the model step's attempts) and our capabilities: the MCP guard, and
    `RetryAfterSleep` itself instead when a capability of the agent handles model request errors
    (`_handles_model_request_errors`).

    `options['tool_steps']` may be a `ToolStepConfig` (default: `ToolStepConfig()`), or `False` to leave function tools
    inline as upstream does. `options['model_step_config']` is merged over `DEFAULT_MODEL_STEP_CONFIG` (the user's
    keys win).
    """
    options = dict(options)
    model_step = {**DEFAULT_MODEL_STEP_CONFIG, **(options.get('model_step_config') or {})}
    options['model_step_config'] = model_step
    options.setdefault('tool_steps', ToolStepConfig())
    options['tool_step_agent'] = agent.durable_name
    attempts = int(model_step.get('max_attempts') or 1) if model_step.get('retries_allowed') else 1
    sleeper = RetryAfterSleep(max_attempts=attempts)
    extra: list[Any] = []
    if _handles_model_request_errors(agent):
        extra.append(sleeper)  # its own capability, in the order the user's error handlers expect (see below)
    else:
        options['retry_after'] = sleeper
    extra += _mcp_defaults(agent, options)
    return options, extra


def _handles_model_request_errors(agent: DurableAgent[Any, Any]) -> bool:
    """Whether a capability of `agent` (a group's members one by one; a wrapper counts, whatever it wraps) overrides
    `on_model_request_error`, as `ModelFallback` does.

    pydantic-ai calls `on_model_request_error` innermost first. The durability capability is innermost, so a
    `retry-after` wait run from it would come before such a handler (`ModelFallback` would no longer move on to its
    next model at once). For these agents `RetryAfterSleep` stays a capability of its own, placed by the agent's list
    (before the innermost ones), as before.
    """
    from pydantic_ai.capabilities import CombinedCapability

    registered: list[AbstractCapability[Any]] = []
    for capability in agent.user_capabilities:
        capability.apply(registered.append)
    base = AbstractCapability.on_model_request_error
    return any(type(c).on_model_request_error is not base for c in registered if not isinstance(c, CombinedCapability))


def mcp_step_config(attempts: int = _mcp.DEFAULT_MCP_ATTEMPTS) -> dict[str, Any]:
    """`DBOSDurability(mcp_step_config=...)` default: bounded step retries."""
    return {
        'retries_allowed': True,
        'max_attempts': attempts,
        'interval_seconds': _mcp.DEFAULT_MCP_RETRY_INTERVAL_SECONDS,
        'backoff_rate': 2.0,
    }


def _mcp_defaults(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> list[Any]:
    """Set `options['mcp_step_config']` to bounded retries unless the user gave one; return the guard."""
    if options.pop(_mcp.GUARD_OPTION, True) is False or not _mcp.mcp_leaves(agent):
        return []
    config = options.setdefault('mcp_step_config', mcp_step_config())
    tries = (config.get('max_attempts') or _mcp.DEFAULT_MCP_ATTEMPTS) if config.get('retries_allowed') else 1
    found = _mcp.guard(agent, 'dbos', lambda leaf_id: tries)
    return [found] if found is not None else []


def system_database_file(url: str | None = None) -> Path | None:
    """The SQLite file the system database of `url` lives in, without creating anything: `url`, else
    `$DURCAP_DBOS_DB`, else `DEFAULT_SQLITE_PATH` (as `system_database_url` resolves them); `None` for a database
    that is not a SQLite file (PostgreSQL, `sqlite:///:memory:`)."""
    url = url or os.environ.get('DURCAP_DBOS_DB') or None
    if url is None:
        return DEFAULT_SQLITE_PATH
    parsed = url.split('?', 1)[0]
    if parsed.startswith('sqlite:///') and parsed[len('sqlite:///'):] not in ('', ':memory:'):
        return Path(parsed[len('sqlite:///'):])
    return None


def system_database_url(url: str | None = None) -> str:
    """`url`, else `$DURCAP_DBOS_DB` (the default of every command's `--db`, `settings.py`), else SQLite at
    `.durcap/dbos.sqlite` (folder created 0700, file 0600, WAL journal mode). A SQLite URL naming a file that does
    not exist yet gets the same private folder and file."""
    url = url or os.environ.get('DURCAP_DBOS_DB') or None
    if url:
        if (path := system_database_file(url)) is not None:
            private_file(path)
        return url
    private_file(DEFAULT_SQLITE_PATH)
    # WAL journal mode (persistent in the file): each step commit no longer syncs the whole journal,
    # measured 1.5-2.1 ms per step against 2-16 ms under other I/O in the default mode.
    with closing(sqlite3.connect(DEFAULT_SQLITE_PATH)) as conn:
        conn.execute('PRAGMA journal_mode=WAL')
    return f'sqlite:///{DEFAULT_SQLITE_PATH.resolve()}'


RUN_EXECUTOR_PREFIX = 'durcap-run'
"""Executor ids of one-shot `durcap run` processes: `durcap-run-{host}-{pid}-{random}`."""

WORKER_QUEUE = 'durcap'
"""The DBOS queue `durcap worker dbos` serves and `durcap runs resume` hands a run to (default)."""


def one_shot_executor_id() -> str:
    """A fresh executor id for one process that runs one workflow and exits: DBOS recovers, at launch, only
    the pending workflows of the launching executor id, so a one-shot run recovers nothing it will not
    finish, and its own run (if the process dies) is left to `durcap runs resume` / a worker."""
    return f'{RUN_EXECUTOR_PREFIX}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}'


def executor_process_gone(executor_id: str | None) -> bool:
    """Whether `executor_id` is a one-shot `durcap run` executor of this host whose process no longer exists."""
    prefix = f'{RUN_EXECUTOR_PREFIX}-{socket.gethostname()}-'
    if not executor_id or not executor_id.startswith(prefix):
        return False
    pid_text = executor_id[len(prefix):].split('-', 1)[0]
    if not pid_text.isdigit():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def launch(
    name: str = 'durcap',
    *,
    system_database_url_: str | None = None,
    agents: Sequence[DurableAgent[Any, Any]] = (),
    lock: str | Path | None = None,
    allow_drift: bool = False,
    one_shot: bool = False,
    listen: Sequence[str] = (),
    **config: Any,
) -> DBOS:
    """Configure and launch DBOS (call after every agent was built and every workflow decorated).

    Args:
        name: DBOS application name.
        system_database_url_: PostgreSQL or SQLite URL; default SQLite at `.durcap/dbos.sqlite`.
        agents: The definitions this app serves; checked against `lock` (or `./durable.lock`) first, so a
            rename cannot strand workflows DBOS would recover at launch.
        lock / allow_drift: See `lockfile.enforce_lock`.
        one_shot: This process runs its own workflow and exits: a fresh executor id (`one_shot_executor_id`, unless
            `config['executor_id']` is given) so launch recovers no one else's pending workflows, and no user queue
            is served but those named in `listen` (`DBOS.listen_queues`), so work handed to a worker's queue stays there.
        config: Other `DBOSConfig` keys (`log_level` defaults to `'WARNING'`; `executor_id` defaults to DBOS's
            `local`, whose pending workflows launch recovers; `application_version` defaults to
            `application_version(name)`, which stays the same when an agent is renamed with `previous_names`).

    Returns:
        The `DBOS` instance.
    """
    for agent in agents:
        BoundAgent(agent)  # claims its names (DC011 against another definition of the same name)
    if agents:
        from ..lockfile import enforce_lock

        enforce_lock(agents, lock, allow_drift=allow_drift)
    config.setdefault('log_level', 'WARNING')
    if config.get('application_version') is None and not os.environ.get('DBOS__APPVERSION') and not config.get('enable_patching'):
        config['application_version'] = application_version(name)
    if one_shot and not config.get('executor_id'):
        config['executor_id'] = one_shot_executor_id()
    dbos = DBOS(config={'name': name, 'system_database_url': system_database_url(system_database_url_), **config})  # type: ignore[typeddict-item]
    if one_shot:
        DBOS.listen_queues(list(listen))
    DBOS.launch()
    return dbos


def application_version(name: str = 'durcap') -> str:
    """The DBOS application version `launch(name)` runs as unless one is configured.

    DBOS recovers a pending workflow only in a process of the version that recorded it, and by default computes
    the version from the sources of every registered workflow. Registering an agent's previous names
    (`DurableAgent(previous_names=[...])`) adds a workflow per name, which changed the version, so a workflow in
    flight when the agent was renamed was never recovered. This is DBOS's own computation over the registered
    workflows except those registered only for previous names: the same as DBOS's default when no agent was
    renamed, and unchanged by a rename that keeps the old name in `previous_names`. A change to any other workflow
    (your own `@DBOS.workflow` functions included) still changes it, as DBOS intends.

    Args:
        name: The DBOS application name.

    Returns:
        A 32-character hex string (DBOS's MD5 form). `DBOSConfig['application_version']` or `$DBOS__APPVERSION`
        override it, as they override DBOS's default.
    """
    return _upstream.dbos_application_version(name, _PREVIOUS_NAME_WORKFLOWS)


P = ParamSpec('P')
R = TypeVar('R')


def _claim(definition: DurableAgent[Any, Any]) -> None:
    """Claim the agent's names in this process; its steps are global by name (DC011 on a clash)."""
    for name in (definition.name, *definition.previous_names):
        _registry.claim('DBOS agent', name, definition, 'registered with DBOS in this process')


class BoundAgent:
    """What a `@workflow(agent)` function receives as its first argument: `run()` durably inside the workflow."""

    def __init__(self, definition: DurableAgent[Any, Any]):
        _claim(definition)
        self.definition = definition
        self.agent = definition.build('dbos')

    async def run(self, prompt: str | None = None, *, conversation_id: str | None = None, **kwargs: Any) -> Any:
        """One turn (`turn.run_turn`) on the DBOS-built agent; returns upstream's `AgentRunResult`.

        With `conversation_id`, the stored history is loaded and the new messages appended in DBOS steps
        (`durcap__{name}__conversation.load` / `.append`, the append idempotent by workflow id).

        Raises:
            DurableConfigError: capabilities passed per run (DC012); drift in the stored history.
        """
        return (await self.turn(prompt, conversation_id=conversation_id, **kwargs)).result

    async def turn(self, prompt: str | None = None, *, conversation_id: str | None = None, **kwargs: Any) -> Turn:
        """As `run`, returning the whole `turn.Turn`."""
        load, append = _conversation_steps(self.definition)
        return await run_turn(self.definition, self.agent.run, prompt, conversation_id=conversation_id, load=load,
                              append=append, gate=DBOSApprovalGate(self.definition), **kwargs)


def _conversation_steps(agent: DurableAgent[Any, Any]) -> tuple[Any, Any]:
    """The store units as DBOS steps: recovery returns the recorded history instead of reading again, and the
    append (idempotent by workflow id) is retried by DBOS while the store is down (`APPEND_STEP_RETRIES`),
    never on a conflict (`PERMANENT_STORE_ERRORS`)."""
    load_step, append_step = conversation_step_names(agent)

    async def load(conversation_id: str) -> Any:
        return await DBOS.run_step_async({'name': load_step}, load_conversation, agent, conversation_id)

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> Any:
        async def body() -> Any:
            try:
                return await append_conversation(
                    agent, conversation_id, messages, expected_revision=revision,
                    append_id=f'dbos:{DBOS.workflow_id}', usage=usage,
                )
            except PERMANENT_STORE_ERRORS as error:
                return _Raised(error)  # a conflict cannot succeed: recorded, not retried

        result = await DBOS.run_step_async({'name': append_step, **APPEND_STEP_RETRIES}, body)  # type: ignore[arg-type]
        if isinstance(result, _Raised):
            raise result.error
        return result

    return load, append


def conversation_step_names(agent: DurableAgent[Any, Any]) -> tuple[str, str]:
    """Step names of the conversation load and append: `durcap__{name}__conversation.load` / `.append`."""
    prefix = f'durcap__{agent.durable_name}__conversation'
    return f'{prefix}.load', f'{prefix}.append'


def workflow_names(agent: DurableAgent[Any, Any]) -> list[str]:
    """The DBOS workflow names `agent_workflow` registers: `durcap.{name}` and one per previous name."""
    return [f'{WORKFLOW_NAME_PREFIX}{n}' for n in (agent.name, *agent.previous_names)]


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
_PREVIOUS_NAME_WORKFLOWS: set[str] = set()
"""DBOS workflow names `agent_workflow` registered only for an agent's previous names (see `application_version`)."""

APPEND_STEP_RETRIES: dict[str, Any] = {'retries_allowed': True, 'interval_seconds': 1.0, 'backoff_rate': 1.5, 'max_attempts': 40}
"""Retries of the conversation-append step: the run's side effects happened, so keep trying while the store is
down: 1 s, then x1.5 each time (DBOS caps a wait at 1 h), 40 attempts, about 22 hours in all."""


def _permanent_store_errors() -> tuple[type[BaseException], ...]:
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
        _claim(agent)  # DC011 when another definition has one of the agent's names
        return existing
    bound = BoundAgent(agent)  # claims the agent's names first

    async def run_agent(
        prompt: str | None, deps: Any = None, message_history: Any = None, conversation_id: str | None = None
    ) -> dict[str, Any]:
        turn = await bound.turn(prompt, deps=deps_from_json(agent, deps), message_history=message_history,
                                conversation_id=conversation_id)
        return turn.payload()

    name, *previous_names = workflow_names(agent)
    registered = DBOS.workflow(name=name)(run_agent)
    for previous in previous_names:
        # Workflows recorded under an earlier agent name recover through the same body.
        async def run_previous(
            prompt: str | None, deps: Any = None, message_history: Any = None, conversation_id: str | None = None
        ) -> dict[str, Any]:
            return await run_agent(prompt, deps, message_history, conversation_id)

        DBOS.workflow(name=previous)(run_previous)
        _PREVIOUS_NAME_WORKFLOWS.add(previous)
    _WORKFLOWS[agent.name] = registered
    return registered


# ---- the adapter ---------------------------------------------------------------------------------


def _journal_ids(agent: DurableAgent[Any, Any]) -> list[Any]:
    """Upstream's operation ids for every durable operation of the agent's built `DBOSDurability`."""
    ids: list[Any] = [
        ModelRequestId(None, streaming=False, model_name='default'),
        ModelRequestId(None, streaming=True, model_name='default'),
        ModelCompactMessagesId(None, model_name='default'),
        ModelCancelSuspendedResponseId(None, model_name='default'),
        ToolsetCallToolId('function', toolset_id='<agent>'),
    ]
    for kind, toolset_id in leaf_kinds(agent):
        ids.append(ToolsetCallToolId(kind, toolset_id=toolset_id))  # type: ignore[arg-type]
        if kind in ('mcp', 'dynamic'):
            ids.append(ToolsetGetToolsId(kind, toolset_id=toolset_id))  # type: ignore[arg-type]
        if kind == 'mcp':
            ids.append(ToolsetGetInstructionsId(toolset_id))
    return ids


class DBOSAdapter(EngineAdapter):
    """DBOS: a workflow per agent (`agent_workflow`), steps for model requests, tools, MCP and the store.

    Run settings: `db` (system database URL; default SQLite at `.durcap/dbos.sqlite`).
    """

    name = 'dbos'
    unit, units, container, run_id_label = 'step', 'steps', 'workflow', 'workflow id'
    extra, requires = 'dbos', 'dbos'
    features = frozenset({'worker'})
    lock_sections: Mapping[str, str] = {'workflows': 'workflow', 'steps': 'step'}

    def listing_note(self, settings: Mapping[str, Any]) -> str | None:
        """A note when `--db` names a SQLite file that does not exist (the listings then show nothing, and reading
        does not create the file); the default system database, absent before the first run, gets none."""
        from ._dbos_runs import _missing_sqlite_file

        if not settings.get('db') or (missing := _missing_sqlite_file(settings)) is None:
            return None
        return f'dbos: no system database at {missing}: nothing has run there (check the path: pass the --db the runs used)'

    def durability_class(self) -> Any:
        return ToolStepDurability

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return durability_parts(agent, options)

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        """Step names from upstream's `DBOSOperationNamer` (the names `DBOSDurability` and `ToolStepDurability`
        register), the conversation steps, and the workflow names of `agent_workflow`."""
        namer = DBOSOperationNamer(agent.durable_name)
        steps = {namer.operation_name(i) for i in _journal_ids(agent)} | set(conversation_step_names(agent))
        steps.add(approval_step_name(agent))
        return {'workflows': sorted(workflow_names(agent)), 'steps': sorted(steps)}

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        return list(conversation_step_names(agent))

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        return "DurableAgent(engine_options={'dbos': {'mcp_step_config': {'max_attempts': ...}}})"

    def mcp_passes_through(self, error: BaseException) -> bool:
        dbos_error, retries_exceeded = _upstream.dbos_error_classes()
        return isinstance(error, dbos_error) and not isinstance(error, retries_exceeded)

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:

        workflow_fn = agent_workflow(agent)
        url = system_database_url(options.setting('db'))
        options.notify(f'dbos system database: {redact_database_url(url)}')
        # A step retry logs one WARNING line (ModelRetryLogLine drops its traceback); the run's failure is reported
        # once, in `durcap run`'s own line (capability, error, innermost cause).
        launch('durcap', system_database_url_=url, one_shot=True, executor_id=options.setting('executor_id'))
        try:
            workflow_id = options.run_id or f'{agent.name}-{uuid.uuid4()}'
            options.started(workflow_id, f'dbos workflow id: {workflow_id} (executor {DBOS.executor_id})')
            history = options.message_history
            history_json = ModelMessagesTypeAdapter.dump_python(list(history), mode='json') if history else None
            deps = to_jsonable_python(options.deps) if options.deps is not None else None
            with SetWorkflowID(workflow_id):
                payload = await workflow_fn(prompt, deps, history_json, options.conversation_id)
            steps = await DBOS.list_workflow_steps_async(workflow_id)
        finally:
            DBOS.destroy()
        return RunReport.from_payload('dbos', workflow_id, payload, [step['function_name'] for step in steps])

    def serve_worker(self, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
        """Serve `agents`' workflows as a long-lived DBOS executor until SIGTERM / SIGINT.

        Settings: `db` (system database URL), `executor_id` (default `local`, DBOS's own default: launch
        recovers that executor's pending workflows), `task_queue` (the DBOS queue served, default `durcap`,
        where `durcap runs resume` hands runs), `graceful_shutdown` (seconds running workflows get to finish).
        """
        import signal
        import threading

        for agent in agents:
            agent_workflow(agent)
        executor = options.setting('executor_id', 'local')
        queue = options.setting('task_queue', WORKER_QUEUE)
        url = system_database_url(options.setting('db'))
        from sqlalchemy.exc import OperationalError, ProgrammingError

        client = _client({'db': url})
        try:
            pending = client.list_workflows(status='PENDING', executor_id=executor, load_input=False, load_output=False)
        except (OperationalError, ProgrammingError):  # a new system database: DBOS creates its tables at launch
            pending = []
        finally:
            client.destroy()
        launch('durcap', system_database_url_=url, executor_id=executor)
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            DBOS.register_queue(queue)
            options.notify(f'dbos worker ready: executor {executor!r} (recovering {len(pending)} pending '
                           f'workflows), queue {queue!r}, system database {redact_database_url(url)}, application version '
                           f'{DBOS.application_version}; Ctrl-C or SIGTERM to stop')
            stop.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            DBOS.destroy(workflow_completion_timeout_sec=int(options.setting('graceful_shutdown', 30)))

    # ---- the operator side (`durcap runs`, `durcap approvals`): `_dbos_runs` ----------------------------------

    async def list_runs(self, settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
        from . import _dbos_runs

        return await _dbos_runs.list_runs(settings, status=status, limit=limit)

    async def show_run(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        from . import _dbos_runs

        return await _dbos_runs.show_run(run_id, settings)

    async def cancel(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        from . import _dbos_runs

        return await _dbos_runs.cancel(run_id, settings)

    async def resume(self, run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
        from . import _dbos_runs

        return await _dbos_runs.resume(run_id, agents, options)

    async def pending_approvals(self, settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
        from . import _dbos_runs

        return await _dbos_runs.pending_approvals(settings, run_id)

    async def decide(self, run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
        from . import _dbos_runs

        return await _dbos_runs.decide(run_id, decision, settings)


def _client(settings: Mapping[str, Any]) -> Any:
    """A `DBOSClient` on `settings['db']` (default system database): runs and approvals read and send through it.

    Raises:
        RuntimeError: the system database cannot be reached (DBOSClient checks the connection when it is made) or
            DBOS refuses its URL (no database name): one line naming the database (password shown as ***) and the
            driver's reason, instead of SQLAlchemy's traceback and DBOS's own log line saying the same.
    """
    from dbos import DBOSClient

    url = system_database_url(settings.get('db'))
    try:
        with quiet_dbos_log('Error connecting to the DBOS system database'):  # raised below, in one line
            return DBOSClient(system_database_url=url)
    except Exception as exc:
        from sqlalchemy.exc import SQLAlchemyError

        from .._upstream import dbos_error_classes

        if not isinstance(exc, (SQLAlchemyError, dbos_error_classes()[0])):  # DBOS's own: a URL it refuses
            raise
        raise RuntimeError(f'cannot connect to the DBOS system database {redact_database_url(url)}: '
                           f'{database_error_line(exc)}') from None


@contextmanager
def quiet_dbos_log(*prefixes: str) -> Iterator[None]:
    """Drop the `dbos` logger's records whose message starts with one of `prefixes` while the block runs: for a
    database error the caller raises itself, in one line, which DBOS would also log with its traceback. The filter is
    the block's own (added and removed), so concurrent blocks never undo each other's, and the logger's level is
    never changed."""
    dbos_logger = logging.getLogger('dbos')
    quiet = _DropRecords(prefixes)
    dbos_logger.addFilter(quiet)
    try:
        yield
    finally:
        dbos_logger.removeFilter(quiet)


def database_error_line(exc: BaseException) -> str:
    """The first line of the database driver's own message (SQLAlchemy's `orig`), else of `exc`, else its type name:
    what the operator commands print after naming the system database."""
    detail = str(getattr(exc, 'orig', None) or exc).strip().splitlines()
    return detail[0] if detail else type(exc).__name__


class _DropRecords:
    """A `logging` filter dropping the records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes = prefixes

    def filter(self, record: Any) -> bool:
        return not record.getMessage().startswith(self.prefixes)


ADAPTER = DBOSAdapter()
