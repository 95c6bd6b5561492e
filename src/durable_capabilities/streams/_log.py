"""The run event log in the conversation store: `durcap_run_streams` (one row per run) and `durcap_run_events`.

Why the store (measured choice, for local, DBOS and Prefect alike): the durable units already write to it, every
process that can run or read a run can reach it, offsets can be assigned in the writer's transaction, and a unique
`(run, unit, attempt, seq)` key makes a re-sent or replayed event a no-op. DBOS's own streams are keyed by workflow
and would need a second mechanism for Prefect and local runs.

Writes are synchronous SQL (the store's own backend and its transactions: SQLite `BEGIN IMMEDIATE`, PostgreSQL a row
lock on the run's stream row); the async API runs them in a worker thread.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import sqlalchemy as sa
from pydantic_core import to_json

from .._limits import InputError
from ..conversations import process_store

T = TypeVar('T')

DEFAULT_MAX_EVENTS = 100_000
"""Events a run's stream keeps (`$DURCAP_STREAM_MAX_EVENTS`); beyond it the oldest are dropped (`dropped` counts them)."""
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
"""Bytes of event JSON a run's stream keeps (`$DURCAP_STREAM_MAX_BYTES`), the oldest dropped first."""
DEFAULT_RETENTION_SECONDS = 7 * 24 * 3600
"""How long a closed run's stream is kept (`$DURCAP_STREAM_RETENTION`, seconds); older ones are deleted when another
run's stream closes."""


PRUNE_EVERY_SECONDS = 60.0
"""A process deletes expired streams at most this often (when a run's stream closes)."""


@dataclass(frozen=True)
class Limits:
    """What one run's stream retains.

    Attributes:
        max_events: Events kept per run (oldest dropped first).
        max_bytes: Bytes of event JSON kept per run.
        retention_seconds: Seconds a closed stream is kept.
    """

    max_events: int = DEFAULT_MAX_EVENTS
    max_bytes: int = DEFAULT_MAX_BYTES
    retention_seconds: float = DEFAULT_RETENTION_SECONDS

    @classmethod
    def from_env(cls) -> Limits:
        """The limits from `$DURCAP_STREAM_MAX_EVENTS`, `$DURCAP_STREAM_MAX_BYTES`, `$DURCAP_STREAM_RETENTION`.

        Raises:
            InputError: DC040 (a `ValueError`), a variable that is not a positive finite number, naming it, its
                default and the fix. `durcap run`, `demo` and the workers read them before anything runs (exit 2).
        """
        def read(name: str, default: float) -> float:
            raw = os.environ.get(name)
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                value = -1
            if not 0 < value < float('inf'):
                shown = f'{default:.0f}' if default == int(default) else f'{default:g}'
                raise InputError(f'${name}', f'must be a positive number, got {raw!r}. Fix: unset it (default '
                                 f'{shown}) or give e.g. {shown}.')
            return value

        return cls(int(read('DURCAP_STREAM_MAX_EVENTS', DEFAULT_MAX_EVENTS)),
                   int(read('DURCAP_STREAM_MAX_BYTES', DEFAULT_MAX_BYTES)),
                   read('DURCAP_STREAM_RETENTION', DEFAULT_RETENTION_SECONDS))


@dataclass(frozen=True)
class Item:
    """One event to publish: its key within the run (`unit`, `attempt`, `seq`), its kind and its JSON body."""

    unit: str
    attempt: int
    seq: int
    kind: str
    body: dict[str, Any]


@dataclass(frozen=True)
class StoredEvent:
    """One stored event row (`raw`: its body's JSON as stored, when the reader kept it)."""

    offset: int
    unit: str
    attempt: int
    seq: int
    kind: str
    body: dict[str, Any]
    created_at: str
    raw: str | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class StreamInfo:
    """A run's stream row: its next offset, what it holds, whether it closed."""

    run_id: str
    engine: str
    next_offset: int
    first_offset: int
    event_count: int
    bytes: int
    dropped: int
    started_at: str
    closed_at: str | None


_EXECUTOR = ThreadPoolExecutor(max_workers=4, thread_name_prefix='durcap-streams')
"""The threads the async API runs its SQL in: its own, not the loop's default executor (DBOS installs its own as the
default and shuts it down with DBOS, after which a subscriber in the same process still reads)."""


async def in_thread(func: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`func(*args, **kwargs)` in one of `_EXECUTOR`'s threads."""
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, functools.partial(func, *args, **kwargs))


class _Writer:
    """One thread that runs a store's event writes in the order they were handed to it (`EventLog.submit`): a run's
    writes never overtake each other (a `run_started` handed over before a model request's first delta is stored
    before it, with a lower offset) without their callers awaiting each other, and only one of this process's writes
    holds the store's write lock at a time (SQLite has one writer anyway). The writes queued when the thread takes
    one go in the same transaction (group commit), each in a savepoint of its own (a write that fails fails alone).
    The transaction is flushed to disk when one of its writes asks for it (`flush`, every durable engine's); one of
    only unflushed writes (a local run's) is committed relaxed (`_SQLBackend._raw_txn`: durable against a crash of
    any process, not against a power loss; the next flushed commit flushes it too).
    A daemon thread, started on first use in each process (a forked child starts its own); a write still queued
    when the process exits is lost as it would be with the process, which every durable unit's publisher awaits
    before its unit ends."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.queue: queue.SimpleQueue[tuple[str, bool, Callable[[Any], Any], Future[Any], bool]] = queue.SimpleQueue()
        self.pending = 0  # writes handed to the thread and not finished yet
        self.guard = threading.Lock()
        threading.Thread(target=self._run, name='durcap-stream-writer', daemon=True).start()

    def submit(self, run_id: str, close: bool, job: Callable[[Any], T], flush: bool = True) -> Future[T]:
        future: Future[T] = Future()
        if not flush and not self.pending and self._inline(run_id, close, job, future):
            return future
        with self.guard:
            self.pending += 1
        self.queue.put((run_id, close, job, future, flush))
        return future

    def _inline(self, run_id: str, close: bool, job: Callable[[Any], T], future: Future[T]) -> bool:
        """A write that needs no flush (a local run's), run at once on the calling thread (the run's event loop) when
        nothing is queued before it and it never waits (SQLite, the write lock free: `_SQLBackend._quick_txn`, a
        relaxed commit): no hand-off to the writer thread and back. Whether it ran (its outcome in `future`)."""
        from ..store._sql import _WouldWait

        try:
            with _staging() as staged, self.log._backend._quick_txn() as cur:
                result = job(cur)
        except _WouldWait:
            return False
        except Exception as error:  # noqa: BLE001 - the write's error is its future's, as the thread's are
            future.set_running_or_notify_cancel()
            future.set_exception(error)
            return True
        future.set_running_or_notify_cancel()
        _notify(run_id, staged)
        if close:
            self.log._maybe_prune(in_thread=True)
        future.set_result(result)
        return True

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            with suppress(queue.Empty):
                while len(batch) < 100:
                    batch.append(self.queue.get_nowait())
            taken = len(batch)
            batch = [item for item in batch if item[3].set_running_or_notify_cancel()]
            results: list[tuple[bool, Any]] = []
            try:
                with _staging() as staged, self.log._backend._raw_txn(relaxed=not any(item[4] for item in batch)) as cur:
                    for index, (_, _, job, _, _) in enumerate(batch):
                        if len(batch) > 1:
                            cur.execute(f'SAVEPOINT durcap_w{index}')
                        kept = len(staged)
                        try:
                            results.append((True, job(cur)))
                        except Exception as error:
                            if len(batch) == 1:
                                raise
                            cur.execute(f'ROLLBACK TO SAVEPOINT durcap_w{index}')
                            del staged[kept:]  # its rows were rolled back: nobody is handed them
                            results.append((False, error))
                        if len(batch) > 1:
                            cur.execute(f'RELEASE SAVEPOINT durcap_w{index}')
            except BaseException as error:  # noqa: BLE001 - the transaction failed: every write of it did
                for _, _, _, future, _ in batch:
                    future.set_exception(error)
                with self.guard:
                    self.pending -= taken
                continue
            for run_id in dict.fromkeys(item[0] for item in batch):
                _notify(run_id, staged)
            if any(item[1] for item in batch):
                with suppress(Exception):
                    self.log._maybe_prune()
            for (_, _, _, future, _), (ok, value) in zip(batch, results, strict=True):
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)
            with self.guard:
                self.pending -= taken


_POLL = ('SELECT s.run_id, s.engine, s.next_offset, s.first_offset, s.event_count, s.bytes, s.dropped, s.started_at, '
         's.closed_at, e.event_offset, e.unit, e.attempt, e.seq, e.kind, e.body, e.created_at FROM durcap_run_streams s '
         'LEFT JOIN (SELECT event_offset, unit, attempt, seq, kind, body, created_at FROM durcap_run_events WHERE '
         'run_id = :r AND event_offset > :o ORDER BY event_offset LIMIT :n) e ON 1 = 1 WHERE s.run_id = :r '
         'ORDER BY e.event_offset')
"""A subscriber's read (`EventLog.poll_sync`): the stream's row, with each of its next events (NULLs: none)."""

_WRITERS: dict[tuple[int, str], _Writer] = {}
_WRITERS_LOCK = threading.Lock()


def _writer(log: EventLog) -> _Writer:
    key = (os.getpid(), log.store_url)
    writer = _WRITERS.get(key)
    if writer is None:
        with _WRITERS_LOCK:
            writer = _WRITERS.get(key)
            if writer is None:
                writer = _WRITERS[key] = _Writer(log)
    return writer


_Row = tuple[int, str, int, int, str, str, str, str]
"""A row staged for this process's subscribers: `(offset, unit, attempt, seq, kind, body JSON, created_at, shape)`
(`shape`: `body_shape` of the body, known when it was written)."""

_Staged = tuple[str, list[_Row], bool]
"""Rows a transaction wrote for a run with a subscriber in this process: `(run_id, rows, closes the stream)`."""


def body_shape(body: Any) -> str:
    """Which of the shapes `_watch.event_json` splices an event's body (a dict) has: `event+data` (`{"event", "data":
    {...}}`), `event` (`{"event"}`), `data` (`{"data": {...}}`), else `''` (any other: encoded through the model)."""
    keys = tuple(body)
    if keys == ('event', 'data') and type(body['data']) is dict:
        return 'event+data'
    if keys == ('event',):
        return 'event'
    if keys == ('data',) and type(body['data']) is dict:
        return 'data'
    return ''


class HandedEvent(StoredEvent):
    """A `StoredEvent` a commit in this process handed over (`Inbox.take`): its `body` is parsed from `raw` when first
    read, and `shape` (`body_shape`, from the body as written) says what `_watch.event_json` needs to splice `raw`, so
    `durcap serve`'s stream, which reads nothing else of it, parses none. Equal to the `StoredEvent` of its row."""

    shape: str

    @classmethod
    def of(cls, row: _Row) -> HandedEvent:
        """The event of a staged row (`_Row`)."""
        event = object.__new__(cls)
        offset, unit, attempt, seq, kind, raw, created_at, shape = row
        event.__dict__.update(offset=offset, unit=unit, attempt=attempt, seq=seq, kind=kind, created_at=created_at,
                              raw=raw, shape=shape)
        return event

    def __getattr__(self, name: str) -> Any:
        if name == 'body':
            body = self.__dict__['body'] = json.loads(self.raw)  # type: ignore[arg-type]
            return body
        if name == 'shape':  # one made by `dataclasses.replace`: from its body
            shape = self.__dict__['shape'] = body_shape(self.body)
            return shape
        raise AttributeError(name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StoredEvent):
            return NotImplemented
        return ((self.offset, self.unit, self.attempt, self.seq, self.kind, self.body, self.created_at)
                == (other.offset, other.unit, other.attempt, other.seq, other.kind, other.body, other.created_at))

    __hash__ = None  # type: ignore[assignment]  # as StoredEvent's: its body is a dict

_STAGING = threading.local()


@contextmanager
def _staging() -> Iterator[list[_Staged]]:
    """The rows the event writes of one transaction on this thread stage for this process's subscribers (`_append`
    adds them while the block runs; the caller hands them over with `_notify` once committed)."""
    staged: list[_Staged] = []
    outer = getattr(_STAGING, 'staged', None)
    _STAGING.staged = staged
    try:
        yield staged
    finally:
        _STAGING.staged = outer


class Inbox:
    """A subscriber in this process (`subscribe`): the rows each commit of its run in this process wrote, handed over
    by the committing thread (so the subscriber needs no read of the store for them), and a wake-up.

    Attributes:
        run_id: The run.
    """

    __slots__ = ('_closed', '_future', '_loop', '_rows', '_unknown', '_woken', 'run_id')

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._loop = asyncio.get_running_loop()
        self._rows: list[_Row] = []
        self._closed = self._unknown = self._woken = False
        self._future: asyncio.Future[None] | None = None

    def _add(self, rows: list[_Row] | None, closed: bool) -> bool:
        """Under `_WAITERS_GUARD`: keep a commit's rows (`None`: not known, the subscriber reads the store); whether
        the subscriber is to be woken (not already)."""
        if rows is None:
            self._unknown = True
        else:
            self._rows += rows
        self._closed = self._closed or closed
        woken, self._woken = self._woken, True
        return not woken

    def _wake(self) -> None:
        future = self._future
        if future is not None and not future.done():
            future.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until a commit of the run in this process since the last `take`, or `timeout` seconds."""
        with _WAITERS_GUARD:
            if self._woken:
                return
            future = self._future = self._loop.create_future()
        timer = self._loop.call_later(timeout, _timed_out, future)
        try:
            await future
        finally:
            timer.cancel()
            self._future = None

    def take(self) -> tuple[list[StoredEvent], bool, bool]:
        """`(rows handed over since the last take, in offset order, whether a commit's rows were not handed over (it
        was under way when the subscriber came: read the store), whether a commit closed the stream)`."""
        with _WAITERS_GUARD:
            rows, unknown, closed = self._rows, self._unknown, self._closed
            self._rows, self._unknown, self._closed, self._woken = [], False, False, False
        rows.sort()
        return [HandedEvent.of(row) for row in rows], unknown, closed


def _timed_out(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_WAITERS: dict[str, list[Inbox]] = {}
_WAITERS_GUARD = threading.Lock()


def subscribe(run_id: str) -> Inbox:
    """An `Inbox` of the running loop for `run_id`: handed what this process commits for the run (any store, any
    thread) from now on, so a subscriber in the process that runs the run (`durcap serve`'s local turns) receives
    each new event without a read, and other commits at its poll. Register it before the first read, so no commit
    after that read is missed; drop it with `unsubscribe`."""
    inbox = Inbox(run_id)
    with _WAITERS_GUARD:
        _WAITERS.setdefault(run_id, []).append(inbox)
    return inbox


def unsubscribe(inbox: Inbox) -> None:
    """Drop an `Inbox` (`subscribe`)."""
    with _WAITERS_GUARD:
        inboxes = _WAITERS.get(inbox.run_id)
        if inboxes is None:
            return
        inboxes[:] = [i for i in inboxes if i is not inbox]
        if not inboxes:
            del _WAITERS[inbox.run_id]


def _notify(run_id: str, staged: list[_Staged] | None = None) -> None:
    """Hand the rows a committed transaction wrote for `run_id` (from `staged`; none there: not known) to its
    subscribers in this process and wake them (called after the commit, in the committing thread)."""
    if run_id not in _WAITERS:
        return
    rows: list[_Row] | None = None
    closed = False
    for staged_run, staged_rows, staged_close in staged or ():
        if staged_run == run_id:
            rows = (rows or []) + staged_rows
            closed = closed or staged_close
    try:
        running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # the writer thread
        running = None
    with _WAITERS_GUARD:
        woken = [inbox for inbox in _WAITERS.get(run_id, ()) if inbox._add(rows, closed)]
    for inbox in woken:
        try:
            if inbox._loop is running:  # a write on the subscriber's own loop (`_Writer._inline`): no wake-up needed
                inbox._loop.call_soon(inbox._wake)
            else:
                inbox._loop.call_soon_threadsafe(inbox._wake)
        except RuntimeError:  # its loop closed: nobody waits
            pass


def _now() -> str:
    return datetime.now(UTC).isoformat()


class EventLog:
    """The run event log of one conversation store (by URL; the store's process-wide backend).

    Args:
        store_url: The conversation store URL (SQLite or PostgreSQL).
        limits: What a run's stream retains (default: `Limits.from_env()`).
    """

    def __init__(self, store_url: str, limits: Limits | None = None):
        self.store_url = store_url
        self.limits = limits or Limits.from_env()
        self._backend = process_store(store_url)._sql  # the store's SQL (migrations, transactions)

    # ---- writing ------------------------------------------------------------------------------

    def append_sync(self, run_id: str, engine: str, items: Sequence[Item], *, close: bool = False) -> list[int]:
        """Store `items` for `run_id` (those whose key is already stored are skipped); with `close`, mark the stream
        closed. Returns the offsets given to the new items, in order."""
        with _staging() as staged, self._backend._raw_txn(relaxed=False) as cur:
            offsets = self.append_in(cur, run_id, engine, items, close=close)
        _notify(run_id, staged)
        if close:
            self._maybe_prune()
        return offsets

    def append_unit_sync(self, run_id: str, engine: str, unit: str, entries: Sequence[tuple[int, str, dict[str, Any]]],
                         attempt: int | None, *, at_least: int | None = None) -> int:
        """Store `entries` (`(seq, kind, body)`) of one execution of `unit`; `attempt=None` for its first batch: the
        execution's attempt is then claimed in the same transaction (one more than the unit's last, and at least
        `at_least`: the engine's own attempt number, a Temporal activity's), after a `retry` event (seq -1) naming
        the earlier attempts when there are any. Returns the attempt.

        The attempt is this execution's alone (claimed in a write transaction, with rows), and it numbers its entries
        itself, each once: they are inserted without looking for stored keys first."""
        with _staging() as staged, self._backend._raw_txn(relaxed=False) as cur:
            attempt = self.append_unit_in(cur, run_id, engine, unit, entries, attempt, at_least=at_least)
        _notify(run_id, staged)
        return attempt

    def append_in(self, cur: Any, run_id: str, engine: str, items: Sequence[Item], *, close: bool = False) -> list[int]:
        """`append_sync`'s work in an open transaction (`_raw_txn`, the writer thread's)."""
        return self._append(cur, run_id, engine, items, close=close)

    def append_unit_in(self, cur: Any, run_id: str, engine: str, unit: str,
                       entries: Sequence[tuple[int, str, dict[str, Any]]], attempt: int | None, *,
                       at_least: int | None = None) -> int:
        """`append_unit_sync`'s work in an open transaction (`_raw_txn`, the writer thread's)."""
        items: list[Item] = []
        if attempt is None:
            rows = cur.execute('SELECT DISTINCT attempt FROM durcap_run_events WHERE run_id = :r AND unit = :u',
                               {'r': run_id, 'u': unit}).fetchall()
            earlier = sorted(int(r[0]) for r in rows)
            attempt = max(max(earlier) + 1 if earlier else 1, at_least or 1)
            if earlier:
                items.append(Item(unit, attempt, -1, 'retry', {'data': {'discard_attempts': earlier}}))
        items += [Item(unit, attempt, seq, kind, body) for seq, kind, body in entries]
        self._append(cur, run_id, engine, items, close=False, check=False)
        return attempt

    def _append(self, cur: Any, run_id: str, engine: str, items: Sequence[Item], *, close: bool,
                check: bool = True) -> list[int]:
        """In a `_raw_txn`: `items` given the run's next offsets (those already stored skipped, unless `check` is
        false: the caller knows they are new), the stream row created or updated, the oldest events dropped past the
        limits."""
        lock = ' FOR UPDATE' if self._backend.is_pg else ''
        select = f'SELECT next_offset, event_count, bytes FROM durcap_run_streams WHERE run_id = :r{lock}'
        row = cur.execute(select, {'r': run_id}).fetchone()
        if row is None:
            cur.execute(
                'INSERT INTO durcap_run_streams (run_id, engine, next_offset, first_offset, event_count, bytes, '
                'dropped, started_at, closed_at, writer) VALUES (:r, :e, 1, 1, 0, 0, 0, :at, NULL, :w) '
                'ON CONFLICT (run_id) DO NOTHING', {'r': run_id, 'e': engine, 'at': _now(), 'w': 'durable-capabilities'})
            row = cur.execute(select, {'r': run_id}).fetchone()
        next_offset, count, size = int(row[0]), int(row[1]), int(row[2])
        offsets: list[int] = []
        now = _now()
        rows = []
        fresh = self._new(cur, run_id, items) if check else items
        for item in fresh:
            body = to_json(item.body, fallback=repr).decode()
            rows.append({'r': run_id, 'o': next_offset, 'u': item.unit, 'a': item.attempt, 's': item.seq,
                         'k': item.kind, 'b': body, 'at': now})
            offsets.append(next_offset)
            next_offset, count, size = next_offset + 1, count + 1, size + len(body)
        if rows:
            cur.executemany(
                'INSERT INTO durcap_run_events (run_id, event_offset, unit, attempt, seq, kind, body, created_at) '
                'VALUES (:r, :o, :u, :a, :s, :k, :b, :at)', rows)
        cur.execute('UPDATE durcap_run_streams SET next_offset = :n, event_count = :c, bytes = :b'
                    + (', closed_at = COALESCE(closed_at, :at)' if close else '') + ' WHERE run_id = :r',
                    {'n': next_offset, 'c': count, 'b': size, 'r': run_id, **({'at': now} if close else {})})
        if count > self.limits.max_events or size > self.limits.max_bytes:
            self._trim(cur, run_id, count, size)
        if run_id in _WAITERS:  # a subscriber in this process: it is handed these rows once they are committed
            staged = getattr(_STAGING, 'staged', None)
            if staged is not None:
                staged.append((run_id, [(r['o'], r['u'], r['a'], r['s'], r['k'], r['b'], r['at'], body_shape(item.body))
                                        for r, item in zip(rows, fresh, strict=True)], close))
        return offsets

    _last_prune: float = 0.0

    def _maybe_prune(self, *, in_thread: bool = False) -> None:
        """`prune_sync`, at most once a minute per process and store (it scans the closed streams); `in_thread`: in
        one of `_EXECUTOR`'s threads, not waited for (the caller is an event loop)."""
        now = time.monotonic()
        if now - EventLog._last_prune >= PRUNE_EVERY_SECONDS or self.limits.retention_seconds < PRUNE_EVERY_SECONDS:
            EventLog._last_prune = now
            if in_thread:
                _EXECUTOR.submit(self.prune_sync)
            else:
                self.prune_sync()

    def _new(self, cur: Any, run_id: str, items: Sequence[Item]) -> list[Item]:
        """The items whose `(unit, attempt, seq)` is not stored yet (and not repeated within `items`)."""
        if not items:
            return []
        keys = {(i.unit, i.attempt) for i in items}
        stored: set[tuple[str, int, int]] = set()
        for unit, attempt in keys:
            seqs = [i.seq for i in items if (i.unit, i.attempt) == (unit, attempt)]
            rows = cur.execute('SELECT seq FROM durcap_run_events WHERE run_id = :r AND unit = :u AND attempt = :a '
                               'AND seq >= :lo AND seq <= :hi',
                               {'r': run_id, 'u': unit, 'a': attempt, 'lo': min(seqs), 'hi': max(seqs)}).fetchall()
            stored.update((unit, attempt, int(r[0])) for r in rows)
        fresh: list[Item] = []
        for item in items:
            key = (item.unit, item.attempt, item.seq)
            if key not in stored:
                stored.add(key)
                fresh.append(item)
        return fresh

    def _trim(self, cur: Any, run_id: str, count: int, size: int) -> None:
        """Drop the oldest events until the stream is within its limits."""
        dropped = 0
        rows = cur.execute('SELECT event_offset, LENGTH(body) FROM durcap_run_events WHERE run_id = :r '
                           'ORDER BY event_offset', {'r': run_id}).fetchall()
        cut = None
        for offset, length in rows:
            if count <= self.limits.max_events and size <= self.limits.max_bytes:
                break
            cut, count, size, dropped = int(offset), count - 1, size - int(length), dropped + 1
        if cut is None:
            return
        cur.execute('DELETE FROM durcap_run_events WHERE run_id = :r AND event_offset <= :o', {'r': run_id, 'o': cut})
        cur.execute('UPDATE durcap_run_streams SET first_offset = :f, event_count = :c, bytes = :b, '
                    'dropped = dropped + :d WHERE run_id = :r',
                    {'f': cut + 1, 'c': count, 'b': size, 'd': dropped, 'r': run_id})

    def next_attempt_sync(self, run_id: str, unit: str) -> tuple[int, list[int]]:
        """`(attempt, earlier attempts that published events)` for a new execution of `unit` in `run_id`."""
        with self._backend._txn(write=False) as conn:
            rows = conn.execute(sa.text('SELECT DISTINCT attempt FROM durcap_run_events WHERE run_id = :r AND unit = :u'),
                                {'r': run_id, 'u': unit}).all()
        earlier = sorted(int(r[0]) for r in rows)
        return (max(earlier) + 1 if earlier else 1), earlier

    def prune_sync(self) -> int:
        """Delete the streams closed longer than the retention ago; returns how many."""
        cutoff = (datetime.now(UTC) - timedelta(seconds=self.limits.retention_seconds)).isoformat()
        with self._backend._txn(write=True) as conn:
            runs = [r[0] for r in conn.execute(sa.text('SELECT run_id FROM durcap_run_streams WHERE closed_at IS NOT '
                                                       'NULL AND closed_at < :c'), {'c': cutoff})]
            for run_id in runs:
                conn.execute(sa.text('DELETE FROM durcap_run_events WHERE run_id = :r'), {'r': run_id})
                conn.execute(sa.text('DELETE FROM durcap_run_streams WHERE run_id = :r'), {'r': run_id})
        return len(runs)

    def submit(self, run_id: str, job: Callable[[Any], T], *, close: bool = False, flush: bool = True) -> Future[T]:
        """`job(cursor)` (`append_in`, `append_unit_in`, on an open transaction's cursor) in this store's writer thread,
        after every write submitted before it in this process, in one transaction with those queued with it
        (`_Writer`); its result (or error) in the future, set once committed. `close`: the write closes `run_id`'s
        stream (expired streams are pruned after it). `flush=False`: the write needs no disk flush (a local run's:
        its commit is relaxed unless a write committed with it needs one)."""
        return _writer(self).submit(run_id, close, job, flush)

    async def append(self, run_id: str, engine: str, items: Sequence[Item], *, close: bool = False) -> list[int]:
        """`append_sync` in this store's writer thread (`submit`), awaited."""
        return await asyncio.wrap_future(self.submit(
            run_id, lambda cur: self.append_in(cur, run_id, engine, items, close=close), close=close))

    # ---- reading ------------------------------------------------------------------------------

    def info_sync(self, run_id: str) -> StreamInfo | None:
        """The run's stream row, `None` when the run has published nothing (yet)."""
        with self._backend._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT run_id, engine, next_offset, first_offset, event_count, bytes, dropped, '
                                       'started_at, closed_at FROM durcap_run_streams WHERE run_id = :r'),
                               {'r': run_id}).first()
        return None if row is None else StreamInfo(*row)

    def poll_sync(self, run_id: str, after: int, limit: int = 500, *,
                  quick: bool = False) -> tuple[list[StoredEvent], StreamInfo | None]:
        """`read_sync` and `info_sync` in one statement straight to the driver (one trip to a worker thread for a
        subscriber, none with `quick`): the stream's row joined with its events after `after`, both from one snapshot
        (a stream the row shows closed holds no event after the last one read, unless past `limit`). `quick`: on the
        calling thread (an event loop's), never waiting (`_SQLBackend._quick_txn`; `_WouldWait` when it would, or on
        PostgreSQL)."""
        backend = self._backend
        with (backend._quick_txn(write=False) if quick else backend._raw_txn(write=False)) as cur:
            rows = cur.execute(_POLL, {'r': run_id, 'o': after, 'n': limit}).fetchall()
        if not rows:
            return [], None
        events = [StoredEvent(int(o), u, int(a), int(s), k, json.loads(b), str(c), b)
                  for *_, o, u, a, s, k, b, c in rows if o is not None]
        return events, StreamInfo(*rows[0][:9])

    def read_sync(self, run_id: str, after: int, limit: int = 500) -> list[StoredEvent]:
        """Up to `limit` events of `run_id` with offsets above `after`, in offset order."""
        with self._backend._txn(write=False) as conn:
            rows = conn.execute(sa.text('SELECT event_offset, unit, attempt, seq, kind, body, created_at FROM '
                                        'durcap_run_events WHERE run_id = :r AND event_offset > :o ORDER BY event_offset '
                                        'LIMIT :n'), {'r': run_id, 'o': after, 'n': limit}).all()
        return [StoredEvent(int(o), u, int(a), int(s), k, json.loads(b), str(c)) for o, u, a, s, k, b, c in rows]
