"""Real pydantic-ai provider models through every engine, against the wire server (`durable_capabilities.wire`).

Model: `OpenAIResponsesModel`, `OpenAIChatModel` (streamed over SSE: an `event_stream_handler` given in
`engine_options`, as a user does) and `AnthropicModel` (streams by itself) of tests/engines/wire_agent.py, through
their providers' `base_url`, speaking HTTP to a wire server this test starts (uvicorn in a thread of the test process;
the engines run in `durcap` subprocesses). No FunctionModel. Servers: the session's Temporal dev server and Prefect
server; DBOS on SQLite. Every process is stopped by pid.

- the support conversation on 3 engines x 3 models (`durcap run --engine E`): the deferred capability loads,
  `order_status` runs, the answer and the usage are the provider's own fields, each model request is answered once;
  a 500 or a 529 met by one model per engine is retried by the engine; the streaming handler saw the live events;
- provider faults on every engine (OpenAIChatModel, streaming): 429 with `retry-after` then success (the engine's
  retry waited the `retry-after`, read from its own record), a stream cut half way retried as one model request,
  `charge` (a ledger line per execution) once;
- the worker killed (SIGKILL) while a model request is in flight, on every engine: the run completes from the
  engine's record, `charge` ran once;
- an unreachable provider on every engine, and a 401, a 404 or a `retry-after` over the cap, end the run within a
  minute with one line naming the model and its base URL (credentials redacted).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip('openai')
pytest.importorskip('anthropic')

from durable_capabilities.engines import DURABLE_ENGINES
from durable_capabilities.wire import SUPPORT_SCRIPT, Fault, Script, Step, ToolCall, Turn, WireServer
from tests import _helpers
from tests._helpers import ROOT, subprocess_env

pytestmark = pytest.mark.slow


DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']
KINDS = ('openai-responses', 'openai-chat', 'anthropic')
API = {'openai-responses': 'responses', 'openai-chat': 'chat', 'anthropic': 'anthropic'}
ANSWER = 'Order ABC-123 (Blue denim jacket) shipped via UPS and arrives 2026-05-02.'
DEPS = json.dumps({'orders': {'ABC-123': 'Blue denim jacket (size M): shipped 2026-04-28 via UPS.'}})


def engine_env(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """`durcap run` connection flags and environment for `engine` on the session's servers."""
    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}'}
    if engine == 'dbos':
        return ['--db', f'sqlite:///{tmp_path / "dbos.sqlite"}'], env
    if engine == 'temporal':
        address = request.getfixturevalue('temporal_address')
        return ['--address', address, '--inline-worker', '--task-queue', f'wire-{uuid.uuid4().hex[:8]}'], env
    env |= {'PREFECT_API_URL': request.getfixturevalue('prefect_api_url'), 'PREFECT_HOME': str(tmp_path / 'ph'),
            'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'pr')}
    return [], env


def durcap_run(target: str, prompt: str, engine: str, flags: list[str], env: dict[str, str], *extra: str,
               timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DURCAP, 'run', target, prompt, '--engine', engine, *flags, *extra], cwd=ROOT,
                          env=subprocess_env(env), capture_output=True, text=True, timeout=timeout)


SERVER_ERRORS = {('temporal', 'anthropic'): (529, 'ModelOverloadedError'), ('dbos', 'openai-responses'): (500, 'ModelServerError'),
                 ('prefect', 'openai-chat'): (500, 'ModelServerError')}
"""(engine, model kind): the provider error the second model request meets three times (the SDK's first request
and its two retries), so the engine's durable unit retries it once."""


@pytest.mark.parametrize('kind', KINDS)
@pytest.mark.parametrize('engine', DURABLE_ENGINES)
def test_support_conversation_on_every_engine(engine: str, kind: str, request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:
    """The support example on a real provider model: `orders` loads, `order_status` runs as the engine's durable
    unit, the answer is the provider's text and the usage is the sum of the provider's usage fields. On one model
    per engine (`SERVER_ERRORS`) the second request meets a 500 or a 529 (Anthropic's overloaded) three times: the
    engine retries the model request (one log line, no traceback) and the run succeeds."""
    flags, env = engine_env(engine, request, tmp_path)
    script = SUPPORT_SCRIPT
    status, error = SERVER_ERRORS.get((engine, kind), (0, ''))
    if status:
        turn = SUPPORT_SCRIPT.turns[0]
        faulted = dataclasses.replace(turn.steps[1], faults=(Fault(status=status),) * 3)
        script = Script((dataclasses.replace(turn, steps=(turn.steps[0], faulted, turn.steps[2])), *SUPPORT_SCRIPT.turns[1:]))
    stream_log = tmp_path / 'stream.jsonl'
    with WireServer(script) as wire:
        env |= {'DURCAP_WIRE_KIND': kind, 'DURCAP_WIRE_URL': wire.url, 'DURCAP_STREAM_LOG': str(stream_log)}
        out = durcap_run('tests.engines.wire_agent:support', 'Where is my order ABC-123?', engine, flags, env,
                         '--deps-json', DEPS)
        served = [(e['api'], e['step'], e['stream']) for e in wire.log if not e['fault']]
        faults = [(e['step'], e['fault']['status']) for e in wire.log if e['fault']]
    assert out.returncode == 0, out.stdout + out.stderr
    assert f'answer ({engine}): {ANSWER}' in out.stdout
    assert 'capabilities loaded in this run: orders' in out.stdout
    tool_units = [line for line in out.stdout.splitlines() if ('orders' in line and 'call_tool' in line)
                  or line.strip() == 'orders.order_status']  # Temporal/DBOS: the toolset's unit; Prefect: the tool's task run
    assert len(tool_units) == 1, out.stdout
    assert 'usage: 3 requests, 2103 input tokens, 73 output tokens' in out.stdout  # 612+701+790, 18+24+31
    # Runs publish their events (docs/watching.md): the model request streams inside its unit
    # (`streams.StreamingModel`) whatever the agent asked, on every engine.
    assert served == [(API[kind], step, True) for step in range(3)]  # each model request answered once
    assert faults == [(1, status)] * (3 if status else 0), faults
    retried = [line for line in out.stderr.splitlines() if error and f'{error}' in line]
    assert len(retried) == (1 if status else 0), out.stderr  # the engine's one line for its retry
    assert 'Traceback' not in out.stderr
    if kind == 'openai-chat':  # streamed by `event_stream_handler` in engine_options: the handler saw the live events
        events = [json.loads(line) for line in stream_log.read_text().splitlines()]
        assert ''.join(e['text'] for e in events) == ANSWER, events  # the answer's text, streamed in two deltas
        assert [e['kind'] for e in events].count('part_delta') >= 2, events
        assert [e['tool'] for e in events if e['kind'] == 'function_tool_call'] == ['load_capability', 'order_status']


def ledger_script(*faults: tuple[int, Fault]) -> Script:
    """`charge order A-1`: load `billing`, call `charge`, answer; `faults` are (step, fault) pairs."""
    steps = [Step(tool_calls=(ToolCall('load_capability', {'id': 'billing'}),)),
             Step(tool_calls=(ToolCall('charge', {'order_id': 'A-1'}),)),
             Step(text='charged A-1')]
    for index, fault in faults:
        steps[index] = Step(**{**steps[index].__dict__, 'faults': (*steps[index].faults, fault)})
    return Script((Turn(tuple(steps), match='charge order'),))


@pytest.fixture
def ledger_dir(tmp_path: Path) -> Path:
    path = tmp_path / 'ledger'
    path.mkdir()
    return path


def ledger_lines(ledger_dir: Path) -> list[str]:
    path = ledger_dir / 'charges'
    return path.read_text().splitlines() if path.exists() else []


@pytest.mark.parametrize('engine', DURABLE_ENGINES)
def test_429_then_success_and_a_cut_stream(engine: str, request: pytest.FixtureRequest, tmp_path: Path,
                                            ledger_dir: Path) -> None:
    """OpenAIChatModel (streaming): the first request gets 429 `retry-after: 1` three times (the SDK's own two
    retries honour it, then the durable unit's retry waits the `retry-after`, not its own interval: Temporal's
    `next_retry_delay`, a `DBOS.sleep` step in the workflow, the Prefect task run's `AwaitingRetry` delay);
    the request after `charge` is a stream cut half way, retried as one model request by the durable unit (DBOS and
    Prefect: after their own 2 s interval). The run completes, `charge` ran once, and the engine's record shows the
    retried unit and the wait."""
    flags, env = engine_env(engine, request, tmp_path)
    limit = Fault(status=429, retry_after=1)
    script = ledger_script((0, limit), (0, limit), (0, limit), (2, Fault(cut=True)))
    with WireServer(script) as wire:
        env |= {'DURCAP_WIRE_KIND': 'openai-chat', 'DURCAP_WIRE_URL': wire.url, 'DURCAP_LEDGER_DIR': str(ledger_dir),
                'DURCAP_LEDGER_CHARGE_SECONDS': '0'}
        out = durcap_run('tests.engines.wire_agent:ledger', 'charge order A-1', engine, flags, env)
        log = list(wire.log)
    assert out.returncode == 0, out.stdout + out.stderr
    assert 'charged A-1' in out.stdout
    assert ledger_lines(ledger_dir) == ['A-1']
    steps = [(e['step'], (e['fault'] or {}).get('status'), (e['fault'] or {}).get('cut')) for e in log]
    assert steps == [(0, 429, False), (0, 429, False), (0, 429, False), (0, None, None), (1, None, None),
                     (2, 0, True), (2, None, None)], steps
    gaps = [later['at'] - earlier['at'] for earlier, later in itertools.pairwise(log[:4])]
    assert all(gap >= 1.0 for gap in gaps), gaps  # every attempt after a 429 waited its retry-after
    assert 'Traceback' not in out.stderr
    run_id = next((line.split(': ', 1)[1].split()[0] for line in out.stderr.splitlines()
                   if 'workflow id:' in line or 'flow run id:' in line), '')
    if engine == 'temporal':  # the event history: attempt of each model activity
        assert temporal_model_attempts(run_id, flags[flags.index('--address') + 1]) == [2, 1, 2]
    elif engine == 'prefect':  # Prefect logs each task retry (one line) and records the task run's states
        retries = [line for line in out.stderr.splitlines() if 'Task run failed with exception' in line]
        assert len(retries) == 2 and 'ModelRateLimitError' in retries[0] and 'ModelConnectionError' in retries[1], retries
        assert 'Retry 1/2 will start 1.0 second(s) from now' in retries[0], retries
        # each retried model request task run: the delay it was scheduled with, and when it actually started again
        delays = prefect_retry_delays(run_id, env['PREFECT_API_URL'])
        assert [round(scheduled, 1) for scheduled, _ in delays] == [1.0, 2.0], delays  # retry-after, then the interval
        assert all(waited >= scheduled for scheduled, waited in delays), delays
    else:  # DBOS: the 429 ends its step (recorded) and the workflow sleeps the retry-after as a step of its own
        retries = [line for line in out.stderr.splitlines() if 'model request step (attempt' in line]
        assert len(retries) == 2, out.stderr
        assert 'failed: ModelRateLimitError: status_code: 429' in retries[0], retries
        assert 'waiting 1 s (retry-after) in DBOS.sleep before attempt 2' in retries[0], retries
        assert 'failed: ModelConnectionError' in retries[1], retries  # the cut stream, retried inside its step
        rows = dbos_steps(run_id, flags[flags.index('--db') + 1])
        model_rows = [row for row in rows if row[0].endswith('__model.request_stream') or row[0] == 'DBOS.sleep']
        names = [row[0].rsplit('__', 1)[-1] for row in model_rows]
        stream = 'model.request_stream'
        assert names == [stream, 'DBOS.sleep', stream, stream, stream], names
        first, sleep, second = model_rows[:3]
        assert first[1] is not None and second[1] is None  # the 429 recorded as the first step's error
        wake = json.loads(sleep[4])  # DBOS.sleep records its wake-up time (epoch seconds) when it starts
        assert 0.9 <= wake - sleep[2] / 1000 <= 1.5, (sleep, wake)  # it slept the retry-after, not the step interval
        assert second[2] / 1000 >= wake, (second, wake)  # the step ran again once the sleep was over


def temporal_model_attempts(run_id: str, address: str) -> list[int]:
    """The attempt that completed each model request activity, from Temporal's event history."""
    cli = str(Path(sys.executable).parent / 'temporal')
    raw = subprocess.run([cli, 'workflow', 'show', '--workflow-id', run_id, '--address', address, '--output', 'json'],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = json.loads(raw)['events']
    scheduled = {e['eventId']: e['activityTaskScheduledEventAttributes']['activityType']['name'] for e in events
                 if e['eventType'].endswith('ACTIVITY_TASK_SCHEDULED')}
    return [int(e['activityTaskStartedEventAttributes'].get('attempt', 1)) for e in events
            if e['eventType'].endswith('ACTIVITY_TASK_STARTED')
            and scheduled[e['activityTaskStartedEventAttributes']['scheduledEventId']].endswith(
                ('__model_request', '__model_request_stream'))]


def dbos_steps(run_id: str, db: str) -> list[tuple[str, str | None, int, int | None, str | None]]:
    """Each recorded operation of the workflow in order, from DBOS's system database (`operation_outputs`): name,
    error, started and completed (epoch ms), output. A step retried inside itself is one row, written when it
    finished."""
    import sqlite3

    with sqlite3.connect(db.removeprefix('sqlite:///')) as conn:
        return conn.execute("SELECT function_name, error, started_at_epoch_ms, completed_at_epoch_ms, output "
                            "FROM operation_outputs WHERE workflow_uuid = ? ORDER BY function_id", (run_id,)).fetchall()


def prefect_retry_delays(flow_run_id: str, api: str) -> list[tuple[float, float]]:
    """For each task run of the flow run that waited for a retry, in order: (seconds its `AwaitingRetry` state was
    scheduled ahead, seconds until its next state), from the Prefect server's task run state history."""
    from datetime import datetime

    import httpx

    def at(text: str) -> float:
        return datetime.fromisoformat(text.replace('Z', '+00:00')).timestamp()

    with httpx.Client(base_url=api, timeout=30) as client:
        runs = client.post('/task_runs/filter', json={'flow_runs': {'id': {'any_': [flow_run_id]}}}).json()
        found = []
        for run in sorted(runs, key=lambda r: r['expected_start_time'] or r['created']):
            states = sorted(client.get('/task_run_states/', params={'task_run_id': run['id']}).json(),
                            key=lambda s: s['timestamp'])
            for state, following in itertools.pairwise(states):
                if state['name'] == 'AwaitingRetry':
                    stamp = at(state['timestamp'])
                    found.append((at(state['state_details']['scheduled_time']) - stamp, at(following['timestamp']) - stamp))
    return found


RETRY_LINES = {'temporal': ('model_request attempt', 5), 'dbos': ('model request step (attempt', 2),
               'prefect': ("Task run failed with exception: ModelConnectionError('Connection error.') - Retry", 2)}


def test_retry_lines_name_every_durable_engine() -> None:
    """`RETRY_LINES` has the bounded retry of each durable engine, so a new engine cannot skip the check below."""
    assert set(RETRY_LINES) == set(DURABLE_ENGINES)


@pytest.mark.parametrize('engine', DURABLE_ENGINES)
def test_unreachable_provider_ends_the_run_with_one_line(engine: str, request: pytest.FixtureRequest,
                                                         tmp_path: Path) -> None:
    """Connection refused (Temporal's default retry policy alone would retry forever): the run fails after a bounded
    number of attempts (`RETRY_LINES`: one log line per retried attempt, no traceback; was: under 60 s of wall
    time), a last line naming the model and the base URL without its password."""
    flags, env = engine_env(engine, request, tmp_path)
    out = subprocess.run([*DURCAP, 'run', 'examples.support.agent:support', 'Where is my order ABC-123?',
                          '--engine', engine, *flags, '--deps-json', DEPS, '--model', 'openai-chat:gpt-4o',
                          '--base-url', 'http://user:s3cret@127.0.0.1:9/v1'],
                         cwd=ROOT, env=subprocess_env(env), capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout + out.stderr
    assert 'Traceback' not in text and 's3cret' not in text, text
    needle, count = RETRY_LINES[engine]
    retries = [line for line in text.splitlines() if needle in line]
    assert len(retries) == count, text
    assert all('ModelConnectionError' in line for line in retries), retries
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("durcap: error: agent '") and (
        f"' failed on {engine} (model openai-chat:gpt-4o at http://127.0.0.1:9/v1): " in last), out.stderr


OVER_CAP = Fault(status=429, retry_after=300)  # past the SDK's own limit (openai: 120 s): the SDK does not retry it


@pytest.mark.parametrize(('engine', 'fault'), [
    ('temporal', Fault(status=401)), ('prefect', Fault(status=404)), ('dbos', Fault(status=404)),
    ('temporal', OVER_CAP), ('dbos', OVER_CAP),  # Prefect's over-cap refusal is the 404's `return False`, not rerun
], ids=['temporal-401', 'prefect-404', 'dbos-404', 'temporal-429-300s', 'dbos-429-300s'])
def test_request_no_retry_can_fix_ends_the_run(engine: str, fault: Fault, request: pytest.FixtureRequest,
                                               tmp_path: Path) -> None:
    """OpenAIResponsesModel at a base URL holding a password: a 401, a 404 (model not found), or a 429 whose
    `retry-after` (300 s) is over the 30 s every engine's durable retry waits at most (`MAX_RETRY_AFTER_SECONDS`):
    one model request attempt, and the run fails at once with one line naming the model, the base URL without its
    password, and the provider's error. Not retried: Temporal (pydantic-ai's non-retryable `ModelRequestRejectedError`
    / our `RetryAfterCap`), DBOS (our `retry_model_step` / `RetryAfterSleep`), Prefect (our `retry_model_request`)."""
    flags, env = engine_env(engine, request, tmp_path)
    script = Script((Turn((Step(text='never', faults=tuple(fault for _ in range(20))),)),))
    with WireServer(script) as wire:
        url = wire.url.replace('http://', 'http://user:s3cret@')
        env |= {'DURCAP_WIRE_KIND': 'openai-responses', 'DURCAP_WIRE_URL': url}
        # 120 s: a 300 s retry-after slept through would time out (the attempt count below is the check)
        out = durcap_run('tests.engines.wire_agent:support', 'hello', engine, flags, env, '--deps-json', DEPS, timeout=120)
        served = len(wire.log)
    assert out.returncode == 1, out.stdout + out.stderr
    assert served == 1, served  # the SDK does not retry it, nor does the engine (was also: under 60 s of wall time)
    text = out.stdout + out.stderr
    assert 'Traceback' not in text and 's3cret' not in text, text
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("durcap: error: agent '") and (
        f"' failed on {engine} (model openai:gpt-5 at {wire.url}/v1/): " in last), last
    cause = {401: 'AuthenticationError', 404: 'NotFoundError', 429: 'RateLimitError'}[fault.status]
    assert cause in last and str(fault.status) in last, last
    if fault.retry_after:  # one line says why it was not retried
        assert 'the provider asked to wait 300 s (retry-after), more than the 30 s a durable retry waits' in text, text


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    _helpers.wait_for(predicate, timeout, message=f'{what} not seen')


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def start(args: list[str], log: Path, env: dict[str, str], procs: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    handle = open(log, 'wb')
    proc = subprocess.Popen(args, cwd=ROOT, env={**os.environ, **env}, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    handle.close()
    procs.append(proc)
    return proc


def kill9(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize('engine', DURABLE_ENGINES)
def test_worker_killed_while_a_model_request_is_in_flight(engine: str, request: pytest.FixtureRequest,
                                                          tmp_path: Path, ledger_dir: Path,
                                                          procs: list[subprocess.Popen[bytes]]) -> None:
    """AnthropicModel (streaming): the first model request gets 429 `retry-after: 1` three times (the durable
    retry waits it: recorded before the crash); the model request after `charge` is held 30 s by the wire server;
    the process running it is killed with SIGKILL while it waits; a new process (Temporal: a new worker; DBOS: the
    same workflow id launched again, which recovers it; Prefect: `durcap runs resume FLOW_RUN_ID`) completes the
    run from the engine's record: `charge` ran once, the first request and its retry-after wait are not sent again
    (DBOS replays the recorded failed step and `DBOS.sleep`), only the held request is."""
    limit = Fault(status=429, retry_after=1)
    script = ledger_script((0, limit), (0, limit), (0, limit), (2, Fault(delay=30)))
    with WireServer(script) as wire:
        env = {'DURCAP_WIRE_KIND': 'anthropic', 'DURCAP_WIRE_URL': wire.url,
               'DURCAP_LEDGER_DIR': str(ledger_dir), 'DURCAP_LEDGER_CHARGE_SECONDS': '0',
               'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}'}
        held = lambda: any(e['step'] == 2 for e in wire.log)  # noqa: E731
        if engine == 'dbos':
            db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
            run = ['tests.engines.drive', 'dbos', 'run', '--target', 'tests.engines.wire_agent:ledger', '--db', db,
                   '--workflow-id', f'wire-{uuid.uuid4().hex[:8]}', '--prompt', 'charge order A-1']
            first = start([sys.executable, '-m', *run], tmp_path / 'first.log', env, procs)
            wait_for(held, 120, 'the held model request')
            kill9(first)
            second = start([sys.executable, '-m', *run], tmp_path / 'second.log', env, procs)
            assert second.wait(timeout=180) == 0, (tmp_path / 'second.log').read_text()[-3000:]
            report = json.loads((tmp_path / 'second.log').read_text().split('REPORT ', 1)[1].splitlines()[0])
            output = report['output']
        elif engine == 'prefect':
            env |= engine_env('prefect', request, tmp_path)[1]
            first = start([*DURCAP, 'run', 'tests.engines.wire_agent:ledger', 'charge order A-1', '--engine', 'prefect'],
                          tmp_path / 'first.log', env, procs)
            wait_for(held, 120, 'the held model request')
            kill9(first)
            flow_run_id = next(line.split('flow run id: ', 1)[1].split()[0]
                               for line in (tmp_path / 'first.log').read_text().splitlines() if 'flow run id: ' in line)
            second = start([*DURCAP, 'runs', 'resume', flow_run_id, '--engine', 'prefect', '--target',
                            'tests.engines.wire_agent:ledger'], tmp_path / 'second.log', env, procs)
            assert second.wait(timeout=180) == 0, (tmp_path / 'second.log').read_text()[-3000:]
            output = (tmp_path / 'second.log').read_text()
        else:
            address = request.getfixturevalue('temporal_address')
            queue = f'wire-{uuid.uuid4().hex[:8]}'
            worker = [sys.executable, '-m', 'tests.engines.drive', 'temporal', 'worker', '--address', address,
                      '--task-queue', queue, '--target', 'tests.engines.wire_agent:ledger']
            first = start(worker, tmp_path / 'w1.log', env, procs)
            client = start([*DURCAP, 'run', 'tests.engines.wire_agent:ledger', 'charge order A-1', '--engine',
                            'temporal', '--address', address, '--task-queue', queue], tmp_path / 'run.log', env, procs)
            wait_for(held, 120, 'the held model request')
            kill9(first)
            start(worker, tmp_path / 'w2.log', env, procs)
            assert client.wait(timeout=180) == 0, (tmp_path / 'run.log').read_text()[-3000:]
            output = (tmp_path / 'run.log').read_text()
        served = [e['step'] for e in wire.log]
    assert 'charged A-1' in output
    assert ledger_lines(ledger_dir) == ['A-1']
    assert served == [0, 0, 0, 0, 1, 2, 2], served  # only the held request was sent again, once


def test_runs_resume_with_model_finishes_a_run_on_the_model_it_was_started_with(
        tmp_path: Path, ledger_dir: Path, procs: list[subprocess.Popen[bytes]]) -> None:
    """`durcap run --model openai-chat:gpt-4o --base-url A` on DBOS (SQLite), SIGKILLed while its third model request
    is held by wire server A; `durcap runs resume ID --target T --model openai-chat:gpt-4o --base-url A` finishes it
    on A (the real `OpenAIChatModel` class against `durcap wire`): the held request is sent again to A, `charge` ran
    once, and wire server B, where the target's own model points, saw nothing. Before `runs resume` had `--model`,
    the rest of such a run went to the target's own model: one run, two models."""
    script = ledger_script((2, Fault(delay=30)))
    with WireServer(script) as wire, WireServer(ledger_script()) as other:
        db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
        env = {'DURCAP_WIRE_KIND': 'openai-chat', 'DURCAP_WIRE_URL': other.url, 'DURCAP_LEDGER_DIR': str(ledger_dir),
               'DURCAP_LEDGER_CHARGE_SECONDS': '0', 'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}',
               'OPENAI_API_KEY': 'test'}
        model = ['--model', 'openai-chat:gpt-4o', '--base-url', wire.url + '/v1']
        first = start([*DURCAP, 'run', 'tests.engines.wire_agent:ledger', 'charge order A-1', '--engine', 'dbos',
                       '--db', db, *model], tmp_path / 'first.log', env, procs)
        wait_for(lambda: any(e['step'] == 2 for e in wire.log), 120, 'the held model request')
        kill9(first)
        said = (tmp_path / 'first.log').read_text()
        listed = subprocess.run([*DURCAP, 'runs', 'list', '--engine', 'dbos', '--db', db, '--format', 'json'],
                                cwd=ROOT, env=subprocess_env(env), capture_output=True, text=True, timeout=120, check=False)
        assert listed.returncode == 0, listed.stderr
        (run,) = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]
        resumed = subprocess.run([*DURCAP, 'runs', 'resume', run['run_id'], '--engine', 'dbos', '--db', db, '--target',
                                  'tests.engines.wire_agent:ledger', *model], cwd=ROOT, env=subprocess_env(env),
                                 capture_output=True, text=True, timeout=180, check=False)
        assert resumed.returncode == 0, said[-2000:] + resumed.stdout + resumed.stderr
        assert 'charged A-1' in resumed.stdout, resumed.stdout
        assert [e['step'] for e in wire.log].count(2) == 2  # the held request, sent again to A by the resume
        assert other.log == []
    assert ledger_lines(ledger_dir) == ['A-1']
