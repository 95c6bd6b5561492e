"""Subscribing to a run's stream from any process: `watch`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from .._limits import InputError
from ..errors import DurcapError
from ._events import TERMINAL_KINDS, RunEvent, load_event
from ._log import EventLog, StoredEvent, forget_waiter, in_thread, written_soon

POLL_SECONDS = 0.05
"""How often a subscriber reads the log for new events while the run is going."""

STREAM_ENGINES = ('local', 'dbos', 'prefect', 'temporal')
"""The engines whose runs publish to the store's event log."""


class StreamNotFoundError(DurcapError, LookupError, code='stream-not-found'):
    """No run with this id published to the store's event log within the wait."""


class StreamUnsupportedError(DurcapError, ValueError, code='stream-unsupported'):
    """The engine's runs publish no event stream (yet)."""


def to_run_event(run_id: str, row: StoredEvent) -> RunEvent:
    """The `RunEvent` of one stored row."""
    event = row.body.get('event')
    return RunEvent(run_id=run_id, offset=row.offset, unit=row.unit, attempt=row.attempt, kind=row.kind,  # type: ignore[arg-type]
                    at=row.created_at, event=load_event(event) if event is not None else None,  # type: ignore[arg-type]
                    data=row.body.get('data') or {})


async def watch(run_id: str, *, engine: str | None = None, from_offset: int = 0, store: str | None = None,
                follow: bool = True, wait_for_start: float = 30.0, poll: float = POLL_SECONDS) -> AsyncIterator[RunEvent]:
    """The events of run `run_id`, in offset order, each once: first those the store retains, then each new one
    as the run publishes it, until the run completes or fails (its `run_completed` / `run_failed` event is the last).

    Args:
        run_id: The run (workflow id, flow run id, `local-...`).
        engine: The engine it runs on (`local`, `dbos`, `prefect`, `temporal`; `None`: any of them); another
            name raises `StreamUnsupportedError`, and a run whose stream records another engine raises `InputError`.
        from_offset: The offset of the last event already seen: only later ones are delivered (0: from the start).
            A subscriber that reconnects with its last offset gets exactly the rest.
        store: The conversation store URL holding the stream (`None`: `$DURCAP_STORE`, else the default store).
        follow: Wait for new events until the run ends (`False`: return what is retained now).
        wait_for_start: Seconds to wait for a run that has published nothing yet.
        poll: Seconds between reads while waiting.

    Yields:
        `RunEvent`s.

    Raises:
        StreamNotFoundError: nothing published for `run_id` within `wait_for_start` seconds.
        StreamUnsupportedError: `engine` publishes no stream.
        InputError: DC040, `engine` is given and the run's stream records another engine (nothing is yielded).
        ValueError: `from_offset` is negative.
    """
    async for batch in watch_batches(run_id, engine=engine, from_offset=from_offset, store=store, follow=follow,
                                     wait_for_start=wait_for_start, poll=poll):
        for event in batch:
            yield event


async def watch_batches(run_id: str, *, engine: str | None = None, from_offset: int = 0, store: str | None = None,
                        follow: bool = True, wait_for_start: float = 30.0,
                        poll: float = POLL_SECONDS) -> AsyncIterator[list[RunEvent]]:
    """`watch`'s events as the store's reads return them: each read's new events as one list, in offset order,
    each once, the last list ending with the run's last event (for a consumer that sends them on together, as
    `durcap serve`'s Server-Sent Events do: one write to the client per read, not one per event).

    Arguments and errors: as `watch`'s.

    Yields:
        Non-empty lists of `RunEvent`s.
    """
    from ..store import resolve_url

    if engine is not None and engine not in STREAM_ENGINES:
        raise StreamUnsupportedError(f'--engine {engine}: runs on {engine} publish no event stream yet; watch a run of '
                                     f'{", ".join(STREAM_ENGINES)}')
    if from_offset < 0:
        raise ValueError(f'from_offset={from_offset}: expected the offset of the last event seen, 0 or more')
    url = resolve_url(store)
    deadline = time.monotonic() + wait_for_start
    if url.startswith('sqlite:///') and ':memory:' not in url:
        # A reader never creates a store (as `durcap history show`): wait for the run to create it.
        path = Path(url[len('sqlite:///'):].split('?', 1)[0])
        while not path.is_file():
            if not follow or time.monotonic() > deadline:
                waited = f' (waited {wait_for_start:g} s)' if follow else ''
                raise StreamNotFoundError(f'no conversation store at {path}{waited}: nothing was published there; '
                                          'check --store (the store the run writes to)')
            await asyncio.sleep(poll)
    log = EventLog(url)
    # Between reads: the poll, cut short when this process commits an event of the run (`written_soon`: a run this
    # process runs, e.g. `durcap serve`'s local turns, is seen at once; one run elsewhere, at the next poll). Each
    # read is the new events and the stream's row in one statement (`poll_sync`): on SQLite on this thread, never
    # waiting; when it would (or on PostgreSQL), one trip to a worker thread.
    waiter = written_soon(run_id)
    after = from_offset
    try:
        while True:
            rows, info = await _poll(log, run_id, after)
            if engine is not None and info is not None and info.engine != engine:
                raise _other_engine(run_id, engine, info.engine)
            if info is None and not rows:
                if not follow or time.monotonic() > deadline:
                    raise StreamNotFoundError(f'run {run_id!r} has published no events to {log._backend.display_url} '
                                              f'(waited {wait_for_start:g} s); check the run id and --store')
                waiter = await _next_write(run_id, waiter, poll)
                continue
            batch = []
            for row in rows:
                after = row.offset
                batch.append(to_run_event(run_id, row))
                if batch[-1].kind in TERMINAL_KINDS:
                    yield batch
                    return
            if batch:
                yield batch
            if info is not None and after < info.next_offset - 1:
                continue  # past the read's limit: read on at once
            if not follow:
                return
            if info is not None and info.closed_at is not None:
                return
            # Nothing more stored when it was read: wait (the waiter was registered before the read, so a commit since
            # wakes it at once), not read again at once (a read that would find nothing, once per batch).
            waiter = await _next_write(run_id, waiter, poll)
    finally:
        forget_waiter(run_id, waiter)


def _other_engine(run_id: str, asked: str, recorded: str) -> InputError:
    """DC040 for `--engine asked` on a run whose stream records engine `recorded`: its events are not that engine's run."""
    return InputError(f'--engine {asked}', (
        f'run {run_id!r} is a {recorded} run (its stream records engine {recorded!r}), not a {asked} one: nothing '
        f'printed. Fix: drop --engine, or pass --engine {recorded}'))


async def _poll(log: EventLog, run_id: str, after: int) -> tuple[list[StoredEvent], Any]:
    """`log.poll_sync(run_id, after)` on this thread when it never waits (SQLite), else in a worker thread."""
    from ..store._sql import _WouldWait

    try:
        return log.poll_sync(run_id, after, quick=True)
    except _WouldWait:
        return await in_thread(log.poll_sync, run_id, after)


async def _next_write(run_id: str, waiter: asyncio.Future[None], poll: float) -> asyncio.Future[None]:
    """Wait until `waiter` (a commit of the run in this process) or `poll` seconds; the waiter for the next read,
    registered before it."""
    if not waiter.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiter), poll)
    forget_waiter(run_id, waiter)
    return written_soon(run_id)
