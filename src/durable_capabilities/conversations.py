"""Load and append a run's conversation: the bodies every engine runs inside its durable units
(the turn itself, load -> run -> append, is `turn.run_turn`).

Engines call these inside an activity (Temporal), a step (DBOS) or a task (Prefect), never in
workflow code: the store is I/O. The append carries an `append_id` derived from the durable run
(workflow id, flow run id), so a retried unit that appends again stores nothing twice.

Messages cross as pydantic-ai's message JSON (`ModelMessagesTypeAdapter`), which every engine can
record and which keeps instruction ids intact.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
)

from .agent import text_output_type
from .report import usage_from_json
from .store import (
    ConversationBusyError,
    ConversationNotFoundError,
    CorruptedRowError,
    SQLConversationStore,
    drift,
    resolve_url,
)
from .store._schema import _decode_messages, _encode
from .validation import DurableConfigError, Report

if TYPE_CHECKING:
    from .agent import DurableAgent

logger = logging.getLogger('durable_capabilities.conversations')


def store_url(agent: DurableAgent[Any, Any], store: str | None = None) -> str:
    """The store URL for `agent`: `DurableAgent(conversation_store=...)`, else `store` (the run's or the worker's
    `--store`, passed down by the engine), else `$DURCAP_STORE`, else SQLite at `.durcap/conversations.db`
    (`store.resolve_url`, resolved where the durable unit runs, e.g. on the worker)."""
    return resolve_url(agent.conversation_store or store)


_STORES: dict[tuple[str, int], SQLConversationStore] = {}


def process_store(url: str) -> SQLConversationStore:
    """The store for `url` that this process keeps open for its life (one per URL and process id).

    Load and append units run on every turn: opening a store costs an engine, a schema check and a close
    (~5 ms, measured by `bench/bench_store.py`), which a worker pays once instead. Connections are pooled
    (PostgreSQL's checked with a ping before use); a SQLite file is `stat`ed per transaction and, when it was
    replaced (a restored backup), deleted or had its mode changed, the pool is closed and the schema checked
    again, so no write goes through a stale file descriptor. Keyed by process id as well, so a forked
    process never shares a pool.

    Raises:
        StoreURLError: `url` is malformed or not SQLite / PostgreSQL.
    """
    key = (url, os.getpid())
    store = _STORES.get(key)
    if store is None:
        store = _STORES[key] = SQLConversationStore(url)
    return store


@dataclass
class LoadedConversation:
    """A conversation as a run starts from it.

    Attributes:
        messages: The stored messages as pydantic-ai message JSON (empty for a new conversation, and when
            `rows` carries them).
        revision: The stored revision, `None` for a conversation that does not exist yet.
        warnings: Drift problems reported at warning severity, as text.
        rows: The stored JSON text of each message, as the store holds it (what `load_conversation` returns:
            no decode/dump round trip in the load unit; the run decodes once, see `turn.decode_history`).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    revision: int | None = None
    warnings: list[str] = field(default_factory=list)
    rows: list[str] | None = None


@dataclass
class LoadedHead:
    """A stored conversation named, not carried: what the load unit of DBOS (a step's recorded output) and Prefect (the
    flow run input `durcap-loaded`; a task's persisted result in flow runs of earlier versions) returns instead of the
    history, so a turn records a few bytes, not every message again
    (issue 24: each turn recording the whole history made an engine's database grow with the square of the turns).

    The workflow (flow) code reads the rows back with `read_loaded_head`, in the run's first execution and in a
    recovery alike: the entries a head names never change (an append adds entries after it, a rebase adds them after
    another writer's, a compaction summary is a new message, a fork's entries point at the parent's, and `durcap
    history delete` removes the conversation whole, which the read back then reports). Pickled by DBOS and Prefect
    by module and name: keep it here under this name.

    Attributes:
        revision: The stored revision the turn loaded (the append's expected revision).
        head_id: The entry id of the last message loaded.
        count: The number of messages loaded (the head's position).
        warnings: Drift problems reported at warning severity, as text.
    """

    revision: int
    head_id: str
    count: int
    warnings: list[str] = field(default_factory=list)


@dataclass
class _RowText:
    """The fields `_decode_messages` reads of an entry row."""

    message: str
    kind: str
    position: int
    entry_id: str
    conversation_id: str
    writer: str = 'unknown'


@dataclass
class _Loaded:
    revision: int
    entry_ids: list[str]
    rows: list[str]


_LOAD_CACHE: OrderedDict[tuple[str, str], _Loaded] = OrderedDict()
LOAD_CACHE_SIZE = 16
"""Conversations whose stored rows a worker keeps (least recently used dropped first), so the next turn's load
unit reads only the rows appended since (their decoded messages are in `_DECODED`)."""


@dataclass
class _Decoded:
    count: int
    last_row: str
    messages: list[ModelMessage]


_DECODED: OrderedDict[tuple[str, str], _Decoded] = OrderedDict()
DECODED_CACHE_SIZE = 16
"""Conversations whose decoded history a worker keeps, least recently used dropped first (`decode_history`).
The load unit and the workflow share it: in one worker process a history is decoded once per turn."""


def decode_history(key: tuple[str, str], rows: list[str], conversation_id: str, *, kinds: list[str] | None = None,
                   entry_ids: list[str] | None = None) -> list[ModelMessage]:
    """The stored rows (one message JSON text each) as messages, decoding only what this process has not.

    A conversation this process loaded or ran recently (by `key`: agent durable name and conversation id) is
    taken from memory up to the messages it had, checked by the text of the last of them; only the rows after
    are decoded, with one `ModelMessagesTypeAdapter.validate_json` call. Messages from memory are the same
    objects the earlier load or turn had (a history is append-only; a run does not change the messages it was
    given). The load unit calls this to check drift and the workflow calls it again with the same rows: in one
    worker process the second call decodes nothing.

    Args:
        key: `(agent durable name, conversation id)`.
        rows: Every stored message's JSON text, oldest first.
        conversation_id: For error messages.
        kinds / entry_ids: The rows' entry kinds and ids when the caller has them (the load unit): an entry
            kind other than `'message'` is then refused and errors name the entry.

    Returns:
        A new list of the messages (the caller may extend it).

    Raises:
        CorruptedRowError / NewerHistoryError: a row is not a message this pydantic-ai reads.
    """
    cached = _DECODED.get(key)
    start = 0
    if cached is not None and 0 < cached.count <= len(rows) and rows[cached.count - 1] == cached.last_row:
        start = cached.count
    tail = rows[start:]
    decoded = _decode_rows(tail, conversation_id, start, kinds[start:] if kinds else None,
                           entry_ids[start:] if entry_ids else None) if tail else []
    messages = [*(cached.messages[:start] if cached is not None and start else []), *decoded]
    if rows:
        _DECODED[key] = _Decoded(len(rows), rows[-1], messages)
        _DECODED.move_to_end(key)
        while len(_DECODED) > DECODED_CACHE_SIZE:
            _DECODED.popitem(last=False)
    return list(messages)


GC_PAUSE_MIN_ROWS = 1_000
"""From this many rows on, a history is decoded with Python's cyclic garbage collector paused.

Decoding 10,000 messages allocates about 250,000 objects, none of them in a reference cycle; with the
collector running, those allocations trigger full collections that walk every live object of the worker, and
measured on the 10,000-message benchmark (`bench/bench_store.py`) they doubled the load unit's CPU time
(0.25 s against 0.13 s). Reference counting still frees everything; the collector runs again right after."""


@contextmanager
def _no_cyclic_gc(pause: bool) -> Iterator[None]:
    """Pause the cyclic garbage collector inside the block when `pause` (and it was running), then restore it."""
    was_enabled = pause and gc.isenabled()
    if was_enabled:
        gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _decode_rows(rows: list[str], conversation_id: str, offset: int, kinds: list[str] | None,
                 entry_ids: list[str] | None) -> list[ModelMessage]:
    if kinds is None or kinds.count('message') == len(kinds):
        try:
            with _no_cyclic_gc(len(rows) >= GC_PAUSE_MIN_ROWS):
                messages = ModelMessagesTypeAdapter.validate_json('[' + ','.join(rows) + ']')
            if len(messages) == len(rows):
                return messages
        except ValueError:
            pass
    # Slow path: the row at fault, by position (and entry id when known).
    return _decode_messages(
        [_RowText(text, kinds[i] if kinds else 'message', offset + i + 1, entry_ids[i] if entry_ids else '', conversation_id)
         for i, text in enumerate(rows)],
        conversation_id,
    )


def _remember(key: tuple[str, str], messages: list[ModelMessage]) -> None:
    """After an append: the conversation's whole history, for the next turn's `decode_history`."""
    _DECODED[key] = _Decoded(len(messages), _encode(messages[-1]), messages)
    _DECODED.move_to_end(key)
    while len(_DECODED) > DECODED_CACHE_SIZE:
        _DECODED.popitem(last=False)


BUSY_STRATEGIES = ('reject', 'enqueue', 'interrupt')
"""What a turn does when another run's turn holds its conversation (`DurableAgent(busy=...)`, `durcap run --busy`):
`'reject'` refuses it before any side effect (`ConversationBusyError`, DC050, naming the holder); `'enqueue'` waits
until the holder's turn is stored (or its run released the conversation), then runs on top of it; `'interrupt'` asks
the holder's turn to stop at its next safe point (`SQLConversationStore.request_stop`: before its next model request
it ends with an answer saying it was interrupted, see `interrupts`; a call of it waiting for approval is denied by the
interrupting caller, `runner.run`), then waits as `'enqueue'` does. Nothing the holder did is lost: its turn is
stored, its tools ran once."""

ALIVE_CHECK_SECONDS = 5.0
"""How often a waiting turn asks the engine whether the run holding its conversation still runs."""

ENQUEUE_POLL_SECONDS = (0.05, 1.0)
"""How often an enqueued turn looks at the claim again: from the first value, doubling, up to the second."""


def text_output(agent: Any) -> bool:
    """Whether `agent`'s output may be plain text (`output_type` is `str` or lists it): the only agents a turn can
    interrupt, since an interrupted turn ends with a text answer (`interrupts.interrupted_text`)."""
    return text_output_type(getattr(agent, 'output_type', str))


def check_busy(value: Any, where: str = 'busy', agent: Any = None) -> str | None:
    """`value` if it is `None` or one of `BUSY_STRATEGIES` (and, for `'interrupt'`, `agent` may end with text).

    Args:
        value: The strategy asked for.
        where: What named it, for the error (`busy`, `--busy`, a request body's field).
        agent: The `DurableAgent` it is for, or `None` (then `'interrupt'` is not checked against its output).

    Raises:
        InputError: DC040, any other value, naming `where` and the accepted ones; DC053, `'interrupt'` for an agent
            whose output is not plain text.
    """
    from ._limits import InputError

    if value == 'interrupt' and agent is not None and not text_output(agent):
        raise InputError(where, interrupt_refusal(agent), code='DC053')
    if value is None or value in BUSY_STRATEGIES:
        return value
    raise InputError(where, f'{value!r} is not a strategy; use one of {", ".join(BUSY_STRATEGIES)}')


def interrupt_refusal(agent: Any) -> str:
    """The DC053 message: `busy='interrupt'` for `agent`, whose output is not plain text."""
    output = getattr(agent, 'output_type', None)
    shown = getattr(output, '__name__', None) or repr(output)
    return (f"'interrupt' cannot be used for agent {getattr(agent, 'name', '?')!r}: its output type is {shown}, and an "
            "interrupted turn ends with a text answer saying so. Use busy='enqueue' (wait for the turn that holds the "
            "conversation) or 'reject', or give the agent an output type that allows text (output_type=[YourType, str])")


async def claim_turn(agent: DurableAgent[Any, Any], conversation_id: str, run_id: str, busy: str | None, *,
                     store: str | None = None, beat: Any = None, alive: Any = None) -> None:
    """Claim `conversation_id` for the turn of run `run_id` (one turn at a time per conversation), before the turn
    does anything: the conversation-load unit calls it. Released when the turn's append lands, or by `release_turn`.

    Args:
        agent / store: Where the conversation is stored (`store_url`).
        run_id: The durable run (workflow id, flow run id); a retried unit of the same run claims again harmlessly.
        busy: `'reject'` (default), `'enqueue'` or `'interrupt'` (`BUSY_STRATEGIES`): an interrupting turn asks the
            holder to stop (`SQLConversationStore.request_stop`, durable), then waits as `'enqueue'` does.
        beat: Called while an enqueued turn waits (Temporal's activity heartbeat), or `None`.
        alive: `async alive(holder run id) -> bool`: whether the run holding the claim still runs (the engine asks
            its server); a claim of a run that ended without releasing it (failed, cancelled, terminated, deleted)
            is released and taken. `None`: never taken over.

    Raises:
        ConversationBusyError: DC050, another run holds the conversation and `busy` is `'reject'`.
    """
    opened = process_store(store_url(agent, store))
    delay, cap = ENQUEUE_POLL_SECONDS
    waited_since: float | None = None
    asked: dict[str, float] = {}
    stopped: set[str] = set()
    while True:
        holder = await opened.claim_turn(conversation_id, run_id)
        if holder is None:
            if waited_since is not None:
                logger.info('run %s: conversation %r is free after %.1f s; its turn starts', run_id, conversation_id,
                            time.monotonic() - waited_since)
            return
        if alive is not None and time.monotonic() - asked.get(holder[0], -60.0) >= ALIVE_CHECK_SECONDS:
            asked[holder[0]] = time.monotonic()
            if not await alive(holder[0]):
                logger.warning('conversation %r: run %s holds it but no longer runs; run %s takes it over',
                               conversation_id, holder[0], run_id)
                await opened.release_turn(conversation_id, holder[0], taken_by=run_id)
                continue
        if (busy or 'reject') == 'reject':
            raise ConversationBusyError(conversation_id, run_id=run_id, holder=holder[0], claimed_at=holder[1],
                                        waiting=await _holder_waiting(opened, holder[0]))
        if busy == 'interrupt' and holder[0] not in stopped:
            stopped.add(holder[0])
            asked_by = await opened.request_stop(conversation_id, holder[0], run_id)
            if asked_by is not None:
                logger.info('run %s asked run %s, whose turn holds conversation %r, to stop at its next safe point',
                            run_id, holder[0], conversation_id)
        if waited_since is None:
            waited_since = time.monotonic()
            logger.info('run %s waits for run %s, whose turn holds conversation %r', run_id, holder[0], conversation_id)
        if beat is not None:
            beat()
        await asyncio.sleep(delay)
        delay = min(delay * 2, cap)


async def _holder_waiting(opened: Any, holder: str) -> tuple[str | None, list[dict[str, Any]]] | None:
    """What the DC050 refusal says of the holder: `(engine, pending calls)` when its stream in the store says it waits
    for an approval (`SQLConversationStore.waiting_approval`), else `None`; a failed read says nothing (the refusal
    stands either way)."""
    try:
        return await opened.waiting_approval(holder)
    except Exception:
        logger.debug('could not read whether run %s waits for an approval', holder, exc_info=True)
        return None


async def release_turn(agent: DurableAgent[Any, Any], conversation_id: str, run_id: str | None, *,
                       store: str | None = None) -> bool:
    """Release the turn claim run `run_id` holds on `conversation_id` (`None`: whoever holds it); idempotent.
    Returns whether a claim was released."""
    return await process_store(store_url(agent, store)).release_turn(conversation_id, run_id)


@overload
async def load_conversation(agent: DurableAgent[Any, Any], conversation_id: str, *, store: str | None = None,
                            by_head: Literal[False] = False) -> LoadedConversation: ...


@overload
async def load_conversation(agent: DurableAgent[Any, Any], conversation_id: str, *, store: str | None = None,
                            by_head: bool) -> LoadedConversation | LoadedHead: ...


async def load_conversation(agent: DurableAgent[Any, Any], conversation_id: str, *, store: str | None = None,
                            by_head: bool = False) -> LoadedConversation | LoadedHead:
    """Read a conversation for a run of `agent` and check it for drift, from the store `store_url(agent, store)`.

    Returns the stored JSON of each message (`LoadedConversation.rows`), which is what crosses the engine's
    boundary (an activity result, a step output). Drift is checked on the decoded history, decoded through
    `decode_history`'s cache: the workflow's own `decode_history` of the same rows, in the same worker process,
    then decodes nothing (another process decodes once more). A conversation this process loaded recently (by
    store URL and id) is read and decoded only past what it had.

    Args:
        by_head: Return a `LoadedHead` (revision, head entry id, count) instead of the rows when the conversation has
            messages: the form DBOS's and Prefect's load units record (`read_loaded_head` reads the rows back).

    Returns:
        The stored rows and revision (or with `by_head` their `LoadedHead`); a new conversation when none is stored.

    Raises:
        DurableConfigError: the history loaded a capability or called a tool the definition no longer
            has (DC018 / DC019) and `DurableAgent(drift='error')` (the default).
        StoreError: the store is unusable (corrupted rows, unknown schema, newer pydantic-ai).
    """
    url = store_url(agent, store)
    key = (url, conversation_id)
    cached = _LOAD_CACHE.get(key)
    opened = process_store(url)
    try:
        # check_writable: refuse a read-only or unreachable store before the run, not after it
        stored = await opened.read_json(
            conversation_id, known=(len(cached.rows), cached.entry_ids[-1]) if cached and cached.rows else None,
            check_writable=True,
        )
    except ConversationNotFoundError:
        _LOAD_CACHE.pop(key, None)
        return LoadedConversation()
    if stored.tail and cached is not None:
        entry = _Loaded(stored.revision, [*cached.entry_ids, *stored.entry_ids], [*cached.rows, *stored.messages])
        kinds = None if stored.kinds.count('message') == len(stored.kinds) else ['message'] * len(cached.rows) + stored.kinds
    else:
        entry = _Loaded(stored.revision, stored.entry_ids, stored.messages)
        kinds = stored.kinds
    messages = decode_history((agent.durable_name, conversation_id), entry.rows, conversation_id, kinds=kinds,
                              entry_ids=entry.entry_ids)
    _LOAD_CACHE[key] = entry
    _LOAD_CACHE.move_to_end(key)
    while len(_LOAD_CACHE) > LOAD_CACHE_SIZE:
        _LOAD_CACHE.popitem(last=False)
    problems = drift(messages, agent, severity=agent.drift, conversation_id=conversation_id)
    report = Report(problems)
    if not report.ok:
        raise DurableConfigError(report, f'conversation {conversation_id!r}')
    warnings = [p.format() for p in problems if p.severity == 'warning']
    for text in warnings:
        logger.warning(text)
    if by_head and entry.rows:
        return LoadedHead(entry.revision, entry.entry_ids[-1], len(entry.rows), warnings)
    return LoadedConversation([], entry.revision, warnings, list(entry.rows))


async def read_loaded_head(agent: DurableAgent[Any, Any], conversation_id: str, head: LoadedHead, *,
                           store: str | None = None) -> LoadedConversation:
    """The conversation a `LoadedHead` names, as the load unit would have returned it: the rows of the history ending
    at `head.head_id`, from this process's load cache when it holds them (the load unit ran here: no I/O), else read
    from the store `store_url(agent, store)` by entry id (a recovery in another process, however much the
    conversation has grown since).

    Raises:
        ConversationNotFoundError: the history is no longer in the store (the conversation was deleted while the turn
            ran, `durcap history delete`): the turn cannot go on without it.
        CorruptedRowError: the stored entries do not form the history the head names.
    """
    url = store_url(agent, store)
    cached = _LOAD_CACHE.get((url, conversation_id))
    if cached is not None and len(cached.entry_ids) >= head.count and cached.entry_ids[head.count - 1] == head.head_id:
        rows = cached.rows[:head.count]
    else:
        rows = await process_store(url).read_json_at(conversation_id, head.head_id, head.count)
    return LoadedConversation([], head.revision, list(head.warnings), rows)


_READERS: dict[tuple[str, int], SQLConversationStore] = {}
"""Stores `read_appended` opened without creating them (`create=False`), one per URL and process id."""


def appended_in(payload: Any) -> dict[str, Any] | None:
    """The append a DBOS workflow's / Prefect flow run's result names (`Turn.payload(append_id=...)`:
    `{'conversation_id', 'append_id', 'revision', 'messages'}`), or `None` when the result carries its messages inline
    (a run without a conversation, or a result recorded before results named their append)."""
    if isinstance(payload, dict) and 'new_messages' not in payload and isinstance(payload.get('appended'), dict):
        return payload['appended']
    return None


async def read_appended(appended: dict[str, Any], *, store: str | None = None) -> list[dict[str, Any]]:
    """The messages (message JSON, oldest first) of the append a run's result names (`appended_in`), read from the
    store `store` (a URL; `None`: `$DURCAP_STORE`, else the default store): the write log's row of that append id
    gives its entries, read in one range query.

    Raises:
        ConversationNotFoundError: the append is no longer in the store (the conversation was deleted, or the store
            is not the one the run appended to): the message says which run, conversation and revision.
        CorruptedRowError: the entries read back are not the ones the append wrote.
        StoreUnavailableError: there is no store at `store` (nothing is created), or it cannot be reached.
    """
    conversation_id, append_id = str(appended['conversation_id']), str(appended['append_id'])
    url = resolve_url(store)
    # A reader (`runs show`, `runs list`) never creates a store: this process's open one, else one opened to read.
    db = _STORES.get((url, os.getpid())) or _READERS.get((url, os.getpid()))
    if db is None:
        db = _READERS[(url, os.getpid())] = SQLConversationStore(url, create=False)
    write = next((w for w in await db.writes(conversation_id) if w.append_id == append_id), None)
    if write is None or not write.entry_ids:
        if write is not None and not int(appended.get('messages') or 0):
            return []
        raise ConversationNotFoundError(
            conversation_id, f' (store {db.location}) with the turn {append_id} appended at revision '
            f'{appended.get("revision")}: its messages were deleted with the conversation, or the run used another '
            '--store')
    entries = await db.read_history(write.entry_ids[-1], limit=len(write.entry_ids))
    if [entry.id for entry in entries] != write.entry_ids:
        raise CorruptedRowError(f'the entries of append {append_id!r} do not read back in order',
                                conversation_id=conversation_id, table='durcap_entries', row=write.entry_ids[-1])
    return ModelMessagesTypeAdapter.dump_python([entry.message for entry in entries], mode='json')


async def resolve_payload(payload: Any, *, store: str | None = None) -> Any:
    """A DBOS workflow's / Prefect flow run's result with its `new_messages`: read from the store when the result
    names its append (`appended_in`; `store` as `read_appended`), else `payload` as recorded (messages inline).

    Raises:
        ConversationNotFoundError, CorruptedRowError: see `read_appended`.
    """
    appended = appended_in(payload)
    if appended is None:
        return payload
    return {**payload, 'new_messages': await read_appended(appended, store=store)}


async def append_conversation(
    agent: DurableAgent[Any, Any],
    conversation_id: str,
    messages: list[dict[str, Any]],
    *,
    expected_revision: int | None,
    append_id: str,
    usage: dict[str, Any] | None = None,
    store: str | None = None,
    rebase: bool = False,
    release_claim: str | None = None,
) -> int:
    """Append a run's new messages (message JSON) to the store `store_url(agent, store)` and return the new revision.

    A repeated `append_id` (a retried durable unit) stores nothing and returns the earlier revision.

    Args:
        rebase: When another writer appended since the run loaded, append after it instead of refusing (a turn
            whose side effects happened is always stored: the turn units pass `True`).
        release_claim: The run whose turn claim (`claim_turn`) is released in the append's transaction.

    Raises:
        ConversationConflictError: another run appended since this one loaded (`expected_revision` is stale) and
            `rebase` is false.
    """
    result = await process_store(store_url(agent, store)).append(
        conversation_id,
        ModelMessagesTypeAdapter.validate_python(messages),
        expected_revision=expected_revision,
        append_id=append_id,
        usage=usage_from_json(usage) if usage else None,
        rebase=rebase,
        release_claim=release_claim,
    )
    if result.rebased:
        logger.warning('conversation %r: another turn was stored while %s ran; its turn was appended after it '
                       '(revision %s)', conversation_id, release_claim or append_id, result.revision)
    return result.revision
