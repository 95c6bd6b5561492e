"""Temporal continue-as-new carries a long agent run forward, with and without a conversation id.

A Temporal dev server of this module's own is started with
`--dynamic-config-value limit.historyCount.suggestContinueAsNew=40`, so Temporal suggests continuing
as new after about 40 history events (the default is thousands); it is stopped by process id (its
process group) when the module ends, whatever happened.

Model: a scripted pydantic-ai `FunctionModel` (`count_script` below; no provider is called) that plays
"count to 12": it loads the deferred capability `counter`, then calls its tool `tick(n)` for n = 1..12,
one call per model request, then answers `counted: 1,2,...,12`. Every decision is a function of the
messages it receives (the tick returns since the prompt), so a run continued from stored or carried
messages picks up where the last one stopped. If a request does not offer `tick` (the capability was
lost across a continuation) it answers `tick is not offered`. 14 model requests and 13 tool calls (the
load and 12 ticks) make each run long enough for 4-5 workflow runs.

The worker runs inline in the test process (`runner.run(engine='temporal', inline_worker=True)`, what `durcap run`
does), so the model requests and tool calls it makes are counted here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent, runner
from durable_capabilities._servers import free_port, port_open
from durable_capabilities.engines.temporal import temporal_cli
from durable_capabilities.store import CorruptedRowError

# One worker runs this module's tests (pytest-xdist `loadgroup`): they share a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('continue-as-new')]

SUGGEST_AFTER_EVENTS = 40
COUNT = 12
PROMPT = f'Count to {COUNT}, one tick at a time.'
OUTPUT = 'counted: ' + ','.join(str(n) for n in range(1, COUNT + 1))
MESSAGES = 2 + 2 + 2 * COUNT  # prompt + load call, load return + first tick call, ..., last tick return + answer
MODEL_REQUESTS = COUNT + 2  # the load, 12 ticks, the answer


# ---- the server -----------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def temporal_suggesting_continue_as_new(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A dev server (in-memory) that suggests continue-as-new after `SUGGEST_AFTER_EVENTS` events."""
    log_path = tmp_path_factory.mktemp('temporal-can') / 'server.log'
    # Three free ports are picked before the server binds them; another process of the suite can take one in between
    # ("bind: address already in use", seen in a CI run): try again with new ports, at most 3 times.
    for _attempt in range(3):
        port = free_port()
        cmd = [
            temporal_cli(), 'server', 'start-dev', '--ip', '127.0.0.1', '--port', str(port), '--headless',
            '--log-level', 'error', '--http-port', str(free_port()), '--metrics-port', str(free_port()),
            '--dynamic-config-value', f'limit.historyCount.suggestContinueAsNew={SUGGEST_AFTER_EVENTS}',
        ]
        with open(log_path, 'wb') as log:
            process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not port_open('127.0.0.1', port) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        if port_open('127.0.0.1', port) or 'address already in use' not in log_path.read_text():
            break
        process.wait(timeout=20)
    try:
        if not port_open('127.0.0.1', port):
            raise RuntimeError(f'temporal dev server did not start (exit {process.poll()}):\n{log_path.read_text()[-2000:]}')
        yield f'127.0.0.1:{port}'
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=20)


# ---- the scripted agent ---------------------------------------------------------------------------


def count_script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Load `counter`, tick 1..COUNT, answer; decided from the messages alone (see the module docstring)."""
    prompt_at = max(
        i for i, m in enumerate(messages)
        if isinstance(m, ModelRequest) and any(isinstance(p, UserPromptPart) for p in m.parts)
    )
    loaded = any(
        isinstance(p, ToolReturnPart) and p.tool_name == 'load_capability' for m in messages for p in m.parts
    )
    ticks = [
        str(p.content) for m in messages[prompt_at:] if isinstance(m, ModelRequest) for p in m.parts
        if isinstance(p, ToolReturnPart) and p.tool_name == 'tick'
    ]
    if not loaded:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'counter'}, tool_call_id='load-counter')])
    if 'tick' not in [t.name for t in info.function_tools]:
        return ModelResponse(parts=[TextPart('tick is not offered')])
    if len(ticks) < COUNT:
        n = len(ticks) + 1
        return ModelResponse(parts=[ToolCallPart('tick', {'n': n}, tool_call_id=f'tick-{n}')])
    return ModelResponse(parts=[TextPart('counted: ' + ','.join(ticks))])


@dataclass
class Counting:
    """An agent whose model requests and tool calls are counted in this process."""

    agent: DurableAgent[Any, Any]
    model_requests: list[int] = field(default_factory=list)
    ticks: list[int] = field(default_factory=list)


def counting_agent(store_url: str | None) -> Counting:
    counted = Counting(None)  # type: ignore[arg-type]

    def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        counted.model_requests.append(len(messages))
        return count_script(messages, info)

    counter = Capability(id='counter', description='Count one by one.', instructions='Tick once per step.', defer_loading=True)

    @counter.tool_plain
    def tick(n: int) -> str:
        """Count one."""
        counted.ticks.append(n)
        return str(n)

    counted.agent = DurableAgent(
        f'can-{uuid.uuid4().hex[:8]}', FunctionModel(model, model_name='count-script'), capabilities=[counter],
        conversation_store=store_url,
    )
    return counted


# ---- the run chain, read from Temporal ------------------------------------------------------------


@dataclass
class RunInfo:
    run_id: str
    status: str
    continued_as_new: bool
    events: int
    input_json: Any
    activities: list[str]


async def run_chain(address: str, workflow_id: str) -> list[RunInfo]:
    """Every run of the workflow id, first to last, following ContinuedAsNew events."""
    from temporalio.api.enums.v1 import EventType

    from durable_capabilities.engines import temporal

    client = await temporal.connect(address)
    latest = client.get_workflow_handle(workflow_id)
    first_run_id = None
    async for event in latest.fetch_history_events():
        first_run_id = event.workflow_execution_started_event_attributes.first_execution_run_id
        break
    runs: list[RunInfo] = []
    run_id = first_run_id
    while run_id:
        handle = client.get_workflow_handle(workflow_id, run_id=run_id)
        description = await handle.describe()
        next_run, events, input_json, activities = None, 0, None, []
        async for event in handle.fetch_history_events():
            events += 1
            if event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
                # Through the claim-check codec: an input over its threshold (16 KiB) is a reference in the history,
                # to this process's default store; a run driven by another process (test_compaction's driver) wrote
                # its claim checks elsewhere: its input stays the reference (those tests read no input).
                payload = event.workflow_execution_started_event_attributes.input.payloads[0]
                with contextlib.suppress(CorruptedRowError):
                    [payload] = await client.data_converter.payload_codec.decode([payload])  # type: ignore[union-attr]
                input_json = json.loads(payload.data)
            elif event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                activities.append(event.activity_task_scheduled_event_attributes.activity_type.name)
            elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                next_run = event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
        runs.append(RunInfo(run_id, description.status.name, next_run is not None, events, input_json, activities))
        run_id = next_run
    return runs


def tool_call_ids(messages: list[ModelMessage]) -> tuple[list[str], list[str]]:
    """(ids of tool calls, ids of tool returns), in order."""
    called = [p.tool_call_id for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)]
    returned = [p.tool_call_id for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    return called, returned


EXPECTED_IDS = ['load-counter', *(f'tick-{n}' for n in range(1, COUNT + 1))]


def assert_whole_run(messages: list[ModelMessage]) -> None:
    """The messages of one "count to 12" run, each exactly once, in order."""
    assert len(messages) == MESSAGES
    assert [m.kind for m in messages] == ['request', 'response'] * (MESSAGES // 2)
    prompts = [p.content for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, UserPromptPart)]
    assert prompts == [PROMPT]
    assert tool_call_ids(messages) == (EXPECTED_IDS, EXPECTED_IDS)
    assert isinstance(messages[-1].parts[-1], TextPart) and messages[-1].parts[-1].content == OUTPUT


def run_agent(address: str, counted: Counting, conversation_id: str | None) -> tuple[runner.RunReport, list[RunInfo]]:
    workflow_id = f'can-{uuid.uuid4().hex[:10]}'

    async def scenario() -> tuple[runner.RunReport, list[RunInfo]]:
        report = await runner.run(
            counted.agent, PROMPT, engine='temporal', address=address, task_queue=f'can-{uuid.uuid4().hex[:8]}', inline_worker=True,
            run_id=workflow_id, conversation_id=conversation_id,
        )
        return report, await run_chain(address, workflow_id)

    return asyncio.run(scenario())


# ---- with a conversation id: the store carries the conversation ---------------------------------


@pytest.fixture(params=['sqlite', 'postgres'])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == 'sqlite':
        return f'sqlite:///{tmp_path / "conversations.db"}'
    return request.getfixturevalue('postgres_url')


def read_store(url: str, conversation_id: str) -> tuple[Any, list[Any], Any]:
    from durable_capabilities.store import SQLConversationStore

    async def read() -> tuple[Any, list[Any], Any]:
        async with SQLConversationStore(url) as store:
            return await store.read(conversation_id), await store.writes(conversation_id), await store.read_record(conversation_id)

    return asyncio.run(read())


def test_continue_as_new_with_a_conversation_id(temporal_suggesting_continue_as_new: str, store_url: str) -> None:
    address = temporal_suggesting_continue_as_new
    counted = counting_agent(store_url)
    conversation_id = f'count-{uuid.uuid4().hex[:8]}'
    report, chain = run_agent(address, counted, conversation_id)

    # Temporal continued the workflow as new, more than once; the last run completed with the right output.
    assert len(chain) >= 3, [(r.status, r.events) for r in chain]
    assert [r.continued_as_new for r in chain] == [True] * (len(chain) - 1) + [False]
    assert [r.status for r in chain] == ['CONTINUED_AS_NEW'] * (len(chain) - 1) + ['COMPLETED']
    assert report.output == OUTPUT
    # Each continued run started from the conversation id alone (no history in its input) and loaded it.
    for run in chain[1:]:
        assert run.input_json['prompt'] is None
        assert run.input_json['conversation_id'] == conversation_id
        assert run.input_json['message_history'] is None
        assert run.activities[0].endswith('__conversation_load')
    # Every run ends by appending what it added: the continued ones just before continuing.
    for run in chain:
        assert run.activities[-1].endswith('__conversation_append')

    # Nothing ran twice across the continuations: 14 model requests, 12 ticks.
    assert len(counted.model_requests) == MODEL_REQUESTS
    assert counted.ticks == list(range(1, COUNT + 1))

    # The store: every message exactly once, one append per workflow run, keyed by that run.
    conversation, writes, record = read_store(store_url, conversation_id)
    assert_whole_run(conversation.messages)
    assert conversation.revision == len(chain)
    workflow_id = report.run_id
    assert [w.append_id for w in writes] == [
        *(f'{workflow_id}:{run.run_id}:continue-as-new' for run in chain[:-1]), f'{workflow_id}:{chain[-1].run_id}',
    ]
    assert [w.first_position for w in writes] == sorted({w.first_position for w in writes})
    assert sum(len(w.entry_ids) for w in writes) == MESSAGES
    assert record.usage.requests == MODEL_REQUESTS
    assert record.usage.tool_calls == COUNT + 1

    # The run's event stream (docs/watching.md) spans the chain: one stream under the workflow id, offsets 1..n with
    # no gap, one run_started, run_completed last, the answer's text.
    from durable_capabilities import streams

    async def events() -> list[streams.RunEvent]:
        return [e async for e in streams.watch(workflow_id, engine='temporal', store=store_url, follow=False)]

    stream = asyncio.run(events())
    kinds = [e.kind for e in stream]
    assert [e.offset for e in stream] == list(range(1, len(stream) + 1))
    assert kinds.count('run_started') == 1 and kinds[-1] == 'run_completed' and kinds.count('run_completed') == 1
    assert kinds.count('turn_stored') == 1 and kinds.count('tool_call') == COUNT + 1
    assert streams.answer_text(stream) == OUTPUT == stream[-1].data['output']


def test_continue_as_new_without_a_conversation_id(temporal_suggesting_continue_as_new: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The history so far rides in each continued run's input; no store is touched (the run's event stream, which
    would be written there, is turned off)."""
    monkeypatch.setenv('DURCAP_STREAMS', '0')
    address = temporal_suggesting_continue_as_new
    unused_store = tmp_path / 'never-created.db'
    counted = counting_agent(f'sqlite:///{unused_store}')
    report, chain = run_agent(address, counted, None)

    assert len(chain) >= 3, [(r.status, r.events) for r in chain]
    assert [r.status for r in chain] == ['CONTINUED_AS_NEW'] * (len(chain) - 1) + ['COMPLETED']
    assert report.output == OUTPUT
    assert len(counted.model_requests) == MODEL_REQUESTS
    assert counted.ticks == list(range(1, COUNT + 1))
    # The last run's input carried the whole history so far, from the prompt on, each message once; the
    # last run added the rest (the tail of what it returned).
    carried = ModelMessagesTypeAdapter.validate_python(chain[-1].input_json['message_history'])
    assert 0 < len(carried) < MESSAGES
    added_last = report.new_messages[len(report.new_messages) - (MESSAGES - len(carried)):]
    assert_whole_run([*carried, *added_last])
    for run in chain:
        assert not any(a.endswith(('__conversation_load', '__conversation_append')) for a in run.activities)
    assert not unused_store.exists()


# ---- what the caller gets back ----------------------------------------------------------------------

@pytest.mark.parametrize('with_conversation', [True, False], ids=['conversation', 'no-conversation'])
def test_the_result_covers_the_whole_run_across_continuations(
    temporal_suggesting_continue_as_new: str, tmp_path: Path, with_conversation: bool
) -> None:
    counted = counting_agent(f'sqlite:///{tmp_path / "conversations.db"}')
    conversation_id = f'count-{uuid.uuid4().hex[:8]}' if with_conversation else None
    report, chain = run_agent(temporal_suggesting_continue_as_new, counted, conversation_id)
    assert len(chain) >= 3
    assert report.output == OUTPUT
    assert report.usage.requests == MODEL_REQUESTS
    assert_whole_run(report.new_messages)
    assert report.loaded_capabilities() == ['counter']


def test_the_runner_lists_the_units_of_every_run(temporal_suggesting_continue_as_new: str, tmp_path: Path) -> None:
    counted = counting_agent(f'sqlite:///{tmp_path / "conversations.db"}')
    report, chain = run_agent(temporal_suggesting_continue_as_new, counted, f'count-{uuid.uuid4().hex[:8]}')
    assert len(chain) >= 3
    assert report.durable_units == [a for run in chain for a in run.activities]


def test_provider_parts_survive_continue_as_new(temporal_suggesting_continue_as_new: str, tmp_path: Path) -> None:
    """A conversation stored with every provider-specific part kind (tests/engines/parts_agent.py `rich_history`:
    thinking + signature, native tool parts, provider details, 1 MB image + 1 MB PDF + a 1 MB FilePart) continued
    by a run that Temporal continues as new several times: the stored prefix's message JSON is unchanged and the
    new run's messages follow it, each once."""
    from durable_capabilities.store import SQLConversationStore
    from tests.engines.parts_agent import dump, rich_history

    store_url = f'sqlite:///{tmp_path / "conversations.db"}'
    conversation_id = f'parts-{uuid.uuid4().hex[:8]}'

    async def seed() -> None:
        async with SQLConversationStore(store_url) as store:
            await store.append(conversation_id, rich_history(), expected_revision=None)

    asyncio.run(seed())
    counted = counting_agent(store_url)
    report, chain = run_agent(temporal_suggesting_continue_as_new, counted, conversation_id)
    assert len(chain) >= 3, [(r.status, r.events) for r in chain]
    assert report.output == OUTPUT
    conversation, _, _ = read_store(store_url, conversation_id)
    assert dump(conversation.messages[:2]) == dump(rich_history())
    assert_whole_run(conversation.messages[2:])
