"""Compaction and history processors (issue 10 item 3): a turn's new messages are identified by run, not by
index, so a history processor that compacts (upstream `ProcessHistory` writing a `CompactionPart`) neither
loses a turn's prompt nor stores a tool return without its call, and Temporal's continue-as-new carries the
whole turn.

Model: the scripted `FunctionModel` of tests/engines/compaction_agent.py (no provider) counting with `tick`;
its processor compacts everything but the last two messages above six messages. Two turns per conversation,
`Count to 5.` then `Count to 12.`: each must answer its own count, and the store must hold each turn whole (its
prompt, every tick call with its return, the answer) plus the compactions, and only grow; each summary once,
never between a call and its return nor before the ticks it summarizes, and the post-compaction window of the
stored conversation without an orphan tool return (issue 24 item 5, `assert_compactions_in_order`).

Real servers: local in-process; Temporal on a dev server of its own started with
`--dynamic-config-value limit.historyCount.suggestContinueAsNew=40` (the fixture of test_continue_as_new.py)
so every turn continues as new at least once; DBOS on SQLite; the session's Prefect server. Engine turns run
in `compaction_driver` subprocesses (stopped by pid). The store is SQLite in the test's directory.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import (
    CompactionPart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
    post_compaction_window,
)

from durable_capabilities import runner
from durable_capabilities.store import SQLConversationStore
from tests._helpers import subprocess_env
from tests.engines.compaction_agent import make_agent
from tests.engines.test_continue_as_new import (  # noqa: F401 - the fixture: a server suggesting continue-as-new
    run_chain,
    temporal_suggesting_continue_as_new,
)

pytestmark = pytest.mark.slow

TURNS = [('Count to 5.', 5), ('Count to 12.', 12)]


def answer(n: int) -> str:
    return 'counted: ' + ','.join(str(i) for i in range(1, n + 1))


def prompts_of(messages: list[ModelMessage]) -> list[str]:
    return [str(p.content) for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, UserPromptPart)]


def is_summary(message: ModelMessage) -> bool:
    return isinstance(message, ModelRequest) and all(isinstance(p, CompactionPart) for p in message.parts)


def assert_whole_turn(messages: list[ModelMessage], prompt: str, n: int) -> None:
    """One turn: its prompt first, every tick call 1..n with its return in order, ends with the answer; the
    summaries a compaction wrote sit among them (their order: `assert_compactions_in_order`)."""
    messages = [m for m in messages if not is_summary(m)]
    assert prompts_of(messages) == [prompt]
    first = messages[0]
    assert isinstance(first, ModelRequest) and any(isinstance(p, UserPromptPart) for p in first.parts), \
        'the turn does not start with its prompt'
    calls = [p for m in messages if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)]
    returns = [p for m in messages if isinstance(m, ModelRequest) for p in m.parts if isinstance(p, ToolReturnPart)]
    assert [c.tool_call_id for c in calls] == [f'tick-{n}-{i}' for i in range(1, n + 1)]
    assert [r.tool_call_id for r in returns] == [c.tool_call_id for c in calls]
    assert [r.content for r in returns] == [str(i) for i in range(1, n + 1)]
    seen_calls: set[str] = set()
    for message in messages:  # every return after its call
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                seen_calls.add(part.tool_call_id)
            elif isinstance(part, ToolReturnPart):
                assert part.tool_call_id in seen_calls, f'return {part.tool_call_id} before (or without) its call'
    last = messages[-1]
    assert isinstance(last, ModelResponse) and isinstance(last.parts[-1], TextPart)
    assert last.parts[-1].content == answer(n)


def assert_compactions_in_order(messages: list[ModelMessage], prior: list[ModelMessage] = ()) -> None:  # type: ignore[assignment]
    """Each summary stored once, never between a tool call and its return, never before the tick returns it
    summarizes (of its prompt), and upstream's `post_compaction_window` of `prior + messages` starts with no tool
    return whose call it left out (issue 24 item 5)."""
    whole = [*prior, *messages]
    summaries = [p.content for p in compactions(whole)]
    assert len(summaries) == len(set(summaries)), f'a summary stored twice: {summaries}'
    pending: set[str] = set()
    returned: dict[str, set[int]] = {}
    for index, message in enumerate(whole):
        for part in message.parts:
            if isinstance(part, ToolCallPart):
                pending.add(part.tool_call_id)
            elif isinstance(part, ToolReturnPart):
                pending.discard(part.tool_call_id)
                target = next(str(p) for p in prompts_of(whole[:index]) if f'to {part.tool_call_id.split("-")[1]}.' in p)
                returned.setdefault(target, set()).add(int(part.content))
            elif isinstance(part, CompactionPart):
                assert not pending, f'summary at {index} between the calls {pending} and their returns'
                summary = json.loads(part.content[len('count-state '):])  # type: ignore[index]
                assert set(summary['ticks']) <= returned.get(summary['prompt'], set()), \
                    f'summary at {index} stored before the ticks it summarizes'
    window = post_compaction_window(whole)
    called = {p.tool_call_id for m in window if isinstance(m, ModelResponse) for p in m.parts if isinstance(p, ToolCallPart)}
    orphans = [p.tool_call_id for m in window if isinstance(m, ModelRequest) for p in m.parts
               if isinstance(p, ToolReturnPart) and p.tool_call_id not in called]
    assert not orphans, f'the post-compaction window starts with orphan returns {orphans}'


def compactions(messages: list[ModelMessage]) -> list[CompactionPart]:
    return [p for m in messages for p in m.parts if isinstance(p, CompactionPart)]


def read_store(url: str, conversation_id: str) -> tuple[list[ModelMessage], int]:
    async def read() -> tuple[list[ModelMessage], int]:
        async with SQLConversationStore(url) as store:
            stored = await store.read(conversation_id)
            return stored.messages, stored.revision

    return asyncio.run(read())


def assert_stored_conversation(url: str, conversation_id: str, turn_messages: list[list[ModelMessage]]) -> None:
    """The store holds both turns whole, in order, with the compactions, and each turn's reported messages."""
    stored, _ = read_store(url, conversation_id)
    assert prompts_of(stored) == [p for p, _ in TURNS]
    assert_compactions_in_order(stored)
    second = len(turn_messages[0])
    assert_whole_turn(stored[:second], *TURNS[0])
    assert_whole_turn(stored[second:], *TURNS[1])
    assert compactions(stored[second:]), 'the compaction of turn 2 is not stored'
    # What each run reported as its new messages is exactly what it stored.
    assert ModelMessagesTypeAdapter.dump_python(stored, mode='json') == ModelMessagesTypeAdapter.dump_python(
        [m for messages in turn_messages for m in messages], mode='json')


# ---- local, in-process --------------------------------------------------------------------------


def test_local_compaction_keeps_whole_turns(tmp_path: Path) -> None:
    url = f'sqlite:///{tmp_path / "conversations.db"}'
    agent = make_agent(f'compacting-{uuid.uuid4().hex[:6]}', url)
    conversation_id, reported = f'count-{uuid.uuid4().hex[:8]}', []
    for prompt, n in TURNS:
        report = asyncio.run(runner.run(agent, prompt, engine='local', conversation_id=conversation_id))
        assert report.output == answer(n)
        assert_whole_turn(report.new_messages, prompt, n)
        reported.append(report.new_messages)
    assert_stored_conversation(url, conversation_id, reported)
    assert read_store(url, conversation_id)[1] == 2


def test_local_compaction_without_a_conversation_keeps_the_turn(tmp_path: Path) -> None:
    """`new_messages` of a compacted run, carried by the caller, answer the next turn right."""
    agent = make_agent(f'compacting-{uuid.uuid4().hex[:6]}', f'sqlite:///{tmp_path / "unused.db"}')
    history: list[ModelMessage] = []
    for prompt, n in TURNS:
        report = asyncio.run(runner.run(agent, prompt, engine='local', message_history=history))
        assert report.output == answer(n)
        assert_whole_turn(report.new_messages, prompt, n)
        history = [*history, *report.new_messages]
    assert compactions(history)
    assert_compactions_in_order(history)


# ---- engines, in driver subprocesses --------------------------------------------------------------


def drive(engine: str, prompt: str, *, tmp: Path, store: str, conversation: str | None, address: str | None = None,
          prefect: str | None = None, ledger: Path | None = None) -> dict[str, Any]:
    args = [sys.executable, '-m', 'tests.engines.compaction_driver', engine, '--prompt', prompt]
    if conversation:
        args += ['--conversation', conversation]
    if address:
        args += ['--address', address]
    if engine == 'dbos':
        args += ['--db', f'sqlite:///{tmp / "dbos.sqlite"}']
    log = tmp / f'{engine}-{uuid.uuid4().hex[:8]}.log'
    env = subprocess_env({
        'DURCAP_STORE': store, 'PREFECT_HOME': str(tmp / 'prefect-home'),
        'PREFECT_LOCAL_STORAGE_PATH': str(tmp / 'prefect-results'),
        **({'PREFECT_API_URL': prefect} if prefect else {}), **({'DURCAP_LEDGER': str(ledger)} if ledger else {}),
    })
    with open(log, 'wb') as handle:
        popen = subprocess.Popen(args, cwd=tmp, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        popen.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, 9)
            popen.wait(timeout=30)
    text = log.read_text(errors='replace')
    for line in text.splitlines():
        if line.startswith('REPORT '):
            return json.loads(line[len('REPORT '):])
    raise AssertionError(f'{engine} turn {prompt!r} failed:\n{text[-4000:]}')


def two_turns(engine: str, tmp: Path, **kwargs: Any) -> tuple[str, str, list[dict[str, Any]], Path]:
    store = f'sqlite:///{tmp / "conversations.db"}'
    conversation_id, ledger, reports = f'count-{uuid.uuid4().hex[:8]}', tmp / 'ticks.ledger', []
    for prompt, n in TURNS:
        report = drive(engine, prompt, tmp=tmp, store=store, conversation=conversation_id, ledger=ledger, **kwargs)
        assert report['output'] == answer(n)
        messages = ModelMessagesTypeAdapter.validate_python(report['new_messages'])
        assert_whole_turn(messages, prompt, n)
        reports.append(report)
    assert_stored_conversation(store, conversation_id,
                               [ModelMessagesTypeAdapter.validate_python(r['new_messages']) for r in reports])
    return store, conversation_id, reports, ledger


def test_temporal_compaction_with_continue_as_new_keeps_whole_turns(
    temporal_suggesting_continue_as_new: str, tmp_path: Path  # noqa: F811 - the fixture imported above
) -> None:
    address = temporal_suggesting_continue_as_new
    _, _, reports, ledger = two_turns('temporal', tmp_path, address=address)
    # Each turn continued as new at least once (the bug this guards: the handler sliced a compacted list).
    for report in reports:
        chain = asyncio.run(run_chain(address, report['run_id']))
        assert len(chain) >= 2, [(r.status, r.events) for r in chain]
        assert [r.status for r in chain] == ['CONTINUED_AS_NEW'] * (len(chain) - 1) + ['COMPLETED']
    # No tick ran twice across the continuations.
    assert ledger.read_text().split() == [str(i) for _, n in TURNS for i in range(1, n + 1)]


def test_temporal_compaction_with_continue_as_new_without_a_conversation(
    temporal_suggesting_continue_as_new: str, tmp_path: Path  # noqa: F811 - the fixture imported above
) -> None:
    """Without a conversation id the carried history is the whole turn: the reported messages are complete."""
    report = drive('temporal', TURNS[1][0], tmp=tmp_path, store=f'sqlite:///{tmp_path / "unused.db"}', conversation=None,
                   address=temporal_suggesting_continue_as_new)
    assert report['output'] == answer(TURNS[1][1])
    messages = ModelMessagesTypeAdapter.validate_python(report['new_messages'])
    assert_whole_turn(messages, *TURNS[1])
    assert compactions(messages)
    assert len(asyncio.run(run_chain(temporal_suggesting_continue_as_new, report['run_id']))) >= 2


@pytest.mark.parametrize('engine', ['dbos', 'prefect'])
def test_compaction_keeps_whole_turns(engine: str, tmp_path: Path, prefect_api_url: str) -> None:
    _, _, _, ledger = two_turns(engine, tmp_path, prefect=prefect_api_url)
    assert ledger.read_text().split() == [str(i) for _, n in TURNS for i in range(1, n + 1)]
