"""Shared fixtures. Plain fixtures only; test-specific helpers live in their own test modules."""

from __future__ import annotations

import itertools
import re
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest


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
