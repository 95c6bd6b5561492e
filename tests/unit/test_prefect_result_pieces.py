"""Prefect tool-call task results keep their long texts in the conversation store, once (issue 24,
`engines.prefect._results.ToolResultPieces`): written as compressed pieces owned by the flow run, read back, turned
into pointers to the appended entry that holds the same text (still read back), deleted with the conversation by
`history delete`'s purge, and never collected by `store gc`.

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
