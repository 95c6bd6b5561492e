"""A SQL conversation store (SQLite by default, PostgreSQL for production), and what a stored history says.

`SQLConversationStore` implements upstream's `pydantic_ai.conversation_store.ConversationStore`, so
`await store.load(id)` / `await store.save(result)` / `fork` / `branch` work as upstream documents, and
adds what a durable runner needs:

- `read(id)`: the whole history in one read transaction (a range query per conversation the history
  runs through), with a revision number, raising a distinct error for each kind of bad input.
- `append(id, messages, expected_revision=N, append_id=...)`: optimistic concurrency on an integer
  revision, idempotent by `append_id` so a retried activity / step / task never appends twice.

Storage (schema version 1, tables prefixed `durcap_`):
- `durcap_entries`: one row per message, the message as pydantic-ai's own JSON
  (`ModelMessagesTypeAdapter`), its parent entry and its 1-based position in its history. Rows are
  never updated or deleted.
- `durcap_conversations`: one row per conversation: the head entry, the integer `revision` (+1 on
  every write, never reused: a deleted conversation keeps a tombstone row), upstream's opaque
  revision token, usage, scope, fork and branch bookkeeping.
- `durcap_writes`: one row per write (append, save, delete), keyed by `(conversation_id, revision)`;
  `append_id` is unique per conversation. It is the audit log `durcap history show` prints.
- `durcap_schema_version`: the migrations applied. A store whose version is newer than this code
  knows is refused (`SchemaVersionError`) and never touched.

Every statement binds its values as parameters. Bad input never deletes or rewrites a row: the error
names the conversation, the table and the row, and leaves the fix to the operator.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import json
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self

import pydantic
import sqlalchemy as sa
from pydantic_ai import __version__ as _PYDANTIC_AI_VERSION
from pydantic_ai.conversation_store import (
    ConversationConflict,
    ConversationEntry,
    ConversationRecord,
    ConversationStore,
)
from pydantic_ai.messages import (
    CapabilityLoadDeltaPart,
    LoadCapabilityCallPart,
    LoadCapabilityReturnPart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelResponse,
    ToolAvailabilityDeltaPart,
    ToolCallPart,
    ToolSearchCallPart,
    post_compaction_window,
)
from pydantic_ai.tools import DeferredToolRequests
from pydantic_ai.usage import RunUsage

from .validation import Problem

if TYPE_CHECKING:
    from .agent import DurableAgent

__all__ = [
    'DEFAULT_URL',
    'SCHEMA_VERSION',
    'AppendIdReuseError',
    'AppendResult',
    'ConversationConflictError',
    'ConversationNotFoundError',
    'CorruptedRowError',
    'NewerHistoryError',
    'SQLConversationStore',
    'SchemaVersionError',
    'StoreError',
    'StoreURLError',
    'StoreUnavailableError',
    'StoredConversation',
    'WriteRecord',
    'drift',
    'loaded_capability_ids',
    'tools_called',
]

DEFAULT_URL = 'sqlite:///.durcap/conversations.db'
"""Where the store lives when no URL is given: `.durcap/conversations.db` under the current directory."""

SCHEMA_VERSION = 1
"""The newest schema this code writes and reads."""

_WRITER = f'pydantic-ai-slim {_PYDANTIC_AI_VERSION}'
_NO_LIMIT = 2**62


# ---- errors -----------------------------------------------------------------------------------


class StoreError(Exception):
    """Base of every error the SQL store raises of its own; catch it to handle any store failure.

    Every subclass pickles with its attributes (DBOS records a failed step's exception by pickling it).
    """

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_error, (type(self), self.args, dict(self.__dict__)))


def _restore_error(cls: type[StoreError], args: tuple[Any, ...], state: dict[str, Any]) -> StoreError:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class StoreURLError(StoreError, ValueError):
    """The store URL is malformed or names a database the store does not support."""


class StoreUnavailableError(StoreError):
    """The database cannot be reached, or (with `create=False`) holds no conversation store."""


class SchemaVersionError(StoreError):
    """The database's schema version is newer than this code knows; nothing was read or changed.

    Attributes:
        found: The version recorded in `durcap_schema_version`.
        supported: `SCHEMA_VERSION` of this code.
    """

    def __init__(self, message: str, *, found: int, supported: int):
        super().__init__(message)
        self.found = found
        self.supported = supported


class ConversationNotFoundError(StoreError, LookupError):
    """The conversation id is not in the store (never saved, or deleted).

    Attributes:
        conversation_id: The id asked for.
    """

    def __init__(self, conversation_id: str, detail: str = ''):
        self.conversation_id = conversation_id
        super().__init__(f'conversation {conversation_id!r} is not in the store{detail}')

    def __str__(self) -> str:  # LookupError would quote the message like a KeyError otherwise
        return str(self.args[0])


class ConversationConflictError(StoreError, ConversationConflict):
    """A write expected a revision the conversation no longer has; nothing was written.

    A subclass of upstream's `ConversationConflict`, so code written against upstream's store
    catches it too. Load the conversation again (or use `stored_revision`) and retry.

    Attributes:
        conversation_id: The conversation written to.
        expected_revision: The revision the write expected (`int` for `append`, upstream's opaque
            token for `save`, `None` for "must not exist yet").
        stored_revision: The revision found (same kind), `None` when the conversation does not exist.
    """

    def __init__(self, conversation_id: str, *, expected: int | str | None, stored: int | str | None, reason: str = ''):
        self.conversation_id = conversation_id
        self.expected_revision = expected
        self.stored_revision = stored
        what = 'none (it does not exist)' if stored is None else f'revision {stored}'
        wanted = 'none (a new conversation)' if expected is None else f'revision {expected}'
        message = (
            f'conversation {conversation_id!r} changed since it was read: the write expected {wanted}, the store '
            f'has {what}{reason}. Nothing was written; read it again and retry with the stored revision.'
        )
        Exception.__init__(self, message)


class AppendIdReuseError(StoreError):
    """An `append_id` already stored for this conversation came back with a different number of messages.

    A retried durable unit sends the same messages (at most rebuilt with new timestamps), so this
    means two different appends share an id. Nothing was written.
    """


class CorruptedRowError(StoreError):
    """A stored row is not what the store wrote: invalid JSON, not a pydantic-ai message, a broken link.

    Nothing was changed. Attributes: `conversation_id`, `table`, `row` (the row's key), `position`
    (1-based message position for entries, else `None`).
    """

    def __init__(self, message: str, *, conversation_id: str | None, table: str, row: str, position: int | None = None):
        super().__init__(message)
        self.conversation_id = conversation_id
        self.table = table
        self.row = row
        self.position = position


class NewerHistoryError(StoreError):
    """A stored message has a kind or part kind this pydantic-ai does not know: a newer one wrote it.

    Nothing was changed. Attributes: `conversation_id`, `row` (entry id), `position`, `tag` (the unknown
    kind), `written_by` (the writer recorded with the row).
    """

    def __init__(self, message: str, *, conversation_id: str | None, row: str, position: int | None, tag: str, written_by: str):
        super().__init__(message)
        self.conversation_id = conversation_id
        self.row = row
        self.position = position
        self.tag = tag
        self.written_by = written_by


# ---- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteRecord:
    """One row of a conversation's write log (`durcap_writes`).

    Attributes:
        revision: The conversation's revision after this write (1 for the first write).
        operation: `'append'` (our `append`), `'save'` (upstream's save / branch / fork) or `'delete'`.
        append_id: The idempotency key the append was given, if any.
        first_position: 1-based position of the first message written (the next free one when none).
        entry_ids: The entries written, in order.
        written_at: When, in UTC.
        writer: The pydantic-ai version that wrote it (`'pydantic-ai-slim 2.68.0'`).
    """

    revision: int
    operation: str
    append_id: str | None
    first_position: int | None
    entry_ids: list[str]
    written_at: datetime
    writer: str


@dataclass(frozen=True)
class AppendResult:
    """What `append` stored.

    Attributes:
        conversation_id: The conversation appended to.
        revision: The revision after the append; pass it as `expected_revision` to the next one.
        entry_ids: The entry ids of the appended messages, in order.
        first_position: 1-based position of the first appended message.
        message_count: Messages in the conversation after the append.
        replayed: True when `append_id` had been stored before: nothing was written and the earlier
            append's result is returned (a retried durable unit).
        replayed_differently: True when the replayed append came with messages that differ from the
            stored ones (same count): workflow code that ran again after a crash rebuilt them with new
            timestamps or ids. The stored messages stand.
    """

    conversation_id: str
    revision: int
    entry_ids: list[str]
    first_position: int
    message_count: int
    replayed: bool = False
    replayed_differently: bool = False


@dataclass
class StoredConversation:
    """A conversation as `read` returns it.

    Attributes:
        conversation_id: Its id.
        messages: The history (the last `limit` messages when `read` was given one), oldest first.
        revision: The integer revision to pass to `append(expected_revision=...)`.
        record: Upstream's record: head entry, usage, deferred tool requests, scope, fork and branch
            bookkeeping, and `record.revision`, the opaque token upstream's `save` checks.
        entry_ids: The entry id of each message, aligned with `messages`.
        first_position: 1-based position of `messages[0]` in the whole history.
    """

    conversation_id: str
    messages: list[ModelMessage]
    revision: int
    record: ConversationRecord
    entry_ids: list[str]
    first_position: int = 1

    @property
    def message_count(self) -> int:
        """Messages in the whole history (not only the ones read)."""
        return self.first_position - 1 + len(self.messages)

    def loaded_capability_ids(self) -> list[str]:
        """The capability ids this history loaded, in load order (see `loaded_capability_ids`)."""
        return loaded_capability_ids(self.messages)


# ---- URLs and engines -------------------------------------------------------------------------


def _parse_url(url: str) -> sa.URL:
    """The SQLAlchemy URL for `url`, with PostgreSQL pinned to psycopg 3.

    Raises:
        StoreURLError: unparsable, or a scheme other than `sqlite` / `postgresql` (`postgres`).
    """
    if not isinstance(url, str) or not url.strip():
        raise StoreURLError(f'store URL must be a non-empty string, got {url!r}')
    try:
        parsed = sa.make_url(url.replace('postgres://', 'postgresql://', 1) if url.startswith('postgres://') else url)
    except sa.exc.ArgumentError:
        raise StoreURLError(
            f'store URL {url!r} is not a database URL; use sqlite:///path/to/file.db or '
            'postgresql://user@host:5432/database'
        ) from None
    backend, _, driver = parsed.drivername.partition('+')
    if backend == 'sqlite' and driver in ('', 'pysqlite'):
        return parsed.set(drivername='sqlite')
    if backend == 'postgresql' and driver in ('', 'psycopg'):
        return parsed.set(drivername='postgresql+psycopg')
    raise StoreURLError(
        f'store URL scheme {parsed.drivername!r} is not supported; use sqlite:///path/to/file.db or '
        'postgresql://user@host:5432/database (psycopg 3)'
    )


def _utcnow() -> str:
    return datetime.now(UTC).isoformat(timespec='microseconds')


def _iso(value: datetime) -> str:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return value.astimezone(UTC).isoformat(timespec='microseconds')


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
}
"""`{version: DDL statements}`: applying version N's statements to a version N-1 database gives version N.

Append a version for every schema change; never edit one that shipped.
"""

_VERSION_TABLE = (
    'CREATE TABLE IF NOT EXISTS durcap_schema_version '
    '(version INTEGER PRIMARY KEY, applied_at TEXT NOT NULL, writer TEXT NOT NULL)'
)
_PG_MIGRATION_LOCK = 0x6475726361700001  # 'durcap' + 1: serializes migrations across processes

_CONVERSATION_COLUMNS = (
    'conversation_id, revision, token, head_id, message_count, usage, deferred_tool_requests, scope, '
    'forked_from, forked_at, branches, format_version, deleted, updated_at, writer'
)
_ENTRY_SELECT = 'SELECT entry_id, parent_id, conversation_id, position, kind, message, writer FROM durcap_entries'

_USAGE = pydantic.TypeAdapter(RunUsage)
_DEFERRED = pydantic.TypeAdapter(DeferredToolRequests)
_BRANCHES = pydantic.TypeAdapter(list[str])


def _encode(message: ModelMessage) -> str:
    """One message as pydantic-ai's JSON (an element of `ModelMessagesTypeAdapter.dump_json`)."""
    return ModelMessagesTypeAdapter.dump_json([message])[1:-1].decode()


def _digest(encoded: Sequence[str]) -> str:
    return hashlib.sha256('\x1e'.join(encoded).encode()).hexdigest()


# ---- the store --------------------------------------------------------------------------------


class SQLConversationStore(ConversationStore):
    """Conversations in SQLite or PostgreSQL, append-only, as pydantic-ai's own message JSON.

    Args:
        url: `sqlite:///relative/path.db`, `sqlite:////absolute/path.db`, `sqlite:///:memory:` (one
            process only) or `postgresql://user:password@host:port/database` (`postgres://` and
            `postgresql+psycopg://` accepted; the driver is psycopg 3). Default `DEFAULT_URL`.
        create: Create the SQLite file, its folder and the tables when missing (default). With
            `False`, a missing file or schema raises `StoreUnavailableError` instead (for readers such
            as `durcap history show`, which must not leave an empty store behind).

    Nothing touches the database until the first operation, which migrates the schema to
    `SCHEMA_VERSION` (one process at a time). Use the store inside durable units (activities, steps,
    tasks), never in workflow code. Thread- and process-safe; the async methods run the database
    work in a worker thread.

    `delete` (upstream's) hides a conversation but keeps its entries and a tombstone row, so a
    conversation created again under the same id continues the revision count and a writer holding
    the old revision gets a conflict. Entries are never deleted.

    Raises:
        StoreURLError: `url` is malformed or not SQLite / PostgreSQL (at construction).
    """

    def __init__(self, url: str = DEFAULT_URL, *, create: bool = True) -> None:
        self.url = url
        self._sql = _SQLBackend(_parse_url(url), create=create)

    def __repr__(self) -> str:
        return f'SQLConversationStore({self._sql.display_url!r})'

    def close(self) -> None:
        """Close the pooled connections. The store reconnects if used again."""
        self._sql.engine.dispose()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    # ---- ours ---------------------------------------------------------------------------------

    async def read(self, conversation_id: str, *, limit: int | None = None, scope: str | None = None) -> StoredConversation:
        """Read a conversation's history and revision in one transaction.

        Args:
            conversation_id: The conversation.
            limit: Read only its last `limit` messages (>= 0); `None` reads all.
            scope: Only read it if it was saved with this scope.

        Returns:
            A `StoredConversation`; `revision` is what the next `append` expects.

        Raises:
            ConversationNotFoundError: not in the store (or deleted, or saved with another scope).
            CorruptedRowError: a row is not valid JSON, not a pydantic-ai message, or the history's chain
                of entries is broken.
            NewerHistoryError: a message has a kind or part kind this pydantic-ai does not know.
            SchemaVersionError, StoreUnavailableError: see the class docstrings.
            ValueError: negative `limit`.
        """
        if limit is not None and limit < 0:
            raise ValueError('`limit` must not be negative')
        return await asyncio.to_thread(self._sql.read, conversation_id, limit, scope)

    async def append(
        self,
        conversation_id: str,
        messages: Sequence[ModelMessage],
        *,
        expected_revision: int | None,
        append_id: str | None = None,
        usage: RunUsage | None = None,
        deferred_tool_requests: DeferredToolRequests | None = None,
        scope: str | None = None,
    ) -> AppendResult:
        """Append messages after the conversation's last one, if it is still at `expected_revision`.

        Args:
            conversation_id: The conversation; created when `expected_revision` is `None`.
            messages: pydantic-ai messages, oldest first (a run's `new_messages()`). May be empty (the
                revision still advances, e.g. to record usage).
            expected_revision: The `revision` read before the run, or `None` for a new conversation.
            append_id: An idempotency key, unique per conversation (e.g. the workflow id and the step).
                If it was stored before with as many messages, nothing is written and the earlier
                result is returned with `replayed=True`, whatever the conversation's revision is now
                (the messages stored first stand; see `AppendResult.replayed_differently`).
            usage: The usage of the run that produced `messages`; added to the stored total.
            deferred_tool_requests: The tool calls the conversation now waits on (`None`: none).
            scope: Whose conversation it is. A new conversation is stored with it; an existing one
                must have been stored with it.

        Returns:
            An `AppendResult` with the new revision.

        Raises:
            ConversationConflictError: the stored revision is not `expected_revision` (also when the
                conversation does not exist and a revision was expected, or exists and `None` was),
                or `scope` differs from the stored one. Nothing was written.
            AppendIdReuseError: `append_id` was stored before with a different number of messages (so
                it is not a retry of the same append). Nothing was written.
            CorruptedRowError, SchemaVersionError, StoreUnavailableError: see the class docstrings.
            ValueError: empty `conversation_id`, `expected_revision` < 1.
        """
        if not isinstance(conversation_id, str) or not conversation_id:
            raise ValueError('`conversation_id` must be a non-empty string')
        if expected_revision is not None and (isinstance(expected_revision, bool) or expected_revision < 1):
            raise ValueError('`expected_revision` must be a revision (>= 1) or None for a new conversation')
        encoded = [_encode(message) for message in messages]
        return await asyncio.to_thread(
            self._sql.append, conversation_id, encoded, expected_revision, append_id, usage, deferred_tool_requests, scope
        )

    async def writes(self, conversation_id: str) -> list[WriteRecord]:
        """The conversation's write log, oldest first (empty for an unknown id)."""
        return await asyncio.to_thread(self._sql.writes, conversation_id)

    # ---- upstream's primitives ----------------------------------------------------------------

    async def read_record(self, conversation_id: str) -> ConversationRecord | None:
        """Upstream primitive: the record, or `None` when missing or deleted.

        Raises:
            CorruptedRowError: the conversation row's JSON columns do not parse.
        """
        return await asyncio.to_thread(self._sql.read_record, conversation_id)

    async def read_records(self, *, scope: str | None = None, limit: int | None = None) -> Sequence[ConversationRecord]:
        """Upstream primitive: live records, newest `updated_at` first, at most `limit`."""
        return await asyncio.to_thread(self._sql.read_records, scope, limit)

    async def write_record(
        self,
        record: ConversationRecord,
        *,
        new_entries: Sequence[ConversationEntry] = (),
        expected_revision: str | None,
    ) -> None:
        """Upstream primitive: store `record` and `new_entries` in one transaction.

        Raises:
            ConversationConflictError: the stored token is not `expected_revision`, or `record.head_id`
                names an entry neither the store nor `new_entries` has.
        """
        encoded = [(entry, _encode(entry.message)) for entry in new_entries]
        await asyncio.to_thread(self._sql.write_record, record, encoded, expected_revision)

    async def delete_record(self, conversation_id: str, *, expected_revision: str) -> None:
        """Upstream primitive: mark the conversation deleted; its entries and write log are kept.

        Raises:
            ConversationConflictError: no live record with the token `expected_revision`.
        """
        await asyncio.to_thread(self._sql.delete_record, conversation_id, expected_revision)

    async def read_entry(self, entry_id: str) -> ConversationEntry:
        """Upstream primitive: one entry.

        Raises:
            KeyError: no such entry.
            CorruptedRowError, NewerHistoryError: the row does not decode.
        """
        return await asyncio.to_thread(self._sql.read_entry, entry_id)

    async def read_history(self, head_id: str | None, *, limit: int | None = None) -> list[ConversationEntry]:
        """Upstream primitive: the entries from the first up to `head_id` (the last `limit`), oldest first.

        One range query per conversation the history runs through (one, unless it was forked), not one
        query per entry.

        Raises:
            CorruptedRowError, NewerHistoryError: an entry is missing or does not decode.
        """
        if head_id is None:
            return []
        return await asyncio.to_thread(self._sql.read_history, head_id, limit)


# ---- the synchronous implementation -----------------------------------------------------------


@dataclass
class _Row:
    """A decoded `durcap_conversations` row."""

    record: ConversationRecord
    revision: int
    message_count: int
    deleted: bool


class _SQLBackend:
    """The SQL work, synchronous; `SQLConversationStore` runs it in a worker thread."""

    def __init__(self, url: sa.URL, *, create: bool) -> None:
        self.url = url
        self.create = create
        self.display_url = url.render_as_string(hide_password=True)
        self.is_pg = url.get_backend_name() == 'postgresql'
        self._ready = False
        self._lock = threading.Lock()
        if self.is_pg:
            try:
                self.engine = sa.create_engine(url, pool_pre_ping=True)
            except ImportError:
                raise StoreURLError(
                    f'{self.display_url} needs psycopg 3: pip install "durable-capabilities[postgres]"'
                ) from None
        else:
            memory = url.database in (None, '', ':memory:')
            self.engine = sa.create_engine(
                url,
                connect_args={'timeout': 60, 'check_same_thread': False},
                **({'poolclass': sa.pool.StaticPool} if memory else {}),
            )
            # Take transactions out of pysqlite's hands so a write can begin with BEGIN IMMEDIATE: the
            # revision it reads is then the one it writes after, across processes.
            sa.event.listen(self.engine, 'connect', _sqlite_connect)
            sa.event.listen(self.engine, 'begin', _sqlite_begin)

    # ---- connections and schema ---------------------------------------------------------------

    @contextmanager
    def _txn(self, *, write: bool) -> Iterator[sa.Connection]:
        self._ensure_ready()
        try:
            conn = self.engine.connect()
        except sa.exc.OperationalError as exc:
            raise StoreUnavailableError(f'cannot connect to the conversation store {self.display_url}: {_first_line(exc)}') from None
        with conn:
            if write:
                conn.execution_options(durcap_write=True)
            with conn.begin():
                yield conn

    def _ensure_ready(self) -> None:
        if self._ready:
            return
        with self._lock:
            if self._ready:
                return
            if not self.is_pg and self.url.database not in (None, '', ':memory:'):
                path = Path(self.url.database)  # type: ignore[arg-type]
                if not path.exists():
                    if not self.create:
                        raise StoreUnavailableError(f'no conversation store at {self.display_url} (file {path} does not exist)')
                    path.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._migrate()
            except sa.exc.DBAPIError as exc:
                raise StoreUnavailableError(f'cannot use the conversation store {self.display_url}: {_first_line(exc)}') from None
            self._ready = True

    def _current_version(self, conn: sa.Connection) -> tuple[int, str | None]:
        row = conn.execute(
            sa.text('SELECT version, writer FROM durcap_schema_version ORDER BY version DESC LIMIT 1')
        ).first()
        return (0, None) if row is None else (int(row[0]), row[1])

    def _migrate(self) -> None:
        with self.engine.connect() as conn:
            with conn.begin():
                exists = sa.inspect(conn).has_table('durcap_schema_version')
                version, writer = self._current_version(conn) if exists else (0, None)
            if exists:
                self._refuse_newer(version, writer)
                if version == SCHEMA_VERSION:
                    return
            elif not self.create:
                raise StoreUnavailableError(f'{self.display_url} holds no conversation store (no durcap_schema_version table)')
            conn.execution_options(durcap_write=True)
            with conn.begin():
                if self.is_pg:
                    conn.execute(sa.text('SELECT pg_advisory_xact_lock(:key)'), {'key': _PG_MIGRATION_LOCK})
                conn.exec_driver_sql(_VERSION_TABLE)
                version, writer = self._current_version(conn)
                self._refuse_newer(version, writer)
                for target in sorted(v for v in _MIGRATIONS if v > version):
                    for statement in _MIGRATIONS[target]:
                        conn.exec_driver_sql(statement)
                    conn.execute(
                        sa.text('INSERT INTO durcap_schema_version (version, applied_at, writer) VALUES (:v, :at, :w)'),
                        {'v': target, 'at': _utcnow(), 'w': f'durable-capabilities ({_WRITER})'},
                    )

    def _refuse_newer(self, version: int, writer: str | None) -> None:
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f'the conversation store {self.display_url} has schema version {version} (written by {writer}); this '
                f'durable-capabilities knows versions up to {SCHEMA_VERSION}. Upgrade durable-capabilities here; the '
                'store was not changed.',
                found=version,
                supported=SCHEMA_VERSION,
            )

    # ---- reading ------------------------------------------------------------------------------

    def _conversation_row(self, conn: sa.Connection, conversation_id: str, *, lock: bool = False) -> _Row | None:
        sql = f'SELECT {_CONVERSATION_COLUMNS} FROM durcap_conversations WHERE conversation_id = :cid'
        if lock and self.is_pg:
            sql += ' FOR UPDATE'
        row = conn.execute(sa.text(sql), {'cid': conversation_id}).first()
        return None if row is None else _decode_row(row)

    def read_record(self, conversation_id: str) -> ConversationRecord | None:
        with self._txn(write=False) as conn:
            row = self._conversation_row(conn, conversation_id)
        return None if row is None or row.deleted else row.record

    def read_records(self, scope: str | None, limit: int | None) -> list[ConversationRecord]:
        sql = f'SELECT {_CONVERSATION_COLUMNS} FROM durcap_conversations WHERE deleted = 0'
        params: dict[str, Any] = {}
        if scope is not None:
            sql += ' AND scope = :scope'
            params['scope'] = scope
        sql += ' ORDER BY updated_at DESC, conversation_id'
        if limit is not None:
            sql += ' LIMIT :limit'
            params['limit'] = limit
        with self._txn(write=False) as conn:
            rows = conn.execute(sa.text(sql), params).all()
        return [_decode_row(row).record for row in rows]

    def _history_rows(self, conn: sa.Connection, head_id: str, limit: int | None, conversation_id: str | None) -> list[Any]:
        """The entry rows from the first (or the `limit`-th last) up to `head_id`, oldest first.

        Positions along a history go down by one from child to parent, so the rows are read a range of
        positions at a time from the conversation that wrote them and linked up in memory: one range for
        a conversation's own history, one more for each fork it descends from. A range holding one line
        of entries (no branch) is taken whole after checking its links.

        Raises:
            CorruptedRowError: an entry on the way is missing or its position does not fit its parent's.
        """
        want = _NO_LIMIT if limit is None else limit
        whose = f'conversation {conversation_id!r}: ' if conversation_id else ''
        chain: list[Any] = []  # newest first
        next_id: str | None = head_id
        child: Any = None  # the oldest row taken so far
        while next_id is not None and len(chain) < want:
            anchor = conn.execute(sa.text(f'{_ENTRY_SELECT} WHERE entry_id = :id'), {'id': next_id}).first()
            if anchor is None:
                what = f'the head entry {next_id!r}' if child is None else (
                    f'entry {next_id!r}, the parent of entry {child.entry_id!r} (message {child.position}),'
                )
                raise CorruptedRowError(
                    f'{whose}{what} is missing from durcap_entries. Nothing was changed; restore it from a backup.',
                    conversation_id=conversation_id, table='durcap_entries',
                    row=next_id if child is None else child.entry_id, position=None if child is None else child.position,
                )
            if child is not None and anchor.position != child.position - 1:
                raise _misplaced(whose, conversation_id, child, anchor)
            low = max(1, anchor.position - (want - len(chain)) + 1)
            rows = conn.execute(
                sa.text(
                    f'{_ENTRY_SELECT} WHERE conversation_id = :owner AND position >= :low AND position < :high '
                    'ORDER BY position'
                ),
                {'owner': anchor.conversation_id, 'low': low, 'high': anchor.position},
            ).all()
            if _is_line(rows, anchor, low):
                chain.append(anchor)
                chain.extend(reversed(rows))
                child = chain[-1]
                next_id = child.parent_id if len(chain) < want else None
                continue
            by_id = {row.entry_id: row for row in rows}
            row, next_id = anchor, None
            while True:
                chain.append(row)
                child = row
                if row.parent_id is None or len(chain) >= want:
                    break
                if row.parent_id not in by_id:
                    next_id = row.parent_id  # written by another conversation (a fork): read its range
                    break
                row = by_id[row.parent_id]
                if row.position != child.position - 1:
                    raise _misplaced(whose, conversation_id, child, row)
        chain.reverse()
        return chain

    def read(self, conversation_id: str, limit: int | None, scope: str | None) -> StoredConversation:
        with self._txn(write=False) as conn:
            row = self._conversation_row(conn, conversation_id)
            if row is None or row.deleted:
                raise ConversationNotFoundError(conversation_id, ' (it was deleted)' if row is not None else '')
            if scope is not None and row.record.scope != scope:
                raise ConversationNotFoundError(conversation_id, f' with scope {scope!r}')
            head = row.record.head_id
            rows = [] if head is None else self._history_rows(conn, head, limit, conversation_id)
        messages = _decode_messages(rows, conversation_id)
        return StoredConversation(
            conversation_id=conversation_id,
            messages=messages,
            revision=row.revision,
            record=row.record,
            entry_ids=[r.entry_id for r in rows],
            first_position=rows[0].position if rows else row.message_count + 1,
        )

    def read_history(self, head_id: str, limit: int | None) -> list[ConversationEntry]:
        with self._txn(write=False) as conn:
            rows = self._history_rows(conn, head_id, limit, None)
        messages = _decode_messages(rows, None)
        return [ConversationEntry(id=r.entry_id, parent_id=r.parent_id, message=m) for r, m in zip(rows, messages)]

    def read_entry(self, entry_id: str) -> ConversationEntry:
        with self._txn(write=False) as conn:
            row = conn.execute(sa.text(f'{_ENTRY_SELECT} WHERE entry_id = :id'), {'id': entry_id}).first()
        if row is None:
            raise KeyError(entry_id)
        return ConversationEntry(id=row.entry_id, parent_id=row.parent_id, message=_decode_messages([row], None)[0])

    def writes(self, conversation_id: str) -> list[WriteRecord]:
        with self._txn(write=False) as conn:
            rows = conn.execute(
                sa.text(
                    'SELECT revision, operation, append_id, first_position, entry_ids, written_at, writer '
                    'FROM durcap_writes WHERE conversation_id = :cid ORDER BY revision'
                ),
                {'cid': conversation_id},
            ).all()
        result = []
        for row in rows:
            try:
                entry_ids = _BRANCHES.validate_json(row.entry_ids)
                written_at = datetime.fromisoformat(row.written_at)
            except (pydantic.ValidationError, ValueError) as exc:
                raise CorruptedRowError(
                    f'conversation {conversation_id!r}: durcap_writes row revision {row.revision} does not decode '
                    f'({_first_line(exc)}). Nothing was changed.',
                    conversation_id=conversation_id, table='durcap_writes', row=str(row.revision),
                ) from None
            result.append(
                WriteRecord(int(row.revision), row.operation, row.append_id, row.first_position, entry_ids, written_at, row.writer)
            )
        return result

    # ---- writing ------------------------------------------------------------------------------

    def _insert_entries(self, conn: sa.Connection, conversation_id: str, rows: list[dict[str, Any]]) -> None:
        if rows:
            conn.execute(
                sa.text(
                    'INSERT INTO durcap_entries (entry_id, parent_id, conversation_id, position, kind, message, writer, '
                    'created_at) VALUES (:entry_id, :parent_id, :cid, :position, :kind, :message, :writer, :at)'
                ),
                [row | {'cid': conversation_id, 'writer': _WRITER} for row in rows],
            )

    def _store_row(
        self, conn: sa.Connection, old: _Row | None, record: ConversationRecord, *, message_count: int, token: str
    ) -> int:
        """Insert or update the conversation row; returns the new integer revision."""
        revision = (old.revision if old is not None else 0) + 1
        values = {
            'cid': record.conversation_id,
            'revision': revision,
            'token': token,
            'head_id': record.head_id,
            'message_count': message_count,
            'usage': _USAGE.dump_json(record.usage).decode(),
            'deferred': None if record.deferred_tool_requests is None else _DEFERRED.dump_json(record.deferred_tool_requests).decode(),
            'scope': record.scope,
            'forked_from': record.forked_from,
            'forked_at': record.forked_at,
            'branches': json.dumps(list(record.branches)),
            'format_version': record.format_version,
            'updated_at': _iso(record.updated_at),
            'writer': _WRITER,
        }
        if old is None:
            conn.execute(
                sa.text(
                    f'INSERT INTO durcap_conversations ({_CONVERSATION_COLUMNS}) VALUES (:cid, :revision, :token, '
                    ':head_id, :message_count, :usage, :deferred, :scope, :forked_from, :forked_at, :branches, '
                    ':format_version, 0, :updated_at, :writer)'
                ),
                values,
            )
        else:
            done = conn.execute(
                sa.text(
                    'UPDATE durcap_conversations SET revision = :revision, token = :token, head_id = :head_id, '
                    'message_count = :message_count, usage = :usage, deferred_tool_requests = :deferred, '
                    'scope = :scope, forked_from = :forked_from, forked_at = :forked_at, branches = :branches, '
                    'format_version = :format_version, deleted = 0, updated_at = :updated_at, writer = :writer '
                    'WHERE conversation_id = :cid AND revision = :old_revision'
                ),
                values | {'old_revision': old.revision},
            )
            if done.rowcount != 1:  # cannot happen under the row lock; never overwrite if it does
                raise ConversationConflictError(record.conversation_id, expected=old.revision, stored=None)
        return revision

    def _log_write(
        self,
        conn: sa.Connection,
        conversation_id: str,
        revision: int,
        operation: str,
        *,
        entry_ids: list[str],
        first_position: int | None,
        append_id: str | None = None,
        digest: str | None = None,
    ) -> None:
        conn.execute(
            sa.text(
                'INSERT INTO durcap_writes (conversation_id, revision, operation, append_id, digest, first_position, '
                'entry_ids, written_at, writer) VALUES (:cid, :revision, :op, :append_id, :digest, :first, :ids, :at, :w)'
            ),
            {
                'cid': conversation_id, 'revision': revision, 'op': operation, 'append_id': append_id, 'digest': digest,
                'first': first_position, 'ids': json.dumps(entry_ids), 'at': _utcnow(), 'w': _WRITER,
            },
        )

    def _retrying_creation(self, attempt: Any) -> Any:
        """Run a write; if two writers created the same conversation at once, run it again (it then sees the row)."""
        for tries in range(3):
            try:
                return attempt()
            except sa.exc.IntegrityError:
                if tries == 2:
                    raise
        raise AssertionError('unreachable')

    def append(
        self,
        conversation_id: str,
        encoded: list[str],
        expected: int | None,
        append_id: str | None,
        usage: RunUsage | None,
        deferred: DeferredToolRequests | None,
        scope: str | None,
    ) -> AppendResult:
        digest = _digest(encoded)

        def attempt() -> AppendResult:
            with self._txn(write=True) as conn:
                old = self._conversation_row(conn, conversation_id, lock=True)
                if append_id is not None:
                    earlier = conn.execute(
                        sa.text(
                            'SELECT revision, digest, first_position, entry_ids FROM durcap_writes '
                            'WHERE conversation_id = :cid AND append_id = :aid'
                        ),
                        {'cid': conversation_id, 'aid': append_id},
                    ).first()
                    if earlier is not None:
                        ids = json.loads(earlier.entry_ids)
                        if len(ids) != len(encoded):
                            raise AppendIdReuseError(
                                f'conversation {conversation_id!r}: append_id {append_id!r} was stored at revision '
                                f'{earlier.revision} with {len(ids)} message(s), and now comes with {len(encoded)}; '
                                'nothing was written. Give each append its own id.'
                            )
                        return AppendResult(
                            conversation_id, int(earlier.revision), ids, int(earlier.first_position),
                            int(earlier.first_position) - 1 + len(ids), replayed=True,
                            replayed_differently=earlier.digest != digest,
                        )
                live = old is not None and not old.deleted
                stored = old.revision if live else None  # type: ignore[union-attr]
                if stored != expected:
                    raise ConversationConflictError(conversation_id, expected=expected, stored=stored)
                if live and scope is not None and old.record.scope != scope:  # type: ignore[union-attr]
                    raise ConversationConflictError(
                        conversation_id, expected=expected, stored=stored,
                        reason=f', saved with scope {old.record.scope!r}, not {scope!r}',  # type: ignore[union-attr]
                    )
                base = old.record if live else ConversationRecord(conversation_id=conversation_id, head_id=None, scope=scope)  # type: ignore[union-attr]
                count = old.message_count if live else 0  # type: ignore[union-attr]
                parent = base.head_id
                rows = []
                for offset, message in enumerate(encoded):
                    entry_id = str(uuid.uuid4())
                    rows.append({
                        'entry_id': entry_id, 'parent_id': parent, 'position': count + offset + 1,
                        'kind': 'message', 'message': message, 'at': _utcnow(),
                    })
                    parent = entry_id
                self._insert_entries(conn, conversation_id, rows)
                record = dataclasses.replace(
                    base,
                    head_id=parent,
                    usage=base.usage + usage if usage is not None else base.usage,
                    deferred_tool_requests=deferred,
                    updated_at=datetime.now(UTC),
                )
                revision = self._store_row(conn, old, record, message_count=count + len(encoded), token=str(uuid.uuid4()))
                ids = [row['entry_id'] for row in rows]
                self._log_write(
                    conn, conversation_id, revision, 'append', entry_ids=ids, first_position=count + 1,
                    append_id=append_id, digest=digest,
                )
                return AppendResult(conversation_id, revision, ids, count + 1, count + len(encoded))

        return self._retrying_creation(attempt)

    def write_record(self, record: ConversationRecord, encoded: list[tuple[ConversationEntry, str]], expected: str | None) -> None:
        cid = record.conversation_id

        def attempt() -> None:
            with self._txn(write=True) as conn:
                old = self._conversation_row(conn, cid, lock=True)
                live = old is not None and not old.deleted
                stored = old.record.revision if live else None  # type: ignore[union-attr]
                if stored != expected:
                    raise ConversationConflictError(cid, expected=expected, stored=stored)
                positions: dict[str, int] = {}
                rows = []
                for entry, message in encoded:
                    if entry.parent_id is None:
                        position = 1
                    elif entry.parent_id in positions:
                        position = positions[entry.parent_id] + 1
                    else:
                        parent_position = self._entry_position(conn, entry.parent_id)
                        if parent_position is None:
                            raise ConversationConflictError(
                                cid, expected=expected, stored=stored, reason=f'; entry {entry.parent_id!r} is gone'
                            )
                        position = parent_position + 1
                    positions[entry.id] = position
                    rows.append({
                        'entry_id': entry.id, 'parent_id': entry.parent_id, 'position': position,
                        'kind': entry.kind, 'message': message, 'at': _utcnow(),
                    })
                head = record.head_id
                if head is None:
                    count = 0
                elif head in positions:
                    count = positions[head]
                else:
                    found = self._entry_position(conn, head)
                    if found is None:
                        raise ConversationConflictError(cid, expected=expected, stored=stored, reason=f'; entry {head!r} is gone')
                    count = found
                self._insert_entries(conn, cid, rows)
                revision = self._store_row(conn, old, record, message_count=count, token=record.revision)
                self._log_write(
                    conn, cid, revision, 'save', entry_ids=[r['entry_id'] for r in rows],
                    first_position=rows[0]['position'] if rows else count + 1,
                )

        self._retrying_creation(attempt)

    def _entry_position(self, conn: sa.Connection, entry_id: str) -> int | None:
        row = conn.execute(sa.text('SELECT position FROM durcap_entries WHERE entry_id = :id'), {'id': entry_id}).first()
        return None if row is None else int(row[0])

    def delete_record(self, conversation_id: str, expected: str) -> None:
        with self._txn(write=True) as conn:
            old = self._conversation_row(conn, conversation_id, lock=True)
            if old is None or old.deleted or old.record.revision != expected:
                stored = old.record.revision if old is not None and not old.deleted else None
                raise ConversationConflictError(conversation_id, expected=expected, stored=stored)
            revision = old.revision + 1
            conn.execute(
                sa.text(
                    'UPDATE durcap_conversations SET deleted = 1, revision = :revision, token = :token, '
                    'updated_at = :at, writer = :w WHERE conversation_id = :cid AND revision = :old'
                ),
                {'revision': revision, 'token': str(uuid.uuid4()), 'at': _utcnow(), 'w': _WRITER,
                 'cid': conversation_id, 'old': old.revision},
            )
            self._log_write(conn, conversation_id, revision, 'delete', entry_ids=[], first_position=None)


def _is_line(rows: Sequence[Any], anchor: Any, low: int) -> bool:
    """Whether `rows` (ordered by position, from `low` up to the anchor's) are one line of entries ending at `anchor`."""
    if len(rows) != anchor.position - low:
        return False
    if not rows:
        return True
    if anchor[1] != rows[-1][0] or rows[0][3] != low:
        return False
    return all(older[0] == newer[1] for older, newer in itertools.pairwise(rows))


def _misplaced(whose: str, conversation_id: str | None, child: Any, parent: Any) -> CorruptedRowError:
    return CorruptedRowError(
        f'{whose}entry {child.entry_id!r} is at position {child.position} but its parent {parent.entry_id!r} is at '
        f'{parent.position}. Nothing was changed; restore the rows from a backup.',
        conversation_id=conversation_id, table='durcap_entries', row=child.entry_id, position=child.position,
    )


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    dbapi_connection.isolation_level = None
    # Readers do not block the writer nor the writer readers; a no-op once set, 'memory' for :memory:.
    dbapi_connection.execute('PRAGMA journal_mode=WAL')


def _sqlite_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql('BEGIN IMMEDIATE' if conn.get_execution_options().get('durcap_write') else 'BEGIN')


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, 'orig', None) or exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# ---- decoding rows ----------------------------------------------------------------------------


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
    return _Row(record, int(row.revision), int(row.message_count), bool(row.deleted))


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


# ---- what a history says ----------------------------------------------------------------------


def loaded_capability_ids(messages: Sequence[ModelMessage]) -> list[str]:
    """The capability ids a history loaded, in the order first loaded.

    The same rule upstream applies when a run starts from `message_history` (pydantic-ai 2.68 keeps
    it private, `_deferred_capabilities.parse_loaded_capabilities`), written with public names: only
    the messages after the last compaction (`post_compaction_window`) count; a capability is loaded by
    a `load_capability` return that completes its call, or by a `CapabilityLoadDeltaPart` naming it
    (`ctx.load_capability()` from a tool). A failed load loads nothing. Upstream then narrows the set to
    the capabilities the agent registers; `drift` reports the ones it would drop.

    Args:
        messages: A history, oldest first.

    Returns:
        Capability ids, without repeats.
    """
    return list(_loads(post_compaction_window(messages)))


@dataclass
class _Load:
    position: int  # 1-based message position of the load
    tools: set[str] = field(default_factory=set)  # tools revealed by the load


def _loads(window: Sequence[ModelMessage], offset: int = 0) -> dict[str, _Load]:
    """`{capability id: where it was loaded and the tools its load revealed}`, in load order."""
    calls: dict[str, str] = {}
    by_call: dict[str | None, list[str]] = {}
    loads: dict[str, _Load] = {}
    for index, message in enumerate(window, start=offset + 1):
        for part in message.parts:
            if isinstance(part, LoadCapabilityCallPart):
                if part.capability_id is not None:
                    calls[part.tool_call_id] = part.capability_id
                continue
            if isinstance(part, ToolAvailabilityDeltaPart):
                for capability_id in by_call.get(part.tool_call_id, []):
                    loads[capability_id].tools.update(part.tools_added)
                continue
            if isinstance(part, CapabilityLoadDeltaPart):
                ids, call_id = list(part.loaded), part.tool_call_id
            elif isinstance(part, LoadCapabilityReturnPart) and part.tool_call_id in calls:
                ids, call_id = [calls[part.tool_call_id]], part.tool_call_id
            else:
                continue
            for capability_id in ids:
                loads.setdefault(capability_id, _Load(index))
                by_call.setdefault(call_id, []).append(capability_id)
    return loads


def tools_called(messages: Sequence[ModelMessage]) -> dict[str, int]:
    """`{tool name: number of calls}` over the model's tool calls, first call first.

    `load_capability` and tool-search calls are counted too; provider-native (builtin) tools are not.
    """
    counts: dict[str, int] = {}
    for message in messages:
        if isinstance(message, ModelResponse):
            for part in message.parts:
                if isinstance(part, ToolCallPart):
                    counts[part.tool_name] = counts.get(part.tool_name, 0) + 1
    return counts


def drift(
    history: Sequence[ModelMessage],
    definition: DurableAgent[Any, Any],
    *,
    severity: Literal['error', 'warning'] = 'error',
    conversation_id: str | None = None,
) -> list[Problem]:
    """What a stored history refers to that `definition` no longer has, as `Problem`s.

    - DC018: the history loaded a capability id the definition does not register (renamed or
      removed). Upstream would silently drop it on resume: the model sees the catalog again, or gets
      "Unknown tool" for its tools. When a current capability has the tools the old one revealed, the
      problem names it as the likely new id. An id the definition keeps as an alias
      (`DurableAgent(aliases={new: old})`) is reported at `'info'`: the agent maps it on resume
      (`aliases.rewrite_history`, `CapabilityAliases`).
    - DC019: the history called a tool no agent tool or capability defines any more. Output tools
      (`final_result*` and `ToolOutput(name=...)`) and `load_capability` are not reported. When some
      capability's tools are only known at run time (MCP, toolset functions), an unknown tool not
      revealed by a missing capability is reported at `'info'`: it may still exist.

    Only the messages after the last compaction count, as upstream's own rebuild.

    Args:
        history: The stored messages, oldest first.
        definition: The definition the conversation will resume with.
        severity: `'error'` (default: a runner refuses to resume) or `'warning'` (resume and report).
        conversation_id: Named in each problem's `where`.

    Returns:
        The problems, DC018 first, each naming the old id, the message position and what to do.
    """
    window = post_compaction_window(history)
    offset = len(history) - len(window)
    loads = _loads(window, offset)
    where = f'conversation {conversation_id!r}' if conversation_id else 'history'
    current = set(definition.capability_ids())
    aliased = {old: new for new, old in getattr(definition, 'aliases', {}).items()}
    static, unknown_owners = _static_tools(definition)
    known_tools = set(static) | set(_agent_tool_names(definition))
    output_names = _output_tool_names(definition.output_type)
    problems: list[Problem] = []
    missing_tools: dict[str, str] = {}  # tool -> missing capability that revealed it
    for capability_id, load in loads.items():
        if capability_id in current:
            continue
        for tool in load.tools:
            missing_tools.setdefault(tool, capability_id)
        if capability_id in aliased:
            problems.append(Problem(
                'DC018', 'info', where,
                f'the history loaded capability {capability_id!r} (message {load.position}), which the definition now '
                f'calls {aliased[capability_id]!r}; its alias maps the load on resume.',
                f"Nothing to do while `aliases={{'{aliased[capability_id]}': '{capability_id}'}}` stays in the "
                'definition; drop the alias only once no stored conversation needs it.',
            ))
            continue
        # The likely new id: the current capability defining most of the tools the old load revealed.
        owners: dict[str, set[str]] = {}
        for tool in load.tools:
            for owner in static.get(tool, ()):
                owners.setdefault(owner, set()).add(tool)
        successors = sorted(owners, key=lambda cid: (-len(owners[cid]), cid))
        if successors:
            hint = f' It looks renamed to {successors[0]!r}, which has {", ".join(sorted(owners[successors[0]]))}.'
        elif load.tools:
            hint = ' No current capability has the tools its load revealed; it looks removed.'
        else:
            hint = ' Its load revealed no tools, so a rename cannot be told from a removal.'

        new_id = successors[0] if successors else 'the new id'
        problems.append(Problem(
            'DC018', severity, where,
            f'the history loaded capability {capability_id!r} (message {load.position}), which the definition no '
            f'longer has; on resume it would silently not be loaded.{hint}',
            f"Keep an alias: `DurableAgent(..., aliases={{'{new_id}': '{capability_id}'}})` (or give a capability "
            f'the id {capability_id!r} back); or start a new conversation.',
        ))
    first_call: dict[str, int] = {}
    for index, message in enumerate(window, start=offset + 1):
        if isinstance(message, ModelResponse):
            for part in message.parts:
                if isinstance(part, ToolCallPart) and not isinstance(part, (LoadCapabilityCallPart, ToolSearchCallPart)):
                    first_call.setdefault(part.tool_name, index)
    for tool, position in first_call.items():
        if tool in known_tools or _is_output_tool(tool, output_names):
            continue
        via = missing_tools.get(tool)
        unsure = bool(unknown_owners) and via is None
        source = f', revealed by capability {via!r}, which the definition no longer has' if via else ''
        maybe = (
            f' (the tools of {", ".join(repr(c) for c in sorted(unknown_owners))} are only known at run time, so it '
            'may still exist)' if unsure else ''
        )
        problems.append(Problem(
            'DC019', 'info' if unsure else severity, where,
            f'the history called tool {tool!r} (message {position}{source}), which no capability or agent tool of the '
            f'definition defines{maybe}; on resume the model would get "Unknown tool" if it calls it again.',
            f'Keep a tool named {tool!r} (in the capability that had it, or one aliased to it), or start a new '
            'conversation.',
        ))
    return problems


def _static_tools(definition: DurableAgent[Any, Any]) -> tuple[dict[str, set[str]], set[str]]:
    """`({tool name: ids of the capabilities defining it}, ids of capabilities whose tools are only known at run time)`."""
    from pydantic_ai.toolsets import CombinedToolset, FunctionToolset

    tools: dict[str, set[str]] = {}
    unknown: set[str] = set()

    def names(toolset: Any) -> list[str] | None:
        if isinstance(toolset, FunctionToolset):
            return list(toolset.tools)
        if isinstance(toolset, CombinedToolset):
            found: list[str] = []
            for child in toolset.toolsets:
                child_names = names(child)
                if child_names is None:
                    return None
                found.extend(child_names)
            return found
        return None

    def visit(capability: Any) -> None:
        try:
            toolset = capability.get_toolset()
        except Exception:  # noqa: BLE001 - a capability failing here fails at Agent() with its own error
            toolset = None
        if toolset is None or capability.id is None:
            return
        found = names(toolset)
        if found is None:
            unknown.add(capability.id)
            return
        for name in found:
            tools.setdefault(name, set()).add(capability.id)

    for capability in definition.capabilities:
        capability.apply(visit)
    return tools, unknown


def _agent_tool_names(definition: DurableAgent[Any, Any]) -> list[str]:
    from pydantic_ai.toolsets import FunctionToolset

    return list(FunctionToolset(list(definition.tools)).tools)


def _output_tool_names(output_type: Any) -> set[str]:
    from pydantic_ai.output import ToolOutput

    found: set[str] = set()
    stack = [output_type]
    while stack:
        item = stack.pop()
        if isinstance(item, ToolOutput) and item.name:
            found.add(item.name)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _is_output_tool(tool: str, named: set[str]) -> bool:
    return tool in named or tool == 'final_result' or tool.startswith('final_result_')
