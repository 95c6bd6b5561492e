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
