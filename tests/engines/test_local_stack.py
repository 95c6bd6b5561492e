"""deploy/local/: bring the process stack up for real, run the support demo on each engine against it,
check that each worker serves its engine, and bring it down with no process of it left.

The stack gets its own state folder, free ports and a fresh PostgreSQL database (dropped afterwards),
so it never touches a developer's own `.durcap/stack/`. Whatever happens, the module fixture stops
every process of the stack by process id (`deploy/local/down`, then SIGKILL by pid for anything left)
and fails if one survives.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities._servers import free_port
from durable_capabilities.engines import DURABLE_ENGINES
from tests._helpers import DURCAP, ROOT, subprocess_env

LOCAL = ROOT / 'deploy' / 'local'
PG_BASE = 'postgresql://postgres@127.0.0.1:5432'
NAMES = ('temporal', 'prefect', 'temporal-worker', 'dbos-app', 'prefect-flows')
PROMPT = 'Where is my order ABC-123? It should have arrived by now.'
ANSWER = 'Order ABC-123: Blue denim jacket (size M): shipped 2026-04-28 via UPS, arriving 2026-05-02.'

# One worker runs this module's tests (pytest-xdist `loadgroup`): they share a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.xdist_group('local-stack')]


# ---- processes, read from /proc independently of deploy/local/stack.py ----------------------------


def stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """`(state, ppid, pgid, sid, start time)` of a process that runs (not a zombie), else `None`."""
    try:
        raw = Path(f'/proc/{pid}/stat').read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    f = raw[raw.rindex(')') + 2:].split()
    return None if f[0] in 'ZX' else (f[0], int(f[1]), int(f[2]), int(f[3]), int(f[19]))


def tree(roots: set[int]) -> set[int]:
    """Running processes that are `roots`, in their process groups or sessions, or descend from them."""
    stats = {int(p.name): s for p in Path('/proc').iterdir() if p.name.isdigit() and (s := stat(int(p.name)))}
    found = {pid for pid, s in stats.items() if pid in roots or s[2] in roots or s[3] in roots}
    while extra := {pid for pid, s in stats.items() if s[1] in found and pid not in found}:
        found |= extra
    return found


def running(pid: int, start_time: int | None = None) -> bool:
    s = stat(pid)
    return s is not None and (start_time is None or s[4] == start_time)


@dataclass
class Stack:
    directory: Path
    env: dict[str, str]
    database: str
    seen: dict[int, int] = field(default_factory=dict)
    """`{pid: start time}` of every process of the stack observed while it ran (recorded pids, their
    groups, their children)."""

    @property
    def state(self) -> dict[str, Any]:
        return json.loads((self.directory / 'state.json').read_text())

    @property
    def addresses(self) -> dict[str, str]:
        return self.state['addresses']

    def pid(self, name: str) -> int:
        return self.state['processes'][name]['pid']

    def observe(self) -> None:
        processes = self.state['processes']
        for pid in {p['pid'] for p in processes.values()} | tree({p['pid'] for p in processes.values()}):
            if (s := stat(pid)) is not None:
                self.seen.setdefault(pid, s[4])

    def still_running(self) -> set[int]:
        return {pid for pid, start in self.seen.items() if running(pid, start)}

    def script(self, name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(LOCAL / name), *args], check=False, cwd=ROOT, env=self.env, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)


def durcap(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`durcap` with exactly `env` (`clean_env()`: no variable pointing at another server), not `_helpers.durcap`'s."""
    return subprocess.run([*DURCAP, *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def python(code: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, '-c', code], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def clean_env() -> dict[str, str]:
    """This environment without anything that would point a process at another server."""
    return subprocess_env({'PREFECT_SERVER_ANALYTICS_ENABLED': 'false'}, unset=(
        'PREFECT_API_URL', 'DURCAP_TEMPORAL_ADDRESS', 'TEMPORAL_ADDRESS', 'DBOS_SYSTEM_DATABASE_URL',
        'DURCAP_TASK_QUEUE', 'DURCAP_DBOS_QUEUE', 'DURCAP_TARGET', 'DURCAP_READY_FILE', 'SUPPORT_MODEL'))


def drop_database(name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(f'{PG_BASE}/postgres', autocommit=True) as conn:
        conn.execute(sql.SQL('DROP DATABASE IF EXISTS {} WITH (FORCE)').format(sql.Identifier(name)))


@pytest.fixture(scope='module')
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    directory = tmp_path_factory.mktemp('stack')
    database = f'durcap_stack_test_{uuid.uuid4().hex[:10]}'
    env = clean_env() | {
        'DURCAP_STACK_DIR': str(directory),
        'DURCAP_STACK_TEMPORAL_PORT': str(free_port()),
        'DURCAP_STACK_PREFECT_PORT': str(free_port()),
        'DURCAP_STACK_DATABASE': database,
        'DURCAP_PYTHON': sys.executable,
    }
    s = Stack(directory, env, database)
    try:
        up = s.script('up')
        if (directory / 'state.json').exists():
            s.observe()
        assert up.returncode == 0, up.stdout + up.stderr
        s.up_output = up.stdout  # type: ignore[attr-defined]
        yield s
    finally:
        if (directory / 'state.json').exists() and s.state['processes']:
            s.observe()
            s.script('down', timeout=120)
        # Safety net: SIGKILL by pid whatever of the stack is left, then fail loudly.
        left = s.still_running()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        with contextlib.suppress(Exception):  # best effort; a leftover test database is harmless
            drop_database(database)
        assert not left, f'processes of the stack were still running after down and were killed: {sorted(left)}'


# ---- up -----------------------------------------------------------------------------------------


def test_up_starts_every_process_and_prints_the_addresses(stack: Stack) -> None:
    state = stack.state
    assert set(state['processes']) == set(NAMES)
    for name in NAMES:
        entry = state['processes'][name]
        assert running(entry['pid'], entry['start_time']), name
        assert (stack.directory / f'{name}.pid').read_text().strip() == str(entry['pid'])
    a = state['addresses']
    port_t, port_p = stack.env['DURCAP_STACK_TEMPORAL_PORT'], stack.env['DURCAP_STACK_PREFECT_PORT']
    assert a['temporal'] == f'127.0.0.1:{port_t}'
    assert a['prefect'] == f'http://127.0.0.1:{port_p}/api'
    assert a['postgres'] == f'{PG_BASE}/{stack.database}'
    out = stack.up_output  # type: ignore[attr-defined]
    for address in a.values():
        assert address in out
    env_file = (stack.directory / 'env').read_text()
    assert f'export DURCAP_TEMPORAL_ADDRESS={a["temporal"]}' in env_file
    assert f'export PREFECT_API_URL={a["prefect"]}' in env_file
    assert f'export DBOS_SYSTEM_DATABASE_URL={a["postgres"]}' in env_file
    with urllib.request.urlopen(f'{a["prefect"]}/health', timeout=5) as response:
        assert response.status == 200
    stack.observe()


def test_up_is_idempotent(stack: Stack) -> None:
    before = {n: (p['pid'], p['start_time']) for n, p in stack.state['processes'].items()}
    again = stack.script('up')
    assert again.returncode == 0, again.stdout + again.stderr
    for name in NAMES:
        assert f'{name}: already running (pid {before[name][0]})' in again.stdout
    after = {n: (p['pid'], p['start_time']) for n, p in stack.state['processes'].items()}
    assert after == before
    status = stack.script('status')
    assert status.returncode == 0, status.stdout
    assert status.stdout.count(' running ') == len(NAMES)


# ---- `durcap demo --engine E` against the stack's servers --------------------------------------------


DEMO_UNITS = {
    'temporal': 'agent__support__toolset__orders__call_tool',
    'dbos': 'support__function_toolset__orders.call_tool',
    'prefect': 'orders.order_status',  # the tool task run's name: capability.tool
}


def test_demo_units_name_every_durable_engine() -> None:
    """`DEMO_UNITS` has an entry for each durable engine, so a new engine's demo cannot go unchecked."""
    assert set(DEMO_UNITS) == set(DURABLE_ENGINES)


def demo_args(stack: Stack, engine: str) -> tuple[list[str], dict[str, str]]:
    a = stack.addresses
    if engine == 'temporal':
        return ['--address', a['temporal']], stack.env
    if engine == 'dbos':
        return ['--db', a['postgres']], stack.env
    return [], stack.env | {'PREFECT_API_URL': a['prefect']}


def temporal_cli(*args: str) -> Any:
    from durable_capabilities.engines.temporal import temporal_cli as cli

    result = subprocess.run([cli(), *args, '--output', 'json'], check=False, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip() else []


def prefect_flow_runs(api: str, flow_name: str) -> list[dict[str, Any]]:
    body = json.dumps({'flows': {'name': {'any_': [flow_name]}}}).encode()
    request = urllib.request.Request(f'{api}/flow_runs/filter', data=body, headers={'Content-Type': 'application/json'})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def dbos_workflows(url: str) -> list[tuple[str, str, str | None]]:
    import psycopg

    with psycopg.connect(url) as conn:
        rows = conn.execute('SELECT workflow_uuid, status, queue_name FROM dbos.workflow_status '
                            "WHERE name = 'durcap.support' ORDER BY created_at").fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


@pytest.mark.parametrize('engine', DURABLE_ENGINES)
def test_demo_runs_against_the_stack(stack: Stack, engine: str) -> None:
    args, env = demo_args(stack, engine)
    result = durcap('demo', '--engine', engine, *args, env=env)
    stack.observe()
    assert result.returncode == 0, result.stdout + result.stderr
    assert f'answer ({engine}): {ANSWER}' in result.stdout
    assert 'capabilities loaded in this run: orders' in result.stdout
    assert DEMO_UNITS[engine] in result.stdout
    assert 'starting the embedded dev server' not in result.stderr  # the stack's server, not a new one
    a = stack.addresses
    # The run is recorded by the stack's own server / database.
    if engine == 'temporal':
        runs = temporal_cli('workflow', 'list', '--address', a['temporal'], '--query', "WorkflowType='durcap.support'")
        assert any(r.get('taskQueue') == 'durcap-demo' and r.get('status') == 'WORKFLOW_EXECUTION_STATUS_COMPLETED'
                   for r in runs), runs
    elif engine == 'dbos':
        assert any(status == 'SUCCESS' and queue is None for _, status, queue in dbos_workflows(a['postgres']))
    else:
        runs = prefect_flow_runs(a['prefect'], 'durcap-support')
        assert any(r['state_type'] == 'COMPLETED' and r['deployment_id'] is None for r in runs), runs


# ---- each worker serves its engine --------------------------------------------------------------


def store_json() -> str:
    code = ('from pydantic_core import to_json; from examples.support.agent import make_store; '
            'print(to_json(make_store()).decode())')
    result = python(code, clean_env())
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_temporal_worker_serves_the_task_queue(stack: Stack) -> None:
    a = stack.addresses
    result = durcap('run', 'examples.support.agent:support', PROMPT, '--engine', 'temporal', '--address', a['temporal'],
                    '--task-queue', 'durcap', '--deps-json', store_json(), env=stack.env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f'answer (temporal): {ANSWER}' in result.stdout
    runs = temporal_cli('workflow', 'list', '--address', a['temporal'], '--query', "TaskQueue='durcap'")
    assert len(runs) == 1, runs
    events = temporal_cli('workflow', 'show', '--address', a['temporal'], '--workflow-id', runs[0]['execution']['workflowId'])
    identities = {e[key]['identity'] for e in events['events'] for key in e
                  if key.endswith('EventAttributes') and isinstance(e[key], dict) and e[key].get('identity')
                  and key.startswith(('workflowTaskStarted', 'activityTaskStarted'))}
    worker_pid = stack.pid('temporal-worker')
    assert identities and all(i.startswith(f'{worker_pid}@') for i in identities), identities


DBOS_CLIENT = """
import json, sys
from dbos import DBOSClient
from pydantic_core import to_jsonable_python
from examples.support.agent import make_store
client = DBOSClient(system_database_url=sys.argv[1])
handle = client.enqueue({'workflow_name': 'durcap.support', 'queue_name': 'durcap'}, sys.argv[2],
                        to_jsonable_python(make_store()), None)
print(json.dumps({'id': handle.workflow_id, 'output': handle.get_result()['output']}))
client.destroy()
"""


def test_dbos_app_serves_its_queue(stack: Stack) -> None:
    url = stack.addresses['postgres']
    result = subprocess.run([sys.executable, '-c', DBOS_CLIENT, url, PROMPT], check=False, cwd=ROOT, env=stack.env,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload['output'] == ANSWER
    assert (payload['id'], 'SUCCESS', 'durcap') in dbos_workflows(url)  # dequeued and run by the stack's app


PREFECT_CLIENT = """
import asyncio, json, sys
from prefect.deployments import run_deployment
from pydantic_core import to_jsonable_python
from examples.support.agent import make_store

async def main():
    run = await run_deployment('durcap-support/support', timeout=240,
                               parameters={'prompt': sys.argv[1], 'deps': to_jsonable_python(make_store())})
    result = await run.state.result() if run.state.is_completed() else None
    print(json.dumps({'state': run.state.type.value, 'deployment_id': str(run.deployment_id),
                      'output': result and result['output']}))

asyncio.run(main())
"""


def test_prefect_flows_serve_the_deployment(stack: Stack) -> None:
    env = stack.env | {'PREFECT_API_URL': stack.addresses['prefect'], 'PREFECT_LOGGING_LEVEL': 'WARNING'}
    result = subprocess.run([sys.executable, '-c', PREFECT_CLIENT, PROMPT], check=False, cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    stack.observe()
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout.strip().splitlines()[-1])
    assert payload == {'state': 'COMPLETED', 'deployment_id': payload['deployment_id'], 'output': ANSWER}, payload
    assert 'durcap-support/support' in (stack.directory / 'prefect-flows.log').read_text()


# ---- every worker exits cleanly on SIGTERM ------------------------------------------------------------


@pytest.mark.parametrize('script', ['temporal_worker.py', 'dbos_app.py', 'prefect_flows.py'])
def test_worker_exits_0_on_sigterm(stack: Stack, script: str, tmp_path: Path) -> None:
    a = stack.addresses
    ready = tmp_path / 'ready'
    env = stack.env | {
        'DURCAP_READY_FILE': str(ready),
        'DURCAP_TEMPORAL_ADDRESS': a['temporal'],
        'DURCAP_TASK_QUEUE': f'sigterm-{uuid.uuid4().hex[:6]}',
        'DBOS_SYSTEM_DATABASE_URL': a['postgres'],
        'DURCAP_DBOS_QUEUE': 'durcap',
        'PREFECT_API_URL': a['prefect'],
    }
    log = tmp_path / 'worker.log'
    with open(log, 'wb') as out:
        process = subprocess.Popen([sys.executable, str(ROOT / 'workers' / script)], cwd=ROOT, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f'{script} not ready:\n{log.read_text()}'
            time.sleep(0.3)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=45) == 0, log.read_text()
        assert not ready.exists()  # removed on the way out
        assert 'Traceback' not in log.read_text(), log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert not tree({process.pid}), 'the worker left children behind'


# ---- down ---------------------------------------------------------------------------------------


def test_down_stops_every_process_by_pid(stack: Stack) -> None:
    stack.observe()
    recorded = stack.state['processes']
    assert set(recorded) == set(NAMES)
    result = stack.script('down', timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'durcap local stack is down' in result.stdout
    for name, entry in recorded.items():
        assert not running(entry['pid'], entry['start_time']), f'{name} (pid {entry["pid"]}) still runs'
        assert not (stack.directory / f'{name}.pid').exists()
    assert not stack.still_running(), 'a process of the stack is still running'
    assert not tree({e['pid'] for e in recorded.values()}), 'a child of the stack is still running'
    assert stack.state['processes'] == {}
    # PostgreSQL is the machine's own cluster: still up.
    assert subprocess.run(['pg_isready', '-q', '-h', '127.0.0.1', '-p', '5432'], check=False).returncode == 0
    again = stack.script('down', timeout=60)
    assert again.returncode == 0 and 'durcap local stack is down' in again.stdout
