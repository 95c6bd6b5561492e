"""The support example's committed `durable.lock` and recorded Temporal histories stay valid.

Recorded with the scripted support model (`examples/support/scripted.py`) on a Temporal dev server;
replay needs no server. A rename that would strand in-flight runs fails here, naming what changed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from durable_capabilities.testing import assert_histories_replay, assert_lock_matches
from examples.support.agent import support
from tests._helpers import ROOT


def test_committed_lock_matches_the_support_definition() -> None:
    assert_lock_matches(ROOT / 'examples/support/durable.lock', [support])


def test_recorded_support_histories_replay() -> None:
    assert assert_histories_replay(ROOT / 'tests/histories/support', [support]) == 4


def test_lock_check_fails_when_a_locked_name_disappears(tmp_path: Path) -> None:
    text = (ROOT / 'examples/support/durable.lock').read_text()
    tampered = tmp_path / 'durable.lock'
    tampered.write_text(text.replace('toolset__orders__call_tool', 'toolset__orders-v0__call_tool'))
    with pytest.raises(AssertionError, match=r"DC020.*orders-v0"):
        assert_lock_matches(tampered, [support])
