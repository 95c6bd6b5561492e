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

import copy
import dataclasses
import re
from typing import TYPE_CHECKING, Any

from prefect import flow
from prefect.cache_policies import CachePolicy
from pydantic_ai.durable_exec.prefect import (
    DEFAULT_PYDANTIC_AI_CACHE_POLICY,
    TaskConfig,
)
from pydantic_ai.tools import RunContext

from ..conversations import run_turn

if TYPE_CHECKING:
    from ..agent import DurableAgent

FLOW_NAME_PREFIX = 'durcap-'
"""Flow name: `durcap-{agent name}`."""


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
    from . import (
        _mcp,  # MCP: bounded `mcp_task_config` retries, and the guard (see _mcp.py)
    )

    return options, _mcp.prefect_defaults(agent, options)


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
    existing = _FLOWS.get(agent.name)
    if existing is not None and existing.__durcap_agent__ is agent:
        return existing
    built = agent.build('prefect')
    load_task, append_task = _conversation_tasks(agent)

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> Any:
        from prefect.runtime import flow_run

        return await append_task(conversation_id, messages, revision, f'prefect:{flow_run.id}', usage)

    async def run_agent(
        prompt: str | None = None,
        deps: dict[str, Any] | None = None,
        message_history: list[dict[str, Any]] | None = None,
        conversation_id: str | None = None,
    ) -> dict[str, Any]:
        return await run_turn(
            agent, built.run, prompt=prompt, deps=deps, message_history=message_history,
            conversation_id=conversation_id, load=load_task, append=append,
        )

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
    from prefect import task
    from prefect.cache_policies import INPUTS, RUN_ID

    from ..conversations import (
        LoadedConversation,
        append_conversation,
        load_conversation,
    )

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
        task(name='Load Conversation', **options)(load),
        # Side effects happened: retry while the store is down (about 17 min), never a conflict.
        task(name='Append Conversation', retries=12, retry_delay_seconds=[1, 2, 4, 8, 15, 30, 60, 120, 240],
             retry_condition_fn=_retry_append, **options)(append),
    )


def _retry_append(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition of the append task: retry unless the store refused for good (a conflict)."""
    from ..store import AppendIdReuseError, ConversationConflictError, CorruptedRowError

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
    import os

    from prefect import serve as prefect_serve

    from .prefect_entry import TARGET_ENV, entrypoint

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
