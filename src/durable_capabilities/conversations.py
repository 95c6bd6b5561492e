"""Load and append a run's conversation: the bodies every engine runs inside its durable units
(the turn itself, load -> run -> append, is `turn.run_turn`).

Engines call these inside an activity (Temporal), a step (DBOS) or a task (Prefect), never in
workflow code: the store is I/O. The append carries an `append_id` derived from the durable run
(workflow id, flow run id), so a retried unit that appends again stores nothing twice.

Messages cross as pydantic-ai's message JSON (`ModelMessagesTypeAdapter`), which every engine can
record and which keeps instruction ids intact.
"""

from __future__ import annotations

import logging
import os
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
)
from pydantic_ai.usage import RunUsage

from .store import DEFAULT_URL, STORE_ENV, ConversationNotFoundError, SQLConversationStore, drift
from .validation import DurableConfigError, Report

if TYPE_CHECKING:
    from .agent import DurableAgent

logger = logging.getLogger('durable_capabilities.conversations')


def store_url(agent: DurableAgent[Any, Any]) -> str:
    """The store URL for `agent`: `DurableAgent(conversation_store=...)`, else `$DURCAP_STORE`, else SQLite
    at `.durcap/conversations.db` (resolved where the durable unit runs, e.g. on the worker)."""
    return agent.conversation_store or os.environ.get(STORE_ENV) or DEFAULT_URL


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


_DRIFT_MARKERS = ('"tool_name":"load_capability"', '"part_kind":"capability-load-delta"',
                  '"part_kind":"tool-availability-delta"', '"part_kind":"compaction"')
"""A stored message whose JSON has one of these may load a capability, reveal tools or compact the history:
the drift scan decodes it."""

_TOOL_KEY = '"tool_name":"'
_RESPONSE_KEY = '"kind":"response"'

_EMPTY_REQUEST = ModelRequest(parts=[])
_EMPTY_RESPONSE = ModelResponse(parts=[])


def _scan_rows(rows: list[str], kinds: list[str], entry_ids: list[str], conversation_id: str, known: Any,
               offset: int = 0) -> list[ModelMessage]:
    """What `drift` reads of stored rows, decoding only the rows that can matter to it: those with a
    `_DRIFT_MARKERS` marker, and those naming a tool (`"tool_name":"..."` anywhere in the row, arguments
    included, so a false match only costs a decode) that `known(name)` does not know. The others stand as an
    empty request or response (shared objects), so positions stay right.

    Raises:
        CorruptedRowError / NewerHistoryError: a decoded row is not a message this pydantic-ai reads.
    """
    from .store._schema import _decode_messages

    # One pass over the rows joined: find each needle's occurrences and map them to their rows.
    joined = '\n'.join(rows)
    ends = list(accumulate(len(text) + 1 for text in rows))
    wanted_rows = {i for i, kind in enumerate(kinds) if kind != 'message'}
    for needle in _DRIFT_MARKERS:
        at = joined.find(needle)
        while at != -1:
            wanted_rows.add(bisect_right(ends, at))
            at = joined.find(needle, at + len(needle))
    verdicts: dict[str, bool] = {}
    at = joined.find(_TOOL_KEY)
    while at != -1:
        start = at + len(_TOOL_KEY)
        end = joined.find('"', start)
        name = joined[start:end]
        verdict = verdicts.get(name)
        if verdict is None:
            verdict = verdicts[name] = '\\' not in name and known(name)
        if not verdict:
            wanted_rows.add(bisect_right(ends, at))
        at = joined.find(_TOOL_KEY, end)
    wanted = sorted(wanted_rows)
    decoded = dict(zip(wanted, _decode_messages(
        [_RowText(rows[i], kinds[i], offset + i + 1, entry_ids[i], conversation_id) for i in wanted], conversation_id), strict=True))
    responses: set[int] = set()
    at = joined.find(_RESPONSE_KEY)
    while at != -1:
        responses.add(bisect_right(ends, at))
        at = joined.find(_RESPONSE_KEY, at + len(_RESPONSE_KEY))
    return [
        decoded.get(i, _EMPTY_RESPONSE if i in responses else _EMPTY_REQUEST) for i in range(len(rows))
    ]


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
class _Scanned:
    revision: int
    entry_ids: list[str]
    rows: list[str]
    scanned: list[ModelMessage]


_LOAD_CACHE: OrderedDict[tuple[str, str], _Scanned] = OrderedDict()
LOAD_CACHE_SIZE = 16
"""Conversations whose stored rows and drift scan a worker keeps (least recently used dropped first), so the
next turn's load unit reads and scans only the rows appended since."""


async def load_conversation(agent: DurableAgent[Any, Any], conversation_id: str) -> LoadedConversation:
    """Read a conversation for a run of `agent` and check it for drift.

    Returns the stored JSON of each message (`LoadedConversation.rows`) without decoding it: drift and the
    loaded capabilities come from one scan that decodes only the rows they can depend on. A conversation this
    process loaded recently (by store URL and id) is read and scanned only past what it had.

    Returns:
        The stored rows and revision; a new conversation when none is stored.

    Raises:
        DurableConfigError: the history loaded a capability or called a tool the definition no longer
            has (DC018 / DC019) and `DurableAgent(drift='error')` (the default).
        StoreError: the store is unusable (corrupted rows, unknown schema, newer pydantic-ai).
    """
    url = store_url(agent)
    key = (url, conversation_id)
    cached = _LOAD_CACHE.get(key)
    async with SQLConversationStore(url) as store:
        await store.check_writable()  # refuse a read-only or unreachable store before the run, not after it
        try:
            stored = await store.read_json(
                conversation_id, known=(len(cached.rows), cached.entry_ids[-1]) if cached and cached.rows else None
            )
        except ConversationNotFoundError:
            _LOAD_CACHE.pop(key, None)
            return LoadedConversation()
    from .history import known_tool

    scanned = _scan_rows(stored.messages, stored.kinds, stored.entry_ids, conversation_id, known_tool(agent),
                         offset=stored.message_count - len(stored.messages))
    if stored.tail and cached is not None:
        entry = _Scanned(stored.revision, [*cached.entry_ids, *stored.entry_ids], [*cached.rows, *stored.messages],
                         [*cached.scanned, *scanned])
    else:
        entry = _Scanned(stored.revision, stored.entry_ids, stored.messages, scanned)
    _LOAD_CACHE[key] = entry
    _LOAD_CACHE.move_to_end(key)
    while len(_LOAD_CACHE) > LOAD_CACHE_SIZE:
        _LOAD_CACHE.popitem(last=False)
    problems = drift(entry.scanned, agent, severity=agent.drift, conversation_id=conversation_id)
    report = Report(problems)
    if not report.ok:
        raise DurableConfigError(report, f'conversation {conversation_id!r}')
    warnings = [p.format() for p in problems if p.severity == 'warning']
    for text in warnings:
        logger.warning(text)
    return LoadedConversation([], entry.revision, warnings, list(entry.rows))


async def append_conversation(
    agent: DurableAgent[Any, Any],
    conversation_id: str,
    messages: list[dict[str, Any]],
    *,
    expected_revision: int | None,
    append_id: str,
    usage: dict[str, Any] | None = None,
) -> int:
    """Append a run's new messages (message JSON) and return the new revision.

    A repeated `append_id` (a retried durable unit) stores nothing and returns the earlier revision.

    Raises:
        ConversationConflictError: another run appended since this one loaded (`expected_revision` is stale).
    """
    async with SQLConversationStore(store_url(agent)) as store:
        result = await store.append(
            conversation_id,
            ModelMessagesTypeAdapter.validate_python(messages),
            expected_revision=expected_revision,
            append_id=append_id,
            usage=RunUsage(**usage) if usage else None,
        )
    return result.revision
