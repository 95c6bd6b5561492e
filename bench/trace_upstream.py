"""The upstream side of `bench_trace_compare.py`: the crash agent hand-wired on pydantic-ai's own durability.

The same scripted `FunctionModel` (`tests/engines/crash_agent.py`'s `script`: `load_capability('ops')`, `charge`,
`slow_export`, the answer) and the same tool functions, in a new `Capability('ops')`, on a plain `pydantic_ai.Agent`
with upstream's `TemporalDurability` or `DBOSDurability`, instrumented the way pydantic-ai documents without Logfire:
`Agent(instrument=InstrumentationSettings())` with an SDK `TracerProvider` installed globally. On Temporal the client
and the workers also carry temporalio's `TracingInterceptor` (`temporalio.contrib.opentelemetry`), Temporal's own
way to carry a trace from the client through workflows and activities, so the comparison is against the best a
user wires by hand.

Each process exports its spans over OTLP/HTTP (`BatchSpanProcessor`, 100 ms schedule, as the durcap side's
`OTEL_BSP_SCHEDULE_DELAY=100`) to the receiver `bench_trace_compare.py` runs, so spans from a process killed with
SIGKILL count when they were exported before the kill. Roles (`main`):

- `temporal-worker ADDRESS QUEUE ENDPOINT [interceptor|plain]`: a worker for `UpstreamCrashWorkflow` (with
  temporalio's `TracingInterceptor`, or `plain`: pydantic-ai's instrumentation alone); prints `WORKER READY`.
- `dbos-run DB WORKFLOW_ID ENDPOINT`: launch DBOS (which recovers this app's pending workflows), start or await the
  workflow, print `REPORT <json>`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import timedelta
from typing import Any

from pydantic_ai import Agent
from pydantic_ai.capabilities import Capability, Instrumentation
from pydantic_ai.models.function import FunctionModel
from pydantic_ai.models.instrumented import InstrumentationSettings

from tests.engines import crash_agent

PROMPT = 'charge order A-1 and export'
WORKFLOW_NAME = 'trace.upstream.crash'


def make_agent(name: str, durability: Any) -> Agent[None, str]:
    """The crash agent on upstream: same script and tool functions, upstream's durability, pydantic-ai's own
    instrumentation (the `Instrumentation` capability with `InstrumentationSettings()`: the global tracer provider,
    GenAI semantic conventions)."""
    ops = Capability(id='ops', description=crash_agent.ops.description, instructions='Charge first.',
                     defer_loading=True)
    ops.tool_plain(crash_agent.charge)
    ops.tool_plain(crash_agent.slow_export)
    return Agent(FunctionModel(crash_agent.script), name=name,
                 capabilities=[ops, durability, Instrumentation(InstrumentationSettings())])


def install_provider(endpoint: str, service: str) -> Any:
    """An SDK `TracerProvider` (resource: `process.pid`) batching to OTLP/HTTP at `endpoint`, installed globally."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({'service.name': service, 'process.pid': os.getpid()}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f'{endpoint}/v1/traces'),
                                                   schedule_delay_millis=100))
    trace.set_tracer_provider(provider)
    return provider


try:
    from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow, TemporalDurability
    from temporalio import workflow
except ImportError:  # pragma: no cover - temporal extra not installed
    pass
else:
    # 5 s per activity: after the SIGKILL, Temporal retries the killed tool activity once that passes (no heartbeat).
    UPSTREAM_TEMPORAL = make_agent('trace_up_temporal', TemporalDurability(
        activity_config={'start_to_close_timeout': timedelta(seconds=5)}))

    @workflow.defn(name=WORKFLOW_NAME)
    class UpstreamCrashWorkflow(PydanticAIWorkflow):
        __pydantic_ai_agents__ = [UPSTREAM_TEMPORAL]  # noqa: RUF012 - as upstream's docs write it

        @workflow.run
        async def run(self, prompt: str) -> str:
            return (await UPSTREAM_TEMPORAL.run(prompt)).output


async def temporal_worker(address: str, queue: str, endpoint: str, interceptor: str = 'interceptor') -> None:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.client import Client
    from temporalio.contrib.opentelemetry import TracingInterceptor
    from temporalio.worker import Worker
    from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

    install_provider(endpoint, 'upstream-temporal-worker')
    interceptors = [TracingInterceptor()] if interceptor == 'interceptor' else []
    client = await Client.connect(address, plugins=[PydanticAIPlugin()], interceptors=interceptors)
    worker = Worker(client, task_queue=queue, workflows=[UpstreamCrashWorkflow],
                    workflow_runner=SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules(
                        __name__, 'tests', 'durable_capabilities')))
    async with worker:
        print('WORKER READY', flush=True)
        await asyncio.Event().wait()


async def dbos_run(db: str, workflow_id: str, endpoint: str) -> None:
    from dbos import DBOS, SetWorkflowID
    from pydantic_ai.durable_exec.dbos import DBOSDurability

    provider = install_provider(endpoint, 'upstream-dbos')
    agent = make_agent('trace_up_dbos', DBOSDurability())

    @DBOS.workflow(name=WORKFLOW_NAME)
    async def crash_workflow(prompt: str) -> str:
        return (await agent.run(prompt)).output

    DBOS(config={'name': 'trace-upstream', 'system_database_url': db})  # type: ignore[typeddict-item]
    DBOS.launch()
    try:
        if await DBOS.get_workflow_status_async(workflow_id) is None:
            with SetWorkflowID(workflow_id):
                handle = await DBOS.start_workflow_async(crash_workflow, PROMPT)
        else:
            handle = await DBOS.retrieve_workflow_async(workflow_id)
        print('DBOS STARTED', flush=True)
        output = await handle.get_result()
        print('REPORT ' + json.dumps({'output': output}), flush=True)
    finally:
        provider.shutdown()
        DBOS.destroy()


def main() -> None:
    role, *args = sys.argv[1:]
    if role == 'temporal-worker':
        asyncio.run(temporal_worker(*args))
    elif role == 'dbos-run':
        asyncio.run(dbos_run(*args))
    else:
        raise SystemExit(f'unknown role {role!r}')
