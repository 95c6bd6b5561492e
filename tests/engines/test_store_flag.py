"""`--store` travels as a value (issue 23): `durcap run --store` and `durcap worker ... --store` write the
conversation to the store they name, with `$DURCAP_STORE` pointing elsewhere, on DBOS (SQLite, no server) and on
Temporal (the session's dev server). The CLI resolves the flag once and passes it down (run settings, worker
settings); nothing writes `os.environ['DURCAP_STORE']` any more.

Model: the scripted support `FunctionModel` (examples/support/scripted.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']
TARGET = 'examples.support.agent:support'
DEPS = json.dumps({'orders': {'ABC-123': 'Blue jacket: shipped'}})


def _env(elsewhere: Path) -> dict[str, str]:
    return {**os.environ, 'PYTHONPATH': str(ROOT), 'DURCAP_STORE': f'sqlite:///{elsewhere}'}


def _conversation_ids(path: Path) -> list[str]:
    """The conversation ids stored at the SQLite file `path` (none when the file does not exist)."""
    if not path.exists():
        return []
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return sorted(row[0] for row in conn.execute('SELECT conversation_id FROM durcap_conversations'))


def _start(args: list[str], log: Path, env: dict[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    with open(log, 'wb') as handle:
        return subprocess.Popen(args, cwd=cwd, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while needle not in log.read_text(errors='replace'):
        assert time.monotonic() < deadline and proc.poll() is None, log.read_text(errors='replace')[-3000:]
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*DURCAP, 'run', TARGET, 'Where is my order ABC-123?', '--deps-json', DEPS, *args],
                            cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'Order ABC-123: Blue jacket: shipped' in result.stdout
    return result


def test_dbos_run_and_worker_write_to_the_store_flag(tmp_path: Path) -> None:
    flagged, elsewhere = tmp_path / 'flagged.db', tmp_path / 'elsewhere.db'
    env = _env(elsewhere)
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    _run(['--engine', 'dbos', '--db', db, '--store', f'sqlite:///{flagged}', '--conversation', 'by-run'], env, tmp_path)
    assert _conversation_ids(flagged) == ['by-run']

    # The worker's steps use the worker's --store.
    from dbos import DBOSClient

    log = tmp_path / 'worker.log'
    worker = _start([*DURCAP, 'worker', 'dbos', TARGET, '--db', db, '--store', f'sqlite:///{flagged}'], log, env, ROOT)
    client = None
    try:
        _wait_for(log, 'dbos worker ready', worker)
        client = DBOSClient(system_database_url=db)
        workflow_id = f'store-flag-{uuid.uuid4().hex[:8]}'
        client.enqueue({'queue_name': 'durcap', 'workflow_name': 'durcap.support', 'workflow_id': workflow_id},
                       'Where is my order ABC-123?', json.loads(DEPS), None, 'by-worker')
        result = client.retrieve_workflow(workflow_id).get_result()
        assert 'Blue jacket: shipped' in result['output']
    finally:
        if client is not None:
            client.destroy()
        _stop(worker)
    assert sorted(_conversation_ids(flagged)) == ['by-run', 'by-worker']
    assert _conversation_ids(elsewhere) == []


def test_temporal_run_and_worker_write_to_the_store_flag(temporal_address: str, tmp_path: Path) -> None:
    flagged, elsewhere = tmp_path / 'flagged.db', tmp_path / 'elsewhere.db'
    env = _env(elsewhere)
    queue = f'store-flag-{uuid.uuid4().hex[:8]}'
    store = ['--store', f'sqlite:///{flagged}']
    log = tmp_path / 'worker.log'
    worker = _start([*DURCAP, 'worker', 'temporal', TARGET, '--task-queue', queue, '--address', temporal_address,
                     '--no-versioning', *store], log, env, ROOT)
    try:
        _wait_for(log, 'worker ready', worker)
        # The run's client (claim-check codec) and the worker's activities both use the flag's store.
        _run(['--engine', 'temporal', '--address', temporal_address, '--task-queue', queue, *store,
              '--conversation', 'by-worker'], env, tmp_path)
        # A run with an inline worker: its activities use the run's --store.
        _run(['--engine', 'temporal', '--address', temporal_address, '--task-queue', f'{queue}-inline', '--inline-worker',
              *store, '--conversation', 'by-run'], env, tmp_path)
    finally:
        _stop(worker)
    assert sorted(_conversation_ids(flagged)) == ['by-run', 'by-worker']
    assert _conversation_ids(elsewhere) == []
