"""A deferred capability built from toolset functions runs durably on every engine (issue 12, item 2).

`Capability(id='stock', toolsets=[counting_tools, pricing_tools], defer_loading=True)` used to be accepted and then
fail every run on every engine ("DynamicToolset 'stock_0' cannot be added at runtime"). Model: the scripted
`FunctionModel` of `tests/engines/toolset_func_agent.py`. Servers: the session's Temporal dev server and Prefect
server; DBOS on SQLite. Engine code runs in driver subprocesses stopped by pid.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TARGET = 'tests.engines.toolset_func_agent:agent'
ANSWER = '3 units at 9.50 EUR'


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {'DURCAP_TOOLSET_AGENT': f'stock-{uuid.uuid4().hex[:8]}', 'DURCAP_CRASH_DIR': str(tmp_path / 'effects')}


def tool_calls(tmp_path: Path) -> list[str]:
    return (tmp_path / 'effects' / 'tool-calls').read_text().splitlines()


def test_toolset_functions_run_as_temporal_activities(temporal_address: str, spawn, tmp_path: Path, env: dict[str, str]) -> None:
    from temporalio.client import WorkflowHistory

    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput, connect

    queue = f'toolset-fn-{uuid.uuid4().hex[:8]}'
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue, env=env)
    worker.wait_for('WORKER READY', 90)
    name = env['DURCAP_TOOLSET_AGENT']

    async def run() -> tuple[AgentRunOutput, WorkflowHistory]:
        client = await connect(temporal_address)
        handle = await client.start_workflow(f'durcap.{name}', AgentRunInput(prompt='stock of A-1?'),
                                             id=f'toolset-fn-{uuid.uuid4()}', task_queue=queue, result_type=AgentRunOutput)
        output = await handle.result()
        return output, await handle.fetch_history()

    output, history = asyncio.run(run())
    worker.stop()
    assert output.output == ANSWER
    activities = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history.events
                  if e.HasField('activity_task_scheduled_event_attributes')]
    assert f'agent__{name}__dynamic_toolset__stock_0__call_tool' in activities
    assert f'agent__{name}__dynamic_toolset__stock_1__call_tool' in activities
    assert tool_calls(tmp_path) == ['count_units A-1', 'price_of A-1']


def test_toolset_functions_run_as_dbos_steps(spawn, tmp_path: Path, env: dict[str, str]) -> None:
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    proc = spawn('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', f'toolset-fn-{uuid.uuid4()}',
                 '--prompt', 'stock of A-1?', env=env)
    report = proc.report(timeout=120)
    name = env['DURCAP_TOOLSET_AGENT']
    assert report['output'] == ANSWER
    assert f'{name}__dynamic_toolset__stock_0.call_tool' in report['units']
    assert f'{name}__dynamic_toolset__stock_1.call_tool' in report['units']
    assert tool_calls(tmp_path) == ['count_units A-1', 'price_of A-1']


def test_toolset_functions_run_as_prefect_tasks(prefect_api_url: str, spawn, tmp_path: Path, env: dict[str, str]) -> None:
    env = env | {'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
                 'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'prefect-results')}
    proc = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'stock of A-1?', env=env)
    report = proc.report(timeout=180)
    assert report['output'] == ANSWER
    names = task_run_names(prefect_api_url, report['flow_run_id'], expected=('Call Tool: count_units', 'Call Tool: price_of'))
    assert any(n.startswith('Discover Tools: stock_0') for n in names), names
    assert any(n.startswith('Discover Tools: stock_1') for n in names), names
    assert tool_calls(tmp_path) == ['count_units A-1', 'price_of A-1']


def task_run_names(api_url: str, flow_run_id: str, expected: tuple[str, ...], timeout: float = 60) -> list[str]:
    """The flow run's task run names once every `expected` prefix is among them (Prefect records task runs from
    events, after the flow run returns)."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    while True:
        runs = httpx.post(f'{api_url}/task_runs/filter', json={'flow_runs': {'id': {'any_': [flow_run_id]}}},
                          timeout=30).json()
        names = sorted(run['name'] for run in runs)
        if all(any(n.startswith(prefix) for n in names) for prefix in expected) or time.monotonic() > deadline:
            assert all(any(n.startswith(prefix) for n in names) for prefix in expected), names
            return names
        time.sleep(0.5)
