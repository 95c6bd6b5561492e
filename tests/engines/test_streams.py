"""Run event streams on durable engines, watched from other processes (`durcap runs watch --format jsonl`).

Model: scripted `FunctionModel`s (the support example's, and `tests/engines/stream_agent.py`'s, which streams its
answer word by word). Real parts: DBOS on SQLite, the Temporal dev server, the Prefect server, the conversation store
on SQLite, every run, worker and subscriber its own process, killed with SIGKILL where the test says.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities.streams import RunEvent, answer_text
from tests._helpers import DURCAP, ROOT, subprocess_env, wait_for, wait_for_file

pytestmark = pytest.mark.slow

TARGET = 'tests.engines.stream_agent:agent'


class Subscriber:
    """`durcap runs watch RUN --format jsonl` in its own process group, its stdout in a file."""

    def __init__(self, tmp_path: Path, run_id: str, env: dict[str, str], *extra: str, name: str = 'watch'):
        self.out = tmp_path / f'{name}.jsonl'
        with open(self.out, 'wb') as out, open(tmp_path / f'{name}.err', 'wb') as err:
            self.popen = subprocess.Popen([*DURCAP, 'runs', 'watch', run_id, '--format', 'jsonl', '--wait', '120', *extra],
                                          cwd=ROOT, env=subprocess_env(env), stdout=out, stderr=err,
                                          start_new_session=True)

    def events(self) -> list[RunEvent]:
        lines = self.out.read_text().splitlines()
        return [RunEvent.model_validate_json(line) for line in lines if line.endswith('}')]

    def kill9(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def finish(self, timeout: float = 180) -> list[RunEvent]:
        assert self.popen.wait(timeout=timeout) == 0, (self.out.with_suffix('.err')).read_text()
        return self.events()


@pytest.fixture
def subscribers() -> Any:
    started: list[Subscriber] = []

    def start(*args: Any, **kwargs: Any) -> Subscriber:
        sub = Subscriber(*args, **kwargs)
        started.append(sub)
        return sub

    yield start
    for sub in started:
        sub.kill9()


def assert_in_order_once(events: list[RunEvent]) -> None:
    offsets = [e.offset for e in events]
    assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), offsets
    assert len({(e.unit, e.attempt, e.kind, e.offset) for e in events}) == len(events)


def assert_resumed_after_the_kill(seen: list[RunEvent], rest: list[RunEvent], answer: str) -> list[RunEvent]:
    """Subscriber B (started from A's last offset) got exactly the rest; the stream holds one `retry` marker (attempt
    2 of the answer's model request, discarding attempt 1, whose partial text was published) and, the retry applied,
    the answer. Returns the whole stream."""
    assert rest[0].offset == seen[-1].offset + 1
    whole = [*seen, *rest]
    assert_in_order_once(whole)
    retries = [e for e in whole if e.kind == 'retry']
    assert len(retries) == 1 and retries[0].attempt == 2 and retries[0].data['discard_attempts'] == [1]
    discarded = [e for e in whole if e.kind == 'text_delta' and e.unit == retries[0].unit and e.attempt == 1]
    assert len(discarded) >= 5  # the first attempt's partial text was published, then discarded
    # No event published twice: the run's own events (its container, replayed by the second process) once each, and
    # each attempt's words (all different) once each.
    run_kinds = [e.kind for e in whole if e.unit == 'run']
    assert run_kinds.count('run_started') == 1 and run_kinds.count('run_completed') == 1, run_kinds
    assert [e.kind for e in whole].count('tool_call') == 1  # the first request (the tool call) ran once
    for unit, attempt in {(e.unit, e.attempt) for e in whole}:
        texts = [e.text for e in whole if e.kind == 'text_delta' and (e.unit, e.attempt) == (unit, attempt)]
        assert len(texts) == len(set(texts)), (unit, attempt, texts)
    assert answer_text(whole) == answer and whole[-1].kind == 'run_completed'
    return whole


@pytest.mark.parametrize('engine', ['dbos', 'temporal'])
def test_support_demo_streams_every_event_to_a_subscriber_in_another_process(engine: str, tmp_path: Path, subscribers,
                                                                             request: pytest.FixtureRequest) -> None:
    """`durcap demo --stream` on DBOS (SQLite) and on Temporal (the shared dev server, the demo's inline worker): a
    subscriber started once the workflow id is printed receives every event in order, from `run_started` to
    `run_completed`, the text joined equal to the demo's answer; a subscriber started after the run ended gets the same
    events and ends (on Temporal without any worker running: the events are in the store, not in the workflow)."""
    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}'}
    where = (['--db', f'sqlite:///{tmp_path / "dbos.sqlite"}'] if engine == 'dbos' else
             ['--address', request.getfixturevalue('temporal_address'), '--task-queue', f'demo-{uuid.uuid4().hex[:8]}'])
    err = tmp_path / 'demo.err'
    with open(tmp_path / 'demo.out', 'wb') as out, open(err, 'wb') as errors:
        demo = subprocess.Popen([*DURCAP, 'demo', '--stream', '--engine', engine, *where],
                                cwd=tmp_path, env=subprocess_env(env), stdout=out, stderr=errors, start_new_session=True)
    try:
        line = wait_for(lambda: next((x for x in err.read_text().splitlines() if f'{engine} workflow id:' in x),
                                          None), 180)
        assert line is not None  # wait_for fails first
        run_id = line.split(f'{engine} workflow id:', 1)[1].split()[0]
        live = subscribers(tmp_path, run_id, env, '--engine', engine, name='live')
        assert demo.wait(timeout=300) == 0, err.read_text()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    stdout = (tmp_path / 'demo.out').read_text()
    answer = stdout.split(f'answer ({engine}): ', 1)[1].splitlines()[0]
    events = live.finish()
    assert_in_order_once(events)
    assert events[0].offset == 1 and events[0].kind == 'run_started' and events[-1].kind == 'run_completed'
    assert answer_text(events) == answer == events[-1].data['output']
    kinds = {e.kind for e in events}
    assert {'tool_call', 'tool_result', 'capability_loaded', 'text_delta', 'turn_stored'} <= kinds or \
        {'tool_call', 'tool_result', 'capability_loaded', 'text_delta'} <= kinds, kinds
    assert answer in stdout.split(f'answer ({engine}): ', 1)[0]  # printed as it streamed, before the summary
    late = subscribers(tmp_path, run_id, env, name='late').finish()
    assert late == events


def _stream_env(tmp_path: Path, store: str) -> dict[str, str]:
    return {'DURCAP_STORE': store, 'DURCAP_STREAM_DIR': str(tmp_path / 'stream'),
            'DURCAP_STREAM_AGENT': f'streamer-{uuid.uuid4().hex[:6]}'}


@pytest.mark.parametrize('backend', ['dbos-sqlite', 'dbos-postgresql', 'prefect'])
def test_worker_killed_mid_stream_and_subscriber_restarted_from_its_offset(
        backend: str, tmp_path: Path, spawn, subscribers, request: pytest.FixtureRequest) -> None:
    """DBOS on SQLite, DBOS on PostgreSQL (a fresh database holding DBOS's system tables and the conversation store
    with its event log, dropped after), Prefect (the shared server, the store on SQLite): subscriber A (another
    process) is SIGKILLed after a few text deltas; the process running the run is SIGKILLed mid-stream, inside the
    answer's model request unit; subscriber B starts with A's last offset and a second process completes the run
    (DBOS: the same workflow id launched again, which recovers it; Prefect: the same flow run run again, its finished
    tasks read from their cached results). B gets exactly the events after A's last one (no gap, no repeat), among
    them the `retry` marker of the answer's model request (attempt 2 discarding attempt 1), and the text with the
    retry applied equals the answer."""
    from tests.engines.stream_agent import ANSWER

    if backend == 'dbos-postgresql':
        db = store = request.getfixturevalue('postgres_url')
    else:
        db, store = f'sqlite:///{tmp_path / "dbos.sqlite"}', f'sqlite:///{tmp_path / "conversations.db"}'
    env = _stream_env(tmp_path, store)
    if backend == 'prefect':
        env |= {'PREFECT_API_URL': request.getfixturevalue('prefect_api_url'),
                'PREFECT_HOME': str(tmp_path / 'prefect-home'), 'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'results')}
        first = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'where is ABC-123?', env=env)
        run_id = first.wait_for('PREFECT FLOW RUN', 120).split()[-1]
        again: tuple[str, ...] = ('prefect', 'run', '--target', TARGET, '--prompt', 'where is ABC-123?',
                                  '--flow-run-id', run_id)
    else:
        run_id = f'stream-{uuid.uuid4()}'
        again = ('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', run_id, '--prompt', 'where is ABC-123?')
    a = subscribers(tmp_path, run_id, env, name='a')
    if backend != 'prefect':
        first = spawn(*again, env=env)
    wait_for(lambda: sum(e.kind == 'text_delta' for e in a.events()) >= 4 or None, 180)
    a.kill9()
    seen = a.events()
    wait_for_file(tmp_path / 'stream' / 'mid-stream', 120)
    time.sleep(0.3)  # the deltas before the hang reach the log (each written as it comes)
    first.kill9()
    b = subscribers(tmp_path, run_id, env, '--from', str(seen[-1].offset), name='b')
    second = spawn(*again, env=env)
    report = second.report(timeout=180)
    rest = b.finish()
    assert report['output'] == ANSWER
    assert_resumed_after_the_kill(seen, rest, ANSWER)


def test_temporal_worker_killed_mid_stream_and_subscriber_restarted_from_its_offset(
        temporal_address: str, tmp_path: Path, spawn, subscribers) -> None:
    """Temporal (the shared dev server), `durcap run --engine temporal --stream` against worker 1: subscriber A
    (another process) is SIGKILLed after a few text deltas; worker 1 is SIGKILLed mid-stream, inside the answer's
    model request activity; subscriber B starts with A's last offset and worker 2 starts. The activity's heartbeat
    timeout retries it on worker 2 (Temporal attempt 2): B gets exactly the events after A's last one (no gap, no
    repeat), among them the `retry` marker (attempt 2 discarding attempt 1), the text with the retry applied equals
    the answer `durcap run` printed, and `durcap run --stream` printed the text as it streamed, the retry marked."""
    from tests.engines.stream_agent import ANSWER

    stream_dir = tmp_path / 'stream'
    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}', 'DURCAP_STREAM_DIR': str(stream_dir),
           'DURCAP_STREAM_AGENT': f'streamer-{uuid.uuid4().hex[:6]}', 'DURCAP_STREAM_DELAY': '0.05'}
    queue = f'stream-{uuid.uuid4().hex[:8]}'
    worker = ('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue)
    first = spawn(*worker, env=env)
    first.wait_for('WORKER READY', 90)
    err = tmp_path / 'run.err'
    with open(tmp_path / 'run.out', 'wb') as out, open(err, 'wb') as errors:
        run = subprocess.Popen([*DURCAP, 'run', TARGET, 'where is ABC-123?', '--engine', 'temporal', '--stream',
                                '--address', temporal_address, '--task-queue', queue, '--no-inline-worker'],
                               cwd=ROOT, env=subprocess_env(env), stdout=out, stderr=errors, start_new_session=True)
    try:
        line = wait_for(lambda: next((x for x in err.read_text().splitlines() if 'temporal workflow id:' in x),
                                          None), 120)
        assert line is not None  # wait_for fails first
        run_id = line.split('temporal workflow id:', 1)[1].split()[0]
        a = subscribers(tmp_path, run_id, env, '--engine', 'temporal', name='a')
        wait_for(lambda: sum(e.kind == 'text_delta' for e in a.events()) >= 4 or None, 120)
        a.kill9()
        seen = a.events()
        wait_for_file(stream_dir / 'mid-stream', 120)
        time.sleep(0.3)  # the deltas before the hang reach the log (each written as it comes)
        first.kill9()
        b = subscribers(tmp_path, run_id, env, '--engine', 'temporal', '--from', str(seen[-1].offset), name='b')
        spawn(*worker, env=env)
        assert run.wait(timeout=180) == 0, err.read_text()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    stdout = (tmp_path / 'run.out').read_text()
    assert stdout.split('answer (temporal): ', 1)[1].splitlines()[0] == ANSWER
    streamed = stdout.split('answer (temporal): ', 1)[0]
    assert '[retried' in streamed and ANSWER in streamed.split('[retried', 1)[1]
    whole = assert_resumed_after_the_kill(seen, b.finish(), ANSWER)
    assert [e.kind for e in whole[:2]] == ['run_started', 'capability_catalog'] and whole[0].attempt == 0


def test_prefect_run_streams_to_a_subscriber_in_another_process(tmp_path: Path, spawn, subscribers,
                                                                prefect_api_url: str) -> None:
    """Prefect (the shared server): a subscriber started on the flow run id receives every event in order, the
    text joined equal to the answer."""
    from tests.engines.stream_agent import ANSWER

    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}', 'PREFECT_API_URL': prefect_api_url,
           'PREFECT_HOME': str(tmp_path / 'prefect-home'), 'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'results'),
           'DURCAP_STREAM_AGENT': f'streamer-{uuid.uuid4().hex[:6]}', 'DURCAP_STREAM_DELAY': '0.02'}
    run = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'where is ABC-123?', env=env)
    flow_run_id = run.wait_for('PREFECT FLOW RUN', 120).split()[-1]
    live = subscribers(tmp_path, flow_run_id, env, name='live')
    report = run.report(timeout=240)
    events = live.finish()
    assert report['output'] == ANSWER
    assert_in_order_once(events)
    assert events[0].offset == 1 and events[-1].kind == 'run_completed'
    assert answer_text(events) == ANSWER
    # The prefix in one delta, then 30 words 20 ms apart: one event each, but those that arrive while a write is in
    # flight are joined (a write over 20 ms on a loaded machine).
    assert 2 <= [e.kind for e in events].count('text_delta') <= len(ANSWER.split(' ')) - 3
    assert json.loads(json.dumps(events[-1].data))['output'] == ANSWER


PROVIDER_KINDS = ('openai-chat', 'openai-responses', 'anthropic')
WIRE_ANSWER = 'Order ABC-123 (Blue denim jacket) shipped via UPS and arrives 2026-05-02.'
WIRE_DEPS = json.dumps({'orders': {'ABC-123': 'Blue denim jacket (size M): shipped 2026-04-28 via UPS.'}})


def _engine_flags(engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[list[str], dict[str, str]]:
    """`durcap run` connection flags and environment for `engine` on the session's servers (the store on SQLite)."""
    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}'}
    if engine == 'dbos':
        return ['--db', f'sqlite:///{tmp_path / "dbos.sqlite"}'], env
    if engine == 'temporal':
        return ['--address', request.getfixturevalue('temporal_address'), '--inline-worker', '--task-queue',
                f'wire-{uuid.uuid4().hex[:8]}'], env
    return [], env | {'PREFECT_API_URL': request.getfixturevalue('prefect_api_url'),
                      'PREFECT_HOME': str(tmp_path / 'ph'), 'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'pr')}


PROVIDER_RUNS = [('dbos', kind) for kind in PROVIDER_KINDS] + [('temporal', 'openai-chat'), ('prefect', 'openai-chat')]
"""Every model class on DBOS; on Temporal and Prefect the Chat model, whose agent streams through an
`event_stream_handler` (the model's `request_stream` inside the unit; the other two send `request`, streamed by
`StreamingModel`): the other four pairs pass too (13-23 s each), left out for the suite's time budget."""


@pytest.mark.parametrize(('engine', 'kind'), PROVIDER_RUNS)
def test_real_provider_models_stream_over_sse_and_a_cut_stream_is_discarded(
        engine: str, kind: str, tmp_path: Path, subscribers, request: pytest.FixtureRequest) -> None:
    """The real `OpenAIChatModel`, `OpenAIResponsesModel` and `AnthropicModel` (tests/engines/wire_agent.py's support
    agent, no FunctionModel) streaming over SSE from the wire server (`durable_capabilities.wire`, in a thread of this
    process), on DBOS (SQLite), Temporal (the shared dev server, `durcap run`'s inline worker) and Prefect (the
    shared server). The answer's stream is cut half way on its first request (8 text deltas, the connection closed
    after half the SSE events): the engine retries the model request, the wire server answers it whole. A subscriber
    (`durcap runs watch`, another process, started once the run id is printed) gets every event in order, once: the
    cut attempt's partial text (a proper prefix of the answer), one `retry` marker discarding it, the retried
    request's deltas (8, those that arrived during a write joined), its text exactly the answer, delivered once; with
    the retry applied the text is the answer."""
    pytest.importorskip('openai')
    pytest.importorskip('anthropic')
    import dataclasses

    from durable_capabilities.wire import SUPPORT_SCRIPT, Fault, Script, WireServer

    turn = SUPPORT_SCRIPT.turns[0]
    cut = dataclasses.replace(turn.steps[2], text_deltas=8, faults=(Fault(cut=True),))
    script = Script((dataclasses.replace(turn, steps=(*turn.steps[:2], cut)),))
    flags, env = _engine_flags(engine, request, tmp_path)
    err = tmp_path / 'run.err'
    with WireServer(script) as wire:
        env |= {'DURCAP_WIRE_KIND': kind, 'DURCAP_WIRE_URL': wire.url}
        with open(tmp_path / 'run.out', 'wb') as out, open(err, 'wb') as errors:
            run = subprocess.Popen([*DURCAP, 'run', 'tests.engines.wire_agent:support', 'Where is my order ABC-123?',
                                    '--engine', engine, *flags, '--deps-json', WIRE_DEPS], cwd=ROOT,
                                   env=subprocess_env(env), stdout=out, stderr=errors, start_new_session=True)
        try:
            line = wait_for(lambda: next((x for x in err.read_text().splitlines()
                                               if 'workflow id:' in x or 'flow run id:' in x), None), 180)
            assert line is not None  # wait_for fails first
            run_id = line.split(' id:', 1)[1].split()[0]
            live = subscribers(tmp_path, run_id, env, '--engine', engine, name='live')
            assert run.wait(timeout=240) == 0, err.read_text()
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
        served = [(e['step'], bool(e['fault'] and e['fault']['cut'])) for e in wire.log]
    assert f'answer ({engine}): {WIRE_ANSWER}' in (tmp_path / 'run.out').read_text()
    assert served == [(0, False), (1, False), (2, True), (2, False)], served  # the cut request, then its retry
    events = live.finish()
    assert_in_order_once(events)
    assert events[0].offset == 1 and events[0].kind == 'run_started' and events[-1].kind == 'run_completed'
    retries = [e for e in events if e.kind == 'retry']
    assert len(retries) == 1 and retries[0].data['discard_attempts'] == [1], retries
    unit, attempt = retries[0].unit, retries[0].attempt
    assert attempt == 2
    texts = lambda n: [e.text for e in events if e.kind == 'text_delta' and (e.unit, e.attempt) == (unit, n)]  # noqa: E731
    partial = ''.join(texts(1))
    assert texts(1) and WIRE_ANSWER.startswith(partial) and partial != WIRE_ANSWER, texts(1)  # cut half way
    assert ''.join(texts(2)) == WIRE_ANSWER, texts(2)  # the retried request's text, once (its 8 deltas, some joined)
    assert sum(e.kind == 'text_delta' for e in events) == len(texts(1)) + len(texts(2))  # no other text
    assert answer_text(events) == WIRE_ANSWER == events[-1].data['output']
    offsets = {e.offset for e in events if e.unit == unit}
    assert retries[0].offset > max(e.offset for e in events if (e.unit, e.attempt) == (unit, 1))
    assert min(e.offset for e in events if (e.unit, e.attempt) == (unit, 2) and e.kind != 'retry') > retries[0].offset, \
        offsets


def test_temporal_worker_killed_in_the_first_model_request_stores_run_started_once(
        temporal_address: str, tmp_path: Path, spawn) -> None:
    """Temporal (the shared dev server), `durcap worker temporal` 1 and `durcap run --no-inline-worker`: the first
    model request activity, which carries the workflow's `run_started` and `capability_catalog` in its header
    (`engines.temporal._streams.CarryStreamEvents`), stores them with its first delta and is SIGKILLed in the middle
    of its stream (`$DURCAP_STREAM_HANG=first`); worker 2 runs attempt 2, which carries the same events. The stream
    holds `run_started` once, at offset 1, then `capability_catalog`, attempt 1's partial event, the `retry` marker
    discarding it, no gap or repeat, `run_completed` last with the answer."""
    from durable_capabilities.streams import EventLog
    from durable_capabilities.streams._watch import to_run_event
    from tests.engines.stream_agent import ANSWER

    stream_dir, store = tmp_path / 'stream', f'sqlite:///{tmp_path / "conversations.db"}'
    env = {'DURCAP_STORE': store, 'DURCAP_STREAM_DIR': str(stream_dir), 'DURCAP_STREAM_HANG': 'first',
           'DURCAP_STREAM_AGENT': f'streamer-{uuid.uuid4().hex[:6]}', 'DURCAP_STREAM_DELAY': '0'}
    queue = f'first-{uuid.uuid4().hex[:8]}'
    worker = ('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue)
    first = spawn(*worker, env=env)
    first.wait_for('WORKER READY', 90)
    err = tmp_path / 'run.err'
    with open(tmp_path / 'run.out', 'wb') as out, open(err, 'wb') as errors:
        run = subprocess.Popen([*DURCAP, 'run', TARGET, 'where is ABC-123?', '--engine', 'temporal', '--no-stream',
                                '--address', temporal_address, '--task-queue', queue, '--no-inline-worker'],
                               cwd=ROOT, env=subprocess_env(env), stdout=out, stderr=errors, start_new_session=True)
    log = EventLog(store)
    try:
        line = wait_for(lambda: next((x for x in err.read_text().splitlines() if 'temporal workflow id:' in x),
                                     None), 120)
        assert line is not None  # wait_for fails first
        run_id = line.split('temporal workflow id:', 1)[1].split()[0]
        wait_for_file(stream_dir / 'mid-stream', 120)
        # attempt 1's first event stored (the carried events with it, in its first write) before the kill
        wait_for(lambda: any(e.unit.startswith('model_request') for e in log.read_sync(run_id, 0)) or None, 60)
        first.kill9()
        spawn(*worker, env=env)
        assert run.wait(timeout=180) == 0, err.read_text()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    assert (tmp_path / 'run.out').read_text().split('answer (temporal): ', 1)[1].splitlines()[0] == ANSWER
    events = [to_run_event(run_id, e) for e in log.read_sync(run_id, 0, limit=10_000)]
    assert_in_order_once(events)
    kinds = [e.kind for e in events]
    assert kinds[:2] == ['run_started', 'capability_catalog'] and events[0].offset == 1, kinds
    assert kinds.count('run_started') == 1 and kinds.count('capability_catalog') == 1 and kinds[-1] == 'run_completed'
    retries = [e for e in events if e.kind == 'retry']
    assert len(retries) == 1 and retries[0].unit == 'model_request:1' and retries[0].data['discard_attempts'] == [1]
    assert any(e.unit == 'model_request:1' and e.attempt == 1 for e in events)  # attempt 1's partial event
    assert answer_text(events) == ANSWER


def test_temporal_run_writes_its_own_events_without_a_local_activity_where_an_activity_follows(
        temporal_address: str, tmp_path: Path) -> None:
    """Temporal (the shared dev server), a worker in this process (`make_worker`), `tests.engines.stream_agent`
    (scripted `FunctionModel`): a run with a conversation records no local activity (its `run_started` and
    `capability_catalog` ride with the first model request activity, `turn_stored` and `run_completed` with the
    conversation append activity, both in the activity's `CARRY_HEADER`); a run without one records one
    (`durcap.stream_publish` for `run_completed`: no activity follows its end). Both streams hold every event once,
    in order, `run_started` first and `run_completed` last (the stream closed). Before this change: 3 and 2 local
    activities."""
    import asyncio

    from temporalio.api.enums.v1 import EventType

    from durable_capabilities import runner
    from durable_capabilities.engines.temporal import connect, make_worker
    from durable_capabilities.engines.temporal._streams import CARRY_HEADER
    from durable_capabilities.streams import EventLog
    from durable_capabilities.streams._watch import to_run_event
    from tests.engines.stream_agent import ANSWER, agent

    store = f'sqlite:///{tmp_path / "conversations.db"}'
    queue = f'carry-{uuid.uuid4().hex[:8]}'

    async def scenario() -> dict[str, tuple[list[Any], str]]:
        client = await connect(temporal_address, store=store)
        runs: dict[str, tuple[list[Any], str]] = {}
        async with make_worker(client, [agent], queue, store=store):
            for name, conversation in (('plain', None), ('conversation', f'carry-{uuid.uuid4().hex[:6]}')):
                run_id = f'carry-{name}-{uuid.uuid4().hex[:8]}'
                report = await runner.run(agent, 'where is ABC-123?', engine='temporal', run_id=run_id,
                                          address=temporal_address, task_queue=queue, inline_worker=False, store=store,
                                          notify=lambda line: None, conversation_id=conversation)
                assert report.output == ANSWER
                runs[name] = (list((await client.get_workflow_handle(run_id).fetch_history()).events), run_id)
        return runs

    os.environ['DURCAP_STREAM_DELAY'] = '0'
    try:
        runs = asyncio.run(scenario())
    finally:
        del os.environ['DURCAP_STREAM_DELAY']
    log = EventLog(store)
    for name, (history, run_id) in runs.items():
        markers = [e for e in history if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
                   and e.marker_recorded_event_attributes.marker_name == 'core_local_activity']
        assert len(markers) == (0 if name == 'conversation' else 1), name
        carriers = [e.activity_task_scheduled_event_attributes.activity_type.name for e in history
                    if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
                    and CARRY_HEADER in e.activity_task_scheduled_event_attributes.header.fields]
        expected = ['model_request'] + (['conversation_append'] if name == 'conversation' else [])
        assert [c.rsplit('__', 1)[1] for c in carriers] == expected, carriers
        events = [to_run_event(run_id, e) for e in log.read_sync(run_id, 0, limit=10_000)]
        assert_in_order_once(events)
        kinds = [e.kind for e in events if e.unit == 'run']
        assert kinds == ['run_started', 'capability_catalog', *(['turn_stored'] if name == 'conversation' else []),
                         'run_completed'], kinds
        assert events[0].offset == 1 and events[-1].kind == 'run_completed' and answer_text(events) == ANSWER
        info = log.info_sync(run_id)
        assert info is not None and info.closed_at is not None


def _fail_appends_of_doomed_conversations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the conversation store's `append` fail for good (`AppendIdReuseError`, not retried) for a conversation whose
    id starts with `doomed-`, in this process (the worker's activities run here); every other append is the real one."""
    from durable_capabilities.store import AppendIdReuseError, SQLConversationStore

    real_append = SQLConversationStore.append

    async def append(self: Any, conversation_id: str, *args: Any, **kwargs: Any) -> Any:
        if conversation_id.startswith('doomed-'):
            raise AppendIdReuseError(f'injected: the append of {conversation_id!r} fails for good')
        return await real_append(self, conversation_id, *args, **kwargs)

    monkeypatch.setattr(SQLConversationStore, 'append', append)


def test_temporal_run_whose_conversation_append_fails_for_good_ends_its_stream_with_run_failed(
        temporal_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temporal (the shared dev server), a worker in this process (`make_worker`), `tests.engines.stream_agent`
    (scripted `FunctionModel`), a conversation whose append fails for good: the store's `append` raises
    `AppendIdReuseError` for it (an injected error, one of the append activity's non-retryable ones; the server,
    worker and event log are real). The run fails, and its stream ends with `run_failed` naming the error and is
    closed: its `turn_stored` and `run_completed` rode with the failed append activity and were never stored. Before,
    the stream stayed open after `capability_catalog` and the run's end said nothing (watchers waited). A run on
    another conversation, on the same worker, completes as before."""
    import asyncio

    from durable_capabilities import runner
    from durable_capabilities.engines.temporal import connect, make_worker
    from durable_capabilities.streams import EventLog
    from durable_capabilities.streams._watch import to_run_event
    from tests.engines.stream_agent import ANSWER, agent

    store = f'sqlite:///{tmp_path / "conversations.db"}'
    queue = f'doomed-{uuid.uuid4().hex[:8]}'
    _fail_appends_of_doomed_conversations(monkeypatch)
    monkeypatch.setenv('DURCAP_STREAM_DELAY', '0')
    doomed, fine = f'doomed-run-{uuid.uuid4().hex[:8]}', f'fine-run-{uuid.uuid4().hex[:8]}'

    async def scenario() -> str:
        client = await connect(temporal_address, store=store)
        async with make_worker(client, [agent], queue, store=store):
            try:
                await runner.run(agent, 'where is ABC-123?', engine='temporal', run_id=doomed, address=temporal_address,
                                 task_queue=queue, inline_worker=False, store=store, notify=lambda line: None,
                                 conversation_id=f'doomed-{uuid.uuid4().hex[:6]}')
            except Exception as error:  # noqa: BLE001 - the run must fail
                failure = f'{type(error).__name__}: {error}'
            else:
                raise AssertionError('the run whose append fails for good completed')
            report = await runner.run(agent, 'where is ABC-123?', engine='temporal', run_id=fine,
                                      address=temporal_address, task_queue=queue, inline_worker=False, store=store,
                                      notify=lambda line: None, conversation_id=f'fine-{uuid.uuid4().hex[:6]}')
            assert report.output == ANSWER
        return failure

    failure = asyncio.run(scenario())
    log = EventLog(store)
    events = [to_run_event(doomed, e) for e in log.read_sync(doomed, 0, limit=10_000)]
    assert_in_order_once(events)
    kinds = [e.kind for e in events if e.unit == 'run']
    assert kinds == ['run_started', 'capability_catalog', 'run_failed'], (kinds, failure)
    assert 'AppendIdReuseError' in events[-1].data['error'], events[-1].data
    info = log.info_sync(doomed)
    assert info is not None and info.closed_at is not None  # closed: a watcher stops
    ok = [to_run_event(fine, e) for e in log.read_sync(fine, 0, limit=10_000)]
    assert [e.kind for e in ok if e.unit == 'run'] == ['run_started', 'capability_catalog', 'turn_stored',
                                                        'run_completed']



def test_temporal_closing_events_over_16_kib_are_written_after_the_append_and_never_for_a_failed_one(
        temporal_address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The carry fallback (`CARRY_MAX_BYTES`, 16 KiB): Temporal (the shared dev server), a worker in this process,
    `tests.engines.stream_agent` (scripted `FunctionModel`) answering 20,000 characters more (`$DURCAP_STREAM_PAD`), so
    `turn_stored` + `run_completed` are too large for the append activity's header. A run with a conversation: its
    append activity carries nothing, one local activity (`durcap.stream_publish`) writes them, after the append
    activity completed; the stream holds every event once, in order, closed, with the whole answer. A second such run
    whose append fails for good (the store's `append` raising `AppendIdReuseError` for it: an injected error): no
    `turn_stored` or `run_completed` is written, the stream ends with `run_failed`. Before, the fallback wrote them
    before the append (a watcher saw the turn stored before it was), and a failed append's run said completed."""
    import asyncio

    from temporalio.api.enums.v1 import EventType

    from durable_capabilities import runner
    from durable_capabilities.engines.temporal import connect, make_worker
    from durable_capabilities.engines.temporal._streams import CARRY_HEADER
    from durable_capabilities.streams import EventLog
    from durable_capabilities.streams._watch import to_run_event
    from tests.engines.stream_agent import ANSWER, agent

    store = f'sqlite:///{tmp_path / "conversations.db"}'
    queue = f'large-{uuid.uuid4().hex[:8]}'
    _fail_appends_of_doomed_conversations(monkeypatch)
    monkeypatch.setenv('DURCAP_STREAM_DELAY', '0')
    monkeypatch.setenv('DURCAP_STREAM_PAD', '20000')
    answer = ANSWER + ' ' + 'x' * 20000
    stored, doomed = f'large-run-{uuid.uuid4().hex[:8]}', f'large-doomed-{uuid.uuid4().hex[:8]}'

    async def scenario() -> list[Any]:
        client = await connect(temporal_address, store=store)
        async with make_worker(client, [agent], queue, store=store):
            report = await runner.run(agent, 'where is ABC-123?', engine='temporal', run_id=stored,
                                      address=temporal_address, task_queue=queue, inline_worker=False, store=store,
                                      notify=lambda line: None, conversation_id=f'large-{uuid.uuid4().hex[:6]}')
            assert report.output == answer
            history = list((await client.get_workflow_handle(stored).fetch_history()).events)
            with pytest.raises(Exception):  # noqa: B017 - the run must fail (Temporal's WorkflowFailureError)
                await runner.run(agent, 'where is ABC-123?', engine='temporal', run_id=doomed, address=temporal_address,
                                 task_queue=queue, inline_worker=False, store=store, notify=lambda line: None,
                                 conversation_id=f'doomed-{uuid.uuid4().hex[:6]}')
        return history

    history = asyncio.run(scenario())
    markers = [e.event_id for e in history if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED
               and e.marker_recorded_event_attributes.marker_name == 'core_local_activity']
    scheduled = {e.event_id: e.activity_task_scheduled_event_attributes for e in history
                 if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED}
    [append_id] = [i for i, a in scheduled.items() if a.activity_type.name.endswith('conversation_append')]
    assert CARRY_HEADER not in scheduled[append_id].header.fields  # too large for the header
    [completed] = [e.event_id for e in history if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED
                   and e.activity_task_completed_event_attributes.scheduled_event_id == append_id]
    assert len(markers) == 1 and markers[0] > completed, (markers, completed)  # written after the append
    log = EventLog(store)
    events = [to_run_event(stored, e) for e in log.read_sync(stored, 0, limit=10_000)]
    assert_in_order_once(events)
    assert [e.kind for e in events if e.unit == 'run'] == ['run_started', 'capability_catalog', 'turn_stored',
                                                          'run_completed']
    assert events[-1].data['output'] == answer and answer_text(events) == answer
    info = log.info_sync(stored)
    assert info is not None and info.closed_at is not None
    failed = [to_run_event(doomed, e) for e in log.read_sync(doomed, 0, limit=10_000)]
    assert [e.kind for e in failed if e.unit == 'run'] == ['run_started', 'capability_catalog', 'run_failed']
    assert 'AppendIdReuseError' in failed[-1].data['error'], failed[-1].data
    info = log.info_sync(doomed)
    assert info is not None and info.closed_at is not None
