"""Traces of one run whose tool is killed mid-call, durcap against upstream's hand-wired durability, side by side.

    .venv/bin/python bench/bench_trace_compare.py                       # Temporal and DBOS (~1 min)
    .venv/bin/python bench/bench_trace_compare.py --engines dbos --json trace-compare.json

Issue 27's last "must show": the crash agent's run (`tests/engines/crash_agent.py`, a scripted `FunctionModel`:
`load_capability('ops')`, `charge`, `slow_export`, the answer; no provider), its worker killed with SIGKILL inside
`slow_export` and the run finished by another worker, traced twice per engine:

- durcap: the worker processes are `tests/engines/drive.py` (as `durcap worker` / `durcap dbos run` run them), their
  telemetry configured from `OTEL_*` (`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_BSP_SCHEDULE_DELAY=100`,
  `DURCAP_OTEL_PYDANTIC_AI=1`: pydantic-ai's GenAI spans inside our model request spans). Temporal: the client is
  this process (`runner.run`, its spans in an in-memory exporter).
- upstream: `bench/trace_upstream.py`, the same script and tool functions on a plain `Agent` with
  `TemporalDurability` / `DBOSDurability` and the `Instrumentation(InstrumentationSettings())` capability on a global
  SDK tracer provider (no Logfire, so no replay-safe provider), plus temporalio's `TracingInterceptor` on the Temporal client
  and workers. Temporal: the client is this process (`client.start_workflow`, interceptor spans in memory).

Every worker process exports over OTLP/HTTP (batched, 100 ms) to a receiver in this process that decodes with
`opentelemetry-proto` (`tests/_otlp.py`), one receiver per side; the kill comes 1 s after `slow_export` started (10x
the batch delay, so what the killed process had ended is exported on both sides). Temporal runs on the server at
`--address` (default `$DURCAP_TEST_TEMPORAL_ADDRESS`, else a dev server started here and stopped by pid); DBOS on
SQLite in a temporary folder.

Printed per engine: the work that really ran (the script's model request log; the tool functions' own logs, the
killed execution included) beside the spans each side emitted for it: per model request, per tool execution, per
capability load, the excess (spans for work that was not done again: replayed workflow tasks, a recovered workflow
re-entering recorded steps), agent run spans, all spans, and the number of traces the run's spans fall in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _path in (str(ROOT / 'src'), str(ROOT), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

CRASH = 'tests.engines.crash_agent:agent'
PROMPT = 'charge order A-1 and export'
SETTLE = 1.0
"""Seconds between `slow_export` starting and the SIGKILL (10x the 100 ms batch delay of both sides)."""
UPSTREAM = [sys.executable, '-c', f'import sys; sys.path[:0] = [{str(BENCH)!r}, {str(ROOT)!r}]; '
            'import trace_upstream; trace_upstream.main()']


@dataclass
class Proc:
    """A process in its own session, its output in a log file."""

    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors='replace')

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text()
            if needle in text:
                return text
            if self.popen.poll() is not None:
                raise RuntimeError(f'process exited ({self.popen.returncode}) before {needle!r}:\n{text[-3000:]}')
            time.sleep(0.05)
        raise TimeoutError(f'no {needle!r} within {timeout} s:\n{self.text()[-3000:]}')

    def kill9(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:  # pragma: no cover - gone meanwhile
                pass
        self.popen.wait(30)


class Procs:
    """Starts processes (`start`); `close` kills every one still running, by its process group."""

    def __init__(self, tmp: Path):
        self.tmp, self.all = tmp, []

    def start(self, argv: list[str], env: dict[str, str]) -> Proc:
        log = self.tmp / f'proc-{len(self.all)}.log'
        with open(log, 'wb') as handle:
            popen = subprocess.Popen(argv, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.all.append(Proc(popen, log))
        return self.all[-1]

    def close(self) -> None:
        for proc in self.all:
            proc.kill9()


def wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f'{path} did not appear within {timeout} s')
        time.sleep(0.05)


def quiet(receiver: Any, seconds: float = 1.0, timeout: float = 30.0) -> None:
    """Wait until the receiver got no span for `seconds` (the last batches of exiting processes arrived)."""
    deadline, count, since = time.monotonic() + timeout, -1, time.monotonic()
    while time.monotonic() < deadline:
        if len(receiver.spans) != count:
            count, since = len(receiver.spans), time.monotonic()
        elif time.monotonic() - since >= seconds:
            return
        time.sleep(0.1)


def base_env(crash_dir: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith('OTEL_')}
    paths = [str(ROOT / 'src'), str(ROOT), env.get('PYTHONPATH', '')]
    return {**env, 'PYTHONPATH': os.pathsep.join(p for p in paths if p), 'DURCAP_CRASH_DIR': str(crash_dir),
            'PYTHONDONTWRITEBYTECODE': '1', **extra}


def durcap_env(crash_dir: Path, receiver: Any, agent: str) -> dict[str, str]:
    return base_env(crash_dir, {'DURCAP_CRASH_AGENT': agent, 'OTEL_EXPORTER_OTLP_ENDPOINT': receiver.endpoint,
                                'OTEL_BSP_SCHEDULE_DELAY': '100', 'OTEL_METRICS_EXPORTER': 'none',
                                'DURCAP_OTEL_PYDANTIC_AI': '1'})


def memory_provider() -> tuple[Any, Any]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def memory_spans(exporter: Any) -> list[dict[str, Any]]:
    return [{'name': s.name, 'trace_id': f'{s.context.trace_id:032x}', 'span_id': f'{s.context.span_id:016x}',
             'parent': f'{s.parent.span_id:016x}' if s.parent else None, 'attributes': dict(s.attributes or {}),
             'resource': {'process.pid': os.getpid()}} for s in exporter.get_finished_spans()]


# ---- one side, one engine -------------------------------------------------------------------------------------


@dataclass
class Side:
    """What one side's run emitted and what really ran."""

    spans: list[dict[str, Any]]
    crash_dir: Path
    output: str
    seconds: float
    notes: list[str] = field(default_factory=list)


async def durcap_temporal(address: str, procs: Procs, tmp: Path) -> Side:
    from pydantic_ai.models.function import FunctionModel

    from durable_capabilities import DurableAgent, runner, telemetry
    from tests._otlp import OtlpReceiver
    from tests.engines import crash_agent

    crash_dir, queue, agent_name = tmp / 'durcap-temporal', f'trace-cmp-{uuid.uuid4().hex[:8]}', f'crashy-{uuid.uuid4().hex[:6]}'
    provider, exporter = memory_provider()
    with OtlpReceiver() as receiver:
        env = durcap_env(crash_dir, receiver, agent_name)
        argv = [sys.executable, '-m', 'tests.engines.drive', 'temporal', 'worker', '--target', CRASH, '--address',
                address, '--task-queue', queue]
        first = procs.start(argv, env)
        await asyncio.to_thread(first.wait_for, 'WORKER READY', 90)
        agent = DurableAgent(agent_name, FunctionModel(crash_agent.script), capabilities=[crash_agent.ops])
        telemetry.configure(provider)
        start = time.monotonic()
        try:
            run = asyncio.ensure_future(runner.run(agent, PROMPT, engine='temporal', address=address, task_queue=queue,
                                                   run_id=f'trace-cmp-{uuid.uuid4()}', notify=lambda line: None))
            await asyncio.to_thread(wait_file, crash_dir / 'slow-started', 90)
            await asyncio.sleep(SETTLE)
            first.kill9()
            second = procs.start(argv, env)
            await asyncio.to_thread(second.wait_for, 'WORKER READY', 90)
            report = await asyncio.wait_for(run, 180)
        finally:
            telemetry.configure(None)
        seconds = time.monotonic() - start
        await asyncio.to_thread(quiet, receiver)
        second.kill9()
        return Side([*memory_spans(exporter), *receiver.spans], crash_dir, str(report.output), seconds)


async def upstream_temporal(address: str, procs: Procs, tmp: Path, interceptor: bool) -> Side:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.client import Client
    from temporalio.contrib.opentelemetry import TracingInterceptor

    from tests._otlp import OtlpReceiver

    kind = 'interceptor' if interceptor else 'plain'
    crash_dir, queue = tmp / f'upstream-temporal-{kind}', f'trace-cmp-up-{uuid.uuid4().hex[:8]}'
    provider, exporter = memory_provider()
    with OtlpReceiver() as receiver:
        env = base_env(crash_dir, {})
        argv = [*UPSTREAM, 'temporal-worker', address, queue, receiver.endpoint, kind]
        first = procs.start(argv, env)
        await asyncio.to_thread(first.wait_for, 'WORKER READY', 90)
        interceptors = [TracingInterceptor(tracer=provider.get_tracer('bench'))] if interceptor else []
        client = await Client.connect(address, plugins=[PydanticAIPlugin()], interceptors=interceptors)
        start = time.monotonic()
        handle = await client.start_workflow('trace.upstream.crash', PROMPT, id=f'trace-cmp-up-{uuid.uuid4()}',
                                             task_queue=queue)
        await asyncio.to_thread(wait_file, crash_dir / 'slow-started', 90)
        await asyncio.sleep(SETTLE)
        first.kill9()
        second = procs.start(argv, env)
        await asyncio.to_thread(second.wait_for, 'WORKER READY', 90)
        output = await asyncio.wait_for(handle.result(), 180)
        seconds = time.monotonic() - start
        await asyncio.to_thread(quiet, receiver)
        second.kill9()
        return Side([*memory_spans(exporter), *receiver.spans], crash_dir, str(output), seconds)


async def dbos_side(side: str, procs: Procs, tmp: Path) -> Side:
    from tests._otlp import OtlpReceiver

    crash_dir = tmp / f'{side}-dbos'
    db = f'sqlite:///{tmp / f"{side}-dbos.sqlite"}'
    workflow_id = f'trace-cmp-{side}-{uuid.uuid4()}'
    with OtlpReceiver() as receiver:
        if side == 'durcap':
            env = durcap_env(crash_dir, receiver, f'crashy-{uuid.uuid4().hex[:6]}')
            argv = [sys.executable, '-m', 'tests.engines.drive', 'dbos', 'run', '--target', CRASH, '--db', db,
                    '--workflow-id', workflow_id]
        else:
            env = base_env(crash_dir, {})
            argv = [*UPSTREAM, 'dbos-run', db, workflow_id, receiver.endpoint]
        start = time.monotonic()
        first = procs.start(argv, env)
        await asyncio.to_thread(wait_file, crash_dir / 'slow-started', 90)
        await asyncio.sleep(SETTLE)
        first.kill9()
        second = procs.start(argv, env)
        text = await asyncio.to_thread(second.wait_for, 'REPORT ', 180)
        seconds = time.monotonic() - start
        report = json.loads(text.split('REPORT ', 1)[1].splitlines()[0])
        await asyncio.to_thread(second.popen.wait, 60)  # its spans are flushed before it exits
        await asyncio.to_thread(quiet, receiver)
        return Side(list(receiver.spans), crash_dir, str(report['output']), seconds)


# ---- counting ---------------------------------------------------------------------------------------------------


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def figures(side: Side, durcap: bool) -> dict[str, Any]:
    """The work that ran (the crash agent's own logs) and the spans emitted for it, by kind."""
    ran_models = len(_lines(side.crash_dir / 'model-requests'))
    ran_tools = len(_lines(side.crash_dir / 'charges')) + len(_lines(side.crash_dir / 'exports'))
    spans = side.spans
    names = Counter(s['name'] for s in spans)
    ops = Counter(s['attributes'].get('gen_ai.operation.name') for s in spans)

    def tool_name(s: dict[str, Any]) -> str | None:
        return s['attributes'].get('gen_ai.tool.name') or s['attributes'].get('durcap.tool')

    executed = [s for s in spans if s['attributes'].get('gen_ai.operation.name') == 'execute_tool']
    genai_tools = sum(1 for s in executed if tool_name(s) != 'load_capability')
    genai_loads = sum(1 for s in executed if tool_name(s) == 'load_capability')
    if durcap:
        model_spans = names['durcap.model_request']
        tool_spans = sum(1 for s in spans if s['name'] == 'durcap.attempt' and s['attributes'].get('durcap.unit') == 'tool_call')
        loads = names['durcap.capability_load']
        runs = names['durcap.run']
    else:
        model_spans, tool_spans, loads, runs = ops['chat'], genai_tools, genai_loads, ops['invoke_agent']
    excess = max(model_spans - ran_models, 0) + max(tool_spans - ran_tools, 0) + max(loads - 1, 0)
    if durcap:
        excess += max(ops['chat'] - ran_models, 0) + max(genai_tools - ran_tools, 0)
    traces = len({s['trace_id'] for s in spans})
    pids = {s['resource'].get('process.pid') for s in spans if s.get('resource')}
    listing = [f"{s['trace_id'][:8]} pid {s.get('resource', {}).get('process.pid')} {s['name']}"
               f"{' ' + str(tool_name(s)) if tool_name(s) else ''}" for s in spans]
    return {'spans': listing, 'model requests that ran': ran_models, 'model request spans': model_spans,
            'GenAI chat spans (pydantic-ai)': ops['chat'],
            'tool executions (killed one included)': ran_tools, 'tool execution spans': tool_spans,
            'capability load spans (1 load)': loads, 'agent run / root spans': runs,
            'spans for work not done again': excess, 'all spans': len(spans), 'traces': traces,
            'processes that exported': len(pids), 'output': side.output}


def table(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One markdown table: a row per engine and figure, a column per side (`-` where an engine has no such side)."""
    labels = list(dict.fromkeys(label for sides in results.values() for label in sides))
    rows = [f'| engine | figure | {" | ".join(labels)} |', '| --- | --- |' + ' --- |' * len(labels)]
    for engine, sides in results.items():
        for key in sides['durcap']:
            if key in ('output', 'spans'):
                continue
            cells = ' | '.join(str(sides[label][key]) if label in sides else '-' for label in labels)
            rows.append(f'| {engine} | {key} | {cells} |')
    return '\n'.join(rows)


async def compare(engines: list[str], address: str | None, tmp: Path) -> dict[str, dict[str, dict[str, Any]]]:
    procs = Procs(tmp)
    server = None
    results: dict[str, dict[str, dict[str, Any]]] = {}
    try:
        if 'temporal' in engines:
            if address is None:
                from durable_capabilities.engines.temporal import start_temporal_dev_server

                server = start_temporal_dev_server(state_dir=tmp / 'temporal', persistent=False)
                address = server.address
                print(f'temporal dev server pid {server.pid} at {address}', flush=True)
            print('temporal: durcap ...', flush=True)
            ours = await durcap_temporal(address, procs, tmp)
            print('temporal: upstream ...', flush=True)
            plain = await upstream_temporal(address, procs, tmp, interceptor=False)
            print('temporal: upstream + TracingInterceptor ...', flush=True)
            theirs = await upstream_temporal(address, procs, tmp, interceptor=True)
            results['temporal'] = {'durcap': figures(ours, True), 'upstream': figures(plain, False),
                                   'upstream + TracingInterceptor': figures(theirs, False)}
        if 'dbos' in engines:
            print('dbos: durcap ...', flush=True)
            ours = await dbos_side('durcap', procs, tmp)
            print('dbos: upstream ...', flush=True)
            theirs = await dbos_side('upstream', procs, tmp)
            results['dbos'] = {'durcap': figures(ours, True), 'upstream': figures(theirs, False)}
    finally:
        procs.close()
        if server is not None:
            server.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or '').split('\n\n')[0])
    parser.add_argument('--engines', default='temporal,dbos', help='comma list of temporal, dbos')
    parser.add_argument('--address', default=os.environ.get('DURCAP_TEST_TEMPORAL_ADDRESS'),
                        help='a Temporal server (default: $DURCAP_TEST_TEMPORAL_ADDRESS, else a dev server started here)')
    parser.add_argument('--json', help='also write the figures to this file')
    parser.add_argument('--spans', action='store_true', help='also list every span (trace, process, name, tool)')
    args = parser.parse_args()
    engines = [e.strip() for e in args.engines.split(',') if e.strip()]
    unknown = set(engines) - {'temporal', 'dbos'}
    if unknown:
        raise SystemExit(f'unknown engine(s): {", ".join(sorted(unknown))} (temporal, dbos)')
    with tempfile.TemporaryDirectory(prefix='trace-compare-') as tmp:
        results = asyncio.run(compare(engines, args.address, Path(tmp)))
    if args.spans:
        for engine, sides in results.items():
            for label, figs in sides.items():
                print(f'{engine} / {label}:')
                print('\n'.join(f'  {line}' for line in figs['spans']))
    print(table(results))
    for engine, sides in results.items():
        print(f'{engine}: outputs: ' + ', '.join(f'{label} {figs["output"]!r}' for label, figs in sides.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == '__main__':
    main()
