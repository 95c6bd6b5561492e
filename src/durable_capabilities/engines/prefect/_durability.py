"""Prefect: a flow per `DurableAgent`, deterministic task cache keys, schedules and deployments.

Upstream `PrefectDurability` runs model requests, tools and MCP calls as tasks whose cache key is
their inputs plus the task source plus the flow run id, so a retried flow run replays finished
tasks. Its model-request key hashes `ModelRequestParameters`, whose `revealed_tool_names`,
`introduced_tool_names` and `deferred_capability_ids` are Python sets: Prefect's JSON hashing keeps
their iteration order, which changes with `PYTHONHASHSEED`, so a flow run resumed in another process
missed the cache for every request made after a capability was loaded and ran it again.
`DeterministicInputs` sorts those sets (and any in the user's values: tool arguments, tool results) before hashing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect.cache_policies import CachePolicy
from pydantic_ai.durable_exec import ToolsetCallToolId, ToolsetGetInstructionsId, ToolsetGetToolsId
from pydantic_ai.durable_exec.prefect import DEFAULT_PYDANTIC_AI_CACHE_POLICY, PrefectOperationNamer, TaskConfig
from pydantic_ai.messages import ModelRequest, ModelResponse
from pydantic_ai.models import ModelRequestContext, ModelRequestParameters
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_ai.toolsets import ToolsetTool

from .. import _mcp, _retry_after, _retry_log
from .._adapter import leaf_kinds
from .._retry_after import MAX_RETRY_AFTER_SECONDS, RetryAfterDelays
from ._results import ToolResultPieces
from ._spec import (
    AGENT_TOOLSET_ID,
    APPROVAL_CLOCK_TASK,
    CONVERSATION_TASKS,
    DEFAULT_MODEL_RETRIES,
    DEFAULT_MODEL_RETRY_DELAYS,
    DEFAULT_TOOL_RETRIES,
    ENGINE,
    MODEL_REQUEST_TASK,
    TOOL_RETRY_DELAY_SECONDS,
    flow_name,
)

if TYPE_CHECKING:
    from ...agent import DurableAgent

_SET_ANNOTATION = re.compile(r'\b(?:set|frozenset|Set|FrozenSet|AbstractSet|MutableSet)\b')
_USER_VALUE_FIELDS = ('content', 'args', 'metadata')
"""Fields of message parts and messages that hold the user's own values (a tool's return value, its arguments,
metadata), where a set can be; every other field of a message is pydantic-ai's, without sets."""


@functools.cache
def _set_fields(cls: type) -> tuple[str, ...]:
    """The fields of dataclass `cls` whose annotation allows a set (`set[str]`, `frozenset[...]`, ...)."""
    return tuple(f.name for f in dataclasses.fields(cls) if _SET_ANNOTATION.search(str(f.type)))


def _sorted_set(value: set[Any] | frozenset[Any]) -> list[Any]:
    return sorted(value, key=repr)


def _with(value: Any, changed: dict[str, Any]) -> Any:
    """A shallow copy of dataclass `value` with the fields in `changed` replaced (frozen dataclasses too)."""
    result = copy.copy(value)
    for name, normalized in changed.items():
        object.__setattr__(result, name, normalized)
    return result


def _plain(value: Any) -> Any:
    """`value` (a user's value: plain data) with every set inside lists, tuples and dicts sorted; `value` itself
    when it holds none. Objects other than those containers are left as they are."""
    kind = type(value)
    if kind is str or value is None or kind is int or kind is float or kind is bool:
        return value
    if kind is set or kind is frozenset or isinstance(value, (set, frozenset)):
        return _sorted_set(value)
    if kind is dict or isinstance(value, dict):
        changed = {k: n for k, v in value.items() if (n := _plain(v)) is not v}
        return {**value, **changed} if changed else value
    if kind is list or kind is tuple or isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        if all(n is v for n, v in zip(items, value, strict=True)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    return value


def _user_fields(value: Any) -> Any:
    """A message, message part or event with the sets in its user-value fields (`_USER_VALUE_FIELDS`) sorted."""
    changed = {}
    for name in _USER_VALUE_FIELDS:
        current = getattr(value, name, None)
        if current is not None and type(current) is not str and (normalized := _plain(current)) is not current:
            changed[name] = normalized
    return _with(value, changed) if changed else value


def _message(message: Any) -> Any:
    """A `ModelRequest` / `ModelResponse` with the sets in its parts' (and its own) user values sorted."""
    parts = message.parts
    normalized = [_user_fields(part) for part in parts]
    changed = {}
    if any(n is not p for n, p in zip(normalized, parts, strict=True)):
        changed['parts'] = normalized
    metadata = getattr(message, 'metadata', None)
    if metadata is not None and (sorted_metadata := _plain(metadata)) is not metadata:
        changed['metadata'] = sorted_metadata
    return _with(message, changed) if changed else message


def _request_parameters(params: ModelRequestParameters) -> ModelRequestParameters:
    """`ModelRequestParameters` with its set fields (revealed / introduced tool names, deferred capability ids, ...:
    every field annotated as a set) sorted; its tool definitions are pydantic-ai's JSON schemas, but for their
    `metadata` (the user's)."""
    changed: dict[str, Any] = {}
    for name in _set_fields(type(params)):
        current = getattr(params, name)
        if isinstance(current, (set, frozenset)):
            changed[name] = _sorted_set(current)
    for name in ('function_tools', 'output_tools'):
        tools = getattr(params, name, None)
        if not tools:
            continue
        normalized = [_user_fields(tool) if tool.metadata is not None else tool for tool in tools]
        if any(n is not t for n, t in zip(normalized, tools, strict=True)):
            changed[name] = normalized
    return _with(params, changed) if changed else params


def _task_input(value: Any) -> Any:
    """One task input with every set it can hold sorted (see `DeterministicInputs`); `value` itself when it holds none."""
    if value is None or type(value) is str or isinstance(value, RunContext):  # upstream's projection sorts a RunContext's sets
        return value
    if isinstance(value, ModelRequestParameters):
        return _request_parameters(value)
    if isinstance(value, (ModelRequest, ModelResponse)):
        return _message(value)
    if isinstance(value, ModelRequestContext):
        changed = {}
        if (messages := _task_input(value.messages)) is not value.messages:
            changed['messages'] = messages
        if (params := _request_parameters(value.model_request_parameters)) is not value.model_request_parameters:
            changed['model_request_parameters'] = params
        return _with(value, changed) if changed else value
    if isinstance(value, ToolsetTool):  # upstream hashes its toolset id and tool definition
        tool_def = value.tool_def
        if tool_def.metadata is None or (normalized := _user_fields(tool_def)) is tool_def:
            return value
        return _with(value, {'tool_def': normalized})
    if isinstance(value, ToolDefinition):
        return value if value.metadata is None else _user_fields(value)
    if isinstance(value, (list, tuple)):
        items = [_task_input(v) for v in value]
        if all(n is v for n, v in zip(items, value, strict=True)):
            return value
        return tuple(items) if isinstance(value, tuple) else items
    if hasattr(value, 'event_kind'):  # an agent stream event: its part or tool result holds the user's values
        changed = {}
        for name in ('part', 'result'):
            current = getattr(value, name, None)
            if current is not None and (normalized := _user_fields(current)) is not current:
                changed[name] = normalized
        return _with(value, changed) if changed else value
    return _plain(value)


@dataclasses.dataclass
class DeterministicInputs(CachePolicy):
    """Upstream's default cache policy with every set in the task inputs sorted first.

    Prefect hashes a task's inputs as JSON, which keeps a set's iteration order, and that order changes with
    `PYTHONHASHSEED`: a key holding a set differs between processes. Only the values that can hold a set are
    normalised (not every input walked): the set fields of `ModelRequestParameters` (found from its type hints:
    revealed and introduced tool names, deferred capability ids, ...), and the user's own values: tool call
    arguments (a `set[str]` parameter validates to a set), message parts' `content` / `args` / `metadata` (a
    tool may return a set), tool definitions' and messages' `metadata`, stream events' parts. Tool definitions'
    JSON schemas and every other field of pydantic-ai's types hold no sets and are not walked. A set is replaced
    by the list of its items sorted by `repr`. Upstream's policy projects `RunContext` itself, sorting its sets.

    Attributes:
        inner: The policy to delegate to (default: `DEFAULT_PYDANTIC_AI_CACHE_POLICY`, which is
            inputs + task source + flow run id).
    """

    inner: CachePolicy = dataclasses.field(default_factory=lambda: DEFAULT_PYDANTIC_AI_CACHE_POLICY)

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str | None:
        return self.inner.compute_key(task_ctx, normalized_inputs(inputs), flow_parameters, **kwargs)


def normalized_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """A task's inputs as `DeterministicInputs` hashes them: `inputs` with every set they can hold sorted, the
    unchanged values (and `inputs` itself when nothing changed) being the very same objects."""
    changed = {key: n for key, value in inputs.items() if (n := _task_input(value)) is not value}
    return {**inputs, **changed} if changed else inputs


for _logger_name in ('prefect.task_runs', 'prefect.flow_runs'):  # a failed model request: Prefect's one line, no traceback
    logging.getLogger(_logger_name).addFilter(_retry_log.ModelRetryLogLine())

_logger = logging.getLogger(__name__)


async def retry_model_request(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn` of model request tasks: retry unless the provider rejected the request (pydantic-ai's
    `ModelRequestRejectedError`: 401, 403, 404 model, context window) or the quota is exhausted, the errors pydantic-ai's
    Temporal integration also leaves unretried (`TemporalDurability(non_retryable_model_errors=...)` default).

    An error with a `retry-after` makes the retry wait that long (`_retry_after.RetryAfterDelays`, the task's
    `retry_delay_seconds`); one above `MAX_RETRY_AFTER_SECONDS` is not retried (one log line says so)."""
    result = state.result(raise_on_failure=False)
    if inspect.isawaitable(result):
        result = await result
    error = result if isinstance(result, BaseException) else None
    seconds = _retry_after.retry_after(error)
    RetryAfterDelays.wait_next(None)
    if _retry_after.unfixable(error):
        return False
    if error is not None and seconds is not None and seconds > MAX_RETRY_AFTER_SECONDS:
        _logger.warning('model request task %s failed: %s', getattr(task_run, 'name', ''),
                        _retry_after.over_cap_message(error, seconds))
        return False
    RetryAfterDelays.wait_next(seconds)  # read by Prefect right after this returns: the retry's delay
    return True


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`PrefectDurability(...)` keyword arguments: deterministic cache keys for model, tool and MCP tasks,
    tool retries, tool results whose long texts are kept in the conversation store (`_results.ToolResultPieces`),
    merged with `options` (the user's keys win)."""
    options = dict(options)
    policy = DeterministicInputs()
    tool_defaults: dict[str, Any] = {'cache_policy': policy, 'retries': DEFAULT_TOOL_RETRIES,
                                     'retry_delay_seconds': TOOL_RETRY_DELAY_SECONDS,
                                     'task_run_name': tool_run_namer(agent),
                                     # its long texts in the conversation store, once (`_results`)
                                     'result_serializer': ToolResultPieces()}
    defaults: dict[str, TaskConfig] = {
        'model_task_config': TaskConfig(cache_policy=policy, retries=DEFAULT_MODEL_RETRIES,
                                        retry_delay_seconds=RetryAfterDelays(DEFAULT_MODEL_RETRY_DELAYS),
                                        retry_condition_fn=retry_model_request),
        'tool_task_config': TaskConfig(**tool_defaults),
        'mcp_task_config': TaskConfig(cache_policy=policy),
    }
    for key, config in defaults.items():
        options[key] = TaskConfig(**{**config, **(options.get(key) or {})})  # type: ignore[typeddict-item]
    delays = options['model_task_config'].get('retry_delay_seconds')
    if isinstance(delays, int | float | list | tuple) and not isinstance(delays, RetryAfterDelays):  # the user's delays
        options['model_task_config']['retry_delay_seconds'] = RetryAfterDelays(
            [float(delays)] if isinstance(delays, int | float) else delays)
    return options, _mcp_defaults(agent, options)


def tool_run_namer(agent: DurableAgent[Any, Any]) -> Callable[..., str]:
    """Prefect `task_run_name` of a tool-call task: `{capability id}.{tool name}` (e.g.
    `account-security.revoke_sessions`), so the flow run's task runs say which capability each call belongs to.
    Prefect's default run name is the task name plus a random suffix (`Call Tool: get_weather-fea`).

    The capability is the one whose leaf toolset provided the tool (`DurableAgent.leaf_ids`); a tool of no
    capability is named after its toolset id, or the agent for an agent-level tool. Only the run's display name: the
    task name (in `durable.lock`) and the cache key are unchanged. Prefect calls it with the task's `parameters`;
    upstream's tool task carries the `ToolsetTool` being called among them (in `logical_inputs`, its cache key),
    which names its toolset.
    """
    owners = {leaf: capability for capability, leaves in agent.leaf_ids().items() for leaf in leaves}

    def name(parameters: dict[str, Any]) -> str:
        values = [*parameters.values(), *parameters.get('logical_inputs', ())]
        tool = next((v for v in values if isinstance(v, ToolsetTool)), None)
        if tool is None:  # not a tool call's task: keep a readable name
            return str(parameters.get('operation_name') or 'tool call')
        toolset_id = tool.toolset.id or AGENT_TOOLSET_ID
        owner = owners.get(toolset_id) or (agent.name if toolset_id == AGENT_TOOLSET_ID else toolset_id)
        return f'{owner}.{tool.tool_def.name}'

    return name


def mcp_task_config(attempts: int = _mcp.DEFAULT_MCP_ATTEMPTS) -> dict[str, Any]:
    """`PrefectDurability(mcp_task_config=...)` retry defaults (merged with the cache policy)."""
    return {'retries': attempts - 1, 'retry_delay_seconds': _mcp.DEFAULT_MCP_RETRY_INTERVAL_SECONDS}


def _mcp_defaults(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> list[Any]:
    """Add bounded retries to `options['mcp_task_config']` where the user set none; return the guard."""
    if options.pop(_mcp.GUARD_OPTION, True) is False or not _mcp.mcp_leaves(agent):
        return []
    config = dict(options.get('mcp_task_config') or {})
    for key, value in mcp_task_config().items():
        config.setdefault(key, value)
    options['mcp_task_config'] = config
    found = _mcp.guard(agent, ENGINE, lambda leaf_id: int(config['retries']) + 1)
    return [found] if found is not None else []


def durable_names(agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
    """Task names from upstream's `PrefectOperationNamer` (tool calls labelled with the static tool name;
    model requests as `Model Request`, without the model name upstream appends), the flow name, the toolset ids
    Prefect's cache keys hold (its identity for a task run), and the recovered tasks: the conversation tasks of flow
    runs recorded by earlier versions, which new flow runs no longer run but whose records a resumed run still reads
    (`_spec.CONVERSATION_TASKS`)."""
    namer = PrefectOperationNamer()
    tasks = {MODEL_REQUEST_TASK, APPROVAL_CLOCK_TASK}
    tasks |= {namer.invocation_name(ToolsetCallToolId('function', toolset_id=AGENT_TOOLSET_ID), label=tool).operation_name
              for tool in agent.static_tool_names()}
    kinds = leaf_kinds(agent)
    for kind, toolset_id in kinds:
        if kind == 'mcp':
            tasks |= {namer.operation_name(ToolsetGetToolsId('mcp', toolset_id=toolset_id)),
                      namer.operation_name(ToolsetGetInstructionsId(toolset_id)),
                      namer.operation_name(ToolsetCallToolId('mcp', toolset_id=toolset_id))}
        elif kind == 'dynamic':
            tasks.add(namer.operation_name(ToolsetGetToolsId('dynamic', toolset_id=toolset_id)))
    return {'flows': [flow_name(agent)], 'tasks': sorted(tasks), 'recovered_tasks': sorted(CONVERSATION_TASKS),
            'cache_toolset_ids': sorted({toolset_id for _, toolset_id in kinds})}
