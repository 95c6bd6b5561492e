"""`durcap store gc` (`collecting.collect_garbage`, `SQLConversationStore.collect`) on real SQLite files (and, through
tests/engines/test_store_gc.py, on fresh PostgreSQL databases: every test here that takes `store_url`).

The claim checks are written through the real codec (`ClaimCheckCodec`, with Temporal's serialization context naming
the workflow), so their pieces and reference rows are what a Temporal run leaves. What the engine says of the runs is
given as data (`engines.RunStates`, the answer `EngineAdapter.run_states` returns): the decision and the deletion are
tested here; tests/engines/test_store_gc.py asks a real Temporal dev server.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart
from temporalio.converter import DataConverter, WorkflowSerializationContext

from durable_capabilities.collecting import (
    GcEngineError,
    GcSchedule,
    collect_garbage,
    gone_owners,
    parse_duration,
)
from durable_capabilities.engines import RunState, RunStates
from durable_capabilities.engines.temporal._payloads import ClaimCheckCodec
from durable_capabilities.settings import Settings
from durable_capabilities.store import SQLConversationStore
from tests._helpers import durcap, sqlite_url
from tests.unit.test_history_delete import everything, needed

HOUR = timedelta(hours=1)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def execute(url: str, statement: str, params: dict[str, Any] | None = None) -> None:
    engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://'))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(statement), params or {})
    finally:
        engine.dispose()


def codec_converter(url: str, workflow_id: str | None) -> DataConverter:
    converter = DataConverter(payload_codec=ClaimCheckCodec(url, threshold=1000))
    if workflow_id is not None:
        converter = converter.with_context(WorkflowSerializationContext(namespace='default', workflow_id=workflow_id))
    return converter


def history(n: int, marker: str) -> list[dict[str, Any]]:
    """A message-list-like value the codec cuts into pieces (one per message)."""
    return [{'parts': [{'content': f'{marker} message {i} ' + 'x' * 400}], 'kind': 'request'} for i in range(n)]


SHARED = 'SHARED-TOOL-RESULT ' * 200


def seed(url: str) -> dict[str, Any]:
    """Two conversations: `wf-a` (conversation conv-a: a history of its own and SHARED) and `wf-b` (conv-b: SHARED and
    a history of its own), and a claim check written without a workflow (no recorded owner). Returns the references."""

    async def go() -> dict[str, Any]:
        with SQLConversationStore(url) as store:
            for cid, wf in (('conv-a', 'wf-a'), ('conv-b', 'wf-b')):
                await store.append(cid, [ModelRequest(parts=[UserPromptPart(f'{cid} prompt')]),
                                         ModelResponse(parts=[TextPart('ok')])], expected_revision=None,
                                   append_id=f'{wf}:run-1')
        a = await codec_converter(url, 'wf-a').encode([history(5, 'ALPHA'), SHARED])
        b = await codec_converter(url, 'wf-b').encode([SHARED, history(4, 'BETA')])
        legacy = await codec_converter(url, None).encode(['LEGACY-UNOWNED ' * 200])
        return {'a': a, 'b': b, 'legacy': legacy}

    return run(go())


def decodes(url: str, workflow_id: str | None, references: list[Any]) -> list[Any]:
    return run(codec_converter(url, workflow_id).decode(references))


def answer(now: datetime, **states: RunState) -> RunStates:
    return RunStates('temporal', "namespace 'default' (given)", HOUR, dict(states))


def closed(run_id: str, ago: timedelta, now: datetime) -> RunState:
    return RunState(run_id, False, now - ago)


def gc(url: str, answers: list[RunStates], *, apply: bool, grace: timedelta = timedelta(0), now: datetime | None = None,
       retention: timedelta | None = None) -> Any:
    return run(collect_garbage(url, answers=answers, apply=apply, grace=grace, retention=retention,
                               now=now or datetime.now(UTC), settings=Settings.resolve()))


def digests_of(url: str, owner: str) -> set[str]:
    """Every durcap_payloads row `owner` needs (its references' rows and the pages and pieces under a tree's root)."""
    return needed(everything(url)).get(owner, set())


def ref_count(url: str, owner: str) -> int:
    return sum(1 for row in everything(url)['durcap_payload_refs'] if row[1] == owner)


# ---- what is freed --------------------------------------------------------------------------------


def test_dry_run_changes_nothing_and_apply_frees_exactly_the_closed_runs_unshared_pieces(store_url: str) -> None:
    refs = seed(store_url)
    now = datetime.now(UTC)
    a_pieces, b_pieces = digests_of(store_url, 'wf-a'), digests_of(store_url, 'wf-b')
    a_refs = ref_count(store_url, 'wf-a')
    shared = a_pieces & b_pieces
    # SHARED (stored whole) and the pieces both histories cut alike (their ends) are shared; ALPHA's messages are its own.
    assert len(shared) >= 1 and len(a_pieces - b_pieces) >= 5
    answers = [answer(now, **{'wf-a': closed('wf-a', 2 * HOUR, now), 'wf-b': RunState('wf-b', True)})]
    before = everything(store_url)

    plan = gc(store_url, answers, apply=False, now=now)
    assert everything(store_url) == before  # the dry run changed nothing
    assert plan.report.dry_run and [o.owner for o in plan.report.owners] == ['wf-a']
    sizes = {row[0]: row[1] for row in before['durcap_payloads']}
    assert plan.report.payloads == len(a_pieces - b_pieces)
    assert plan.report.payload_bytes == sum(sizes[d] for d in a_pieces - b_pieces)
    assert plan.report.refs == a_refs  # one per claim check: its tree's root
    assert (plan.report.shared_payloads, plan.report.shared_payload_bytes) == (len(shared), sum(sizes[d] for d in shared))
    assert plan.report.owners[0].conversations == ['conv-a']
    assert plan.kept == {'open': 1}
    assert 'closed' in plan.reasons['wf-a'] and 'past the 1h retention' in plan.reasons['wf-a']

    done = gc(store_url, answers, apply=True, now=now)
    after = everything(store_url)
    assert not done.report.dry_run
    assert (done.report.payloads, done.report.payload_bytes, done.report.refs) == (
        plan.report.payloads, plan.report.payload_bytes, plan.report.refs)
    left = {row[0] for row in after['durcap_payloads']}
    assert left == {row[0] for row in before['durcap_payloads']} - (a_pieces - b_pieces)  # exactly those freed
    assert shared <= left and b_pieces <= left
    assert digests_of(store_url, 'wf-a') == set() and digests_of(store_url, 'wf-b') == b_pieces
    for table in ('durcap_conversations', 'durcap_entries', 'durcap_writes'):
        assert after[table] == before[table], table  # conversations are not gc's business
    # The open run's claim checks (the shared piece included) and the unowned one still decode.
    assert decodes(store_url, 'wf-b', refs['b']) == [SHARED, history(4, 'BETA')]
    assert decodes(store_url, None, refs['legacy']) == ['LEGACY-UNOWNED ' * 200]

    again = gc(store_url, answers, apply=True, now=now)
    assert (again.report.payloads, again.report.refs, again.report.owners) == (0, 0, [])  # nothing left to free


def test_a_run_closed_within_the_retention_and_a_piece_shared_with_it_are_kept(store_url: str) -> None:
    seed(store_url)
    now = datetime.now(UTC)
    before = everything(store_url)
    answers = [answer(now, **{'wf-a': closed('wf-a', timedelta(minutes=30), now), 'wf-b': closed('wf-b', 3 * HOUR, now)})]
    done = gc(store_url, answers, apply=True, now=now)
    assert [o.owner for o in done.report.owners] == ['wf-b']
    assert done.kept == {'closed within the retention period': 1}
    left = {row[0] for row in everything(store_url)['durcap_payloads']}
    a_pieces = needed(before)['wf-a']
    assert a_pieces <= left  # wf-a's, the shared pieces among them, kept
    assert done.report.shared_payloads == len(a_pieces & needed(before)['wf-b'])
    # --retention overrides the engine's: with 10 minutes, wf-a is past it too.
    later = gc(store_url, answers, apply=True, now=now, retention=timedelta(minutes=10))
    assert [o.owner for o in later.report.owners] == ['wf-a'] and later.report.payloads == len(a_pieces)


def test_an_owner_the_engine_does_not_know_goes_only_once_its_references_are_past_the_retention(store_url: str) -> None:
    seed(store_url)
    now = datetime.now(UTC)
    answers = [answer(now, **{'wf-b': RunState('wf-b', True)})]  # wf-a: deleted from the engine, or not started yet
    recent = gc(store_url, answers, apply=True, now=now)
    assert recent.report.owners == [] and len(digests_of(store_url, 'wf-a')) > 0
    assert any('unknown' in why for why in recent.kept)
    old = (now - 2 * HOUR).isoformat(timespec='microseconds')
    execute(store_url, "UPDATE durcap_payload_refs SET created_at = :at WHERE owner = 'wf-a'", {'at': old})
    execute(store_url, 'UPDATE durcap_payloads SET created_at = :at', {'at': old})
    gone = gc(store_url, answers, apply=True, now=now)
    assert [o.owner for o in gone.report.owners] == ['wf-a'] and 'unknown to temporal' in gone.reasons['wf-a']
    assert digests_of(store_url, 'wf-a') == set()


# ---- the grace window ------------------------------------------------------------------------------


def test_the_grace_window_keeps_owners_and_pieces_written_in_it(store_url: str) -> None:
    seed(store_url)
    now = datetime.now(UTC)
    before = everything(store_url)
    answers = [answer(now, **{'wf-a': closed('wf-a', 2 * HOUR, now), 'wf-b': RunState('wf-b', True)})]
    # Everything was written just now: with a 15-minute grace, wf-a is skipped whole, nothing is deleted.
    kept = gc(store_url, answers, apply=True, now=now, grace=timedelta(minutes=15))
    assert kept.report.owners == [] and kept.report.skipped == ['wf-a'] and everything(store_url) == before
    assert 'within the grace window: wf-a' in '\n'.join(kept.lines())
    # wf-a's references are old, but one of its pieces was (re)written inside the grace window: that piece stays.
    old = (now - 2 * HOUR).isoformat(timespec='microseconds')
    execute(store_url, "UPDATE durcap_payload_refs SET created_at = :at WHERE owner = 'wf-a'", {'at': old})
    a_only = digests_of(store_url, 'wf-a') - digests_of(store_url, 'wf-b')
    young = sorted(a_only)[0]
    execute(store_url, 'UPDATE durcap_payloads SET created_at = :at WHERE sha256 <> :d', {'at': old, 'd': young})
    done = gc(store_url, answers, apply=True, now=now, grace=timedelta(minutes=15))
    left = {row[0] for row in everything(store_url)['durcap_payloads']}
    assert young in left and not (a_only - {young}) & left
    shared = digests_of(store_url, 'wf-b') & needed(before)['wf-a']
    assert done.report.payloads == len(a_only) - 1 and done.report.shared_payloads == len(shared) + 1  # and the young one


def test_nothing_is_deleted_when_the_engine_cannot_tell_its_retention(store_url: str) -> None:
    seed(store_url)
    now = datetime.now(UTC)
    before = everything(store_url)
    unknown = RunStates('temporal', "namespace 'x'", None, {'wf-a': closed('wf-a', 2 * HOUR, now)})
    with pytest.raises(GcEngineError, match='--retention') as caught:
        gc(store_url, [unknown], apply=True, now=now)
    assert caught.value.code == 'gc-engine-unavailable' and everything(store_url) == before
    done = gc(store_url, [unknown], apply=True, now=now, retention=HOUR)  # the override lets it decide
    assert [o.owner for o in done.report.owners] == ['wf-a']


def test_gone_owners_merges_what_several_engines_say() -> None:
    from durable_capabilities.store import ClaimCheckOwner

    now = datetime.now(UTC)
    owners = [ClaimCheckOwner(name, [], 1, now - 2 * HOUR) for name in ('w1', 'w2', 'w3')]
    owners.append(ClaimCheckOwner('w4', [], 1, now - 4 * HOUR))
    first = RunStates('one', 'x', HOUR, {'w1': closed('w1', 2 * HOUR, now), 'w2': closed('w2', 2 * HOUR, now)})
    second = RunStates('two', 'y', 3 * HOUR, {'w2': RunState('w2', True)})
    gone, kept = gone_owners(owners, [first, second], now)
    # w2 is open on the second engine; w3 is unknown to both and younger than the longest retention (3 h), w4 older.
    assert set(gone) == {'w1', 'w4'} and gone['w4'].startswith('unknown to one, two')
    assert kept == {'open': 1, 'unknown to the engines but referenced within the retention period (starting, or another '
                                'namespace)': 1}
    # A zero --retention is a retention (not "none given"): every closed or unknown owner is past it.
    zero, none_kept = gone_owners(owners, [first], now, retention=timedelta(0))
    assert set(zero) == {'w1', 'w2', 'w3', 'w4'} and none_kept == {}


def test_each_engine_judges_only_the_owners_of_its_runs() -> None:
    """A Prefect owner (`prefect:<flow run id>`) is judged by Prefect's answer only (a Temporal answer that does not
    know it never makes it "unknown, past retention"), a workflow id by Temporal's only; an owner of an engine not
    asked is kept."""
    from durable_capabilities.store import ClaimCheckOwner

    now = datetime.now(UTC)
    old = now - 5 * HOUR
    owners = [ClaimCheckOwner('wf-1', [], 1, old), ClaimCheckOwner('prefect:run-1', [], 1, old),
              ClaimCheckOwner('prefect:run-2', [], 1, old)]
    temporal = RunStates('temporal', 'x', HOUR, {'wf-1': RunState('wf-1', True)})
    gone, kept = gone_owners(owners, [temporal], now)
    assert gone == {} and kept == {'open': 1, 'their engine was not asked': 2}
    prefect = RunStates('prefect', 'y', HOUR, {'prefect:run-1': RunState('prefect:run-1', False, now - 2 * HOUR)})
    gone, kept = gone_owners(owners, [temporal, prefect], now)
    assert set(gone) == {'prefect:run-1', 'prefect:run-2'} and gone['prefect:run-2'].startswith('unknown to prefect ')
    assert kept == {'open': 1}


def test_an_abandoned_run_goes_once_its_last_sign_of_life_is_past_the_retention() -> None:
    """`RunState.abandoned` (Prefect: RUNNING, silent): closed at its last sign of life; the reason says why."""
    from durable_capabilities.collecting import abandoned_owners
    from durable_capabilities.store import ClaimCheckOwner

    now = datetime.now(UTC)
    owners = [ClaimCheckOwner(f'prefect:{n}', [], 1, now - 9 * HOUR) for n in ('old', 'new')]
    why = 'RUNNING, no beat, state change or task run update for 3 h: its process is gone'
    prefect = RunStates('prefect', 'y', HOUR, {
        'prefect:old': RunState('prefect:old', False, now - 3 * HOUR, abandoned=why),
        'prefect:new': RunState('prefect:new', False, now - timedelta(minutes=5), abandoned=why)})
    gone, kept = gone_owners(owners, [prefect], now)
    assert gone == {'prefect:old': f'abandoned on prefect ({why}), past the 1h retention'}
    assert kept == {'abandoned within the retention period': 1}
    assert abandoned_owners([prefect]) == {'prefect:old': f'prefect: {why}', 'prefect:new': f'prefect: {why}'}


def test_an_engine_that_keeps_its_runs_until_deleted_keeps_their_claim_checks_unless_a_retention_is_given(
        tmp_path: Path) -> None:
    """Prefect without flow run vacuum (`RunStates.keeps_forever`, no retention): gc does not refuse (Temporal's owners
    are still collected), keeps the Prefect runs' claim checks and says how to free them; `--retention` decides."""
    from durable_capabilities.store import ClaimCheckOwner

    now = datetime.now(UTC)
    owners = [ClaimCheckOwner('prefect:done', [], 1, now - 9 * HOUR), ClaimCheckOwner('prefect:gone', [], 1, now - 9 * HOUR)]
    forever = RunStates('prefect', 'y', None, {'prefect:done': RunState('prefect:done', False, now - 3 * HOUR)},
                        keeps_forever=True)
    gone, kept = gone_owners(owners, [forever], now)
    assert gone == {} and sorted(kept.values()) == [1, 1]
    assert any('keeps its runs until deleted (pass --retention' in why for why in kept), kept
    gone, _ = gone_owners(owners, [forever], now, retention=HOUR)
    assert set(gone) == {'prefect:done', 'prefect:gone'}
    url = sqlite_url(tmp_path)
    seed(url)
    later = datetime.now(UTC) + timedelta(seconds=1)  # after the seeded references: none inside the (zero) grace
    found = gc(url, [forever, answer(later, **{'wf-a': closed('wf-a', 2 * HOUR, later)})], apply=False, now=later)
    assert [o.owner for o in found.report.owners] == ['wf-a'] and found.forever == ['prefect']
    assert 'prefect keeps its runs until deleted' in found.lines()[0]


def test_gc_does_not_start_a_prefect_server_to_judge_prefect_runs_when_no_api_is_configured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store holding a Prefect flow run's tool-result piece, `durcap store gc` with no `PREFECT_API_URL` (a fresh
    Prefect home: no profile either): Prefect is not asked (that would start a temporary server, in a worker's every
    pass), its run is kept, and a note says why. Real CLI subprocess, real SQLite store; no engine runs."""
    from durable_capabilities.engines.prefect import _results

    url = sqlite_url(tmp_path)
    monkeypatch.setattr(_results, '_owner', lambda: 'prefect:0b9e1e8c-5a7e-4b8e-9f55-2f1c1d6f7a10')
    with _results.result_store(url):
        _results.ToolResultPieces().dumps({'value': 'y' * 5000})
    before = everything(url)
    done = durcap('store', 'gc', '--store', url, '--retention', '0s', '--grace', '0s', '--apply', '--format', 'json',
                  env={'PREFECT_HOME': str(tmp_path / 'prefect-home')}, unset=['PREFECT_API_URL'], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)
    assert data['owners'] == [] and data['kept_owners'] == {'their engine was not asked': 1}, data
    assert data['notes'] and data['notes'][0].startswith('prefect: skipped, no PREFECT_API_URL'), data
    assert everything(url) == before


# ---- output and flags ---------------------------------------------------------------------------------


def test_the_json_and_text_reports_name_each_workflow_its_conversation_and_bytes(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    seed(url)
    now = datetime.now(UTC)
    found = gc(url, [answer(now, **{'wf-a': closed('wf-a', 2 * HOUR, now), 'wf-b': RunState('wf-b', True)})],
               apply=False, now=now)
    data = json.loads(json.dumps(found.to_json()))
    assert data['dry_run'] is True and data['retention_seconds'] == {'temporal': 3600.0} and data['grace_seconds'] == 0
    assert data['freed']['payloads'] == found.report.payloads > 0
    assert data['freed']['payload_bytes'] == found.report.payload_bytes
    (owner,) = data['owners']
    assert (owner['owner'], owner['conversations'], owner['payloads']) == ('wf-a', ['conv-a'], found.report.payloads)
    assert owner['reason'].startswith('closed ') and data['kept_shared']['payloads'] == found.report.shared_payloads >= 1
    assert data['kept_owners'] == {'open': 1}
    text = found.lines()
    assert text[0].startswith('store gc (dry run; temporal retention 1h; grace 0s') and 'would free' in text[0]
    assert text[1].startswith('  wf-a (conversation conv-a): ') and text[-1] == 'nothing was deleted: pass --apply to delete'


def test_the_text_report_words_a_workflow_without_a_stored_turn_and_one_with_several_conversations(tmp_path: Path) -> None:
    """`wf-c` wrote claim checks but stored no turn; `wf-d` appended to two conversations: the owner line says so in
    words (a fresh-user trial read `(conversation no stored turn)`). Real SQLite store, the real codec."""
    url = sqlite_url(tmp_path)
    seed(url)

    async def more() -> None:
        with SQLConversationStore(url) as store:
            for cid in ('conv-d1', 'conv-d2'):
                await store.append(cid, [ModelRequest(parts=[UserPromptPart(f'{cid} prompt')])], expected_revision=None,
                                   append_id=f'wf-d:{cid}')
        for wf in ('wf-c', 'wf-d'):
            await codec_converter(url, wf).encode([history(3, wf)])

    run(more())
    now = datetime.now(UTC)
    found = gc(url, [answer(now, **{wf: closed(wf, 2 * HOUR, now) for wf in ('wf-c', 'wf-d')},
                            **{'wf-a': RunState('wf-a', True), 'wf-b': RunState('wf-b', True)})], apply=False, now=now)
    lines = {line.split(' (', 1)[0].strip(): line for line in found.lines()[1:] if line.startswith('  ')}
    assert lines['wf-c'].startswith('  wf-c (stored no turn in a conversation): '), lines
    assert lines['wf-d'].startswith('  wf-d (conversations conv-d1, conv-d2): '), lines


def test_the_cli_prints_json_for_a_store_without_claim_checks_and_asks_no_engine(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    run(SQLConversationStore(url).check_writable())
    # No owner recorded: nothing to ask, so an address where nothing listens is never dialled.
    done = durcap('store', 'gc', '--store', url, '--format', 'json', '--address', '127.0.0.1:9')
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data['freed'] == {'refs': 0, 'payloads': 0, 'payload_bytes': 0} and data['owners'] == [] and data['dry_run']
    text = durcap('store', 'gc', '--store', url, '--apply', '--grace', '0s')
    assert text.returncode == 0 and 'applied' in text.stdout and 'freed 0 piece(s)' in text.stdout, text.stdout


def test_dry_run_is_the_default_said_explicitly_and_never_with_apply(tmp_path: Path) -> None:
    """`store gc --dry-run` (the flag `history delete` takes) is the default dry run, not a usage error; with --apply
    it is one coded line, exit 2, nothing deleted. Real SQLite store, `durcap` subprocesses."""
    empty = sqlite_url(tmp_path, 'empty.db')
    run(SQLConversationStore(empty).check_writable())
    done = durcap('store', 'gc', '--store', empty, '--dry-run', '--format', 'json')
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)['dry_run'] is True
    url = sqlite_url(tmp_path)
    seed(url)
    before = everything(url)
    both = durcap('store', 'gc', '--store', url, '--dry-run', '--apply', '--grace', '0s', '--retention', '0s')
    assert both.returncode == 2 and both.stdout == '' and everything(url) == before
    lines = both.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('durcap: error: DC040 --apply and --dry-run contradict'), both.stderr


def test_gc_refuses_with_one_line_when_the_engine_cannot_be_reached(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    seed(url)
    before = everything(url)
    done = durcap('store', 'gc', '--store', url, '--apply', '--address', '127.0.0.1:9', timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith('durcap: error: DC040 temporal: cannot read run states: '), done.stderr
    assert 'nothing was deleted' in lines[0] and everything(url) == before


@pytest.mark.parametrize(('args', 'expected'), [
    (['--grace', '5x'], "DC040 --grace '5x' is not a duration"),
    (['--retention', 'soon'], "DC040 --retention 'soon' is not a duration"),
    (['--retention', '-1h'], "DC040 --retention '-1h' is not a duration"),
])
def test_bad_durations_are_one_coded_line(tmp_path: Path, args: list[str], expected: str) -> None:
    done = durcap('store', 'gc', '--store', sqlite_url(tmp_path), *args)
    assert done.returncode == 2 and done.stdout == ''
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f'durcap: error: {expected}'), done.stderr
    assert 'e.g. 90s, 15m, 1h30m, 7d' in lines[0]


def test_a_missing_store_is_one_line_and_not_created(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path, 'absent.db')
    done = durcap('store', 'gc', '--store', url)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert 'no conversation store' in done.stderr and not (tmp_path / 'absent.db').exists()


@pytest.mark.parametrize(('engine', 'args', 'expected'), [
    ('temporal', ['--gc-every', 'often'], "DC040 --gc-every 'often' is not a duration"),
    ('temporal', ['--gc-every', '0s'], "DC040 --gc-every '0s' must be longer than 0s"),
    ('temporal', ['--gc-apply'], 'DC040 --gc-apply, --gc-retention and --gc-abandoned-after need --gc-every DURATION'),
    ('temporal', ['--gc-abandoned-after', '2h'], 'DC040 --gc-apply, --gc-retention and --gc-abandoned-after need'),
    ('temporal', ['--gc-every', '1h', '--gc-abandoned-after', 'soon'], "DC040 --gc-abandoned-after 'soon' is not a duration"),
    ('temporal', ['--gc-every', '1h', '--gc-abandoned-after', '0s'], "DC040 --gc-abandoned-after '0s' must be longer than 0s"),
    ('dbos', ['--gc-every', '1h'], 'DC040 --gc-every: dbos runs store no claim checks'),
])
def test_bad_worker_gc_flags_are_one_coded_line_before_the_worker_starts(engine: str, args: list[str], expected: str) -> None:
    done = durcap('worker', engine, 'tests.fixtures.good_agent:agent', *args)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f'durcap: error: {expected}'), done.stderr


def test_the_worker_schedule_logs_one_line_per_pass(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    run(SQLConversationStore(url).check_writable())
    lines: list[str] = []
    schedule = GcSchedule(url, Settings.resolve(), timedelta(hours=1), lines.append)
    found = schedule.run_once()
    assert found is not None and found.report.dry_run
    assert lines == ['store gc: would free 0 piece(s), 0 bytes, of 0 workflow(s); kept 0 shared piece(s); 0 workflow(s) '
                     'live (dry run: --gc-apply deletes)']
    missing = GcSchedule(sqlite_url(tmp_path, 'absent.db'), Settings.resolve(), timedelta(hours=1), lines.append)
    assert missing.run_once() is None and lines[-1].startswith('store gc: failed, nothing deleted: no conversation store')
    with pytest.raises(ValueError, match='positive'):
        GcSchedule(url, Settings.resolve(), timedelta(0), lines.append)


@pytest.mark.parametrize(('text', 'seconds'), [('90s', 90), ('15m', 900), ('1h30m', 5400), ('7d', 604800), ('2w', 1209600),
                                               ('250ms', 0.25), ('45', 45), ('0s', 0), ('1.5h', 5400)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text, '--grace').total_seconds() == seconds


@pytest.mark.parametrize('text', ['', 'h', '1y', '-5m', '5 m m', '1h-2m'])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError, match='is not a duration'):
        parse_duration(text, '--grace')
