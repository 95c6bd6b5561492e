"""The documentation pages that need a Temporal or Prefect server (`<!-- docs-test-page: needs="..." -->`): run as
tests/unit/test_docs.py runs the others, each with the servers the page starts for itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_docs import SERVER_PAGES, page_id, run_page

pytestmark = pytest.mark.slow


@pytest.mark.parametrize('page', [pytest.param(p, id=page_id(p)) for p in SERVER_PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_page(page, tmp_path, monkeypatch)
