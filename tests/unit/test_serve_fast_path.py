"""`durcap serve`'s app sends the two requests of every turn (`POST /v1/conversations/{id}/turns`, `GET
/v1/runs/{id}/events`) straight to their handlers, past Starlette's middleware and router
(`serve._routes._ServeStarlette`), only while nothing else must see them: with CORS on, the middleware still answers
them; mounted under a path, Starlette routes them; any other method or path goes to Starlette. In-process with
Starlette's `TestClient` on the local engine; model: tests/engines/stream_agent.py's scripted `FunctionModel`.
`starlette.routing.Route.matches` is wrapped to count the router's work (the real one still runs)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route

AUTH = {'Authorization': 'Bearer s3cret'}


@pytest.fixture
def matched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.setenv('DURCAP_STREAM_DELAY', '0')
    seen: list[str] = []
    real = Route.matches

    def counted(self: Route, scope: Any) -> Any:
        seen.append(scope['path'])
        return real(self, scope)

    monkeypatch.setattr(Route, 'matches', counted)
    return seen


def _app(tmp_path: Path, **kwargs: Any) -> Any:
    from durable_capabilities.serve import bearer_auth, create_app
    from tests.engines.stream_agent import agent

    return create_app(agent, settings={'store': f'sqlite:///{tmp_path / "serve.db"}'}, auth=bearer_auth('s3cret'),
                      **kwargs)


def _turn(client: Any, prefix: str = '', headers: dict[str, str] | None = None) -> tuple[Any, str]:
    posted = client.post(f'{prefix}/v1/conversations/c-{uuid.uuid4().hex}/turns', json={'prompt': 'where is ABC-123?'},
                         headers={**AUTH, **(headers or {})})
    assert posted.status_code == 202, posted.text
    with client.stream('GET', posted.json()['events_url'], headers={**AUTH, **(headers or {})}) as response:
        assert response.status_code == 200
        text = response.read().decode()
    # every event, the run's last one last: the stream ended with it (its last write ended the response)
    assert text.startswith('retry: 1000\n\nid: 1\n') and text.rstrip('\n').split('\n')[-2] == 'event: run_completed'
    return posted, text


def test_a_turn_skips_the_router_and_every_other_request_takes_it(tmp_path: Path, matched: list[str]) -> None:
    from starlette.testclient import TestClient

    with TestClient(_app(tmp_path)) as client:
        posted, _ = _turn(client)
        assert matched == []  # neither request of the turn walked the routes
        run_id = posted.json()['run_id']
        assert client.get(f'/v1/runs/{run_id}', headers=AUTH).json()['status'] == 'completed'
        assert matched and matched[-1] == f'/v1/runs/{run_id}'
        slash = client.post(f'/v1/conversations/c-{uuid.uuid4().hex}/turns/', json={'prompt': 'hi'}, headers=AUTH,
                            follow_redirects=False)
        assert slash.status_code == 307 and any(path.endswith('/turns/') for path in matched)  # Starlette's, as before
        wrong = client.get(f'/v1/conversations/c-{uuid.uuid4().hex}/turns', headers=AUTH)
        assert wrong.status_code == 405 and wrong.json()['error']['code'] == 'DC042'


def test_with_cors_on_the_middleware_answers_a_turns_requests(tmp_path: Path, matched: list[str]) -> None:
    from starlette.testclient import TestClient

    origin = {'Origin': 'https://app.example.com'}
    with TestClient(_app(tmp_path, cors_origins=['https://app.example.com'])) as client:
        posted = client.post(f'/v1/conversations/c-{uuid.uuid4().hex}/turns', json={'prompt': 'where is ABC-123?'},
                             headers={**AUTH, **origin})
        assert posted.status_code == 202
        assert posted.headers['access-control-allow-origin'] == 'https://app.example.com'
        with client.stream('GET', posted.json()['events_url'], headers={**AUTH, **origin}) as response:
            assert response.headers['access-control-allow-origin'] == 'https://app.example.com'
            assert response.read().decode().rstrip('\n').split('\n')[-2] == 'event: run_completed'
    assert len(matched) >= 2  # through Starlette


def test_mounted_under_a_path_starlette_routes_a_turn(tmp_path: Path, matched: list[str]) -> None:
    from starlette.applications import Starlette
    from starlette.routing import Mount
    from starlette.testclient import TestClient

    outer = Starlette(routes=[Mount('/api', app=_app(tmp_path))])
    with TestClient(outer) as client:
        posted, _ = _turn(client, prefix='/api')
    assert posted.json()['events_url'].startswith('/api/v1/runs/')
    assert any(path.startswith('/api/v1/conversations/') for path in matched)
