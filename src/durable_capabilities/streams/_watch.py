"""Subscribing to a run's stream from any process: `watch`."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, get_args

from pydantic_core import to_json

from .._limits import InputError
from ..errors import NOT_FOUND_CODE, DurcapError
from ._events import TERMINAL_KINDS, EventKind, RunEvent, load_event
from ._log import EventLog, HandedEvent, Inbox, StoredEvent, body_shape, in_thread, subscribe, unsubscribe

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


_UTC_AT = re.compile(r'\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d{6})?\+00:00')
"""A stored `created_at` (`datetime.now(UTC).isoformat()`) that `RunEvent.at` dumps as itself with `Z` for `+00:00`."""

_KINDS = frozenset(get_args(EventKind))


def event_json(run_id: str, row: StoredEvent) -> str:
    """`to_run_event(run_id, row).model_dump_json()`, spliced from the row's stored JSON (`row.raw`) when it has it:
    no validation of pydantic-ai's event and no dump of it again (the stored body is that dump), a few microseconds
    instead of tens; through the model otherwise (a body of another shape, an older row, a `created_at` of another
    form). tests/unit/test_streams.py checks both give the same text for every event of a run.

    Raises:
        pydantic.ValidationError: as `to_run_event`, for a row that is no `RunEvent` (an unknown kind).
    """
    raw, at = row.raw, row.created_at
    if raw is not None and row.kind in _KINDS and _UTC_AT.fullmatch(at):
        head = (f'{{"run_id":{to_json(run_id).decode()},"offset":{row.offset},"unit":{to_json(row.unit).decode()},'
                f'"attempt":{row.attempt},"kind":"{row.kind}","at":"{at[:-6]}Z",')
        # a row handed over by a commit here knows its shape (its body is then never parsed), a read one is looked at
        shape = row.shape if type(row) is HandedEvent else body_shape(row.body)
        if shape == 'event+data':
            return head + raw[1:]
        if shape == 'event':
            return head + raw[1:-1] + ',"data":{}}'
        if shape == 'data':
            return head + '"event":null,' + raw[1:]
    return to_run_event(run_id, row).model_dump_json()


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
        StreamNotFoundError: nothing published for `run_id` within `wait_for_start` seconds (the message leads with
            DC044), or no store at a SQLite `store` URL.
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
    each once, the last list ending with the run's last event (for a consumer that sends them on together: one
    write per read, not one per event).

    Arguments and errors: as `watch`'s.

    Yields:
        Non-empty lists of `RunEvent`s.
    """
    async for rows in watch_rows(run_id, engine=engine, from_offset=from_offset, store=store, follow=follow,
                                 wait_for_start=wait_for_start, poll=poll):
        yield [to_run_event(run_id, row) for row in rows]


async def watch_rows(run_id: str, *, engine: str | None = None, from_offset: int = 0, store: str | None = None,
                     follow: bool = True, wait_for_start: float = 30.0,
                     poll: float = POLL_SECONDS) -> AsyncIterator[list[StoredEvent]]:
    """`watch_batches`'s events as the stored rows (`StoredEvent`, with `raw`: the body's JSON as stored), for a
    consumer that encodes them itself (`durcap serve`'s Server-Sent Events: `event_json`).

    Arguments and errors: as `watch`'s.

    Yields:
        Non-empty lists of `StoredEvent`s, in offset order, each once.
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
    # Between reads: the poll, cut short when this process commits an event of the run (`subscribe`: a run this
    # process runs, e.g. `durcap serve`'s local turns, is seen at once; one run elsewhere, at the next poll). A commit
    # in this process hands its rows over: when they follow the last event delivered, no read. A read is the new
    # events and the stream's row in one statement (`poll_sync`): on SQLite on this thread, never waiting; when it
    # would (or on PostgreSQL), one trip to a worker thread.
    inbox = subscribe(run_id)  # before the first read: no commit after it is missed
    after = from_offset
    try:
        rows, info = await _poll(log, run_id, after)
        while True:
            if engine is not None and info is not None and info.engine != engine:
                raise _other_engine(run_id, engine, info.engine)
            if info is None and not rows:
                if not follow or time.monotonic() > deadline:
                    waited = f' (waited {wait_for_start:g} s)' if follow else ''
                    raise StreamNotFoundError(f'{NOT_FOUND_CODE} run {run_id!r} has published no events to '
                                              f'{log._backend.display_url}{waited}; check the run id and --store')
                await inbox.wait(poll)
                inbox.take()
                rows, info = await _poll(log, run_id, after)
                continue
            batch: list[StoredEvent] = []
            for row in rows:
                after = row.offset
                batch.append(row)
                if row.kind in TERMINAL_KINDS:
                    yield batch
                    return
            if batch:
                yield batch
            if info is not None and after < info.next_offset - 1:
                rows, info = await _poll(log, run_id, after)  # past the read's limit: read on at once
                continue
            if not follow or (info is not None and info.closed_at is not None):
                return
            rows, info = await _next(log, inbox, after, poll)
    finally:
        unsubscribe(inbox)


async def _next(log: EventLog, inbox: Inbox, after: int, poll: float) -> tuple[list[StoredEvent], Any]:
    """The events after offset `after`: those this process's commits hand over (`Inbox`), when they follow `after`
    with no gap (`info` then `None`: not read), else a read of the store, at the first commit or after `poll`
    seconds (a commit of another process)."""
    while True:
        await inbox.wait(poll)
        handed, unknown, closed = inbox.take()
        rows = [row for row in handed if row.offset > after]
        if unknown or not handed or any(row.offset != after + 1 + i for i, row in enumerate(rows)):
            return await _poll(log, run_id=inbox.run_id, after=after)  # the poll's time, or rows not handed over
        if rows and (not closed or rows[-1].kind in TERMINAL_KINDS):
            return rows, None
        if closed:
            return await _poll(log, run_id=inbox.run_id, after=after)  # closed with no last event handed over: read
        # only rows already delivered (committed between the subscription and the read): wait on


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
