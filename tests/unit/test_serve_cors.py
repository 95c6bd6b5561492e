"""CORS of `durcap serve` (`create_app(cors_origins=...)`, `--cors-origin`), in-process with Starlette's `TestClient`
on the local engine. Model: pydantic-ai's `TestModel` (a turn answers at once).

A fresh-user trial found no test of CORS at all, and that a browser app on an allowed origin could not read the
`X-Durcap-Run-Id` header of the AG-UI and Vercel AI responses (docs/serving.md names it as where the run is): CORS
did not expose it, and a browser hides an unexposed header from the page's script.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_ai.models.test import TestModel
from starlette.testclient import TestClient

from durable_capabilities import DurableAgent

ORIGIN = 'https://app.example.com'
TOKEN = {'Authorization': 'Bearer s3cret'}


def _client(tmp_path: Path, origins: list[str]) -> TestClient:
    from durable_capabilities.serve import bearer_auth, create_app

    app = create_app(DurableAgent('cors', TestModel()), settings={'store': f'sqlite:///{tmp_path / "serve.db"}'},
                     auth=bearer_auth('s3cret'), cors_origins=origins)
    return TestClient(app, raise_server_exceptions=False)


def test_a_preflight_from_the_named_origin_is_allowed_with_the_api_headers_and_another_origin_is_not(
        tmp_path: Path) -> None:
    asked = {'Access-Control-Request-Method': 'POST',
             'Access-Control-Request-Headers': 'authorization,content-type,idempotency-key,last-event-id'}
    with _client(tmp_path, [ORIGIN]) as client:
        allowed = client.options('/v1/conversations/c1/turns', headers={'Origin': ORIGIN, **asked})
        other = client.options('/v1/conversations/c1/turns', headers={'Origin': 'https://evil.example', **asked})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers['access-control-allow-origin'] == ORIGIN
    assert {h.strip().lower() for h in allowed.headers['access-control-allow-headers'].split(',')} >= {
        'authorization', 'content-type', 'idempotency-key', 'last-event-id'}
    assert other.status_code == 400 and 'access-control-allow-origin' not in other.headers


def test_the_protocol_responses_run_id_header_is_exposed_to_the_allowed_origin(tmp_path: Path) -> None:
    """An AG-UI and a Vercel AI turn from the allowed origin: each response names its run in `X-Durcap-Run-Id`, and
    `Access-Control-Expose-Headers` lists it, so the page's script can read it; the API's own JSON answers carry the
    allowed origin too."""
    ag_ui = {'threadId': 'cors-1', 'runId': 'r1', 'state': None, 'tools': [], 'context': [], 'forwardedProps': None,
             'messages': [{'id': 'm1', 'role': 'user', 'content': 'hello'}]}
    vercel = {'id': 'cors-2', 'trigger': 'submit-message',
              'messages': [{'id': 'm1', 'role': 'user', 'parts': [{'type': 'text', 'text': 'hello'}]}]}
    headers = {**TOKEN, 'Origin': ORIGIN}
    with _client(tmp_path, [ORIGIN]) as client:
        answers = [client.post('/v1/agents/cors/ag-ui', json=ag_ui, headers=headers),
                   client.post('/v1/agents/cors/vercel-ai', json=vercel, headers=headers)]
        turn = client.post('/v1/conversations/cors-3/turns', json={'prompt': 'hello'}, headers=headers)
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.headers['x-durcap-run-id'].startswith('local-'), answer.headers
        assert answer.headers['access-control-allow-origin'] == ORIGIN
        exposed = {h.strip().lower() for h in answer.headers['access-control-expose-headers'].split(',')}
        assert 'x-durcap-run-id' in exposed, answer.headers
    assert turn.status_code == 202 and turn.headers['access-control-allow-origin'] == ORIGIN, turn.headers


def test_without_origins_no_cors_header_is_sent(tmp_path: Path) -> None:
    """CORS is off by default: a cross-origin request gets no `Access-Control-*` header, a preflight no 200."""
    with _client(tmp_path, []) as client:
        answer = client.post('/v1/conversations/c1/turns', json={'prompt': 'hello'}, headers={**TOKEN, 'Origin': ORIGIN})
        preflight = client.options('/v1/conversations/c1/turns',
                                   headers={'Origin': ORIGIN, 'Access-Control-Request-Method': 'POST'})
    assert answer.status_code == 202, answer.text
    assert not [h for h in answer.headers if h.lower().startswith('access-control-')], answer.headers
    assert preflight.status_code != 200 and 'access-control-allow-origin' not in preflight.headers
