"""A SQL conversation store (SQLite by default, PostgreSQL for production), and what a stored history says.

`SQLConversationStore` implements upstream's `pydantic_ai.conversation_store.ConversationStore`, so
`await store.load(id)` / `await store.save(result)` / `fork` / `branch` work as upstream documents, and
adds what a durable runner needs:

- `read(id)`: the whole history in one read transaction (a range query per conversation the history
  runs through), with a revision number, raising a distinct error for each kind of bad input.
- `append(id, messages, expected_revision=N, append_id=...)`: optimistic concurrency on an integer
  revision, idempotent by `append_id` so a retried activity / step / task never appends twice.

Storage (schema version 9, tables prefixed `durcap_`):
- `durcap_entries`: one row per message, the message as pydantic-ai's own JSON
  (`ModelMessagesTypeAdapter`), its parent entry and its 1-based position in its history. Rows are
  never updated, and deleted only by `purge` (`durcap history delete`).
- `durcap_conversations`: one row per conversation: the head entry, the integer `revision` (+1 on
  every write, never reused: a deleted conversation keeps a tombstone row), upstream's opaque
  revision token, usage, scope, fork and branch bookkeeping.
- `durcap_writes`: one row per write (append, save, delete), keyed by `(conversation_id, revision)`;
  `append_id` is unique per conversation. It is the audit log `durcap history show` prints.
- `durcap_payloads` (version 2): Temporal payloads stored by the claim-check codec (`engines.temporal._payloads`), keyed
  by the sha256 of their bytes; written once, never updated, deleted by `purge` and `collect` (`durcap store gc`).
  Since version 8 its `kind` says what a row is: a piece (0; or a whole payload, or a page of 0.3's layout), a leaf
  page (1), a page of pages (2), a piece stored zlib-compressed (3), and a pointer to the conversation entry that
  holds the piece's text (4: the id of the entry; a Prefect tool result's text once its turn is appended, see
  `engines.prefect._results`: the only rows ever updated).
- `durcap_payload_refs` (version 3): which durable run (a Temporal workflow id; a Prefect flow run's append id for its
  tool results' pieces) refers to which claim check, so
  `purge` deletes a conversation's own claim checks, `stats` counts them and `collect` deletes those of runs gone.
  A reference to a page (kind 1 or 2: a claim check's root since version 8) stands for every row under it.
- `durcap_turn_claims` (version 4): which run's turn holds a conversation (`claim_turn`), so two turns never run on
  one conversation at once; released when that turn's append lands, or by `release_turn`. Version 9 adds who asked
  the holder to stop (`request_stop`, `stop_requested`: a newer turn with `busy='interrupt'`).
- `durcap_turn_takeovers` (version 10): the holders whose claim a turn took over because they no longer ran
  (`release_turn(taken_by=...)`), so `purge` and `stats` still tie a run killed before its append to its conversation.
- `durcap_budget_ledger`, `durcap_budget_reservations` (version 6): what each budget key spent and each model
  request of it reserved and settled (`budget_reserve`, `budget_settle`; `durable_capabilities.budget`).
- `durcap_serve_owners`, `durcap_serve_runs`, `durcap_serve_requests` (version 7): `durcap serve`'s shared state (the
  principal owning each conversation, the runs requests started, each `Idempotency-Key` and its run), so several
  serve processes act as one (`durable_capabilities.serve`); deleted with the conversation by `purge`.
- `durcap_schema_version`: the migrations applied. A store whose version is newer than this code
  knows is refused (`SchemaVersionError`) and never touched.


Every statement binds its values as parameters. Bad input never deletes or rewrites a row: the error
names the conversation, the table and the row, and leaves the fix to the operator.

Layout: this module is the public API (the store, its results and errors); the SQL work is in
`_store_sql`, the tables and row decoding in `_store_schema`, and what a history says (`drift`,
`loaded_capability_ids`, `tools_called`) in `history`, re-exported here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Self

from pydantic_ai.conversation import Conversation
from pydantic_ai.conversation_store import (
    ConversationConflict,
    ConversationEntry,
    ConversationRecord,
    ConversationStore,
)
from pydantic_ai.messages import ModelMessage
from pydantic_ai.tools import DeferredToolRequests
from pydantic_ai.usage import RunUsage

from ..errors import NOT_FOUND_CODE, DurcapError
from ..history import drift, loaded_capability_ids, tools_called

__all__ = [
    'DEFAULT_URL',
    'SCHEMA_VERSION',
    'AppendIdReuseError',
    'AppendResult',
    'ClaimCheckOwner',
    'CollectReport',
    'ConversationBusyError',
    'ConversationConflictError',
    'ConversationHasForksError',
    'ConversationNotFoundError',
    'ConversationStats',
    'CorruptedRowError',
    'NewerHistoryError',
    'OwnerCollected',
    'PurgeReport',
    'SQLConversationStore',
    'SchemaVersionError',
    'StoreError',
    'StoreReadOnlyError',
    'StoreStats',
    'StoreURLError',
    'StoreUnavailableError',
    'StoredConversation',
    'StoredJSON',
    'WriteRecord',
    'drift',
    'loaded_capability_ids',
    'on_create',
    'resolve_url',
    'tools_called',
]

STORE_ENV = 'DURCAP_STORE'
"""Environment variable naming the conversation store URL a worker or process uses."""

DEFAULT_URL = 'sqlite:///.durcap/conversations.db'
"""Where the store lives when no URL is given: `.durcap/conversations.db` under the current directory."""


def resolve_url(explicit: str | None = None) -> str:
    """The conversation store URL: `explicit` (a flag, `DurableAgent(conversation_store=...)`), else `$DURCAP_STORE`,
    else `DEFAULT_URL`. The one place that reads `$DURCAP_STORE` (at the edge: where the store is opened); empty
    values count as not given. The URL is not validated here (`SQLConversationStore` raises `StoreURLError`)."""
    return explicit or os.environ.get(STORE_ENV) or DEFAULT_URL

SCHEMA_VERSION = 10
"""The newest schema this code writes and reads."""

logger = logging.getLogger('durable_capabilities.store')
_creation_notice: Callable[[str], None] | None = None


def on_create(notice: Callable[[str], None] | None) -> None:
    """Call `notice(absolute path)` whenever this process creates a SQLite store file (the `durcap` command prints it
    to stderr, so a run from an unexpected folder says where its data went); `None` restores the default, a log
    record on logger `durable_capabilities.store` at INFO."""
    global _creation_notice
    _creation_notice = notice


def _announce_created(path: str) -> None:
    if _creation_notice is not None:
        _creation_notice(path)
    else:
        logger.info('created the conversation store %s', path)


# ---- errors -----------------------------------------------------------------------------------


class StoreError(DurcapError, code='store'):
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


class StoreURLError(StoreError, ValueError, code='store-url'):
    """The store URL is malformed or names a database the store does not support."""


class StoreUnavailableError(StoreError, code='store-unavailable'):
    """The database cannot be reached, or (with `create=False`) holds no conversation store."""


class StoreReadOnlyError(StoreUnavailableError, code='store-read-only'):
    """The database can be read but not written (a read-only SQLite file, a PostgreSQL database or server in
    read-only mode). Raised by `check_writable` before a run, so no side effect happens for a turn that could
    not be stored."""


class SchemaVersionError(StoreError, code='store-schema-version'):
    """The database's schema version is newer than this code knows; nothing was read or changed.

    Attributes:
        found: The version recorded in `durcap_schema_version`.
        supported: `SCHEMA_VERSION` of this code.
    """

    def __init__(self, message: str, *, found: int, supported: int):
        super().__init__(message)
        self.found = found
        self.supported = supported


class ConversationNotFoundError(StoreError, LookupError, code='conversation-not-found'):
    """The conversation id is not in the store (never saved, or deleted); the message is led by `DC044` (an id that
    names nothing).

    Attributes:
        conversation_id: The id asked for.
    """

    def __init__(self, conversation_id: str, detail: str = ''):
        self.conversation_id = conversation_id
        super().__init__(f'{NOT_FOUND_CODE} conversation {conversation_id!r} is not in the store{detail}')

    def __str__(self) -> str:  # LookupError would quote the message like a KeyError otherwise
        return str(self.args[0])


class ConversationConflictError(StoreError, ConversationConflict, code='conversation-conflict'):
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


class ConversationBusyError(StoreError, code='DC050'):
    """Another run's turn holds the conversation (`SQLConversationStore.claim_turn`) and this turn's strategy is
    `'reject'`: refused before the turn did anything (no model request, no tool).

    Attributes:
        conversation_id: The busy conversation.
        run_id: The run that asked.
        holder: The run whose turn holds the conversation.
        claimed_at: When `holder` claimed it (ISO 8601 UTC).
    """

    def __init__(self, conversation_id: str, *, run_id: str, holder: str, claimed_at: str,
                 waiting: tuple[str | None, list[dict[str, Any]]] | None = None):
        self.conversation_id, self.run_id, self.holder, self.claimed_at = conversation_id, run_id, holder, claimed_at
        self.waiting = waiting
        Exception.__init__(self, (
            f'DC050 conversation {conversation_id!r} is busy: run {holder!r} holds it (its turn started at '
            f'{claimed_at} and is not stored yet){self.waits_for()}; run {run_id!r} was refused before doing anything. '
            f'{self.decide_hint()}Send the turn again once {holder!r} is done, or run it with `--busy enqueue` '
            f'(`busy=\'enqueue\'`) to wait for it; a claim left by a run that is gone is released with `durcap '
            f'history release {conversation_id}`.'))

    def waits_for(self) -> str:
        """`' and waits for a person's approval of TOOL (call ID)...'` when the holder waits for approvals, else `''`."""
        if not self.waiting:
            return ''
        calls = ', '.join(f"{c.get('tool_name', '?')} (call {c.get('call_id', '?')})" for c in self.waiting[1][:3])
        more = f' and {len(self.waiting[1]) - 3} more' if len(self.waiting[1]) > 3 else ''
        return f" and waits for a person's approval of {calls}{more}"

    def decide_hint(self) -> str:
        """How to decide the holder's pending calls (the CLI's commands), or `''` when it waits for none."""
        if not self.waiting:
            return ''
        engine = f' --engine {self.waiting[0]}' if self.waiting[0] else ''
        call = str(self.waiting[1][0].get('call_id', 'CALL_ID'))
        return (f'Decide it first: `durcap approvals list --run {self.holder}{engine}`, then `durcap approve '
                f'{self.holder} {call}{engine}` or `durcap deny {self.holder} {call}{engine} --reason TEXT` (HTTP: GET '
                f'/v1/runs/{self.holder}/approvals, POST /v1/runs/{self.holder}/approvals/{{call_id}}); the turn is '
                'stored once the run ends. ')


class AppendIdReuseError(StoreError, code='append-id-reuse'):
    """An `append_id` already stored for this conversation came back with a different number of messages.

    A retried durable unit sends the same messages (at most rebuilt with new timestamps), so this
    means two different appends share an id. Nothing was written.
    """


class CorruptedRowError(StoreError, code='store-corrupted-row'):
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


class NewerHistoryError(StoreError, code='newer-history'):
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


class ConversationHasForksError(StoreError, code='conversation-has-forks'):
    """`purge` refused: other conversations' histories run through this conversation's messages (they were forked
    from it). Nothing was deleted. Attributes: `conversation_id`, `forks` (the other conversations' ids)."""

    def __init__(self, message: str, *, conversation_id: str, forks: list[str]):
        super().__init__(message)
        self.conversation_id = conversation_id
        self.forks = forks


# ---- results ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class PurgeReport:
    """What `purge` deleted (or, with `dry_run`, would delete).

    Attributes:
        conversation_id: The conversation.
        dry_run: True when nothing was changed.
        rows: `{table: rows}` of the conversation's own rows in each table (`durcap_payloads`: the claim checks
            only its runs referred to).
        appends: The `append_id` of every write to it, oldest first: each names the run that wrote it, so what the
            engines may still hold (`forgetting.engine_records` reads them with the engines' specs).
        owners: The claim-check owners of its runs (`durcap_payload_refs.owner`): of its appends, of the run holding
            its turn claim and of the runs whose claim was taken over (killed before their append).
        message_bytes: Bytes of its messages' JSON.
        payload_bytes: Bytes of the claim checks deleted with it.
        shared_payloads: Claim checks its runs referred to that another conversation's runs refer to too (kept).
        shared_payload_bytes: Their bytes.
    """

    conversation_id: str
    dry_run: bool
    rows: dict[str, int]
    appends: list[str]
    message_bytes: int
    payload_bytes: int
    shared_payloads: int
    shared_payload_bytes: int
    owners: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ConversationStats:
    """One conversation's bytes in the store (`stats`).

    Attributes:
        conversation_id: Its id.
        deleted: Hidden by upstream's `delete` (its rows are still here).
        message_count: Its own rows in `durcap_entries` (a fork's shared prefix is counted where it was written).
        message_bytes: Bytes of those messages' JSON.
        payload_bytes: Bytes of the claim checks only its runs refer to (`payloads` of them).
        shared_payload_bytes: Bytes of the claim checks its runs share with another conversation's (each counted
            in full for every conversation sharing it; `shared_payloads` of them).
    """

    conversation_id: str
    deleted: bool
    message_count: int
    message_bytes: int
    payload_bytes: int
    shared_payload_bytes: int
    payloads: int
    shared_payloads: int


@dataclass(frozen=True)
class StoreStats:
    """What the store holds (`stats`).

    Attributes:
        location: A SQLite file's absolute path, or the URL with its password hidden.
        conversations: One `ConversationStats` per conversation, by id.
        message_bytes: Bytes of every stored message's JSON.
        payload_bytes: Bytes of every claim check (`payloads` of them), each counted once.
        unattributed_payload_bytes: Bytes of claim checks no conversation's run is known to refer to: written
            before schema version 3, or by a run that stored no turn (failed, or still in flight).
        database_bytes: The database's size on disk (SQLite file and its WAL, PostgreSQL `pg_database_size`),
            `None` for an in-memory store.
    """

    location: str
    conversations: list[ConversationStats]
    message_bytes: int
    payload_bytes: int
    payloads: int
    unattributed_payload_bytes: int
    database_bytes: int | None


@dataclass(frozen=True)
class ClaimCheckOwner:
    """One durable run that claim checks are recorded for (`claim_check_owners`, read by `durcap store gc`).

    Attributes:
        owner: The run's id as the codec recorded it (`durcap_payload_refs.owner`: a Temporal workflow id).
        conversations: The conversations it appended to (from `durcap_writes.append_id`), sorted; empty when it
            stored no turn (failed, or still in flight).
        refs: Its `durcap_payload_refs` rows (pieces and pages it refers to).
        newest: When its newest reference was first written (UTC).
    """

    owner: str
    conversations: list[str]
    refs: int
    newest: datetime


@dataclass(frozen=True)
class OwnerCollected:
    """What `collect` deleted (or would delete) of one owner.

    Attributes:
        owner: The run's id (`ClaimCheckOwner.owner`).
        conversations: Its conversations (`ClaimCheckOwner.conversations`).
        refs: Its `durcap_payload_refs` rows deleted.
        payloads: `durcap_payloads` rows freed that it referred to (a piece several collected owners referred to is
            counted for each of them).
        payload_bytes: Their bytes.
    """

    owner: str
    conversations: list[str]
    refs: int
    payloads: int
    payload_bytes: int


@dataclass(frozen=True)
class CollectReport:
    """What `collect` deleted (or, with `dry_run`, would delete).

    Attributes:
        dry_run: True when nothing was changed.
        before: The cutoff (UTC): nothing written at or after it was deleted.
        owners: One `OwnerCollected` per owner whose references were deleted, by owner id.
        skipped: Owners asked for that were kept because a reference of theirs was written at or after `before`.
        refs: `durcap_payload_refs` rows deleted.
        payloads: `durcap_payloads` rows deleted (each counted once).
        payload_bytes: Their bytes.
        shared_payloads: Pieces the collected owners referred to that are kept because another owner still refers
            to them (or they were written at or after `before`).
        shared_payload_bytes: Their bytes.
    """

    dry_run: bool
    before: datetime
    owners: list[OwnerCollected]
    skipped: list[str]
    refs: int
    payloads: int
    payload_bytes: int
    shared_payloads: int
    shared_payload_bytes: int


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
        rebased: True when the conversation had moved past `expected_revision` and `rebase=True` appended the
            messages after the other writes instead of refusing them.
    """

    conversation_id: str
    revision: int
    entry_ids: list[str]
    first_position: int
    message_count: int
    replayed: bool = False
    replayed_differently: bool = False
    rebased: bool = False


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


@dataclass
class StoredJSON:
    """A conversation as `read_json` returns it: each message's stored JSON, not decoded.

    Attributes:
        conversation_id: Its id.
        messages: One JSON text per message (an element of `ModelMessagesTypeAdapter.dump_json`), oldest
            first: the whole history, or with `tail` only the messages after the known prefix.
        entry_ids: The entry id of each message, aligned with `messages`.
        revision: The integer revision to pass to `append(expected_revision=...)`.
        message_count: Messages in the whole history.
        tail: Whether `messages` are only the ones after the prefix `read_json(known=...)` named.
        kinds: The entry kind of each row (`'message'`; another kind is a newer pydantic-ai's).
    """

    conversation_id: str
    messages: list[str]
    entry_ids: list[str]
    revision: int
    message_count: int
    tail: bool = False
    kinds: list[str] = field(default_factory=list)


# ---- the store --------------------------------------------------------------------------------

# The row codec, imported here: `_schema` imports the errors and results above from this module.
# `_MIGRATIONS` (the schema's `{version: DDL}`, newest `SCHEMA_VERSION`) is re-exported. The SQL work
# (`_sql`, which brings SQLAlchemy: ~0.4 s and ~300 modules) is imported by the first store constructed,
# so importing the package for its errors or `drift` costs none of it (issue 14, item 5).
from ._schema import _MIGRATIONS, _encode  # noqa: F401

if TYPE_CHECKING:
    from ._budgets import BudgetRecord


_BUDGET_POOL: list[Any] = []


async def _budget_thread(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in the budget ledger's own worker threads (at most 8), not the loop's default executor: DBOS's
    one-shot run shuts that one down when it ends (`DBOS.destroy()`), and a budget's model request or report read can
    come after it in the same loop. One pool per process (a forked child makes its own)."""
    from concurrent.futures import ThreadPoolExecutor

    if not _BUDGET_POOL or _BUDGET_POOL[0][0] != os.getpid():  # a forked process gets threads of its own
        _BUDGET_POOL[:] = [(os.getpid(), ThreadPoolExecutor(max_workers=8, thread_name_prefix='durcap-budget'))]
    return await asyncio.get_running_loop().run_in_executor(_BUDGET_POOL[0][1], lambda: function(*args))


_LEDGER: list[Any] = []
"""`[store._budgets, store._sql._WouldWait]`, imported by the first per-request write (an import statement in a function
runs importlib's Python code each call: ~2 us, twice a model request)."""


async def _budget_write(sql: Any, name: str, *args: Any) -> Any:
    """`_budgets.{name}(sql, *args)`, one of the budget ledger's per-request writes (`reserve`, `settle`, `release`): on
    SQLite, at once on this thread (the loop's) in a transaction that never waits (`quick=True`,
    `_SQLBackend._quick_run`: tens of microseconds, no thread hand-off); when it would wait (another writer holds the
    lock, PostgreSQL, a store not migrated yet), in the ledger's worker threads as before."""
    if not _LEDGER:
        from . import _budgets
        from ._sql import _WouldWait

        _LEDGER[:] = [_budgets, _WouldWait]
    budgets, would_wait = _LEDGER
    function = getattr(budgets, name)
    try:
        return function(sql, *args, quick=True)
    except would_wait:
        return await _budget_thread(function, sql, *args)


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
        from ._sql import _parse_url, _SQLBackend

        self.url = url
        self._sql = _SQLBackend(_parse_url(url), create=create)

    def __repr__(self) -> str:
        return f'SQLConversationStore({self._sql.display_url!r})'

    def close(self) -> None:
        """Close the pooled connections. The store reconnects if used again."""
        self._sql.dispose()

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

    async def read_json(
        self, conversation_id: str, *, known: tuple[int, str] | None = None, check_writable: bool = False
    ) -> StoredJSON:
        """Read a conversation's messages as their stored JSON, without decoding them (what a load unit hands
        to the run, which decodes once), in one transaction with the header checks of `read`.

        Args:
            conversation_id: The conversation.
            known: `(message count, entry id of the last of them)` from an earlier `read_json`: when the
                stored history still extends that prefix, only the messages after it are read (`tail=True`).
            check_writable: Run `check_writable`'s probe first, in the same worker thread (one hop instead of two:
                what a load unit does before a run whose turn will be appended). Its errors are raised as there.

        Returns:
            A `StoredJSON`. Rows are not validated here: `decode_json` (or `ModelMessagesTypeAdapter`) does that.

        Raises:
            ConversationNotFoundError: not in the store (or deleted).
            CorruptedRowError: the header disagrees with the rows, or the chain of entries is broken.
            SchemaVersionError, StoreUnavailableError: see the class docstrings.
        """
        return await asyncio.to_thread(self._sql.read_json, conversation_id, known, check_writable)

    async def read_json_at(self, conversation_id: str, head_id: str, count: int) -> list[str]:
        """The stored JSON of each message of the history ending at entry `head_id` (`count` messages, oldest first):
        a history as it was at an earlier revision, whatever was appended since (entries never change once
        written). What DBOS and Prefect turns read back after their load unit recorded only the head
        (`conversations.LoadedHead`). A history running through a conversation it was forked from is followed.

        Raises:
            ConversationNotFoundError: entry `head_id` is not in the store (the conversation was deleted).
            CorruptedRowError: the entries from `head_id` back are not `count` messages, or their chain is broken.
        """
        return await asyncio.to_thread(self._sql.read_json_at, conversation_id, head_id, count)

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
        rebase: bool = False,
        release_claim: str | None = None,
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
            rebase: When the conversation moved past `expected_revision` (another writer appended), append after
                its current last message instead of refusing (`AppendResult.rebased`): what a turn whose side effects
                happened does, so it is never lost.
            release_claim: A run id: release that run's turn claim (`claim_turn`) in the same transaction.

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
            self._sql.append, conversation_id, encoded, expected_revision, append_id, usage, deferred_tool_requests, scope,
            rebase, release_claim,
        )

    async def claim_turn(self, conversation_id: str, run_id: str) -> tuple[str, str] | None:
        """Claim `conversation_id` for the turn of run `run_id`: one turn at a time per conversation.

        Returns:
            `None` when `run_id` holds the claim now (it was free, or `run_id` held it already: a retried unit);
            else the holder's `(run_id, claimed_at ISO 8601 UTC)`, and nothing changed.

        Raises:
            SchemaVersionError, StoreUnavailableError: see the class docstrings.
        """
        return await asyncio.to_thread(self._sql.claim_turn, conversation_id, run_id)

    async def release_turn(self, conversation_id: str, run_id: str | None = None, *, taken_by: str | None = None) -> bool:
        """Release the turn claim on `conversation_id` held by `run_id` (`None`: whoever holds it, e.g. a run that
        is gone). Returns whether a claim was released; releasing twice is harmless.

        With `taken_by` (the run taking the conversation over from `run_id`, which no longer runs), the released
        holder is recorded as a run of the conversation in the same transaction (`durcap_turn_takeovers`): `purge`
        then names it and deletes its claim checks, as it does for a holder's."""
        return await asyncio.to_thread(self._sql.release_turn, conversation_id, run_id, taken_by)

    async def waiting_approval(self, run_id: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        """`(engine or None, pending calls as `PendingCall.to_json()`)` when run `run_id`'s stream (in this store) says it
        waits for a person's approval now (its last approval event is `approval_waiting`); else `None` (also for a run
        that published no events)."""
        return await asyncio.to_thread(self._sql.waiting_approval, run_id)

    async def turn_claim(self, conversation_id: str) -> tuple[str, str] | None:
        """The `(run_id, claimed_at)` holding `conversation_id`'s turn claim, or `None`."""
        return await asyncio.to_thread(self._sql.turn_claim, conversation_id)

    async def request_stop(self, conversation_id: str, holder: str, by: str) -> str | None:
        """Ask run `holder`, whose turn holds `conversation_id`, to stop at its next safe point, on behalf of run `by`
        (a newer turn with `busy='interrupt'`). Idempotent: the first request is kept.

        Returns:
            The run the stop was asked by (`by`, or an earlier asker), or `None` when `holder` no longer holds the
            conversation (its turn was stored, or its claim released): nothing changed.
        """
        return await asyncio.to_thread(self._sql.request_stop, conversation_id, holder, by)

    async def stop_requested(self, run_id: str) -> str | None:
        """The run that asked run `run_id` to stop (`request_stop`) while `run_id` holds a turn claim, else `None`.
        Read before every model request of a turn: on SQLite on this thread, one statement that never waits (a
        worker thread when it would, and on PostgreSQL)."""
        from ._sql import _WouldWait

        try:
            return self._sql.stop_requested(run_id, quick=True)
        except _WouldWait:
            return await asyncio.to_thread(self._sql.stop_requested, run_id)

    async def turn_stop(self, conversation_id: str) -> tuple[str, str | None] | None:
        """`(holder run id, run that asked it to stop or None)` of `conversation_id`'s turn claim, or `None`."""
        return await asyncio.to_thread(self._sql.turn_stop, conversation_id)

    # ---- budgets (schema version 6, `durable_capabilities.budget`) ------------------------------

    async def budget_reserve(self, key: str, request_id: str, run_id: str, limits: dict[str, float]) -> BudgetRecord | None:
        """Admit and reserve model request `request_id` (unique within `key`, the same on a retried unit) of budget
        `key` for run `run_id`, checked against `limits` (`{'total_tokens' | 'input_tokens' | 'output_tokens' |
        'cost': value}`, cost in USD) plus what operators raised them by.

        Returns:
            `None` when admitted (or already reserved: a retry); else the key's `BudgetRecord`, which reached a limit.

        Raises:
            StoreUnavailableError, SchemaVersionError: see the class docstrings.
        """
        return await _budget_write(self._sql, 'reserve', key, request_id, run_id, limits)

    async def budget_settle(self, key: str, request_id: str, run_id: str, *, input_tokens: int, output_tokens: int,
                            cost: float = 0.0) -> None:
        """Record the provider-reported usage of completed request `request_id` of `key` (tokens, cost in USD): settling
        it again replaces its usage, so a retried unit counts once."""
        await _budget_write(self._sql, 'settle', key, request_id, run_id, input_tokens, output_tokens, cost)

    async def budget_release(self, key: str, request_id: str) -> None:
        """Drop the reservation of request `request_id` of `key` that failed before the provider answered."""
        await _budget_write(self._sql, 'release', key, request_id)

    async def budgets(self, key: str | None = None) -> list[BudgetRecord]:
        """Every budget key's `BudgetRecord` (only `key`'s when given), sorted by key."""
        from . import _budgets

        return await _budget_thread(_budgets.records, self._sql, key)

    async def budget_reset(self, key: str) -> bool:
        """Forget what budget `key` spent, reserved and was raised by. Returns whether the key existed."""
        from . import _budgets

        return await _budget_thread(_budgets.reset, self._sql, key)

    async def budget_raise(self, key: str, name: str, amount: float) -> BudgetRecord:
        """Raise limit `name` (`'total_tokens'`, ..., `'cost'`) of budget `key` by `amount`; the record after."""
        from . import _budgets

        return await _budget_thread(_budgets.raise_limit, self._sql, key, name, amount)

    async def budget_inherit(self, source_key: str, new_key: str, *, until: str | None,
                             raised: dict[str, float]) -> BudgetRecord | None:
        """Start budget `new_key` with what `source_key` had spent at `until` (ISO 8601 UTC; `None`: what the source
        itself inherited when forked) plus `raised` operator raises (`_budgets.inherit`); `None` when nothing was."""
        from . import _budgets

        return await _budget_thread(_budgets.inherit, self._sql, source_key, new_key, until, raised)

    async def fork(
        self,
        conversation_id: str,
        *,
        at: int | None = None,
        from_entry: str | None = None,
        new_conversation_id: str | None = None,
        scope: str | None = None,
        source_scope: str | None = None,
    ) -> Conversation:
        """Upstream's `fork` (a new conversation sharing the kept messages; arguments, result and errors as upstream
        documents them), then the fork's conversation-scoped budget starts with what the kept messages cost.

        Those requests were billed, so forking does not get around a spent conversation budget: the key
        `conversation:{new id}` inherits the settled spend of `conversation:{source}` up to the write that stored the
        last kept message (requests reserved up to then: the kept turns', and those of runs that failed between them),
        and the raises operators approved in the kept messages (`budget.granted_raises`). A source that was itself
        forked, cut inside its kept prefix, is followed back to the conversation that wrote those messages. Budgets
        scoped to a run or a tenant key are unchanged: they are not the conversation's.
        """
        forked = await super().fork(conversation_id, at=at, from_entry=from_entry,
                                    new_conversation_id=new_conversation_id, scope=scope, source_scope=source_scope)
        if forked.messages and forked.conversation_id is not None:
            from ..budget import conversation_key, granted_raises

            source, until = await self._spend_cut(conversation_id, len(forked.messages))
            await self.budget_inherit(conversation_key(source), conversation_key(forked.conversation_id), until=until,
                                      raised=granted_raises(forked.messages))
        return forked

    async def _spend_cut(self, conversation_id: str, position: int) -> tuple[str, str | None]:
        """`(conversation, time)` whose spend up to `time` is what message `position` (1-based) of `conversation_id`'s
        history had cost: the write of it that stored that message; inside a fork's kept prefix, the conversation it
        was forked from (`time` `None`: the fork's inherited row only, where that one is gone or the cut is the
        prefix's end)."""
        record = await self.read_record(conversation_id)
        if record is not None and record.forked_from is not None:
            prefix = len(await self.read_history(record.forked_at)) if record.forked_at else 0
            if position <= prefix:
                if position < prefix and await self.read_record(record.forked_from) is not None:
                    return await self._spend_cut(record.forked_from, position)
                return conversation_id, None
        for write in await self.writes(conversation_id):
            if write.entry_ids and write.first_position is not None and \
                    write.first_position + len(write.entry_ids) - 1 >= position:
                return conversation_id, write.written_at.isoformat(timespec='microseconds')
        return conversation_id, datetime.now(UTC).isoformat(timespec='microseconds')

    async def check_writable(self) -> None:
        """Open a write transaction and write nothing: a cheap probe before a run whose turn will be appended.

        Raises:
            StoreReadOnlyError: the database is read-only (a read-only SQLite file, a PostgreSQL database or
                server in read-only mode).
            StoreUnavailableError: the database cannot be reached, with the database's reason.
            SchemaVersionError: see the class docstring.
        """
        await asyncio.to_thread(self._sql.probe_writable)

    async def purge(self, conversation_id: str, *, dry_run: bool = False) -> PurgeReport:
        """Delete a conversation for good (a user's right to be forgotten), in one transaction: its
        `durcap_conversations`, `durcap_entries` and `durcap_writes` rows, the claim-check references of its
        runs (`durcap_payload_refs`), and the claim-check rows (`durcap_payloads`: pieces, and the pages under a
        reference to a tree's root, schema 8) no other run needs. On PostgreSQL it holds `durcap_payload_refs` as
        `collect` does. This reads every reference and page of the store (a tree's pieces may be shared with any other
        run's tree). Unlike
        upstream's `delete` (a tombstone that keeps the entries), nothing of it is left; the id can be used again
        from revision 1. What the engines keep of its runs is not touched: see `PurgeReport.appends`.

        The store records no lease on a conversation, so it cannot tell whether a run of it is in flight: a run
        that appends after the purge creates the conversation again. Claim checks written before schema version
        3 have no recorded owner and are kept.

        Args:
            conversation_id: The conversation (live, or hidden by upstream's `delete`).
            dry_run: Count what would be deleted and change nothing.

        Returns:
            A `PurgeReport`.

        Raises:
            ConversationNotFoundError: no row of it in the store.
            ConversationHasForksError: another conversation's history runs through its messages; nothing deleted.
            SchemaVersionError, StoreUnavailableError: see the class docstrings.
        """
        return await asyncio.to_thread(self._sql.purge, conversation_id, dry_run)

    async def stats(self) -> StoreStats:
        """Bytes per conversation (messages, own and shared claim checks) and in total, and the store's location.

        Raises:
            SchemaVersionError, StoreUnavailableError: see the class docstrings.
        """
        return await asyncio.to_thread(self._sql.stats)

    async def conversation_stats(self, conversation_id: str) -> ConversationStats:
        """One conversation's bytes (messages, own and shared claim checks), without reading the whole store.

        Raises:
            ConversationNotFoundError: no row of it; SchemaVersionError, StoreUnavailableError: see the class docstrings.
        """
        return await asyncio.to_thread(self._sql.conversation_stats, conversation_id)

    async def claim_check_owners(self) -> list[ClaimCheckOwner]:
        """Every run claim checks are recorded for (`durcap_payload_refs`), by owner id, with its conversations.

        Raises:
            SchemaVersionError, StoreUnavailableError: see the class docstrings.
        """
        return await asyncio.to_thread(self._sql.claim_check_owners)

    async def collect(self, owners: Sequence[str], *, before: datetime, dry_run: bool = False) -> CollectReport:
        """Delete the claim-check references of `owners` (runs the caller found gone: closed past their engine's
        retention, or unknown to it) and the pieces and pages no other run needs (through the pages under every
        remaining reference to a tree's root, schema 8), in one transaction (`durcap store gc`).

        Race-safe: an owner with a reference written at or after `before` is kept whole (`CollectReport.skipped`), a
        piece written at or after `before` is kept, and a piece is deleted only when no reference to it is left when
        the transaction deletes it. On PostgreSQL the transaction holds `durcap_payload_refs` in SHARE ROW EXCLUSIVE
        mode, so a writer that records a reference (the codec records its references before it looks for the pieces
        already stored) either committed before and is seen, or waits and then writes the piece again. Pieces with no
        recorded owner (written before schema version 3) are never deleted.

        Args:
            owners: Owner ids (`ClaimCheckOwner.owner`); unknown ones are ignored.
            before: The cutoff (timezone-aware; naive means UTC): `now - grace`.
            dry_run: Count what would be deleted and change nothing.

        Returns:
            A `CollectReport`.

        Raises:
            SchemaVersionError, StoreUnavailableError: see the class docstrings.
        """
        return await asyncio.to_thread(self._sql.collect, list(dict.fromkeys(owners)), before, dry_run)

    @property
    def location(self) -> str:
        """Where the store is, for people: a SQLite file's absolute path, else the URL with its password hidden."""
        return self._sql.location

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
