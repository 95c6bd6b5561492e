"""A turn that fails with a coded error shows that code first in `GET /v1/runs/{id}`'s `error` and in its `run_failed`
event, as docs/serving.md says ("a failed run's one line, led by its code when it has one"): before, a DC061 turn read
`TurnRequestLimitError: DC061 ...`. In-process with Starlette's `TestClient` on the local engine, a real SQLite store;
model: tests/fixtures/stubborn_agent.py's scripted `FunctionModel` (asks for approval after every denial)."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

AUTH = {'Authorization': 'Bearer s3cret'}


def test_a_dc061_turn_error_is_led_by_its_code(tmp_path: Path, monkeypatch) -> None:
    import importlib.util

    from starlette.testclient import TestClient

    from durable_capabilities.serve import bearer_auth, create_app
    from tests._helpers import ROOT

    monkeypatch.setenv('DURCAP_STREAM_DELAY', '0')
    spec = importlib.util.spec_from_file_location('stubborn_agent', ROOT / 'tests' / 'fixtures' / 'stubborn_agent.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    app = create_app(module.agent, settings={'store': f'sqlite:///{tmp_path / "serve.db"}'}, auth=bearer_auth('s3cret'))
    with TestClient(app) as client:
        posted = client.post(f'/v1/conversations/c-{uuid.uuid4().hex}/turns', json={'prompt': 'revoke bob'}, headers=AUTH)
        assert posted.status_code == 202, posted.text
        with client.stream('GET', posted.json()['events_url'], headers=AUTH) as response:
            body = response.read().decode()
        status = client.get(posted.json()['status_url'], headers=AUTH).json()
    assert status['status'] == 'failed', status
    assert status['error'].startswith('DC061 the turn made 50 model requests'), status['error']
    failed = [json.loads(line[6:]) for line in body.splitlines() if line.startswith('data: ') and '"run_failed"' in line]
    assert [event['data'] for event in failed] == [{'error': status['error'], 'code': 'DC061'}], failed
