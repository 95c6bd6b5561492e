"""Histories with provider-specific parts round-trip exactly: through the conversation store and across every
engine's boundary.

The history (`tests/engines/parts_agent.py: rich_history`) holds thinking with a signature and provider details,
native (built-in) tool call and return parts, text with provider details, a 1 MB PNG and a 1 MB PDF in the prompt
and a 1 MB image the model returned, 4.2 MB of message JSON. Equality is of pydantic-ai's message JSON
(`ModelMessagesTypeAdapter.dump_json`) before and after.

Model: a scripted `FunctionModel` that writes the history it receives to a file from whatever process runs the
model request (Temporal worker activity, DBOS step, Prefect task), so the test compares what crossed the engine's
boundary, not only what the store kept; on Temporal the recorded workflow is exported and `durcap replay`ed.
Servers: the session's Temporal dev server and Prefect server; DBOS on
SQLite. Runs are `durcap run --conversation` subprocesses.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest
from pydantic_ai.messages import ModelMessagesTypeAdapter

from durable_capabilities.engines import DURABLE_ENGINES
from durable_capabilities.store import SQLConversationStore
from tests.engines.parts_agent import dump, rich_history
from tests.engines.test_providers import DURCAP, ROOT, durcap_run, engine_env


def test_store_round_trip_is_exact(tmp_path: Path) -> None:
    """Append then read (claim-checked payloads included): the message JSON is byte-for-byte the same."""
    history = rich_history()

    async def go() -> bytes:
        with SQLConversationStore(f'sqlite:///{tmp_path / "c.db"}') as store:
            await store.append('c-1', history, expected_revision=None)
            return dump((await store.read('c-1')).messages)

    assert asyncio.run(go()) == dump(history)


@pytest.mark.slow
@pytest.mark.parametrize('engine', DURABLE_ENGINES)
def test_history_crosses_the_engine_boundary_unchanged(engine: str, request: pytest.FixtureRequest,
                                                       tmp_path: Path) -> None:
    """A conversation stored with every part kind, continued with `durcap run --conversation` on ENGINE: the model
    request unit received the stored messages exactly, and the store holds them exactly after the new turn."""
    flags, env = engine_env(engine, request, tmp_path)
    store_url = env['DURCAP_STORE']
    history = rich_history()

    async def seed() -> None:
        with SQLConversationStore(store_url) as store:
            await store.append('parts-1', history, expected_revision=None)

    asyncio.run(seed())
    seen_dir = tmp_path / 'seen'
    env |= {'DURCAP_PARTS_DIR': str(seen_dir)}
    out = durcap_run('tests.engines.parts_agent:agent', 'Thanks, what next?', engine, flags, env,
                     '--conversation', 'parts-1', '--store', store_url)
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'seen 3 messages' in out.stdout
    [seen] = sorted(seen_dir.iterdir())
    received = ModelMessagesTypeAdapter.validate_json(seen.read_bytes())
    assert dump(received[:2]) == dump(history)

    async def stored() -> bytes:
        with SQLConversationStore(store_url) as store:
            return dump((await store.read('parts-1')).messages[:2])

    assert asyncio.run(stored()) == dump(history)
    assert os.path.getsize(seen) > 4 * 1024 * 1024
    if engine == 'temporal':  # `durcap replay` of the recorded workflow (its history payloads are claim checks)
        workflow_id = next(line.split(': ', 1)[1].split()[0] for line in out.stderr.splitlines()
                           if line.startswith('workflow id:'))
        address = flags[flags.index('--address') + 1]
        exported = subprocess.run([*DURCAP, 'history', 'export', '--workflow-id', workflow_id, '-o',
                                   str(tmp_path / 'h.json'), '--address', address], cwd=ROOT,
                                  env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert exported.returncode == 0, exported.stderr
        replayed = subprocess.run([*DURCAP, 'replay', str(tmp_path / 'h.json'), '--target',
                                   'tests.engines.parts_agent:agent', '--store', store_url], cwd=ROOT,
                                  env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        assert '1 of 1 histories replay' in replayed.stderr
