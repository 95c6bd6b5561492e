"""Conversations of any size on every engine (issue 10 items 1 and 2), and a turn that survives a store outage
during its append (item 4).

Model: the scripted `FunctionModel` of tests/engines/size_agent.py (no provider). Real servers: the session's
Temporal dev server and Prefect server (tests/engines/conftest.py), DBOS on SQLite, the conversation store in a
fresh PostgreSQL database on 127.0.0.1:5432. Each turn runs in a `size_driver` subprocess (Temporal: an inline
worker; its client and worker use the claim-check codec on the same store).

- a stored conversation of 10,000 messages (~7.6 MB, built with `SQLConversationStore.append`) resumes and completes;
- a conversation whose single tool result is 3 MB completes;
- a conversation of many ~500-byte tool outputs past 2.5 MB completes (and calls more tools);
- Temporal: a payload over the configured maximum fails in under 30 s with DC030 naming the conversation, its
  size and the limit; the large payloads of the other runs are claim checks in `durcap_payloads`;
- the store cut for 20 s (an asyncio TCP proxy in front of PostgreSQL, stopped while the append runs): the turn
  completes on Temporal and DBOS, its tool ran once, the turn is stored once.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import (
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)

from durable_capabilities.engines import DURABLE_ENGINES
from durable_capabilities.store import SQLConversationStore
from tests._helpers import ROOT, subprocess_env, wait_for

# One worker runs this module's tests (pytest-xdist `loadgroup`): they share a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('payload-sizes')]


MAXIMUM = 12_000_000  # the configured single-payload maximum of these runs (bytes)
ENGINES = DURABLE_ENGINES


# ---- helpers ------------------------------------------------------------------------------------


def drive(engine: str, conversation: str, prompt: str, *, store: str, tmp: Path, address: str, prefect: str,
          env: dict[str, str] | None = None, timeout: float = 300, workflow_id: str | None = None) -> dict[str, Any]:
    """Run one turn in a `size_driver` process (stopped by pid, whatever happens); its REPORT or FAILED line."""
    args = [sys.executable, '-m', 'tests.engines.size_driver', engine, '--conversation', conversation, '--prompt', prompt]
    if engine == 'temporal':
        args += ['--address', address]
    if engine == 'dbos':
        args += ['--db', f'sqlite:///{tmp / "dbos.sqlite"}']
    if workflow_id:
        args += ['--workflow-id', workflow_id]
    log = tmp / f'{engine}-{uuid.uuid4().hex[:8]}.log'
    environment = subprocess_env({
        'DURCAP_STORE': store, 'DURCAP_PAYLOAD_MAXIMUM': str(MAXIMUM), 'PREFECT_API_URL': prefect,
        'PREFECT_HOME': str(tmp / 'prefect-home'), 'PREFECT_LOCAL_STORAGE_PATH': str(tmp / 'prefect-results'),
        **(env or {}),
    })
    with open(log, 'wb') as handle:
        popen = subprocess.Popen(args, cwd=tmp, stdout=handle, stderr=subprocess.STDOUT, env=environment,
                                 start_new_session=True)
    try:
        popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, 9)
            popen.wait(timeout=30)
    text = log.read_text(errors='replace')
    for line in text.splitlines():
        for tag in ('REPORT ', 'FAILED '):
            if line.startswith(tag):
                return {'ok': tag == 'REPORT ', **json.loads(line.removeprefix(tag)), 'log': text[-3000:], 'log_file': log}
    raise AssertionError(f'{engine} driver gave no report within {timeout} s (exit {popen.returncode}):\n{text[-6000:]}')


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def seed(url: str, cid: str, messages: list[Any], chunk: int = 1000) -> None:
    """Store `messages` under `cid` with `SQLConversationStore.append`, `chunk` messages per append."""

    async def write() -> None:
        async with SQLConversationStore(url) as store:
            revision = None
            for start in range(0, len(messages), chunk):
                revision = (await store.append(cid, messages[start:start + chunk], expected_revision=revision)).revision

    run(write())


def read(url: str, cid: str) -> Any:
    async def go() -> Any:
        async with SQLConversationStore(url) as store:
            return await store.read(cid), await store.writes(cid)

    return run(go())


def json_size(messages: list[Any]) -> int:
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    return len(ModelMessagesTypeAdapter.dump_json(messages))


def ten_thousand() -> list[Any]:
    text = 'lorem ipsum dolor sit amet ' * 10  # 270 characters: ~760 bytes a message with its JSON
    return [
        message
        for i in range(5000)
        for message in (ModelRequest(parts=[UserPromptPart(f'{i}: {text}')]), ModelResponse(parts=[TextPart(f'{i}: {text}')]))
    ]


def tool_outputs(pairs: int) -> list[Any]:
    messages: list[Any] = [ModelRequest(parts=[UserPromptPart(f'tools {pairs} 500')])]
    for i in range(pairs):
        messages.append(ModelResponse(parts=[ToolCallPart('produce', {'size': 500}, tool_call_id=f'seed-{i}')]))
        messages.append(ModelRequest(parts=[ToolReturnPart('produce', 'x' * 500, tool_call_id=f'seed-{i}')]))
    messages.append(ModelResponse(parts=[TextPart(f'produced {pairs * 500} chars')]))
    return messages


@pytest.fixture(scope='module')
def world(tmp_path_factory: pytest.TempPathFactory, temporal_address: str, prefect_api_url: str) -> Any:
    """One fresh PostgreSQL store for the module, seeded once per engine."""
    from tests._helpers import create_database, drop_database, pg_url

    name = create_database('durcap_sizes')
    store = pg_url(name)
    big, shape = ten_thousand(), tool_outputs(3300)
    assert len(big) == 10_000 and 7_000_000 < json_size(big) < 8_000_000
    assert json_size(shape) > 2_500_000
    for engine in ENGINES:
        seed(store, f'big-{engine}', big)
        seed(store, f'shape-{engine}', shape)
    world = {'store': store, 'tmp': tmp_path_factory.mktemp('sizes'), 'address': temporal_address, 'prefect': prefect_api_url}
    yield world
    drop_database(name)


def turn(world: dict[str, Any], engine: str, conversation: str, prompt: str, **kwargs: Any) -> dict[str, Any]:
    tmp = world['tmp'] / engine
    tmp.mkdir(exist_ok=True)
    return drive(engine, conversation, prompt, store=world['store'], tmp=tmp, address=world['address'],
                 prefect=world['prefect'], **kwargs)


def temporal_retries(world: dict[str, Any], workflow_id: str) -> dict[str, Any]:
    """What Temporal retried for `workflow_id`: `{'started': bool, 'attempts': [activity attempts], 'task_failures': n,
    'closed': event type name of the last event}` (`started` False when no workflow was ever started). The "fails fast"
    tests check these counts instead of wall time: a payload over the maximum must fail the run, not be retried."""
    from temporalio.api.enums.v1 import EventType
    from temporalio.service import RPCError

    from durable_capabilities.engines.temporal import connect

    async def go() -> dict[str, Any]:
        client = await connect(world['address'])
        try:
            events = [e async for e in client.get_workflow_handle(workflow_id).fetch_history_events()]
        except RPCError:
            return {'started': False, 'attempts': [], 'task_failures': 0, 'closed': None}
        return {
            'started': True,
            'attempts': [e.activity_task_started_event_attributes.attempt for e in events
                         if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED],
            'task_failures': sum(e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_FAILED for e in events),
            'closed': EventType.Name(events[-1].event_type),
        }

    return run(go())


def assert_failed_without_retrying(world: dict[str, Any], workflow_id: str) -> None:
    """The workflow (if one started) failed at once: no activity attempt past the first, no workflow task retried."""
    retries = temporal_retries(world, workflow_id)
    assert all(a == 1 for a in retries['attempts']) and retries['task_failures'] == 0, retries
    assert not retries['started'] or retries['closed'] == 'EVENT_TYPE_WORKFLOW_EXECUTION_FAILED', retries


def prefect_run_counts(world: dict[str, Any], flow_run_id: str, tasks_expected: bool = True) -> dict[str, Any]:
    """How often Prefect ran the flow run and each of its task runs, once every one is final: `{'flow': run_count,
    'tasks': [(task run name, run_count)]}` (a retried task run counts each attempt; Prefect records task runs from
    events, so they are read until none is missing or unfinished, within 60 s; `tasks_expected=False`: a flow run that
    ran none is read once it is final)."""
    import httpx

    def read() -> dict[str, Any] | None:
        with httpx.Client(base_url=world['prefect'], timeout=30) as client:
            flow = client.get(f'/flow_runs/{flow_run_id}').json()
            tasks = client.post('/task_runs/filter', json={'flow_runs': {'id': {'any_': [flow_run_id]}}}).json()
        final = ('COMPLETED', 'FAILED', 'CRASHED', 'CANCELLED')
        if flow.get('state_type') not in final or (tasks_expected and not tasks) \
                or any(t.get('state_type') not in final for t in tasks):
            return None
        return {'flow': flow['run_count'], 'tasks': sorted((t['name'], t['run_count']) for t in tasks)}

    return wait_for(read, 60, interval=0.5, message=f'the final flow run and task runs of {flow_run_id}')


def assert_no_retry_ran(world: dict[str, Any], engine: str, result: dict[str, Any], workflow_id: str,
                        unit: str | None) -> None:
    """The failed turn made one attempt of each durable unit (the attempts the engine itself recorded), `unit` among
    them: Temporal's history (no activity attempt past the first, no workflow task retried, the workflow failed);
    DBOS's run (no "Step being automatically retried" warning, which DBOS logs before each retry of a step); Prefect's
    flow run and task runs (each ran once; `unit` `None`: the turn failed in the flow's own code, no task ran)."""
    log = Path(result['log_file']).read_text(errors='replace')
    if engine == 'temporal':
        assert_failed_without_retrying(world, workflow_id)
    elif engine == 'dbos':
        assert f'dbos workflow id: {workflow_id}' in log, log[-3000:]
        retried = [line for line in log.splitlines() if 'automatically retried' in line or ' (attempt ' in line]
        assert retried == [], retried
    else:
        flow_run_id = log.split('prefect flow run id: ')[1].split()[0]
        counts = prefect_run_counts(world, flow_run_id, tasks_expected=unit is not None)
        assert counts['flow'] == 1 and all(count == 1 for _, count in counts['tasks']), counts
        if unit is None:
            assert counts['tasks'] == [], counts
        else:
            assert any(name.startswith(unit) for name, _ in counts['tasks']), counts


# ---- sizes --------------------------------------------------------------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_a_stored_conversation_of_10000_messages_resumes(world: dict[str, Any], engine: str) -> None:
    cid = f'big-{engine}'
    result = turn(world, engine, cid, 'hello again')
    assert result['ok'], result['log']
    assert result['output'] == 'seen 10001 messages'  # the whole history reached the model
    stored, writes = read(world['store'], cid)
    assert stored.message_count == 10_002 and stored.messages[-1].parts[0].content == 'seen 10001 messages'
    assert [w.operation for w in writes][-1] == 'append' and len(writes) == 11


@pytest.mark.parametrize('engine', ENGINES)
def test_a_single_3_mb_tool_result_completes(world: dict[str, Any], engine: str) -> None:
    cid = f'three-mb-{engine}'
    result = turn(world, engine, cid, 'tool 3000000')
    assert result['ok'], result['log']
    assert result['output'] == 'produced 3000000 chars after 3 messages'
    stored, _ = read(world['store'], cid)
    assert stored.message_count == 4
    assert len(stored.messages[2].parts[0].content) == 3_000_000


@pytest.mark.parametrize('engine', ENGINES)
def test_many_500_byte_tool_outputs_past_2_5_mb_complete(world: dict[str, Any], engine: str) -> None:
    cid = f'shape-{engine}'
    before, _ = read(world['store'], cid)
    result = turn(world, engine, cid, 'tools 3 500')
    assert result['ok'], result['log']
    assert result['output'] == f'produced 1500 chars after {before.message_count + 7} messages'
    stored, _ = read(world['store'], cid)
    assert stored.message_count == before.message_count + 8
    assert json_size(stored.messages) > 2_500_000


def test_temporal_payloads_over_the_threshold_travel_as_claim_checks(world: dict[str, Any]) -> None:
    """After the runs above (module order): Temporal's history holds references; the store holds the payloads."""
    import zlib

    from tests.unit.test_history_delete import everything, needed

    snapshot = everything(world['store'])
    rows = snapshot['durcap_payloads']  # sha256, size, data, created_at, writer, kind (3: a piece stored compressed)
    largest = max(len(zlib.decompress(row[2]) if row[-1] == 3 else row[2]) for row in rows)
    assert len(rows) >= 3 and largest >= 3_000_000  # the 3 MB tool result at least (one piece of its own)
    # Each claim check records the workflow that wrote it (Temporal's serialization context), which `durcap history
    # delete`, `durcap store stats` and `durcap store gc` read: every row is under some workflow's reference.
    owned = set().union(*needed(snapshot).values())
    assert {row[0] for row in rows} <= owned


def test_temporal_payload_over_the_maximum_fails_fast_with_the_coded_problem(world: dict[str, Any]) -> None:
    cid = 'over-max-temporal'
    workflow_id = f'{cid}-{uuid.uuid4().hex[:8]}'
    result = turn(world, 'temporal', cid, f'tool {MAXIMUM + 1_000_000}', timeout=60, workflow_id=workflow_id)
    assert not result['ok'], result
    assert_failed_without_retrying(world, workflow_id)
    error = result['error']
    assert 'DC030' in error and f"conversation '{cid}'" in error and f'{MAXIMUM:,} bytes' in error, error
    assert 'DurcapPayloadTooLarge' in error or 'over the maximum' in error
    # The caller's error names the tool and its capability (issue 24 item 6), not only the worker log.
    assert f"DC030 conversation '{cid}': the result of tool 'produce' (capability 'bulk'" in error, error
    with pytest.raises(Exception, match='not in the store'):
        read(world['store'], cid)  # nothing half-stored


def test_temporal_history_over_the_maximum_fails_fast_with_the_coded_problem(world: dict[str, Any]) -> None:
    cid = 'big-temporal-over-max'
    seed(world['store'], cid, ten_thousand())
    workflow_id = f'{cid}-{uuid.uuid4().hex[:8]}'
    result = turn(world, 'temporal', cid, 'hello', env={'DURCAP_PAYLOAD_MAXIMUM': '5000000'}, timeout=60,
                  workflow_id=workflow_id)
    assert not result['ok'], result
    assert_failed_without_retrying(world, workflow_id)
    assert f"DC030 conversation '{cid}': its stored history: a payload of" in result['error'], result['error']
    assert result['error'].count(f"conversation '{cid}'") == 2 and '5,000,000 bytes' in result['error']  # raised, then named


# ---- a store outage during the append -----------------------------------------------------------


class Proxy:
    """A TCP proxy (asyncio, in a thread) from 127.0.0.1:<port> to PostgreSQL on 127.0.0.1:5432.

    `stop()` closes the listener and every open connection (the store sees the database vanish);
    `start()` listens again on the same port.
    """

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = 0
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection('127.0.0.1', 5432)
        except OSError:
            writer.close()
            return
        self.writers |= {writer, up_writer}
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _start(self) -> None:
        self.server = await asyncio.start_server(self._handle, '127.0.0.1', self.port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
        assert self.server is not None
        self.server.close()
        for writer in list(self.writers):
            writer.transport.abort()
        self.writers.clear()
        await self.server.wait_closed()

    def start(self) -> None:
        self._call(self._start())

    def stop(self) -> None:
        self._call(self._stop())

    def close(self) -> None:
        if self.server is not None and self.server.is_serving():
            self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.mark.parametrize('engine', ['temporal', 'dbos'])
def test_a_20_s_store_outage_during_the_append_loses_nothing_and_doubles_nothing(
    world: dict[str, Any], engine: str, tmp_path: Path
) -> None:
    proxy = Proxy()
    try:
        proxy.start()
        store = world['store'].replace('127.0.0.1:5432', f'127.0.0.1:{proxy.port}')
        cid = f'outage-{engine}'
        seed(store, cid, [ModelRequest(parts=[UserPromptPart('hi')]), ModelResponse(parts=[TextPart('hello')])])
        ledger = tmp_path / 'ledger'
        outcome: dict[str, Any] = {}

        def go() -> None:
            outcome.update(turn(world | {'store': store}, engine, cid, 'tool 1000', timeout=240,
                                env={'DURCAP_LEDGER': str(ledger), 'DURCAP_TOOL_PAUSE': '2'}))

        runner = threading.Thread(target=go)
        runner.start()
        deadline = time.monotonic() + 120
        while not (ledger.exists() and ledger.read_text()) and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.05)
        assert ledger.exists(), outcome
        proxy.stop()  # the tool ran; its turn's append comes within ~2 s, while the store is gone
        down_at = time.monotonic()
        time.sleep(20)
        assert runner.is_alive(), outcome  # the turn is waiting on the store, not failed
        proxy.start()
        runner.join(timeout=180)
        assert not runner.is_alive()
        assert outcome['ok'], outcome['log']
        assert outcome['output'] == 'produced 1000 chars after 5 messages'
        assert time.monotonic() - down_at >= 20
        assert ledger.read_text().splitlines() == ['1000']  # the side effect happened once
        stored, writes = read(store, cid)
        assert stored.message_count == 6  # the seeded turn and this one, once
        assert [w.operation for w in writes] == ['append', 'append']
        assert stored.messages[-1].parts[0].content == 'produced 1000 chars after 5 messages'
    finally:
        proxy.close()


# ---- a conflicting append is rebased, never lost ---------------------------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_a_conflicting_append_is_stored_after_the_other_write(world: dict[str, Any], engine: str, tmp_path: Path) -> None:
    """Another writer appends (taking no turn claim) while the turn's tool runs: the turn's side effect happened, so
    its append goes after the other write (rebased) instead of failing as a conflict (issue 26 item 5: before, the
    run failed with `ConversationConflictError` and the turn was lost). Store on PostgreSQL."""
    cid = f'conflict-{engine}-{uuid.uuid4().hex[:6]}'
    workflow_id = f'{cid}-{uuid.uuid4().hex[:8]}'
    seed(world['store'], cid, [ModelRequest(parts=[UserPromptPart('hi')]), ModelResponse(parts=[TextPart('hello')])])
    ledger = tmp_path / 'ledger'
    outcome: dict[str, Any] = {}

    def go() -> None:
        outcome.update(turn(world, engine, cid, 'tool 10', timeout=120, workflow_id=workflow_id,
                            env={'DURCAP_LEDGER': str(ledger), 'DURCAP_TOOL_PAUSE': '2'}))

    runner = threading.Thread(target=go)
    runner.start()
    deadline = time.monotonic() + 90
    while not (ledger.exists() and ledger.read_text()) and time.monotonic() < deadline and runner.is_alive():
        time.sleep(0.05)
    assert ledger.exists(), outcome

    async def interleave() -> None:
        async with SQLConversationStore(world['store']) as store:
            await store.append(cid, [ModelRequest(parts=[UserPromptPart('meanwhile')])], expected_revision=1)

    run(interleave())
    runner.join(timeout=120)
    assert outcome['ok'], outcome['log']
    assert 'ConversationConflictError' not in outcome['log']
    assert ledger.read_text().splitlines() == ['10']  # the side effect happened once
    stored, writes = read(world['store'], cid)
    assert [w.operation for w in writes] == ['append', 'append', 'append']  # seed, the other writer, the turn
    assert stored.messages[2].parts[0].content == 'meanwhile'  # the other write stands, the turn after it
    assert stored.messages[3].parts[0].content == 'tool 10'
    assert stored.messages[-1].parts[0].content == outcome['output']


# ---- a read-only store is refused before the run ------------------------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_a_read_only_store_is_refused_before_any_side_effect(world: dict[str, Any], engine: str, tmp_path: Path) -> None:
    import psycopg

    from tests._helpers import PG_ADMIN_URL as ADMIN_URL
    from tests._helpers import create_database, drop_database, pg_url

    name = create_database('durcap_ro')
    try:
        store = pg_url(name)
        seed(store, 'ro', [ModelRequest(parts=[UserPromptPart('hi')]), ModelResponse(parts=[TextPart('hello')])])
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE {name} SET default_transaction_read_only = on')
        ledger = tmp_path / 'ledger'
        workflow_id = f'ro-{engine}-{uuid.uuid4().hex[:8]}'
        result = turn(world | {'store': store}, engine, 'ro', 'tool 10', timeout=120, workflow_id=workflow_id,
                      env={'DURCAP_LEDGER': str(ledger)})
        assert not result['ok'], result
        assert 'is read-only' in result['error'], result['error']
        assert not ledger.exists()  # the tool never ran
        # Refused at once, not retried: the attempts each engine recorded (was: under 30 s of wall time).
        # Prefect loads in the flow's code (no task): the flow run failed once, before any task.
        assert_no_retry_ran(world, engine, result, workflow_id, None if engine == 'prefect' else 'Load Conversation')
    finally:
        drop_database(name)


# ---- export and replay read through the codec -----------------------------------------------------


def test_export_keeps_claim_checks_and_replay_reads_them_from_the_store(world: dict[str, Any], tmp_path: Path) -> None:
    import base64

    workflow_id = f'sizes-replay-{uuid.uuid4().hex[:8]}'
    result = turn(world, 'temporal', 'replay-temporal', 'tool 3000000', workflow_id=workflow_id)
    assert result['ok'], result['log']
    durcap = [sys.executable, '-m', 'durable_capabilities.cli']
    env = subprocess_env({'DURCAP_STORE': world['store']})
    exported = tmp_path / 'history.json'
    done = subprocess.run([*durcap, 'history', 'export', '--workflow-id', workflow_id, '-o', str(exported),
                           '--address', world['address']], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    text = exported.read_text()
    assert base64.b64encode(b'binary/durcap-claim-check').decode() in text  # references, as `temporal workflow show` prints
    assert len(text) < 1_000_000  # the 3 MB tool result (twice: activity result, workflow result) is not inline
    replayed = subprocess.run([*durcap, 'replay', str(exported), '--target', 'tests.engines.size_agent:agent',
                               '--store', world['store']], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert '1 of 1 histories replay' in replayed.stderr
    elsewhere = subprocess.run([*durcap, 'replay', str(exported), '--target', 'tests.engines.size_agent:agent',
                                '--store', f'sqlite:///{tmp_path / "empty.db"}'], cwd=ROOT, env=env, capture_output=True,
                               text=True, timeout=120, check=False)
    # A store without the history's claim checks cannot read its payloads: the replay does not pass.
    assert elsewhere.returncode != 0 and '1 of 1 histories replay' not in elsewhere.stderr
    assert 'durcap_payloads' in elsewhere.stdout + elsewhere.stderr, elsewhere.stdout + elsewhere.stderr


# ---- a turn whose append never completed is recovered from Temporal's record --------------------


def test_history_repair_stores_a_turn_whose_workflow_ended_before_its_append(world: dict[str, Any], tmp_path: Path) -> None:
    """The store goes down after the tool ran; the workflow is terminated while its append retries; once the store
    is back, `durcap history repair` stores the turn from the workflow's record (its input through the codec)
    and prints the answer; a second repair stores nothing twice."""

    from durable_capabilities.engines import temporal

    proxy = Proxy()
    try:
        proxy.start()
        store = world['store'].replace('127.0.0.1:5432', f'127.0.0.1:{proxy.port}')
        cid = 'repair-temporal'
        seed(store, cid, [ModelRequest(parts=[UserPromptPart('hi')]), ModelResponse(parts=[TextPart('hello')])])
        ledger = tmp_path / 'ledger'
        workflow_id = f'sizes-repair-{uuid.uuid4().hex[:8]}'
        outcome: dict[str, Any] = {}

        def go() -> None:
            outcome.update(turn(world | {'store': store}, 'temporal', cid, 'tool 400000', timeout=120, workflow_id=workflow_id,
                                env={'DURCAP_LEDGER': str(ledger), 'DURCAP_TOOL_PAUSE': '2'}))

        runner = threading.Thread(target=go)
        runner.start()
        deadline = time.monotonic() + 90
        while not (ledger.exists() and ledger.read_text()) and time.monotonic() < deadline and runner.is_alive():
            time.sleep(0.05)
        assert ledger.exists(), outcome
        proxy.stop()

        async def retrying() -> bool:
            client = await temporal.connect(world['address'], store=world['store'])
            described = await client.get_workflow_handle(workflow_id).describe()
            return any(p.attempt >= 2 for p in described.raw_description.pending_activities)

        wait_for(lambda: run(retrying()), 90, interval=0.5,  # the append activity is now failing and retrying
                 message=lambda: f'no append activity retried: {outcome}')

        async def terminate() -> None:
            client = await temporal.connect(world['address'], store=world['store'])
            await client.get_workflow_handle(workflow_id).terminate('operator gave up on the store')

        run(terminate())
        runner.join(timeout=60)
        assert not outcome['ok'] and 'terminated' in outcome['error'].lower(), outcome
        proxy.start()
        assert read(store, cid)[0].message_count == 2  # the turn was not stored

        durcap = [sys.executable, '-m', 'durable_capabilities.cli', 'history', 'repair', workflow_id,
                  '--store', world['store'], '--address', world['address']]
        env = subprocess_env()
        first = subprocess.run(durcap, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert first.returncode == 0, first.stdout + first.stderr
        assert f"conversation '{cid}': stored 4 message(s) at revision 2" in first.stdout
        assert 'answer: produced 400000 chars after 5 messages' in first.stdout
        again = subprocess.run(durcap, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert again.returncode == 0 and 'already stored 4 message(s) at revision 2' in again.stdout, again.stdout + again.stderr
        stored, writes = read(world['store'], cid)
        assert stored.message_count == 6 and len(writes) == 2
        assert len(stored.messages[4].parts[0].content) == 400_000  # carried inline while the store was down (under 2 MiB)
        assert ledger.read_text().splitlines() == ['400000']
    finally:
        proxy.close()


def test_temporal_model_request_growing_over_the_maximum_fails_fast_with_the_coded_problem(world: dict[str, Any]) -> None:
    """The stored history loads (under the maximum) and the tool result is under it too, but the next model
    request would carry both: the workflow fails before scheduling it (workflow code, not a workflow task)."""
    cid = 'grows-over-max-temporal'
    seed(world['store'], cid, ten_thousand()[:5000])  # ~3.8 MB
    workflow_id = f'{cid}-{uuid.uuid4().hex[:8]}'
    result = turn(world, 'temporal', cid, 'tool 1500000', env={'DURCAP_PAYLOAD_MAXIMUM': '5000000'}, timeout=60,
                  workflow_id=workflow_id)
    assert not result['ok'], result
    assert_failed_without_retrying(world, workflow_id)
    assert f"DC030 conversation '{cid}': the model request: a payload of" in result['error'], result['error']
    assert 'over the maximum of 5,000,000 bytes' in result['error']
    assert read(world['store'], cid)[0].message_count == 5000  # nothing appended
