"""`durcap run` owns only its own work, and `durcap runs list|show|resume|cancel` on every engine.

Real parts: `durcap` subprocesses (killed with SIGKILL), DBOS on PostgreSQL, the session's Temporal dev
server and Prefect server. Model: the scripted `FunctionModel`s of `tests/engines/ledger_agent.py` and
`tests/engines/crash_agent.py`, which count side effects and model requests in files.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.engines.test_crash import assert_exactly_once, wait_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']
LEDGER = 'tests/engines/ledger_agent.py:agent'
CRASH = 'tests/engines/crash_agent.py:agent'


def env_with(**extra: str) -> dict[str, str]:
    return {**os.environ, 'PYTHONPATH': str(ROOT), **extra}


def start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    handle = open(log, 'wb')
    proc = subprocess.Popen([*DURCAP, *args], cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    handle.close()
    return proc


def kill9(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


def wait_text(log: Path, needle: str, proc: subprocess.Popen[bytes] | None, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors='replace').splitlines():
            if needle in line:
                return line
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.1)
    raise AssertionError(f'{needle!r} not seen within {timeout} s:\n{log.read_text(errors="replace")[-3000:]}')


def durcap(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DURCAP, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_concurrent_dbos_runs_each_do_their_own_work_once(postgres_url: str, tmp_path: Path) -> None:
    """Two `durcap run --engine dbos` on one system database, the second launched while the first is inside its
    side effect: neither recovers the other's workflow, so one charge per run and no model request twice."""
    ledger = tmp_path / 'ledger'
    env = env_with(DURCAP_LEDGER_DIR=str(ledger), DURCAP_LEDGER_AGENT=f'ledger-{uuid.uuid4().hex[:6]}',
                   DURCAP_LEDGER_CHARGE_SECONDS='6')
    procs = []
    try:
        first = start(['run', LEDGER, 'charge order A-1', '--engine', 'dbos', '--db', postgres_url],
                      tmp_path / 'first.log', env)
        procs.append(first)
        wait_file(ledger / 'charge-started-A-1', 90)
        second = start(['run', LEDGER, 'charge order B-2', '--engine', 'dbos', '--db', postgres_url],
                       tmp_path / 'second.log', env)
        procs.append(second)
        assert first.wait(timeout=120) == 0, (tmp_path / 'first.log').read_text()
        assert second.wait(timeout=120) == 0, (tmp_path / 'second.log').read_text()
    finally:
        for proc in procs:
            kill9(proc)
    assert 'answer (dbos): charged A-1' in (tmp_path / 'first.log').read_text()
    assert 'answer (dbos): charged B-2' in (tmp_path / 'second.log').read_text()
    assert sorted((ledger / 'charges').read_text().splitlines()) == ['A-1', 'B-2'], 'a side effect ran twice'
    requests = (ledger / 'model-requests').read_text().splitlines()
    assert sorted(requests) == sorted(f'{o}:{n}' for o in ('A-1', 'B-2') for n in range(3)), requests
    # Each process printed its run id at start, under its own executor id.
    executors = {wait_text(tmp_path / f'{n}.log', 'dbos workflow id:', None, 1).split('(executor ')[1].split(';')[0]
                 for n in ('first', 'second')}
    assert len(executors) == 2 and all(e.startswith('durcap-run-') for e in executors), executors


def wait_status(db: str, workflow_id: str, wanted: str, timeout: float) -> str:
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=db)
    try:
        deadline, status = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            found = client.list_workflows(workflow_ids=[workflow_id], load_input=False, load_output=False)
            status = found[0].status if found else None
            if status == wanted:
                return status
            time.sleep(0.3)
        raise AssertionError(f'{workflow_id} is {status}, not {wanted}, after {timeout} s')
    finally:
        client.destroy()


def test_dbos_worker_recovers_its_executors_pending_workflow(postgres_url: str, tmp_path: Path) -> None:
    """`durcap run --engine dbos` killed mid-tool leaves its workflow PENDING under its own executor id (printed at
    start); no later run touches it. `durcap worker dbos --executor-id THAT_ID` recovers it at start and finishes it:
    each checkpointed step once, no model request repeated."""
    from tests.engines.test_crash import crash_env

    env, crash_dir = crash_env(tmp_path)
    env = env_with(**env)
    run = start(['run', CRASH, 'charge order A-1 and export', '--engine', 'dbos', '--db', postgres_url],
                tmp_path / 'run.log', env)
    worker = None
    try:
        line = wait_text(tmp_path / 'run.log', 'dbos workflow id:', run, 90)
        workflow_id = line.split('dbos workflow id: ')[1].split()[0]
        executor = line.split('(executor ')[1].split(';')[0]
        wait_file(crash_dir / 'slow-started', 90)
        kill9(run)
        worker = start(['worker', 'dbos', CRASH, '--db', postgres_url, '--executor-id', executor],
                       tmp_path / 'worker.log', env)
        line = wait_text(tmp_path / 'worker.log', 'dbos worker ready', worker, 90)
        assert f"executor '{executor}' (recovering 1 pending workflows)" in line, line
        wait_status(postgres_url, workflow_id, 'SUCCESS', 90)
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, (tmp_path / 'worker.log').read_text()
    finally:
        kill9(run)
        if worker is not None:
            kill9(worker)
    assert_exactly_once(crash_dir)
