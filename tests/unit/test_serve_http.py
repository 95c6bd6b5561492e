"""`durcap serve`'s HTTP protocol (`serve._http`) sends each response's head in one socket write with the body that
follows it: a turn's 202 is one write, the event stream of a stored run (head, every event, the chunked body's end)
is one write; a stream whose first event is not stored yet still gets its head at once. A real uvicorn server (the
protocol class `durcap serve` gives it, in a thread of this process) and a real httpx client over loopback TCP, the
local engine on a SQLite store; model: tests/engines/stream_agent.py's scripted `FunctionModel`. The transport each
connection gets is wrapped to record the socket writes (the real one still sends them)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

AUTH = {'Authorization': 'Bearer s3cret'}


class _Recorded:
    """A connection's real transport, its writes recorded in `writes` (then sent)."""

    def __init__(self, transport: Any, writes: list[bytes]) -> None:
        self.transport, self.writes = transport, writes

    def write(self, data: Any) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[bytes], str]]:
    """`(base URL, socket writes so far, store URL)` of a uvicorn server running `create_app` with `durcap serve`'s
    protocol class."""
    import uvicorn

    from durable_capabilities.serve import _http, bearer_auth, create_app
    from tests.engines.stream_agent import agent

    monkeypatch.setenv('DURCAP_STREAM_DELAY', '0')
    writes: list[bytes] = []
    real = _http.HeadJoinedTransport.__init__

    def recorded(self: Any, transport: Any, loop: Any) -> None:
        real(self, _Recorded(transport, writes), loop)

    monkeypatch.setattr(_http.HeadJoinedTransport, '__init__', recorded)
    store = f'sqlite:///{tmp_path / "serve.db"}'
    with socket.socket() as probe:
        probe.bind(('127.0.0.1', 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(agent, settings={'store': store}, auth=bearer_auth('s3cret')),
                                           host='127.0.0.1', port=port, log_level='warning', access_log=False,
                                           http=_http.protocol_class()))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, 'uvicorn did not start'
        time.sleep(0.01)
    try:
        yield f'http://127.0.0.1:{port}', writes, store
    finally:
        server.should_exit = True
        thread.join(30)


def test_a_turns_answer_and_a_stored_runs_stream_are_one_write_each(served: tuple[str, list[bytes], str]) -> None:
    import httpx
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    # the serve extra's httptools (uvicorn's h11 protocol ends a chunked body in a write of its own; heads join there too)
    assert issubclass(AutoHTTPProtocol, HttpToolsProtocol)
    url, writes, _ = served
    with httpx.Client(base_url=url, timeout=60) as client:
        posted = client.post(f'/v1/conversations/c-{uuid.uuid4().hex}/turns', json={'prompt': 'where is ABC-123?'},
                             headers=AUTH)
        assert posted.status_code == 202, posted.text
        assert len(writes) == 1  # the head and the JSON body together
        assert writes[0].startswith(b'HTTP/1.1 202 ') and writes[0].endswith(posted.content)
        events = posted.json()['events_url']
        with client.stream('GET', events, headers=AUTH) as response:
            live = response.read().decode()
        assert live.rstrip('\n').split('\n')[-2] == 'event: run_completed'
        del writes[:]
        again = client.get(events, headers=AUTH)  # the run's whole stream is stored: its first read has it all
        assert again.status_code == 200 and again.headers['content-type'] == 'text/event-stream; charset=utf-8'
        assert again.text == live  # the same bytes as the live stream's, in one write
        assert len(writes) == 1
        assert writes[0].startswith(b'HTTP/1.1 200 ') and writes[0].endswith(b'0\r\n\r\n')


def test_a_stream_whose_first_event_is_not_stored_gets_its_head_at_once(served: tuple[str, list[bytes], str]) -> None:
    import httpx

    from durable_capabilities.conversations import process_store

    url, writes, store = served
    conversation = f'c-{uuid.uuid4().hex}'
    backend = process_store(store)
    with httpx.Client(base_url=url, timeout=60) as client:
        first = client.post(f'/v1/conversations/{conversation}/turns', json={'prompt': 'where is ABC-123?'},
                            headers=AUTH)
        with client.stream('GET', first.json()['events_url'], headers=AUTH) as response:
            response.read()
        assert backend._sql.claim_turn(conversation, 'other-run') is None  # another run's turn holds it: the next waits
        queued = client.post(f'/v1/conversations/{conversation}/turns',
                             json={'prompt': 'where is ABC-123?', 'busy': 'enqueue'}, headers=AUTH)
        run_id = queued.json()['run_id']
        with client.stream('GET', queued.json()['events_url'], headers=AUTH) as response:
            assert response.status_code == 200  # the head came while the run waits, before any of its events
            assert client.get(f'/v1/runs/{run_id}', headers=AUTH).json()['status'] == 'queued'
            assert writes[-1].startswith(b'HTTP/1.1 200 ') and writes[-1].endswith(b'}')  # that answer: one write
            backend._sql.release_turn(conversation, 'other-run')
            text = response.read().decode()
        assert text.startswith('retry: 1000\n\nid: 1\n') and 'event: run_completed' in text
