"""DBOS workers that watch each other: each `durcap worker dbos` records a heartbeat in the system database, and a
worker that finds a peer silent past a timeout recovers that peer's pending workflows through DBOS's own recovery.

Self-hosted DBOS notices nothing when an executor dies: its PENDING workflows wait until a process with the same
executor id launches again (DBOS Conductor does this for DBOS's hosted users; issue 29 measured 20 runs stuck under
a SIGKILLed worker's id). Here:

- Every worker upserts a row of `durcap_dbos_executors` (executor id, queue, host, pid, last heartbeat by the
  database's clock) every `HEARTBEAT_SECONDS`, and deletes it when it stops cleanly.
- Every worker, after each heartbeat, looks for rows older than its peer timeout (`--peer-timeout`, default
  `DEFAULT_PEER_TIMEOUT`). It claims one by deleting it (`DELETE ... WHERE executor_id = X AND last_seen < cutoff`:
  one transaction, so of two survivors noticing at once exactly one deletes the row) and then asks DBOS to recover
  executor X's pending workflows (`_upstream.dbos_recover_pending_workflows`). DBOS re-enqueues each on its internal
  queue, whose ENQUEUED -> PENDING hand-off admits one runner, so even a recovery asked twice runs each workflow once;
  any worker of the same application version may take them.
- A worker restarted with the dead executor's id upserts the row again, and DBOS's launch recovers its own pending
  workflows as before.
- A worker stopped with SIGTERM keeps beating while DBOS drains (`--graceful-shutdown`), then deletes its row if none
  of its workflows is left PENDING; otherwise the row goes stale and a peer recovers what the drain left (a pod's
  executor id is never launched again).

Executor ids must differ between live workers for this to work (two workers sharing `local` keep one row fresh
between them): `durcap worker dbos --executor-id` (e.g. the pod name). A worker's own `durcap run` one-shot executors
never beat, so they are left to `durcap runs resume`, as before.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from ... import _upstream
from .._process import pid_alive
from ._schema import ensure_table

TABLE = 'durcap_dbos_executors'
"""The heartbeat table, in the DBOS system database (the one thing every worker of an application shares)."""

HEARTBEAT_SECONDS = 2.0
"""Seconds between a worker's heartbeats (and its look for silent peers)."""

DEFAULT_PEER_TIMEOUT = 15.0
"""Seconds without a heartbeat after which a peer counts as dead and its pending workflows are recovered. Longer than
a few missed heartbeats (a busy machine, a database failover), short enough for issue 29's 30 s bound."""

_METADATA = sa.MetaData()
_EXECUTORS = sa.Table(
    TABLE, _METADATA,
    sa.Column('executor_id', sa.String(255), primary_key=True),
    sa.Column('queue', sa.String(255), nullable=False),
    sa.Column('host', sa.String(255), nullable=False),
    sa.Column('pid', sa.Integer, nullable=False),
    sa.Column('last_seen', sa.Float, nullable=False),  # seconds since the epoch, the database's clock
)


def _now(dialect: str) -> Any:
    """The database's clock in epoch seconds (hosts' clocks may disagree; the database's is one clock)."""
    if dialect == 'sqlite':
        return sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)")
    return sa.literal_column('EXTRACT(EPOCH FROM clock_timestamp())')


class Peers:
    """One worker's heartbeat and its watch over its peers, on the system database at `url`.

    Args:
        url: The DBOS system database URL (SQLite or PostgreSQL).
        executor_id: This worker's executor id.
        queue: The queue it serves (shown to operators).
        timeout: Seconds of silence after which a peer's pending workflows are recovered (> 0).
        notify: Where a recovery is reported (one line each).
        recover: `executor ids -> recovered workflow ids` (default: DBOS's own recovery, in this launched process).

    Raises:
        ValueError: `timeout` is not above 0.
    """

    def __init__(self, url: str, executor_id: str, queue: str, timeout: float, notify: Callable[[str], None],
                 recover: Callable[[list[str]], list[str]] | None = None):
        if not timeout > 0:
            raise ValueError(f'peer timeout must be above 0 seconds, not {timeout!r}')
        self.engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://', 1)
                                       if url.startswith('postgresql://') else url)
        self.executor_id, self.queue, self.timeout, self.notify = executor_id, queue, timeout, notify
        self.recover = recover or _upstream.dbos_recover_pending_workflows
        self.now = _now(self.engine.dialect.name)
        ensure_table(self.engine, _EXECUTORS)  # several workers starting at once on one database

    def shared_with(self) -> str | None:
        """Another live process beating as this executor id (`'pid P on HOST'`), or `None`: two workers with one
        executor id keep one row fresh between them, so neither's death would be noticed.

        A row beaten within the timeout by a process of this host that is gone (a worker SIGKILLed and restarted at
        once, as its id) is not another live worker: `None`. A process of another host is taken as alive while its
        row is fresh (its pid cannot be asked from here)."""
        age = (self.now - _EXECUTORS.c.last_seen).label('age')
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(_EXECUTORS.c.host, _EXECUTORS.c.pid, age).where(
                _EXECUTORS.c.executor_id == self.executor_id)).first()
        if row is None or float(row[2]) > self.timeout or (row[0], row[1]) == (socket.gethostname(), os.getpid()):
            return None
        if row[0] == socket.gethostname() and not pid_alive(int(row[1])):
            return None
        return f'pid {row[1]} on {row[0]}'

    def beat(self) -> None:
        """Record this worker as alive now (insert or refresh its row)."""
        with self.engine.begin() as conn:
            updated = conn.execute(_EXECUTORS.update().where(_EXECUTORS.c.executor_id == self.executor_id).values(
                queue=self.queue, host=socket.gethostname(), pid=os.getpid(), last_seen=self.now)).rowcount
            if not updated:
                conn.execute(_EXECUTORS.insert().from_select(
                    ['executor_id', 'queue', 'host', 'pid', 'last_seen'],
                    sa.select(sa.literal(self.executor_id), sa.literal(self.queue), sa.literal(socket.gethostname()),
                              sa.literal(os.getpid()), self.now)))

    def silent(self) -> list[tuple[str, float]]:
        """`(executor id, seconds since its last heartbeat)` of every other executor silent past the timeout."""
        age = (self.now - _EXECUTORS.c.last_seen).label('age')
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(_EXECUTORS.c.executor_id, age).where(
                _EXECUTORS.c.executor_id != self.executor_id, age > self.timeout)).all()
        return [(row[0], float(row[1])) for row in rows]

    def claim(self, executor_id: str) -> bool:
        """Take the silent `executor_id` for recovery: `True` for exactly one of the workers that ask at once (the one
        whose delete found the stale row); `False` when another took it or it beat again meanwhile."""
        with self.engine.begin() as conn:
            return conn.execute(_EXECUTORS.delete().where(
                _EXECUTORS.c.executor_id == executor_id,
                (self.now - _EXECUTORS.c.last_seen) > self.timeout)).rowcount == 1

    def check(self) -> list[tuple[str, list[str]]]:
        """One round: heartbeat, then recover every silent peer this worker claims. Returns `(executor id, recovered
        workflow ids)` per recovered peer."""
        self.beat()
        done = []
        for executor_id, age in self.silent():
            if self.claim(executor_id):
                workflows = self.recover([executor_id])
                self.notify(f'dbos worker {self.executor_id!r}: executor {executor_id!r} silent for {age:.0f} s '
                            f'(peer timeout {self.timeout:g} s): recovering its {len(workflows)} pending workflows '
                            'through DBOS')
                done.append((executor_id, workflows))
        return done

    def watch(self, stop: threading.Event) -> None:
        """`check()` every `HEARTBEAT_SECONDS` until `stop` is set; a database error is reported and retried (a
        heartbeat missed is not a failure of the worker)."""
        while not stop.is_set():
            try:
                self.check()
            except Exception as exc:  # noqa: BLE001 - report, keep beating: the database may be back next round
                self.notify(f'dbos worker {self.executor_id!r}: heartbeat failed ({type(exc).__name__}: '
                            f'{str(exc).splitlines()[0][:160] if str(exc) else ""}); trying again')
            stop.wait(HEARTBEAT_SECONDS)

    def leave(self) -> None:
        """Delete this worker's row (a clean stop: nothing to recover), and close the connections."""
        try:
            with self.engine.begin() as conn:
                conn.execute(_EXECUTORS.delete().where(_EXECUTORS.c.executor_id == self.executor_id))
        finally:
            self.close()

    def close(self) -> None:
        """Close the connections and keep this worker's row: it goes stale, and a peer recovers this executor's
        pending workflows after the timeout (a stop that left workflows unfinished)."""
        self.engine.dispose()


def live_executors(url: str) -> list[dict[str, Any]]:
    """The executors with a heartbeat row in the system database at `url`: `{'executor_id', 'queue', 'host', 'pid',
    'age'}` (age in seconds), newest first; `[]` when no worker ever beat there."""
    engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://', 1)
                              if url.startswith('postgresql://') else url)
    try:
        if not sa.inspect(engine).has_table(TABLE):
            return []
        age = (_now(engine.dialect.name) - _EXECUTORS.c.last_seen).label('age')
        with engine.connect() as conn:
            rows = conn.execute(sa.select(_EXECUTORS.c.executor_id, _EXECUTORS.c.queue, _EXECUTORS.c.host,
                                          _EXECUTORS.c.pid, age).order_by(age)).all()
        return [{'executor_id': r[0], 'queue': r[1], 'host': r[2], 'pid': r[3], 'age': float(r[4])} for r in rows]
    finally:
        engine.dispose()
