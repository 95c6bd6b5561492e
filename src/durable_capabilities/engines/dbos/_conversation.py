"""DBOS's conversation units: the load and append steps (store I/O runs only in steps), and `Raised`, the form an
error takes when a step records it as its result instead of failing.

The bodies and the errors no retry fixes are the engines' shared ones (`engines._conversation_unit`); the retry
numbers are DBOS's (`_spec.APPEND_RETRY`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dbos import DBOS

from .._conversation_unit import PERMANENT_APPEND_ERRORS, append_unit, load_unit, read_back, release_unit
from ._spec import APPEND_RETRY, conversation_step_names

if TYPE_CHECKING:
    from ...agent import DurableAgent


@dataclass
class Raised:
    """An exception recorded as a step result (pickled by DBOS), raised again after the step: a tool's control-flow
    exception, or a store error no retry fixes."""

    error: BaseException


# Pickled step results name this class by module and name: keep the path recorded before the package split, so
# workflows recorded then recover (`engines.dbos` re-exports it as `_Raised`).
Raised.__module__, Raised.__qualname__, Raised.__name__ = 'durable_capabilities.engines.dbos', '_Raised', '_Raised'


def in_workflow_code() -> bool:
    """Whether this code runs in a DBOS workflow, outside any step."""
    return DBOS.workflow_id is not None and DBOS.step_id is None


APPEND_STEP_RETRIES: dict[str, Any] = {'retries_allowed': True, 'interval_seconds': APPEND_RETRY.initial_seconds,
                                       'backoff_rate': APPEND_RETRY.backoff, 'max_attempts': APPEND_RETRY.attempts}
"""`DBOS.run_step_async` options of the conversation-append step (`_spec.APPEND_RETRY`)."""

PERMANENT_STORE_ERRORS = PERMANENT_APPEND_ERRORS
"""Store errors a retried append cannot fix: the append step records them as its result and raises them after."""


def conversation_steps(agent: DurableAgent[Any, Any], store: str | None = None) -> tuple[Any, Any, Any]:
    """The store units as DBOS steps: the load step records the conversation's head (`conversations.LoadedHead`:
    revision, head entry id, count; a few bytes whatever the history's length), and the workflow code reads the rows
    back (`_conversation_unit.read_back`: the same rows in a recovery, entries never change; a workflow recorded
    before heads existed recovers with the rows its step recorded). The
    append (idempotent by workflow id) is retried by DBOS while the store is down (`APPEND_STEP_RETRIES`),
    never on a conflict (`PERMANENT_STORE_ERRORS`). On the store `store` (the run's or the worker's `--store`;
    `None`: `$DURCAP_STORE`, else the default store; `DurableAgent(conversation_store=...)` wins). Returns
    `(load, append, release)` for `turn.run_turn`: the load claims the conversation for the workflow's turn."""
    load_step, append_step = conversation_step_names(agent)
    load_body = load_unit(agent, store=store, run_of=_workflow_id, alive=_workflow_running, by_head=True)
    append_body = append_unit(agent, store=store, run_of=_workflow_id)
    release = release_unit(agent, store=store, run_of=_workflow_id)
    read = read_back(agent, store=store, release=release)

    async def load(conversation_id: str, busy: str | None = None) -> Any:
        if busy is None:  # the step's inputs as workflows recorded before `busy` existed gave them
            loaded = await DBOS.run_step_async({'name': load_step}, load_body, conversation_id)
        else:
            loaded = await DBOS.run_step_async({'name': load_step}, load_body, conversation_id, busy)
        return await read(conversation_id, loaded)

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> Any:
        async def body() -> Any:
            try:
                return await append_body(conversation_id, messages, revision, f'dbos:{DBOS.workflow_id}', usage)
            except PERMANENT_STORE_ERRORS as error:
                return Raised(error)  # a conflict cannot succeed: recorded, not retried

        result = await DBOS.run_step_async({'name': append_step, **APPEND_STEP_RETRIES}, body)  # type: ignore[arg-type]
        if isinstance(result, Raised):
            raise result.error
        return result

    # The release runs in workflow code, not in a step: it is idempotent (a recovered workflow runs it again harmlessly).
    return load, append, release


def _workflow_id() -> str:
    return DBOS.workflow_id or ''


async def _workflow_running(run_id: str) -> bool:
    """Whether DBOS workflow `run_id` (holding a conversation's turn claim) may still run: pending or enqueued. A
    workflow that succeeded, failed, was cancelled or is unknown left its claim behind."""
    status = await DBOS.get_workflow_status_async(run_id)
    return status is not None and status.status in ('PENDING', 'ENQUEUED')
