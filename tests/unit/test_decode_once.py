"""Resume decodes once (issue 10 item 6): the load unit hands over the stored JSON, the run decodes it once,
and a process that ran a conversation recently reads, scans and decodes only the messages added since.

Model: a scripted `FunctionModel` (no provider) that calls `note(text)` once and answers. Store: SQLite in
the test's directory. Local engine (the same `run_turn` and load unit every engine runs).
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path
from typing import Any

from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent, conversations, runner, turn
from durable_capabilities.store import SQLConversationStore
from durable_capabilities.store._schema import _encode


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(p, ToolReturnPart) for p in last.parts):
        return ModelResponse(parts=[TextPart(f'noted after {len(messages)} messages')])
    return ModelResponse(parts=[ToolCallPart('note', {'text': 'x'}, tool_call_id=f'note-{len(messages)}')])


def note(text: str) -> str:
    """Note something."""
    return text


def make(tmp_path: Path) -> tuple[DurableAgent[Any, Any], str]:
    url = f'sqlite:///{tmp_path / "conversations.db"}'
    return DurableAgent(f'decode-{uuid.uuid4().hex[:6]}', FunctionModel(script), tools=[note], conversation_store=url), url


def test_the_load_unit_returns_the_stored_json_and_the_next_turn_decodes_only_new_messages(tmp_path: Path) -> None:
    agent, _ = make(tmp_path)
    cid = f'c-{uuid.uuid4().hex[:6]}'
    first = asyncio.run(runner.run(agent, 'one', conversation_id=cid))
    assert first.output == 'noted after 3 messages'

    loaded = asyncio.run(conversations.load_conversation(agent, cid))
    with sqlite3.connect(tmp_path / 'conversations.db') as db:
        stored_rows = [r[0] for r in db.execute('SELECT message FROM durcap_entries WHERE conversation_id = ? ORDER BY position', (cid,))]
    assert loaded.rows == stored_rows  # the stored JSON itself: no decode/dump round trip
    assert loaded.messages == [] and loaded.revision == 1

    # The turn remembered the history it ran with: the next decode takes those objects, decoding only the rest.
    key = (agent.durable_name, cid)
    remembered = turn._DECODED[key].messages
    assert len(remembered) == 4
    second = asyncio.run(turn.run_turn(agent, agent.build('local').run, 'two', conversation_id=cid))
    assert second.result.output == 'noted after 7 messages'
    assert len(second.state.messages) == 4
    assert all(a is b for a, b in zip(second.state.messages, remembered, strict=True))  # same objects: nothing decoded again
    assert len(turn._DECODED[key].messages) == 8
    stored = asyncio.run(conversations.load_conversation(agent, cid))
    assert ModelMessagesTypeAdapter.validate_json('[' + ','.join(stored.rows or []) + ']') == turn._DECODED[key].messages


def test_a_changed_prefix_is_decoded_again(tmp_path: Path) -> None:
    agent, _ = make(tmp_path)
    cid = f'c-{uuid.uuid4().hex[:6]}'
    asyncio.run(runner.run(agent, 'one', conversation_id=cid))
    key = (agent.durable_name, cid)
    remembered = turn._DECODED[key]
    rows = [_encode(m) for m in remembered.messages]
    changed = [*rows[:-1], rows[-1].replace('noted after', 'NOTED after')]
    decoded = turn.decode_history(key, changed, cid)
    assert decoded[-1] is not remembered.messages[-1]
    assert isinstance(decoded[-1], ModelResponse) and decoded[-1].parts[0].content.startswith('NOTED')  # type: ignore[union-attr]


def test_read_json_reads_only_the_rows_after_a_known_prefix(tmp_path: Path) -> None:
    agent, url = make(tmp_path)
    cid = f'c-{uuid.uuid4().hex[:6]}'
    asyncio.run(runner.run(agent, 'one', conversation_id=cid))

    async def reads() -> tuple[Any, Any, Any]:
        async with SQLConversationStore(url) as store:
            whole = await store.read_json(cid)
            await store.append(cid, ModelMessagesTypeAdapter.validate_json('[' + whole.messages[0] + ']'),
                               expected_revision=whole.revision)
            tail = await store.read_json(cid, known=(len(whole.messages), whole.entry_ids[-1]))
            stale = await store.read_json(cid, known=(len(whole.messages), 'not-an-entry'))
            return whole, tail, stale

    whole, tail, stale = asyncio.run(reads())
    assert not whole.tail and len(whole.messages) == whole.message_count == 4
    assert tail.tail and tail.messages == [whole.messages[0]] and tail.message_count == 5 and tail.revision == 2
    assert not stale.tail and len(stale.messages) == 5  # a prefix that is not the stored one: the whole history


def test_the_load_unit_scans_drift_from_the_stored_rows(tmp_path: Path) -> None:
    """A history calling a tool the definition no longer has is refused at load (DC019), from the scan."""
    import pytest

    from durable_capabilities.validation import DurableConfigError

    agent, url = make(tmp_path)
    cid = f'c-{uuid.uuid4().hex[:6]}'
    asyncio.run(runner.run(agent, 'one', conversation_id=cid))
    renamed = DurableAgent(agent.name + '-b', FunctionModel(script), conversation_store=url)
    with pytest.raises(DurableConfigError, match='DC019'):
        asyncio.run(conversations.load_conversation(renamed, cid))
