"""Temporal's durability options: upstream's `TemporalDurability` with the payload guard, and the activity options
durcap gives every model, tool and MCP activity by default (heartbeats, bounded retries), merged with the user's.
Also the names a worker registers (`durable_names`) and the sandbox runner."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any

from pydantic_ai.durable_exec.temporal import TemporalDurability
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from ... import _upstream
from .. import _mcp
from .._retry_after import MAX_RETRY_AFTER_SECONDS
from . import _payloads
from ._conversation import conversation_activities
from ._spec import (
    DEFAULT_MODEL_HEARTBEAT_TIMEOUT,
    DEFAULT_TOOL_HEARTBEAT_TIMEOUT,
    ENGINE,
    LOCAL_RETRY_THRESHOLD,
    LOCAL_TOOL_RETRY_INITIAL_INTERVAL,
    LOCAL_TOOL_RETRY_MAXIMUM_INTERVAL,
    LOCAL_TOOL_START_TO_CLOSE_TIMEOUT,
    LOCAL_TOOLSETS_OPTION,
    MCP_RETRY_MAXIMUM_INTERVAL,
    MODEL_RETRY_ATTEMPTS,
    MODEL_RETRY_INITIAL_INTERVAL,
    TOOL_RETRY_INITIAL_INTERVAL,
    TOOL_RETRY_MAXIMUM_INTERVAL,
    TOOL_START_TO_CLOSE_TIMEOUT,
    workflow_type,
)
from ._workflow import continue_as_new_handler

if TYPE_CHECKING:
    from ...agent import DurableAgent

DEFAULT_MODEL_RETRY_POLICY = RetryPolicy(
    initial_interval=MODEL_RETRY_INITIAL_INTERVAL, backoff_coefficient=2.0,
    maximum_interval=timedelta(seconds=MAX_RETRY_AFTER_SECONDS), maximum_attempts=MODEL_RETRY_ATTEMPTS,
)
"""The model request activity's retry policy unless `engine_options['temporal']['model_activity_config']` or
`['activity_config']` gives one: 5 attempts, waits of 1, 2, 4 and 8 s between them (15 s of backoff), so a
provider that stays unreachable fails the run in well under a minute (measured: tests/engines/test_providers.py)
instead of Temporal's default policy, which retries forever (temporalio `RetryPolicy`: `maximum_attempts=0`,
unlimited). A 429/503 with `retry-after` waits that long instead (pydantic-ai sets the attempt's
`next_retry_delay`, capped at `maximum_interval`: `MAX_RETRY_AFTER_SECONDS`, 30 s, the bound of every engine); a
longer `retry-after` fails the activity at once (`RetryAfterCap`). Errors another attempt cannot fix (401, 404 model,
quota; pydantic-ai's `TemporalDurability(non_retryable_model_errors=...)` default) fail at the first attempt."""

DEFAULT_LOCAL_TOOL_CONFIG: dict[str, Any] = {
    'start_to_close_timeout': LOCAL_TOOL_START_TO_CLOSE_TIMEOUT,
    # The worker retries locally (no server timer) after 0.1 s, doubling to 5 s; past `local_retry_threshold` (10 s)
    # the retry is scheduled through the server with a timer, as Temporal does for long local backoffs.
    'retry_policy': RetryPolicy(initial_interval=LOCAL_TOOL_RETRY_INITIAL_INTERVAL,
                                maximum_interval=LOCAL_TOOL_RETRY_MAXIMUM_INTERVAL),
    'local_retry_threshold': LOCAL_RETRY_THRESHOLD,
}
"""Local-activity options for a marked leaf; a leaf's own dict in `LOCAL_TOOLSETS_OPTION` overrides these keys
(`start_to_close_timeout`, `schedule_to_close_timeout`, `retry_policy`, `local_retry_threshold`)."""


class GuardedTemporalDurability(TemporalDurability[Any]):
    """Upstream's `TemporalDurability` that also refuses, in workflow code, a model request whose input no payload can
    carry (problem DC030: `_payloads.PayloadGuard`), from its own `before_model_request`.

    The check runs after upstream's own `before_model_request` (its continue-as-new, then its final repair of the
    request), so it measures the request the model-request activity will carry. Done here rather than as a capability
    of its own because every capability of an agent costs a `RunContext` copy on every hook of every run, which in
    Temporal's workflow sandbox is about 0.1 ms of CPU each (`bench/README.md`, issue 14).

    Args:
        payload_guard: The check (`durability_parts` gives one); `None`: no check, as upstream.
        kwargs: `TemporalDurability`'s own arguments.
    """

    def __init__(self, *, payload_guard: _payloads.PayloadGuard | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.payload_guard = payload_guard

    async def before_model_request(self, ctx: Any, request_context: Any) -> Any:
        request_context = await super().before_model_request(ctx, request_context)
        if self.payload_guard is not None:
            request_context = await self.payload_guard.before_model_request(ctx, request_context)
        return request_context

    async def on_tool_execute_error(self, ctx: Any, *, call: Any, tool_def: Any, args: Any, error: Exception) -> Any:
        """A tool result the claim-check codec refused (DC030/DC031) fails the turn naming the conversation, the tool
        and its capability (in workflow code; the caller's error says which tool, not only the worker log)."""
        if workflow.in_workflow():
            named = _payloads.named(error, None, tool=call.tool_name)
            if named is not error:
                raise named from error
        return await super().on_tool_execute_error(ctx, call=call, tool_def=tool_def, args=args, error=error)


AGENT_TOOLSET_ID = '<agent>'
"""The toolset id pydantic-ai gives an agent's own function toolset (`tools=[...]`; `AbstractToolset.id` documents
it), outside every capability, so not in `DurableAgent.leaf_ids()`: its tool activities get the same recovery
settings as a capability's (before, a killed worker's always-on tool, e.g. the support example's `issue_refund`,
was retried only when its 60 s start-to-close timeout expired)."""


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`GuardedTemporalDurability(...)` keyword arguments: ours (every tool activity, the agent's own toolset
    `AGENT_TOOLSET_ID` included: `DEFAULT_TOOL_HEARTBEAT_TIMEOUT` and,
    MCP leaves aside, a retry policy from `TOOL_RETRY_INITIAL_INTERVAL`; model requests: `DEFAULT_MODEL_HEARTBEAT_TIMEOUT`
    and the bounded `DEFAULT_MODEL_RETRY_POLICY`) merged with `options` (the user's win, per toolset id and per key),
    the payload guard (`payload_guard`), and the MCP guard (`_mcp.py`) when there are MCP leaves."""
    options = dict(options)
    options.pop(LOCAL_TOOLSETS_OPTION, None)  # ours, read by `make_worker` (see `local_tool_activities`)
    configs: dict[str, Any] = {
        leaf: {'heartbeat_timeout': DEFAULT_TOOL_HEARTBEAT_TIMEOUT, 'start_to_close_timeout': TOOL_START_TO_CLOSE_TIMEOUT}
        for leaf in [AGENT_TOOLSET_ID, *(leaf for leaves in agent.leaf_ids().values() for leaf in leaves)]
    }
    for leaf, config in (options.pop('toolset_activity_config', None) or {}).items():
        configs[leaf] = {**configs.get(leaf, {}), **config}
    options['model_activity_config'] = {'heartbeat_timeout': DEFAULT_MODEL_HEARTBEAT_TIMEOUT,
                                        **(options.get('model_activity_config') or {})}
    if 'retry_policy' not in options['model_activity_config'] and \
            'retry_policy' not in (options.get('activity_config') or {}):
        options['model_activity_config']['retry_policy'] = DEFAULT_MODEL_RETRY_POLICY
    extra = _mcp_defaults(agent, options, configs)
    mcp = set(_mcp.mcp_leaves(agent))
    for leaf, config in configs.items():
        if leaf not in mcp:
            config.setdefault('retry_policy', RetryPolicy(
                initial_interval=TOOL_RETRY_INITIAL_INTERVAL, maximum_interval=TOOL_RETRY_MAXIMUM_INTERVAL))
    options['payload_guard'] = _payloads.PayloadGuard()  # DC030 before a model request no payload can carry
    options.setdefault('continue_as_new', continue_as_new_handler(agent))
    return {'toolset_activity_config': configs, **options}, extra


def sandbox_runner() -> SandboxedWorkflowRunner:
    """Temporal's sandboxed runner with `durable_capabilities` passed through (PydanticAIPlugin adds pydantic-ai's)."""
    return SandboxedWorkflowRunner(
        restrictions=SandboxRestrictions.default.with_passthrough_modules('durable_capabilities')
    )


def mcp_activity_config(attempts: int = _mcp.DEFAULT_MCP_ATTEMPTS) -> dict[str, Any]:
    """`toolset_activity_config[mcp leaf id]` defaults: a retry policy with `maximum_attempts=attempts`."""
    return {
        'retry_policy': RetryPolicy(
            initial_interval=timedelta(seconds=_mcp.DEFAULT_MCP_RETRY_INTERVAL_SECONDS),
            backoff_coefficient=2.0,
            maximum_interval=MCP_RETRY_MAXIMUM_INTERVAL,
            maximum_attempts=attempts,
        )
    }


def _mcp_defaults(agent: DurableAgent[Any, Any], options: dict[str, Any], configs: dict[str, Any]) -> list[Any]:
    """Give every MCP leaf without a user `retry_policy` a bounded one in `configs` (`toolset_activity_config`,
    edited in place) and return the extra capabilities (the guard). Pops `_mcp.GUARD_OPTION` from `options`."""
    if options.pop(_mcp.GUARD_OPTION, True) is False:
        return []
    for leaf_id in _mcp.mcp_leaves(agent):
        configs.setdefault(leaf_id, {}).setdefault('retry_policy', mcp_activity_config()['retry_policy'])

    def attempts(leaf_id: str) -> int | None:
        policy = configs.get(leaf_id, {}).get('retry_policy')
        return (policy.maximum_attempts or None) if policy is not None else None

    found = _mcp.guard(agent, ENGINE, attempts)
    return [found] if found is not None else []



def durable_names(agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
    """What `make_worker` registers for `agent`: the workflow types `workflow_classes` defines (named by
    `workflow_type`, without defining the classes: a lock may compare two versions of one agent in one
    process) and every activity type (upstream's `worker_registrations` of the built agent's durability,
    plus `conversation_activities`)."""
    durability = TemporalDurability.from_agent(agent.build(ENGINE))
    assert durability is not None
    upstream, _ = _upstream.temporal_worker_registrations(durability)
    activities = [*upstream, *conversation_activities(agent)]
    return {
        'workflows': sorted(workflow_type(name) for name in (agent.name, *agent.previous_names)),
        'activities': sorted(_upstream.temporal_activity_name(fn) for fn in activities),
    }
