"""Prefect's conversation units: the turn's load and append run in the flow's own code, not as tasks (issue 24).

As tasks (`Load Conversation`, `Append Conversation`, what earlier versions ran), each turn left two more task runs in
Prefect's database (their states and events, ~25 KB each whatever the turn's size) and two persisted results: about 1x
the conversation's bytes, the difference between 3.8x and 2.9x of storage per message byte. What a task gave them, the
flow code now does itself:

- A flow run run again (Prefect's retry, `durcap runs resume`, a crashed deployment run rescheduled) must start from
  the history its first attempt loaded, or its model requests miss their cache and run again, tools included. The load
  records what it read (`LoadedHead`: revision, head entry id, count) as flow run input `_spec.LOADED_INPUT` (a
  row of a few hundred bytes, no task run, no event) before the turn does anything else; a rerun reads it back and
  does not claim the conversation again (a rerun of a task-based load did not either: its result came from the
  cache).
- The append is idempotent by its append id (`prefect:{flow run id}`, as before): a rerun after the append landed
  stores nothing and returns the same revision. It is retried in the flow while the store is down
  (`_spec.APPEND_RETRY`, the numbers the task had), never on an error no retry fixes.
- A flow run recorded by an earlier version (its load a task) and resumed by this one: its claim is still held by the
  run when the crash came before the append, so loading again reads the same history; when the append had landed
  (`durcap_writes` holds its append id), the `Load Conversation` task is called as before and Prefect returns its cached
  result, the history before the append (`conversation_tasks`).

The bodies and the errors no retry fixes are the engines' shared ones (`engines._conversation_unit`).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import INPUTS, RUN_ID

from ...conversations import LoadedConversation, LoadedHead, process_store, store_url
from .._conversation_unit import PERMANENT_APPEND_ERRORS, StoreSource, append_unit, load_unit, release_unit
from ._spec import APPEND_RETRY, CONVERSATION_TASKS, LOADED_INPUT

if TYPE_CHECKING:
    from ...agent import DurableAgent

logger = logging.getLogger(__name__)


def conversation_units(agent: DurableAgent[Any, Any], store: StoreSource = None) -> tuple[
        Callable[..., Awaitable[Any]], Callable[..., Awaitable[int]]]:
    """In flow code: `load(conversation_id, busy=None) -> LoadedHead | LoadedConversation` and `append(conversation_id,
    messages, expected_revision, append_id, usage) -> revision`, on the store `store` (see `StoreSource`; `agent_flow`
    passes the run's, read when the unit runs). See the module docstring for what a rerun does.

    Raises (load): `ConversationBusyError` (DC050), drift (`DurableConfigError`), a `StoreError`; (append): one of
    `PERMANENT_APPEND_ERRORS`, or the last `StoreError` once `APPEND_RETRY`'s attempts are spent.
    """
    claim_and_load = load_unit(agent, store=store, run_of=flow_run_id, alive=_flow_run_active, by_head=True)
    append_once = append_unit(agent, store=store, run_of=flow_run_id)
    release_claim = release(agent, store)
    legacy_load: list[Any] = []

    async def load(conversation_id: str, busy: str | None = None) -> LoadedHead | LoadedConversation:
        if run_count() > 1:  # run again: the first attempt's load is what this one starts from
            recorded = await read_recorded_load()
            if recorded is not None:
                return recorded
            if await _appended_already(agent, store, conversation_id):  # an earlier version's run, appended
                if not legacy_load:
                    legacy_load.append(conversation_tasks(agent, store)[0])
                return await (legacy_load[0](conversation_id) if busy is None else legacy_load[0](conversation_id, busy))
        loaded = await claim_and_load(conversation_id, busy)
        # Recorded before the turn does anything: a rerun starts from it. A suspended flow run resumed (the same
        # run_count) finds its own record, made from the same history (its claim held it).
        try:
            return await record_load(loaded)
        except BaseException:  # the turn does not start: the conversation is free again
            await release_claim(conversation_id)
            raise

    async def append(conversation_id: str, messages: list[dict[str, Any]], expected_revision: int | None,
                     append_id: str, usage: dict[str, Any] | None = None) -> int:
        delays = APPEND_RETRY.delays()
        for attempt in range(len(delays) + 1):
            try:
                return await append_once(conversation_id, messages, expected_revision, append_id, usage)
            except PERMANENT_APPEND_ERRORS:
                raise
            except Exception as error:
                if attempt == len(delays):
                    raise
                logger.warning('flow run %s: the append to conversation %r failed (%s); retrying in %.0f s (%d of %d)',
                               append_id, conversation_id, str(error).splitlines()[0] if str(error) else
                               type(error).__name__, delays[attempt], attempt + 1, len(delays))
                await asyncio.sleep(delays[attempt])
        raise AssertionError('unreachable')  # pragma: no cover

    return load, append


def recorded_value(loaded: LoadedHead | LoadedConversation) -> dict[str, Any]:
    """What `record_load` stores of a load: a `LoadedHead`'s fields, or, for a conversation with no message yet, its
    revision (`None`: not stored yet) and warnings. Never the messages."""
    if isinstance(loaded, LoadedHead):
        return {'head': asdict(loaded)}
    return {'revision': loaded.revision, 'warnings': list(loaded.warnings)}


def from_recorded(value: dict[str, Any]) -> LoadedHead | LoadedConversation:
    """The load `recorded_value` stored (`read_back` reads a head's rows)."""
    if 'head' in value:
        return LoadedHead(**value['head'])
    return LoadedConversation([], value.get('revision'), list(value.get('warnings') or []), [] if value.get('revision')
                              is not None else None)


async def record_load(loaded: LoadedHead | LoadedConversation) -> LoadedHead | LoadedConversation:
    """Store `loaded` as the flow run's input `LOADED_INPUT` and return it; when the flow run has one already (a
    suspended run resumed), the stored one is returned. A load holding rows (a load unit of the form before heads)
    is not recorded: a rerun loads again, under the claim the run still holds."""
    from prefect.exceptions import ObjectAlreadyExists, PrefectHTTPStatusError
    from prefect.input import acreate_flow_run_input

    if isinstance(loaded, LoadedConversation) and loaded.rows:
        return loaded
    try:
        await acreate_flow_run_input(LOADED_INPUT, recorded_value(loaded), flow_run_id=uuid.UUID(flow_run_id()))
    except (ObjectAlreadyExists, PrefectHTTPStatusError) as error:
        if isinstance(error, PrefectHTTPStatusError) and error.response.status_code != 409:
            raise
        recorded = await read_recorded_load()
        if recorded is not None:
            return recorded
        raise
    return loaded


async def read_recorded_load() -> LoadedHead | LoadedConversation | None:
    """The load the flow run recorded (`record_load`), or `None`."""
    from prefect.input import aread_flow_run_input

    value = await aread_flow_run_input(LOADED_INPUT, flow_run_id=uuid.UUID(flow_run_id()))
    return from_recorded(value) if isinstance(value, dict) else None


async def _appended_already(agent: DurableAgent[Any, Any], store: StoreSource, conversation_id: str) -> bool:
    """Whether this flow run's append (`prefect:{flow run id}`) is in the store's write log."""
    from ...store import ConversationNotFoundError

    append_id = f'prefect:{flow_run_id()}'
    try:
        writes = await process_store(store_url(agent, store() if callable(store) else store)).writes(conversation_id)
    except ConversationNotFoundError:
        return False
    return any(write.append_id == append_id for write in writes)


def conversation_tasks(agent: DurableAgent[Any, Any], store: StoreSource = None) -> tuple[Any, Any]:
    """The Prefect tasks `Load Conversation` and `Append Conversation` of earlier versions (`CONVERSATION_TASKS`), on
    the store `store`: how a flow run loaded and appended before its flow code did (`conversation_units`).

    Only the load is still called, by a flow run recorded by an earlier version and resumed after its append landed:
    with the same inputs (conversation id, and `busy` when the run was given one), the same name and cache policy
    (inputs and flow run id), Prefect returns the result it persisted then, the history before the append. Its result
    is the conversation's head (`conversations.LoadedHead`), or the rows for runs recorded before heads existed; the
    flow reads the rows back (`_conversation_unit.read_back`). The append is idempotent by its append id, and retried
    while the store is down (`_spec.APPEND_RETRY`), never on an error no retry fixes.
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


def run_count() -> int:
    """How many times the flow run this code runs in has entered Running (1: its first attempt, or a suspended run
    resumed; more: run again after a crash or a failure)."""
    from prefect.runtime import flow_run

    return int(flow_run.run_count or 1)


async def _flow_run_active(run_id: str) -> bool:
    """Whether flow run `run_id` (holding a conversation's turn claim) may still run: not in a final state, and not a
    RUNNING / PENDING / CANCELLING run that beats (`_liveness.BEAT_LABEL`) but has shown no sign of life (its `updated`,
    which every beat moves, and its state's time, on the server's clock) for `_liveness.stale_seconds()`.

    Why the beat: a flow run outside a deployment (`durcap run --engine prefect`) whose process was killed stays
    RUNNING for good (no serving process watches it), and its claim refused every later turn of the conversation
    (DC050) or kept an enqueued one waiting forever. A run with no beat label (started by a durcap before the beats, or
    killed before its first beat landed) is judged by its state alone, as before."""
    from prefect import get_client

    from ._liveness import BEAT_LABEL, last_sign_of_life, server_clock, silent_for, stale_seconds

    try:
        async with get_client() as client:
            found = await client.read_flow_run(uuid.UUID(run_id))
            if found.state is None or found.state.is_final():
                return found.state is None
            if found.state_type is None or found.state_type.name not in ('RUNNING', 'PENDING', 'CANCELLING') or \
                    BEAT_LABEL not in (found.labels or {}):
                return True
            server_now = await server_clock(client)
    except Exception:  # noqa: BLE001 - unknown (deleted) or not a flow run id: nobody will release it
        return False
    if server_now is None:
        return True  # no server clock to compare with: judged by its state
    return not silent_for(last_sign_of_life(found), server_now, stale_seconds())


def _retry_append(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition of the append task: retry unless the store refused for good (a conflict)."""
    return not isinstance(getattr(state, 'data', None), PERMANENT_APPEND_ERRORS)
