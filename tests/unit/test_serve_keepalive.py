"""`durcap serve`'s event stream keeps an idle connection alive: a stream that wrote nothing for `keepalive_seconds`
gets an SSE comment line (`: keepalive`), which SSE clients skip, so that a proxy with an idle timeout does not cut
the stream of a run waiting for an approval or a worker; a stream that writes events gets none. The response class
(`serve._app._EventStream`) is driven over ASGI as uvicorn drives it, its rows from an async generator this test
releases (no model, no engine: what is under test is the response's writes)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from durable_capabilities.streams._log import StoredEvent


def _event(offset: int, kind: str) -> StoredEvent:
    return StoredEvent(offset=offset, unit='u', attempt=1, seq=offset, kind=kind, body={'kind': kind},
                       created_at='2026-12-06T00:00:00+00:00')


async def _drive(rows: Any, keepalive: float, until: Any) -> list[dict[str, Any]]:
    """Run the response; `until(sent)` is awaited with the list of messages sent so far (it releases the rows)."""
    from durable_capabilities.serve._app import _EventStream

    sent: list[dict[str, Any]] = []
    changed = asyncio.Event()
    never = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        changed.set()

    async def receive() -> dict[str, Any]:
        await never.wait()  # the client stays
        return {'type': 'http.disconnect'}

    response = asyncio.ensure_future(_EventStream('r-1', rows, keepalive)({'type': 'http'}, receive, send))
    await asyncio.wait_for(until(sent, changed), 30)
    await asyncio.wait_for(response, 30)
    return sent


def _bodies(sent: list[dict[str, Any]]) -> list[bytes]:
    return [m['body'] for m in sent if m['type'] == 'http.response.body']


def test_an_idle_stream_gets_keepalive_comments_then_its_events() -> None:
    release = asyncio.Event()

    async def rows() -> Any:
        await release.wait()
        yield [_event(1, 'run_started'), _event(2, 'run_completed')]

    async def until(sent: list[dict[str, Any]], changed: asyncio.Event) -> None:
        while _bodies(sent).count(b': keepalive\n\n') < 2:  # two intervals of silence: a comment each
            changed.clear()
            await changed.wait()
        release.set()

    sent = asyncio.run(_drive(rows(), 0.05, until))
    bodies = _bodies(sent)
    assert sent[0]['type'] == 'http.response.start' and sent[0]['status'] == 200
    # The reconnect delay comes with the first write, here the first comment (a run waiting for a worker sends no
    # event for a while: an EventSource that lost the stream then would reconnect after the browser's 3-5 s).
    assert bodies[:2] == [b'retry: 1000\n\n: keepalive\n\n', b': keepalive\n\n']
    last = bodies[-1].decode()
    assert last.startswith('id: 1\nevent: run_started\n') and 'event: run_completed' in last
    assert sum(body.count(b'retry:') for body in bodies) == 1
    assert sent[-1]['more_body'] is False  # the events' write ended the response: nothing written after it


def test_a_stream_that_writes_gets_no_comment_and_none_is_written_after_its_end() -> None:
    steps = [asyncio.Event() for _ in range(4)]

    async def rows() -> Any:
        for n, step in enumerate(steps, start=1):
            await step.wait()
            yield [_event(n, 'run_completed' if n == len(steps) else 'text_delta')]

    async def until(sent: list[dict[str, Any]], changed: asyncio.Event) -> None:
        for n, step in enumerate(steps, start=1):  # an event well within each interval (10 s): never idle for one
            step.set()
            while len(_bodies(sent)) < n:
                changed.clear()
                await changed.wait()

    sent = asyncio.run(_drive(rows(), 10.0, until))
    assert not any(b'keepalive' in body for body in _bodies(sent))
    assert len(_bodies(sent)) == 4 and sent[-1]['more_body'] is False
    assert _bodies(sent)[0].startswith(b'retry: 1000\n\nid: 1\n')  # with the first events: no write of its own
    assert sum(body.count(b'retry:') for body in _bodies(sent)) == 1


def test_keepalive_off_and_bad_values() -> None:
    from durable_capabilities.serve import bearer_auth, create_app
    from tests.engines.stream_agent import agent

    app = create_app(agent, settings={'store': 'sqlite:///:memory:'}, auth=bearer_auth('t'), keepalive_seconds=0)
    assert app.state.serve.keepalive_seconds == 0
    assert create_app(agent, settings={'store': 'sqlite:///:memory:'},
                      auth=bearer_auth('t')).state.serve.keepalive_seconds == 15.0
    for bad in (-1, float('nan')):
        with pytest.raises(ValueError, match='keepalive_seconds'):
            create_app(agent, settings={'store': 'sqlite:///:memory:'}, auth=bearer_auth('t'), keepalive_seconds=bad)
