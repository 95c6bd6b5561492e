"""Crash tests: SIGKILL the process during a slow capability tool that follows a counted side effect.

Model: the scripted `FunctionModel` of `tests/engines/crash_agent.py`. Real servers: Temporal dev
server, DBOS on SQLite and on PostgreSQL, Prefect server. On every engine the run completes after a
restart, the `charge` tool ran exactly once, and no model request from before the crash ran again.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests._helpers import wait_for_file

pytestmark = pytest.mark.slow

TARGET = 'tests.engines.crash_agent:agent'


def crash_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    crash_dir = tmp_path / 'crash'
    return {'DURCAP_CRASH_DIR': str(crash_dir), 'DURCAP_CRASH_AGENT': f'crashy-{uuid.uuid4().hex[:8]}'}, crash_dir


wait_file = wait_for_file  # the name other modules import


def assert_exactly_once(crash_dir: Path) -> None:
    assert (crash_dir / 'charges').read_text().splitlines() == ['A-1'], 'the charge side effect ran more than once'
    requests = (crash_dir / 'model-requests').read_text().splitlines()
    assert requests == ['0', '1', '2', '3'], f'a model request ran again after the crash: {requests}'


def test_temporal_worker_killed_mid_tool_recovers_on_the_heartbeat_timeout(temporal_address: str, spawn, tmp_path: Path) -> None:
    """SIGKILL of the worker inside `slow_export`, a new worker: the run completes with `charge` once, and the killed
    tool's retry is the one its heartbeat timeout started (attempt 2, last failure a HEARTBEAT timeout), not a
    start-to-close timeout. An event check in the history (was: recovery under 15 s of wall time)."""
    from durable_capabilities.engines.temporal import (
        AgentRunInput,
        AgentRunOutput,
        connect,
    )

    env, crash_dir = crash_env(tmp_path)
    queue = f'crash-{uuid.uuid4().hex[:8]}'
    args = ('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue)
    first = spawn(*args, env=env)
    first.wait_for('WORKER READY', 90)

    async def scenario() -> tuple[AgentRunOutput, list[Any]]:
        client = await connect(temporal_address)
        handle = await client.start_workflow(
            f'durcap.{env["DURCAP_CRASH_AGENT"]}', AgentRunInput(prompt='charge order A-1 and export'),
            id=f'crash-{uuid.uuid4()}', task_queue=queue, result_type=AgentRunOutput,
        )
        await asyncio.to_thread(wait_file, crash_dir / 'slow-started', 60)
        first.kill9()
        second = spawn(*args, env=env)
        await asyncio.to_thread(second.wait_for, 'WORKER READY', 90)
        result = await asyncio.wait_for(handle.result(), 120)
        history = await handle.fetch_history()
        return result, [e.activity_task_started_event_attributes for e in history.events
                        if e.HasField('activity_task_started_event_attributes')]

    result, started = asyncio.run(scenario())
    assert result.output == 'charged and exported'
    assert_exactly_once(crash_dir)
    from temporalio.api.enums.v1 import TimeoutType

    def heartbeat_lost(attributes: Any) -> bool:
        failure = attributes.last_failure
        return failure.HasField('timeout_failure_info') and \
            failure.timeout_failure_info.timeout_type == TimeoutType.TIMEOUT_TYPE_HEARTBEAT

    assert max(a.attempt for a in started) == 2, [a.attempt for a in started]
    assert [a.attempt for a in started if heartbeat_lost(a)] == [2], [(a.attempt, a.last_failure) for a in started]


def test_temporal_tool_of_killed_worker_reruns_on_the_polling_second_worker(
        temporal_address: str, spawn, tmp_path: Path) -> None:
    """Two workers poll the queue before the run starts; the one running `slow_export` gets SIGKILL. The tool's
    activity times out on its heartbeat and is re-run by the surviving worker (no new worker started), and the
    run completes: `charge` ran once, `slow_export` started twice (the aborted attempt in the killed process, the
    completed one in the survivor), and no model request ran again. Not timed (see bench/bench_recovery.py)."""
    from durable_capabilities.engines.temporal import (
        AgentRunInput,
        AgentRunOutput,
        connect,
    )

    env, crash_dir = crash_env(tmp_path)
    queue = f'crash2-{uuid.uuid4().hex[:8]}'
    args = ('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue)
    workers = [spawn(*args, env=env), spawn(*args, env=env)]
    for worker in workers:
        worker.wait_for('WORKER READY', 90)

    async def run() -> AgentRunOutput:
        client = await connect(temporal_address)
        handle = await client.start_workflow(
            f'durcap.{env["DURCAP_CRASH_AGENT"]}', AgentRunInput(prompt='charge order A-1 and export'),
            id=f'crash2-{uuid.uuid4()}', task_queue=queue, result_type=AgentRunOutput,
        )
        await asyncio.to_thread(wait_file, crash_dir / 'slow-started', 60)
        while not (crash_dir / 'slow-started').read_text():  # created, pid not yet written
            await asyncio.sleep(0.01)
        holder_pid = int((crash_dir / 'slow-started').read_text())
        (holder,) = [w for w in workers if w.popen.pid == holder_pid]
        holder.kill9()
        return await asyncio.wait_for(handle.result(), 60)

    result = asyncio.run(run())
    assert result.output == 'charged and exported'
    assert_exactly_once(crash_dir)
    holder_pid = int((crash_dir / 'slow-started').read_text())
    (survivor,) = [w for w in workers if w.popen.pid != holder_pid]
    assert survivor.popen.poll() is None, 'the second worker died'
    exports = (crash_dir / 'exports').read_text().splitlines()
    assert exports == [str(holder_pid), str(survivor.popen.pid)], f'slow_export ran in {exports}'


@pytest.mark.parametrize('backend', ['sqlite', 'postgres'])
def test_dbos_process_killed_mid_tool_recovers(backend: str, spawn, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}' if backend == 'sqlite' else request.getfixturevalue('postgres_url')
    env, crash_dir = crash_env(tmp_path)
    args = ('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', f'crash-{uuid.uuid4()}')
    first = spawn(*args, env=env)
    wait_file(crash_dir / 'slow-started', 90)
    first.kill9()
    second = spawn(*args, env=env)
    report = second.report(timeout=120)
    assert report['output'] == 'charged and exported'
    assert_exactly_once(crash_dir)
    name = env['DURCAP_CRASH_AGENT']
    assert f'{name}__function_toolset__ops.call_tool' in report['units']
    assert report['units'].count(f'{name}__model.request') == 4


def _seeds_with_different_set_order() -> tuple[str, str]:
    """Two PYTHONHASHSEED values under which `{'charge', 'slow_export'}` iterates in different orders."""
    import subprocess
    import sys

    orders = {}
    for seed in range(32):
        out = subprocess.run(
            [sys.executable, '-c', "print(list({'charge', 'slow_export'}))"],
            env={'PYTHONHASHSEED': str(seed)}, capture_output=True, text=True, check=True,
        ).stdout
        orders.setdefault(out, str(seed))
        if len(orders) == 2:
            return tuple(orders.values())  # type: ignore[return-value]
    raise AssertionError('no two seeds gave different orders')


def _prefect_crash(prefect_api_url: str, spawn, tmp_path: Path, extra_env: dict[str, str]) -> tuple[dict, Path]:
    env, crash_dir = crash_env(tmp_path)
    env |= {
        'PREFECT_API_URL': prefect_api_url,
        'PREFECT_HOME': str(tmp_path / 'prefect-home'),
        'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'prefect-results'),
        **extra_env,
    }
    first_seed, second_seed = _seeds_with_different_set_order()
    first = spawn('prefect', 'run', '--target', TARGET, env=env | {'PYTHONHASHSEED': first_seed})
    flow_run_id = first.wait_for('PREFECT FLOW RUN', 90).split()[-1]
    wait_file(crash_dir / 'slow-started', 90)
    first.kill9()
    second = spawn(
        'prefect', 'run', '--target', TARGET, '--flow-run-id', flow_run_id, env=env | {'PYTHONHASHSEED': second_seed}
    )
    report = second.report(timeout=180)
    assert report['output'] == 'charged and exported'
    assert report['flow_run_id'] == flow_run_id
    return report, crash_dir


def test_prefect_process_killed_mid_tool_resumes_flow_run(prefect_api_url: str, spawn, tmp_path: Path) -> None:
    """The resumed process runs under another hash seed, so set iteration order differs from the first."""
    _prefect_crash(prefect_api_url, spawn, tmp_path, {})
    assert_exactly_once(tmp_path / 'crash')


def test_prefect_upstream_cache_policy_repeats_requests_after_a_load(prefect_api_url: str, spawn, tmp_path: Path) -> None:
    """The gap we close, shown on upstream's own policy: the model requests made after `ops` was loaded
    (their parameters hold a set of revealed tool names) miss the cache in the resumed process and run again."""
    _, crash_dir = _prefect_crash(prefect_api_url, spawn, tmp_path, {'DURCAP_CRASH_UPSTREAM_PREFECT_CACHE': '1'})
    requests = (crash_dir / 'model-requests').read_text().splitlines()
    assert requests.count('0') == 1, requests  # made before the load: its key holds no set
    assert requests.count('1') + requests.count('2') > 2, f'expected repeated requests, got {requests}'
    # The repeated requests give the tool calls new ids, so even the side effect may run again (seen: twice).
    assert len((crash_dir / 'charges').read_text().splitlines()) >= 1


KEY_SCRIPT = '''
import json
from pydantic_ai.durable_exec.prefect import DEFAULT_PYDANTIC_AI_CACHE_POLICY
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart, UserPromptPart
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.tools import ToolDefinition
from durable_capabilities.engines.prefect import DeterministicInputs, normalized_inputs

names = {'charge', 'slow_export'}
tool = ToolDefinition(name='ship', metadata={'tags': set(names)})
messages = [ModelRequest(parts=[UserPromptPart('go')]),
            ModelResponse(parts=[ToolCallPart('ship', {'ids': ['a']}, tool_call_id='c1')]),
            ModelRequest(parts=[ToolReturnPart('ship', set(names), tool_call_id='c1')])]
params = ModelRequestParameters(function_tools=[tool], revealed_tool_names=set(names), deferred_capability_ids=set(names))
inputs = {'operation_name': 'Model Request',
          'logical_inputs': ('default', messages, {'temperature': 0}, params, None)}
tool_inputs = {'operation_name': 'Call Tool: ship', 'logical_inputs': ('ship', {'ids': set(names)}, None, tool)}
policy = DeterministicInputs(inner=DEFAULT_PYDANTIC_AI_CACHE_POLICY.policies[0])  # inputs only: no task source, run id
keys = [policy.compute_key(None, i, {}) for i in (inputs, tool_inputs)]
raw = [policy.inner.compute_key(None, i, {}) for i in (inputs, tool_inputs)]
assert normalized_inputs({'x': 1}) == {'x': 1} and params.revealed_tool_names == names  # nothing mutated
print(json.dumps({'keys': keys, 'raw': raw}))
'''


def test_prefect_cache_keys_are_the_same_under_any_hash_seed(tmp_path: Path) -> None:
    """`DeterministicInputs` keys a model request (sets in `ModelRequestParameters`, a tool returning a set, a tool's
    metadata holding one) and a tool call (a set argument) the same under two hash seeds that order those sets
    differently, where upstream's own policy on the same inputs does not. No server: the keys only."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / 'keys.py'
    script.write_text(KEY_SCRIPT)
    results = []
    for seed in _seeds_with_different_set_order():
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, 'PYTHONHASHSEED': seed})
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = results
    assert first['keys'] == second['keys'] and None not in first['keys']
    assert first['raw'][0] != second['raw'][0] and first['raw'][1] != second['raw'][1]  # the seeds do reorder the sets
