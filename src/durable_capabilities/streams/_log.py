"""The run event log in the conversation store: `durcap_run_streams` (one row per run) and `durcap_run_events`.

Why the store (measured choice, for local, DBOS and Prefect alike): the durable units already write to it, every
process that can run or read a run can reach it, offsets can be assigned in the writer's transaction, and a unique
`(run, unit, attempt, seq)` key makes a re-sent or replayed event a no-op. DBOS's own streams are keyed by workflow
and would need a second mechanism for Prefect and local runs.

Writes are synchronous SQL (the store's own backend and its transactions: SQLite `BEGIN IMMEDIATE`, PostgreSQL a row
lock on the run's stream row); the async API runs them in a worker thread. They are relaxed (`_SQLBackend._txn(
relaxed=True)`, as the budget ledger's): a commit survives a crash of any process, not an OS crash or a power loss
(SQLite `synchronous=NORMAL` in WAL mode: no disk flush per commit; PostgreSQL `synchronous_commit = off`). A stream
is a view of a run whose record is the engine's own (history, steps, task runs) and the conversation's stored turns,
which keep their flushed commits; a flush per event batch held SQLite's one write lock for ~3-11 ms on this machine's
disk, twice per model request, and every run of a worker's store queued behind it (`bench/bench_throughput.py`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import sqlalchemy as sa
from pydantic_core import to_json

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
            ValueError: a variable is not a positive number (the message names it).
        """
        def read(name: str, default: float) -> float:
            raw = os.environ.get(name)
            if not raw:
                return default
            try:
                value = float(raw)
            except ValueError:
                value = -1
            if value <= 0:
                raise ValueError(f'{name}={raw!r}: expected a positive number')
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
    """One stored event row."""

    offset: int
    unit: str
    attempt: int
    seq: int
    kind: str
    body: dict[str, Any]
    created_at: str


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


def _now() -> str:
    return datetime.now(UTC).isoformat()


# The statements of the write path, built once (a `text()` parses its bind parameters when built).
_ATTEMPTS = sa.text('SELECT DISTINCT attempt FROM durcap_run_events WHERE run_id = :r AND unit = :u')
_STREAM_ROW = sa.text('SELECT next_offset, event_count, bytes FROM durcap_run_streams WHERE run_id = :r')
_STREAM_ROW_LOCKED = sa.text('SELECT next_offset, event_count, bytes FROM durcap_run_streams WHERE run_id = :r FOR UPDATE')
_NEW_STREAM = sa.text(
    'INSERT INTO durcap_run_streams (run_id, engine, next_offset, first_offset, event_count, bytes, dropped, started_at, '
    'closed_at, writer) VALUES (:r, :e, 1, 1, 0, 0, 0, :at, NULL, :w)')
_INSERT_EVENTS = sa.text('INSERT INTO durcap_run_events (run_id, event_offset, unit, attempt, seq, kind, body, created_at) '
                         'VALUES (:r, :o, :u, :a, :s, :k, :b, :at)')
_UPDATE_STREAM = sa.text('UPDATE durcap_run_streams SET next_offset = :n, event_count = :c, bytes = :b WHERE run_id = :r')
_CLOSE_STREAM = sa.text('UPDATE durcap_run_streams SET next_offset = :n, event_count = :c, bytes = :b, '
                        'closed_at = COALESCE(closed_at, :at) WHERE run_id = :r')
_STORED_SEQS = sa.text('SELECT seq FROM durcap_run_events WHERE run_id = :r AND unit = :u AND attempt = :a AND seq >= :lo '
                       'AND seq <= :hi')


def _distinct(items: Sequence[Item]) -> list[Item]:
    """`items` without a repeated `(unit, attempt, seq)` (the first kept)."""
    seen: set[tuple[str, int, int]] = set()
    kept = []
    for item in items:
        key = (item.unit, item.attempt, item.seq)
        if key not in seen:
            seen.add(key)
            kept.append(item)
    return kept


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
        with self._backend._txn(write=True, relaxed=True) as conn:
            offsets = self._append(conn, run_id, engine, items, close=close)
        if close:
            self._maybe_prune()
        return offsets

    def append_unit_sync(self, run_id: str, engine: str, unit: str, entries: Sequence[tuple[int, str, dict[str, Any]]],
                         attempt: int | None, *, at_least: int | None = None) -> int:
        """Store `entries` (`(seq, kind, body)`) of one execution of `unit`; `attempt=None` for its first batch: the
        execution's attempt is then claimed in the same transaction (one more than the unit's last, and at least
        `at_least`: the engine's own attempt number, a Temporal activity's), after a `retry` event (seq -1) naming
        the earlier attempts when there are any. Returns the attempt.

        The attempt is the caller's own (it claimed it here, where no other writer can claim the same number), and
        the caller sends each seq once, in order: the entries are stored without looking for stored ones (which
        `append_sync` does for a re-sent batch)."""
        with self._backend._txn(write=True, relaxed=True) as conn:
            items: list[Item] = []
            if attempt is None:
                rows = conn.execute(_ATTEMPTS, {'r': run_id, 'u': unit}).all()
                earlier = sorted(int(r[0]) for r in rows)
                attempt = max(max(earlier) + 1 if earlier else 1, at_least or 1)
                if earlier:
                    items.append(Item(unit, attempt, -1, 'retry', {'data': {'discard_attempts': earlier}}))
            items += [Item(unit, attempt, seq, kind, body) for seq, kind, body in entries]
            self._append(conn, run_id, engine, items, close=False, new=True)
        return attempt

    def _append(self, conn: sa.Connection, run_id: str, engine: str, items: Sequence[Item], *, close: bool,
                new: bool = False) -> list[int]:
        """Store `items` in the open transaction; `new`: none of them can be stored already (see
        `append_unit_sync`)."""
        row = conn.execute(_STREAM_ROW_LOCKED if self._backend.is_pg else _STREAM_ROW, {'r': run_id}).first()
        if row is None:
            conn.execute(_NEW_STREAM, {'r': run_id, 'e': engine, 'at': _now(), 'w': 'durable-capabilities'})
            next_offset, count, size = 1, 0, 0
        else:
            next_offset, count, size = int(row[0]), int(row[1]), int(row[2])
        offsets: list[int] = []
        now = _now()
        rows = []
        for item in (_distinct(items) if new else self._new(conn, run_id, items)):
            body = to_json(item.body, fallback=repr).decode()
            rows.append({'r': run_id, 'o': next_offset, 'u': item.unit, 'a': item.attempt, 's': item.seq,
                         'k': item.kind, 'b': body, 'at': now})
            offsets.append(next_offset)
            next_offset, count, size = next_offset + 1, count + 1, size + len(body)
        if rows:
            conn.execute(_INSERT_EVENTS, rows)
        conn.execute(_CLOSE_STREAM if close else _UPDATE_STREAM,
                     {'n': next_offset, 'c': count, 'b': size, 'r': run_id, **({'at': now} if close else {})})
        if count > self.limits.max_events or size > self.limits.max_bytes:
            self._trim(conn, run_id, count, size)
        return offsets

    _last_prune: float = 0.0

    def _maybe_prune(self) -> None:
        """`prune_sync`, at most once a minute per process and store (it scans the closed streams)."""
        now = time.monotonic()
        if now - EventLog._last_prune >= PRUNE_EVERY_SECONDS or self.limits.retention_seconds < PRUNE_EVERY_SECONDS:
            EventLog._last_prune = now
            self.prune_sync()

    def _new(self, conn: sa.Connection, run_id: str, items: Sequence[Item]) -> list[Item]:
        """The items whose `(unit, attempt, seq)` is not stored yet (and not repeated within `items`)."""
        if not items:
            return []
        keys = {(i.unit, i.attempt) for i in items}
        stored: set[tuple[str, int, int]] = set()
        for unit, attempt in keys:
            seqs = [i.seq for i in items if (i.unit, i.attempt) == (unit, attempt)]
            rows = conn.execute(_STORED_SEQS, {'r': run_id, 'u': unit, 'a': attempt, 'lo': min(seqs), 'hi': max(seqs)})
            stored.update((unit, attempt, int(r[0])) for r in rows)
        fresh: list[Item] = []
        for item in items:
            key = (item.unit, item.attempt, item.seq)
            if key not in stored:
                stored.add(key)
                fresh.append(item)
        return fresh

    def _trim(self, conn: sa.Connection, run_id: str, count: int, size: int) -> None:
        """Drop the oldest events until the stream is within its limits."""
        dropped = 0
        rows = conn.execute(sa.text('SELECT event_offset, LENGTH(body) FROM durcap_run_events WHERE run_id = :r '
                                    'ORDER BY event_offset'), {'r': run_id}).all()
        cut = None
        for offset, length in rows:
            if count <= self.limits.max_events and size <= self.limits.max_bytes:
                break
            cut, count, size, dropped = int(offset), count - 1, size - int(length), dropped + 1
        if cut is None:
            return
        conn.execute(sa.text('DELETE FROM durcap_run_events WHERE run_id = :r AND event_offset <= :o'),
                     {'r': run_id, 'o': cut})
        conn.execute(sa.text('UPDATE durcap_run_streams SET first_offset = :f, event_count = :c, bytes = :b, '
                             'dropped = dropped + :d WHERE run_id = :r'),
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

    async def append(self, run_id: str, engine: str, items: Sequence[Item], *, close: bool = False) -> list[int]:
        """`append_sync` in a worker thread."""
        return await in_thread(self.append_sync, run_id, engine, items, close=close)

    # ---- reading ------------------------------------------------------------------------------

    def info_sync(self, run_id: str) -> StreamInfo | None:
        """The run's stream row, `None` when the run has published nothing (yet)."""
        with self._backend._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT run_id, engine, next_offset, first_offset, event_count, bytes, dropped, '
                                       'started_at, closed_at FROM durcap_run_streams WHERE run_id = :r'),
                               {'r': run_id}).first()
        return None if row is None else StreamInfo(*row)

    def read_sync(self, run_id: str, after: int, limit: int = 500) -> list[StoredEvent]:
        """Up to `limit` events of `run_id` with offsets above `after`, in offset order."""
        with self._backend._txn(write=False) as conn:
            rows = conn.execute(sa.text('SELECT event_offset, unit, attempt, seq, kind, body, created_at FROM '
                                        'durcap_run_events WHERE run_id = :r AND event_offset > :o ORDER BY event_offset '
                                        'LIMIT :n'), {'r': run_id, 'o': after, 'n': limit}).all()
        return [StoredEvent(int(o), u, int(a), int(s), k, json.loads(b), str(c)) for o, u, a, s, k, b, c in rows]
