"""Driver of tests/engines/test_telemetry.py's metric test: `python -m tests.engines.metrics_driver ENGINE STORE [--db URL]`.

Runs the approval agent (`tests/engines/approval_agent.py`, its scripted `FunctionModel`: no provider) once on ENGINE
(`temporal`: the session's server, `$DURCAP_TEST_TEMPORAL_ADDRESS`, worker inline; `dbos`: SQLite `--db`) through
`runner.run`, with this process's metrics read by the SDK's `InMemoryMetricReader` (`telemetry.configure`). While the
run waits for its decision the driver reads the metrics (the waiting count must say 1 call, the event it waits
for), approves the call (`runner.decide`), and prints one `METRICS <json>` line: the report's output and the
metric points read while waiting and after the run (name -> list of {attributes, value | count/sum}). On Temporal a
second run follows (`claim_checked_run`, the claim-check threshold at 200 bytes) and the claim-check byte counts
before and after it, and the token counts by agent, direction and capability.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import uuid
from typing import Any


def points(reader: Any) -> dict[str, list[dict[str, Any]]]:
    """Every metric point the reader collects now: name -> [{'attributes', 'value'} or {'attributes', 'count', 'sum'}]."""
    out: dict[str, list[dict[str, Any]]] = {}
    data = reader.get_metrics_data()
    for resource in data.resource_metrics if data else ():
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    row: dict[str, Any] = {'attributes': dict(point.attributes or {})}
                    if hasattr(point, 'value'):
                        row['value'] = point.value
                    else:
                        row['count'], row['sum'] = point.count, point.sum
                    out.setdefault(metric.name, []).append(row)
    return out


async def scenario(engine: str, store: str, db: str | None, reader: Any) -> dict[str, Any]:
    from durable_capabilities import runner
    from tests.engines.approval_agent import gated

    run_id = f'metrics-{engine}-{uuid.uuid4().hex[:8]}'
    settings: dict[str, Any] = {'store': store}
    if engine == 'temporal':
        settings |= {'address': os.environ['DURCAP_TEST_TEMPORAL_ADDRESS'], 'inline_worker': True,
                     'task_queue': f'metrics-{uuid.uuid4().hex[:8]}'}
    else:
        settings |= {'db': db}
    run = asyncio.ensure_future(runner.run(gated, 'revoke bob', engine=engine, run_id=run_id, notify=lambda line: None,
                                           **settings))
    decide_settings = {k: v for k, v in settings.items() if k not in ('inline_worker', 'task_queue')}
    try:
        return await _drive(run, run_id, engine, decide_settings, reader)
    finally:
        if not run.done():  # a failure here: leave no run waiting on the shared server (others list its approvals)
            run.cancel()
            if engine == 'temporal':
                from temporalio.client import Client

                with contextlib.suppress(Exception):  # not started
                    client = await Client.connect(settings['address'])
                    await client.get_workflow_handle(run_id).terminate(reason='metrics_driver failed')


async def _drive(run: Any, run_id: str, engine: str, decide_settings: dict[str, Any], reader: Any) -> dict[str, Any]:
    from durable_capabilities import runner
    from durable_capabilities.approvals import ApprovalError
    from tests.engines.approval_agent import gated

    pending: list[Any] = []
    for _ in range(600):  # the run publishes its pending call: the event the decision waits for (0.1 s polls)
        if run.done():
            break
        try:
            pending = await runner.approvals(run_id, engine=engine, **decide_settings)
        except ApprovalError:  # not started yet
            pending = []
        if pending:
            break
        await asyncio.sleep(0.1)
    assert pending, f'no pending call for {run_id}'
    waiting = points(reader)
    await runner.decide(run_id, pending[0].call_id, approve=True, by='metrics-test', engine=engine, **decide_settings)
    report = await asyncio.wait_for(run, 120)
    return {'output': report.output, 'waiting': waiting, 'after': points(reader), 'agent': gated.name}


async def claim_checked_run(store: str) -> dict[str, Any]:
    """Temporal: the support example (its scripted `FunctionModel` `SupportScript`) with the claim-check threshold
    at 200 bytes, so its payloads travel by reference. Not the approval run: while a run waits, other processes
    listing the server's pending approvals decode its memo, which must then not be a reference into this store."""
    from durable_capabilities import runner
    from examples.support.agent import SupportScript, make_store, make_support

    os.environ['DURCAP_CLAIM_CHECK_THRESHOLD'] = '200'
    agent = make_support(SupportScript(), name=f'metrics-claims-{uuid.uuid4().hex[:6]}')
    report = await runner.run(agent, 'Where is my order ABC-123?', engine='temporal', deps=make_store(), store=store,
                              address=os.environ['DURCAP_TEST_TEMPORAL_ADDRESS'], inline_worker=True,
                              task_queue=f'metrics-{uuid.uuid4().hex[:8]}', notify=lambda line: None)
    return {'output': report.output, 'agent': agent.name}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine', choices=['temporal', 'dbos'])
    parser.add_argument('store')
    parser.add_argument('--db')
    args = parser.parse_args()
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider

    from durable_capabilities import telemetry

    reader = InMemoryMetricReader()
    telemetry.configure(TracerProvider(), MeterProvider(metric_readers=[reader]))
    out = asyncio.run(scenario(args.engine, args.store, args.db, reader))
    if args.engine == 'temporal':
        out['claims_before'] = points(reader).get('durcap.claim_check.bytes', [])
        out['claims_run'] = asyncio.run(claim_checked_run(args.store))
        out['claims'] = points(reader).get('durcap.claim_check.bytes', [])
        out['tokens'] = points(reader).get('durcap.tokens', [])
    print('METRICS ' + json.dumps(out, default=str), flush=True)


if __name__ == '__main__':
    main()
