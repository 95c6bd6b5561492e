"""The conversation store's tables, and how their rows map to and from pydantic-ai objects.

`_store_sql._SQLBackend` runs the SQL; this module holds what it stores: the schema DDL per version
(`_MIGRATIONS`), the column lists, the JSON codecs of the columns, and the decoding of rows back into
records and messages, with the error naming the row that does not decode. See `store.py`'s docstring
for the tables.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import pydantic
from pydantic_ai import __version__ as _PYDANTIC_AI_VERSION
from pydantic_ai.conversation_store import ConversationRecord
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.tools import DeferredToolRequests
from pydantic_ai.usage import RunUsage

from . import CorruptedRowError, NewerHistoryError

_WRITER = f'pydantic-ai-slim {_PYDANTIC_AI_VERSION}'
"""Recorded in every row's `writer` column."""


# ---- schema -----------------------------------------------------------------------------------

_MIGRATIONS: dict[int, list[str]] = {
    1: [
        """CREATE TABLE durcap_conversations (
            conversation_id TEXT PRIMARY KEY,
            revision BIGINT NOT NULL,
            token TEXT NOT NULL,
            head_id TEXT,
            message_count BIGINT NOT NULL,
            usage TEXT NOT NULL,
            deferred_tool_requests TEXT,
            scope TEXT,
            forked_from TEXT,
            forked_at TEXT,
            branches TEXT NOT NULL,
            format_version INTEGER NOT NULL,
            deleted INTEGER NOT NULL,
            updated_at TEXT NOT NULL,
            writer TEXT NOT NULL
        )""",
        'CREATE INDEX durcap_conversations_updated ON durcap_conversations (updated_at)',
        """CREATE TABLE durcap_entries (
            entry_id TEXT PRIMARY KEY,
            parent_id TEXT,
            conversation_id TEXT NOT NULL,
            position BIGINT NOT NULL,
            kind TEXT NOT NULL,
            message TEXT NOT NULL,
            writer TEXT NOT NULL,
            created_at TEXT NOT NULL
        )""",
        'CREATE INDEX durcap_entries_position ON durcap_entries (conversation_id, position)',
        """CREATE TABLE durcap_writes (
            conversation_id TEXT NOT NULL,
            revision BIGINT NOT NULL,
            operation TEXT NOT NULL,
            append_id TEXT,
            digest TEXT,
            first_position BIGINT,
            entry_ids TEXT NOT NULL,
            written_at TEXT NOT NULL,
            writer TEXT NOT NULL,
            PRIMARY KEY (conversation_id, revision)
        )""",
        'CREATE UNIQUE INDEX durcap_writes_append_id ON durcap_writes (conversation_id, append_id)',
    ],
    2: [
        # Claim checks (`engines.temporal._payloads.ClaimCheckCodec`): Temporal payloads too large to travel inline, keyed by
        # the sha256 of their bytes. `{BLOB}` is BLOB on SQLite, BYTEA on PostgreSQL.
        """CREATE TABLE durcap_payloads (
            sha256 TEXT PRIMARY KEY,
            size BIGINT NOT NULL,
            data {BLOB} NOT NULL,
            created_at TEXT NOT NULL,
            writer TEXT NOT NULL
        )""",
    ],
    3: [
        # Who refers to a claim check (`durcap history delete`, `durcap store stats`): one row per (payload, owner),
        # the owner being the durable run that wrote it (a Temporal workflow id, from the codec's serialization
        # context). A run's conversation is found through its append (`durcap_writes.append_id`). Payloads written
        # before this version have no row: their owner is unknown and they are never deleted as someone's own.
        """CREATE TABLE durcap_payload_refs (
            sha256 TEXT NOT NULL,
            owner TEXT NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (sha256, owner)
        )""",
        'CREATE INDEX durcap_payload_refs_owner ON durcap_payload_refs (owner)',
    ],
    4: [
        # One turn at a time per conversation (`SQLConversationStore.claim_turn`): the run whose turn holds the
        # conversation, from its load until its append lands (released in the append's transaction) or the run ends.
        """CREATE TABLE durcap_turn_claims (
            conversation_id TEXT PRIMARY KEY,
            run_id TEXT NOT NULL,
            claimed_at TEXT NOT NULL,
            writer TEXT NOT NULL
        )""",
    ],
    5: [
        # Run event streams (`durable_capabilities.streams`): one row per run (its next offset, what it retains, when
        # it closed) and one per event, offsets assigned here. A unit's event is keyed by (run, unit, attempt, seq), so a
        # replayed container or a re-sent batch never stores an event twice.
        """CREATE TABLE durcap_run_streams (
            run_id TEXT PRIMARY KEY,
            engine TEXT NOT NULL,
            next_offset BIGINT NOT NULL,
            first_offset BIGINT NOT NULL,
            event_count BIGINT NOT NULL,
            bytes BIGINT NOT NULL,
            dropped BIGINT NOT NULL,
            started_at TEXT NOT NULL,
            closed_at TEXT,
            writer TEXT NOT NULL
        )""",
        'CREATE INDEX durcap_run_streams_closed ON durcap_run_streams (closed_at)',
        """CREATE TABLE durcap_run_events (
            run_id TEXT NOT NULL,
            event_offset BIGINT NOT NULL,
            unit TEXT NOT NULL,
            attempt INTEGER NOT NULL,
            seq INTEGER NOT NULL,
            kind TEXT NOT NULL,
            body TEXT NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (run_id, event_offset)
        )""",
        'CREATE UNIQUE INDEX durcap_run_events_key ON durcap_run_events (run_id, unit, attempt, seq)',
    ],
    6: [
        # Budgets (`durable_capabilities.budget`): one ledger row per budget key (what its settled model requests
        # spent, the limits last checked, what operators raised them by) and one reservation row per model request,
        # keyed by (key, request id), so a retried model request unit reuses its reservation and is counted once.
        # Cost in nano-USD (1e-9 USD) as an integer.
        """CREATE TABLE durcap_budget_ledger (
            budget_key TEXT PRIMARY KEY,
            input_tokens BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL,
            total_tokens BIGINT NOT NULL,
            cost_nanos BIGINT NOT NULL,
            requests BIGINT NOT NULL,
            limits TEXT NOT NULL,
            raised TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            writer TEXT NOT NULL
        )""",
        """CREATE TABLE durcap_budget_reservations (
            budget_key TEXT NOT NULL,
            request_id TEXT NOT NULL,
            run_id TEXT NOT NULL,
            state TEXT NOT NULL,
            input_tokens BIGINT NOT NULL,
            output_tokens BIGINT NOT NULL,
            cost_nanos BIGINT NOT NULL,
            created_at TEXT NOT NULL,
            settled_at TEXT,
            PRIMARY KEY (budget_key, request_id)
        )""",
    ],
    7: [
        # `durcap serve` (`durable_capabilities.serve`), shared by every serve process on the store: who owns each
        # conversation (the principal whose request started its first turn), each run a request started (its owner,
        # agent, engine), and each `Idempotency-Key` a principal sent (the request's digest and the run it started),
        # so a retried POST on any process returns the same run instead of a second turn.
        """CREATE TABLE durcap_serve_owners (
            conversation_id TEXT PRIMARY KEY,
            principal TEXT NOT NULL,
            created_at TEXT NOT NULL
        )""",
        """CREATE TABLE durcap_serve_runs (
            run_id TEXT PRIMARY KEY,
            principal TEXT NOT NULL,
            conversation_id TEXT NOT NULL,
            agent TEXT NOT NULL,
            engine TEXT NOT NULL,
            created_at TEXT NOT NULL
        )""",
        'CREATE INDEX durcap_serve_runs_conversation ON durcap_serve_runs (conversation_id)',
        """CREATE TABLE durcap_serve_requests (
            principal TEXT NOT NULL,
            idempotency_key TEXT NOT NULL,
            digest TEXT NOT NULL,
            run_id TEXT NOT NULL,
            created_at TEXT NOT NULL,
            PRIMARY KEY (principal, idempotency_key)
        )""",
    ],
    8: [
        # Claim checks as trees (`engines.temporal._payloads`, issue 24): what a `durcap_payloads` row is. 0: a piece, a
        # whole payload, or a page of 0.3's layout (whose owners have a `durcap_payload_refs` row for each of its pieces);
        # 1: a leaf page (entries of a depth byte and a piece's sha256); 2: a page of page digests. An owner of a tree
        # has one `durcap_payload_refs` row, for its root: `purge`, `collect` and `stats` read the pages under it.
        'ALTER TABLE durcap_payloads ADD COLUMN kind SMALLINT NOT NULL DEFAULT 0',
    ],
    9: [
        # A turn asked to stop (`busy='interrupt'`, `durable_capabilities.interrupts`): the run whose newer turn asked
        # the holder of the claim to stop at its next safe point, and when. Deleted with the claim; read by run id
        # inside the holder's model request unit.
        'ALTER TABLE durcap_turn_claims ADD COLUMN stop_by TEXT',
        'ALTER TABLE durcap_turn_claims ADD COLUMN stop_at TEXT',
        'CREATE INDEX durcap_turn_claims_run ON durcap_turn_claims (run_id)',
    ],
    10: [
        # A turn claim taken over from a run that no longer runs (`conversations.claim_turn`): the dead holder stays
        # tied to the conversation (a run killed before its append wrote no `durcap_writes` row; its claim was what
        # tied its claim checks to the conversation), so `purge` names it and deletes its claim checks. Deleted with
        # the conversation.
        """CREATE TABLE durcap_turn_takeovers (
            conversation_id TEXT NOT NULL,
            run_id TEXT NOT NULL,
            taken_by TEXT NOT NULL,
            taken_at TEXT NOT NULL,
            PRIMARY KEY (conversation_id, run_id)
        )""",
    ],
}
"""`{version: DDL statements}`: applying version N's statements to a version N-1 database gives version N.

Append a version for every schema change (and raise `store.SCHEMA_VERSION` to it); never edit one that shipped.
`{BLOB}` in a statement is the backend's binary column type.
"""

_VERSION_TABLE = (
    'CREATE TABLE IF NOT EXISTS durcap_schema_version '
    '(version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL, writer TEXT NOT NULL)'
)

_CONVERSATION_COLUMNS = (
    'conversation_id, revision, token, head_id, message_count, usage, deferred_tool_requests, scope, '
    'forked_from, forked_at, branches, format_version, deleted, updated_at, writer'
)
_ENTRY_SELECT = 'SELECT entry_id, parent_id, conversation_id, position, kind, message, writer FROM durcap_entries'


class _EntryRow(NamedTuple):
    """One `durcap_entries` row, in `_ENTRY_SELECT`'s column order (a plain tuple: range reads of a long
    history build one per message, and a tuple costs a fraction of a SQLAlchemy `Row`)."""

    entry_id: str
    parent_id: str | None
    conversation_id: str
    position: int
    kind: str
    message: str
    writer: str

_USAGE = pydantic.TypeAdapter(RunUsage)
_DEFERRED = pydantic.TypeAdapter(DeferredToolRequests)
_BRANCHES = pydantic.TypeAdapter(list[str])


def _encode(message: ModelMessage) -> str:
    """One message as pydantic-ai's JSON (an element of `ModelMessagesTypeAdapter.dump_json`)."""
    return ModelMessagesTypeAdapter.dump_json([message])[1:-1].decode()


def _digest(encoded: Sequence[str]) -> str:
    return hashlib.sha256('\x1e'.join(encoded).encode()).hexdigest()


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, 'orig', None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- decoding rows ----------------------------------------------------------------------------


@dataclass
class _Row:
    """A decoded `durcap_conversations` row."""

    record: ConversationRecord
    revision: int
    message_count: int
    deleted: bool


def _decode_row(row: Any) -> _Row:
    """A `durcap_conversations` row as a `_Row`.

    Raises:
        CorruptedRowError: a JSON column or the timestamp does not parse.
        NewerHistoryError: the record's upstream format version is newer than this pydantic-ai's.
    """
    cid = row.conversation_id
    if row.format_version != 1:
        raise NewerHistoryError(
            f'conversation {cid!r}: its durcap_conversations row is in upstream storage format {row.format_version} '
            f'(written by {row.writer}); this pydantic-ai ({_PYDANTIC_AI_VERSION}) reads format 1. Upgrade '
            'pydantic-ai-slim here. Nothing was changed.',
            conversation_id=cid, row=cid, position=None, tag=f'format_version={row.format_version}', written_by=row.writer,
        )
    column = 'usage'
    try:
        usage = _USAGE.validate_json(row.usage)
        column = 'deferred_tool_requests'
        deferred = None if row.deferred_tool_requests is None else _DEFERRED.validate_json(row.deferred_tool_requests)
        column = 'branches'
        branches = _BRANCHES.validate_json(row.branches)
        column = 'updated_at'
        updated_at = datetime.fromisoformat(row.updated_at)
        column = 'revision'
        revision = int(row.revision)
        column = 'message_count'
        message_count = int(row.message_count)
    except (pydantic.ValidationError, ValueError, TypeError) as exc:
        raise CorruptedRowError(
            f'conversation {cid!r}: column {column} of its durcap_conversations row does not decode '
            f'({_first_line(exc)}). Nothing was changed; restore the row from a backup.',
            conversation_id=cid, table='durcap_conversations', row=cid,
        ) from None
    record = ConversationRecord(
        conversation_id=cid,
        head_id=row.head_id,
        usage=usage,
        deferred_tool_requests=deferred,
        scope=row.scope,
        forked_from=row.forked_from,
        forked_at=row.forked_at,
        branches=branches,
        revision=row.token,
        updated_at=updated_at,
    )
    return _Row(record, revision, message_count, bool(row.deleted))


def _decode_messages(rows: Sequence[Any], conversation_id: str | None) -> list[ModelMessage]:
    """The messages of entry rows, validated in one call; a failure is traced to its row.

    Raises:
        CorruptedRowError: a row is not valid JSON or not one pydantic-ai message.
        NewerHistoryError: a row has a message kind or part kind this pydantic-ai does not know, or an
            entry kind other than `'message'`.
    """
    for row in rows:
        if row.kind != 'message':
            _raise_newer(row, conversation_id, f'entry kind {row.kind!r}')
    if not rows:
        return []
    try:
        messages = ModelMessagesTypeAdapter.validate_json('[' + ','.join(row.message for row in rows) + ']')
        if len(messages) == len(rows):
            return messages
    except (pydantic.ValidationError, ValueError):
        pass
    for row in rows:  # slow path: find the bad row
        _decode_one(row, conversation_id)
    raise AssertionError('a history that fails to decode as a whole decoded row by row')  # pragma: no cover


def _decode_one(row: Any, conversation_id: str | None) -> ModelMessage:
    cid = conversation_id or row.conversation_id
    where = f'conversation {cid!r}: entry {row.entry_id!r} (message {row.position}) in durcap_entries'
    fix = ' Nothing was changed; restore the row from a backup, or branch the conversation before it.'
    try:
        json.loads(row.message)
    except (ValueError, TypeError) as exc:
        raise CorruptedRowError(
            f'{where} is not valid JSON ({exc}).{fix}', conversation_id=cid, table='durcap_entries', row=row.entry_id,
            position=row.position,
        ) from None
    try:
        messages = ModelMessagesTypeAdapter.validate_json('[' + row.message + ']')
    except pydantic.ValidationError as exc:
        for error in exc.errors():
            if error['type'] == 'union_tag_invalid':
                ctx = error.get('ctx') or {}
                _raise_newer(row, conversation_id, f'{"message" if len(error["loc"]) == 1 else "part"} kind {ctx.get("tag")!r}')
        error = exc.errors()[0]
        loc = '.'.join(str(p) for p in error['loc'][1:])
        raise CorruptedRowError(
            f'{where} is not a pydantic-ai message ({loc}: {error["msg"]}).{fix}', conversation_id=cid,
            table='durcap_entries', row=row.entry_id, position=row.position,
        ) from None
    return messages[0]  # one JSON value, so one message


def _raise_newer(row: Any, conversation_id: str | None, what: str) -> None:
    cid = conversation_id or row.conversation_id
    raise NewerHistoryError(
        f'conversation {cid!r}: entry {row.entry_id!r} (message {row.position}) in durcap_entries, written by '
        f'{row.writer}, has {what}, which this pydantic-ai ({_PYDANTIC_AI_VERSION}) does not know: a newer '
        'pydantic-ai wrote it. Upgrade pydantic-ai-slim here to read it. Nothing was changed.',
        conversation_id=cid, row=row.entry_id, position=row.position, tag=what.split(' ', 2)[-1].strip("'"),
        written_by=row.writer,
    )
