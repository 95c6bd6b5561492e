"""Driver of tests/engines/test_telemetry.py: `python -m tests.engines.telemetry_driver ENGINE STORE [--off-first]`.

Runs the support example (`examples/support`, its scripted `FunctionModel` `SupportScript`: no provider) once on
ENGINE through `runner.run`, with this process's spans going to an in-memory exporter (`telemetry.configure`; on
local, the global tracer provider instead, as `logfire.configure()` installs one), and
pydantic-ai's own instrumentation on (`instrument_pydantic_ai=True`), and prints one `SPANS <json>` line: the report (run id, output, new messages) and every finished span. With
`--off-first`, a run with telemetry off comes first, and the line says which OpenTelemetry SDK modules it imported.
Servers: `$DURCAP_TEST_TEMPORAL_ADDRESS` (Temporal, worker inline), `$PREFECT_API_URL`, DBOS on SQLite `--db`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from typing import Any

from pydantic_core import to_jsonable_python


async def demo(engine: str, store: str, db: str | None) -> Any:
    from durable_capabilities import runner
    from examples.support.agent import SupportScript, make_store, make_support

    agent = make_support(SupportScript(), name=f'tel-{engine}-{uuid.uuid4().hex[:6]}')
    settings: dict[str, Any] = {}
    if engine == 'temporal':
        settings = {'address': os.environ['DURCAP_TEST_TEMPORAL_ADDRESS'], 'inline_worker': True,
                    'task_queue': f'tel-{uuid.uuid4().hex[:8]}'}
    if engine == 'dbos':
        settings = {'db': db}
    return await runner.run(agent, 'Where is my order ABC-123?', engine=engine, deps=make_store(),
                            conversation_id=f'tel-{uuid.uuid4().hex}', store=store, notify=lambda line: None,
                            **settings)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine')
    parser.add_argument('store')
    parser.add_argument('--db')
    parser.add_argument('--off-first', action='store_true')
    args = parser.parse_args()
    out: dict[str, Any] = {}
    if args.off_first:
        asyncio.run(demo(args.engine, args.store, args.db))
        out['sdk_modules_when_off'] = sorted(m for m in sys.modules if m.startswith('opentelemetry.sdk'))
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from durable_capabilities import telemetry

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if args.engine == 'local':  # a global SDK provider someone else installed (what `logfire.configure()` does)
        from opentelemetry import trace

        trace.set_tracer_provider(provider)
        telemetry.configure(None, instrument_pydantic_ai=True)
    else:
        telemetry.configure(provider, instrument_pydantic_ai=True)  # pydantic-ai's GenAI spans inside the model unit
    report = asyncio.run(demo(args.engine, args.store, args.db))
    out['report'] = {'run_id': report.run_id, 'output': report.output, 'units': report.durable_units,
                     'new_messages': to_jsonable_python(report.new_messages)}
    out['spans'] = [{'name': s.name, 'trace_id': f'{s.context.trace_id:032x}', 'span_id': f'{s.context.span_id:016x}',
                     'parent': f'{s.parent.span_id:016x}' if s.parent else None, 'attributes': dict(s.attributes or {})}
                    for s in exporter.get_finished_spans()]
    print('SPANS ' + json.dumps(to_jsonable_python(out)), flush=True)


if __name__ == '__main__':
    main()
