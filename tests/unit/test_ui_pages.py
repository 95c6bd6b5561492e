"""`durcap ui` pages that need no running engine server (Starlette's test client, a real empty DBOS SQLite system
database). The browser tests on real servers are in `tests/engines/test_ui.py`."""

from __future__ import annotations

import re
from pathlib import Path

from starlette.testclient import TestClient

from durable_capabilities.settings import Settings
from durable_capabilities.ui import create_app


def test_an_unknown_run_is_a_404_page_with_one_plain_line(tmp_path: Path) -> None:
    app = create_app(Settings.resolve(db=f'sqlite:///{tmp_path}/dbos.sqlite', store=f'sqlite:///{tmp_path}/c.db'), 'tok',
                     engines=['dbos'])
    page = TestClient(app).get('/runs/dbos/nope')
    assert page.status_code == 404
    text = re.sub(r'\s+', ' ', page.text)
    assert 'no run &#39;nope&#39; found' in text or "no run 'nope' found" in text, text[-2000:]
    assert '(&#34;' not in text and '(&#39;no run' not in text and '[&#34;' not in text, text[-2000:]  # no tuple repr
    # The other 404s are pages with one plain line too: a path no page has (Starlette's bare "Not Found" before) and
    # a conversation page without an id (it said "None").
    for path, said in [('/nope', 'no page at /nope: the pages are /, /runs/ENGINE/RUN_ID'),
                       ('/conversations/', 'no conversation id in the address: /conversations/ID')]:
        page = TestClient(app).get(path)
        assert page.status_code == 404 and said in page.text and 'id="error"' in page.text, (path, page.text[-1500:])
        assert '>None<' not in re.sub(r'\s+', '', page.text), page.text[-1500:]
    wrong_method = TestClient(app).get('/decide')
    assert wrong_method.status_code == 405 and '/decide does not take GET requests' in wrong_method.text


def test_bad_query_parameters_are_a_400_page_naming_each_one(tmp_path: Path) -> None:
    """`/?engine=nope`, `?status=bogus`, `?limit=-3` were ignored (all runs listed): each is refused with a 400 page
    naming the parameter, the value and what it takes; the filter form's empty values still mean "all"."""
    import html

    app = create_app(Settings.resolve(db=f'sqlite:///{tmp_path}/dbos.sqlite', store=f'sqlite:///{tmp_path}/c.db'), 'tok',
                     engines=['dbos'])
    client = TestClient(app)
    for query, said in [
        ('engine=nope', "query parameter 'engine' is 'nope': it takes dbos (the engines served here), or empty for all"),
        ('status=bogus', "query parameter 'status' is 'bogus': it takes running, queued, orphaned, completed, failed, "
                         'cancelled, or empty for all'),
        ('limit=-3', "query parameter 'limit' is '-3': it takes a whole number from 1 to 500"),
        ('limit=many', "query parameter 'limit' is 'many': it takes a whole number from 1 to 500"),
    ]:
        page = client.get(f'/?{query}')
        assert page.status_code == 400, (query, page.status_code)
        assert said in html.unescape(re.sub(r'\s+', ' ', page.text)), (query, page.text[-1500:])
    both = html.unescape(client.get('/?engine=nope&limit=0').text)
    assert "'engine' is 'nope'" in both and "'limit' is '0'" in both
    assert client.get('/?engine=&status=&capability=&limit=').status_code == 200
    assert client.get('/?engine=dbos&status=running&limit=7').status_code == 200


def test_a_call_decided_but_not_received_shows_the_decision_and_no_forms() -> None:
    """The approvals page's call block (`_pending.html`, rendered as `create_app` does): a call a decision was already
    sent on (DBOS, the run's process down) says so and offers no second decision; a waiting one offers both forms."""
    from jinja2 import Environment, FileSystemLoader

    from durable_capabilities.approvals import PendingCall
    from durable_capabilities.ui import TEMPLATES, _json_text

    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=True, lstrip_blocks=True)
    env.filters['tojson_text'] = _json_text
    call = PendingCall('run-1', 'call-1', 'revoke_sessions', {'user': 'alice'}, 'f' * 64, '2026-12-01T06:00:00+00:00',
                       '2026-12-02T06:00:00+00:00', 'gated', None, 'dbos')
    decided = PendingCall(**{**call.to_json(), 'decided': 'approved by alice-admin at 2026-12-01T06:05:00+00:00'})
    waiting_html = env.get_template('_pending.html').render(pending=[call], csrf='x')
    decided_html = env.get_template('_pending.html').render(pending=[decided], csrf='x')
    assert waiting_html.count('<form') == 2 and 'already' not in waiting_html
    assert '<form' not in decided_html
    assert 'already <strong>approved by alice-admin at 2026-12-01T06:05:00+00:00</strong>' in decided_html
    assert 'durcap runs resume run-1' in decided_html


def test_budgets_page_lists_each_key_with_spent_and_limits(tmp_path: Path) -> None:
    """`/budgets` (issue 28): a key's spend of each limit, its raise, requests and in-flight count, from the real
    SQLite ledger (written through the store's budget calls); an empty store says so; a missing store is one line."""
    import asyncio
    import html

    from durable_capabilities.store import SQLConversationStore

    store = f'sqlite:///{tmp_path}/c.db'

    async def spend() -> None:
        with SQLConversationStore(store) as opened:
            assert await opened.budget_reserve('tenant:acme', 'r#1', 'r', {'total_tokens': 500}) is None
            await opened.budget_settle('tenant:acme', 'r#1', 'r', input_tokens=300, output_tokens=100)
            await opened.budget_raise('tenant:acme', 'total_tokens', 250)
            assert await opened.budget_reserve('tenant:acme', 'r#3', 'r', {'total_tokens': 500}) is None

    app = create_app(Settings.resolve(db=f'sqlite:///{tmp_path}/dbos.sqlite', store=store), 'tok', engines=['dbos'])
    asyncio.run(spend())
    page = html.unescape(re.sub(r'\s+', ' ', TestClient(app).get('/budgets').text))
    assert 'tenant:acme' in page and '400 / 750 (raised by 250)' in page, page[-2000:]
    assert '<td>1</td><td>1</td>' in page  # one request settled, one in flight
    missing = create_app(Settings.resolve(db=f'sqlite:///{tmp_path}/dbos.sqlite', store=f'sqlite:///{tmp_path}/none.db'),
                         'tok', engines=['dbos'])
    said = TestClient(missing).get('/budgets')
    assert said.status_code == 200 and 'no conversation store at' in said.text and 'id="budgets"' not in said.text


def test_no_other_site_may_frame_the_pages_with_decision_buttons(tmp_path: Path) -> None:
    """`durcap ui`'s pages and `durcap serve --chat`'s page carry Approve / Deny buttons: both refuse to be framed by
    another site (`frame-ancestors 'none'` and `X-Frame-Options: DENY`, against clickjacking; a fresh-user trial saw
    neither). Starlette's test client; the serve app on the local engine, model pydantic-ai's `TestModel` (no turn)."""
    from pydantic_ai.models.test import TestModel

    from durable_capabilities import DurableAgent
    from durable_capabilities.serve import bearer_auth
    from durable_capabilities.serve import create_app as create_serve_app

    ui = create_app(Settings.resolve(db=f'sqlite:///{tmp_path}/dbos.sqlite', store=f'sqlite:///{tmp_path}/c.db'), 'tok',
                    engines=['dbos'])
    serve = create_serve_app(DurableAgent('framed', TestModel()), settings={'store': f'sqlite:///{tmp_path}/s.db'},
                             auth=bearer_auth('tok'), chat=True)
    for page in (TestClient(ui).get('/'), TestClient(serve).get('/chat')):
        assert page.status_code == 200, page.text[-500:]
        assert "frame-ancestors 'none'" in page.headers['content-security-policy'], page.headers
        assert page.headers['x-frame-options'] == 'DENY', page.headers
