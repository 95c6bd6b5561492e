"""Shared fixtures and the two lanes.

- `tests/unit/`: no server is started (SQLite stores, subprocesses of `durcap` at most): the fast lane, every item
  marked `fast` here, so `pytest tests/unit` and `pytest -m fast` select the same tests.
- `tests/engines/`: real Temporal / Prefect servers (session fixtures in tests/engines/conftest.py) and PostgreSQL.

`store_url` is a SQLite file under tests/unit and a fresh PostgreSQL database under tests/engines
(tests/engines/test_stores_on_postgresql.py runs the unit store tests again that way). Helpers (subprocess
environment, the `durcap` CLI, databases, waits) live in tests/_helpers.py.
"""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests._helpers import postgres_database, sqlite_url
from tests._leaks import pytest_configure, pytest_sessionfinish  # noqa: F401  (hooks: the leaked-server check)

TESTS = Path(__file__).resolve().parent
UNIT = TESTS / 'unit'
ENGINES = TESTS / 'engines'


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every item under tests/unit `fast`. A module with `REUSES_STORE_TESTS = True` imports unit tests to run
    them on another store backend: of the imported tests, only those that take `store_url` stay."""
    dropped: list[pytest.Item] = []
    kept: list[pytest.Item] = []
    for item in items:
        if item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.fast)
        module = getattr(item, 'module', None)
        imported = getattr(getattr(item, 'function', None), '__module__', None) != getattr(module, '__name__', None)
        if getattr(module, 'REUSES_STORE_TESTS', False) and imported and 'store_url' not in getattr(item, 'fixturenames', ()):
            dropped.append(item)
        else:
            kept.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`store_url`'s backend: PostgreSQL for tests collected under tests/engines, SQLite elsewhere; only where the
    `store_url` a test gets is this file's (a module may define its own, with its own params)."""
    definitions = metafunc._arg2fixturedefs.get('store_url') or ()
    if definitions and definitions[-1].func is store_url.__wrapped__:
        backend = 'postgresql' if metafunc.definition.path.is_relative_to(ENGINES) else 'sqlite'
        metafunc.parametrize('store_url', [backend], indirect=True)


@pytest.fixture
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A URL to an empty store: a SQLite file under `tmp_path`, or a fresh PostgreSQL database (dropped after)."""
    if request.param == 'sqlite':
        yield sqlite_url(tmp_path)
        return
    with postgres_database('durcap_store') as url:
        yield url


@pytest.fixture
def store(store_url: str) -> Iterator[object]:
    """An open `SQLConversationStore` on `store_url`, closed after the test."""
    from durable_capabilities.store import SQLConversationStore

    with SQLConversationStore(store_url) as opened:
        yield opened


@pytest.fixture
def agent_name(request: pytest.FixtureRequest) -> Callable[[str], str]:
    """A factory of agent names unique to this test: `agent_name('support')` -> `'support-t1a2b3c4-1'`.

    DBOS registers durable steps globally when an agent is constructed and complains when two
    agents share a name, so every agent a test builds needs its own. The name is derived from the
    test node id (stable across runs) and is a valid durable id.
    """
    tag = f'{zlib.crc32(request.node.nodeid.encode()):08x}'
    counter = itertools.count(1)

    def make(prefix: str = 'agent') -> str:
        clean = re.sub(r'[^A-Za-z0-9-]+', '-', prefix).strip('-')[:40] or 'agent'
        return f'{clean}-t{tag}-{next(counter)}'

    return make


SKILL_FILES = {
    'refunds.md': '---\nid: refunds\ndescription: Use for refund eligibility or refund status.\n---\n'
    'Always confirm the order ID before issuing a refund.\n',
    'returns.md': '---\nid: returns\ndescription: Use for product returns and return labels.\n---\n'
    'Returns are accepted within 30 days of delivery.\n',
}


@pytest.fixture
def skills_dir(tmp_path: Path) -> Path:
    """A directory with two valid skill files (`refunds`, `returns`)."""
    directory = tmp_path / 'skills'
    directory.mkdir()
    for name, text in SKILL_FILES.items():
        (directory / name).write_text(text, encoding='utf-8', newline='\n')
    return directory


# The suite's `python -m durable_capabilities...` / `python -m tests...` / `python -c` subprocesses fork from a server
# that has imported pydantic-ai and the other third-party modules once (tests/_zygote.py: ~1.2 s of CPU saved per
# subprocess); `DURCAP_TEST_ZYGOTE=0` turns it off.
from tests import _zygote

_zygote.install()
