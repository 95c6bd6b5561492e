"""Run event streams (`durable_capabilities.streams`) on the local engine and the store's event log.

Model: scripted `pydantic_ai.models.function.FunctionModel`s (one with a `stream_function`, one without, one whose
stream fails half way). Real parts: a SQLite conversation store per test (tmp_path), the `durcap` CLI in a subprocess.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, TextPart, ToolCallPart, UserPromptPart
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, FunctionModel

from durable_capabilities import DurableAgent, runner, streams, watch
from durable_capabilities.streams import EventLog, Limits, answer_text
from durable_capabilities.streams._log import Item, StoredEvent
from tests._helpers import durcap, sqlite_url

WORDS = ['Order ', 'ABC-123 ', 'is ', 'on ', 'its ', 'way.']
ANSWER = ''.join(WORDS)


async def stream_words(messages: list[Any], info: AgentInfo) -> AsyncIterator[str | dict[int, DeltaToolCall]]:
    for word in WORDS:
        yield word


def plain_answer(messages: list[Any], info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart(ANSWER)])


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def events_of(run_id: str, store: str, **kwargs: Any) -> list[streams.RunEvent]:
    return [e async for e in watch(run_id, store=store, wait_for_start=0, **kwargs)]


def local_run(model: Any, store: str, run_id: str, name: str = 'streamer', **kwargs: Any) -> Any:
    agent = DurableAgent(name, model, engines=[], **kwargs)
    return run(runner.run(agent, 'where is ABC-123?', engine='local', run_id=run_id, store=store))


@pytest.mark.parametrize('model', [FunctionModel(stream_function=stream_words), FunctionModel(plain_answer)],
                         ids=['streamed', 'no-stream-function'])
def test_local_run_publishes_every_event_in_order_and_the_text_joins_to_the_answer(model: Any, tmp_path: Path) -> None:
    """A streamed model's deltas arrive one by one; a FunctionModel without `stream_function` is sent the plain
    request and its text is published at the end of the request. Either way: offsets 1..n, the container's events
    first and last, the text equal to the answer, and the finished run's watch ends by itself."""
    store = sqlite_url(tmp_path)
    report = local_run(model, store, 'local-order')
    events = run(events_of('local-order', store))
    assert [e.offset for e in events] == list(range(1, len(events) + 1))
    assert [e.kind for e in events[:2]] == ['run_started', 'capability_catalog'] and events[-1].kind == 'run_completed'
    assert answer_text(events) == report.output == ANSWER
    assert events[-1].data['output'] == ANSWER
    text = [e for e in events if e.kind == 'text_delta']
    assert {(e.unit, e.attempt) for e in text} == {('model_request:1', 1)}
    # Streamed: the deltas that arrived while a write was in flight are joined (a burst: fewer events, same text).
    assert 1 <= len(text) <= len(WORDS) if model.stream_function else len(text) == 1


def test_reconnecting_with_the_last_offset_gets_exactly_the_rest(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    local_run(FunctionModel(stream_function=stream_words), store, 'local-resume')
    whole = run(events_of('local-resume', store))
    for cut in range(len(whole)):
        rest = run(events_of('local-resume', store, from_offset=whole[cut].offset))
        assert [e.offset for e in rest] == [e.offset for e in whole[cut + 1:]]
        assert rest == whole[cut + 1:]


def test_tool_calls_results_and_large_results_are_summarised(tmp_path: Path) -> None:
    """A tool call and its result are published (the result in the next model request's unit); a result over
    `TOOL_RESULT_SUMMARY_CHARS` is cut, with its full size and where it is stored."""
    store = sqlite_url(tmp_path)

    def model(messages: list[Any], info: AgentInfo) -> ModelResponse:
        if len(messages) == 1:
            return ModelResponse(parts=[ToolCallPart('big_report', {'order': 'ABC-123'}, tool_call_id='c1')])
        return ModelResponse(parts=[TextPart('done')])

    def big_report(order: str) -> str:
        """A long report."""
        return order * 5_000

    local_run(FunctionModel(model), store, 'local-tools', tools=[big_report])
    events = run(events_of('local-tools', store))
    call = next(e for e in events if e.kind == 'tool_call')
    result = next(e for e in events if e.kind == 'tool_result')
    assert call.event.part.tool_name == 'big_report' and call.offset < result.offset  # type: ignore[union-attr]
    assert result.data['truncated'] == {'size': len('ABC-123' * 5_000), 'conversation_id': None, 'tool_call_id': 'c1'}
    assert len(result.event.part.content) <= streams.TOOL_RESULT_SUMMARY_CHARS + 3  # type: ignore[union-attr]
    assert answer_text(events) == 'done'


def test_a_retried_model_request_publishes_the_retry_marker_and_no_duplicate(tmp_path: Path) -> None:
    """The same model request unit executed twice in one run (what a durable engine does after a crash or a
    provider error): the second execution is attempt 2, preceded by a `retry` event naming attempt 1, whose partial
    text `answer_text` discards."""
    store = sqlite_url(tmp_path)
    calls = {'n': 0}

    async def flaky(messages: list[Any], info: AgentInfo) -> AsyncIterator[str]:
        calls['n'] += 1
        for index, word in enumerate(WORDS):
            if calls['n'] == 1 and index == 3:
                raise ConnectionError('stream cut half way')
            yield word

    wrapped = streams.StreamingModel(FunctionModel(stream_function=flaky))
    messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart('where is ABC-123?')])]

    async def scenario() -> None:
        with streams.publishing('run-retry', 'local', store):
            with pytest.raises(ConnectionError):
                await wrapped.request(messages, None, ModelRequestParameters())
            await wrapped.request(messages, None, ModelRequestParameters())
            await streams.publish_run('run_completed', {'output': ANSWER}, close=True)

    run(scenario())
    events = run(events_of('run-retry', store))
    retry = next(e for e in events if e.kind == 'retry')
    assert (retry.unit, retry.attempt, retry.data['discard_attempts']) == ('model_request:1', 2, [1])
    first = [e for e in events if e.kind == 'text_delta' and e.attempt == 1]
    assert first and all(e.offset < retry.offset for e in first)
    assert answer_text(events) == ANSWER
    assert len({(e.unit, e.attempt, e.offset) for e in events}) == len(events)


def test_a_request_the_caller_streams_is_published_as_it_is_read(tmp_path: Path) -> None:
    """An agent with an `event_stream_handler` has the engine's unit call the model's `request_stream` (not
    `request`): each event is published as the caller reads it, then the response's tool call; the caller's stream
    is the model's (same events, `get()`), and a cut first attempt is discarded by the second's `retry` marker."""
    store = sqlite_url(tmp_path)
    calls = {'n': 0}

    async def flaky(messages: list[Any], info: AgentInfo) -> AsyncIterator[str | dict[int, DeltaToolCall]]:
        calls['n'] += 1
        for index, word in enumerate(WORDS):
            if calls['n'] == 1 and index == 3:
                raise ConnectionError('stream cut half way')
            yield word
        yield {0: DeltaToolCall(name='order_status', json_args='{"order_id": "ABC-123"}', tool_call_id='call-1')}

    wrapped = streams.StreamingModel(FunctionModel(stream_function=flaky))
    messages: list[ModelMessage] = [ModelRequest(parts=[UserPromptPart('where is ABC-123?')])]
    published_while_reading: list[int] = []

    async def scenario() -> tuple[list[Any], ModelResponse]:
        with streams.publishing('run-rs', 'local', store):
            with pytest.raises(ConnectionError):
                async with wrapped.request_stream(messages, None, ModelRequestParameters()) as stream:
                    async for _ in stream:
                        pass
            seen = []
            async with wrapped.request_stream(messages, None, ModelRequestParameters()) as stream:
                async for event in stream:
                    seen.append(event)
                    if len(seen) == 3:  # the first events reach the log while the caller reads on
                        await wait_until_stored('run-rs', store, lambda rows: any(
                            r.attempt == 2 and r.kind == 'text_delta' for r in rows))
                        published_while_reading.append(True)
                response = stream.get()
            await streams.publish_run('run_completed', {'output': ANSWER}, close=True)
        return seen, response

    seen, response = run(scenario())
    events = run(events_of('run-rs', store))
    second = [e for e in events if e.attempt == 2 and e.kind != 'retry']
    assert ''.join(e.text for e in second) == ANSWER == response.parts[0].content  # type: ignore[union-attr]
    assert len(seen) >= len(WORDS) + 1  # the caller read the model's own events (each word; joined only in the log)
    assert [e.kind for e in second][-1] == 'tool_call' and second[-1].event.part == response.parts[-1]  # type: ignore[union-attr]
    retry = next(e for e in events if e.kind == 'retry')
    assert (retry.unit, retry.attempt, retry.data['discard_attempts']) == ('model_request:1', 2, [1])
    assert answer_text(events) == ANSWER
    assert published_while_reading == [True]


def test_the_first_delta_is_written_at_once_and_a_burst_is_joined(tmp_path: Path) -> None:
    """Group commit: the first text delta is stored while the model still streams (no timer holds it back: the
    model waits for it to be in the log before it goes on); the 200 deltas that follow in a burst are stored in a
    few events (deltas that arrived during a write are joined), in order, the text unchanged."""
    store = sqlite_url(tmp_path)
    burst = [f'w{n} ' for n in range(200)]

    async def first_then_burst(messages: list[Any], info: AgentInfo) -> AsyncIterator[str]:
        yield 'First. '
        await wait_until_stored('run-burst', store, lambda rows: any(r.kind == 'text_delta' for r in rows))
        for word in burst:
            yield word

    wrapped = streams.StreamingModel(FunctionModel(stream_function=first_then_burst))

    async def scenario() -> None:
        with streams.publishing('run-burst', 'local', store):
            await wrapped.request([ModelRequest(parts=[UserPromptPart('go')])], None, ModelRequestParameters())
            await streams.publish_run('run_completed', {'output': ''}, close=True)

    run(scenario())
    text = [e for e in run(events_of('run-burst', store)) if e.kind == 'text_delta']
    assert text[0].text == 'First. '
    assert ''.join(e.text for e in text) == 'First. ' + ''.join(burst)
    assert len(text) < 50, [e.text for e in text]  # joined: 201 deltas, a few events
    assert [e.offset for e in text] == sorted(e.offset for e in text)


def test_a_durable_units_close_ends_the_interval_wait_and_a_cancelled_wait_leaves_its_batch_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A durable unit's publisher (`_UnitPublisher`, flushed commits to a real SQLite log): with the write interval
    raised to 30 s, an event added after the first batch waits in the pacing task; `close` hands it over at once and
    returns once it is stored (well before the interval). Cancelling the pacing task while it waits for a batch's
    commit leaves that batch to be stored (the writer thread runs it; the wait alone ends). No model: events built
    here."""
    from pydantic_ai.messages import PartDeltaEvent, PartStartEvent, TextPartDelta

    from durable_capabilities.streams import _publish

    monkeypatch.setattr(_publish, 'WRITE_INTERVAL_SECONDS', 30.0)
    store = sqlite_url(tmp_path)
    log = EventLog(store)

    async def scenario() -> float:
        unit = _publish._UnitPublisher(_publish.StreamContext('run-pace', 'temporal', log, attempt=1), 'model_request:1')
        unit.add(PartStartEvent(index=0, part=TextPart('One ')))
        await wait_until_stored('run-pace', store, lambda rows: len(rows) == 1)
        unit.add(PartDeltaEvent(index=0, delta=TextPartDelta('two.')))
        await asyncio.sleep(0.05)
        assert unit.pause is not None and not unit.pause.done()  # the pacing task waits for the interval
        started = asyncio.get_running_loop().time()
        await asyncio.wait_for(unit.close(), 10)
        took = asyncio.get_running_loop().time() - started
        assert [(row.offset, row.kind) for row in log.read_sync('run-pace', 0)] == [(1, 'text_delta'), (2, 'text_delta')]

        cancelled = _publish._UnitPublisher(_publish.StreamContext('run-cancel', 'temporal', log, attempt=1),
                                            'model_request:1')
        cancelled.add(PartStartEvent(index=0, part=TextPart('Kept.')))
        assert cancelled.writing is not None
        await asyncio.sleep(0)  # the pacing task has handed the batch over and waits for its commit
        cancelled.writing.cancel()
        await wait_until_stored('run-cancel', store, lambda rows: len(rows) == 1)
        return took

    assert run(scenario()) < 5


async def wait_until_stored(run_id: str, store: str, done: Any, timeout: float = 10.0) -> None:
    """Wait (polling the log from a thread) until `done(rows)` holds for the rows stored for `run_id`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not done(await asyncio.to_thread(EventLog(store).read_sync, run_id, 0)):
        assert asyncio.get_running_loop().time() < deadline, f'{run_id}: not stored within {timeout} s'
        await asyncio.sleep(0.01)


def test_log_skips_a_key_it_has_and_trims_to_its_limits(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    log = EventLog(store, Limits(max_events=5, max_bytes=10_000, retention_seconds=3600))
    items = [Item('u', 1, seq, 'text_delta', {'data': {'n': seq}}) for seq in range(3)]
    assert log.append_sync('r', 'local', items) == [1, 2, 3]
    assert log.append_sync('r', 'local', items) == []  # a replayed or re-sent batch: nothing stored twice
    assert log.append_sync('r', 'local', [Item('u', 1, seq, 'x', {}) for seq in range(3, 8)]) == [4, 5, 6, 7, 8]
    info = log.info_sync('r')
    assert info is not None and (info.first_offset, info.event_count, info.dropped, info.next_offset) == (4, 5, 3, 9)
    assert [row.offset for row in log.read_sync('r', 0)] == [4, 5, 6, 7, 8]
    assert log.next_attempt_sync('r', 'u') == (2, [1])
    # The engine's own attempt (a Temporal activity's; its attempt 2 published nothing) is claimed when it is higher,
    # the retry marker naming the attempts stored.
    assert log.append_unit_sync('r', 'temporal', 'u', [(0, 'x', {})], None, at_least=3) == 3
    retry = log.read_sync('r', 8)[0]
    assert (retry.kind, retry.attempt, retry.body['data']['discard_attempts']) == ('retry', 3, [1])
    assert log.append_unit_sync('r', 'temporal', 'v', [(0, 'x', {})], None, at_least=1) == 1


def test_a_local_runs_event_writes_are_committed_without_a_flush_a_durable_runs_with_one(tmp_path: Path) -> None:
    """The writer thread commits a transaction of only `flush=False` writes (a local run's: `StreamContext.durable`
    false) relaxed, SQLite `synchronous=NORMAL` (1), and one holding a durable engine's write fully, `FULL` (2): each
    job reads the mode of the connection it is committed on."""
    log = EventLog(sqlite_url(tmp_path))
    log.append_sync('r', 'local', [Item('run', 0, 0, 'run_started', {})])  # the schema, before the writer's jobs

    def mode(cursor: Any) -> int:
        return int(cursor.execute('PRAGMA synchronous').fetchone()[0])

    assert log.submit('r', mode, flush=False).result(timeout=60) == 1
    assert log.submit('r', mode).result(timeout=60) == 2

    async def local_run() -> list[str]:
        agent = DurableAgent('relaxed-events', FunctionModel(plain_answer, stream_function=stream_words), engines=[])
        report = await runner.run(agent, 'where is my order?', store=sqlite_url(tmp_path), notify=lambda line: None,
                                  run_id='local-relaxed')
        assert report.output == ANSWER
        return [event.kind async for event in watch('local-relaxed', store=sqlite_url(tmp_path))]

    assert run(local_run())[-1] == 'run_completed'  # every write of the local run stored, its last one awaited


def test_closed_streams_are_dropped_after_the_retention(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    keep = EventLog(store, Limits(retention_seconds=3600))
    keep.append_sync('old', 'local', [Item('run', 0, 0, 'run_completed', {})], close=True)
    assert keep.info_sync('old') is not None
    short = EventLog(store, Limits(retention_seconds=1e-9))
    short.append_sync('new', 'local', [Item('run', 0, 0, 'run_completed', {})], close=True)
    assert keep.info_sync('old') is None and keep.info_sync('new') is None


def test_outside_a_run_the_wrapper_only_forwards(tmp_path: Path) -> None:
    """No `publishing` context (a Temporal activity, `DURCAP_STREAMS=0`): the plain request, nothing published."""
    seen: list[str] = []

    def model(messages: list[Any], info: AgentInfo) -> ModelResponse:
        seen.append('request')
        return ModelResponse(parts=[TextPart('ok')])

    wrapped = streams.StreamingModel(FunctionModel(model))
    response = run(wrapped.request([ModelRequest(parts=[UserPromptPart('x')])], None, ModelRequestParameters()))
    assert response.parts[0].content == 'ok' and seen == ['request']  # type: ignore[union-attr]


def test_watch_errors_name_what_to_fix(tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    # No store at that path: said so, and none is created (a reader never creates a store).
    with pytest.raises(streams.StreamNotFoundError, match=r'no conversation store at .*: nothing was published there'):
        run(events_of('nope', store))
    assert not (tmp_path / 'conversations.db').exists()
    assert streams.EventLog(store).info_sync('nope') is None  # the store now exists, without that run
    with pytest.raises(streams.StreamNotFoundError, match="run 'nope' has published no events"):
        run(events_of('nope', store))
    with pytest.raises(streams.StreamUnsupportedError, match='--engine journal'):
        run(events_of('x', store, engine='journal'))
    with pytest.raises(ValueError, match='from_offset=-1'):
        run(events_of('x', store, from_offset=-1))


def test_cli_watch_prints_jsonl_text_and_resumes_from_an_offset(tmp_path: Path) -> None:
    """`durcap runs watch` in another process: every event as one JSON object per line, `--from N` only the later
    ones, `--format text` the answer; an unknown run is one error line, exit 2, after a line saying it waits (when
    --wait is longer than the notice's 2 s)."""
    store = sqlite_url(tmp_path)
    local_run(FunctionModel(stream_function=stream_words), store, 'local-cli')
    jsonl = durcap('runs', 'watch', 'local-cli', '--store', store, '--format', 'jsonl')
    assert jsonl.returncode == 0, jsonl.stderr
    offsets = [json.loads(line)['offset'] for line in jsonl.stdout.splitlines()]
    assert offsets == list(range(1, len(offsets) + 1))
    later = durcap('runs', 'watch', 'local-cli', '--store', store, '--format', 'jsonl', '--from', '4')
    assert [json.loads(line)['offset'] for line in later.stdout.splitlines()] == offsets[4:]
    assert later.stderr == ''
    # --from past the last event of an ended run: nothing printed, exit 0, and a line saying so (it was silent).
    past = durcap('runs', 'watch', 'local-cli', '--store', store, '--from', str(offsets[-1]))
    assert (past.returncode, past.stdout) == (0, ''), past.stderr
    assert past.stderr.strip() == (f"durcap: run 'local-cli' has no event after offset {offsets[-1]} (the run has ended; "
                                   '--from 0 prints all its events)'), past.stderr
    text = durcap('runs', 'watch', 'local-cli', '--store', store)
    assert ANSWER in text.stdout and '] run_completed' in text.stdout
    # One line per event, the text between them: no empty line before each event (there was one before every event).
    lines = text.stdout.splitlines()
    assert '' not in lines and lines[0].startswith('[1] run_started '), text.stdout
    # --engine names the run's engine: another engine's run is one coded line, exit 2, nothing printed (it printed the
    # local run's events as if they were a Temporal run's).
    other = durcap('runs', 'watch', 'local-cli', '--store', store, '--engine', 'temporal', '--format', 'jsonl')
    assert (other.returncode, other.stdout) == (2, ''), other.stdout + other.stderr
    assert other.stderr.replace('\n', ' ').strip() == (
        "durcap: error: DC040 --engine temporal: run 'local-cli' is a local run (its stream records engine 'local'), "
        'not a temporal one: nothing printed. Fix: drop --engine, or pass --engine local'), other.stderr
    same = durcap('runs', 'watch', 'local-cli', '--store', store, '--engine', 'local', '--format', 'jsonl')
    assert same.returncode == 0 and same.stdout == jsonl.stdout, same.stderr
    missing = durcap('runs', 'watch', 'nope', '--store', store, '--wait', '0')
    assert missing.returncode == 2 and missing.stderr.startswith("durcap: error: DC044 run 'nope' has published no events")
    assert 'Traceback' not in missing.stderr
    # A longer wait is not silent: after WATCH_NOTICE_SECONDS it says what it waits for, then fails as above.
    waited = durcap('runs', 'watch', 'nope', '--store', store, '--wait', '3')
    lines = waited.stderr.splitlines()
    assert waited.returncode == 2 and len(lines) == 2, waited.stderr
    assert lines[0].startswith("durcap: run 'nope' has published no event to ") and 'waiting up to 3 s' in lines[0]
    assert lines[1].startswith("durcap: error: DC044 run 'nope' has published no events")


def test_a_subscriber_in_the_running_process_is_woken_by_each_commit_not_its_poll(tmp_path: Path) -> None:
    """A subscriber in the process that runs the run (as `durcap serve` does for its local turns), polling once an
    hour, still receives every event of a local run, from before the run published anything to its
    `run_completed`: each commit of the run in this process wakes it (`_log.subscribe`). Its watch is bounded by
    `wait_for` (60 s), so a wake that never comes fails the test instead of hanging it; no waiter is left behind."""
    from durable_capabilities.streams import _log

    store = sqlite_url(tmp_path)
    EventLog(store).info_sync('local-woken')  # the store exists: the subscriber waits for the run's first event

    async def subscriber_and_run() -> tuple[list[streams.RunEvent], Any]:
        async def subscribe() -> list[streams.RunEvent]:
            return [e async for e in watch('local-woken', store=store, poll=3600, wait_for_start=3600)]

        watching = asyncio.ensure_future(asyncio.wait_for(subscribe(), 60))
        await asyncio.sleep(0.2)  # the subscriber found no stream yet and waits
        agent = DurableAgent('woken', FunctionModel(stream_function=stream_words), engines=[])
        report = await runner.run(agent, 'where is ABC-123?', engine='local', run_id='local-woken', store=store)
        return await watching, report

    events, report = run(subscriber_and_run())
    assert [e.offset for e in events] == list(range(1, len(events) + 1))
    assert events[0].kind == 'run_started' and events[-1].kind == 'run_completed'
    assert answer_text(events) == report.output == ANSWER
    assert 'local-woken' not in _log._WAITERS


def test_a_subscriber_in_the_running_process_is_handed_the_committed_rows_and_reads_the_store_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows each commit of a local run writes are handed to a subscriber in the same process (`_log.Inbox`), so
    after its first read (nothing published yet) it reads the store no more: every event once, in order, equal to
    what a reader in another process reads from the store afterwards. `EventLog.poll_sync` is wrapped to count its
    calls (the real read still runs)."""
    store = sqlite_url(tmp_path)
    EventLog(store).info_sync('local-handed')
    reads: list[int] = []
    real = EventLog.poll_sync

    def counted(self: EventLog, run_id: str, after: int, *args: Any, **kwargs: Any) -> Any:
        reads.append(after)
        return real(self, run_id, after, *args, **kwargs)

    monkeypatch.setattr(EventLog, 'poll_sync', counted)

    async def collect(events: AsyncIterator[streams.RunEvent]) -> list[streams.RunEvent]:
        return [e async for e in events]

    async def subscriber_and_run() -> list[streams.RunEvent]:
        watching = asyncio.ensure_future(asyncio.wait_for(
            collect(watch('local-handed', store=store, poll=3600, wait_for_start=3600)), 60))
        await asyncio.sleep(0.2)  # the subscriber read once (no stream yet) and waits
        agent = DurableAgent('handed', FunctionModel(stream_function=stream_words), engines=[])
        await runner.run(agent, 'where is ABC-123?', engine='local', run_id='local-handed', store=store)
        return await watching

    events = run(subscriber_and_run())
    monkeypatch.setattr(EventLog, 'poll_sync', real)
    assert events == run(events_of('local-handed', store))  # what the store holds, each event once
    assert events[-1].kind == 'run_completed' and answer_text(events) == ANSWER
    # One read before the run published; the first commit's rows were handed over only when the stream's first
    # commit came after the subscription's (here it does): at most one more read, never one per commit.
    assert len(reads) <= 2, reads


def test_a_commit_whose_rows_were_not_handed_over_is_read_from_the_store(tmp_path: Path) -> None:
    """A commit that hands no rows (one written outside the staging of the writer, as a transaction already under way
    when the subscriber came) wakes the subscriber, which then reads the store: no event is lost or repeated; and a
    commit from another thread (`append_sync` in a worker thread) hands its rows over."""
    from durable_capabilities.streams import _log

    store = sqlite_url(tmp_path)
    log = EventLog(store)
    log.append_sync('local-gap', 'local', [Item('run', 0, 0, 'run_started', {'data': {'agent': 'a'}})])

    async def scenario() -> list[streams.RunEvent]:
        watching = asyncio.ensure_future(asyncio.wait_for(events_of('local-gap', store, poll=3600), 60))
        await asyncio.sleep(0.1)
        with log._backend._raw_txn(relaxed=False) as cur:  # not staged: the subscriber is told only "something"
            log.append_in(cur, 'local-gap', 'local', [Item('run', 0, 1, 'capability_catalog', {'data': {'capabilities': []}})])
        _log._notify('local-gap')
        await asyncio.sleep(0.1)
        await asyncio.to_thread(log.append_sync, 'local-gap', 'local', [  # staged, handed over from a worker thread
            Item('run', 0, 2, 'run_completed', {'data': {'output': 'ok'}})], close=True)
        return await watching

    events = run(scenario())
    assert [(e.offset, e.kind) for e in events] == [(1, 'run_started'), (2, 'capability_catalog'), (3, 'run_completed')]
    assert events == run(events_of('local-gap', store))
    assert 'local-gap' not in _log._WAITERS



async def _report_then_words(messages: list[Any], info: AgentInfo) -> AsyncIterator[str | dict[int, DeltaToolCall]]:
    """Scripted model: a `big_report` call, then the answer streamed word by word."""
    if len(messages) == 1:
        yield {0: DeltaToolCall('big_report', '{"order": "ABC-123"}', tool_call_id='c1')}
        return
    for word in WORDS:
        yield word


def big_report(order: str) -> str:
    """A long report."""
    return order * 5_000


def test_event_json_is_the_run_events_own_json(tmp_path: Path) -> None:
    """`durcap serve`'s Server-Sent Event data (`_watch.event_json`, spliced from the stored JSON) is exactly
    `RunEvent.model_dump_json()` for every event of a run with a tool call, a large (truncated) tool result, streamed
    text and the run's own events; a row read without its stored JSON, or with a `created_at` of another form, goes
    through the model and gives the same."""
    from dataclasses import replace

    from durable_capabilities.streams._watch import event_json, to_run_event

    store = sqlite_url(tmp_path)

    local_run(FunctionModel(stream_function=_report_then_words), store, 'local-json', tools=[big_report])
    log = EventLog(store)
    rows, _ = log.poll_sync('local-json', 0)
    assert {row.kind for row in rows} >= {'run_started', 'tool_call', 'tool_result', 'text_delta', 'run_completed'}
    for row in rows:
        expected = to_run_event('local-json', row).model_dump_json()
        assert event_json('local-json', row) == expected
        assert event_json('local-json', replace(row, raw=None)) == expected
        assert event_json('local-json', replace(row, created_at=row.created_at.replace('+00:00', 'Z'))) == expected
    assert event_json('run "quoted" é', rows[0]) == to_run_event('run "quoted" é', rows[0]).model_dump_json()


def test_rows_handed_over_splice_without_parsing_and_equal_the_stored_rows(tmp_path: Path) -> None:
    """The rows a local run's commits hand to a subscriber in the same process (`_log.HandedEvent`, as `durcap
    serve`'s stream gets them) give `event_json` exactly `RunEvent.model_dump_json()` without their body being parsed
    (its shape was known when it was written), equal the rows read from the store, and parse their body when it is
    read. Model: a scripted `FunctionModel` (a tool call with a large result, then streamed text)."""
    from durable_capabilities.streams import _log
    from durable_capabilities.streams._watch import event_json, to_run_event

    store = sqlite_url(tmp_path)

    async def subscribed_run() -> list[StoredEvent]:
        inbox = _log.subscribe('local-handed-json')
        try:
            agent = DurableAgent('streamer', FunctionModel(stream_function=_report_then_words), engines=[],
                                 tools=[big_report])
            await runner.run(agent, 'where is ABC-123?', engine='local', run_id='local-handed-json', store=store)
            handed, unknown, _closed = inbox.take()
            assert not unknown
            return handed
        finally:
            _log.unsubscribe(inbox)

    handed = run(subscribed_run())
    read, _ = EventLog(store).poll_sync('local-handed-json', 0)
    assert [row.offset for row in handed] == [row.offset for row in read] and len(read) > 5
    shapes = set()
    for mine, stored in zip(handed, read, strict=True):
        assert type(mine) is _log.HandedEvent
        # a copy no tool has looked at (a repr, e.g. an assertion's, parses the body)
        fresh = _log.HandedEvent.of((mine.offset, mine.unit, mine.attempt, mine.seq, mine.kind, mine.raw or '',
                                     mine.created_at, mine.shape))
        assert event_json('local-handed-json', fresh) == to_run_event('local-handed-json', stored).model_dump_json()
        assert 'body' not in vars(fresh)  # spliced from its JSON as stored, never parsed
        shapes.add(mine.shape)
        assert mine == stored and stored == mine and mine.body == stored.body  # the body, parsed once read
    assert shapes >= {'event+data', 'event', 'data'}


def test_temporal_stream_histories_replay_from_before_and_after_events_rode_with_activities() -> None:
    """Recorded Temporal histories of `tests.engines.stream_agent` (scripted `FunctionModel`; a run without a
    conversation and one with) replay against this code: `local-activities-*` recorded by main's code at 20c41c4 (a
    `durcap.stream_publish` local activity per publish of the workflow's own events), `carried-*` by this code (those
    events in the model request and append activities' `CARRY_HEADER`, behind `CARRY_PATCH_ID`), `current-*` by the
    code with one patch marker per new run (`_spec.CURRENT_PATCH_ID`, implying the individual ones)."""
    from durable_capabilities.testing import assert_histories_replay
    from tests._helpers import HISTORIES
    from tests.engines.stream_agent import agent

    assert assert_histories_replay(HISTORIES / 'streams', [agent]) == 6
