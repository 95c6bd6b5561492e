"""Subprocess driver for the MCP engine tests: `python -m tests.engines.mcp_driver ENGINE [options]`.

One process runs one agent run on one engine and prints one `REPORT {json}` line, whatever happened:
- `temporal --address A`: a worker for the agent runs in this process; the workflow is started and
  awaited for at most `--wait` seconds. On timeout the report holds what Temporal was doing (pending
  activity attempts, failed workflow tasks) and the workflow is terminated.
- `dbos --db URL`: DBOS on that system database; the workflow is awaited for at most `--wait` seconds.
  Every finished history is replayed against the definition (`report['replay']`: `'ok'` or the
  nondeterminism found); `--dump-history FILE` saves it, `--replay-history FILE` only replays one.
- `prefect` (against `$PREFECT_API_URL`): the agent's flow runs in this process.

The agent (built here from environment variables, so every test gets its own name and servers):
- `DURCAP_MCP_AGENT`: agent name;
- `DURCAP_MCP_SERVERS`: JSON `{capability id: url}`; each becomes `MCP(url=..., id=..., defer_loading=True)`
  (`"+id"` builds an always-on `MCP(url=..., id='id')`, `"<no id>"`-prefixed keys `MCP(url=...)` without an id);
- `DURCAP_MCP_PLAN`: JSON list of model actions, one per model response: `{"load": "<capability id>"}`
  or `{"call": "<tool>", "args": {...}}`; after the last action the model answers
  `done: <tool return contents>`;
- `DURCAP_MCP_DIR`: directory where every model request appends one JSON line (the tool names the
  model was shown) to `model-requests`.

Model: a scripted `FunctionModel` (no provider, no network).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import MCP
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_core import to_jsonable_python

from durable_capabilities import DurableAgent
from durable_capabilities.engines import DURABLE_ENGINES

NO_ID = '<no id>'


def emit(report: dict[str, Any]) -> None:
    print('REPORT ' + json.dumps(to_jsonable_python(report)), flush=True)


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """The scripted model: the next action of `DURCAP_MCP_PLAN`, then a text answer."""
    plan = json.loads(os.environ.get('DURCAP_MCP_PLAN', '[]'))
    with open(Path(os.environ['DURCAP_MCP_DIR']) / 'model-requests', 'a', encoding='utf-8') as f:
        f.write(json.dumps(sorted(t.name for t in info.function_tools)) + '\n')
    step = sum(1 for m in messages if m.kind == 'response')
    if step < len(plan):
        action = plan[step]
        if 'load' in action:
            return ModelResponse(parts=[ToolCallPart('load_capability', {'id': action['load']})])
        return ModelResponse(parts=[ToolCallPart(action['call'], action.get('args', {}))])
    returns = [
        str(p.content)
        for m in messages
        for p in getattr(m, 'parts', [])
        if isinstance(p, ToolReturnPart) and p.tool_name != 'load_capability'
    ]
    return ModelResponse(parts=[TextPart('done: ' + ', '.join(returns))])


def build_agent() -> DurableAgent[Any, Any]:
    servers: dict[str, str] = json.loads(os.environ['DURCAP_MCP_SERVERS'])
    capabilities = [
        MCP(url=url)
        if cap_id.startswith(NO_ID)
        else MCP(url=url, id=cap_id[1:])
        if cap_id.startswith('+')
        else MCP(url=url, id=cap_id, defer_loading=True, description=f'Use {cap_id} to add numbers.')
        for cap_id, url in servers.items()
    ]
    options = {}
    if os.environ.get('DURCAP_MCP_UPSTREAM'):
        # Upstream's MCP handling, to show the gap the guard closes: no guard, no retry bounds.
        options = {engine: {'mcp_guard': False} for engine in DURABLE_ENGINES}
    return DurableAgent(
        os.environ['DURCAP_MCP_AGENT'], FunctionModel(script), capabilities=capabilities, engine_options=options
    )


def leaks(texts: list[str]) -> list[str]:
    """Which of `DURCAP_MCP_SECRETS` (JSON list) appear in what the engine recorded."""
    needles = json.loads(os.environ.get('DURCAP_MCP_SECRETS', '[]'))
    return sorted({needle for needle in needles for text in texts if needle in text})


def error_chain(error: BaseException) -> list[dict[str, str]]:
    """Type and message of `error` and each of its causes (Temporal nests activity failures)."""
    chain: list[dict[str, str]] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append({'type': type(current).__name__, 'message': str(current)})
        current = current.__cause__ or getattr(current, 'cause', None) or current.__context__
    return chain


async def temporal_replay(agent: DurableAgent[Any, Any], history: Any) -> str:
    """Replay `history` against the current definition: `'ok'`, or the nondeterminism Temporal found."""
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.worker import Replayer

    from durable_capabilities.engines import temporal
    from durable_capabilities.engines.temporal._streams import CarryStreamEvents

    replayer = Replayer(
        workflows=[temporal.workflow_class(agent)], plugins=[PydanticAIPlugin()], workflow_runner=temporal.sandbox_runner(),
        interceptors=[CarryStreamEvents()],  # the worker's: the workflow's stream events ride with its activities
    )
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    failure = result.replay_failure
    return 'ok' if failure is None else f'{type(failure).__name__}: {failure}'


async def temporal_run(args: argparse.Namespace, agent: DurableAgent[Any, Any]) -> dict[str, Any]:
    from temporalio.api.enums.v1 import EventType
    from temporalio.client import WorkflowFailureError, WorkflowHistory

    from durable_capabilities.engines import temporal

    if args.replay_history:
        data = json.loads(Path(args.replay_history).read_text())
        history = WorkflowHistory.from_json(data['workflow_id'], data['history'])
        return {'status': 'replayed', 'replay': await temporal_replay(agent, history)}
    client = await temporal.connect(args.address)
    queue = f'mcp-{uuid.uuid4().hex[:8]}'
    report: dict[str, Any] = {}
    async with temporal.make_worker(client, [agent], queue):
        handle = await temporal.start_run(client, agent, 'use the calculator', task_queue=queue, workflow_id=f'mcp-{uuid.uuid4()}')
        try:
            result = await asyncio.wait_for(handle.result(), args.wait)
            report |= {'status': 'completed', 'output': result.output}
        except WorkflowFailureError as error:
            report |= {'status': 'failed', 'errors': error_chain(error)}
        except TimeoutError:
            description = await handle.describe()
            pending = description.raw_description.pending_activities
            report |= {
                'status': 'timeout',
                'pending': [
                    {'activity': p.activity_type.name, 'attempt': p.attempt, 'last_failure': p.last_failure.message}
                    for p in pending
                ],
            }
            await handle.terminate('mcp test: gave up waiting')
        units: list[str] = []
        task_failures: list[str] = []
        recorded: list[str] = []
        scheduled: dict[int, str] = {}
        attempts: dict[str, int] = {}
        async for event in handle.fetch_history_events():
            recorded.append(str(event))
            if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                units.append(event.activity_task_scheduled_event_attributes.activity_type.name)
                scheduled[event.event_id] = units[-1]
            elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
                started = event.activity_task_started_event_attributes
                name = scheduled.get(started.scheduled_event_id, '?')
                attempts[name] = max(attempts.get(name, 0), started.attempt)
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED:
                task_failures.append(event.workflow_task_failed_event_attributes.failure.message)
        report |= {'units': units, 'workflow_task_failures': task_failures, 'leaked': leaks(recorded),
                   'attempts': attempts}
        if report['status'] != 'timeout':
            history = await handle.fetch_history()
            report['replay'] = await temporal_replay(agent, history)
            if args.dump_history:
                Path(args.dump_history).write_text(json.dumps({'workflow_id': handle.id, 'history': history.to_json_dict()}))
    return report


async def dbos_run(args: argparse.Namespace, agent: DurableAgent[Any, Any]) -> dict[str, Any]:
    from dbos import DBOS, SetWorkflowID

    from durable_capabilities.engines import dbos as dbos_engine

    workflow = dbos_engine.agent_workflow(agent)
    dbos_engine.launch('durcap-mcp-tests', system_database_url_=args.db)
    workflow_id = f'mcp-{uuid.uuid4()}'
    report: dict[str, Any] = {}
    try:
        with SetWorkflowID(workflow_id):
            handle = await DBOS.start_workflow_async(workflow, 'use the calculator', None, None)
        try:
            payload = await asyncio.wait_for(handle.get_result(), args.wait)
            report |= {'status': 'completed', 'output': payload['output']}
        except TimeoutError:
            report |= {'status': 'timeout'}
            await DBOS.cancel_workflow_async(workflow_id)
        except Exception as error:  # noqa: BLE001 - reported to the test
            report |= {'status': 'failed', 'errors': error_chain(error)}
        steps = await DBOS.list_workflow_steps_async(workflow_id)
        report['units'] = [s['function_name'] for s in steps]
        report['step_errors'] = [str(s['error']) for s in steps if s.get('error') is not None]
        status = await DBOS.get_workflow_status_async(workflow_id)
        report['leaked'] = leaks([repr(steps), repr(status)])
    finally:
        DBOS.destroy()
    return report


async def prefect_run(args: argparse.Namespace, agent: DurableAgent[Any, Any]) -> dict[str, Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.flow_engine import run_flow_async

    from durable_capabilities.engines import prefect as prefect_engine

    flow = prefect_engine.agent_flow(agent)
    report: dict[str, Any] = {}
    async with get_client() as client:
        flow_run = await client.create_flow_run(flow, parameters={'prompt': 'use the calculator'})
        try:
            state = await asyncio.wait_for(
                run_flow_async(flow, flow_run=flow_run, parameters={'prompt': 'use the calculator'}, return_type='state'),
                args.wait,
            )
        except TimeoutError:
            report |= {'status': 'timeout'}
        else:
            if state.is_completed():
                report |= {'status': 'completed', 'output': (await state.result())['output']}
            else:
                try:
                    await state.result()
                    report |= {'status': state.type.value, 'errors': [{'type': 'state', 'message': str(state.message)}]}
                except Exception as error:  # noqa: BLE001 - reported to the test
                    report |= {'status': 'failed', 'errors': error_chain(error)}
        # Prefect records task runs through its event stream, so they reach the API shortly after the flow ends.
        flow_run_state = (await client.read_flow_run(flow_run.id)).state
        task_runs: list[Any] = []
        previous = None
        for _ in range(60):
            task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
            snapshot = sorted((str(t.id), t.state.type.value if t.state else '') for t in task_runs)
            if snapshot == previous and all(t.state is not None and t.state.is_final() for t in task_runs):
                break
            previous = snapshot
            await asyncio.sleep(0.5)
    ordered = sorted(task_runs, key=lambda t: (t.expected_start_time or t.created, t.name))
    report['units'] = [t.name.rsplit('-', 1)[0] for t in ordered]
    report['task_states'] = [f'{t.name}: {t.state.type.value if t.state else None}' for t in ordered]
    report['task_run_count'] = {t.name: t.run_count for t in ordered}
    report['leaked'] = leaks([f'{t.state!r} {t.state.message if t.state else ""}' for t in ordered] + [repr(flow_run_state)])
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine', choices=['temporal', 'dbos', 'prefect', 'local'])
    parser.add_argument('--address')
    parser.add_argument('--db')
    parser.add_argument('--wait', type=float, default=60.0)
    parser.add_argument('--dump-history', help='temporal: write the finished workflow history (JSON) here')
    parser.add_argument('--replay-history', help='temporal: only replay this history against the current definition')
    args = parser.parse_args()
    started = time.monotonic()
    try:
        agent = build_agent()
    except Exception as error:  # noqa: BLE001 - a DurableConfigError is what some tests expect
        emit({'status': 'invalid', 'errors': error_chain(error), 'elapsed': time.monotonic() - started})
        return
    run = {'temporal': temporal_run, 'dbos': dbos_run, 'prefect': prefect_run}.get(args.engine)

    async def local(args: argparse.Namespace, agent: DurableAgent[Any, Any]) -> dict[str, Any]:
        try:
            result = await asyncio.wait_for(agent.run('use the calculator'), args.wait)
            return {'status': 'completed', 'output': result.output}
        except Exception as error:  # noqa: BLE001 - reported to the test
            return {'status': 'failed', 'errors': error_chain(error)}

    try:
        report = asyncio.run((run or local)(args, agent))
    except Exception as error:  # noqa: BLE001 - the driver itself failed: say how
        report = {'status': 'driver-error', 'errors': error_chain(error), 'traceback': traceback.format_exc()}
    report['elapsed'] = time.monotonic() - started
    report['agent'] = agent.name
    emit(report)
    sys.stdout.flush()
    sys.stderr.flush()
    # Every engine resource was released above (worker stopped, DBOS destroyed, Prefect client closed);
    # skip interpreter teardown, where Prefect's background threads occasionally abort the process.
    os._exit(0)


if __name__ == '__main__':
    sys.exit(main())
