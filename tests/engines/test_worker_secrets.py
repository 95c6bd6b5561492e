"""Run deps marked secret (`WorkerSecret`) stay out of every engine's records (issue 12, item 4).

The caller passes `{"account": "acct-…", "api_key": {"secret": "<variable name>"}}`; only the worker process has
the variable. Each test checks that the tool resolved the real value in the worker (its SHA-256 in the ledger),
that the value appears nowhere in the engine's records (`temporal workflow show -o json`, every table of the
DBOS system database, the Prefect flow run's parameters), and, as a control that the search can find deps, that
the plain `account` value does. Model: the scripted `FunctionModel` of `tests/engines/secret_agent.py`. Servers:
the session's Temporal dev server and Prefect server; DBOS on SQLite. Processes are stopped by pid.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities.engines.temporal import temporal_cli

pytestmark = pytest.mark.slow

TARGET = 'tests.engines.secret_agent:agent'


@pytest.fixture
def case(tmp_path: Path) -> dict[str, Any]:
    variable = f'DURCAP_TEST_KEY_{uuid.uuid4().hex[:6].upper()}'
    secret = f'sk-live-{uuid.uuid4().hex}'
    account = f'acct-{uuid.uuid4().hex[:8]}'
    env = {'DURCAP_SECRET_AGENT': f'payer-{uuid.uuid4().hex[:8]}', 'DURCAP_CRASH_DIR': str(tmp_path / 'effects'),
           variable: secret}
    deps = {'account': account, 'api_key': {'secret': variable}}
    return {'variable': variable, 'secret': secret, 'account': account, 'env': env, 'deps': deps, 'dir': tmp_path}


def assert_resolved_in_the_worker(case: dict[str, Any]) -> None:
    resolved = (case['dir'] / 'effects' / 'resolved').read_text().split()
    assert resolved == [hashlib.sha256(case['secret'].encode()).hexdigest()]


def assert_kept_out(text: str, case: dict[str, Any]) -> None:
    assert case['account'] in text, 'control: the plain deps field should be found'
    assert case['variable'] in text, 'the secret travels by name'
    assert case['secret'] not in text


def test_temporal_workflow_show_has_no_secret(temporal_address: str, spawn, case: dict[str, Any]) -> None:
    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput, connect

    queue = f'secrets-{uuid.uuid4().hex[:8]}'
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue,
                   env=case['env'])
    worker.wait_for('WORKER READY', 90)
    workflow_id = f'secrets-{uuid.uuid4()}'

    async def run() -> AgentRunOutput:
        client = await connect(temporal_address)
        return await client.execute_workflow(
            f'durcap.{case["env"]["DURCAP_SECRET_AGENT"]}', AgentRunInput(prompt='charge A-1', deps=case['deps']),
            id=workflow_id, task_queue=queue, result_type=AgentRunOutput,
        )

    assert asyncio.run(run()).output == f'charged A-1 on {case["account"]}'
    worker.stop()
    assert_resolved_in_the_worker(case)
    shown = subprocess.run([temporal_cli(), 'workflow', 'show', '-w', workflow_id, '-o', 'json', '--address',
                            temporal_address], capture_output=True, text=True, timeout=60, check=True).stdout
    # Payloads are base64 JSON in `workflow show`; search both the raw text and the decoded payloads.
    decoded = shown + ''.join(_decoded_payloads(json.loads(shown)))
    assert_kept_out(decoded, case)


def _decoded_payloads(value: Any) -> list[str]:
    import base64

    found: list[str] = []
    if isinstance(value, dict):
        if isinstance(value.get('data'), str) and 'metadata' in value:
            try:
                found.append(base64.b64decode(value['data']).decode('utf-8', 'replace'))
            except ValueError:
                pass
        for item in value.values():
            found.extend(_decoded_payloads(item))
    elif isinstance(value, list):
        for item in value:
            found.extend(_decoded_payloads(item))
    return found


def test_dbos_system_database_has_no_secret(spawn, case: dict[str, Any]) -> None:
    db_path = case['dir'] / 'dbos.sqlite'
    proc = spawn('dbos', 'run', '--target', TARGET, '--db', f'sqlite:///{db_path}', '--workflow-id',
                 f'secrets-{uuid.uuid4()}', '--prompt', 'charge A-1', '--deps-json', json.dumps(case['deps']),
                 env=case['env'])
    assert proc.report(timeout=120)['output'] == f'charged A-1 on {case["account"]}'
    proc.popen.wait(timeout=60)
    assert_resolved_in_the_worker(case)
    assert_kept_out(_all_text(db_path), case)


def _all_text(db_path: Path) -> str:
    """Every value of every table of a SQLite database, as text (blobs decoded as UTF-8, and base64 tried)."""
    import base64
    import binascii

    parts: list[str] = []
    with sqlite3.connect(db_path) as conn:
        tables = [row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        for table in tables:
            for row in conn.execute(f'SELECT * FROM "{table}"'):
                for value in row:
                    text = value.decode('utf-8', 'replace') if isinstance(value, bytes) else str(value)
                    parts.append(text)
                    try:
                        parts.append(base64.b64decode(text, validate=True).decode('utf-8', 'replace'))
                    except (binascii.Error, ValueError):
                        pass
    assert len(tables) > 3, tables
    return '\n'.join(parts)


def test_prefect_flow_run_parameters_have_no_secret(prefect_api_url: str, spawn, case: dict[str, Any]) -> None:
    import httpx

    env = case['env'] | {'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(case['dir'] / 'prefect-home'),
                         'PREFECT_LOCAL_STORAGE_PATH': str(case['dir'] / 'prefect-results')}
    proc = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'charge A-1', '--deps-json', json.dumps(case['deps']),
                 env=env)
    report = proc.report(timeout=180)
    assert report['output'] == f'charged A-1 on {case["account"]}'
    assert_resolved_in_the_worker(case)
    flow_run = httpx.get(f'{prefect_api_url}/flow_runs/{report["flow_run_id"]}', timeout=30).json()
    assert_kept_out(json.dumps(flow_run['parameters']), case)
    task_runs = httpx.post(f'{prefect_api_url}/task_runs/filter', timeout=30,
                           json={'flow_runs': {'id': {'any_': [report['flow_run_id']]}}}).json()
    assert task_runs and case['secret'] not in json.dumps(task_runs)
