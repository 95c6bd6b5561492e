"""Subprocess driver for engine tests: `python -m tests.engines.drive ENGINE ACTION [options]`.

Each engine keeps global state (DBOS's registry, Prefect's settings, a Temporal worker), so tests
run each engine in its own process, and crash tests kill that process with SIGKILL.

Actions:
- `temporal worker --address A --task-queue Q --target MOD:ATTR [--versioned]`: serve until SIGTERM (with
  `--versioned`, as `durcap worker temporal` does: Worker Versioning, its version made current).
- `dbos run --db URL --workflow-id ID --target MOD:ATTR --prompt P [--conversation C] [--deps-json J]`: launch DBOS (which recovers
  pending workflows of this app version), start or await workflow ID, print the JSON report.
- `prefect run --target MOD:ATTR --prompt P [--flow-run-id ID]`: run the agent's flow (a new flow run,
  or run an existing one again), print the JSON report.
- `ENGINE turns --target tests.engines.budget_agent:agent --conversation C --store URL`: three turns of the budget
  agent in conversation C (`tests/engines/budget_driver.py`, which prints each turn's run id and outcome).
Reports are printed as one JSON line prefixed with `REPORT `.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import sys
from typing import Any

from pydantic_core import to_jsonable_python


def load(target: str) -> Any:
    module, _, attr = target.partition(':')
    return getattr(importlib.import_module(module), attr)


def _deps(args: argparse.Namespace) -> Any:
    return json.loads(args.deps_json) if args.deps_json else None


def emit(report: dict[str, Any]) -> None:
    print('REPORT ' + json.dumps(to_jsonable_python(report)), flush=True)


async def temporal_worker(args: argparse.Namespace) -> None:
    from durable_capabilities.engines import temporal

    ready = asyncio.Event()
    agents = [load(args.target)]
    version = temporal.worker_version(agents, args.task_queue) if args.versioned else None
    task = asyncio.create_task(
        temporal.run_worker(agents, task_queue=args.task_queue, address=args.address, ready=ready, version=version)
    )
    await ready.wait()
    print(f'WORKER READY {version.build_id if version else "unversioned"}', flush=True)
    await task


async def dbos_run(args: argparse.Namespace) -> None:
    from dbos import DBOS, SetWorkflowID

    from durable_capabilities import telemetry
    from durable_capabilities.conversations import resolve_payload
    from durable_capabilities.engines import dbos as dbos_engine

    agent = load(args.target)
    workflow = dbos_engine.agent_workflow(agent)
    dbos_engine.launch('durcap-tests', system_database_url_=args.db)
    print(f'DBOS APPLICATION VERSION {DBOS.application_version}', flush=True)
    try:
        status = await DBOS.get_workflow_status_async(args.workflow_id)
        if status is None:
            with SetWorkflowID(args.workflow_id):
                handle = await DBOS.start_workflow_async(workflow, args.prompt, _deps(args), None, args.conversation)
        else:
            handle = await DBOS.retrieve_workflow_async(args.workflow_id)
        print('DBOS STARTED', flush=True)
        start = telemetry.run_started()
        payload = await resolve_payload(await handle.get_result())  # a result naming its append: read it back
        telemetry.record_run(args.workflow_id, agent=agent.name, engine='dbos', conversation_id=args.conversation,
                             start_ns=start)
        steps = await DBOS.list_workflow_steps_async(args.workflow_id)
        emit({'output': payload['output'], 'units': [s['function_name'] for s in steps],
              'new_messages': payload['new_messages']})
    finally:
        DBOS.destroy()


async def prefect_run(args: argparse.Namespace) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.flow_engine import run_flow_async
    from prefect.states import Scheduled

    from durable_capabilities.conversations import resolve_payload
    from durable_capabilities.engines import prefect as prefect_engine

    agent = load(args.target)
    flow = prefect_engine.agent_flow(agent)
    async with get_client() as client:
        if args.flow_run_id:
            flow_run = await client.read_flow_run(args.flow_run_id)
            # The killed process left the run Running; hand it back to the engine to run again.
            await client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
        else:
            flow_run = await client.create_flow_run(flow, parameters={'prompt': args.prompt, 'deps': _deps(args)})
        print(f'PREFECT FLOW RUN {flow_run.id}', flush=True)
        flow_run = await client.read_flow_run(flow_run.id)
        state = await run_flow_async(flow, flow_run=flow_run, parameters={'prompt': args.prompt, 'deps': _deps(args)},
                                     return_type='state')
        payload = await resolve_payload(await state.result())  # a result naming its append: read it back
        task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
    # The flow returns its new messages as one JSON string (`engines.prefect.agent_flow`), or names its append (read
    # back as a list).
    messages = payload['new_messages']
    emit({'output': payload['output'], 'units': sorted(t.name for t in task_runs),
          'new_messages': json.loads(messages) if isinstance(messages, str) else messages,
          'flow_run_id': str(flow_run.id)})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine')
    parser.add_argument('action')
    parser.add_argument('--target', required=True)
    parser.add_argument('--address')
    parser.add_argument('--task-queue')
    parser.add_argument('--db')
    parser.add_argument('--workflow-id')
    parser.add_argument('--prompt', default='charge order A-1 and export')
    parser.add_argument('--flow-run-id')
    parser.add_argument('--conversation')
    parser.add_argument('--deps-json', help='dbos / prefect run: the run deps as JSON')
    parser.add_argument('--versioned', action='store_true', help='Temporal: Worker Versioning, made current')
    parser.add_argument('--store', help='turns: the conversation store URL')
    args = parser.parse_args()
    if args.action == 'turns':
        from tests.engines import budget_driver

        asyncio.run(budget_driver.main(args.engine, args.conversation, args.store))
        return
    action = {('temporal', 'worker'): temporal_worker, ('dbos', 'run'): dbos_run, ('prefect', 'run'): prefect_run}
    from durable_capabilities import telemetry

    telemetry.configure_from_env('durcap-test-driver')  # as every `durcap` command does (OTEL_* variables)
    try:
        asyncio.run(action[(args.engine, args.action)](args))
    finally:
        telemetry.shutdown()


if __name__ == '__main__':
    sys.exit(main())
