"""Prefect tool-call task results keep their long texts in the conversation store, once (issue 24,
`engines.prefect._results.ToolResultPieces`): written as compressed pieces owned by the flow run, read back, turned
into pointers to the appended entry that holds the same text (still read back), deleted with the conversation by
`history delete`'s purge (also those of a run killed before its append, tied to its conversation by its turn claim),
and kept by `store gc` unless Prefect is asked and says the flow run is gone (tests/engines/test_prefect_gc.py).

Real SQLite files and PostgreSQL databases (the `store_url` fixture); the serializer runs outside a flow run, so the
owner a flow run's task would record (`prefect:<flow run id>`) is given by patching `_results._owner`. No model runs.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, ToolCallPart, ToolReturnPart, UserPromptPart

from durable_capabilities.collecting import collect_garbage
from durable_capabilities.engines.prefect import _results
from durable_capabilities.store import SQLConversationStore

RUN = 'prefect:0b9e1e8c-5a7e-4b8e-9f55-2f1c1d6f7a10'


def _report(turn: int) -> str:
    seed, lines = str(turn), []
    for _ in range(700):  # ~50 KB of sha256 hex lines, as bench/storage_agent.py's tool returns
        seed = hashlib.sha256(seed.encode()).hexdigest()
        lines.append(seed)
    return '\n'.join(lines)


def _rows(url: str) -> dict[str, tuple[int, int]]:
    with SQLConversationStore(url) as store:
        sql: Any = store._sql
        with sql.engine.connect() as conn:
            digests = [row[0] for row in conn.exec_driver_sql('SELECT sha256 FROM durcap_payloads').all()]
        return {d: (len(data), kind) for d, (data, kind) in sql.get_rows(digests).items()}


def test_a_tool_result_is_stored_once_read_back_deleted_with_its_conversation_and_kept_by_gc(
        store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_results, '_owner', lambda: RUN)
    text = _report(1)
    serializer = _results.ToolResultPieces()
    with _results.result_store(store_url):
        blob = serializer.dumps({'value': text, 'short': 'kept inline'})
        assert len(base64.b64decode(blob)) < 500  # the record holds the digest, not the text
        (digest,) = _rows(store_url)
        size, kind = _rows(store_url)[digest]
        assert kind == _results.KIND_ZPIECE and size < len(text) * 0.7
        assert serializer.loads(blob) == {'value': text, 'short': 'kept inline'}

        async def append() -> None:
            with SQLConversationStore(store_url) as store:
                await store.append('c', [
                    ModelRequest(parts=[UserPromptPart('fetch')]),
                    ModelResponse(parts=[ToolCallPart('fetch_report', {}, tool_call_id='t1')]),
                    ModelRequest(parts=[ToolReturnPart('fetch_report', text, tool_call_id='t1')]),
                ], expected_revision=None, append_id=RUN)

        asyncio.run(append())
        assert _results.settle('c', RUN) > len(text) * 0.5
        size, kind = _rows(store_url)[digest]
        assert kind == _results.KIND_IN_ENTRY and size < 100  # only the entry id: the text is the conversation's
        assert _results.settle('c', RUN) == 0  # idempotent
        assert serializer.loads(blob)['value'] == text  # read back from the entry

        gc = asyncio.run(collect_garbage(store_url, retention=timedelta(0), grace=timedelta(0), apply=True,
                                         now=datetime.now(UTC) + timedelta(days=1), answers=[]))
        assert gc.report.payloads == 0 and _rows(store_url)  # not an owner gc asks an engine about: kept

        async def purge() -> Any:
            with SQLConversationStore(store_url) as store:
                return await store.purge('c')

        assert asyncio.run(purge()).rows['durcap_payloads'] == 1  # the flow run's piece goes with its conversation
        assert _rows(store_url) == {}
        with pytest.raises(Exception, match='durcap_payloads'):
            serializer.loads(blob)


def test_deleting_a_conversation_keeps_the_tool_text_another_flow_run_still_reads(
        store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two flow runs' tools returned the same text: run A's turn was appended (its piece became a pointer into A's
    entry), run B was killed before its append (its result refers to the same row). Deleting conversation A gives the
    row its text back as a compressed piece, so B's resume still reads its tool's result (it was a dangling pointer:
    CorruptedRowError, and Prefect ran B's tool again); deleting B's conversation then frees it. Real SQLite /
    PostgreSQL stores, no flow run (owners patched), no model."""
    other = 'prefect:7c0e8a51-2b1d-4c3e-8f00-aa55aa55aa55'
    text = _report(2)
    serializer = _results.ToolResultPieces()

    def append(conversation_id: str, append_id: str) -> None:
        async def go() -> None:
            with SQLConversationStore(store_url) as store:
                await store.append(conversation_id, [
                    ModelRequest(parts=[UserPromptPart('fetch')]),
                    ModelResponse(parts=[ToolCallPart('fetch_report', {}, tool_call_id='t1')]),
                    ModelRequest(parts=[ToolReturnPart('fetch_report', text, tool_call_id='t1')]),
                ], expected_revision=None, append_id=append_id)
        asyncio.run(go())

    def purge(conversation_id: str) -> Any:
        async def go() -> Any:
            with SQLConversationStore(store_url) as store:
                return await store.purge(conversation_id)
        return asyncio.run(go())

    with _results.result_store(store_url):
        monkeypatch.setattr(_results, '_owner', lambda: RUN)
        serializer.dumps({'value': text})
        append('a', RUN)
        _results.settle('a', RUN)
        monkeypatch.setattr(_results, '_owner', lambda: other)
        blob_b = serializer.dumps({'value': text})  # B's result: the row A's settle made a pointer
        (digest,) = _rows(store_url)
        assert _rows(store_url)[digest][1] == _results.KIND_IN_ENTRY

        purge('a')
        size, kind = _rows(store_url)[digest]
        assert kind == _results.KIND_ZPIECE and size < len(text)
        assert serializer.loads(blob_b) == {'value': text}  # B's resume reads its tool's result

        append('b', other)
        _results.settle('b', other)
        assert _rows(store_url)[digest][1] == _results.KIND_IN_ENTRY  # B's own entry now
        assert serializer.loads(blob_b) == {'value': text}
        assert purge('b').rows['durcap_payloads'] == 1
        assert _rows(store_url) == {}


def test_the_pieces_of_a_run_killed_before_its_append_belong_to_its_conversation_through_its_turn_claim(
        store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A flow run that claimed conversation `c` (its load) and stored a tool result, then died before its append: no
    write names it, but its claim (held as the bare flow run id) does. `store stats` counts the piece as `c`'s, and
    deleting `c` (only a claim in the store: found, not "no such conversation") removes the piece and the claim.
    Another conversation's piece stays."""
    monkeypatch.setattr(_results, '_owner', lambda: RUN)
    with _results.result_store(store_url):
        _results.ToolResultPieces().dumps({'value': _report(3)})
    other = 'prefect:11111111-2222-4333-8444-555555555555'
    monkeypatch.setattr(_results, '_owner', lambda: other)
    with _results.result_store(store_url):
        _results.ToolResultPieces().dumps({'value': _report(4)})
    mine, theirs = _results.piece_digest(_report(3)), _results.piece_digest(_report(4))

    async def go() -> Any:
        with SQLConversationStore(store_url) as store:
            store._sql.claim_turn('c', RUN.removeprefix('prefect:'))
            store._sql.claim_turn('d', other.removeprefix('prefect:'))
            stats = {c.conversation_id: c for c in (await store.stats()).conversations}
            assert stats['c'].payload_bytes == _rows(store_url)[mine][0] and stats['c'].message_count == 0
            report = await store.purge('c')
            return report, store._sql.turn_claim('c'), store._sql.turn_claim('d')

    report, claim_c, claim_d = asyncio.run(go())
    assert report.rows['durcap_payloads'] == 1 and report.rows['durcap_payload_refs'] == 1
    assert set(_rows(store_url)) == {theirs} and claim_c is None and claim_d is not None
