"""`SQLConversationStore`, drift on resume, and `durcap history show`.

Here on SQLite files; tests/engines/test_stores_on_postgresql.py runs every test that takes `store_url` again on a
fresh PostgreSQL database (127.0.0.1:5432, trust auth), dropped after.
The histories are real: a `DurableAgent` on the local engine with a scripted `FunctionModel` that loads
the deferred capability `orders` and calls its tool `track_order`.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.conversation import Conversation
from pydantic_ai.conversation_store import ConversationConflict
from pydantic_ai.messages import (
    LoadCapabilityCallPart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RunUsage

from durable_capabilities import DurableAgent
from durable_capabilities import store as store_module
from durable_capabilities.store import (
    DEFAULT_URL,
    SCHEMA_VERSION,
    AppendIdReuseError,
    ConversationConflictError,
    ConversationNotFoundError,
    CorruptedRowError,
    NewerHistoryError,
    SchemaVersionError,
    SQLConversationStore,
    StoreUnavailableError,
    StoreURLError,
    drift,
    loaded_capability_ids,
    tools_called,
)
from tests._helpers import python, snapshot, sql, subprocess_env

# ---- fixtures: `store_url` and `store` in tests/conftest.py (SQLite here; PostgreSQL in
# tests/engines/test_stores_on_postgresql.py) ---------------------------------------------------


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# ---- a real history ---------------------------------------------------------------------------


class Status(BaseModel):
    status: str


def track_order(order_id: str) -> str:
    """Return the shipping status of an order."""
    return f'{order_id}: shipped'


def cancel_order(order_id: str) -> str:
    """Cancel an order."""
    return f'{order_id}: cancelled'


def orders_capability(capability_id: str = 'orders') -> Capability[Any]:
    return Capability(
        id=capability_id, description='Track and cancel orders.', instructions='Quote the status verbatim.',
        tools=[track_order, cancel_order], defer_loading=True,
    )


def notes_capability() -> Capability[Any]:
    return Capability(id='notes', description='Take notes.', instructions='Be brief.', defer_loading=True)


class Script:
    """A scripted model: load `orders`, call `track_order`, answer with the output tool. Records what it saw."""

    def __init__(self) -> None:
        self.seen_tools: list[list[str]] = []

    def __call__(self, messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        visible = [tool.name for tool in info.function_tools]
        self.seen_tools.append(visible)
        turn = [m for m in messages if isinstance(m, ModelRequest) and any(isinstance(p, UserPromptPart) for p in m.parts)]
        since = messages[messages.index(turn[-1]):]
        returned = [p.tool_name for m in since for p in m.parts if isinstance(p, ToolReturnPart)]
        if 'track_order' not in visible:
            return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'orders'})])
        if 'track_order' not in returned:
            return ModelResponse(parts=[ToolCallPart('track_order', {'order_id': 'A-1'})])
        return ModelResponse(parts=[ToolCallPart(info.output_tools[0].name, {'status': 'shipped'})])


def make_agent(script: Script, capabilities: list[Any] | None = None, **kwargs: Any) -> DurableAgent[Any, Any]:
    return DurableAgent(
        'store-test', FunctionModel(script), instructions='You are a support agent.',
        capabilities=capabilities if capabilities is not None else [orders_capability(), notes_capability()],
        output_type=Status, engines=(), **kwargs,
    )


@pytest.fixture(scope='module')
def history() -> list[ModelMessage]:
    """One real run: loads `orders`, calls `track_order`, answers with `final_result`."""
    result = run(make_agent(Script()).run('Where is order A-1?'))
    messages = result.all_messages()
    assert loaded_capability_ids(messages) == ['orders']
    return messages


# ---- round trip and the upstream API ----------------------------------------------------------


def test_round_trip_stores_pydantic_ai_json(store: SQLConversationStore, store_url: str, history: list[ModelMessage]) -> None:
    result = run(store.append('t-1', history, expected_revision=None, usage=RunUsage(requests=3)))
    assert (result.revision, result.first_position, result.message_count) == (1, 1, len(history))

    stored = run(store.read('t-1'))
    assert stored.messages == history
    assert ModelMessagesTypeAdapter.dump_json(stored.messages) == ModelMessagesTypeAdapter.dump_json(history)
    assert stored.revision == 1 and stored.entry_ids == result.entry_ids
    assert stored.record.usage.requests == 3
    assert stored.loaded_capability_ids() == ['orders']
    # The row holds pydantic-ai's own JSON for the message, byte for byte.
    rows = sql(store_url, 'SELECT message FROM durcap_entries ORDER BY position')
    assert [row[0] for row in rows] == [json.dumps(item, separators=(',', ':'), ensure_ascii=False) for item in json.loads(ModelMessagesTypeAdapter.dump_json(history))]

    more = [ModelRequest(parts=[UserPromptPart('and now?')])]
    second = run(store.append('t-1', more, expected_revision=1, usage=RunUsage(requests=1)))
    assert (second.revision, second.first_position, second.message_count) == (2, len(history) + 1, len(history) + 1)
    stored = run(store.read('t-1'))
    assert stored.messages == [*history, *more] and stored.record.usage.requests == 4
    last = run(store.read('t-1', limit=2))
    assert last.messages == [history[-1], *more] and last.first_position == len(history)


def test_resume_from_the_store_keeps_the_loaded_capability(store: SQLConversationStore) -> None:
    first = run(make_agent(Script()).run('Where is order A-1?'))
    run(store.append('t-resume', first.all_messages(), expected_revision=None, append_id='run-1'))

    # Run 2: another agent object (as another process would build it), history from the store.
    script = Script()
    stored = run(store.read('t-resume'))
    second = run(make_agent(script).run('And order A-2?', message_history=stored.messages))
    assert 'track_order' in script.seen_tools[0], 'the first request of run 2 already shows the loaded tools'
    assert not any(isinstance(p, LoadCapabilityCallPart) for m in second.new_messages() for p in m.parts)
    appended = run(store.append('t-resume', second.new_messages(), expected_revision=stored.revision, append_id='run-2'))
    assert appended.message_count == len(second.all_messages())


def test_upstream_load_save_fork_branch_delete(store: SQLConversationStore) -> None:
    agent = make_agent(Script())
    conversation = run(store.load('t-up')) or Conversation(conversation_id='t-up')
    result = run(agent.run('Where is order A-1?', conversation=conversation))
    saved = run(store.save(result))
    assert len(saved) == len(result.all_messages())

    loaded = run(store.load('t-up'))
    assert loaded is not None and loaded.messages == result.all_messages()
    ours = run(store.read('t-up'))
    assert ours.revision == 1 and ours.record.revision == loaded.revision

    result2 = run(agent.run('And order A-2?', conversation=loaded))
    run(store.save(result2))
    assert run(store.read('t-up')).messages == result2.all_messages()

    # Our append and upstream's save guard the same conversation: a stale upstream save conflicts.
    stale = run(store.load('t-up'))
    run(store.append('t-up', [ModelRequest(parts=[UserPromptPart('hi')])], expected_revision=2))
    stale.messages.append(ModelRequest(parts=[UserPromptPart('lost?')]))
    with pytest.raises(ConversationConflict):
        run(store.save(stale))

    fork = run(store.fork('t-up', at=2, new_conversation_id='t-fork'))
    fork.messages.append(ModelRequest(parts=[UserPromptPart('forked')]))
    run(store.save(fork))
    forked = run(store.read('t-fork'))
    assert forked.messages[:2] == result.all_messages()[:2] and len(forked.messages) == 3
    assert forked.message_count == 3

    current = run(store.read('t-up'))
    branched = run(store.branch('t-up', at=1, expected_revision=current.record.revision))
    branched.messages.append(ModelRequest(parts=[UserPromptPart('edited')]))
    run(store.save(branched))
    after = run(store.read('t-up'))
    assert len(after.messages) == 2 and after.record.branches  # the old line is kept as a branch
    assert {r.conversation_id for r in run(store.list_conversations())} == {'t-up', 't-fork'}

    run(store.delete('t-fork'))
    assert run(store.load('t-fork')) is None
    with pytest.raises(ConversationNotFoundError, match="'t-fork' is not in the store"):
        run(store.read('t-fork'))
    # Entries are kept: the fork's own message is still there, the delete is in the log.
    assert [w.operation for w in run(store.writes('t-fork'))] == ['save', 'save', 'delete']
    # Created again under the same id, the revision count continues (a stale writer still conflicts).
    again = run(store.append('t-fork', [], expected_revision=None))
    assert again.revision == 4


# ---- conflicts and idempotency ----------------------------------------------------------------


def test_conflicting_append_raises_and_writes_nothing(store: SQLConversationStore, store_url: str) -> None:
    one = [ModelRequest(parts=[UserPromptPart('one')])]
    run(store.append('t-c', one, expected_revision=None))
    run(store.append('t-s', one, expected_revision=None, scope='alice'))
    before = snapshot(store_url)

    with pytest.raises(ConversationConflictError) as exists:
        run(store.append('t-c', one, expected_revision=None))
    assert exists.value.stored_revision == 1 and exists.value.expected_revision is None
    with pytest.raises(ConversationConflictError, match='expected revision 5, the store has revision 1') as stale:
        run(store.append('t-c', one, expected_revision=5))
    assert isinstance(stale.value, ConversationConflict)  # upstream's type: `except ConversationConflict` works
    with pytest.raises(ConversationConflictError, match='has none'):
        run(store.append('t-missing', one, expected_revision=3))
    with pytest.raises(ConversationConflictError, match="saved with scope 'alice', not 'bob'"):
        run(store.append('t-s', one, expected_revision=1, scope='bob'))

    assert snapshot(store_url) == before  # no refused append wrote anything
    stored = run(store.read('t-c'))
    assert stored.revision == 1 and stored.messages == one


def test_append_id_makes_a_retried_append_a_no_op(store: SQLConversationStore) -> None:
    batch = [ModelRequest(parts=[UserPromptPart('q')]), ModelResponse(parts=[TextPart('a')])]
    first = run(store.append('t-i', batch, expected_revision=None, append_id='wf-1/append'))
    run(store.append('t-i', [ModelRequest(parts=[UserPromptPart('later')])], expected_revision=1, append_id='wf-2/append'))

    # The retried unit still expects revision None (stale) and sends the same messages.
    again = run(store.append('t-i', batch, expected_revision=None, append_id='wf-1/append'))
    assert again.replayed and not again.replayed_differently
    assert (again.revision, again.entry_ids, again.first_position) == (first.revision, first.entry_ids, 1)
    # Rebuilt by workflow code that ran again after a crash: new timestamps, same count; the stored ones stand.
    rebuilt = [ModelRequest(parts=[UserPromptPart('q')]), ModelResponse(parts=[TextPart('a')])]
    replay = run(store.append('t-i', rebuilt, expected_revision=None, append_id='wf-1/append'))
    assert replay.replayed and replay.replayed_differently and replay.entry_ids == first.entry_ids

    with pytest.raises(AppendIdReuseError, match="append_id 'wf-1/append' was stored at revision 1 with 2"):
        run(store.append('t-i', batch[:1], expected_revision=2, append_id='wf-1/append'))
    stored = run(store.read('t-i'))
    assert stored.revision == 2 and len(stored.messages) == 3
    assert [w.append_id for w in run(store.writes('t-i'))] == ['wf-1/append', 'wf-2/append']


WRITER = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from pydantic_ai.messages import ModelRequest, UserPromptPart
    from durable_capabilities.store import ConversationConflictError, ConversationNotFoundError, SQLConversationStore

    url, cid, name, count, go = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]

    async def main():
        store = SQLConversationStore(url)
        open(f'{go}.{name}', 'w').close()  # imported and ready: wait for the others
        while not os.path.exists(go):
            time.sleep(0.002)
        revision, conflicts, attempts, revisions = None, 0, 0, []
        for i in range(count):
            message = [ModelRequest(parts=[UserPromptPart(f'{name}-{i}')])]
            while True:
                attempts += 1
                try:
                    result = await store.append(cid, message, expected_revision=revision, append_id=f'{name}-{i}')
                except ConversationConflictError:
                    conflicts += 1
                    try:  # what a runner does: read the conversation again, retry with its revision
                        revision = (await store.read(cid)).revision
                    except ConversationNotFoundError:
                        revision = None
                    continue
                assert not result.replayed and result.revision == (revision or 0) + 1, (result, revision)
                revisions.append(result.revision)
                revision = result.revision
                break
        # A retried durable unit: the first append again, with a long-stale revision. Nothing is written.
        replay = await store.append(cid, [ModelRequest(parts=[UserPromptPart(f'{name}-0')])], expected_revision=None,
                                    append_id=f'{name}-0')
        assert replay.replayed and replay.revision == revisions[0]
        store.close()
        print(json.dumps({'conflicts': conflicts, 'attempts': attempts, 'revisions': revisions}))

    asyncio.run(main())
    """
)


@pytest.mark.slow
def test_200_concurrent_appends_from_4_processes(store: SQLConversationStore, store_url: str, tmp_path: Path) -> None:
    go = tmp_path / 'go'  # the writers also race to create the schema of the empty database
    writers = [
        subprocess.Popen(
            [sys.executable, '-c', WRITER, store_url, 't-race', f'w{k}', '50', str(go)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
        )
        for k in range(4)
    ]
    deadline = time.monotonic() + 120
    while not all(Path(f'{go}.w{k}').exists() for k in range(4)) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.write_text('go')  # all four start appending together
    reports = []
    for writer in writers:
        out, err = writer.communicate(timeout=300)
        assert writer.returncode == 0, err
        reports.append(json.loads(out))

    stored = run(store.read('t-race'))
    contents = [m.parts[0].content for m in stored.messages]
    expected = {f'w{k}-{i}' for k in range(4) for i in range(50)}
    assert len(contents) == 200 and set(contents) == expected  # nothing lost, no duplicate
    for k in range(4):  # each writer's messages in its own order
        own = [c for c in contents if c.startswith(f'w{k}-')]
        assert own == [f'w{k}-{i}' for i in range(50)]
    revisions = sorted(r for report in reports for r in report['revisions'])
    assert revisions == list(range(1, 201)), 'every success advanced the revision by one: no stale append got in'
    conflicts = sum(report['conflicts'] for report in reports)
    assert sum(report['attempts'] for report in reports) == 200 + conflicts  # every other attempt raised
    assert conflicts > 0
    print(f'{store_url.split(":")[0]}: 200 appends, {conflicts} conflicts raised and retried')
    assert stored.revision == 200
    assert [w.revision for w in run(store.writes('t-race'))] == list(range(1, 201))
    assert sql(store_url, 'SELECT COUNT(*) FROM durcap_entries')[0][0] == 200


# ---- bad input ----------------------------------------------------------------------------------


def _second_entry(store_url: str) -> str:
    return sql(store_url, 'SELECT entry_id FROM durcap_entries WHERE position = 2')[0][0]


@pytest.mark.parametrize(
    ('message', 'error', 'pattern'),
    [
        ('{"kind": "request", "parts": [', CorruptedRowError, 'is not valid JSON'),
        ('{"kind": "response", "parts": [{"part_kind": "text"}]}', CorruptedRowError, 'is not a pydantic-ai message'),
        ('{"kind": "response", "parts": []},{"kind": "response", "parts": []}', CorruptedRowError, 'is not valid JSON'),
        ('[{"kind": "response", "parts": []}]', CorruptedRowError, 'is not a pydantic-ai message'),
        ('{"kind": "response", "parts": [{"part_kind": "hologram", "content": "x"}]}', NewerHistoryError, "part kind 'hologram'"),
        ('{"kind": "thought", "parts": []}', NewerHistoryError, "message kind 'thought'"),
    ],
    ids=['invalid-json', 'invalid-message', 'two-messages', 'a-list', 'newer-part-kind', 'newer-message-kind'],
)
def test_a_bad_row_is_named_and_left_alone(
    store: SQLConversationStore, store_url: str, history: list[ModelMessage], message: str, error: type[Exception], pattern: str
) -> None:
    run(store.append('t-bad', history, expected_revision=None))
    entry = _second_entry(store_url)
    sql(store_url, 'UPDATE durcap_entries SET message = :m WHERE entry_id = :e', {'m': message, 'e': entry})
    before = snapshot(store_url)

    with pytest.raises(error, match=pattern) as raised:
        run(store.read('t-bad'))
    text = str(raised.value)
    assert "conversation 't-bad'" in text and entry in text and '(message 2)' in text and 'Nothing was changed' in text
    assert raised.value.row == entry and raised.value.position == 2  # type: ignore[attr-defined]
    if error is NewerHistoryError:
        assert 'pydantic-ai-slim 2.68.0' in text and 'Upgrade pydantic-ai-slim' in text
    with pytest.raises(error):
        run(store.load('t-bad'))  # upstream's load path reports it too
    assert snapshot(store_url) == before  # nothing deleted or rewritten
    # Appending never reads old messages: the conversation stays writable while the row is repaired.
    run(store.append('t-bad', [ModelRequest(parts=[UserPromptPart('still appendable')])], expected_revision=1))
    after = snapshot(store_url)
    assert all(row in after['durcap_entries'] for row in before['durcap_entries'])
    assert len(after['durcap_entries']) == len(before['durcap_entries']) + 1


def test_a_corrupted_conversation_row_is_named(store: SQLConversationStore, store_url: str) -> None:
    run(store.append('t-row', [ModelRequest(parts=[UserPromptPart('x')])], expected_revision=None))
    sql(store_url, "UPDATE durcap_conversations SET usage = '{\"requests\": \"many\"}'")
    before = snapshot(store_url)
    with pytest.raises(CorruptedRowError, match="conversation 't-row': column usage of its durcap_conversations row") as raised:
        run(store.read('t-row'))
    assert raised.value.table == 'durcap_conversations' and raised.value.row == 't-row'
    assert snapshot(store_url) == before


def test_a_missing_parent_entry_is_named(store: SQLConversationStore, store_url: str, history: list[ModelMessage]) -> None:
    run(store.append('t-gap', history, expected_revision=None))
    entry = _second_entry(store_url)
    sql(store_url, 'DELETE FROM durcap_entries WHERE entry_id = :e', {'e': entry})
    with pytest.raises(CorruptedRowError, match=f"entry '{entry}', the parent of entry .* \\(message 3\\), is missing"):
        run(store.read('t-gap'))


def test_errors_pickle_with_their_attributes() -> None:
    import pickle

    errors = [
        ConversationConflictError('c', expected=1, stored=2),
        ConversationNotFoundError('c'),
        CorruptedRowError('bad', conversation_id='c', table='durcap_entries', row='e', position=2),
        NewerHistoryError('newer', conversation_id='c', row='e', position=2, tag='hologram', written_by='x'),
        SchemaVersionError('v', found=9, supported=1),
        AppendIdReuseError('reused'),
    ]
    for error in errors:
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error) and str(copy) == str(error) and copy.__dict__ == error.__dict__


def test_an_unknown_conversation_is_a_distinct_error(store: SQLConversationStore) -> None:
    with pytest.raises(ConversationNotFoundError, match="conversation 'nobody' is not in the store") as raised:
        run(store.read('nobody'))
    assert raised.value.conversation_id == 'nobody' and isinstance(raised.value, LookupError)
    assert run(store.load('nobody')) is None  # upstream's contract
    run(store.append('t-scoped', [], expected_revision=None, scope='alice'))
    with pytest.raises(ConversationNotFoundError, match="with scope 'bob'"):
        run(store.read('t-scoped', scope='bob'))


def test_a_newer_schema_is_refused_and_left_alone(store_url: str) -> None:
    with SQLConversationStore(store_url) as first:
        run(first.append('t-v', [ModelRequest(parts=[UserPromptPart('x')])], expected_revision=None))
    sql(store_url, "INSERT INTO durcap_schema_version (version, applied_at, writer) VALUES (99, 'later', 'durable-capabilities 9')")
    before = snapshot(store_url)
    with SQLConversationStore(store_url) as second:
        with pytest.raises(SchemaVersionError, match='has schema version 99 \\(written by durable-capabilities 9\\)') as raised:
            run(second.read('t-v'))
        assert (raised.value.found, raised.value.supported) == (99, SCHEMA_VERSION)
        with pytest.raises(SchemaVersionError):
            run(second.append('t-v', [], expected_revision=1))
    assert snapshot(store_url) == before


def test_migrations_run_once_and_upgrade_in_place(store_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with SQLConversationStore(store_url) as first:
        run(first.append('t-m', [ModelRequest(parts=[UserPromptPart('x')])], expected_revision=None))
    with SQLConversationStore(store_url) as again:
        run(again.read('t-m'))
    shipped = sorted(store_module._MIGRATIONS)
    assert shipped == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 4: turn claims, 5: run event streams, 6: budgets, 7: durcap serve, 8: claim-check trees, 9: stops, 10: takeovers
    assert [row[0] for row in sql(store_url, 'SELECT version FROM durcap_schema_version')] == shipped

    # A later version: applied in place, once, the data kept.
    later = SCHEMA_VERSION + 1
    monkeypatch.setattr(store_module, 'SCHEMA_VERSION', later)
    monkeypatch.setitem(store_module._MIGRATIONS, later, ['CREATE INDEX durcap_writes_written ON durcap_writes (written_at)'])
    with SQLConversationStore(store_url) as upgraded:
        assert run(upgraded.read('t-m')).messages[0].parts[0].content == 'x'
    with SQLConversationStore(store_url) as reopened:
        run(reopened.read('t-m'))
    assert sorted(row[0] for row in sql(store_url, 'SELECT version FROM durcap_schema_version')) == [*shipped, later]


def test_bad_urls_and_missing_stores(tmp_path: Path) -> None:
    for url in ('', 'not a url', 'mysql://user@host/db', 'postgresql+psycopg2://x@y/z'):
        with pytest.raises(StoreURLError):
            SQLConversationStore(url)
    missing = tmp_path / 'nowhere' / 'conversations.db'
    reader = SQLConversationStore(f'sqlite:///{missing}', create=False)
    with pytest.raises(StoreUnavailableError, match='does not exist'):
        run(reader.read('x'))
    assert not missing.parent.exists()  # a reader leaves nothing behind
    writer = SQLConversationStore(f'sqlite:///{missing}')
    run(writer.append('x', [], expected_revision=None))
    assert missing.exists()
    unreachable = SQLConversationStore('postgresql://postgres@127.0.0.1:5432/durcap_no_such_database')
    with pytest.raises(StoreUnavailableError, match='durcap_no_such_database'):
        run(unreachable.read('x'))
    with pytest.raises(ValueError):
        run(writer.append('', [], expected_revision=None))


def test_default_url_is_under_dot_durcap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with SQLConversationStore() as default:
        assert DEFAULT_URL == 'sqlite:///.durcap/conversations.db'
        run(default.append('x', [], expected_revision=None))
    assert (tmp_path / '.durcap' / 'conversations.db').is_file()


# ---- what a history says: loaded ids, drift, aliases ---------------------------------------------


def test_loaded_ids_match_upstreams_own_rebuild(history: list[ModelMessage]) -> None:
    from pydantic_ai._deferred_capabilities import (
        parse_loaded_capabilities,  # the private rule we mirror
    )

    assert set(loaded_capability_ids(history)) == parse_loaded_capabilities(history)
    assert loaded_capability_ids(history[:2]) == [] == sorted(parse_loaded_capabilities(history[:2]))
    assert tools_called(history) == {'load_capability': 1, 'track_order': 1, 'final_result': 1}


def test_drift_same_definition_is_clean(history: list[ModelMessage]) -> None:
    assert drift(history, make_agent(Script())) == []


def test_drift_renamed_capability(history: list[ModelMessage]) -> None:
    renamed = make_agent(Script(), [orders_capability('orders-v2'), notes_capability()])
    problems = drift(history, renamed, conversation_id='t-1')
    assert [p.code for p in problems] == ['DC018']
    problem = problems[0]
    assert problem.severity == 'error' and problem.where == "conversation 't-1'"
    assert "loaded capability 'orders' (message 3)" in problem.message  # where its load returned
    assert "looks renamed to 'orders-v2'" in problem.message
    assert "aliases={'orders-v2': 'orders'}" in problem.fix and 'start a new conversation' in problem.fix
    assert drift(history, renamed, severity='warning')[0].severity == 'warning'


def test_drift_dropped_capability(history: list[ModelMessage]) -> None:
    dropped = make_agent(Script(), [notes_capability()])
    problems = drift(history, dropped, severity='warning')
    assert [p.code for p in problems] == ['DC018', 'DC019']
    assert all(p.severity == 'warning' for p in problems)
    assert 'looks removed' in problems[0].message
    assert "called tool 'track_order' (message 4, revealed by capability 'orders'" in problems[1].message
    assert "Keep a tool named 'track_order'" in problems[1].fix


def test_drift_unknown_tool_is_info_when_some_tools_are_only_known_at_run_time(history: list[ModelMessage]) -> None:
    called = [*history, ModelResponse(parts=[ToolCallPart('old_tool', {})])]
    static = drift(called, make_agent(Script()))
    assert [(p.code, p.severity) for p in static] == [('DC019', 'error')]
    assert f"called tool 'old_tool' (message {len(called)})" in static[0].message

    def search_tools(ctx: Any) -> Any:
        from pydantic_ai.toolsets import FunctionToolset

        return FunctionToolset([])

    dynamic = Capability(id='search', description='Search.', toolsets=[search_tools], defer_loading=True)
    unsure = drift(called, make_agent(Script(), [orders_capability(), notes_capability(), dynamic]))
    assert [(p.code, p.severity) for p in unsure] == [('DC019', 'info')]
    assert "the tools of 'search' are only known at run time" in unsure[0].message


def test_drift_with_an_alias_is_info_and_resume_keeps_the_capability(store: SQLConversationStore, history: list[ModelMessage]) -> None:
    run(store.append('t-alias', history, expected_revision=None))
    script = Script()
    aliased = make_agent(script, [orders_capability('orders-v2'), notes_capability()], aliases={'orders-v2': 'orders'})
    stored = run(store.read('t-alias'))
    problems = drift(stored.messages, aliased)
    assert [(p.code, p.severity) for p in problems] == [('DC018', 'info')]
    assert "now calls 'orders-v2'" in problems[0].message

    result = run(aliased.run('And order A-2?', message_history=stored.messages))
    assert 'track_order' in script.seen_tools[0]
    assert not any(isinstance(p, LoadCapabilityCallPart) for m in result.new_messages() for p in m.parts)

    # Without the alias the load is silently dropped on resume: only `load_capability` is visible.
    plain_script = Script()
    plain = make_agent(plain_script, [orders_capability('orders-v2'), notes_capability()])
    with pytest.raises(Exception):  # noqa: B017 - the scripted model then loads 'orders', which no longer exists
        run(plain.run('And order A-2?', message_history=stored.messages))
    assert plain_script.seen_tools[0] == ['load_capability']


# ---- durcap history show ------------------------------------------------------------------------


def _show(*args: str) -> subprocess.CompletedProcess[str]:
    code = 'from durable_capabilities.cli.history import history_app; history_app(prog_name="durcap history")'
    return python(code, *args, timeout=120)


def test_history_show_text_and_json(store: SQLConversationStore, store_url: str, history: list[ModelMessage]) -> None:
    run(store.append('t-show', history, expected_revision=None, append_id='wf-7/append'))
    from typer.testing import CliRunner

    from durable_capabilities.cli.history import history_app

    text = CliRunner().invoke(history_app, ['show', 't-show', '--store', store_url])
    assert text.exit_code == 0, text.output
    assert f'conversation t-show: revision 1, {len(history)} messages' in text.output
    assert 'loaded capabilities: orders' in text.output
    assert 'tools called: load_capability x1, track_order x1, final_result x1' in text.output
    assert 'usage (summed over responses): requests 3' in text.output
    assert 'r1 append append_id wf-7/append' in text.output
    assert 'tool-call track_order({"order_id": "A-1"})' in text.output

    shown = CliRunner().invoke(history_app, ['show', 't-show', '--store', store_url, '--format', 'json'])
    assert shown.exit_code == 0
    data = json.loads(shown.output)
    assert data['loaded_capabilities'] == ['orders'] and data['revision'] == 1
    assert data['tools_called'] == {'load_capability': 1, 'track_order': 1, 'final_result': 1}
    assert data['usage']['requests'] == 3 and data['usage']['input_tokens'] > 0
    assert ModelMessagesTypeAdapter.validate_python(data['messages']) == history


def test_history_show_unusable_input_exits_2_with_one_line(store_url: str, tmp_path: Path) -> None:
    with SQLConversationStore(store_url) as opened:
        run(opened.append('exists', [], expected_revision=None))
    cases = {
        ('show', 'nobody', '--store', store_url): "durcap: error: DC044 conversation 'nobody' is not in the store",
        ('show', 'x', '--store', 'mysql://h/db'): "durcap: error: DC040 store URL scheme 'mysql' is not supported",
        ('show', 'x', '--store', f'sqlite:///{tmp_path}/none.db'): 'durcap: error: DC040 no conversation store at',
    }
    for args, first_words in cases.items():
        result = _show(*args)
        assert result.returncode == 2, result.stderr
        assert result.stdout == ''
        assert result.stderr.startswith(first_words) and result.stderr.count('\n') == 1, result.stderr
        assert 'Traceback' not in result.stderr
    assert not (tmp_path / 'none.db').exists()


def test_loaded_ids_and_drift_count_only_the_window_after_a_compaction() -> None:
    """The one-pass scan (no `CompactionPart`: the whole history) and the compacted path (upstream's
    `post_compaction_window`, then a scan of it) agree with upstream's rule: loads and calls before the last
    compaction do not count, positions stay those of the whole history."""
    from pydantic_ai.messages import CapabilityLoadDeltaPart, CompactionPart, ToolCallPart

    from durable_capabilities import DurableAgent
    from durable_capabilities.store import drift, loaded_capability_ids

    def load(cid: str) -> ModelRequest:
        return ModelRequest(parts=[UserPromptPart('go'), CapabilityLoadDeltaPart(loaded=[cid])])

    def call(tool: str) -> ModelResponse:
        return ModelResponse(parts=[ToolCallPart(tool, {})])

    before = [load('gone-early'), call('vanished_early')]
    after = [load('gone-late'), call('vanished_late')]
    assert loaded_capability_ids([*before, *after]) == ['gone-early', 'gone-late']
    compacted = [*before, ModelResponse(parts=[TextPart('old'), CompactionPart(content='summary')]), *after]
    assert loaded_capability_ids(compacted) == ['gone-late']
    problems = drift(compacted, DurableAgent('window', 'test', engines=()), severity='error')
    assert [(p.code, p.message.split(' (message ')[1].split(')')[0]) for p in problems] == [('DC018', '4'), ('DC019', '5')]
    assert 'gone-late' in problems[0].message and 'vanished_late' in problems[1].message


# ---- the turn recorder: only where the message list can be rewritten -------------------------------------------


class _Compacting(Capability[Any]):
    """A capability with a hook that sees the message list (as upstream `ProcessHistory` has; `test_compaction`
    runs a real compaction on every engine). It leaves the list alone: what counts here is that it could change it."""

    async def before_model_request(self, ctx: Any, request_context: Any) -> Any:
        return request_context


def test_turn_recorder_only_where_a_hook_can_rewrite_the_messages_and_turns_stay_whole(store_url: str) -> None:
    """`TurnRecorder` (one more capability on every hook call) is built in only when a capability, wrapped or combined,
    has a hook that sees the message list, or `history_processors` are given. With and without it, two turns of a
    conversation (a local run, real store, scripted `FunctionModel`) store exactly every message of both runs."""
    from pydantic_ai.capabilities import CombinedCapability

    from durable_capabilities._turn_log import TurnRecorder

    def recorders(agent: DurableAgent[Any, Any]) -> int:
        return sum(isinstance(c, TurnRecorder) for c in agent.build('local').root_capability.capabilities)

    plain = make_agent(Script(), conversation_store=store_url)
    assert not plain.records_turn and recorders(plain) == 0
    compacting = make_agent(Script(), [orders_capability(), _Compacting(id='compact')], conversation_store=store_url)
    nested = make_agent(Script(), [CombinedCapability([orders_capability(), _Compacting(id='compact')])])
    processors = make_agent(Script(), history_processors=[lambda messages: messages])
    assert compacting.records_turn and nested.records_turn and processors.records_turn and recorders(compacting) == 1

    for agent, conversation in ((plain, 'c-plain'), (compacting, 'c-compact')):
        first = run(agent.run('Where is order A-1?', conversation_id=conversation))
        second = run(agent.run('And order A-2?', conversation_id=conversation))
        with SQLConversationStore(store_url) as opened:
            stored = run(opened.read(conversation)).messages
        assert stored == [*first.all_messages(), *second.new_messages()], conversation
        prompts = [p.content for m in stored for p in m.parts if isinstance(p, UserPromptPart)]
        assert prompts == ['Where is order A-1?', 'And order A-2?'], prompts
        assert sum(isinstance(p, ToolReturnPart) and p.tool_name == 'track_order' for m in stored for p in m.parts) == 2

    # History given without run ids (an older store, or messages built by hand) is history, not part of the turn.
    from dataclasses import replace

    from pydantic_ai.messages import ModelMessagesTypeAdapter

    from durable_capabilities.turn import run_turn

    unstamped = [replace(m, run_id=None) for m in run(plain.run('Where is order A-1?')).all_messages()]
    turn = run(run_turn(plain, plain.build('local').run, 'And order A-2?', message_history=unstamped))
    assert turn.new_messages == ModelMessagesTypeAdapter.dump_python(turn.result.new_messages(), mode='json')
    assert len(turn.new_messages) == 5 and turn.new_messages[0]["parts"][0]["content"] == "And order A-2?"
