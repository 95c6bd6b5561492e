"""Short capability tools as Temporal local activities (`engine_options={'temporal': {'local_activity_toolsets': ...}}`).

Real Temporal dev server (the shared one or the session's), an in-process worker from `make_worker`. Model: the
scripted `FunctionModel` of `bench/_common.py` (6 requests: `load_capability`, four tool calls, the answer).
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / 'bench'))

import _common as c

pytestmark = pytest.mark.slow


def _agent(name: str, **engine_options: Any) -> Any:
    from durable_capabilities import DurableAgent

    return DurableAgent(name, c.make_model(), instructions=c.INSTRUCTIONS, capabilities=[c.make_capability()],
                        engine_options={'temporal': engine_options} if engine_options else None)


async def _run(client: Any, agent: Any, queue: str) -> tuple[str, list[Any]]:
    from durable_capabilities.engines import temporal

    async with temporal.make_worker(client, [agent], queue):
        handle = await temporal.start_run(client, agent, c.PROMPT, task_queue=queue, workflow_id=f'lt-{uuid.uuid4()}',
                                          eager=True)
        output = await asyncio.wait_for(handle.result(), 60)
    c.check_messages(output.new_messages)
    return handle.id, [e async for e in handle.fetch_history_events()]


def test_marked_leaf_runs_its_tools_as_local_activities_and_old_histories_replay(temporal_address: str) -> None:
    """With `ops` marked, its four tool calls are local-activity markers (no ActivityTaskScheduled), the six model
    requests stay activities, and the history is shorter. Unmarked, the tool and model activities carry the recovery
    settings (heartbeat timeouts, retry backoff). The same agent's history recorded before it was marked
    (regular tool activities, no patch marker) and the new one both replay with the agent's replayer; without the
    interceptor the new history does not replay (the option really changes the commands)."""
    from temporalio.api.enums.v1 import EventType

    from durable_capabilities.engines import temporal
    from durable_capabilities.engines.temporal import HistoryReplayer

    name = f'lt_{uuid.uuid4().hex[:8]}'
    agent = _agent(name)
    names_before = temporal.ADAPTER.durable_names(agent)

    async def scenario() -> None:
        client = await temporal.connect(temporal_address)
        before_id, before = await _run(client, agent, f'lt-{uuid.uuid4().hex[:8]}')
        agent.engine_options['temporal'] = {temporal.LOCAL_TOOLSETS_OPTION: {'ops': {}}}
        after_id, after = await _run(client, agent, f'lt-{uuid.uuid4().hex[:8]}')

        def scheduled(history: list[Any]) -> list[str]:
            return [e.activity_task_scheduled_event_attributes.activity_type.name for e in history
                    if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]

        assert scheduled(before).count(f'agent__{name}__toolset__ops__call_tool') == 4
        # The recovery settings as Temporal recorded them (engines/temporal/_spec.py: DEFAULT_TOOL_HEARTBEAT_TIMEOUT,
        # TOOL_RETRY_INITIAL_INTERVAL, DEFAULT_MODEL_HEARTBEAT_TIMEOUT).
        for event in before:
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                attrs = event.activity_task_scheduled_event_attributes
                if attrs.activity_type.name.endswith('__call_tool'):
                    assert attrs.heartbeat_timeout.ToTimedelta() == temporal.DEFAULT_TOOL_HEARTBEAT_TIMEOUT
                    assert attrs.retry_policy.initial_interval.ToTimedelta() == temporal.TOOL_RETRY_INITIAL_INTERVAL
                else:
                    assert attrs.heartbeat_timeout.ToTimedelta() == temporal.DEFAULT_MODEL_HEARTBEAT_TIMEOUT
        assert scheduled(after) == [f'agent__{name}__model_request'] * 6
        def local_markers(history: list[Any]) -> list[Any]:
            return [e for e in history if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                    and e.marker_recorded_event_attributes.marker_name == 'core_local_activity']

        # Both runs also publish their own stream events through local activities (durcap.stream_publish).
        assert len(local_markers(after)) == len(local_markers(before)) + 4
        assert len(after) < len(before) - 10, (len(before), len(after))

        replayer = temporal.ADAPTER.replayer([agent])
        plain = HistoryReplayer([agent], temporal.workflow_classes(agent), temporal.sandbox_runner())
        for workflow_id in (before_id, after_id):
            history = await client.get_workflow_handle(workflow_id).fetch_history()
            as_json = json.loads(history.to_json())
            assert await replayer.replay(as_json, workflow_id) is None
            if workflow_id == after_id:
                assert await plain.replay(as_json, workflow_id) is not None

    asyncio.run(scenario())
    assert temporal.ADAPTER.durable_names(agent) == names_before, 'local activities must not rename durable units'


def test_an_agents_own_tool_activity_gets_the_tool_recovery_settings(temporal_address: str) -> None:
    """A tool given with `DurableAgent(tools=[...])` (the agent's own toolset `<agent>`, outside every capability) is
    scheduled with the same recovery settings as a capability's tools: `DEFAULT_TOOL_HEARTBEAT_TIMEOUT` and the
    `TOOL_RETRY_INITIAL_INTERVAL` backoff, so a killed worker's always-on tool (the support example's
    `issue_refund`) is retried within seconds, not when its 60 s start-to-close timeout expires (it had no heartbeat
    timeout). Real Temporal dev server, an in-process worker; model: a scripted `FunctionModel` (call, then answer)."""
    from pydantic_ai import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.messages import ToolReturnPart
    from pydantic_ai.models.function import FunctionModel
    from temporalio.api.enums.v1 import EventType

    from durable_capabilities import DurableAgent
    from durable_capabilities.engines import temporal

    def model(messages: list[Any], info: Any) -> ModelResponse:
        if isinstance(messages[-1].parts[-1], ToolReturnPart):
            return ModelResponse([TextPart(f'refunded: {messages[-1].parts[-1].content}')])
        return ModelResponse([ToolCallPart('refund', {'order': 'A-1'}, tool_call_id='refund-1')])

    def refund(order: str) -> str:
        """Refund an order."""
        return order

    name = f'own_{uuid.uuid4().hex[:8]}'
    agent = DurableAgent(name, FunctionModel(model), tools=[refund])

    async def scheduled() -> dict[str, Any]:
        client = await temporal.connect(temporal_address)
        queue = f'own-{uuid.uuid4().hex[:8]}'
        async with temporal.make_worker(client, [agent], queue):
            handle = await temporal.start_run(client, agent, 'refund A-1', task_queue=queue,
                                              workflow_id=f'own-{uuid.uuid4()}', eager=True)
            assert (await asyncio.wait_for(handle.result(), 60)).output == 'refunded: A-1'
        return {e.activity_task_scheduled_event_attributes.activity_type.name: e.activity_task_scheduled_event_attributes
                async for e in handle.fetch_history_events()
                if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}

    attrs = asyncio.run(scheduled())[f'agent__{name}__toolset__<agent>__call_tool']
    assert attrs.heartbeat_timeout.ToTimedelta() == temporal.DEFAULT_TOOL_HEARTBEAT_TIMEOUT
    assert attrs.retry_policy.initial_interval.ToTimedelta() == temporal.TOOL_RETRY_INITIAL_INTERVAL


def test_unknown_leaf_is_refused_naming_it() -> None:
    """A marked leaf id the agent does not have is refused (when a worker or replayer is made), naming it and the ids that fit."""
    from durable_capabilities.engines import temporal

    agent = _agent(f'lt_{uuid.uuid4().hex[:8]}', **{temporal.LOCAL_TOOLSETS_OPTION: {'opz': {}}})
    with pytest.raises(ValueError, match=r"\['opz'\] is not a leaf toolset with tool activities; leaf ids that fit: ops"):
        temporal.local_tool_activities(agent)


def test_workers_get_a_deadlock_timeout_a_long_history_fits(temporal_address: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`make_worker` raises temporalio's fixed 2 s deadlock detector to `DEFAULT_DEADLOCK_TIMEOUT` (a 10,000-message
    activation on a busy machine takes longer; see its docstring), `$DURCAP_TEMPORAL_DEADLOCK_TIMEOUT` changes it and
    a bad value is DC040 naming the variable. Real Temporal dev server (the client); the worker is built, not run."""
    from temporalio.client import Client

    from durable_capabilities._limits import InputError
    from durable_capabilities.engines import temporal

    async def timeouts() -> list[Any]:
        client = await Client.connect(temporal_address)
        agent = _agent('deadlock')
        found = []
        for value in (None, '3.5', 'soon'):
            if value is None:
                monkeypatch.delenv(temporal.DEADLOCK_TIMEOUT_ENV, raising=False)
            else:
                monkeypatch.setenv(temporal.DEADLOCK_TIMEOUT_ENV, value)
            try:
                worker = temporal.make_worker(client, [agent], f'deadlock-{uuid.uuid4().hex[:8]}')
                found.append(worker._workflow_worker._deadlock_timeout_seconds)
            except InputError as exc:
                found.append(str(exc))
        return found

    default, changed, bad = asyncio.run(timeouts())
    assert (default, changed) == (temporal.DEFAULT_DEADLOCK_TIMEOUT, 3.5)
    assert 'DC040' in bad and temporal.DEADLOCK_TIMEOUT_ENV in bad and "'soon'" in bad


_TARGET = '''
import sys
sys.path.insert(0, {bench!r})
import _common as c
from durable_capabilities import DurableAgent

agent = DurableAgent({name!r}, c.make_model(), instructions=c.INSTRUCTIONS, capabilities=[c.make_capability()])
'''


def test_lock_measure_decides_local_tools_and_workers_and_replay_follow_the_lock(temporal_address: str,
                                                                                 tmp_path: Path) -> None:
    """`durcap lock --measure` (the real CLI, a subprocess) reads two recorded runs of an agent with no hand marking,
    finds `ops`'s 8 tool calls fast and records `ops` as local in durable.lock; a plain `durcap lock` afterwards keeps
    the decision; a worker made from the target loaded with that lock runs `ops` as local activities (markers, no
    ActivityTaskScheduled), and `durcap replay` of that history passes (the lock is applied), while a replayer without
    the lock's decision fails it. Real Temporal dev server; model: bench/_common.py's scripted FunctionModel."""
    import subprocess

    from temporalio.api.enums.v1 import EventType

    from durable_capabilities.engines import temporal
    from durable_capabilities.lockfile import LOCAL_SECTION, MEASURED_SECTION, read_lock
    from durable_capabilities.targets import load_checked
    from tests._helpers import subprocess_env

    name = f'lm_{uuid.uuid4().hex[:8]}'
    target_file = tmp_path / 'measured_agents.py'
    target_file.write_text(_TARGET.format(bench=str(Path(str(c.__file__)).parent), name=name), encoding='utf-8')
    target = f'{target_file}:agent'
    lock_file = tmp_path / 'durable.lock'
    env = subprocess_env({'DURCAP_TEMPORAL_ADDRESS': temporal_address})

    def durcap(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, '-m', 'durable_capabilities.cli', *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120, check=False)

    async def record(agents: list[Any], runs: int) -> list[tuple[str, list[Any]]]:
        client = await temporal.connect(temporal_address)
        done = [await _run(client, agents[0], f'lm-{uuid.uuid4().hex[:8]}') for _ in range(runs)]
        query = f'WorkflowType = "durcap.{name}" AND ExecutionStatus != "Running"'
        for _ in range(200):  # visibility is eventually consistent: wait until the server lists both
            if (await client.count_workflows(query)).count >= runs:
                break
            await asyncio.sleep(0.05)
        return done

    loaded = load_checked(target, use_lock=False)
    asyncio.run(record(loaded.agents, 2))
    out = durcap('lock', target, '--measure', '--output', str(lock_file))
    assert out.returncode == 0, out.stderr
    assert f'{name}: ops: local (8 calls in 2 run(s)' in out.stderr, out.stderr
    assert 'ms) [changed: was not local]' in out.stderr, out.stderr  # the first decision is a change
    entry = read_lock(lock_file)['agents'][name]['temporal']
    assert entry[LOCAL_SECTION] == ['ops'] and entry[MEASURED_SECTION][0].startswith('ops: local (8 calls')

    again = durcap('lock', target, '--output', str(lock_file))  # no --measure: the decision stays
    assert again.returncode == 0, again.stderr
    assert read_lock(lock_file)['agents'][name]['temporal'][LOCAL_SECTION] == ['ops']

    with_lock = load_checked(target)  # the lock beside the target file: decisions applied
    assert with_lock.agents[0].engine_options['temporal'][temporal.LOCAL_TOOLSETS_OPTION] == {'ops': {}}
    [(workflow_id, history)] = asyncio.run(record(with_lock.agents, 1))
    scheduled = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
    assert scheduled == [f'agent__{name}__model_request'] * 6
    assert sum(1 for e in history if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
               and e.marker_recorded_event_attributes.marker_name == 'core_local_activity'
               and b'__call_tool' in e.marker_recorded_event_attributes.SerializeToString()) == 4  # not the stream's

    async def measured_again() -> Any:  # the local run's calls are markers: counted, not timed
        client = await temporal.connect(temporal_address)
        query = f'WorkflowType = "durcap.{name}" AND ExecutionStatus != "Running"'
        for _ in range(200):
            if (await client.count_workflows(query)).count >= 3:
                break
            await asyncio.sleep(0.05)
        return (await temporal.ADAPTER.measure_tool_calls(with_lock.agents, {'address': temporal_address}, 50))[name]

    async def units() -> list[str]:  # what `durcap demo` / `runs show` list: the tools' local activities too
        return await temporal.units_recorded(await temporal.connect(temporal_address), workflow_id, None)

    assert asyncio.run(units()).count(f'agent__{name}__toolset__ops__call_tool') == 4
    ops = asyncio.run(measured_again())['ops']
    assert (ops.local_calls, len(ops.seconds), ops.runs) == (4, 8, 3)

    exported = tmp_path / 'history.json'
    assert durcap('history', 'export', '--workflow-id', workflow_id, '-o', str(exported)).returncode == 0
    replayed = durcap('replay', str(exported), '--target', target)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    lock_file.unlink()  # without the lock's decision the same history does not replay
    refused = durcap('replay', str(exported), '--target', target)
    assert refused.returncode == 1 and 'nondeterminism' in refused.stdout, refused.stdout + refused.stderr
