"""Temporal's conversation units: the load and append activities (store I/O runs only in activities) and the
workflow-side calls that schedule them.

The bodies and the errors no retry fixes are the engines' shared ones (`engines._conversation_unit`); the retry
numbers are Temporal's (`_spec`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from temporalio import activity, workflow
from temporalio.common import RetryPolicy

from ...conversations import LoadedConversation
from .._conversation_unit import (
    PERMANENT_APPEND_ERRORS,
    PERMANENT_LOAD_ERRORS,
    UnitRetry,
    append_unit,
    error_names,
    load_unit,
)
from . import _payloads
from ._spec import (
    APPEND_RETRY,
    CONVERSATION_APPEND_SUFFIX,
    CONVERSATION_LOAD_SUFFIX,
    ENQUEUE_WAIT_TIMEOUT,
    LOAD_RETRY,
    STORE_ACTIVITY_TIMEOUT,
)

if TYPE_CHECKING:
    from ...agent import DurableAgent

def _policy(retry: UnitRetry, permanent: tuple[type[BaseException], ...], *, waits: bool) -> RetryPolicy:
    if not waits:  # the load keeps Temporal's own default waits
        return RetryPolicy(maximum_attempts=retry.attempts, non_retryable_error_types=error_names(permanent))
    return RetryPolicy(initial_interval=timedelta(seconds=retry.initial_seconds), backoff_coefficient=retry.backoff,
                       maximum_interval=timedelta(seconds=retry.maximum_seconds), maximum_attempts=retry.attempts,
                       non_retryable_error_types=error_names(permanent))


STORE_ACTIVITY_OPTIONS: dict[str, Any] = {
    'start_to_close_timeout': STORE_ACTIVITY_TIMEOUT,
    'retry_policy': _policy(LOAD_RETRY, PERMANENT_LOAD_ERRORS, waits=False),
}

APPEND_ACTIVITY_OPTIONS: dict[str, Any] = {
    'start_to_close_timeout': STORE_ACTIVITY_TIMEOUT,
    'retry_policy': _policy(APPEND_RETRY, PERMANENT_APPEND_ERRORS, waits=True),
}


@dataclass
class AppendInput:
    """Input of the conversation-append activity (message JSON, see `AgentRunInput`)."""

    conversation_id: str
    messages: list[dict[str, Any]]
    expected_revision: int | None
    append_id: str
    usage: dict[str, Any] | None = None


def conversation_activity_names(agent: DurableAgent[Any, Any]) -> tuple[str, str]:
    """Activity type names of the conversation load and append: `agent__{name}__conversation_load` / `_append`."""
    return (f'agent__{agent.durable_name}{CONVERSATION_LOAD_SUFFIX}',
            f'agent__{agent.durable_name}{CONVERSATION_APPEND_SUFFIX}')


_ACTIVITIES: dict[tuple[str, str | None], list[Any]] = {}


def conversation_activities(agent: DurableAgent[Any, Any], store: str | None = None) -> list[Any]:
    """The activities that read and append the agent's conversations (store I/O runs only in activities), on the
    store `store` (the worker's `--store`; `None`: `$DURCAP_STORE`, else the default store, read where the activity
    runs; `DurableAgent(conversation_store=...)` wins). One pair per agent and store in a process."""
    key = (agent.durable_name, store)
    if key in _ACTIVITIES:
        return _ACTIVITIES[key]
    load_name, append_name = conversation_activity_names(agent)
    load_body = load_unit(agent, _payloads.check_loaded, store=store, run_of=_workflow_id,  # DC030 here
                          beat=activity.heartbeat, alive=_workflow_running)
    append_body = append_unit(agent, store=store, run_of=_workflow_id)

    @activity.defn(name=load_name)
    async def load(conversation_id: str, busy: str | None = None) -> LoadedConversation:
        loaded = await load_body(conversation_id, busy)
        assert isinstance(loaded, LoadedConversation)  # `by_head` is off: the rows travel (claim-checked in pieces)
        return loaded

    @activity.defn(name=append_name)
    async def append(params: AppendInput) -> int:
        return await append_body(params.conversation_id, params.messages, params.expected_revision, params.append_id,
                                 params.usage)

    _ACTIVITIES[key] = [load, append]
    return _ACTIVITIES[key]


def _workflow_id() -> str:
    return activity.info().workflow_id or ''


async def _workflow_running(run_id: str) -> bool:
    """In an activity: whether workflow `run_id` (holding a conversation's turn claim) is still running; a claim
    left by a workflow that failed, was cancelled, terminated or timed out is taken over."""
    from temporalio.client import WorkflowExecutionStatus
    from temporalio.service import RPCError, RPCStatusCode

    try:
        described = await activity.client().get_workflow_handle(run_id).describe()
    except RPCError as exc:
        return exc.status != RPCStatusCode.NOT_FOUND
    return described.status in (WorkflowExecutionStatus.RUNNING, WorkflowExecutionStatus.CONTINUED_AS_NEW)


ENQUEUE_LOAD_OPTIONS: dict[str, Any] = {
    'start_to_close_timeout': ENQUEUE_WAIT_TIMEOUT,
    'heartbeat_timeout': timedelta(seconds=30),
    'retry_policy': STORE_ACTIVITY_OPTIONS['retry_policy'],
}
"""The load of an enqueued turn (`busy='enqueue'`): it waits in the activity, heartbeating, for the turn that holds
the conversation to be stored (`_spec.ENQUEUE_WAIT_TIMEOUT` at most)."""


def workflow_units(agent: DurableAgent[Any, Any]) -> tuple[Any, Any]:
    """In workflow code: `(load, append)` for `run_turn`, each scheduling the agent's conversation activity."""
    load_name, _ = conversation_activity_names(agent)

    async def load(conversation_id: str, busy: str | None = None) -> LoadedConversation:
        if busy is None:  # the input runs recorded before `busy` existed scheduled
            return await workflow.execute_activity(
                load_name, conversation_id, result_type=LoadedConversation, **STORE_ACTIVITY_OPTIONS
            )
        options = ENQUEUE_LOAD_OPTIONS if (busy or agent.busy) in ('enqueue', 'interrupt') else STORE_ACTIVITY_OPTIONS
        return await workflow.execute_activity(
            load_name, args=[conversation_id, busy], result_type=LoadedConversation, **options
        )

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> int:
        info = workflow.info()
        return await append_activity(
            agent, AppendInput(conversation_id, messages, revision, f'{info.workflow_id}:{info.run_id}', usage))

    return load, append


async def append_activity(agent: DurableAgent[Any, Any], params: AppendInput) -> int:
    """In workflow code: run the agent's append activity with `params`; returns the new revision."""
    _, append_name = conversation_activity_names(agent)
    return await workflow.execute_activity(append_name, params, result_type=int, **APPEND_ACTIVITY_OPTIONS)
