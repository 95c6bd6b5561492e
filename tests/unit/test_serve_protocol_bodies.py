"""Malformed bodies on the protocol endpoints of `durcap serve` (`POST /v1/agents/{agent}/vercel-ai` and `/ag-ui`),
in-process with Starlette's `TestClient` on the local engine. Model: pydantic-ai's `TestModel` (never reached: every
body here is refused before a run starts).

A fresh-user trial sent `{"messages": 5}` to the Vercel AI endpoint and got 500 `internal` (the pre-pass that drops
`rawInput` from approval parts iterated the integer); every such body is 400 DC042 naming the field, and nothing is
stored.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from pydantic_ai.models.test import TestModel

from durable_capabilities import DurableAgent

BAD_BODIES = [
    ('vercel-ai', {'messages': 5}),
    ('vercel-ai', {'id': 'v1', 'trigger': 'submit-message', 'messages': 5}),
    ('vercel-ai', {'id': 'v1', 'trigger': 'submit-message', 'messages': 'hello'}),
    ('vercel-ai', {'id': 'v1', 'trigger': 'submit-message', 'messages': [{'id': 'm', 'role': 'user', 'parts': 5}]}),
    ('vercel-ai', {'id': 'v1', 'trigger': 'submit-message', 'messages': [{'id': 'm', 'role': 'user', 'parts': None}]}),
    ('vercel-ai', {'id': 'v1', 'trigger': 'submit-message', 'messages': [5]}),
    ('vercel-ai', [1]),
    ('ag-ui', {'threadId': 't', 'runId': 'r', 'messages': 5}),
    ('ag-ui', [1]),
]


@pytest.mark.parametrize(('protocol', 'body'), BAD_BODIES, ids=[f'{p}-{json.dumps(b)}' for p, b in BAD_BODIES])
def test_a_protocol_body_of_the_wrong_shape_is_dc042_not_a_500(protocol: str, body: object, tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from durable_capabilities.serve import bearer_auth, create_app

    db = tmp_path / 'serve.db'
    app = create_app(DurableAgent('protocol-bodies', TestModel()), settings={'store': f'sqlite:///{db}'},
                     auth=bearer_auth('s3cret'))
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post(f'/v1/agents/protocol-bodies/{protocol}', json=body,
                             headers={'Authorization': 'Bearer s3cret'})
    assert answer.status_code == 400, answer.text
    error = answer.json()['error']
    assert error['code'] == 'DC042' and error['message'].startswith(f'DC042 {protocol}: ') and 'Traceback' not in answer.text
    if db.exists():  # nothing recorded: no run, no conversation
        with sqlite3.connect(db) as con:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            for table in ('durcap_serve_runs', 'durcap_serve_owners', 'durcap_conversations', 'durcap_run_streams'):
                if table in tables:
                    assert con.execute(f'SELECT COUNT(*) FROM {table}').fetchone() == (0,), table


def test_a_protocol_request_id_reused_for_another_request_is_dc045_naming_that_id(tmp_path: Path) -> None:
    """The protocol endpoints derive the turn's idempotency key from the request's own ids (AG-UI `runId`, Vercel AI
    chat and message ids): the same id sent again with another request is 409 DC045 naming that id, not the derived
    `Idempotency-Key 'p-...'` the client never sent (a fresh-user trial reused an AG-UI `runId` on a new thread); the
    same request again returns the same run. Model: `TestModel`."""
    from starlette.testclient import TestClient

    from durable_capabilities.serve import bearer_auth, create_app

    app = create_app(DurableAgent('protocol-ids', TestModel()), settings={'store': f'sqlite:///{tmp_path / "s.db"}'},
                     auth=bearer_auth('s3cret'))
    auth = {'Authorization': 'Bearer s3cret'}

    def ag_ui(thread: str, text: str) -> dict[str, object]:
        return {'threadId': thread, 'runId': 'run-1', 'state': None, 'tools': [], 'context': [], 'forwardedProps': None,
                'messages': [{'id': 'm1', 'role': 'user', 'content': text}]}

    def vercel(text: str) -> dict[str, object]:
        return {'id': 'chat-1', 'trigger': 'submit-message',
                'messages': [{'id': 'm1', 'role': 'user', 'parts': [{'type': 'text', 'text': text}]}]}

    with TestClient(app, raise_server_exceptions=False) as client:
        for protocol, first, other, named in (
                ('ag-ui', ag_ui('t-1', 'hello'), ag_ui('t-2', 'hello'), "AG-UI runId 'run-1' was sent before"),
                ('vercel-ai', vercel('hello'), vercel('something else'),
                 "Vercel AI message id 'm1' of chat 'chat-1' was sent before")):
            url = f'/v1/agents/protocol-ids/{protocol}'
            started = client.post(url, json=first, headers=auth)
            assert started.status_code == 200, started.text
            again = client.post(url, json=first, headers=auth)
            assert again.status_code == 200 and again.headers['x-durcap-run-id'] == started.headers['x-durcap-run-id']
            refused = client.post(url, json=other, headers=auth)
            assert refused.status_code == 409, refused.text
            error = refused.json()['error']
            assert error['code'] == 'DC045' and error['message'].startswith(f'DC045 {named} with another request'), error
            assert started.headers['x-durcap-run-id'] in error['message'] and "'p-" not in error['message'], error


def test_a_vercel_ai_regenerate_is_refused_naming_what_works_and_the_conversation_keeps_its_turn(tmp_path: Path) -> None:
    """The ai SDK's `regenerate()` (`trigger: 'regenerate-message'`) after a submitted message: a stored turn is not
    replaced (its tools ran; the store only appends), so it is 400 DC042 naming `trigger` and what works instead; before,
    it was answered with the first run again, as if the same message were resent (a fresh-user trial). The chat keeps
    its one turn. Model: `TestModel`."""
    from starlette.testclient import TestClient

    from durable_capabilities.serve import bearer_auth, create_app

    app = create_app(DurableAgent('protocol-regen', TestModel()), settings={'store': f'sqlite:///{tmp_path / "s.db"}'},
                     auth=bearer_auth('s3cret'))
    auth = {'Authorization': 'Bearer s3cret'}
    user = {'id': 'm1', 'role': 'user', 'parts': [{'type': 'text', 'text': 'hello'}]}
    with TestClient(app, raise_server_exceptions=False) as client:
        url = '/v1/agents/protocol-regen/vercel-ai'
        started = client.post(url, json={'id': 'chat-r', 'trigger': 'submit-message', 'messages': [user]}, headers=auth)
        assert started.status_code == 200, started.text
        regenerated = client.post(url, json={'id': 'chat-r', 'trigger': 'regenerate-message', 'messageId': 'a1',
                                             'messages': [user]}, headers=auth)
        assert regenerated.status_code == 400, regenerated.text
        error = regenerated.json()['error']
        assert error['code'] == 'DC042' and error['field'] == 'trigger', error
        assert 'send the prompt again as a new message' in error['message'] and 'durcap history fork' in error['message']
        stored = client.get('/v1/conversations/chat-r', headers=auth)
        assert stored.status_code == 200 and stored.json()['revision'] == 1, stored.text
