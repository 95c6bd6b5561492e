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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from dbos import DBOS
from pydantic_ai.capabilities import AbstractCapability, CombinedCapability
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
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset, WrapperToolset

from .. import _mcp, _retry_after, _retry_log
from .._adapter import leaf_kinds
from .._retry_after import MAX_RETRY_AFTER_SECONDS
from ._conversation import Raised, in_workflow_code
from ._spec import (
    ENGINE,
    MODEL_STEP_ATTEMPTS,
    MODEL_STEP_INTERVAL_SECONDS,
    TOOL_STEP_ATTEMPTS,
    TOOL_STEP_INTERVAL_SECONDS,
    approval_step_name,
    conversation_step_names,
    workflow_names,
)

if TYPE_CHECKING:
    from ...agent import DurableAgent

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
    max_attempts: int = TOOL_STEP_ATTEMPTS
    interval_seconds: float = TOOL_STEP_INTERVAL_SECONDS
    backoff_rate: float = 2.0




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
        if not in_workflow_code():
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        result = await DBOS.run_step_async(self.options, self._step, name, tool_args, ctx, tool)  # type: ignore[arg-type]
        if isinstance(result, Raised):
            raise result.error
        return result

    async def _step(self, name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        """The step body: the tool call, with control-flow exceptions returned as `Raised` (recorded, not retried)."""
        try:
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)
        except _CONTROL_FLOW as error:
            return Raised(error)


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


def step_retry_attempt(record: logging.LogRecord) -> tuple[str, str | None] | None:
    """DBOS's "Step being automatically retried (attempt 2 of 3)" warning as `model request step (attempt 2 of 3)` for
    a model error, `step (attempt 2 of 3)` for any other (a tool step)."""
    message = str(record.msg)
    if not message.startswith(_STEP_RETRIED):
        return None
    return message.replace(_STEP_RETRIED, 'model request step'), message.replace(_STEP_RETRIED, 'step')


_STEP_RETRIED = 'Step being automatically retried'


logging.getLogger('dbos').addFilter(_retry_log.ModelRetryLogLine(step_retry_attempt))  # when this module is imported


class BusyLogLine(logging.Filter):
    """DBOS logs a workflow's exception with its traceback (`Exception encountered in asynchronous workflow`, ~80
    lines); a turn refused because another run's turn holds its conversation (`ConversationBusyError`, DC050, raised
    at its load before it did anything) is an expected outcome: one warning line with the refusal, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        from ...store import ConversationBusyError

        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, ConversationBusyError):
            record.msg, record.args = 'workflow %s refused: %s', (error.run_id or '?', error)
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, 'WARNING'
        return True


logging.getLogger('dbos').addFilter(BusyLogLine())


def retry_model_step(error: BaseException) -> bool:
    """DBOS `should_retry` of the model request step: retry it in the step (after the step's interval) unless another
    attempt cannot fix the error (401, 403, 404 model, exhausted quota: `_retry_after.unfixable`) or the provider
    asked for a wait (`retry-after`): that error ends the step, recorded, and `RetryAfterSleep` waits it in the
    workflow."""
    return not _retry_after.unfixable(error) and _retry_after.retry_after(error) is None


DEFAULT_MODEL_STEP_CONFIG: dict[str, Any] = {'retries_allowed': True, 'max_attempts': MODEL_STEP_ATTEMPTS,
                                             'interval_seconds': MODEL_STEP_INTERVAL_SECONDS,
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
        if seconds is None or not in_workflow_code():
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
    found = _mcp.guard(agent, ENGINE, lambda leaf_id: tries)
    return [found] if found is not None else []



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


def durable_names(agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
    """Step names from upstream's `DBOSOperationNamer` (the names `DBOSDurability` and `ToolStepDurability`
    register), the conversation steps, the approval clock step, and the workflow names of `agent_workflow`."""
    namer = DBOSOperationNamer(agent.durable_name)
    steps = {namer.operation_name(i) for i in _journal_ids(agent)} | set(conversation_step_names(agent))
    steps.add(approval_step_name(agent))
    return {'workflows': sorted(workflow_names(agent)), 'steps': sorted(steps)}
