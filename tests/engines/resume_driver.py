"""Run a list of conversation steps on one engine in this process and print what happened, as JSON.

    python -m tests.engines.resume_driver ENGINE --plan PLAN.json --out-dir DIR
        [--address HOST:PORT] [--db URL] [--recover ID]

ENGINE is `local`, `temporal`, `dbos` or `prefect`. The conversation store is `$DURCAP_STORE` (the test
sets it; every run of every engine shares it). PLAN.json is a list of steps, each
`{label, conversation_id, prompt, variant, drift[, fault, workflow_id]}`:

- `variant` picks the definition the step runs with (see `VARIANTS`): the support agent of
  examples/support (`support`), or the same agent after a change that a stored history can drift from:
  `orders` renamed to `orders-v2` without an alias (`renamed`), `orders` dropped (`dropped`), or `orders`
  keeping its id while its tool `order_status` became `order_lookup` (`tool-gone`).
- `drift` is `DurableAgent(drift=...)`: `'error'` or `'warning'`.
- `fault` injects a failure right after the store committed the step's append (see `_append_with_faults`):
  `'raise'` (the durable unit fails and its engine retries it) or `'kill'` (SIGKILL this process).
- `workflow_id` fixes the Temporal / DBOS workflow id (else a random one).

Every run goes through `durable_capabilities.runner` (what `durcap run` uses) with the step's
`conversation_id`: Temporal with the worker inline in this process (`inline_worker=True`, a fresh task
queue per step), DBOS launched on `--db` and destroyed after each run, Prefect against `PREFECT_API_URL`.
So the model requests run in this process on every engine, and the scripted model's records are ours.

The model is the scripted `SupportScript` (a pydantic-ai `FunctionModel`, examples/support/scripted.py):
each decision is a function of the messages it receives, no provider is called. One script per
definition; each step reports the slice of `SupportScript.requests` its run made (tools offered, the
response, the capability instructions delivered so far).

`--recover ID` reports one step, the result of a run another process started (the plan only says which
definitions to register): DBOS: launch DBOS (which recovers this app's pending workflows) and wait for
workflow ID; Prefect: set flow run ID back to Scheduled and run it again in this process (its finished
tasks come back from Prefect's cache). A step with `fault: 'kill'` on Prefect creates its flow run first
and writes its id to `DIR/flow-run-id`, so the test can hand it to `--recover`.

Every call of the conversation append body (wherever an engine ran it) is logged as one JSON line in
`DIR/appends.jsonl` (conversation id, append id, the revision it returned, pid), before any fault fires,
so a retried or recovered append shows up there twice. Conversation-store warnings (drift at warning
severity) logged during a step are reported with it.

The report is one line, `REPORT {json}`: `{'engine', 'startup_seconds', 'total_seconds', 'steps': [...]}`
with, per step, `label`, `conversation_id`, `variant`, `ok`, `error` (`{'type', 'chain'}`: the messages of
the exception and its causes, Temporal's `WorkflowFailureError -> ActivityError -> ApplicationError`
included), `output`, `requests`, `new_messages` (pydantic-ai JSON), `units`, `run_id`, `warnings`, `seconds`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

_STARTED = time.monotonic()

from pydantic_ai import RunContext
from pydantic_ai.capabilities import AbstractCapability, Capability
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_core import to_jsonable_python

from durable_capabilities import (
    DurableAgent,
    RunbookRequired,
    conversations,
    load_skills,
    runner,
)
from durable_capabilities.conversations import resolve_payload
from examples.support.agent import (
    SKILLS_DIR,
    AccountSecurity,
    Store,
    issue_refund,
    make_store,
    orders,
    refund_policy,
)
from examples.support.scripted import SupportScript

ENGINES = ('local', 'temporal', 'dbos', 'prefect')
VARIANTS = ('support', 'renamed', 'dropped', 'tool-gone')
DRIFTS = ('error', 'warning')
DBOS_APP_VERSION = 'durcap-resume-tests'

# ---- the definitions a stored conversation resumes with ------------------------------------------

orders_v2 = Capability[Store](
    id='orders-v2',
    description=orders.description,
    instructions=orders.instructions,
    defer_loading=True,
)


@orders_v2.tool
def order_status(ctx: RunContext[Store], order_id: str) -> str:
    """Look up shipping or delivery status for an order."""
    return ctx.deps.orders.get(order_id, f'No order found with id {order_id}.')


orders_lookup = Capability[Store](
    id='orders',
    description=orders.description,
    instructions=orders.instructions,
    defer_loading=True,
)


@orders_lookup.tool
def order_lookup(ctx: RunContext[Store], order_id: str) -> str:
    """Look up shipping or delivery status for an order."""
    return ctx.deps.orders.get(order_id, f'No order found with id {order_id}.')


def _orders_capability(variant: str) -> list[AbstractCapability[Any]]:
    return {'support': [orders], 'renamed': [orders_v2], 'dropped': [], 'tool-gone': [orders_lookup]}[variant]


def agent_name(variant: str, drift: str) -> str:
    return f'resume-{variant}-{drift}'


def build(variant: str, drift: str, script: SupportScript) -> DurableAgent[Store, str]:
    """The support agent of examples/support (as `make_support` builds it), with `orders` as `variant` says."""
    return DurableAgent(
        agent_name(variant, drift),
        script.model,
        deps_type=Store,
        instructions='You are a customer-support agent for an e-commerce store.',
        capabilities=[
            *_orders_capability(variant),
            AccountSecurity(),
            refund_policy,
            RunbookRequired(requirements={'issue_refund': 'refund-policy'}),
            *load_skills(SKILLS_DIR),
        ],
        tools=[issue_refund],
        drift=drift,
    )


# ---- fault injection and the append log -----------------------------------------------------------

_APPEND_LOG: dict[str, Path | None] = {'path': None}
_FAULTS: dict[str, str] = {}  # conversation id -> 'raise' | 'kill', fired once
_real_append = conversations.append_conversation


def _log_append(record: dict[str, Any]) -> None:
    if (path := _APPEND_LOG['path']) is not None:
        with open(path, 'a', encoding='utf-8') as f:
            f.write(json.dumps(record) + '\n')
            f.flush()
            os.fsync(f.fileno())  # the line must survive the SIGKILL that may follow


async def _append_with_faults(agent: Any, conversation_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    """The real append body, logged; then the step's fault, if any, after the store committed."""
    revision = await _real_append(agent, conversation_id, messages, **kwargs)
    _log_append({
        'conversation_id': conversation_id, 'append_id': kwargs.get('append_id'), 'revision': revision,
        'expected_revision': kwargs.get('expected_revision'), 'messages': len(messages), 'pid': os.getpid(),
    })
    fault = _FAULTS.pop(conversation_id, None)
    if fault == 'raise':
        raise RuntimeError('injected fault: the durable unit failed after the store committed its append')
    if fault == 'kill':
        os.kill(os.getpid(), signal.SIGKILL)
    return revision


def install_fault_injection(append_log: Path) -> None:
    """Route every append through `_append_with_faults`, logging to `append_log`. Called by `main` before any
    definition is built: engines import the append body when they build their units (activities, steps, tasks).
    Importing this module (the tests do, for `build`) patches nothing."""
    _APPEND_LOG['path'] = append_log
    conversations.append_conversation = _append_with_faults  # type: ignore[assignment]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


_WARNINGS = _Warnings()


# ---- running ----------------------------------------------------------------------------------------


def error_chain(error: BaseException) -> list[str]:
    """The messages of `error` and its causes (`__cause__`, Temporal's `.cause`), outermost first."""
    chain: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(f'{type(current).__name__}: {current}')
        current = getattr(current, 'cause', None) or current.__cause__ or current.__context__
    return chain


async def run_step(engine: str, agent: DurableAgent[Any, Any], step: dict[str, Any], args: argparse.Namespace) -> runner.RunReport:
    cid, prompt, deps = step['conversation_id'], step['prompt'], make_store()
    if engine == 'local':
        return await runner.run(agent, prompt, engine='local', deps=deps, conversation_id=cid)
    if engine == 'temporal':
        return await runner.run(
            agent, prompt, engine='temporal', address=args.address, task_queue=f'resume-{uuid.uuid4().hex[:12]}', deps=deps,
            inline_worker=True, run_id=step.get('workflow_id'), conversation_id=cid,
        )
    if engine == 'dbos':
        if step.get('fault') == 'kill':
            return await _dbos_own_launch(agent, step, args)
        return await runner.run(
            agent, prompt, engine='dbos', deps=deps, db=args.db, run_id=step.get('workflow_id'), conversation_id=cid,
        )
    if engine == 'prefect':
        if step.get('fault') == 'kill':
            return await _prefect_flow_run(agent, step, args)
        return await runner.run(agent, prompt, engine='prefect', deps=deps, conversation_id=cid)
    raise ValueError(f'unknown engine {engine!r}')


def _dbos_launch(db: str | None) -> None:
    from durable_capabilities.engines import dbos as dbos_engine

    dbos_engine.launch('durcap-resume', system_database_url_=db, application_version=DBOS_APP_VERSION)


async def _dbos_own_launch(agent: DurableAgent[Any, Any], step: dict[str, Any], args: argparse.Namespace) -> runner.RunReport:
    """A DBOS run with a fixed application version, so `--recover` in another process recovers it."""
    from dbos import DBOS, SetWorkflowID

    from durable_capabilities.engines import dbos as dbos_engine

    workflow = dbos_engine.agent_workflow(agent)
    _dbos_launch(args.db)
    try:
        with SetWorkflowID(step['workflow_id']):
            payload = await workflow(step['prompt'], to_jsonable_python(make_store()), None, step['conversation_id'])
        payload = await resolve_payload(payload)  # before `DBOS.destroy`, which shuts the loop's executor down
    finally:
        DBOS.destroy()
    return _dbos_report(step['workflow_id'], payload, [])


def _dbos_report(workflow_id: str, payload: dict[str, Any], units: list[str]) -> runner.RunReport:
    from pydantic_ai.usage import RunUsage

    return runner.RunReport(
        'dbos', workflow_id, payload['output'], ModelMessagesTypeAdapter.validate_python(payload['new_messages']),
        RunUsage(**payload['usage']), units,
    )


async def _prefect_flow_run(agent: DurableAgent[Any, Any], step: dict[str, Any], args: argparse.Namespace) -> runner.RunReport:
    """A Prefect flow run created first (its id written to `DIR/flow-run-id`), then run in this process."""
    from prefect import get_client

    from durable_capabilities.engines import prefect as prefect_engine

    flow = prefect_engine.agent_flow(agent)
    parameters = {'prompt': step['prompt'], 'deps': to_jsonable_python(make_store()), 'message_history': None,
                  'conversation_id': step['conversation_id']}
    async with get_client() as client:
        flow_run = await client.create_flow_run(flow, parameters=parameters)
    (args.out_dir / 'flow-run-id').write_text(str(flow_run.id))
    return await _run_prefect_flow_run(flow, flow_run.id, parameters)


async def _run_prefect_flow_run(flow: Any, flow_run_id: Any, parameters: dict[str, Any]) -> runner.RunReport:
    from prefect import get_client
    from prefect.flow_engine import run_flow_async
    from pydantic_ai.usage import RunUsage

    started = datetime.now(UTC)
    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
    state = await run_flow_async(flow, flow_run=flow_run, parameters=parameters, return_type='state')
    payload = await resolve_payload(await state.result())  # a result naming its append: the messages from the store
    return runner.RunReport(
        # The flow returns its new messages as one JSON string (`engines.prefect.agent_flow`).
        'prefect', str(flow_run_id), payload['output'], runner.RunReport.from_payload(
            'prefect', None, payload).new_messages, RunUsage(**payload['usage']), await _task_run_states(flow_run_id, started),
    )


async def _task_run_states(flow_run_id: Any, since: datetime, quiet: float = 1.0, timeout: float = 30.0) -> list[str]:
    """`'{task run name} {state name}'` per task run of the flow run, once every task run created `since` (by
    this process) is final and the list has been quiet for `quiet` s.

    Not the Prefect adapter's wait for every task run to be final: a killed process leaves its last task run
    Running for good.
    """
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline, previous, quiet_since = time.monotonic() + timeout, None, time.monotonic()
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            snapshot = sorted(f'{r.name} {r.state.name if r.state else None}' for r in runs)
            if snapshot != previous:
                previous, quiet_since = snapshot, time.monotonic()
            mine = [r for r in runs if r.created is not None and r.created >= since]
            settled = bool(mine) and all(r.state is not None and r.state.is_final() for r in mine)
            if (settled and time.monotonic() - quiet_since >= quiet) or time.monotonic() > deadline:
                return snapshot
            await asyncio.sleep(0.2)


async def prefect_recover(flow_run_id: str, agents: list[DurableAgent[Any, Any]]) -> runner.RunReport:
    """Run flow run `flow_run_id` again (a killed process left it Running): back to Scheduled, then run."""
    from prefect import get_client
    from prefect.states import Scheduled

    from durable_capabilities.engines import prefect as prefect_engine

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
        await client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
    if len(agents) != 1:
        raise ValueError('--recover on Prefect needs a plan with exactly the definition the flow run used')
    flow = prefect_engine.agent_flow(agents[0])
    return await _run_prefect_flow_run(flow, flow_run.id, dict(flow_run.parameters))


async def dbos_recover(workflow_id: str, args: argparse.Namespace) -> runner.RunReport:
    from dbos import DBOS

    _dbos_launch(args.db)
    try:
        handle = await DBOS.retrieve_workflow_async(workflow_id)
        payload = await resolve_payload(await handle.get_result())  # the turn's messages from the store
        steps = await DBOS.list_workflow_steps_async(workflow_id)
    finally:
        DBOS.destroy()
    return _dbos_report(workflow_id, payload, [s['function_name'] for s in steps])


def _report(step: dict[str, Any], run: runner.RunReport | None, error: BaseException | None, requests: list[Any],
            warnings: list[str], seconds: float) -> dict[str, Any]:
    return {
        'label': step.get('label'),
        'conversation_id': step.get('conversation_id'),
        'variant': step.get('variant'),
        'ok': error is None,
        'error': None if error is None else {
            'type': type(error).__name__, 'chain': error_chain(error), 'traceback': traceback.format_exception(error)[-12:],
        },
        'output': None if run is None else to_jsonable_python(run.output),
        'requests': [dataclasses.asdict(r) for r in requests],
        'new_messages': [] if run is None else ModelMessagesTypeAdapter.dump_python(run.new_messages, mode='json'),
        'units': [] if run is None else run.durable_units,
        'run_id': None if run is None else run.run_id,
        'warnings': warnings,
        'seconds': round(seconds, 3),
    }


async def run_plan(engine: str, plan: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    # Every definition the plan uses, built (and, on DBOS and Prefect, registered) before the first run:
    # DBOS needs every workflow registered before `DBOS.launch()`.
    agents: dict[tuple[str, str], tuple[DurableAgent[Any, Any], SupportScript]] = {}
    for step in plan:
        key = (step.get('variant', 'support'), step.get('drift', 'error'))
        if key not in agents:
            script = SupportScript()
            agents[key] = (build(*key, script), script)
    if engine == 'dbos':
        from durable_capabilities.engines import dbos as dbos_engine

        for agent, _ in agents.values():
            dbos_engine.agent_workflow(agent)
    if engine == 'prefect':
        from durable_capabilities.engines import prefect as prefect_engine

        for agent, _ in agents.values():
            prefect_engine.agent_flow(agent)

    if args.recover:
        started = time.monotonic()
        seen = {key: len(script.requests) for key, (_, script) in agents.items()}
        run, error = None, None
        try:
            if engine == 'dbos':
                run = await dbos_recover(args.recover, args)
            elif engine == 'prefect':
                run = await prefect_recover(args.recover, [a for a, _ in agents.values()])
            else:
                raise ValueError(f'--recover is for dbos and prefect, not {engine}')
        except BaseException as exc:  # noqa: BLE001 - reported, the test decides
            error = exc
        requests = [r for key, (_, script) in agents.items() for r in script.requests[seen[key]:]]
        return [_report({'label': 'recover', 'run_id': args.recover}, run, error, requests, list(_WARNINGS.records),
                        time.monotonic() - started)]

    reports = []
    for step in plan:
        agent, script = agents[(step.get('variant', 'support'), step.get('drift', 'error'))]
        if step.get('fault'):
            _FAULTS[step['conversation_id']] = step['fault']
        seen, warned = len(script.requests), len(_WARNINGS.records)
        started = time.monotonic()
        run, error = None, None
        try:
            run = await run_step(engine, agent, step, args)
        except BaseException as exc:  # noqa: BLE001 - one failing step must not hide the others' reports
            error = exc
        _FAULTS.pop(step['conversation_id'], None)
        reports.append(_report(step, run, error, script.requests[seen:], _WARNINGS.records[warned:], time.monotonic() - started))
    return reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine', choices=ENGINES)
    parser.add_argument('--plan', required=True, type=Path)
    parser.add_argument('--out-dir', required=True, type=Path)
    parser.add_argument('--address', help='Temporal frontend address')
    parser.add_argument('--db', help='DBOS system database URL')
    parser.add_argument('--recover', help='DBOS workflow id / Prefect flow run id to recover and report')
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    install_fault_injection(args.out_dir / 'appends.jsonl')
    logging.getLogger('durable_capabilities.conversations').addHandler(_WARNINGS)
    plan = json.loads(args.plan.read_text())
    startup = time.monotonic() - _STARTED
    steps = asyncio.run(run_plan(args.engine, plan, args))
    report = {'engine': args.engine, 'startup_seconds': round(startup, 3),
              'total_seconds': round(time.monotonic() - _STARTED, 3), 'steps': steps}
    print('REPORT ' + json.dumps(to_jsonable_python(report)), flush=True)


if __name__ == '__main__':
    sys.exit(main())
