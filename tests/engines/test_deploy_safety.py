"""Deploy safety on real servers: renames shown by the lockfile, replay and recovery with aliases.

Model: the scripted `FunctionModel` of `tests/engines/rename_agents.py`. Temporal: the session dev
server; DBOS: SQLite. Every `durcap` and driver process is a real subprocess stopped by pid.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from durable_capabilities.engines import DURABLE_ENGINES
from tests._helpers import ROOT, durcap, subprocess_env

pytestmark = pytest.mark.slow


TARGET = 'tests.engines.rename_agents:agent'


@pytest.fixture
def base_env(tmp_path: Path) -> dict[str, str]:
    return {'DURCAP_RENAME_AGENT': f'greeter-{uuid.uuid4().hex[:8]}', 'DURCAP_CRASH_DIR': str(tmp_path / 'effects')}


@pytest.fixture
def recorded_history(temporal_address: str, spawn, tmp_path: Path, base_env: dict[str, str]) -> Path:
    """A finished v1 workflow's history, exported with `durcap history export`."""
    from durable_capabilities.engines.temporal import (
        AgentRunInput,
        AgentRunOutput,
        connect,
    )

    queue = f'rename-{uuid.uuid4().hex[:8]}'
    env = base_env | {'DURCAP_RENAME_VARIANT': 'v1'}
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue, env=env)
    worker.wait_for('WORKER READY', 90)
    workflow_id = f'rename-{uuid.uuid4()}'

    async def record() -> AgentRunOutput:
        client = await connect(temporal_address)
        return await client.execute_workflow(
            f'durcap.{env["DURCAP_RENAME_AGENT"]}', AgentRunInput(prompt='greet ada'),
            id=workflow_id, task_queue=queue, result_type=AgentRunOutput,
        )

    assert asyncio.run(record()).output == 'greeted'
    worker.stop()
    path = tmp_path / 'history.json'
    result = durcap('history', 'export', '--workflow-id', workflow_id, '-o', str(path), '--address', temporal_address, env=env)
    assert result.returncode == 0, result.stderr
    return path


def test_replay_of_recorded_history_passes_on_the_same_code(recorded_history: Path, base_env: dict[str, str]) -> None:
    result = durcap('replay', str(recorded_history), '--target', TARGET, env=base_env | {'DURCAP_RENAME_VARIANT': 'v1'})
    assert result.returncode == 0, result.stdout + result.stderr
    assert '1 of 1 histories replay' in result.stderr


def test_replay_after_capability_rename_fails_naming_the_capability(recorded_history: Path, base_env: dict[str, str]) -> None:
    result = durcap('replay', str(recorded_history), '--target', TARGET, env=base_env | {'DURCAP_RENAME_VARIANT': 'v2'})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "leaf toolset 'greet'" in result.stdout
    assert "aliases={'<new id>': 'greet'}" in result.stdout


def test_replay_after_capability_rename_passes_with_the_alias(recorded_history: Path, base_env: dict[str, str]) -> None:
    result = durcap('replay', str(recorded_history), '--target', TARGET, env=base_env | {'DURCAP_RENAME_VARIANT': 'v2-alias'})
    assert result.returncode == 0, result.stdout + result.stderr


def test_replay_after_agent_rename_fails_then_passes_with_previous_names(recorded_history: Path, base_env: dict[str, str]) -> None:
    renamed = durcap('replay', str(recorded_history), '--target', TARGET, env=base_env | {'DURCAP_RENAME_VARIANT': 'agent-v2'})
    assert renamed.returncode == 1, renamed.stdout + renamed.stderr
    declared = durcap('replay', str(recorded_history), '--target', TARGET,
                      env=base_env | {'DURCAP_RENAME_VARIANT': 'agent-v2-alias'})
    assert declared.returncode == 0, declared.stdout + declared.stderr


def test_lock_diff_shows_a_capability_rename_and_the_alias_clears_it(tmp_path: Path, base_env: dict[str, str]) -> None:
    lock = tmp_path / 'durable.lock'
    made = durcap('lock', TARGET, '-o', str(lock), env=base_env | {'DURCAP_RENAME_VARIANT': 'v1'})
    assert made.returncode == 0, made.stderr
    assert 'toolset__greet__call_tool' in lock.read_text()
    renamed = durcap('check', TARGET, '--lock', str(lock), env=base_env | {'DURCAP_RENAME_VARIANT': 'v2'})
    assert renamed.returncode == 1
    assert 'DC020' in renamed.stdout and "capability 'greet'" in renamed.stdout
    for engine in DURABLE_ENGINES:
        assert engine in renamed.stdout
    aliased = durcap('check', TARGET, '--lock', str(lock), env=base_env | {'DURCAP_RENAME_VARIANT': 'v2-alias'})
    assert aliased.returncode == 0, aliased.stdout


def test_lock_diff_shows_an_agent_rename(tmp_path: Path, base_env: dict[str, str]) -> None:
    lock = tmp_path / 'durable.lock'
    assert durcap('lock', TARGET, '-o', str(lock), env=base_env | {'DURCAP_RENAME_VARIANT': 'v1'}).returncode == 0
    renamed = durcap('check', TARGET, '--lock', str(lock), env=base_env | {'DURCAP_RENAME_VARIANT': 'agent-v2'})
    assert renamed.returncode == 1 and 'DC021' in renamed.stdout, renamed.stdout
    declared = durcap('check', TARGET, '--lock', str(lock), env=base_env | {'DURCAP_RENAME_VARIANT': 'agent-v2-alias'})
    assert declared.returncode == 0, declared.stdout


def test_worker_refuses_to_start_on_drift_unless_allowed(tmp_path: Path, base_env: dict[str, str], temporal_address: str) -> None:
    lock = tmp_path / 'durable.lock'
    assert durcap('lock', TARGET, '-o', str(lock), env=base_env | {'DURCAP_RENAME_VARIANT': 'v1'}).returncode == 0
    refused = durcap('worker', 'temporal', TARGET, '--lock', str(lock), '--address', temporal_address,
                     env=base_env | {'DURCAP_RENAME_VARIANT': 'v2'})
    assert refused.returncode == 1
    assert 'worker not started' in refused.stderr and 'DC020' in refused.stdout
    # With --allow-drift it starts (and we stop it by pid once it says so).
    proc = subprocess.Popen(
        [sys.executable, '-m', 'durable_capabilities.cli', 'worker', 'temporal', TARGET, '--lock', str(lock),
         '--address', temporal_address, '--allow-drift', '--task-queue', f'drift-{uuid.uuid4().hex[:6]}'],
        cwd=ROOT, env=subprocess_env({**base_env, 'DURCAP_RENAME_VARIANT': 'v2'}),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        seen = ''
        while time.monotonic() < deadline and 'worker ready' not in seen:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        assert 'worker ready' in seen, seen
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _dbos_effects(tmp_path: Path) -> Path:
    return tmp_path / 'effects'


@pytest.mark.parametrize('alias', [True, False])
def test_dbos_recovery_after_capability_rename(alias: bool, spawn, tmp_path: Path, base_env: dict[str, str]) -> None:
    """Kill a v1 DBOS process mid-tool, restart the renamed code: with the alias it completes; without, it cannot."""
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    workflow_id = f'rename-{uuid.uuid4()}'
    args = ('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', workflow_id, '--prompt', 'greet ada')
    first = spawn(*args, env=base_env | {'DURCAP_RENAME_VARIANT': 'v1', 'DURCAP_RENAME_SLOW': '1'})
    deadline = time.monotonic() + 90
    while not (_dbos_effects(tmp_path) / 'slow-started').exists():
        assert time.monotonic() < deadline, first.text()
        time.sleep(0.1)
    first.kill9()
    second = spawn(*args, env=base_env | {'DURCAP_RENAME_VARIANT': 'v2-alias' if alias else 'v2', 'DURCAP_RENAME_SLOW': '1'})
    if alias:
        report = second.report(timeout=120)
        assert report['output'] == 'greeted'
        assert (_dbos_effects(tmp_path) / 'hellos').read_text().splitlines() == ['ada']
    else:
        second.popen.wait(timeout=120)
        assert second.popen.returncode != 0
        assert 'REPORT' not in second.text()
        assert 'DBOSUnexpectedStepError' in second.text()


def test_prefect_resume_after_capability_rename_with_alias(prefect_api_url: str, spawn, tmp_path: Path, base_env: dict[str, str]) -> None:
    """Documented limit: on Prefect a flow run resumed with the renamed code completes, but nothing replays
    from cache. A task's cache key hashes its inputs, and the capability id is in them (tool definitions,
    the catalog in the instructions), so every model request and tool after the rename runs again,
    side effects included. The alias keeps Temporal and DBOS recoverable; on Prefect, drain flow runs
    before renaming (docs/concepts/lockfile.md). If upstream ever keys tasks without the capability
    id, this test fails and the limit can be lifted."""
    env = base_env | {
        'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
        'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'prefect-results'), 'DURCAP_RENAME_SLOW': '1',
    }
    first = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'greet ada', env=env | {'DURCAP_RENAME_VARIANT': 'v1'})
    flow_run_id = first.wait_for('PREFECT FLOW RUN', 90).split()[-1]
    deadline = time.monotonic() + 90
    while not (_dbos_effects(tmp_path) / 'slow-started').exists():
        assert time.monotonic() < deadline, first.text()
        time.sleep(0.1)
    first.kill9()
    second = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'greet ada', '--flow-run-id', flow_run_id,
                   env=env | {'DURCAP_RENAME_VARIANT': 'v2-alias'})
    report = second.report(timeout=180)
    assert report['output'] == 'greeted'
    hellos = (_dbos_effects(tmp_path) / 'hellos').read_text().splitlines()
    requests = (_dbos_effects(tmp_path) / 'model-requests').read_text().splitlines()
    print(f'prefect rename resume: hello ran {len(hellos)}x, model requests {requests}')
    assert requests[:3] == ['0', '1', '2'] and requests[3:] == ['0', '1', '2', '3'], requests
    assert hellos == ['ada', 'ada']


def test_dbos_recovery_after_agent_rename_with_previous_names(spawn, tmp_path: Path, base_env: dict[str, str]) -> None:
    """Kill a DBOS process (SIGKILL) while a tool of agent `greeter-…` runs; relaunch the same workflow id with the agent
    renamed to `greeter-…-v2` and `previous_names=['greeter-…']`: the run completes, the earlier tool ran once.

    Registering the old name as a second DBOS workflow used to change DBOS's application version (a hash of the
    registered workflows' sources), so the relaunched process never recovered the pending workflow."""
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    workflow_id = f'rename-{uuid.uuid4()}'
    args = ('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', workflow_id, '--prompt', 'greet ada')
    first = spawn(*args, env=base_env | {'DURCAP_RENAME_VARIANT': 'v1', 'DURCAP_RENAME_SLOW': '1'})
    version = first.wait_for('DBOS APPLICATION VERSION', 90).split()[-1]
    deadline = time.monotonic() + 90
    while not (_dbos_effects(tmp_path) / 'slow-started').exists():
        assert time.monotonic() < deadline, first.text()
        time.sleep(0.1)
    first.kill9()
    second = spawn(*args, env=base_env | {'DURCAP_RENAME_VARIANT': 'agent-v2-alias', 'DURCAP_RENAME_SLOW': '1'})
    assert second.wait_for('DBOS APPLICATION VERSION', 90).split()[-1] == version
    report = second.report(timeout=120)
    assert report['output'] == 'greeted'
    assert (_dbos_effects(tmp_path) / 'hellos').read_text().splitlines() == ['ada']
    assert f'{base_env["DURCAP_RENAME_AGENT"]}__function_toolset__greet.call_tool' in report['units']


def test_temporal_recovery_after_agent_rename_with_previous_names(
    temporal_address: str, spawn, tmp_path: Path, base_env: dict[str, str]
) -> None:
    """A workflow of agent `greeter-…` whose worker is killed (SIGKILL) mid-tool finishes on a worker of the renamed
    agent `greeter-…-v2` with `previous_names=['greeter-…']` on the same task queue; the earlier tool ran once.
    Both workers use Worker Versioning as `durcap worker temporal` does: the rename keeps the build id, so the run,
    pinned to it, may continue on the new worker."""
    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput, connect

    queue = f'rename-{uuid.uuid4().hex[:8]}'
    env = base_env | {'DURCAP_RENAME_SLOW': '1'}
    old = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue,
                '--versioned', env=env | {'DURCAP_RENAME_VARIANT': 'v1'})
    old_build = old.wait_for('WORKER READY', 90).split()[-1]

    async def start() -> str:
        client = await connect(temporal_address)
        handle = await client.start_workflow(f'durcap.{env["DURCAP_RENAME_AGENT"]}', AgentRunInput(prompt='greet ada'),
                                             id=f'rename-{uuid.uuid4()}', task_queue=queue)
        return handle.id

    workflow_id = asyncio.run(start())
    deadline = time.monotonic() + 90
    while not (_dbos_effects(tmp_path) / 'slow-started').exists():
        assert time.monotonic() < deadline, old.text()
        time.sleep(0.1)
    old.kill9()
    new = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue,
                '--versioned', env=env | {'DURCAP_RENAME_VARIANT': 'agent-v2-alias'})
    assert new.wait_for('WORKER READY', 90).split()[-1] == old_build != 'unversioned'

    async def finish() -> AgentRunOutput:
        client = await connect(temporal_address)
        return await client.get_workflow_handle(workflow_id, result_type=AgentRunOutput).result()

    assert asyncio.run(asyncio.wait_for(finish(), 180)).output == 'greeted'
    assert (_dbos_effects(tmp_path) / 'hellos').read_text().splitlines() == ['ada']


def test_prefect_resume_after_agent_rename_with_previous_names(
    prefect_api_url: str, spawn, tmp_path: Path, base_env: dict[str, str]
) -> None:
    """A Prefect flow run of agent `greeter-…` killed (SIGKILL) mid-tool, run again by the renamed agent with
    `previous_names`: it completes and the finished model requests and tool replay from Prefect's cache (the kept
    durable name keeps the task cache keys), so `hello` ran once."""
    env = base_env | {
        'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
        'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'prefect-results'), 'DURCAP_RENAME_SLOW': '1',
    }
    first = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'greet ada', env=env | {'DURCAP_RENAME_VARIANT': 'v1'})
    flow_run_id = first.wait_for('PREFECT FLOW RUN', 90).split()[-1]
    deadline = time.monotonic() + 90
    while not (_dbos_effects(tmp_path) / 'slow-started').exists():
        assert time.monotonic() < deadline, first.text()
        time.sleep(0.1)
    first.kill9()
    second = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'greet ada', '--flow-run-id', flow_run_id,
                   env=env | {'DURCAP_RENAME_VARIANT': 'agent-v2-alias'})
    report = second.report(timeout=180)
    assert report['output'] == 'greeted'
    requests = (_dbos_effects(tmp_path) / 'model-requests').read_text().splitlines()
    assert requests == ['0', '1', '2', '3'], requests  # the second process ran only the last request
    assert (_dbos_effects(tmp_path) / 'hellos').read_text().splitlines() == ['ada']
