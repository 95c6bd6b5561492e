"""`durcap serve` (issue 26): real `durcap serve` subprocesses, real HTTP (httpx), the local engine and DBOS (a real
`durcap worker dbos` on SQLite), the conversation store on SQLite.

Models: scripted `FunctionModel`s (tests/engines/serve_agents.py: `streamer` streams its answer word by word after a
tool call; `gated` calls `revoke_sessions`, which waits for a person's approval and records each execution).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from durable_capabilities.streams import RunEvent, answer_text
from tests._helpers import sql
from tests.engines._serve import ALICE, TARGET, Proc, read_sse, start, start_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('serve-dbos')]


@dataclass
class Stack:
    """A `durcap serve` on one engine (and, for DBOS, the worker running its turns), sharing one store."""

    url: str
    store: str
    env: dict[str, str]
    crash_dir: Path
    procs: list[Proc]
    tmp: Path


def _env(tmp: Path) -> tuple[dict[str, str], Path, str]:
    store = f'sqlite:///{tmp / "conversations.db"}'
    crash = tmp / 'crash'
    return ({'DURCAP_STORE': store, 'DURCAP_STREAM_DELAY': '0.02', 'DURCAP_CRASH_DIR': str(crash)}, crash, store)


@pytest.fixture(scope='module')
def dbos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp('serve-dbos')
    env, crash, store = _env(tmp)
    db = f'sqlite:///{tmp / "dbos.sqlite"}'
    env['DURCAP_DBOS_DB'] = db
    procs: list[Proc] = []
    try:
        worker = start(['worker', 'dbos', TARGET, '--db', db], tmp / 'worker.log', env)
        procs.append(worker)
        worker.wait_for('dbos worker ready', 120)
        server, url = start_server(tmp, 'serve-a', env, '--engine', 'dbos', '--db', db)
        procs.append(server)
        yield Stack(url, store, env, crash, procs, tmp)
    finally:
        for proc in procs:
            proc.kill9()


def _post(url: str, conversation: str, body: dict[str, Any], key: str | None = None,
          headers: dict[str, str] = ALICE) -> httpx.Response:
    return httpx.post(f'{url}/v1/conversations/{conversation}/turns', json=body, timeout=30,
                      headers={**headers, **({'Idempotency-Key': key} if key else {})})


async def _post_many(url: str, conversation: str, body: dict[str, Any], key: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return list(await asyncio.gather(*[
            client.post(f'{url}/v1/conversations/{conversation}/turns', json=body,
                        headers={**ALICE, 'Idempotency-Key': key}) for _ in range(n)]))


def _streamed_idempotent_turn(stack: Stack, conversation: str) -> None:
    """Three concurrent POSTs with one Idempotency-Key, then a fourth after the run: one run, one turn stored; the
    run's SSE stream (offsets as ids, in order) joins to the answer; Last-Event-ID resumes exactly after it."""
    from tests.engines.stream_agent import ANSWER

    body = {'agent': 'streamer', 'prompt': 'where is ABC-123?'}
    responses = asyncio.run(_post_many(stack.url, conversation, body, f'key-{conversation}', 3))
    assert [r.status_code for r in responses] == [202] * 3, [r.text for r in responses]
    answers = [r.json() for r in responses]
    run_id = answers[0]['run_id']
    assert {a['run_id'] for a in answers} == {run_id}
    assert sorted(a['created'] for a in answers) == [False, False, True]
    events = read_sse(stack.url + answers[0]['events_url'], ALICE)
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert [e.data['offset'] for e in events] == [e.id for e in events]
    assert events[0].kind == 'run_started' and events[-1].kind == 'run_completed'
    run_events = [RunEvent.model_validate(e.data) for e in events]
    assert sum(e.kind == 'text_delta' for e in run_events) > 10  # streamed, not one block
    assert answer_text(run_events) == ANSWER == events[-1].data['data']['output']
    middle = len(events) // 2
    rest = read_sse(stack.url + answers[0]['events_url'], ALICE, last_event_id=events[middle].id)
    assert rest == events[middle + 1:]
    again = _post(stack.url, conversation, body, key=f'key-{conversation}')
    assert again.status_code == 202 and again.json()['run_id'] == run_id and again.json()['created'] is False
    status = httpx.get(f'{stack.url}/v1/runs/{run_id}', headers=ALICE, timeout=30).json()
    assert status['status'] == 'completed' and status['report']['output'] == ANSWER
    stored = httpx.get(f'{stack.url}/v1/conversations/{conversation}', headers=ALICE, timeout=30).json()
    assert [w['operation'] for w in stored['writes']] == ['append'] and stored['message_count'] == 4
    assert sql(stack.store, 'SELECT COUNT(*) FROM durcap_serve_runs WHERE conversation_id = :c',
               {'c': conversation}) == [(1,)]


def test_local_turn_streamed_over_sse_and_one_run_per_idempotency_key(tmp_path: Path) -> None:
    """`durcap serve --engine local` (the turn runs in the serve process): see `_streamed_idempotent_turn`."""
    env, crash, store = _env(tmp_path)
    server, url = start_server(tmp_path, 'serve-local', env, '--engine', 'local')
    try:
        _streamed_idempotent_turn(Stack(url, store, env, crash, [server], tmp_path), 'local-1')
    finally:
        server.kill9()


def test_dbos_turn_streamed_over_sse_and_one_run_per_idempotency_key(dbos_stack: Stack) -> None:
    """`durcap serve --engine dbos` hands the turn to `durcap worker dbos` (another process) and streams it: see
    `_streamed_idempotent_turn`."""
    _streamed_idempotent_turn(dbos_stack, 'dbos-1')


def _json(response: httpx.Response) -> Any:
    return json.loads(response.text)
