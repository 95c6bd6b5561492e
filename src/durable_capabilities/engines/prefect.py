"""Prefect: a flow per `DurableAgent`, deterministic task cache keys, schedules and deployments.

Upstream `PrefectDurability` runs model requests, tools and MCP calls as tasks whose cache key is
their inputs plus the task source plus the flow run id, so a retried flow run replays finished
tasks. Its model-request key hashes `ModelRequestParameters`, whose `revealed_tool_names`,
`introduced_tool_names` and `deferred_capability_ids` are Python sets: Prefect's JSON hashing keeps
their iteration order, which changes with `PYTHONHASHSEED`, so a flow run resumed in another process
missed the cache for every request made after a capability was loaded and ran it again.
`DeterministicInputs` sorts every set before hashing.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import re
import time
from collections.abc import Callable, Mapping
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
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_ai.tools import RunContext
from pydantic_core import to_jsonable_python

from .. import _registry
from ..conversations import LoadedConversation, append_conversation, load_conversation
from ..store import AppendIdReuseError, ConversationConflictError, CorruptedRowError
from ..turn import RunReport, deps_from_json, run_turn
from . import _mcp
from ._adapter import EngineAdapter, RunOptions, leaf_kinds
from .prefect_entry import TARGET_ENV, entrypoint

if TYPE_CHECKING:
    from ..agent import DurableAgent

FLOW_NAME_PREFIX = 'durcap-'
"""Flow name: `durcap-{agent name}`."""

CONVERSATION_TASKS = ('Load Conversation', 'Append Conversation')
"""Task names of the conversation load and append."""


def _sorted_sets(value: Any, memo: dict[int, Any]) -> Any:
    """A copy of `value` with every set inside (containers, pydantic-ai dataclasses) as a sorted list."""
    key = id(value)
    if key in memo:
        return memo[key]
    if isinstance(value, (set, frozenset)):
        result: Any = sorted(value, key=repr)
    elif isinstance(value, list):
        result = [_sorted_sets(v, memo) for v in value]
    elif isinstance(value, tuple):
        result = tuple(_sorted_sets(v, memo) for v in value)
    elif isinstance(value, dict):
        result = {k: _sorted_sets(v, memo) for k, v in value.items()}
    elif (
        dataclasses.is_dataclass(value)
        and not isinstance(value, type)
        and not isinstance(value, RunContext)  # upstream projects it, sorting its sets itself
        and type(value).__module__.startswith('pydantic_ai')
    ):
        memo[key] = value
        changed = {}
        for f in dataclasses.fields(value):
            current = getattr(value, f.name)
            normalized = _sorted_sets(current, memo)
            if normalized is not current:
                changed[f.name] = normalized
        if not changed:
            return value
        result = copy.copy(value)
        for name, normalized in changed.items():
            object.__setattr__(result, name, normalized)
    else:
        return value
    memo[key] = result
    return result


@dataclasses.dataclass
class DeterministicInputs(CachePolicy):
    """Upstream's default cache policy with every set in the inputs sorted first.

    Attributes:
        inner: The policy to delegate to (default: `DEFAULT_PYDANTIC_AI_CACHE_POLICY`, which is
            inputs + task source + flow run id).
    """

    inner: CachePolicy = dataclasses.field(default_factory=lambda: DEFAULT_PYDANTIC_AI_CACHE_POLICY)

    def compute_key(self, task_ctx: Any, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str | None:
        return self.inner.compute_key(task_ctx, _sorted_sets(inputs, {}), flow_parameters, **kwargs)


DEFAULT_TOOL_RETRIES = 2
"""Retries for a function-tool task (3 attempts in all), 1 s apart."""


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`PrefectDurability(...)` keyword arguments: deterministic cache keys for model, tool and MCP tasks,
    tool retries, merged with `options` (the user's keys win)."""
    options = dict(options)
    policy = DeterministicInputs()
    defaults: dict[str, TaskConfig] = {
        'model_task_config': TaskConfig(cache_policy=policy),
        'tool_task_config': TaskConfig(cache_policy=policy, retries=DEFAULT_TOOL_RETRIES, retry_delay_seconds=1.0),
        'mcp_task_config': TaskConfig(cache_policy=policy),
    }
    for key, config in defaults.items():
        options[key] = TaskConfig(**{**config, **(options.get(key) or {})})  # type: ignore[typeddict-item]
    return options, _mcp_defaults(agent, options)


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
    `{'output': ..., 'new_messages': [...], 'usage': {...}}` as JSON-compatible data.
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
                              conversation_id=conversation_id, load=load_task, append=append)
        return turn.payload()

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
    prefect_serve(deployment, print_starting_message=False)


# ---- the adapter ---------------------------------------------------------------------------------


async def _settled_task_runs(flow_run_id: Any, model_requests: int, timeout: float = 30.0) -> list[Any]:
    """The flow run's task runs once Prefect has recorded them all.

    Prefect 3 records task runs from events, asynchronously: listed right after the flow returns, the
    last ones can be missing. Poll (up to `timeout` seconds) until every task run is final, there is a
    `Model Request` task per model response, and the list has not changed for a second.
    """

    from prefect import get_client  # lazily: the API client (httpx) loads only to wait for a run
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    previous: list[tuple[str, str]] = []
    stable_since = time.monotonic()
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            snapshot = sorted((str(r.id), str(r.state_type)) for r in runs)
            if snapshot != previous:
                previous, stable_since = snapshot, time.monotonic()
            done = all(r.state is not None and r.state.is_final() for r in runs)
            enough = sum(1 for r in runs if r.name.startswith('Model Request')) >= model_requests
            if (done and enough and time.monotonic() - stable_since >= 1.0) or time.monotonic() > deadline:
                return list(runs)
            await asyncio.sleep(0.2)


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
        tasks = {'Model Request', *CONVERSATION_TASKS}
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

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:

        # Without PREFECT_API_URL, Prefect starts a temporary local server; keep it from phoning home.
        os.environ.setdefault('PREFECT_SERVER_ANALYTICS_ENABLED', 'false')
        history = options.message_history
        state = await agent_flow(agent)(
            prompt=prompt, deps=to_jsonable_python(options.deps) if options.deps is not None else None,
            message_history=ModelMessagesTypeAdapter.dump_python(list(history), mode='json') if history else None,
            conversation_id=options.conversation_id, return_state=True,
        )
        payload = await state.result()
        flow_run_id = state.state_details.flow_run_id
        model_requests = sum(1 for m in payload['new_messages'] if m.get('kind') == 'response')
        task_runs = await _settled_task_runs(flow_run_id, model_requests)
        units = [t.name for t in sorted(task_runs, key=lambda t: (t.expected_start_time or t.created, t.name))]
        return RunReport.from_payload('prefect', str(flow_run_id), payload, units)

    def serve_schedule(
        self, agent: DurableAgent[Any, Any], *, target: str, prompt: str, cron: str | None, interval_seconds: float | None,
        deps: Any, deployment_name: str | None, notify: Callable[[str], None],
    ) -> None:
        """A scheduled deployment of the agent's flow, served by `prefect.serve` (see `serve`)."""
        notify(f'serving deployment {deployment_name or agent.name + "-scheduled"!r} of flow {flow_name(agent)} '
               f'({"cron " + cron if cron else f"every {interval_seconds:g} s"}); Ctrl-C or SIGTERM to stop')
        serve(agent, target=target, prompt=prompt, cron=cron, interval_seconds=interval_seconds, deps=deps,
              deployment_name=deployment_name)


ADAPTER = PrefectAdapter()
