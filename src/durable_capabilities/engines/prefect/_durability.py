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

import asyncio
import copy
import dataclasses
import functools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prefect import flow, task
from prefect import serve as prefect_serve
from prefect.cache_policies import INPUTS, RUN_ID, CachePolicy
from prefect.exceptions import PrefectException
from pydantic_ai.durable_exec import ToolsetCallToolId, ToolsetGetInstructionsId, ToolsetGetToolsId
from pydantic_ai.durable_exec.prefect import (
    DEFAULT_PYDANTIC_AI_CACHE_POLICY,
    PrefectDurability,
    PrefectOperationNamer,
    TaskConfig,
)
from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelRequest, ModelResponse
from pydantic_ai.models import ModelRequestContext, ModelRequestParameters
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_ai.toolsets import ToolsetTool
from pydantic_core import to_jsonable_python

from .. import _registry
from .._limits import one_line, printable
from ..conversations import LoadedConversation, append_conversation, load_conversation
from ..store import AppendIdReuseError, ConversationConflictError, CorruptedRowError
from ..turn import RunReport, deps_from_json, run_turn
from . import _mcp, _retry_after, _retry_log
from ._adapter import EngineAdapter, RunInfo, RunOptions, leaf_kinds
from ._prefect_approvals import (  # noqa: F401 - public here, as before the split
    APPROVAL_CLOCK_TASK,
    DECISION_INPUT_PREFIX,
    PENDING_INPUT,
    SUSPEND_GRACE_SECONDS,
    PrefectApprovalGate,
    resume_expired,
    watch_deadlines,
)
from ._retry_after import MAX_RETRY_AFTER_SECONDS, RetryAfterDelays
from .prefect_entry import TARGET_ENV, entrypoint

if TYPE_CHECKING:
    from ..agent import DurableAgent
    from ..approvals import Decision, PendingCall

FLOW_NAME_PREFIX = 'durcap-'
"""Flow name: `durcap-{agent name}`."""

CONVERSATION_TASKS = ('Load Conversation', 'Append Conversation')
"""Task names of the conversation load and append."""


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


DEFAULT_TOOL_RETRIES = 2
"""Retries for a function-tool task (3 attempts in all), 1 s apart."""

for _logger_name in ('prefect.task_runs', 'prefect.flow_runs'):  # a failed model request: Prefect's one line, no traceback
    logging.getLogger(_logger_name).addFilter(_retry_log.TracebacklessModelErrors())

DEFAULT_MODEL_RETRIES = 2
"""Retries for a model request task (3 attempts in all, 2 s then 4 s apart, or the provider's `retry-after` up to
`MAX_RETRY_AFTER_SECONDS`); Prefect's own default is none (`@task(retries=0)`), so a stream the provider cut half way
would fail the flow. Errors another attempt cannot fix (401, 404 model, quota) are not retried
(`retry_model_request`). Each attempt carries the provider SDK's own retries (2, honouring `retry-after` on
429/503)."""

DEFAULT_MODEL_RETRY_DELAYS = (2.0, 4.0)
"""Seconds before the model request task's first and second retry when the error carried no `retry-after`."""

_logger = logging.getLogger(__name__)


async def retry_model_request(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect `retry_condition_fn` of model request tasks: retry unless the provider rejected the request (pydantic-ai's
    `ModelRequestRejectedError`: 401, 403, 404 model, context window) or the quota is exhausted, the errors pydantic-ai's
    Temporal integration also leaves unretried (`TemporalDurability(non_retryable_model_errors=...)` default).

    An error with a `retry-after` makes the retry wait that long (`_retry_after.RetryAfterDelays`, the task's
    `retry_delay_seconds`); one above `MAX_RETRY_AFTER_SECONDS` is not retried (one log line says so)."""
    import inspect

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
    tool retries, merged with `options` (the user's keys win)."""
    options = dict(options)
    policy = DeterministicInputs()
    tool_defaults: dict[str, Any] = {'cache_policy': policy, 'retries': DEFAULT_TOOL_RETRIES, 'retry_delay_seconds': 1.0,
                                     'task_run_name': tool_run_namer(agent)}
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


AGENT_TOOLSET_ID = '<agent>'
"""pydantic-ai's id of the agent's own function toolset (`Agent(tools=[...])`); its tools' task runs are named
`{agent name}.{tool}`."""


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
    found = _mcp.guard(agent, 'prefect', lambda leaf_id: int(config['retries']) + 1)
    return [found] if found is not None else []


def flow_name(agent: DurableAgent[Any, Any]) -> str:
    return f'{FLOW_NAME_PREFIX}{agent.name}'


_FLOWS: dict[str, Any] = {}


def agent_flow(agent: DurableAgent[Any, Any]) -> Any:
    """The Prefect flow that runs `agent` (one per agent name and process).

    Flow parameters (JSON, so deployments and schedules can carry them): `prompt: str | None`,
    `deps: dict | None` (validated into `deps_type`), `message_history: list[dict] | None`
    (pydantic-ai's message JSON), `conversation_id: str | None`. Returns
    `{'output': ..., 'new_messages': '[...]', 'usage': {...}}` as JSON-compatible data, `new_messages` being the new
    messages as one JSON string (`ModelMessagesTypeAdapter.validate_json` reads it; see `Turn.payload` for why).
    """
    _registry.claim('Prefect flow', agent.name, agent, 'given Prefect flows in this process')  # DC011 on a clash
    existing = _FLOWS.get(agent.name)
    if existing is not None and existing.__durcap_agent__ is agent:
        return existing
    built = agent.build('prefect')
    load_task, append_task = _conversation_tasks(agent)

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> Any:
        from prefect.runtime import flow_run  # lazily: the run context, read only inside a flow run

        return await append_task(conversation_id, messages, revision, f'prefect:{flow_run.id}', usage)

    async def run_agent(
        prompt: str | None = None,
        deps: dict[str, Any] | None = None,
        message_history: list[dict[str, Any]] | None = None,
        conversation_id: str | None = None,
    ) -> dict[str, Any]:
        turn = await run_turn(agent, built.run, prompt, deps=deps_from_json(agent, deps), message_history=message_history,
                              conversation_id=conversation_id, load=load_task, append=append,
                              gate=PrefectApprovalGate(agent))
        return turn.payload(messages_as_json=True)

    run_agent.__name__ = re.sub(r'\W', '_', f'run_{agent.name}')
    decorated = flow(name=flow_name(agent), persist_result=True)(run_agent)
    decorated.__durcap_agent__ = agent  # type: ignore[attr-defined]
    _FLOWS[agent.name] = decorated
    return decorated


def _conversation_tasks(agent: DurableAgent[Any, Any]) -> tuple[Any, Any]:
    """Prefect tasks `Load Conversation` and `Append Conversation` (store I/O only runs in tasks).

    Cached on their inputs and the flow run id, so a flow run resumed after a crash replays them
    instead of reading or appending again; the append is also idempotent by its append id.
    """

    async def load(conversation_id: str) -> LoadedConversation:
        return await load_conversation(agent, conversation_id)

    async def append(
        conversation_id: str, messages: list[dict[str, Any]], expected_revision: int | None, append_id: str,
        usage: dict[str, Any] | None,
    ) -> int:
        return await append_conversation(
            agent, conversation_id, messages, expected_revision=expected_revision, append_id=append_id, usage=usage
        )

    options: dict[str, Any] = {'cache_policy': INPUTS + RUN_ID, 'persist_result': True}
    return (
        task(name=CONVERSATION_TASKS[0], **options)(load),
        # Side effects happened: retry while the store is down (about 17 min), never a conflict.
        task(name=CONVERSATION_TASKS[1], retries=12, retry_delay_seconds=[1, 2, 4, 8, 15, 30, 60, 120, 240],
             retry_condition_fn=_retry_append, **options)(append),
    )


def _retry_append(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition of the append task: retry unless the store refused for good (a conflict)."""
    return not isinstance(getattr(state, 'data', None), (ConversationConflictError, AppendIdReuseError, CorruptedRowError))


def serve(
    agent: DurableAgent[Any, Any],
    *,
    target: str,
    prompt: str,
    cron: str | None = None,
    interval_seconds: float | None = None,
    deps: dict[str, Any] | None = None,
    deployment_name: str | None = None,
) -> None:
    """Serve the agent's flow as a scheduled deployment (Prefect `serve`); blocks until interrupted.

    Also runs `watch_deadlines`: a flow run of the deployment Suspended on an approval gate is resumed (and its
    calls denied) once their deadline has passed.

    Args:
        agent: The definition (already validated).
        target: Where flow-run processes load it from (`pkg.module:attr` or `path/to/file.py:attr`):
            Prefect starts each scheduled run in a new process from the deployment's entrypoint.
        prompt: The prompt of every run. cron / interval_seconds: the schedule (exactly one).
        deps: JSON deps of every run. deployment_name: default `<agent>-scheduled`.

    Raises:
        ValueError: neither or both of `cron` and `interval_seconds` given.
    """
    if (cron is None) == (interval_seconds is None):
        raise ValueError('give exactly one of cron or interval_seconds')
    os.environ[TARGET_ENV] = target  # inherited by the processes that run each flow run
    deployment = agent_flow(agent).to_deployment(
        name=deployment_name or f'{agent.name}-scheduled',
        cron=cron,
        interval=interval_seconds,
        parameters={'prompt': prompt, 'deps': deps},
    )
    deployment.entrypoint = entrypoint(agent.name)
    watch_deadlines(agent)  # resumes suspended runs whose approval deadline passed (see PrefectApprovalGate)
    prefect_serve(deployment, print_starting_message=False)


# ---- the adapter ---------------------------------------------------------------------------------


_TEMPORARY_SERVER: list[Any] = []
"""The temporary local Prefect server this process started (at most one; see `ensure_api`)."""


def configured_api() -> str | None:
    """The Prefect API URL configured for this process (`PREFECT_API_URL`, or the active Prefect profile), or `None`."""
    from prefect.settings import get_current_settings

    return get_current_settings().api.url or None


def ensure_api() -> tuple[str, bool]:
    """The Prefect API this process talks to: `(url, temporary)`.

    The configured one (`configured_api`), else a temporary local server this process starts once (`prefect server
    start` on a free port, on the database of the user's Prefect home, as Prefect's own temporary server would) and
    points every Prefect client of the process at (`PREFECT_API_URL` and `refresh_global_settings_context`, so
    Prefect's background threads see it too). The server dies with this process, even on `kill -9`
    (`_servers.start_prefect_server(die_with_parent=True)`), and is stopped at exit.

    Raises:
        RuntimeError / TimeoutError: the temporary server did not come up.
    """
    if _TEMPORARY_SERVER:
        return _TEMPORARY_SERVER[0].address, True
    url = configured_api()
    if url:
        return url, False
    import atexit

    from prefect.context import refresh_global_settings_context

    from .._servers import start_prefect_server

    server = start_prefect_server(home=None, die_with_parent=True)
    _TEMPORARY_SERVER.append(server)
    atexit.register(server.stop)
    os.environ['PREFECT_API_URL'] = server.address
    refresh_global_settings_context()
    return server.address, True


def server_line() -> str:
    """The line a run prints before it starts: which Prefect API it uses (starting the temporary server if needed)."""
    url, temporary = ensure_api()
    if temporary:
        return (f'prefect server: temporary local server at {url}, started by this command and stopped with it '
                '(PREFECT_API_URL is not set)')
    return f'prefect server: {url}'


async def _task_runs(flow_run_id: Any) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        return list(await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))))


async def _settled_task_runs(flow_run_id: Any, model_requests: int, timeout: float = 30.0,
                             orphans: frozenset[str] = frozenset()) -> list[Any]:
    """The flow run's task runs once Prefect has recorded them all.

    Prefect 3 records task runs from events, asynchronously: listed right after the flow returns, the
    last ones can be missing. Poll (up to `timeout` seconds) until every task run is final, there is a
    `Model Request` task per model response, and the list has not changed for a second.

    `orphans`: ids of task runs a dead process left unfinished (Running forever) before this process ran the flow
    run again (`durcap runs resume`); they are left out (waiting for them to finish cost the whole `timeout`).
    """

    from prefect import get_client  # lazily: the API client (httpx) loads only to wait for a run
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    previous: list[tuple[str, str]] = []
    stable_since = time.monotonic()
    async with get_client() as client:
        while True:
            runs = [r for r in await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                    if str(r.id) not in orphans]
            snapshot = sorted((str(r.id), str(r.state_type)) for r in runs)
            if snapshot != previous:
                previous, stable_since = snapshot, time.monotonic()
            done = all(r.state is not None and r.state.is_final() for r in runs)
            enough = sum(1 for r in runs if r.name.startswith('Model Request')) >= model_requests
            if (done and enough and time.monotonic() - stable_since >= 1.0) or time.monotonic() > deadline:
                return list(runs)
            await asyncio.sleep(0.2)


async def _run_flow_run(flow_: Any, flow_run_id: Any, parameters: dict[str, Any]) -> RunReport:
    """Run an existing flow run of `flow_` in this process and report it (task runs settled)."""
    from prefect import get_client
    from prefect.flow_engine import run_flow_async

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
    # A flow run run again (resume) may hold task runs its dead process left Running: not this run's to wait for.
    orphans = frozenset(str(t.id) for t in await _task_runs(flow_run_id) if t.state is None or not t.state.is_final())
    state: Any = await run_flow_async(flow_, flow_run=flow_run, parameters=parameters, return_type='state')
    report = RunReport.from_payload('prefect', str(flow_run_id), await state.result())
    model_requests = sum(1 for m in report.new_messages if m.kind == 'response')
    task_runs = await _settled_task_runs(flow_run_id, model_requests, orphans=orphans)
    report.durable_units = [t.name for t in sorted(task_runs, key=lambda t: (t.expected_start_time or t.created, t.name))]
    return report


class PrefectAdapter(EngineAdapter):
    """Prefect: a flow per agent (`agent_flow`), tasks for model requests, tools, MCP and the store.

    Runs go to `PREFECT_API_URL` when set, else to Prefect's ephemeral local server.
    """

    name = 'prefect'
    unit, units, container, run_id_label = 'task', 'tasks', 'flow', 'flow run id'
    extra, requires = 'prefect', 'prefect'
    features = frozenset({'schedule'})
    lock_sections: Mapping[str, str] = {'flows': 'flow', 'tasks': 'task', 'cache_toolset_ids': 'cache toolset id'}

    def durability_class(self) -> Any:
        return PrefectDurability

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return durability_parts(agent, options)

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        """Task names from upstream's `PrefectOperationNamer` (tool calls labelled with the static tool name;
        model requests as `Model Request`, without the model name upstream appends), the conversation tasks,
        the flow name, and the toolset ids Prefect's cache keys hold (its identity for a task run)."""
        namer = PrefectOperationNamer()
        tasks = {'Model Request', APPROVAL_CLOCK_TASK, *CONVERSATION_TASKS}
        tasks |= {namer.invocation_name(ToolsetCallToolId('function', toolset_id='<agent>'), label=tool).operation_name
                  for tool in agent.static_tool_names()}
        kinds = leaf_kinds(agent)
        for kind, toolset_id in kinds:
            if kind == 'mcp':
                tasks |= {namer.operation_name(ToolsetGetToolsId('mcp', toolset_id=toolset_id)),
                          namer.operation_name(ToolsetGetInstructionsId(toolset_id)),
                          namer.operation_name(ToolsetCallToolId('mcp', toolset_id=toolset_id))}
            elif kind == 'dynamic':
                tasks.add(namer.operation_name(ToolsetGetToolsId('dynamic', toolset_id=toolset_id)))
        return {'flows': [flow_name(agent)], 'tasks': sorted(tasks),
                'cache_toolset_ids': sorted({toolset_id for _, toolset_id in kinds})}

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        return list(CONVERSATION_TASKS)

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        return "DurableAgent(engine_options={'prefect': {'mcp_task_config': {'retries': ...}}})"

    def mcp_passes_through(self, error: BaseException) -> bool:
        return isinstance(error, PrefectException)

    def unconfigured(self, settings: Mapping[str, Any]) -> str | None:
        if configured_api() or _TEMPORARY_SERVER:
            return None
        return ('prefect: skipped, no PREFECT_API_URL configured (`--engine prefect` reads the database of Prefect\'s '
                'temporary local server)')

    def listing_note(self, settings: Mapping[str, Any]) -> str | None:
        """When no Prefect API is configured: the listing reads the database of Prefect's temporary local server, which
        holds only the runs made here without a server (a command asking every engine skips Prefect instead)."""
        if configured_api() or _TEMPORARY_SERVER:
            return None
        return ('prefect: no PREFECT_API_URL configured: reading the database of Prefect\'s temporary local server (set '
                'PREFECT_API_URL to read your server)')

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:

        os.environ.setdefault('PREFECT_SERVER_ANALYTICS_ENABLED', 'false')
        from prefect import get_client

        options.notify(server_line())

        history = options.message_history
        parameters = {
            'prompt': prompt, 'deps': to_jsonable_python(options.deps) if options.deps is not None else None,
            'message_history': ModelMessagesTypeAdapter.dump_python(list(history), mode='json') if history else None,
            'conversation_id': options.conversation_id,
        }
        flow_ = agent_flow(agent)
        async with get_client() as client:
            flow_run = await client.create_flow_run(flow_, parameters=parameters)
        options.started(str(flow_run.id), f'prefect flow run id: {flow_run.id} (at {ensure_api()[0]})')
        return await _run_flow_run(flow_, flow_run.id, parameters)

    def serve_schedule(
        self, agent: DurableAgent[Any, Any], *, target: str, prompt: str, cron: str | None, interval_seconds: float | None,
        deps: Any, deployment_name: str | None, notify: Callable[[str], None],
    ) -> None:
        """A scheduled deployment of the agent's flow, served by `prefect.serve` (see `serve`).

        Raises:
            RuntimeError: no Prefect API is configured (`PREFECT_API_URL` in the environment or the Prefect
                profile): a schedule on Prefect's temporary local server would never run.
            ValueError: `cron` is not a cron expression Prefect accepts (code DC040), checked before anything starts.
        """
        from prefect.client.schemas.schedules import CronSchedule
        from prefect.settings import get_current_settings
        from pydantic import ValidationError

        if cron is not None:
            try:
                CronSchedule(cron=cron)
            except ValidationError as exc:
                reason = exc.errors()[0]['msg'].removeprefix('Value error, ')
                raise ValueError(f'DC040 --cron {printable(repr(cron))}: not a cron expression ({one_line(reason)}); '
                                 'write five fields, e.g. "0 9 * * *" (09:00 every day)') from None

        if not get_current_settings().api.url:
            raise RuntimeError('no Prefect API configured: a schedule needs a Prefect server that outlives this command. '
                               'Start one (`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api')
        notify(f'serving deployment {deployment_name or agent.name + "-scheduled"!r} of flow {flow_name(agent)} '
               f'({"cron " + cron if cron else f"every {interval_seconds:g} s"}); Ctrl-C or SIGTERM to stop')
        serve(agent, target=target, prompt=prompt, cron=cron, interval_seconds=interval_seconds, deps=deps,
              deployment_name=deployment_name)

    # ---- the operator side (`durcap runs`, `durcap approvals`): `_prefect_runs` -------------------------------

    async def list_runs(self, settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
        from . import _prefect_runs

        return await _prefect_runs.list_runs(settings, status=status, limit=limit)

    async def show_run(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        from . import _prefect_runs

        return await _prefect_runs.show_run(run_id, settings)

    async def cancel(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        from . import _prefect_runs

        return await _prefect_runs.cancel(run_id, settings)

    async def resume(self, run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
        from . import _prefect_runs

        return await _prefect_runs.resume(run_id, agents, options)

    async def pending_approvals(self, settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
        from . import _prefect_runs

        return await _prefect_runs.pending_approvals(settings, run_id)

    async def decide(self, run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
        from . import _prefect_runs

        return await _prefect_runs.decide(run_id, decision, settings)


ADAPTER = PrefectAdapter()
