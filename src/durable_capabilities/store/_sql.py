"""The conversation store's SQL work, synchronous: connecting to SQLite or PostgreSQL, migrating, reading, writing.

`store.SQLConversationStore` validates its arguments and runs `_SQLBackend` in a worker thread; the tables
and the decoding of their rows are in `_store_schema`. `store.SCHEMA_VERSION` is read from `store` where it
is used, not imported: it is the public name (and tests patch it there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import re
import threading
import uuid
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import pydantic
import sqlalchemy as sa
from pydantic_ai.conversation_store import ConversationEntry, ConversationRecord
from pydantic_ai.tools import DeferredToolRequests
from pydantic_ai.usage import RunUsage
from sqlalchemy import event as sa_event
from sqlalchemy import exc as sa_exc

from .. import store
from .._limits import postgres_connect_fix, private_file, redact_database_url
from . import (
    AppendIdReuseError,
    AppendResult,
    ClaimCheckOwner,
    CollectReport,
    ConversationConflictError,
    ConversationHasForksError,
    ConversationNotFoundError,
    ConversationStats,
    CorruptedRowError,
    OwnerCollected,
    PurgeReport,
    SchemaVersionError,
    StoredConversation,
    StoredJSON,
    StoreReadOnlyError,
    StoreStats,
    StoreUnavailableError,
    StoreURLError,
    WriteRecord,
)
from ._schema import (
    _BRANCHES,
    _CONVERSATION_COLUMNS,
    _DEFERRED,
    _ENTRY_SELECT,
    _MIGRATIONS,
    _USAGE,
    _VERSION_TABLE,
    _WRITER,
    _decode_messages,
    _decode_row,
    _digest,
    _EntryRow,
    _first_line,
    _Row,
)

_NO_LIMIT = 2**62
PG_CONNECT_TIMEOUT = 10
"""Seconds a PostgreSQL connection attempt may take (libpq `connect_timeout`), unless the URL sets its own."""
_PG_MIGRATION_LOCK = 0x6475726361700001  # 'durcap' + 1: serializes migrations across processes


# ---- URLs and engines -------------------------------------------------------------------------


_IN_BATCH = 500
"""Digests per `IN (...)` of the claim-check reads (under every backend's limit on bound parameters)."""


def _parse_url(url: str) -> sa.URL:
    """The SQLAlchemy URL for `url`, with PostgreSQL pinned to psycopg 3.

    Raises:
        StoreURLError: unparsable, or a scheme other than `sqlite` / `postgresql` (`postgres`).
    """
    if not isinstance(url, str) or not url.strip():
        raise StoreURLError(f'store URL must be a non-empty string, got {url!r}')
    try:
        parsed = sa.make_url(url.replace('postgres://', 'postgresql://', 1) if url.startswith('postgres://') else url)
    except sa_exc.ArgumentError:
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


# ---- the synchronous implementation -----------------------------------------------------------


_FORKED_CONNECTIONS: list[Any] = []
"""`_quick_txn` connections a forked child found in its thread-local data: kept referenced, so that garbage collection
never closes the parent's SQLite connection in the child."""


class _WouldWait(Exception):
    """`_SQLBackend._quick_txn` would have waited (or cannot run on this store): nothing was done."""


class _SQLBackend:
    """The SQL work, synchronous; `SQLConversationStore` runs it in a worker thread."""

    def __init__(self, url: sa.URL, *, create: bool) -> None:
        self.url = url
        self.create = create
        self.display_url = redact_database_url(url.render_as_string(hide_password=False))
        self.is_pg = url.get_backend_name() == 'postgresql'
        self._ready = False
        self._ready_file: tuple[int, int, int] | None = None
        self._lock = threading.Lock()
        self._fast_engine: sa.Engine | None = None
        self._write_lock = threading.RLock()
        self._quick = threading.local()  # `_quick_txn`'s connection of each thread, with `_quick_generation`
        self._quick_generation = 0
        if self.is_pg:
            try:
                # A bounded connect (unless the URL sets its own): an unreachable host fails in seconds, not at the
                # operating system's TCP timeout (minutes).
                timeout = {} if 'connect_timeout' in url.query else {'connect_timeout': PG_CONNECT_TIMEOUT}
                self.engine = sa.create_engine(url, pool_pre_ping=True, connect_args=timeout)
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
            sa_event.listen(self.engine, 'connect', _sqlite_connect)
            sa_event.listen(self.engine, 'begin', _sqlite_begin)

    # ---- connections and schema ---------------------------------------------------------------

    @contextmanager
    def _txn(self, *, write: bool, relaxed: bool = False) -> Iterator[sa.Connection]:
        """A transaction (`BEGIN IMMEDIATE` on SQLite when `write`). `relaxed`: its commit is durable against a crash of
        any process, not against an OS crash or power loss (SQLite `synchronous=NORMAL` in WAL mode, PostgreSQL
        `synchronous_commit = off`): no disk flush per commit, for the budget ledger's per-request writes."""
        self._ensure_ready()
        try:
            conn = self.engine.connect()
        except sa_exc.OperationalError as exc:
            raise self._unreachable('cannot connect to', exc) from None
        with conn, self._relaxed(conn, relaxed), self._writing(write):
            if write:
                conn.execution_options(durcap_write=True)
            with conn.begin():
                if relaxed and self.is_pg:
                    conn.exec_driver_sql('SET LOCAL synchronous_commit TO OFF')
                try:
                    yield conn
                except (sa_exc.OperationalError, sa_exc.ProgrammingError) as exc:
                    if 'no such table' not in str(exc) and 'UndefinedTable' not in type(exc.orig).__name__:
                        raise
                    raise StoreUnavailableError(
                        f'the conversation store {self.display_url} is damaged: {_first_line(exc)}. Nothing was '
                        'changed; restore the database from a backup.'
                    ) from None

    def _unreachable(self, verb: str, exc: BaseException) -> StoreUnavailableError:
        """`StoreUnavailableError`: `verb` the store, the driver's reason and, on PostgreSQL, the fix (the missing
        database named with `createdb`, or start the server or fix the URL: `postgres_connect_fix`)."""
        reason = _first_line(exc)
        fix = f'; {postgres_connect_fix(self.url, reason)}' if self.is_pg and isinstance(exc, sa_exc.OperationalError) else ''
        return StoreUnavailableError(f'{verb} the conversation store {self.display_url}: {reason}{fix}')

    @contextmanager
    def _writing(self, write: bool) -> Iterator[None]:
        """On SQLite, a write transaction holds this store's in-process write lock: the threads of one process that
        write to one file queue on it and each starts the moment the last one commits, instead of meeting SQLite's
        own lock, whose busy handler sleeps 1, 2, 5, 10 ... 100 ms between tries (what other processes still do).
        Reentrant: a thread's nested write transaction meets SQLite's lock as before."""
        if not write or self.is_pg:
            yield
            return
        with self._write_lock:
            yield

    def _relaxed_engine(self) -> sa.Engine:
        """The engine of `_raw_txn`: the store's URL and connect arguments, its connections set once at connect to
        commit without a disk flush (SQLite `synchronous=NORMAL`, PostgreSQL `synchronous_commit=off`), so a relaxed
        transaction spends no statement switching it (the main pool's connections stay fully synchronous)."""
        engine = self._fast_engine
        if engine is not None:
            return engine
        with self._lock:
            if self._fast_engine is None:
                if self.is_pg:
                    timeout = {} if 'connect_timeout' in self.url.query else {'connect_timeout': PG_CONNECT_TIMEOUT}
                    self._fast_engine = sa.create_engine(self.url, pool_pre_ping=True,
                                                         connect_args={**timeout, 'options': '-c synchronous_commit=off'})
                else:
                    memory = self.url.database in (None, '', ':memory:')
                    # One database in memory is one connection: the main pool's (its pragma switched per transaction).
                    self._fast_engine = self.engine if memory else sa.create_engine(
                        self.url, connect_args={'timeout': 60, 'check_same_thread': False})
                    if not memory:
                        sa_event.listen(self._fast_engine, 'connect', _sqlite_connect_relaxed)
            return self._fast_engine

    @contextmanager
    def _raw_txn(self, *, write: bool = True, relaxed: bool = True) -> Iterator[_RawCursor]:
        """A relaxed write transaction (see `_txn`'s `relaxed`) straight on a pooled DBAPI connection: `BEGIN
        IMMEDIATE` on SQLite, the driver's transaction on PostgreSQL; committed when the block ends, rolled back when
        it raises. For the hot per-request writes (the budget ledger): none of SQLAlchemy's statement machinery, which
        cost most of such a transaction's CPU time. Statements take `:name` parameters on both backends.
        `write=False`: for one reading statement (on SQLite no transaction is begun: the statement is its own).
        `relaxed=False`: a commit flushed to disk as `_txn`'s are (the main pool's connections).

        Raises:
            StoreUnavailableError: the store cannot be reached, or its tables are missing.
        """
        self._ensure_ready()
        engine = self._relaxed_engine() if relaxed else self.engine
        try:
            raw = engine.raw_connection()
        except sa_exc.OperationalError as exc:
            raise self._unreachable('cannot connect to', exc) from None
        try:
            cursor = raw.cursor()
            memory = relaxed and engine is self.engine and not self.is_pg
            try:
                with self._writing(write):
                    if memory:
                        cursor.execute('PRAGMA synchronous=NORMAL')
                    begun = write and not self.is_pg
                    if begun:
                        cursor.execute('BEGIN IMMEDIATE')
                    try:
                        yield _RawCursor(cursor, self.is_pg)
                    except BaseException:
                        if self.is_pg:
                            raw.rollback()
                        elif begun:
                            cursor.execute('ROLLBACK')
                        raise
                    if self.is_pg:
                        raw.commit()
                    elif begun:
                        cursor.execute('COMMIT')
            except engine.dialect.dbapi.Error as exc:  # type: ignore[union-attr]
                if 'no such table' in str(exc) or 'UndefinedTable' in type(exc).__name__:
                    raise StoreUnavailableError(
                        f'the conversation store {self.display_url} is damaged: {_first_line(exc)}. Nothing was '
                        'changed; restore the database from a backup.'
                    ) from None
                raise
            finally:
                if memory:
                    cursor.execute('PRAGMA synchronous=FULL')
                cursor.close()
        finally:
            raw.close()

    @contextmanager
    def _relaxed(self, conn: sa.Connection, relaxed: bool) -> Iterator[None]:
        """On SQLite with `relaxed`: the connection at `synchronous=NORMAL` outside its transaction (SQLite refuses the
        change inside one), set back to FULL before it returns to the pool."""
        if not relaxed or self.is_pg:
            yield
            return
        raw = conn.connection.driver_connection
        raw.execute('PRAGMA synchronous=NORMAL')  # type: ignore[union-attr]
        try:
            yield
        finally:
            raw.execute('PRAGMA synchronous=FULL')  # type: ignore[union-attr]

    @contextmanager
    def _quick_txn(self, *, write: bool = True) -> Iterator[_RawCursor]:
        """A relaxed transaction (as `_raw_txn`'s) on a SQLite file, run on the calling thread (an event loop's) without
        ever waiting: on a connection of this thread's own, kept open (no pool checkout), whose busy timeout is 0. For
        the budget ledger's per-request statements and a stream subscriber's reads, a few tens of microseconds: cheaper
        in the loop than the two thread hand-offs of running them in a worker thread. `write=False`: reading
        statements, each its own transaction (as `_raw_txn(write=False)`).

        Raises:
            _WouldWait: before anything is done, when it would wait: PostgreSQL or an in-memory database (the caller
                runs the work in a worker thread instead), a store not migrated yet, another thread of this process
                writing to the file, or another process holding SQLite's write lock.
            StoreUnavailableError: the tables are missing.
        """
        if self.is_pg or not self._ready or self.url.database in (None, '', ':memory:'):
            raise _WouldWait
        if write and not self._write_lock.acquire(blocking=False):
            raise _WouldWait
        try:
            self._ensure_ready()  # one stat: a replaced file closes every connection (`dispose`) and migrates again
            raw = self._quick_connection()
            try:
                if write:
                    try:
                        raw.execute('BEGIN IMMEDIATE')
                    except self.engine.dialect.dbapi.OperationalError as exc:  # type: ignore[union-attr]
                        if 'locked' in str(exc) or 'busy' in str(exc):
                            raise _WouldWait from None
                        raise
                cursor = raw.cursor()
                try:
                    yield _RawCursor(cursor, False)
                except BaseException:
                    if write:
                        raw.execute('ROLLBACK')
                    raise
                finally:
                    cursor.close()  # its statement finished: the connection holds no read snapshot between calls
                if write:
                    try:
                        raw.execute('COMMIT')
                    except BaseException:  # the connection is this thread's again next time: never left in a transaction
                        with suppress(Exception):
                            raw.execute('ROLLBACK')
                        raise
            except self.engine.dialect.dbapi.Error as exc:  # type: ignore[union-attr]
                if 'no such table' in str(exc):
                    raise StoreUnavailableError(
                        f'the conversation store {self.display_url} is damaged: {_first_line(exc)}. Nothing was '
                        'changed; restore the database from a backup.'
                    ) from None
                if not write and ('locked' in str(exc) or 'busy' in str(exc)):  # a read that would wait: nothing done
                    raise _WouldWait from None
                raise
        finally:
            if write:
                self._write_lock.release()

    def _quick_run(self, work: Callable[[Any], Any], *, begin: bool) -> Any:
        """`work(connection)` on this thread's `_quick_txn` connection (a `sqlite3.Connection`: `execute` returns a
        cursor, with `rowcount` and `fetchone`), under the store's in-process write lock taken without waiting, as
        `_quick_txn(write=True)` runs its block, with less around it (no generator, no cursor wrapper): what the budget
        ledger's per-request writes run in. `begin`: in one `BEGIN IMMEDIATE` ... `COMMIT` (rolled back when `work`
        raises); without, `work` runs one writing statement, its own transaction (atomic: done whole or not at all).

        Returns:
            What `work` returned.

        Raises:
            _WouldWait: before anything is done, when it would wait (as `_quick_txn`'s); without `begin`, also when the
                statement found SQLite's write lock held by another process (it did nothing).
            StoreUnavailableError: the tables are missing.
        """
        if self.is_pg or not self._ready or self.url.database in (None, '', ':memory:'):
            raise _WouldWait
        if not self._write_lock.acquire(blocking=False):
            raise _WouldWait
        try:
            self._ensure_ready()  # one stat: a replaced file closes every connection (`dispose`) and migrates again
            raw = self._quick_connection()
            try:
                if not begin:
                    return work(raw)
                raw.execute('BEGIN IMMEDIATE')
                try:
                    result = work(raw)
                except BaseException:
                    raw.execute('ROLLBACK')
                    raise
                try:
                    raw.execute('COMMIT')
                except BaseException:  # the connection is this thread's again next time: never left in a transaction
                    with suppress(Exception):
                        raw.execute('ROLLBACK')
                    raise
                return result
            except self.engine.dialect.dbapi.OperationalError as exc:  # type: ignore[union-attr]
                if 'no such table' in str(exc):
                    raise StoreUnavailableError(
                        f'the conversation store {self.display_url} is damaged: {_first_line(exc)}. Nothing was '
                        'changed; restore the database from a backup.'
                    ) from None
                # BEGIN IMMEDIATE, or the statement of a run without `begin`, met another process's write lock.
                if ('locked' in str(exc) or 'busy' in str(exc)) and not raw.in_transaction:
                    raise _WouldWait from None
                raise
        finally:
            self._write_lock.release()

    def _quick_connection(self) -> Any:
        """This thread's connection of `_quick_txn`: one of the relaxed engine's (`synchronous=NORMAL`), detached from its
        pool and kept by the thread, with a busy timeout of 0; a new one after `dispose`."""
        local = self._quick
        raw = getattr(local, 'raw', None)
        if raw is not None and local.generation == self._quick_generation and local.pid == os.getpid():
            return raw
        if raw is not None and local.pid != os.getpid():  # a forked child's copy of its parent's: never used, nor closed
            _FORKED_CONNECTIONS.append(raw)
        elif raw is not None:
            with suppress(Exception):
                raw.close()
        fairy = self._relaxed_engine().raw_connection()
        raw: Any = fairy.driver_connection
        fairy.detach()  # the connection is this thread's from now on, closed by it (above), never pooled again
        raw.execute('PRAGMA busy_timeout = 0')
        local.raw, local.generation, local.pid = raw, self._quick_generation, os.getpid()
        return raw

    def dispose(self) -> None:
        """Close the pooled connections (both pools); the next transaction reconnects."""
        self._quick_generation += 1  # each thread's `_quick_txn` connection is closed at its next use
        self.engine.dispose()
        if self._fast_engine is not None and self._fast_engine is not self.engine:
            self._fast_engine.dispose()

    def _file_identity(self) -> tuple[int, int, int] | None:
        """`(device, inode, mode)` of the SQLite file, `None` for PostgreSQL, `:memory:` or a missing file."""
        if self.is_pg or self.url.database in (None, '', ':memory:'):
            return None
        try:
            st = os.stat(self.url.database)  # type: ignore[arg-type]
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_mode)

    def _ensure_ready(self) -> None:
        """Create or migrate the schema once per store object; for a SQLite file, again when the file was
        replaced, deleted or had its permissions changed since (one `stat` per transaction), after closing the
        pooled connections: a store kept for a worker's life never writes through a file descriptor of a file
        restored from a backup, or made read-only, since it opened it."""
        if self._ready and (self.is_pg or self._file_identity() == self._ready_file):
            return
        with self._lock:
            if self._ready and (self.is_pg or self._file_identity() == self._ready_file):
                return
            if self._ready:
                self.dispose()
            self._ready = False
            created = None
            if not self.is_pg and self.url.database not in (None, '', ':memory:'):
                path = Path(self.url.database)  # type: ignore[arg-type]
                if not path.exists():
                    if not self.create:
                        raise StoreUnavailableError(f'no conversation store at {self.display_url} (file {path.resolve()} does not exist)')
                    private_file(path)  # 0600 in a 0700 folder: conversations hold users' messages
                    created = str(path.resolve())
            try:
                self._migrate()
            except sa_exc.DBAPIError as exc:
                raise self._unreachable('cannot use', exc) from None
            if created is not None:
                store._announce_created(created)
            self._ready_file = self._file_identity()
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
                if version == store.SCHEMA_VERSION:
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
                        conn.exec_driver_sql(statement.replace('{BLOB}', 'BYTEA' if self.is_pg else 'BLOB'))
                    conn.execute(
                        sa.text('INSERT INTO durcap_schema_version (version, applied_at, writer) VALUES (:v, :at, :w)'),
                        {'v': target, 'at': _utcnow(), 'w': f'durable-capabilities ({_WRITER})'},
                    )

    def _refuse_newer(self, version: int, writer: str | None) -> None:
        supported = store.SCHEMA_VERSION
        if version > supported:
            raise SchemaVersionError(
                f'the conversation store {self.display_url} has schema version {version} (written by {writer}); this '
                f'durable-capabilities knows versions up to {supported}. Upgrade durable-capabilities here; the '
                'store was not changed.',
                found=version,
                supported=supported,
            )

    # ---- reading ------------------------------------------------------------------------------

    def _conversation_row(self, conn: sa.Connection, conversation_id: str, *, lock: bool = False) -> _Row | None:
        sql = f'SELECT {_CONVERSATION_COLUMNS} FROM durcap_conversations WHERE conversation_id = :cid'
        if lock and self.is_pg:
            sql += ' FOR UPDATE'
        row = conn.execute(sa.text(sql), {'cid': conversation_id}).first()
        return None if row is None else _decode_row(row)

    def _checked_row(self, conn: sa.Connection, conversation_id: str, scope: str | None = None) -> _Row | None:
        """The conversation row, checked against its rows as `_check_header` does, in one statement (one
        snapshot on PostgreSQL, one round trip on both): how every read starts. A row of another `scope` than the
        one given is returned unchecked (the caller reports it as not found, saying nothing more about it).

        Raises:
            CorruptedRowError: the row and its rows disagree (see `_verify_header`).
        """
        found = conn.execute(sa.text(_CHECKED_ROW), {'cid': conversation_id}).first()
        if found is None:
            return None
        row = _decode_row(found)
        if scope is None or row.record.scope == scope:
            _verify_header(row, found.head_position, found.logged)
        return row

    def read_record(self, conversation_id: str) -> ConversationRecord | None:
        with self._txn(write=False) as conn:
            row = self._checked_row(conn, conversation_id)
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
            result = conn.execute(
                sa.text(
                    f'{_ENTRY_SELECT} WHERE conversation_id = :owner AND position >= :low AND position < :high '
                    'ORDER BY position'
                ),
                {'owner': anchor.conversation_id, 'low': low, 'high': anchor.position},
            )
            try:
                # The driver's own rows (tuples of str and int on sqlite3 and psycopg; these columns need no
                # result processing): building a SQLAlchemy Row per message doubled the cost of a long read.
                cursor = result.cursor
                rows = list(map(_EntryRow._make, cursor.fetchall() if cursor is not None else result.all()))
            finally:
                result.close()
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
            row = self._checked_row(conn, conversation_id, scope)
            if row is None or row.deleted:
                raise ConversationNotFoundError(conversation_id, ' (it was deleted)' if row is not None else '')
            if scope is not None and row.record.scope != scope:
                raise ConversationNotFoundError(conversation_id, f' with scope {scope!r}')
            head = row.record.head_id
            rows = [] if head is None else self._history_rows(conn, head, limit, conversation_id)
            if limit is None and len(rows) != row.message_count:
                raise _header_error(row, f'says {row.message_count} message(s) but its history has {len(rows)}')
        messages = _decode_messages(rows, conversation_id)
        return StoredConversation(
            conversation_id=conversation_id,
            messages=messages,
            revision=row.revision,
            record=row.record,
            entry_ids=[r.entry_id for r in rows],
            first_position=rows[0].position if rows else row.message_count + 1,
        )

    def read_json(self, conversation_id: str, known: tuple[int, str] | None, check_writable: bool = False) -> StoredJSON:
        """`read` without decoding: each message's stored JSON. With `known` (a message count and the entry id
        of the last of them, from an earlier read), only the rows after them are read when the history still
        extends that prefix (`StoredJSON.tail`); otherwise the whole history. With `check_writable`,
        `probe_writable` first."""
        if check_writable:
            self.probe_writable()
        with self._txn(write=False) as conn:
            row = self._checked_row(conn, conversation_id)
            if row is None or row.deleted:
                raise ConversationNotFoundError(conversation_id, ' (it was deleted)' if row is not None else '')
            head = row.record.head_id
            if known is not None and 0 < known[0] <= row.message_count and head is not None:
                count, last = known
                if row.message_count == count:
                    line: tuple[list[str], list[str], list[str]] | None = ([], [], []) if head == last else None
                else:
                    line = self._own_line(conn, conversation_id, head, count + 1, row.message_count, last)
                if line is not None:
                    return StoredJSON(conversation_id, line[0], line[1], row.revision, row.message_count, tail=True,
                                      kinds=line[2])
                rows = self._history_rows(conn, head, row.message_count - count, conversation_id) if row.message_count > count else []
                if (rows[0].parent_id if rows else head) == last:
                    messages, entry_ids, kinds = _json_columns(rows)
                    return StoredJSON(conversation_id, messages, entry_ids, row.revision, row.message_count, tail=True,
                                      kinds=kinds)
            if head is not None and (line := self._own_line(conn, conversation_id, head, 1, row.message_count, None)):
                return StoredJSON(conversation_id, line[0], line[1], row.revision, row.message_count, tail=False,
                                  kinds=line[2])
            rows = [] if head is None else self._history_rows(conn, head, None, conversation_id)
            if len(rows) != row.message_count:
                raise _header_error(row, f'says {row.message_count} message(s) but its history has {len(rows)}')
        messages, entry_ids, kinds = _json_columns(rows)
        return StoredJSON(conversation_id, messages, entry_ids, row.revision, row.message_count, tail=False, kinds=kinds)

    def read_json_at(self, conversation_id: str, head_id: str, count: int) -> list[str]:
        """See `SQLConversationStore.read_json_at`."""
        with self._txn(write=False) as conn:
            found = conn.execute(sa.text('SELECT position FROM durcap_entries WHERE entry_id = :id'), {'id': head_id}).first()
            if found is None:
                raise ConversationNotFoundError(
                    conversation_id, f' (its history up to entry {head_id!r}, which a turn in flight loaded, is no '
                    'longer stored: the conversation was deleted)')
            if found.position != count:
                raise CorruptedRowError(
                    f'conversation {conversation_id!r}: entry {head_id!r} is message {found.position}, not message '
                    f'{count} as the turn that loaded it recorded. Nothing was changed; restore the store from a backup.',
                    conversation_id=conversation_id, table='durcap_entries', row=head_id, position=found.position)
            line = self._own_line(conn, conversation_id, head_id, 1, count, None)
            if line is not None:
                return line[0]
            rows = self._history_rows(conn, head_id, None, conversation_id)
        if len(rows) != count:
            raise CorruptedRowError(
                f'conversation {conversation_id!r}: the history up to entry {head_id!r} has {len(rows)} message(s), not '
                f'{count}. Nothing was changed; restore the store from a backup.',
                conversation_id=conversation_id, table='durcap_entries', row=head_id, position=count)
        return _json_columns(rows)[0]

    def _own_line(self, conn: sa.Connection, conversation_id: str, head: str, first: int, last: int,
                  parent: str | None) -> tuple[list[str], list[str], list[str]] | None:
        """The conversation's own entries at positions `first`..`last` (>= `first`), when they are exactly one
        line of entries from the child of `parent` (`None`: the first message) up to `head`: their message
        JSON, entry ids and kinds, oldest first. `None` when they are not (the history descends from a fork,
        or has a branch): the caller then links the rows up one by one (`_history_rows`).

        The common case of a long read, in one range query of four columns, with the links checked as two
        tuple slices compared (a C loop, not a Python one per message).
        """
        result = conn.execute(
            sa.text(
                'SELECT entry_id, parent_id, kind, message FROM durcap_entries '
                'WHERE conversation_id = :cid AND position >= :low AND position <= :high ORDER BY position'
            ),
            {'cid': conversation_id, 'low': first, 'high': last},
        )
        try:
            cursor = result.cursor  # the driver's tuples (see `_history_rows`)
            rows = cursor.fetchall() if cursor is not None else result.all()
        finally:
            result.close()
        if len(rows) != last - first + 1:
            return None
        entry_ids, parents, kinds, messages = zip(*rows, strict=True)
        if entry_ids[-1] != head or parents[0] != parent or parents[1:] != entry_ids[:-1]:
            return None
        return list(messages), list(entry_ids), list(kinds)

    def _check_header(self, conn: sa.Connection, row: _Row) -> None:
        """Check a conversation row read earlier in this transaction (a write's locked row) against its rows
        (`_verify_header`); a row another writer committed since is left to that writer's check.

        Raises:
            CorruptedRowError: they disagree (the row was edited, or rows are missing); names the conversation.
        """
        if row.deleted:
            return
        # One statement, so one snapshot on PostgreSQL even outside a locked write.
        found = conn.execute(
            sa.text(
                'SELECT (SELECT position FROM durcap_entries WHERE entry_id = :head) AS head_position, '
                '(SELECT MAX(revision) FROM durcap_writes WHERE conversation_id = :cid) AS logged, '
                '(SELECT revision FROM durcap_conversations WHERE conversation_id = :cid) AS revision'
            ),
            {'head': row.record.head_id, 'cid': row.record.conversation_id},
        ).one()
        if found.revision is not None and int(found.revision) != row.revision:
            return  # a writer committed between the two reads; the caller's rows are from before it
        _verify_header(row, found.head_position, found.logged)

    # ---- claim checks (durcap_payloads, see engines/temporal/_payloads.py) ----------------------------------------

    def put_payload(self, digest: str, data: bytes, owner: str | None = None) -> None:
        """Store `data` under its sha256 `digest`; a digest already stored is left as it is (idempotent). With
        `owner` (the durable run that refers to it: a Temporal workflow id), record the reference in
        `durcap_payload_refs` (once per owner), which `purge`, `stats` and `collect` read.

        The reference is written first: on PostgreSQL that waits for a `collect` in progress (it holds the table),
        so the piece is then looked for after the collection committed and written again if it was deleted."""
        with self._txn(write=True) as conn:
            if owner:
                conn.execute(
                    sa.text(
                        'INSERT INTO durcap_payload_refs (sha256, owner, created_at) VALUES (:d, :o, :at) '
                        'ON CONFLICT (sha256, owner) DO NOTHING'
                    ),
                    {'d': digest, 'o': owner, 'at': _utcnow()},
                )
            conn.execute(
                sa.text(
                    'INSERT INTO durcap_payloads (sha256, size, data, created_at, writer) VALUES (:d, :n, :data, :at, :w) '
                    'ON CONFLICT (sha256) DO NOTHING'
                ),
                {'d': digest, 'n': len(data), 'data': data, 'at': _utcnow(), 'w': _WRITER},
            )

    def put_payloads(self, pieces: Sequence[tuple[str, bytes]], owner: str | None = None) -> int:
        """Store each `(digest, data)` not stored yet, in one transaction; returns the bytes newly written.

        The digests already stored are read first (in batches), so a piece shared with earlier payloads is
        neither sent again nor rewritten; a concurrent writer of the same piece is absorbed by
        `ON CONFLICT DO NOTHING`. With `owner`, every piece's reference is recorded in `durcap_payload_refs`
        (once per owner), as `put_payload` does, so `purge`, `stats` and `collect` see which runs share a piece. The
        references are written before the stored digests are read: a `collect` in progress (which holds the table on
        PostgreSQL) is waited for, so a piece it deleted is not taken for stored.
        """
        unique = dict(pieces)
        if not unique:
            return 0
        written = 0
        with self._txn(write=True) as conn:
            at = _utcnow()
            if owner:
                conn.execute(
                    sa.text(
                        'INSERT INTO durcap_payload_refs (sha256, owner, created_at) VALUES (:d, :o, :at) '
                        'ON CONFLICT (sha256, owner) DO NOTHING'
                    ),
                    [{'d': d, 'o': owner, 'at': at} for d in unique],
                )
            known: set[str] = set()
            digests = list(unique)
            for start in range(0, len(digests), _IN_BATCH):
                batch = digests[start:start + _IN_BATCH]
                found = conn.execute(sa.text('SELECT sha256 FROM durcap_payloads WHERE sha256 IN :ds').bindparams(
                    sa.bindparam('ds', expanding=True)), {'ds': batch})
                known.update(row[0] for row in found)
            rows = [{'d': d, 'n': len(data), 'data': data, 'at': at, 'w': _WRITER} for d, data in unique.items() if d not in known]
            if rows:
                conn.execute(
                    sa.text(
                        'INSERT INTO durcap_payloads (sha256, size, data, created_at, writer) VALUES (:d, :n, :data, :at, :w) '
                        'ON CONFLICT (sha256) DO NOTHING'
                    ),
                    rows,
                )
                written = sum(row['n'] for row in rows)
        return written

    def put_tree(self, root: str, rows: Sequence[tuple[str, bytes, int]], owner: str | None = None,
                 pack: Callable[[bytes, int], tuple[bytes, int]] | None = None) -> int:
        """Store a claim check's tree (schema 8): each `(digest, data, kind)` not stored yet (`kind`: 0 a piece, 1 a leaf
        page, 2 a page of pages), in one transaction; returns the bytes newly written. With `owner`, one reference is
        recorded, for `root` (the page every other row is under): `purge`, `stats` and `collect` find the rest through
        the pages. As in `put_payloads`, the reference is written before the stored digests are read, so a `collect`
        in progress is waited for (PostgreSQL) and a row it deleted is written again. `pack(data, kind)` gives the
        `(data, kind)` to store for each row not stored yet (the codec compresses pieces there: `kind` 3).
        """
        unique = {digest: (data, kind) for digest, data, kind in rows}
        written = 0
        with self._txn(write=True) as conn:
            at = _utcnow()
            if owner:
                conn.execute(
                    sa.text(
                        'INSERT INTO durcap_payload_refs (sha256, owner, created_at) VALUES (:d, :o, :at) '
                        'ON CONFLICT (sha256, owner) DO NOTHING'
                    ),
                    {'d': root, 'o': owner, 'at': at},
                )
            known: set[str] = set()
            digests = list(unique)
            for start in range(0, len(digests), _IN_BATCH):
                batch = digests[start:start + _IN_BATCH]
                found = conn.execute(sa.text('SELECT sha256 FROM durcap_payloads WHERE sha256 IN :ds').bindparams(
                    sa.bindparam('ds', expanding=True)), {'ds': batch})
                known.update(row[0] for row in found)
            new = []
            for d, (data, kind) in unique.items():
                if d not in known:
                    data, kind = pack(data, kind) if pack is not None else (data, kind)
                    new.append({'d': d, 'n': len(data), 'data': data, 'at': at, 'w': _WRITER, 'k': kind})
            if new:
                conn.execute(
                    sa.text(
                        'INSERT INTO durcap_payloads (sha256, size, data, created_at, writer, kind) '
                        'VALUES (:d, :n, :data, :at, :w, :k) ON CONFLICT (sha256) DO NOTHING'
                    ),
                    new,
                )
                written = sum(row['n'] for row in new)
        return written

    def _children(self, conn: sa.Connection, digests: set[str]) -> dict[str, list[str]]:
        """`{page: the digests it lists}` of every tree page (schema 8, `kind` 1 or 2) under `digests` (the pages
        among them and below them); a digest that is not such a page has no entry."""
        children: dict[str, list[str]] = {}
        frontier = sorted(digests)
        while frontier:
            below: set[str] = set()
            for chunk in _chunks(frontier):
                for digest, kind, data in conn.execute(sa.text(
                        'SELECT sha256, kind, data FROM durcap_payloads WHERE kind IN (1, 2) AND sha256 IN :ds').bindparams(
                            sa.bindparam('ds', expanding=True)), {'ds': list(chunk)}).all():
                    raw = bytes(data)
                    if int(kind) == 1:  # a leaf page: a depth byte and a piece digest per entry; pieces have no children
                        children[digest] = list(dict.fromkeys(raw[i + 1:i + 33].hex() for i in range(0, len(raw), 33)))
                    else:
                        children[digest] = list(dict.fromkeys(raw[i:i + 32].hex() for i in range(0, len(raw), 32)))
                        below.update(d for d in children[digest] if d not in children)
            frontier = sorted(below - children.keys())
        return children

    @staticmethod
    def _under(digests: set[str], children: dict[str, list[str]]) -> set[str]:
        """`digests` and every row under them (through `children`, from `_children`)."""
        reached = set(digests)
        stack = [d for d in digests if d in children]
        while stack:
            for child in children[stack.pop()]:
                if child not in reached:
                    reached.add(child)
                    if child in children:
                        stack.append(child)
        return reached

    def _reach(self, conn: sa.Connection, refs: dict[str, set[str]]) -> dict[str, set[str]]:
        """`{owner: every durcap_payloads digest it needs}` from `{owner: the digests it refers to}`: the rows it refers
        to and, for a tree's root, every page and piece under it."""
        children = self._children(conn, set().union(*refs.values()) if refs else set())
        memo: dict[frozenset[str], set[str]] = {}
        return {owner: memo.setdefault(frozenset(ds), self._under(ds, children)) for owner, ds in refs.items()}

    def get_payloads(self, digests: Sequence[str]) -> dict[str, bytes]:
        """`{digest: bytes}` of the stored ones among `digests` (read in batches, one transaction)."""
        result: dict[str, bytes] = {}
        wanted = list(dict.fromkeys(digests))
        with self._txn(write=False) as conn:
            for start in range(0, len(wanted), _IN_BATCH):
                batch = wanted[start:start + _IN_BATCH]
                found = conn.execute(sa.text('SELECT sha256, data FROM durcap_payloads WHERE sha256 IN :ds').bindparams(
                    sa.bindparam('ds', expanding=True)), {'ds': batch})
                result.update((row[0], bytes(row[1])) for row in found)
        return result

    def get_rows(self, digests: Sequence[str]) -> dict[str, tuple[bytes, int]]:
        """`{digest: (bytes, kind)}` of the stored ones among `digests` (schema 8's `kind`; read in batches, one transaction)."""
        result: dict[str, tuple[bytes, int]] = {}
        wanted = list(dict.fromkeys(digests))
        with self._txn(write=False) as conn:
            for start in range(0, len(wanted), _IN_BATCH):
                batch = wanted[start:start + _IN_BATCH]
                found = conn.execute(sa.text('SELECT sha256, data, kind FROM durcap_payloads WHERE sha256 IN :ds').bindparams(
                    sa.bindparam('ds', expanding=True)), {'ds': batch})
                result.update((row[0], (bytes(row[1]), int(row[2]))) for row in found)
        return result

    def pieces_of(self, owner: str) -> list[str]:
        """The digests of the pieces `owner` refers to that still hold their bytes (`kind` 0 or 3, not a tree page nor a
        pointer into an entry)."""
        with self._txn(write=False) as conn:
            rows = conn.execute(sa.text(
                'SELECT p.sha256 FROM durcap_payload_refs r JOIN durcap_payloads p ON p.sha256 = r.sha256 '
                'WHERE r.owner = :o AND p.kind IN (0, 3) ORDER BY p.sha256'), {'o': owner}).all()
        return [row[0] for row in rows]

    def appended_entries(self, conversation_id: str, append_id: str) -> dict[str, str]:
        """`{entry id: message JSON}` of the entries the append `append_id` wrote to the conversation (empty when it
        has not landed), as stored."""
        with self._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT entry_ids FROM durcap_writes WHERE conversation_id = :cid AND '
                                       'append_id = :a'), {'cid': conversation_id, 'a': append_id}).first()
            if row is None:
                return {}
            ids = _BRANCHES.validate_json(row[0])
            found = dict(conn.execute(sa.text('SELECT entry_id, message FROM durcap_entries WHERE entry_id IN :ids').bindparams(
                sa.bindparam('ids', expanding=True)), {'ids': ids}).all()) if ids else {}
        return {entry_id: found[entry_id] for entry_id in ids if entry_id in found}

    def entry_message(self, entry_id: str) -> str | None:
        """The stored message JSON of entry `entry_id`, or `None` when there is no such entry."""
        with self._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT message FROM durcap_entries WHERE entry_id = :id'), {'id': entry_id}).first()
        return None if row is None else str(row[0])

    def point_payloads(self, pointers: dict[str, str]) -> int:
        """Replace the bytes of each piece `{digest: entry id}` by the id of the conversation entry that holds the same
        text (`kind` 4, `engines.prefect._results`); a piece already pointing, or missing, is left as it is. Returns
        the bytes freed."""
        freed = 0
        with self._txn(write=True) as conn:
            for digest, entry_id in sorted(pointers.items()):
                size = conn.execute(sa.text('SELECT size FROM durcap_payloads WHERE sha256 = :d AND kind IN (0, 3)'),
                                    {'d': digest}).scalar()
                if size is None:
                    continue
                data = entry_id.encode()
                conn.execute(sa.text('UPDATE durcap_payloads SET data = :data, size = :n, kind = 4 WHERE sha256 = :d'),
                             {'d': digest, 'data': data, 'n': len(data)})
                freed += int(size) - len(data)
        return freed

    def get_payload(self, digest: str) -> bytes | None:
        """The bytes stored under `digest`, or `None`."""
        with self._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT data FROM durcap_payloads WHERE sha256 = :d'), {'d': digest}).first()
        return None if row is None else bytes(row[0])

    # ---- deleting a conversation and measuring the store (`durcap history delete`, `durcap store stats`) ---------

    def _appends_of(self, conn: sa.Connection, conversation_id: str) -> list[str]:
        """The conversation's distinct `append_id`s, oldest first."""
        rows = conn.execute(
            sa.text('SELECT append_id FROM durcap_writes WHERE conversation_id = :cid AND append_id IS NOT NULL ORDER BY revision'),
            {'cid': conversation_id},
        ).all()
        return list(dict.fromkeys(append_id for (append_id,) in rows))

    def _owners(self, conn: sa.Connection) -> set[str]:
        """Every claim-check owner recorded (`durcap_payload_refs.owner`: the run the codec stored it for)."""
        return {owner for (owner,) in conn.execute(sa.text('SELECT DISTINCT owner FROM durcap_payload_refs')).all()}

    def _usage(self, conn: sa.Connection, conversation_id: str) -> _Usage:
        """The conversation's rows per table, its runs, and the claim checks its runs refer to (own and shared).

        Raises:
            ConversationNotFoundError: no row of it.
        """
        counts: dict[str, int] = {}
        for table in ('durcap_conversations', 'durcap_entries', 'durcap_writes'):
            counts[table] = int(conn.execute(
                sa.text(f'SELECT COUNT(*) FROM {table} WHERE conversation_id = :cid'), {'cid': conversation_id}).scalar() or 0)
        holders = [row[0] for row in conn.execute(
            sa.text('SELECT run_id FROM durcap_turn_claims WHERE conversation_id = :cid UNION '
                    'SELECT run_id FROM durcap_turn_takeovers WHERE conversation_id = :cid'), {'cid': conversation_id}).all()]
        if not any(counts.values()) and not holders:
            raise ConversationNotFoundError(conversation_id)
        length = 'OCTET_LENGTH(message)' if self.is_pg else 'LENGTH(CAST(message AS BLOB))'
        message_bytes = int(conn.execute(
            sa.text(f'SELECT SUM({length}) FROM durcap_entries WHERE conversation_id = :cid'), {'cid': conversation_id},
        ).scalar() or 0)
        deleted = conn.execute(sa.text('SELECT deleted FROM durcap_conversations WHERE conversation_id = :cid'),
                               {'cid': conversation_id}).scalar()
        appends = self._appends_of(conn, conversation_id)
        known = self._owners(conn)
        owners = sorted({owner for append_id in appends if (owner := _owner_of(append_id, known)) is not None}
                        | {owner for holder in holders for owner in _owners_of_holder(holder, known)})
        direct: dict[str, set[str]] = {}
        refs = 0
        for digest, owner in conn.execute(sa.text('SELECT sha256, owner FROM durcap_payload_refs')).all():
            direct.setdefault(owner, set()).add(digest)
        ours = set(owners)
        refs = sum(len(direct.get(owner, ())) for owner in owners)
        reach = self._reach(conn, direct)
        needed = set().union(*(reach[o] for o in owners if o in reach)) if owners else set()
        others = set().union(*(ds for o, ds in reach.items() if o not in ours)) if len(reach) > len(ours) else set()
        sizes: dict[str, int] = {}
        for chunk in _chunks(sorted(needed)):
            sizes.update((d, int(n)) for d, n in conn.execute(sa.text(
                'SELECT sha256, size FROM durcap_payloads WHERE sha256 IN :ds').bindparams(
                    sa.bindparam('ds', expanding=True)), {'ds': list(chunk)}).all())
        own = {d: sizes.get(d, 0) for d in needed - others}
        shared = {d: sizes.get(d, 0) for d in needed & others}
        counts['durcap_payload_refs'] = refs
        counts['durcap_payloads'] = len(own)
        return _Usage(counts, appends, owners, own, shared, message_bytes, bool(deleted))

    def _unpoint_shared(self, conn: sa.Connection, conversation_id: str, owners: set[str]) -> None:
        """Before the conversation's entries go: each pointer row (`kind` 4, `point_payloads`) into one of them that
        an owner other than `owners` (the conversation's runs) still refers to gets its text back as a compressed
        piece (`kind` 3). A run of another conversation that stored the same tool text (a Prefect flow run killed
        before its turn was appended) then still reads its result back, instead of running the tool again."""
        pointers = {d: bytes(data).decode() for d, data in conn.execute(
            sa.text('SELECT sha256, data FROM durcap_payloads WHERE kind = 4')).all()}
        if not pointers:
            return
        others: set[str] = set()
        for chunk in _chunks(sorted(pointers)):
            others.update(row[0] for row in conn.execute(sa.text(
                'SELECT sha256, owner FROM durcap_payload_refs WHERE sha256 IN :ds').bindparams(
                    sa.bindparam('ds', expanding=True)), {'ds': list(chunk)}).all() if row[1] not in owners)
        wanted = {d: entry for d, entry in pointers.items() if d in others}
        if not wanted:
            return
        messages: dict[str, str] = {}
        for chunk in _chunks(sorted(set(wanted.values()))):
            messages.update(conn.execute(sa.text(
                'SELECT entry_id, message FROM durcap_entries WHERE conversation_id = :cid AND entry_id IN :ids').bindparams(
                    sa.bindparam('ids', expanding=True)), {'cid': conversation_id, 'ids': list(chunk)}).all())
        for digest, entry_id in sorted(wanted.items()):
            if entry_id not in messages:
                continue  # another conversation's entry
            text = next((t for t in _long_strings(json.loads(messages[entry_id])) if tool_text_digest(t) == digest), None)
            if text is None:
                continue
            data = zlib.compress(text.encode(), 6)
            conn.execute(sa.text('UPDATE durcap_payloads SET data = :data, size = :n, kind = 3 WHERE sha256 = :d'),
                         {'d': digest, 'data': data, 'n': len(data)})

    def purge(self, conversation_id: str, dry_run: bool) -> PurgeReport:
        """Delete every row of the conversation and the claim checks only its runs refer to (see
        `SQLConversationStore.purge`); with `dry_run`, count them and change nothing."""
        with self._txn(write=not dry_run) as conn:
            if self.is_pg and not dry_run:  # as `collect`: a writer of a tree sharing our pieces waits, then rewrites them
                conn.execute(sa.text('LOCK TABLE durcap_payload_refs IN SHARE ROW EXCLUSIVE MODE'))
            usage = self._usage(conn, conversation_id)
            forks = [row[0] for row in conn.execute(sa.text(_FORKS), {'cid': conversation_id}).all()]
            if forks:
                raise ConversationHasForksError(
                    f'conversation {conversation_id!r}: the histories of {", ".join(map(repr, sorted(forks)))} run through '
                    'its messages (forked from it); nothing was deleted. Delete those conversations first.',
                    conversation_id=conversation_id, forks=sorted(forks),
                )
            if not dry_run:
                self._unpoint_shared(conn, conversation_id, set(usage.owners))
                # Its turn claim too: a run killed before its append (a Prefect flow run outside a deployment stays
                # RUNNING) held it for good, and its pieces are the conversation's (`_owners_of_holder`).
                for table in ('durcap_entries', 'durcap_writes', 'durcap_conversations', 'durcap_turn_claims',
                              'durcap_turn_takeovers'):
                    conn.execute(sa.text(f'DELETE FROM {table} WHERE conversation_id = :cid'), {'cid': conversation_id})
                # `durcap serve`'s rows of it (schema 7): who owned it, the runs requests started, their idempotency keys.
                conn.execute(sa.text('DELETE FROM durcap_serve_requests WHERE run_id IN (SELECT run_id FROM '
                                     'durcap_serve_runs WHERE conversation_id = :cid)'), {'cid': conversation_id})
                for table in ('durcap_serve_runs', 'durcap_serve_owners'):
                    conn.execute(sa.text(f'DELETE FROM {table} WHERE conversation_id = :cid'), {'cid': conversation_id})
                for chunk in _chunks(usage.owners):
                    params = {f'o{i}': owner for i, owner in enumerate(chunk)}
                    marks = ', '.join(f':{key}' for key in params)
                    conn.execute(sa.text(f'DELETE FROM durcap_payload_refs WHERE owner IN ({marks})'), params)
                for chunk in _chunks(sorted(usage.own)):
                    params = {f'd{i}': digest for i, digest in enumerate(chunk)}
                    marks = ', '.join(f':{key}' for key in params)
                    conn.execute(
                        sa.text(
                            f'DELETE FROM durcap_payloads WHERE sha256 IN ({marks}) AND NOT EXISTS '
                            '(SELECT 1 FROM durcap_payload_refs r WHERE r.sha256 = durcap_payloads.sha256)'
                        ),
                        params,
                    )
        return PurgeReport(
            conversation_id=conversation_id, dry_run=dry_run, rows=usage.counts, appends=usage.appends,
            message_bytes=usage.message_bytes, payload_bytes=sum(usage.own.values()), shared_payloads=len(usage.shared),
            shared_payload_bytes=sum(usage.shared.values()), owners=list(usage.owners),
        )

    # ---- collecting claim checks no run needs (`durcap store gc`) ---------------------------------------------------

    def _conversations_of_owners(self, conn: sa.Connection, owners: set[str]) -> dict[str, set[str]]:
        """`{owner: conversation ids}` from the appends (`durcap_writes.append_id`) of the owners' runs."""
        found: dict[str, set[str]] = {}
        for cid, append_id in conn.execute(
                sa.text('SELECT conversation_id, append_id FROM durcap_writes WHERE append_id IS NOT NULL')).all():
            owner = _owner_of(append_id, owners)
            if owner is not None:
                found.setdefault(owner, set()).add(cid)
        return found

    def claim_check_owners(self) -> list[ClaimCheckOwner]:
        """Every recorded claim-check owner (see `SQLConversationStore.claim_check_owners`)."""
        with self._txn(write=False) as conn:
            rows = conn.execute(sa.text(
                'SELECT owner, COUNT(*), MAX(created_at) FROM durcap_payload_refs GROUP BY owner ORDER BY owner')).all()
            conversations = self._conversations_of_owners(conn, {row[0] for row in rows})
        return [ClaimCheckOwner(owner, sorted(conversations.get(owner, ())), int(count), datetime.fromisoformat(newest))
                for owner, count, newest in rows]

    def collect(self, owners: list[str], before: datetime, dry_run: bool) -> CollectReport:
        """Delete the references of `owners` and the pieces left unreferenced (see `SQLConversationStore.collect`)."""
        cutoff = _iso(before)
        with self._txn(write=not dry_run) as conn:
            if self.is_pg and not dry_run:
                # Writers record their references first (`put_payloads`): holding the table here makes each of them
                # either committed before this transaction's statements (and seen) or wait until it commits.
                conn.execute(sa.text('LOCK TABLE durcap_payload_refs IN SHARE ROW EXCLUSIVE MODE'))
            newest: dict[str, str] = {}
            for chunk in _chunks(owners):
                newest.update(conn.execute(sa.text(
                    'SELECT owner, MAX(created_at) FROM durcap_payload_refs WHERE owner IN :os GROUP BY owner').bindparams(
                        sa.bindparam('os', expanding=True)), {'os': list(chunk)}).all())
            doomed = sorted(owner for owner, at in newest.items() if at < cutoff)
            skipped = sorted(owner for owner, at in newest.items() if at >= cutoff)
            direct: dict[str, set[str]] = {}  # owner -> digests it refers to (a tree: its root)
            for digest, owner in conn.execute(sa.text('SELECT sha256, owner FROM durcap_payload_refs')).all():
                direct.setdefault(owner, set()).add(digest)
            dead = set(doomed)
            reach = self._reach(conn, direct)
            refs = {owner: direct[owner] for owner in doomed if owner in direct}
            needs = {owner: reach[owner] for owner in refs}  # owner -> every row it needs
            candidates = sorted(set().union(*needs.values())) if needs else []
            alive = set().union(*(ds for owner, ds in reach.items() if owner not in dead)) if reach else set()
            kept: set[str] = set(candidates) & alive
            pieces: dict[str, tuple[int, str]] = {}  # digest -> (size, created_at)
            for chunk in _chunks(candidates):
                pieces.update((d, (int(n), at)) for d, n, at in conn.execute(
                    sa.text('SELECT sha256, size, created_at FROM durcap_payloads WHERE sha256 IN :ds').bindparams(
                        sa.bindparam('ds', expanding=True)), {'ds': list(chunk)}).all())
            kept |= {d for d, (_, at) in pieces.items() if at >= cutoff}
            freed = sorted(d for d in pieces if d not in kept)
            deleted_refs = sum(len(digests) for digests in refs.values())
            if not dry_run:
                deleted_refs = 0
                for chunk in _chunks(doomed):
                    deleted_refs += conn.execute(sa.text(
                        'DELETE FROM durcap_payload_refs WHERE owner IN :os AND created_at < :cut').bindparams(
                            sa.bindparam('os', expanding=True)), {'os': list(chunk), 'cut': cutoff}).rowcount
                gone: set[str] = set()
                for chunk in _chunks(freed):
                    gone.update(row[0] for row in conn.execute(sa.text(
                        'DELETE FROM durcap_payloads WHERE sha256 IN :ds AND created_at < :cut AND NOT EXISTS '
                        '(SELECT 1 FROM durcap_payload_refs r WHERE r.sha256 = durcap_payloads.sha256) RETURNING sha256')
                        .bindparams(sa.bindparam('ds', expanding=True)), {'ds': list(chunk), 'cut': cutoff}).all())
                kept |= set(freed) - gone
                freed = sorted(gone)
            conversations = self._conversations_of_owners(conn, set(doomed)) if doomed else {}
        freed_set = set(freed)
        per = [OwnerCollected(owner, sorted(conversations.get(owner, ())), len(refs.get(owner, ())),
                              len(mine := needs.get(owner, set()) & freed_set), sum(pieces[d][0] for d in mine))
               for owner in doomed]
        shared = {d for digests in needs.values() for d in digests if d in pieces and d not in freed_set}
        return CollectReport(
            dry_run=dry_run, before=before, owners=per, skipped=skipped, refs=deleted_refs, payloads=len(freed),
            payload_bytes=sum(pieces[d][0] for d in freed), shared_payloads=len(shared),
            shared_payload_bytes=sum(pieces[d][0] for d in shared),
        )

    def conversation_stats(self, conversation_id: str) -> ConversationStats:
        """One conversation's bytes (see `SQLConversationStore.conversation_stats`)."""
        with self._txn(write=False) as conn:
            usage = self._usage(conn, conversation_id)
        return ConversationStats(
            conversation_id=conversation_id, deleted=usage.deleted, message_count=usage.counts['durcap_entries'],
            message_bytes=usage.message_bytes, payload_bytes=sum(usage.own.values()),
            shared_payload_bytes=sum(usage.shared.values()), payloads=len(usage.own), shared_payloads=len(usage.shared),
        )

    def stats(self) -> StoreStats:
        """Bytes per conversation and in total (see `SQLConversationStore.stats`)."""
        length = 'OCTET_LENGTH(message)' if self.is_pg else 'LENGTH(CAST(message AS BLOB))'
        with self._txn(write=False) as conn:
            headers = {row[0]: bool(row[1]) for row in conn.execute(
                sa.text('SELECT conversation_id, deleted FROM durcap_conversations')).all()}
            messages = {row[0]: (int(row[1]), int(row[2] or 0)) for row in conn.execute(
                sa.text(f'SELECT conversation_id, COUNT(*), SUM({length}) FROM durcap_entries GROUP BY conversation_id')).all()}
            owner_of: dict[str, set[str]] = {}
            known = self._owners(conn)
            for cid, append_id in conn.execute(
                    sa.text('SELECT conversation_id, append_id FROM durcap_writes WHERE append_id IS NOT NULL')).all():
                owner = _owner_of(append_id, known)
                if owner is not None:
                    owner_of.setdefault(owner, set()).add(cid)
            claims: set[str] = set()
            for cid, holder in conn.execute(sa.text('SELECT conversation_id, run_id FROM durcap_turn_claims UNION '
                                                    'SELECT conversation_id, run_id FROM durcap_turn_takeovers')).all():
                # a run in flight, or killed before its append (its claim held, or taken over since)
                for owner in _owners_of_holder(holder, known):
                    owner_of.setdefault(owner, set()).add(cid)
                    claims.add(cid)
            sizes = {row[0]: int(row[1]) for row in conn.execute(sa.text('SELECT sha256, size FROM durcap_payloads')).all()}
            direct: dict[str, set[str]] = {}
            for digest, owner in conn.execute(sa.text('SELECT sha256, owner FROM durcap_payload_refs')).all():
                direct.setdefault(owner, set()).add(digest)
            users: dict[str, set[str | None]] = {}
            for owner, digests in self._reach(conn, direct).items():
                for digest in digests:
                    users.setdefault(digest, set()).update(owner_of.get(owner) or {None})
            database_bytes = (int(conn.execute(sa.text('SELECT pg_database_size(current_database())')).scalar() or 0)
                              if self.is_pg else None)
        if database_bytes is None and self.url.database not in (None, '', ':memory:'):
            database_bytes = sum(
                os.path.getsize(f) for f in (str(self.url.database), f'{self.url.database}-wal') if os.path.exists(f))
        per: dict[str, dict[str, int]] = {}
        unattributed = 0
        for digest, size in sizes.items():
            who = users.get(digest, {None})
            known = sorted(c for c in who if c is not None)
            if not known:
                unattributed += size
                continue
            key = 'own' if len(who) == 1 else 'shared'
            for cid in known:
                slot = per.setdefault(cid, {'own': 0, 'shared': 0, 'own_n': 0, 'shared_n': 0})
                slot[key] += size
                slot[f'{key}_n'] += 1
        conversations = []
        for cid in sorted(set(headers) | set(messages) | claims):
            count, size = messages.get(cid, (0, 0))
            slot = per.get(cid, {})
            conversations.append(ConversationStats(
                conversation_id=cid, deleted=headers.get(cid, False), message_count=count, message_bytes=size,
                payload_bytes=slot.get('own', 0), shared_payload_bytes=slot.get('shared', 0),
                payloads=slot.get('own_n', 0), shared_payloads=slot.get('shared_n', 0),
            ))
        return StoreStats(
            location=self.location, conversations=conversations,
            message_bytes=sum(c.message_bytes for c in conversations), payload_bytes=sum(sizes.values()),
            payloads=len(sizes), unattributed_payload_bytes=unattributed, database_bytes=database_bytes,
        )

    @property
    def location(self) -> str:
        """The store's location for people: a SQLite file's absolute path, else the URL with its password hidden."""
        if not self.is_pg and self.url.database not in (None, '', ':memory:'):
            return str(Path(self.url.database).resolve())  # type: ignore[arg-type]
        return self.display_url

    def probe_writable(self) -> None:
        """Open a write transaction and write nothing: fails when the database is unreachable or read-only.

        Raises:
            StoreUnavailableError: it cannot be written, with the database's reason.
        """
        read_only = f'the conversation store {self.display_url} is read-only; nothing was run. Fix: point $DURCAP_STORE at a writable database'
        try:
            with self._txn(write=True) as conn:
                if self.is_pg:
                    if conn.execute(sa.text('SHOW transaction_read_only')).scalar() == 'on':
                        raise StoreReadOnlyError(read_only)
                else:  # BEGIN IMMEDIATE succeeds on a read-only file; a write does not. Rolled back below.
                    conn.exec_driver_sql('UPDATE durcap_schema_version SET version = version')
                    raise _ProbeDone
        except _ProbeDone:
            pass
        except sa_exc.DBAPIError as exc:
            if 'readonly' in str(exc).replace('-', '').replace(' ', '').lower():
                raise StoreReadOnlyError(f'{read_only} ({_first_line(exc)})') from None
            raise StoreUnavailableError(f'cannot write to the conversation store {self.display_url}: {_first_line(exc)}') from None

    def read_history(self, head_id: str, limit: int | None) -> list[ConversationEntry]:
        with self._txn(write=False) as conn:
            rows = self._history_rows(conn, head_id, limit, None)
        messages = _decode_messages(rows, None)
        return [ConversationEntry(id=r.entry_id, parent_id=r.parent_id, message=m) for r, m in zip(rows, messages, strict=True)]

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
            except sa_exc.IntegrityError:
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
        rebase: bool = False,
        release: str | None = None,
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
                if live:
                    self._check_header(conn, old)  # type: ignore[arg-type]  # never write past a wrong end
                stored = old.revision if live else None  # type: ignore[union-attr]
                rebased = stored != expected
                if rebased and not rebase:
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
                if release is not None:
                    self._release(conn, conversation_id, release)
                return AppendResult(conversation_id, revision, ids, count + 1, count + len(encoded), rebased=rebased)

        return self._retrying_creation(attempt)

    # ---- turn claims ----------------------------------------------------------------------------

    def claim_turn(self, conversation_id: str, run_id: str) -> tuple[str, str] | None:
        """Claim the conversation for `run_id`'s turn; `None` when claimed (or `run_id` held it already), else the
        holder's `(run_id, claimed_at)`. One statement per backend that never fails on a concurrent claim.

        Raises:
            StoreReadOnlyError: the database is read-only (the claim is the turn's first write: nothing ran yet).
            StoreUnavailableError: it cannot be written otherwise, with the database's reason.
        """
        try:
            with self._txn(write=True) as conn:
                conn.execute(
                    sa.text('INSERT INTO durcap_turn_claims (conversation_id, run_id, claimed_at, writer) '
                            'VALUES (:cid, :run, :at, :w) ON CONFLICT (conversation_id) DO NOTHING'),
                    {'cid': conversation_id, 'run': run_id, 'at': _utcnow(), 'w': _WRITER},
                )
                row = conn.execute(sa.text('SELECT run_id, claimed_at FROM durcap_turn_claims WHERE conversation_id = :cid'),
                                   {'cid': conversation_id}).first()
        except sa_exc.DBAPIError as exc:
            if 'readonly' in str(exc).replace('-', '').replace(' ', '').lower():
                raise StoreReadOnlyError(f'the conversation store {self.display_url} is read-only; nothing was run. Fix: '
                                         f'point $DURCAP_STORE at a writable database ({_first_line(exc)})') from None
            raise
        if row is None or row.run_id == run_id:  # None: released between the two statements (not on one txn's view)
            return None
        return str(row.run_id), str(row.claimed_at)

    def _release(self, conn: sa.Connection, conversation_id: str, run_id: str | None) -> int:
        if run_id is None:
            return conn.execute(sa.text('DELETE FROM durcap_turn_claims WHERE conversation_id = :cid'),
                                {'cid': conversation_id}).rowcount
        return conn.execute(sa.text('DELETE FROM durcap_turn_claims WHERE conversation_id = :cid AND run_id = :run'),
                            {'cid': conversation_id, 'run': run_id}).rowcount

    def release_turn(self, conversation_id: str, run_id: str | None, taken_by: str | None = None) -> bool:
        with self._txn(write=True) as conn:
            released = self._release(conn, conversation_id, run_id) > 0
            if released and taken_by is not None and run_id is not None:
                conn.execute(sa.text('INSERT INTO durcap_turn_takeovers (conversation_id, run_id, taken_by, taken_at) '
                                     'VALUES (:cid, :run, :by, :at) ON CONFLICT (conversation_id, run_id) DO NOTHING'),
                             {'cid': conversation_id, 'run': run_id, 'by': taken_by, 'at': _utcnow()})
            return released

    def waiting_approval(self, run_id: str) -> tuple[str | None, list[dict[str, Any]]] | None:
        """`(engine, pending calls)` when the last approval event run `run_id` published to its stream is
        `approval_waiting` (no `approval_decided` after it); else `None`. Engine: its `run_started` event's, if any."""
        with self._txn(write=False) as conn:
            rows = conn.execute(sa.text(
                "SELECT kind, body FROM durcap_run_events WHERE run_id = :run AND kind IN ('run_started', "
                "'approval_waiting', 'approval_decided') ORDER BY event_offset"), {'run': run_id}).all()
        engine, calls = None, None
        for kind, body in rows:
            try:
                data = (json.loads(body) or {}).get('data') or {}
            except (TypeError, ValueError, AttributeError):
                continue
            if kind == 'run_started':
                engine = data.get('engine') if isinstance(data.get('engine'), str) else None
            elif kind == 'approval_waiting':
                calls = [c for c in data.get('calls') or [] if isinstance(c, dict)]
            else:
                calls = None
        return None if not calls else (engine, calls)

    def turn_claim(self, conversation_id: str) -> tuple[str, str] | None:
        with self._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT run_id, claimed_at FROM durcap_turn_claims WHERE conversation_id = :cid'),
                               {'cid': conversation_id}).first()
        return None if row is None else (str(row.run_id), str(row.claimed_at))

    def request_stop(self, conversation_id: str, holder: str, by: str) -> str | None:
        with self._txn(write=True) as conn:
            conn.execute(sa.text('UPDATE durcap_turn_claims SET stop_by = :by, stop_at = :at WHERE conversation_id = :cid '
                                 'AND run_id = :run AND stop_by IS NULL'),
                         {'by': by, 'at': _utcnow(), 'cid': conversation_id, 'run': holder})
            row = conn.execute(sa.text('SELECT stop_by FROM durcap_turn_claims WHERE conversation_id = :cid AND '
                                       'run_id = :run'), {'cid': conversation_id, 'run': holder}).first()
        return None if row is None else str(row.stop_by)

    def stop_requested(self, run_id: str, *, quick: bool = False) -> str | None:
        if quick:  # before every model request: one statement on the caller's thread (`_quick_txn`: `_WouldWait`)
            with self._quick_txn(write=False) as cur:
                found = cur.execute('SELECT stop_by FROM durcap_turn_claims WHERE run_id = :run AND stop_by IS NOT '
                                    'NULL LIMIT 1', {'run': run_id}).fetchone()
            return None if found is None else str(found[0])
        with self._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT stop_by FROM durcap_turn_claims WHERE run_id = :run AND stop_by IS NOT '
                                       'NULL LIMIT 1'), {'run': run_id}).first()
        return None if row is None else str(row.stop_by)

    def turn_stop(self, conversation_id: str) -> tuple[str, str | None] | None:
        with self._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT run_id, stop_by FROM durcap_turn_claims WHERE conversation_id = :cid'),
                               {'cid': conversation_id}).first()
        return None if row is None else (str(row.run_id), None if row.stop_by is None else str(row.stop_by))

    def write_record(self, record: ConversationRecord, encoded: list[tuple[ConversationEntry, str]], expected: str | None) -> None:
        cid = record.conversation_id

        def attempt() -> None:
            with self._txn(write=True) as conn:
                old = self._conversation_row(conn, cid, lock=True)
                live = old is not None and not old.deleted
                if live:
                    self._check_header(conn, old)  # type: ignore[arg-type]
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


_FORKS = (
    'SELECT DISTINCT e.conversation_id FROM durcap_entries e JOIN durcap_entries p ON e.parent_id = p.entry_id '
    'WHERE p.conversation_id = :cid AND e.conversation_id <> :cid '
    'UNION SELECT c.conversation_id FROM durcap_conversations c JOIN durcap_entries p ON c.head_id = p.entry_id '
    'WHERE p.conversation_id = :cid AND c.conversation_id <> :cid'
)
"""The other conversations whose histories run through the conversation's own entries (forked from it)."""


def _owners_of_holder(holder: str, owners: set[str]) -> list[str]:
    """The claim-check owners that are the run holding a conversation's turn claim (`durcap_turn_claims.run_id`): the
    owner of that id, or of that id after an engine's prefix (a Prefect flow run holds the claim as `<flow run id>`
    and owns its pieces as `prefect:<flow run id>`). A run killed before its append wrote no `durcap_writes` row: its
    claim is what ties its pieces to the conversation."""
    return [owner for owner in owners if owner == holder or owner.endswith(f':{holder}')]


def _owner_of(append_id: str, owners: set[str]) -> str | None:
    """The claim-check owner an `append_id` belongs to: the append id itself when it is a recorded owner (a Prefect
    flow run's tool-result pieces, `engines.prefect._results`), else the longest recorded owner it begins with, followed
    by ':' (a durable run's appends begin with its id, `WORKFLOW_ID:RUN_ID`; ids of engines that store no claim checks
    begin with no owner). Engine-neutral: the owners are whatever the writers recorded."""
    if append_id in owners:  # an engine whose runs' owner id is their append id (Prefect: `prefect:<flow run id>`)
        return append_id
    found = None
    cut = append_id.find(':')
    while cut > 0:
        if append_id[:cut] in owners:
            found = append_id[:cut]
        cut = append_id.find(':', cut + 1)
    return found


@dataclasses.dataclass
class _Usage:
    counts: dict[str, int]
    appends: list[str]
    owners: list[str]
    own: dict[str, int]
    shared: dict[str, int]
    message_bytes: int
    deleted: bool


_TOOL_TEXT_NAMESPACE = b'durcap/prefect-tool-result\x00'


def tool_text_digest(text: str) -> str:
    """The `durcap_payloads` key of a long text taken out of a Prefect tool result (sha256, namespaced; the pointer
    rows of `point_payloads` are keyed by it)."""
    return hashlib.sha256(_TOOL_TEXT_NAMESPACE + text.encode()).hexdigest()


def _long_strings(value: Any, at_least: int = 1024) -> Iterator[str]:
    if isinstance(value, str):
        if len(value) >= at_least:
            yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _long_strings(item, at_least)
    elif isinstance(value, list):
        for item in value:
            yield from _long_strings(item, at_least)


def _chunks(values: Sequence[str], size: int = 500) -> Iterator[Sequence[str]]:
    for start in range(0, len(values), size):
        yield values[start:start + size]


def _json_columns(rows: Sequence[Any]) -> tuple[list[str], list[str], list[str]]:
    """The message, entry id and kind columns of entry rows (one transposition, not three passes)."""
    if not rows:
        return [], [], []
    entry_ids, _parents, _owners, _positions, kinds, messages, _writers = zip(*rows, strict=True)
    return list(messages), list(entry_ids), list(kinds)


def _is_line(rows: Sequence[Any], anchor: Any, low: int) -> bool:
    """Whether `rows` (ordered by position, from `low` up to the anchor's) are one line of entries ending at `anchor`."""
    if len(rows) != anchor.position - low:
        return False
    if not rows:
        return True
    if anchor[1] != rows[-1][0] or rows[0][3] != low:
        return False
    return all(older[0] == newer[1] for older, newer in itertools.pairwise(rows))


class _ProbeDone(Exception):
    """Raised inside the writability probe's transaction to roll its write back."""


_CHECKED_ROW = (
    'SELECT ' + ', '.join(f'c.{column.strip()}' for column in _CONVERSATION_COLUMNS.split(',')) + ', '
    '(SELECT e.position FROM durcap_entries e WHERE e.entry_id = c.head_id) AS head_position, '
    '(SELECT MAX(w.revision) FROM durcap_writes w WHERE w.conversation_id = c.conversation_id) AS logged '
    'FROM durcap_conversations c WHERE c.conversation_id = :cid'
)
"""`_checked_row`'s statement: the conversation row, the position of its head entry and the last revision its write
log records."""


def _verify_header(row: _Row, head_position: Any, logged: Any) -> None:
    """Check a live conversation row against its rows: its head entry is at position `message_count`
    (`head_position`, `None` when the head entry is missing), and its `revision` is the last one its write log
    records (`logged`, `None` for an empty log). A deleted row is not checked.

    Raises:
        CorruptedRowError: they disagree (the row was edited, or rows are missing); names the conversation.
    """
    if row.deleted:
        return
    head = row.record.head_id
    if head is None:
        if row.message_count != 0:
            raise _header_error(row, f'says {row.message_count} message(s) but has no head entry')
    elif head_position is None:
        raise _header_error(row, f'names head entry {head!r}, which is not in durcap_entries')
    elif int(head_position) != row.message_count:
        raise _header_error(
            row, f'says {row.message_count} message(s) but its head entry {head!r} is message {int(head_position)}'
        )
    if logged is not None and int(logged) != row.revision:
        raise _header_error(row, f'is at revision {row.revision} but its write log ends at revision {int(logged)}')


def _header_error(row: _Row, what: str) -> CorruptedRowError:
    cid = row.record.conversation_id
    return CorruptedRowError(
        f'conversation {cid!r}: its durcap_conversations row {what}. Nothing was changed; restore the row from a '
        'backup (`durcap history show` lists its writes).',
        conversation_id=cid, table='durcap_conversations', row=cid,
    )


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


def _sqlite_connect_relaxed(dbapi_connection: Any, record: Any) -> None:
    _sqlite_connect(dbapi_connection, record)
    dbapi_connection.execute('PRAGMA synchronous=NORMAL')


class _RawCursor:
    """A DBAPI cursor taking `:name` parameters on both backends (rewritten to psycopg's `%(name)s` on PostgreSQL)."""

    _PG: ClassVar[dict[str, str]] = {}

    def __init__(self, cursor: Any, is_pg: bool):
        self.cursor, self.is_pg = cursor, is_pg

    def execute(self, statement: str, params: dict[str, Any] | None = None) -> Any:
        """Run `statement`; returns the cursor (`fetchone`, `rowcount`)."""
        if self.is_pg:
            converted = self._PG.get(statement)
            if converted is None:
                converted = self._PG[statement] = _PG_PARAM.sub(r'%(\1)s', statement.replace('%', '%%'))
            statement = converted
        self.cursor.execute(statement, params or {})
        return self.cursor

    def executemany(self, statement: str, rows: Sequence[dict[str, Any]]) -> None:
        """Run `statement` once per parameter set of `rows`."""
        if self.is_pg:
            converted = self._PG.get(statement)
            if converted is None:
                converted = self._PG[statement] = _PG_PARAM.sub(r'%(\1)s', statement.replace('%', '%%'))
            statement = converted
        self.cursor.executemany(statement, rows)


_PG_PARAM = re.compile(r'(?<![:\w]):(\w+)')


def _sqlite_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql('BEGIN IMMEDIATE' if conn.get_execution_options().get('durcap_write') else 'BEGIN')
