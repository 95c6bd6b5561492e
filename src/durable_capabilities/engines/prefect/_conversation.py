"""Prefect's conversation units: the `Load Conversation` and `Append Conversation` tasks (store I/O runs only in
tasks).

The bodies and the errors no retry fixes are the engines' shared ones (`engines._conversation_unit`); the retry
numbers are Prefect's (`_spec.APPEND_RETRY`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import INPUTS, RUN_ID

from .._conversation_unit import PERMANENT_APPEND_ERRORS, StoreSource, append_unit, load_unit, release_unit
from ._spec import APPEND_RETRY, CONVERSATION_TASKS

if TYPE_CHECKING:
    from ...agent import DurableAgent


def conversation_tasks(agent: DurableAgent[Any, Any], store: StoreSource = None) -> tuple[Any, Any]:
    """Prefect tasks `Load Conversation` and `Append Conversation` (store I/O only runs in tasks), on the store
    `store` (`_conversation_unit.StoreSource`; `agent_flow` passes the run's, read when the task runs).

    Cached on their inputs and the flow run id, so a flow run resumed after a crash replays them
    instead of reading or appending again. The load's result (persisted) is the conversation's head
    (`conversations.LoadedHead`: a few bytes whatever the history's length); the flow reads the rows back
    (`_conversation_unit.read_back`; a result persisted before heads existed holds the rows themselves); the append is also idempotent by its append id, and retried while the
    store is down (`_spec.APPEND_RETRY`), never on an error no retry fixes.
    """
    options: dict[str, Any] = {'cache_policy': INPUTS + RUN_ID, 'persist_result': True}
    return (
        task(name=CONVERSATION_TASKS[0], **options)(load_unit(agent, store=store, run_of=flow_run_id,
                                                              alive=_flow_run_active, by_head=True)),
        task(name=CONVERSATION_TASKS[1], retries=APPEND_RETRY.attempts - 1, retry_delay_seconds=APPEND_RETRY.delays(),
             retry_condition_fn=_retry_append, **options)(append_unit(agent, store=store, run_of=flow_run_id)),
    )


def release(agent: DurableAgent[Any, Any], store: StoreSource = None) -> Any:
    """In flow code: `release(conversation_id)`, freeing the flow run's turn claim when its turn fails before the
    append (idempotent: no task needed)."""
    return release_unit(agent, store=store, run_of=flow_run_id)


def flow_run_id() -> str:
    """The id of the flow run this code runs in (a task's parent flow run): the holder of its turn claim."""
    from prefect.runtime import flow_run

    return str(flow_run.id)


async def _flow_run_active(run_id: str) -> bool:
    """Whether flow run `run_id` (holding a conversation's turn claim) may still run: not in a final state."""
    import uuid

    from prefect import get_client

    try:
        async with get_client() as client:
            found = await client.read_flow_run(uuid.UUID(run_id))
    except Exception:  # noqa: BLE001 - unknown (deleted) or not a flow run id: nobody will release it
        return False
    return found.state is None or not found.state.is_final()


def _retry_append(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition of the append task: retry unless the store refused for good (a conflict)."""
    return not isinstance(getattr(state, 'data', None), PERMANENT_APPEND_ERRORS)
