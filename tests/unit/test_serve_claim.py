"""`durcap serve`'s local turn claims its conversation once: the transaction recording the run takes the claim when
the conversation is free, and the run's in-process load then does not claim it again (`turn.claimed_by_caller`); when
another run holds the conversation (nothing was claimed at the POST), the load claims and waits as before. In-process
with Starlette's `TestClient` on the local engine, a real SQLite store; model: tests/engines/stream_agent.py's
scripted `FunctionModel`. `_SQLBackend.claim_turn` is wrapped to record its calls (the real one still runs)."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

AUTH = {'Authorization': 'Bearer s3cret'}


@pytest.fixture
def claims(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    from durable_capabilities.store._sql import _SQLBackend

    monkeypatch.setenv('DURCAP_STREAM_DELAY', '0')
    seen: list[tuple[str, str]] = []
    real = _SQLBackend.claim_turn

    def counted(self: _SQLBackend, conversation_id: str, run_id: str) -> Any:
        seen.append((conversation_id, run_id))
        return real(self, conversation_id, run_id)

    monkeypatch.setattr(_SQLBackend, 'claim_turn', counted)
    return seen


def _app(store: str) -> Any:
    from durable_capabilities.serve import bearer_auth, create_app
    from tests.engines.stream_agent import agent

    return create_app(agent, settings={'store': store}, auth=bearer_auth('s3cret'))


def _stream(client: Any, posted: Any) -> str:
    assert posted.status_code == 202, posted.text
    with client.stream('GET', posted.json()['events_url'], headers=AUTH) as response:
        return response.read().decode()


def test_a_turn_on_a_free_conversation_is_claimed_once_and_released_by_its_append(
        tmp_path: Path, claims: list[tuple[str, str]]) -> None:
    from starlette.testclient import TestClient

    from durable_capabilities.conversations import process_store

    store = f'sqlite:///{tmp_path / "serve.db"}'
    conversation = f'c-{uuid.uuid4().hex}'
    with TestClient(_app(store)) as client:
        for count in (4, 6):  # the second turn's model answers from the history (no tool call): 2 messages
            posted = client.post(f'/v1/conversations/{conversation}/turns', json={'prompt': 'where is ABC-123?'},
                                 headers=AUTH)
            assert 'event: run_completed' in _stream(client, posted)
            run_id = posted.json()['run_id']
            assert client.get(f'/v1/runs/{run_id}', headers=AUTH).json()['status'] == 'completed'
            assert client.get(f'/v1/conversations/{conversation}', headers=AUTH).json()['message_count'] == count
    assert claims == []  # the POST's transaction took each turn's claim; the runs' loads did not claim again
    backend = process_store(store)._sql
    assert backend.claim_turn(conversation, 'probe') is None  # released by each turn's append: free again


def test_a_turn_queued_behind_another_runs_claim_claims_at_its_load(tmp_path: Path,
                                                                    claims: list[tuple[str, str]]) -> None:
    from starlette.testclient import TestClient

    from durable_capabilities.conversations import process_store

    store = f'sqlite:///{tmp_path / "serve.db"}'
    conversation = f'c-{uuid.uuid4().hex}'
    with TestClient(_app(store)) as client:
        first = client.post(f'/v1/conversations/{conversation}/turns', json={'prompt': 'where is ABC-123?'},
                            headers=AUTH)
        assert 'event: run_completed' in _stream(client, first)
        backend = process_store(store)._sql
        assert backend.claim_turn(conversation, 'other-run') is None  # another run's turn holds it now
        claims.clear()
        queued = client.post(f'/v1/conversations/{conversation}/turns',
                             json={'prompt': 'where is ABC-123?', 'busy': 'enqueue'}, headers=AUTH)
        assert queued.status_code == 202, queued.text
        run_id = queued.json()['run_id']
        deadline = time.monotonic() + 30
        while (conversation, run_id) not in claims:  # its load tries to claim (and waits: held)
            assert time.monotonic() < deadline, claims
            time.sleep(0.02)
        assert client.get(f'/v1/runs/{run_id}', headers=AUTH).json()['status'] in ('queued', 'running')
        released = threading.Event()
        threading.Thread(target=lambda: (backend.release_turn(conversation, 'other-run'), released.set())).start()
        assert released.wait(30)
        assert 'event: run_completed' in _stream(client, queued)
        assert client.get(f'/v1/runs/{run_id}', headers=AUTH).json()['status'] == 'completed'
        assert client.get(f'/v1/conversations/{conversation}', headers=AUTH).json()['message_count'] == 6
