"""Claim checks that share what repeats (issue 24 item 1): a large payload holding a message list is stored as
content-addressed pieces written once, so a conversation's claim checks grow linearly with its messages, not with
the number of model requests. Real SQLite files and real PostgreSQL databases (`store_url` of tests/conftest.py: SQLite here, PostgreSQL again from tests/engines/test_stores_on_postgresql.py),
payloads made by temporalio's pydantic data converter as pydantic-ai's Temporal integration sends them."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import re
from typing import Any

import pytest
from pydantic_ai.messages import (
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from temporalio.api.common.v1 import Payload
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import WorkflowSerializationContext

from durable_capabilities.engines.temporal._payloads import ENCODING, ClaimCheckCodec, _escape, pieces
from durable_capabilities.store import CorruptedRowError
from tests._helpers import sql


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def conversation(turns: int, result_bytes: int = 50_000) -> list[Any]:
    """`turns` turns of: a prompt, a tool call, a ~`result_bytes` tool result, an answer."""
    messages: list[Any] = []
    for i in range(turns):
        messages.append(ModelRequest(parts=[UserPromptPart(f'turn {i}: look it up')]))
        messages.append(ModelResponse(parts=[ToolCallPart('lookup', {'turn': i}, tool_call_id=f'call-{i}')]))
        messages.append(ModelRequest(parts=[ToolReturnPart('lookup', f'{i} ' + 'lorem ipsum ' * (result_bytes // 12), tool_call_id=f'call-{i}')]))
        messages.append(ModelResponse(parts=[TextPart(f'answer {i}')]))
    return messages


def request(messages: list[Any]) -> dict[str, Any]:
    """A model-request activity input's shape: the messages, then settings and tool definitions."""
    return {
        'messages': ModelMessagesTypeAdapter.dump_python(messages, mode='json'),
        'model_settings': {'temperature': 0.0},
        'model_request_parameters': {'function_tools': [{'name': 'lookup', 'description': 'd' * 2000}]},
    }


def stored_bytes(url: str) -> int:
    return int(sql(url, 'SELECT COALESCE(SUM(size), 0) FROM durcap_payloads')[0][0])


def test_pieces_cover_the_payload_and_keep_the_prefix() -> None:
    messages = conversation(9)
    short = json.dumps(request(messages[:24]), separators=(',', ':')).encode()
    longer = json.dumps(request(messages), separators=(',', ':')).encode()
    for data in (short, longer, b'', b'no objects here', b'{"a":[{"b":1},{"c":2}]}', b'"unterminated ' + b'x' * 3000):
        found = pieces(data)
        assert b''.join(_escape(piece, depth) for depth, piece in found) == data
        assert all(piece for _, piece in found) or data == b''
    first, second = pieces(short), pieces(longer)
    assert len(first) > 5
    tail = len(pieces(json.dumps(request([]), separators=(',', ':')).encode()[len('{"messages":[]'):]))
    assert first[:-tail - 1] == second[:len(first) - tail - 1]  # all but the last message's end and the pieces after the messages


def test_a_long_string_is_the_same_piece_in_every_payload_that_carries_it() -> None:
    """A tool result inside a model request, alone (the tool's result), and inside a stored message's JSON text carried
    as a string (the conversation-load result: escaped once more) is one piece, kept unescaped."""
    messages = conversation(2, 5000)
    result = messages[2].parts[0].content
    inside = json.dumps(result)[1:-1].encode()
    rows = [ModelMessagesTypeAdapter.dump_json([m])[1:-1].decode() for m in messages]
    loaded = json.dumps({'messages': [], 'revision': 3, 'warnings': [], 'rows': rows}, separators=(',', ':')).encode()
    carriers = [json.dumps(request(messages), separators=(',', ':')).encode(), json.dumps(result).encode(), loaded]
    for data in carriers:
        found = pieces(data)
        assert b''.join(_escape(piece, depth) for depth, piece in found) == data
        assert inside in {piece for _, piece in found}, data[:80]
    assert (1, inside) in pieces(loaded)  # one level down, unescaped
    message = ModelMessagesTypeAdapter.dump_json([messages[2]])[1:-1]
    assert set(pieces(message)) <= {(0, p) for _, p in pieces(loaded)} | {(0, p) for _, p in pieces(carriers[0])}
    # A string whose escapes are not only `\\` and `\"` (a JSON text written with \u escapes) stays one piece, as it is.
    odd = json.dumps({'rows': [json.dumps({'text': 'é' * 1200})]}).encode()
    assert (0, json.loads(odd)['rows'][0].encode()) not in pieces(odd)
    assert b''.join(_escape(piece, depth) for depth, piece in pieces(odd)) == odd


def test_a_growing_conversation_stores_its_messages_once(store_url: str) -> None:
    codec = ClaimCheckCodec(store_url, threshold=100_000)

    converter = dataclasses.replace(pydantic_data_converter, payload_codec=codec)
    messages = conversation(24)
    payloads: list[Payload] = []
    sizes: dict[int, int] = {}
    whole = 0  # what 0.2 stored: every payload over the threshold, whole
    for count in range(1, len(messages) + 1):  # every model request carries the conversation so far
        value = request(messages[:count])
        [encoded] = run(converter.encode([value]))
        [plain] = run(pydantic_data_converter.encode([value]))
        whole += plain.ByteSize() if plain.ByteSize() > codec.threshold else 0
        payloads.append(encoded)
        if count in (48, 96):
            sizes[count] = stored_bytes(store_url)
        assert run(converter.decode([encoded], [dict[str, Any]])) == [value]
    conversation_bytes = len(ModelMessagesTypeAdapter.dump_json(messages))
    assert all(p.metadata['encoding'] == ENCODING for p in payloads[8:])
    assert max(p.ByteSize() for p in payloads[8:]) < 1_000  # references, not the payloads
    # Stored: about the conversation once (0.2 stored every request whole: `whole`, ~40x here).
    assert sizes[96] < 1.3 * conversation_bytes, (sizes, conversation_bytes, whole)
    assert whole > 20 * sizes[96], (sizes, whole)
    second_half = conversation_bytes - len(ModelMessagesTypeAdapter.dump_json(messages[:48]))
    assert sizes[96] - sizes[48] < 1.2 * second_half  # linear: the second 12 turns cost about their own bytes
    # Stored again (a retried activity): nothing new.
    run(converter.encode([request(messages)]))
    assert stored_bytes(store_url) == sizes[96]


def test_a_reference_written_by_0_2_still_decodes(store_url: str) -> None:
    """0.2's layout, as its codec wrote it: the whole serialized payload under its sha256, the reference
    `{"sha256": ..., "size": ...}`. Next to it, a new reference in pieces for the same value."""
    value = request(conversation(8))
    [plain] = run(pydantic_data_converter.encode([value]))
    data = plain.SerializeToString(deterministic=True)
    digest = hashlib.sha256(data).hexdigest()
    sql(store_url, 'SELECT 1')  # the database exists; the codec creates the schema
    codec = ClaimCheckCodec(store_url, threshold=1000)
    codec._store._sql.put_payload(digest, data)  # 0.2's `encode`: one row, keyed by the whole payload's digest
    old = Payload(metadata={'encoding': b'binary/durcap-claim-check'}, data=json.dumps({'sha256': digest, 'size': len(data)}).encode())
    [new] = run(codec.encode([plain]))
    assert json.loads(new.data)['sha256'] == digest and json.loads(new.data)['root']  # same digest, in pieces
    decoded = run(codec.decode([old, new]))
    assert decoded == [plain, plain]


_CUT_0_3 = re.compile(rb'(?<=[\[,])\{"parts":\[|\}\]')


def write_0_3(codec: ClaimCheckCodec, plain: Payload, owner: str) -> Payload:
    """Store `plain` in 0.3's layout, as its codec wrote it: pieces cut before each message and after each list of
    objects, one level of pages of 32-byte piece digests, a reference row per piece and page for `owner`; returns the
    reference `{"sha256", "size", "pages"}`."""
    data = plain.SerializeToString(deterministic=True)
    head = len(data) - len(plain.data)
    bounds, start = [(0, head)], head
    for match in _CUT_0_3.finditer(data, head):
        end = match.start() if match.group() != b'}]' else match.end()
        if end > start:
            bounds.append((start, end))
            start = end
    bounds.append((start, len(data)))
    rows = [(hashlib.sha256(data[a:b]).hexdigest(), data[a:b]) for a, b in bounds]
    digests = b''.join(bytes.fromhex(d) for d, _ in rows)
    pages = [digests[i:i + 32 * 32] for i in range(0, len(digests), 32 * 32)]
    page_digests = [hashlib.sha256(page).hexdigest() for page in pages]
    codec._store._sql.put_payloads(rows + list(zip(page_digests, pages, strict=True)), owner)
    return Payload(metadata={'encoding': b'binary/durcap-claim-check'},
                   data=json.dumps({'sha256': hashlib.sha256(data).hexdigest(), 'size': len(data), 'pages': page_digests}).encode())


def test_a_reference_written_by_0_3_still_decodes(store_url: str) -> None:
    """0.3's layout (`write_0_3`) decodes, next to today's reference for the same value."""
    value = request(conversation(8, 3000))
    [plain] = run(pydantic_data_converter.encode([value]))
    codec = ClaimCheckCodec(store_url, threshold=1000)
    old = write_0_3(codec, plain, 'old-owner')
    assert len(json.loads(old.data)['pages']) > 1
    [new] = run(codec.encode([plain]))
    assert run(codec.decode([old, new])) == [plain, plain]
    assert run(pydantic_data_converter.decode(run(codec.decode([old])), [dict[str, Any]])) == [value]


def test_a_store_of_schema_7_migrates_in_place_and_its_claim_checks_decode_and_collect(
        store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store written by 0.3 (schema 7, 0.3's claim checks), opened by this version: migrated in place (schema 8's
    `kind` column, 0 for every row), nothing lost; its reference decodes; gc frees the old run's pieces (through its
    reference rows, one per piece and page) and leaves a new run's claim check alone."""
    from datetime import UTC, datetime, timedelta

    import durable_capabilities.store as store_module

    monkeypatch.setattr(store_module, 'SCHEMA_VERSION', 7)
    for newer in [v for v in store_module._MIGRATIONS if v > 7]:  # 0.3's store: schema 7
        monkeypatch.delitem(store_module._MIGRATIONS, newer)
    value = request(conversation(4, 3000))
    [plain] = run(pydantic_data_converter.encode([value]))
    old = write_0_3(ClaimCheckCodec(store_url, threshold=1000), plain, 'wf-0.3')
    before = {d: bytes(data) for d, data in sql(store_url, 'SELECT sha256, data FROM durcap_payloads')}
    assert sql(store_url, 'SELECT MAX(version) FROM durcap_schema_version')[0][0] == 7
    monkeypatch.undo()

    codec = ClaimCheckCodec(store_url, threshold=1000)
    assert run(codec.decode([old])) == [plain]
    assert sql(store_url, 'SELECT MAX(version) FROM durcap_schema_version')[0][0] == store_module.SCHEMA_VERSION
    assert {d: (bytes(data), kind) for d, data, kind in sql(store_url, 'SELECT sha256, data, kind FROM durcap_payloads')} == {
        d: (data, 0) for d, data in before.items()}
    bound = codec.with_context(WorkflowSerializationContext(namespace='default', workflow_id='wf-0.4'))
    result = value['messages'][2]['parts'][0]['content']
    [plain_result] = run(pydantic_data_converter.encode([result]))
    [new] = run(bound.encode([plain_result]))
    assert run(codec.decode([new])) == [plain_result]
    later = datetime.now(UTC) + timedelta(seconds=1)
    report = codec._store._sql.collect(['wf-0.3'], later, dry_run=False)
    left = {d for (d,) in sql(store_url, 'SELECT sha256 FROM durcap_payloads')}
    assert (report.payloads, report.refs) == (len(before), len(before)) and not left & set(before)  # all of 0.3's run
    assert run(codec.decode([new])) == [plain_result]  # the new run's claim check is untouched


def test_a_missing_or_altered_piece_is_a_corrupted_row(store_url: str) -> None:
    codec = ClaimCheckCodec(store_url, threshold=1000)
    [plain] = run(pydantic_data_converter.encode([request(conversation(3, 5000))]))
    [reference] = run(codec.encode([plain]))
    assert run(codec.decode([reference])) == [plain]  # the storing codec's first decode (`_Recent`: no store read)
    root = json.loads(reference.data)['root']
    stored = [d for (d,) in sql(store_url, 'SELECT sha256 FROM durcap_payloads WHERE kind = 0')]
    assert len(stored) > 5
    [(packed, data)] = sql(store_url, 'SELECT sha256, data FROM durcap_payloads WHERE kind = 3 ORDER BY size DESC LIMIT 1')
    sql(store_url, 'UPDATE durcap_payloads SET data = :junk WHERE sha256 = :d', {'junk': b'not zlib', 'd': packed})
    with pytest.raises(CorruptedRowError, match='has a piece that does not decompress in durcap_payloads'):
        run(codec.decode([reference]))
    sql(store_url, 'UPDATE durcap_payloads SET data = :data WHERE sha256 = :d', {'data': bytes(data), 'd': packed})
    assert run(codec.decode([reference])) == [plain]
    sql(store_url, 'UPDATE durcap_payloads SET data = :junk WHERE sha256 = :d', {'junk': b'not the piece', 'd': stored[2]})
    with pytest.raises(CorruptedRowError, match='does not match its sha256 in durcap_payloads'):
        run(codec.decode([reference]))
    sql(store_url, 'DELETE FROM durcap_payloads WHERE sha256 = :d', {'d': stored[2]})
    with pytest.raises(CorruptedRowError, match='has a piece that is not in durcap_payloads'):
        run(codec.decode([reference]))
    sql(store_url, 'DELETE FROM durcap_payloads WHERE sha256 = :d', {'d': root})
    with pytest.raises(CorruptedRowError, match='has a page that is not in durcap_payloads'):
        run(codec.decode([reference]))
