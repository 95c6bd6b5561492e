"""The claim-check codec on its own (no Temporal server): real SQLite files and real PostgreSQL databases
(the `store_url` fixture of tests/conftest.py), payloads made by temporalio's own `DataConverter`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from temporalio.converter import DataConverter, WorkflowSerializationContext
from temporalio.exceptions import ApplicationError

from durable_capabilities.engines.temporal._payloads import ENCODING, ClaimCheckCodec, default_codec
from durable_capabilities.store import CorruptedRowError
from tests._helpers import sql


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_large_payloads_travel_by_reference_and_come_back_whole(store_url: str) -> None:
    codec = ClaimCheckCodec(store_url, threshold=1000, maximum=10_000_000)
    converter = DataConverter(payload_codec=codec)
    small, large = 'x' * 500, {'text': 'é' * 600_000}
    encoded = run(converter.encode([small, large, large]))
    assert encoded[0].metadata['encoding'] != ENCODING  # under the threshold: as it was
    assert encoded[1].metadata['encoding'] == ENCODING and encoded[1].ByteSize() < 300  # its head and the root of its pieces' tree
    assert encoded[1] == encoded[2]  # content-addressed: the same reference
    assert run(converter.decode(encoded, [str, dict, dict])) == [small, large, large]
    rows = sql(store_url, 'SELECT COUNT(*) FROM durcap_payloads')[0][0]
    run(converter.encode([large]))  # encoded again (a retried task): no new row
    assert sql(store_url, 'SELECT COUNT(*) FROM durcap_payloads')[0][0] == rows


def test_a_payload_over_the_maximum_is_refused_for_good(store_url: str) -> None:
    converter = DataConverter(payload_codec=ClaimCheckCodec(store_url, threshold=1000, maximum=50_000))
    run(converter.encode(['y' * 2000]))  # one claim check stored
    stored = sql(store_url, 'SELECT COUNT(*) FROM durcap_payloads')[0][0]
    with pytest.raises(ApplicationError, match=r'DC030 Temporal payload: a payload of 60,0\d\d bytes is over the maximum of 50,000 bytes') as raised:
        run(converter.encode(['x' * 60_000]))
    assert raised.value.non_retryable and raised.value.type == 'DurcapPayloadTooLarge'
    assert sql(store_url, 'SELECT COUNT(*) FROM durcap_payloads')[0][0] == stored  # nothing stored for the refused one


def test_store_down_inline_when_temporal_can_carry_it_else_dc031() -> None:
    codec = ClaimCheckCodec('postgresql://postgres@127.0.0.1:1/conversations', threshold=1000, inline_limit=100_000)
    converter = DataConverter(payload_codec=codec)
    [inline] = run(converter.encode(['x' * 50_000]))
    assert inline.metadata['encoding'] != ENCODING
    with pytest.raises(ApplicationError, match=r'DC031 cannot store a payload of 200,0\d\d bytes') as raised:
        run(converter.encode(['x' * 200_000]))
    assert raised.value.non_retryable and raised.value.type == 'DurcapClaimCheckUnavailable'


def test_a_reference_whose_payload_is_missing_or_altered_is_a_corrupted_row(store_url: str) -> None:
    converter = DataConverter(payload_codec=ClaimCheckCodec(store_url, threshold=1000))
    [reference] = run(converter.encode(['x' * 5000]))
    assert run(converter.decode([reference], [str])) == ['x' * 5000]
    sql(store_url, 'UPDATE durcap_payloads SET data = :junk', {'junk': b'not the payload'})
    with pytest.raises(CorruptedRowError, match='does not match its sha256 in durcap_payloads'):
        run(converter.decode([reference], [str]))
    elsewhere = DataConverter(payload_codec=ClaimCheckCodec('sqlite:///:memory:'))
    with pytest.raises(CorruptedRowError, match='is not in durcap_payloads'):
        run(elsewhere.decode([reference], [str]))


def test_the_first_decode_by_the_codec_that_stored_a_payload_skips_the_store_read_once(store_url: str) -> None:
    """A model request's input is stored when the workflow task completes and decoded by the activity the same worker
    runs: that first decode takes the bytes the codec just wrote (their write committed, their sha256 the reference's)
    instead of reading them back. Only once, only there: the next decode, and another codec's, read the store and
    check it (proven here by altering the stored row between them)."""
    codec = ClaimCheckCodec(store_url, threshold=1000)
    worker = DataConverter(payload_codec=codec.with_context(WorkflowSerializationContext('default', 'wf-1')))
    activity = DataConverter(payload_codec=codec.with_context(WorkflowSerializationContext('default', 'wf-1')))
    [reference] = run(worker.encode(['x' * 5000]))
    sql(store_url, 'UPDATE durcap_payloads SET data = :junk', {'junk': b'not the payload'})
    assert run(activity.decode([reference], [str])) == ['x' * 5000]  # the copy the worker's activity uses: no read
    with pytest.raises(CorruptedRowError, match='does not match its sha256 in durcap_payloads'):
        run(activity.decode([reference], [str]))  # a retried attempt or a replay: read and checked
    [again] = run(worker.encode(['x' * 5000]))  # a second store of the same payload (content-addressed, no new row)
    other = DataConverter(payload_codec=ClaimCheckCodec(store_url, threshold=1000))
    with pytest.raises(CorruptedRowError, match='does not match its sha256 in durcap_payloads'):
        run(other.decode([again], [str]))  # another process's codec never takes what this one stored


def test_thresholds_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('DURCAP_CLAIM_CHECK_THRESHOLD', '1234')
    monkeypatch.setenv('DURCAP_PAYLOAD_MAXIMUM', '5678')
    monkeypatch.setenv('DURCAP_STORE', 'sqlite:///somewhere.db')
    codec = default_codec()
    assert (codec.threshold, codec.maximum, codec.store_url) == (1234, 5678, 'sqlite:///somewhere.db')
    monkeypatch.setenv('DURCAP_PAYLOAD_MAXIMUM', 'lots')
    with pytest.raises(ValueError, match=r'\$DURCAP_PAYLOAD_MAXIMUM must be a number of bytes'):
        default_codec()


def test_the_data_converter_binds_one_copy_per_workflow_and_records_each_owner(store_url: str) -> None:
    """`ClaimCheckDataConverter.with_context` (what temporalio calls for every payload sequence of a workflow task and
    every activity) hands back one bound copy per workflow id, whatever the activity context, instead of a new
    converter per call; each copy's codec records its own workflow as the owner of what it stores
    (`durcap_payload_refs`), as `DataConverter`'s copies did."""
    from temporalio.converter import ActivitySerializationContext
    from temporalio.converter import PayloadConverter as _PayloadConverter
    from temporalio.converter import WithSerializationContext as _WithContext

    from durable_capabilities.engines.temporal._payloads import ClaimCheckDataConverter, default_data_converter

    converter = default_data_converter(store_url)
    assert isinstance(converter, ClaimCheckDataConverter) and converter.payload_codec.store_url == store_url  # type: ignore[union-attr]
    workflow_1 = converter.with_context(WorkflowSerializationContext('default', 'wf-1'))
    activity_1 = converter.with_context(ActivitySerializationContext(
        namespace='default', activity_id='3', activity_type='agent__x__model_request', activity_task_queue='q',
        workflow_id='wf-1', workflow_type='durcap.x', is_local=False))
    workflow_2 = converter.with_context(WorkflowSerializationContext('default', 'wf-2'))
    assert workflow_1 is activity_1 is converter.with_context(WorkflowSerializationContext('default', 'wf-1'))
    assert workflow_2 is not workflow_1 and workflow_1 is not converter
    assert [c.payload_codec.owner for c in (converter, workflow_1, workflow_2)] == [None, 'wf-1', 'wf-2']  # type: ignore[union-attr]
    for bound, owner in ((workflow_1, 'wf-1'), (workflow_2, 'wf-2')):
        [reference] = run(bound.encode([owner * 10_000]))
        assert reference.metadata['encoding'] == ENCODING
        assert run(bound.decode([reference], [str])) == [owner * 10_000]
    owners = sql(store_url, 'SELECT DISTINCT owner FROM durcap_payload_refs ORDER BY owner')
    assert [row[0] for row in owners] == ['wf-1', 'wf-2']

    class ContextAware(_PayloadConverter, _WithContext):  # a payload converter that differs per context: no reuse
        def __init__(self, seen: Any = None) -> None:
            self.seen = seen

        def to_payloads(self, values: Any) -> Any:
            raise NotImplementedError

        def from_payloads(self, payloads: Any, type_hints: Any = None) -> Any:
            raise NotImplementedError

        def with_context(self, context: Any) -> ContextAware:
            return ContextAware(context)

    aware = ClaimCheckDataConverter(payload_codec=ClaimCheckCodec(store_url), payload_converter_class=ContextAware)
    context = WorkflowSerializationContext('default', 'wf-1')
    assert aware.with_context(context) is not aware.with_context(context)
