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
