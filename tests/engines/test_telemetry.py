"""Traces of durable runs (docs/tracing.md): one span per unit that executed, none for replayed work, one trace.

Models: the support example's scripted `FunctionModel` (`SupportScript`) and the crash agent's
(`tests/engines/crash_agent.py`); no provider. Real parts: the session's Temporal dev server and Prefect server,
DBOS on SQLite, the conversation store on SQLite, workers in their own processes killed with SIGKILL, their spans
exported over OTLP/HTTP (the SDK's `OTLPSpanExporter`, configured by `OTEL_*` variables) to a receiver on 127.0.0.1
that decodes them with `opentelemetry-proto` (`tests/_otlp.py`); the drivers' own spans go to the SDK's in-memory
exporter.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities import telemetry
from tests._helpers import DURCAP, ROOT, subprocess_env, wait_for, wait_for_file
from tests._otlp import OtlpReceiver

pytestmark = pytest.mark.slow

CRASH = 'tests.engines.crash_agent:agent'


def _otel_env(receiver: OtlpReceiver) -> dict[str, str]:
    return {'OTEL_EXPORTER_OTLP_ENDPOINT': receiver.endpoint, 'OTEL_BSP_SCHEDULE_DELAY': '100',
            'OTEL_METRIC_EXPORT_INTERVAL': '500'}


def _tree_checks(spans: list[dict[str, Any]], run_id: str) -> dict[str, list[dict[str, Any]]]:
    """Spans by name, after checking the shape every run has: one trace (the run's), one root `durcap.run` with the
    run's span id, and every other span's parent a span of the trace (the root's parent chain)."""
    assert {s['trace_id'] for s in spans} == {telemetry.trace_id(run_id)}, 'spans outside the run\'s trace'
    by_name: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        by_name.setdefault(span['name'], []).append(span)
    (root,) = by_name['durcap.run']
    assert root['parent'] is None and root['span_id'] == telemetry.run_span_id(run_id)
    ids = {s['span_id'] for s in spans}
    assert all(s['parent'] in ids for s in spans if s is not root), [s['name'] for s in spans if s['parent'] not in ids]
    return by_name


def test_support_demo_on_every_engine_one_span_per_executed_unit(temporal_address: str, prefect_api_url: str,
                                                                 tmp_path: Path) -> None:
    """The support demo on local, DBOS, Temporal (inline worker) and Prefect, each in its own driver process at once:
    one `durcap.model_request` per model response of the run, one `durcap.tool_call` per tool return (the tool's
    name, `durcap.capability` orders), one `durcap.capability_load` (orders), one store load and one append, every
    span in the run's trace under its root; pydantic-ai's own GenAI span once inside each model request span; on a
    durable engine every unit execution has its `durcap.attempt` (attempt 1). Local also runs once with telemetry off first: no `opentelemetry.sdk` module imported."""
    store = f'sqlite:///{tmp_path / "store.sqlite"}'
    env = subprocess_env({'DURCAP_TEST_TEMPORAL_ADDRESS': temporal_address, 'PREFECT_API_URL': prefect_api_url,
                          'PREFECT_HOME': str(tmp_path / 'prefect-home'),
                          'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'prefect-results')})
    procs = {}
    for engine in ('local', 'dbos', 'temporal', 'prefect'):
        extra = ['--off-first'] if engine == 'local' else ['--db', f'sqlite:///{tmp_path / "dbos.sqlite"}']
        procs[engine] = subprocess.Popen([sys.executable, '-m', 'tests.engines.telemetry_driver', engine, store, *extra],
                                         cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         start_new_session=True)
    try:
        outputs = {engine: proc.communicate(timeout=240) for engine, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for engine, (stdout, stderr) in outputs.items():
        lines = [line for line in stdout.splitlines() if line.startswith('SPANS ')]
        assert lines, f'{engine}: no SPANS line\n{stderr[-3000:]}'
        out = json.loads(lines[0][len('SPANS '):])
        report, spans = out['report'], out['spans']
        assert report['output'].startswith('Order ABC-123'), (engine, report['output'])
        run_id = report['run_id'] or spans[-1]['attributes']['durcap.run_id']
        by_name = _tree_checks(spans, run_id)
        responses = [m for m in report['new_messages'] if m['kind'] == 'response']
        returns = [p['tool_name'] for m in report['new_messages'] if m['kind'] == 'request' for p in m['parts']
                   if p['part_kind'] == 'tool-return']
        models = by_name['durcap.model_request']
        assert len(models) == len(responses) == 3, (engine, len(models), len(responses))
        tools = by_name['durcap.tool_call']
        assert [t['attributes']['durcap.tool'] for t in tools] == [r for r in returns if r != 'load_capability'] \
            == ['order_status'], engine
        assert tools[0]['attributes']['durcap.capability'] == 'orders'
        (load,) = by_name['durcap.capability_load']
        assert load['attributes']['durcap.capability'] == 'orders'
        assert len(by_name['durcap.store.load']) == len(by_name['durcap.store.append']) == 1, engine
        ours = [s for s in spans if s['name'].startswith('durcap.')]
        for span in ours:
            assert span['attributes']['durcap.engine'] == engine and span['attributes']['durcap.run_id'] == run_id
            assert span['attributes']['durcap.agent'].startswith(f'tel-{engine}-'), span
        # pydantic-ai's instrumentation: one GenAI span per request that ran, each inside its durcap.model_request
        genai = [s for s in spans if s not in ours]
        assert [s['attributes'].get('gen_ai.operation.name') for s in genai] == ['chat'] * len(models), engine
        assert {s['parent'] for s in genai} == {m['span_id'] for m in models}, engine
        attempts = by_name.get('durcap.attempt', [])
        if engine == 'local':
            assert out['sdk_modules_when_off'] == [], out['sdk_modules_when_off']
            assert not attempts and len(by_name['durcap.turn']) == 1
            continue
        assert len(attempts) == len(models) + len(tools), engine
        attempt_ids = {a['span_id'] for a in attempts}
        assert all(u['parent'] in attempt_ids for u in models + tools), engine
        assert {a['attributes']['durcap.attempt'] for a in attempts} == {1}, engine
        assert 'durcap.turn' not in by_name, f'{engine}: a turn span from container code, which replays'


def test_cli_exports_over_otlp_and_replay_emits_no_spans(tmp_path: Path) -> None:
    """`durcap demo` (local) with `OTEL_EXPORTER_OTLP_ENDPOINT` set exports its spans over OTLP/HTTP before it
    exits (the run's tree arrives whole at the receiver, and its metrics); `durcap replay` of a recorded Temporal
    support history with the same variables exports none (the replayed workflow runs no unit). `durcap runs show`
    is not needed for the trace id: it is `telemetry.trace_id(run id)` (checked in tests/unit)."""
    history = ROOT / 'tests' / 'histories' / 'support' / 'returns.json'
    support = f'{ROOT / "examples" / "support" / "agent.py"}:support'
    with OtlpReceiver() as receiver:
        env = subprocess_env({**_otel_env(receiver), 'DURCAP_STORE': f'sqlite:///{tmp_path / "s.sqlite"}'})
        run = subprocess.run([*DURCAP, 'demo', '--prompt', 'Where is my order ABC-123?'], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
        names = Counter(s['name'] for s in receiver.spans)
        assert names['durcap.run'] == 1 and names['durcap.model_request'] == 3 and names['durcap.tool_call'] == 1, names
        run_id = next(s for s in receiver.spans if s['name'] == 'durcap.run')['attributes']['durcap.run_id']
        _tree_checks(receiver.spans, run_id)
        assert {'durcap.runs.started', 'durcap.runs.completed', 'durcap.run.duration'} <= set(receiver.metrics)
        before = len(receiver.spans)
        replay = subprocess.run([*DURCAP, 'replay', str(history), '--target', support], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=120, check=False)
        assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-2000:]
        assert receiver.spans[before:] == [], [s['name'] for s in receiver.spans[before:]]


def test_metrics_approvals_waiting_and_claim_check_bytes(temporal_address: str, tmp_path: Path) -> None:
    """The approval agent (`tests/engines/approval_agent.py`, a scripted `FunctionModel`) on Temporal (the session's
    server, worker inline, claim-check threshold 200 bytes) and DBOS (SQLite), each in a driver process reading its
    metrics with the SDK's `InMemoryMetricReader` (`tests/engines/metrics_driver.py`): while the run waits for its
    decision `durcap.approvals.waiting` is 1 for the agent and engine, after the decision 0, and the wait is one
    `durcap.approval.wait` point (approved), and no claim-check bytes (the default threshold). On Temporal a second
    run, the support example with the claim-check threshold at 200 bytes: `durcap.claim_check.bytes` counts bytes
    written by reference and read back, and `durcap.tokens` puts its requests under the capability they act on."""
    env = subprocess_env({'DURCAP_TEST_TEMPORAL_ADDRESS': temporal_address, 'DURCAP_CRASH_DIR': str(tmp_path / 'crash')})
    procs = {engine: subprocess.Popen([sys.executable, '-m', 'tests.engines.metrics_driver', engine,
                                       f'sqlite:///{tmp_path / f"store-{engine}.sqlite"}',
                                       '--db', f'sqlite:///{tmp_path / "dbos.sqlite"}'],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True)
             for engine in ('temporal', 'dbos')}
    try:
        outputs = {engine: proc.communicate(timeout=180) for engine, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    for engine, (stdout, stderr) in outputs.items():
        lines = [line for line in stdout.splitlines() if line.startswith('METRICS ')]
        assert lines, f'{engine}: no METRICS line\n{stderr[-3000:]}'
        out = json.loads(lines[0][len('METRICS '):])
        assert out['output'] == 'result: revoked sessions of bob', (engine, out['output'])
        ours = {'durcap.agent': out['agent'], 'durcap.engine': engine}
        assert out['waiting']['durcap.approvals.waiting'] == [{'attributes': ours, 'value': 1}], (engine, out['waiting'])
        assert out['after']['durcap.approvals.waiting'] == [{'attributes': ours, 'value': 0}], (engine, out['after'])
        [wait] = out['after']['durcap.approval.wait']
        assert wait['attributes'] == {**ours, 'durcap.decision': 'approved'} and wait['count'] == 1, wait
        assert 'durcap.claim_check.bytes' not in out['after'], out['after']  # the default threshold: all inline
        if engine == 'dbos':
            continue
        assert out['claims_before'] == [] and out['claims_run']['output'].startswith('Order ABC-123'), out
        claims = {p['attributes']['durcap.direction']: p['value'] for p in out['claims']}
        assert claims['written'] > 0 and claims['read'] > 0, claims
        assert {p['attributes']['durcap.engine'] for p in out['claims']} == {'temporal'}
        # Tokens by capability (issue 27 item 3): the support run's requests that load `orders` or call its tool are
        # counted under it, its answer under no capability; each request once.
        support = [p for p in out['tokens'] if p['attributes'].get('durcap.agent') == out['claims_run']['agent']]
        by_capability = {p['attributes'].get('durcap.capability') for p in support}
        assert by_capability == {'orders', None}, support
        assert all(p['value'] > 0 for p in support if p['attributes']['durcap.direction'] == 'in'), support


def test_unreachable_collector_bounded_exit_one_line(tmp_path: Path) -> None:
    """`durcap demo` (DBOS on SQLite, the support example's scripted `FunctionModel`) exporting to a port that refuses
    connections (a socket bound on 127.0.0.1 that does not listen): the run completes, the exit code is 0, and
    instead of the exporter's log line per retry there is one line naming the endpoint and the cause. The exit is
    bounded (`OTEL_EXPORTER_OTLP_TIMEOUT=3`, the exporter's own retries alone took ~45 s): the process ends, which
    the subprocess timeout (generous) waits for."""
    import socket

    with socket.socket() as refusing:
        refusing.bind(('127.0.0.1', 0))  # bound, never listening: every connection is refused while the test holds it
        endpoint = f'http://127.0.0.1:{refusing.getsockname()[1]}'
        env = subprocess_env({'OTEL_EXPORTER_OTLP_ENDPOINT': endpoint, 'OTEL_EXPORTER_OTLP_TIMEOUT': '3',
                              'DURCAP_STORE': f'sqlite:///{tmp_path / "s.sqlite"}'})
        run = subprocess.run([*DURCAP, 'demo', '--prompt', 'Where is my order ABC-123?'], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert 'answer (dbos): Order ABC-123' in run.stdout, run.stdout[-2000:]
    said = [line for line in run.stderr.splitlines() if 'export' in line.lower()]
    assert len(said) == 1, run.stderr[-3000:]
    assert re.match(rf'durcap: traces( \(\d+ spans\))? and metrics could not be exported to {endpoint}/v1/traces: '
                    'Connection refused', said[0]), said[0]
    assert 'OTEL_EXPORTER_OTLP_ENDPOINT' in said[0] and 'Transient error' not in run.stderr, run.stderr[-3000:]


def _kill_checks(spans: list[dict[str, Any]], run_id: str, crash_dir: Path, killed_pid: int) -> None:
    """The crash agent's run after its worker was killed inside `slow_export`: `slow_export` has two attempt spans
    (the killed one, from the killed process, without a tool span; the retry, from another, with one), `charge`
    one of each, one model request span per request that ran (the model log: 4, none again after the kill), one
    capability load, all in the run's trace under its root."""
    by_name = _tree_checks(spans, run_id)
    attempts = [a for a in by_name['durcap.attempt'] if a['attributes'].get('durcap.tool') == 'slow_export']
    assert len(attempts) == 2, attempts
    pids = [a['resource'].get('process.pid') for a in attempts]
    assert pids[0] == killed_pid and pids[1] not in (None, killed_pid), pids
    tools = Counter(t['attributes']['durcap.tool'] for t in by_name['durcap.tool_call'])
    assert tools == {'charge': 1, 'slow_export': 1}, tools
    (export,) = [t for t in by_name['durcap.tool_call'] if t['attributes']['durcap.tool'] == 'slow_export']
    assert export['parent'] == attempts[1]['span_id'] and export['resource']['process.pid'] == pids[1]
    requests = (crash_dir / 'model-requests').read_text().splitlines()
    assert len(by_name['durcap.model_request']) == len(requests) == 4, (len(by_name['durcap.model_request']), requests)
    assert [c['attributes']['durcap.capability'] for c in by_name['durcap.capability_load']] == ['ops']


def test_temporal_worker_killed_mid_tool_one_trace_two_attempts(temporal_address: str, spawn, tmp_path: Path) -> None:
    """The client (`runner.run` in this process, spans in memory) starts the crash agent's run; worker 1 (its own
    process, OTLP to the receiver) is killed with SIGKILL inside `slow_export`; worker 2 replays the workflow and
    runs the tool again (its heartbeat timeout). One trace from the client's call to the report (`_kill_checks`),
    the retry numbered attempt 2 by Temporal, and no span from worker 2's replay of the work worker 1 did."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from pydantic_ai.models.function import FunctionModel

    from durable_capabilities import DurableAgent, runner
    from tests.engines import crash_agent
    from tests.engines.test_crash import crash_env

    env, crash_dir = crash_env(tmp_path)
    queue = f'tel-crash-{uuid.uuid4().hex[:8]}'
    workflow_id = f'tel-crash-{uuid.uuid4()}'
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    with OtlpReceiver() as receiver:
        args = ('temporal', 'worker', '--target', CRASH, '--address', temporal_address, '--task-queue', queue)
        first = spawn(*args, env={**env, **_otel_env(receiver)})
        first.wait_for('WORKER READY', 90)
        client_agent = DurableAgent(env['DURCAP_CRASH_AGENT'], FunctionModel(crash_agent.script),
                                    capabilities=[crash_agent.ops])
        telemetry.configure(provider)

        async def scenario() -> Any:
            run = asyncio.ensure_future(runner.run(client_agent, 'charge order A-1 and export', engine='temporal',
                                                   address=temporal_address, task_queue=queue, run_id=workflow_id,
                                                   notify=lambda line: None))
            await asyncio.to_thread(wait_for_file, crash_dir / 'slow-started', 60)
            first.kill9()
            second = spawn(*args, env={**env, **_otel_env(receiver)})
            await asyncio.to_thread(second.wait_for, 'WORKER READY', 90)
            return await asyncio.wait_for(run, 120)

        try:
            report = asyncio.run(scenario())
        finally:
            telemetry.configure(None)
        assert report.output == 'charged and exported'
        wait_for(lambda: sum(s['name'] == 'durcap.model_request' for s in receiver.spans) >= 4, 30,
                 message=lambda: str(Counter(s['name'] for s in receiver.spans)))
        client = [{'name': s.name, 'trace_id': f'{ctx.trace_id:032x}', 'span_id': f'{ctx.span_id:016x}',
                   'parent': None, 'attributes': dict(s.attributes or {}), 'resource': {}}
                  for s in exporter.get_finished_spans() if (ctx := s.get_span_context()) is not None]
        spans = [*client, *receiver.spans]
        killed = int((crash_dir / 'slow-started').read_text())
        _kill_checks(spans, workflow_id, crash_dir, killed)
        attempts = [a['attributes']['durcap.attempt'] for a in spans if a['name'] == 'durcap.attempt'
                    and a['attributes'].get('durcap.tool') == 'slow_export']
        assert attempts == [1, 2], attempts


def test_dbos_process_killed_mid_tool_one_trace_two_attempts(spawn, tmp_path: Path) -> None:
    """DBOS on SQLite: the process running the crash agent's workflow is killed with SIGKILL inside `slow_export`;
    a second process recovers the workflow (recorded steps return their outputs) and runs the tool again. Both
    export over OTLP to the receiver: one trace (`_kill_checks`), the root from the process that got the report,
    no span for the steps the recovery replayed."""
    from tests.engines.test_crash import crash_env

    env, crash_dir = crash_env(tmp_path)
    workflow_id = f'tel-crash-{uuid.uuid4()}'
    with OtlpReceiver() as receiver:
        env |= _otel_env(receiver)
        args = ('dbos', 'run', '--target', CRASH, '--db', f'sqlite:///{tmp_path / "dbos.sqlite"}', '--workflow-id',
                workflow_id)
        first = spawn(*args, env=env)
        wait_for_file(crash_dir / 'slow-started', 90)
        first.kill9()
        second = spawn(*args, env=env)
        report = second.report(timeout=120)
        assert report['output'] == 'charged and exported'
        second.popen.wait(30)  # its spans are flushed before it exits
        killed = int((crash_dir / 'slow-started').read_text())
        _kill_checks(receiver.spans, workflow_id, crash_dir, killed)
