"""`SQLConversationStore.purge` (`durcap history delete`) and `stats` (`durcap store stats`) on real SQLite files and
real PostgreSQL databases (127.0.0.1:5432, a uniquely named database created and dropped by the fixture).

The table test: two conversations whose Temporal runs stored claim checks (through the real codec, with
Temporal's serialization context naming the workflow), one claim check shared by both, one written before the
store recorded owners. After deleting the first, every table of the schema is read whole: nothing of the deleted
conversation is left, every row of the other is as it was, and the other still loads and decodes.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart
from temporalio.converter import DataConverter, WorkflowSerializationContext

from durable_capabilities.engines import run_of, specs
from durable_capabilities.engines.temporal._payloads import ClaimCheckCodec
from durable_capabilities.forgetting import engine_records
from durable_capabilities.store import (
    ConversationHasForksError,
    ConversationNotFoundError,
    SQLConversationStore,
)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def everything(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table in the store's database, as text-searchable tuples (bytes kept as bytes)."""
    engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://'))
    try:
        with engine.connect() as conn:
            tables = sa.inspect(conn).get_table_names()
            return {t: sorted((tuple(bytes(v) if isinstance(v, memoryview) else v for v in row)
                               for row in conn.execute(sa.text(f'SELECT * FROM {t}')).all()), key=repr)
                    for t in tables}
    finally:
        engine.dispose()


def needed(snapshot: dict[str, list[tuple[Any, ...]]]) -> dict[str, set[str]]:
    """`{owner: every durcap_payloads digest it needs}` from a snapshot (`everything`): the rows its references name and,
    under a tree's root (schema 8: `kind` 1 a leaf page of depth-byte + digest entries, 2 a page of page digests), every
    page and piece. Read here from the rows, independently of the store's own walk."""
    pages = {row[0]: (row[-1], row[2]) for row in snapshot['durcap_payloads'] if row[-1] in (1, 2)}

    def under(digest: str) -> set[str]:
        found = {digest}
        if digest in pages:
            kind, data = pages[digest]
            width = 33 if kind == 1 else 32
            for i in range(0, len(data), width):
                found |= under(data[i + width - 32:i + width].hex())
        return found

    result: dict[str, set[str]] = {}
    for digest, owner, _ in snapshot['durcap_payload_refs']:
        result.setdefault(owner, set()).update(under(digest))
    return result


def mentions(row: tuple[Any, ...], markers: list[str]) -> bool:
    text = ' '.join(v.decode('utf-8', 'replace') if isinstance(v, bytes) else str(v) for v in row)
    return any(marker in text for marker in markers)


def turn(prompt: str, answer: str) -> list[Any]:
    return [ModelRequest(parts=[UserPromptPart(prompt)]), ModelResponse(parts=[TextPart(answer)])]


async def claim_checks(url: str, workflow_id: str | None, *values: str) -> list[Any]:
    """Encode `values` through the real claim-check codec, as Temporal does for workflow `workflow_id`."""
    converter = DataConverter(payload_codec=ClaimCheckCodec(url, threshold=1000))
    if workflow_id is not None:
        converter = converter.with_context(WorkflowSerializationContext(namespace='default', workflow_id=workflow_id))
    return await converter.encode(list(values))


def test_delete_leaves_nothing_of_the_conversation_and_touches_nothing_of_the_other(store_url: str) -> None:
    shared = 'SHARED-TOOL-RESULT ' * 200
    alpha_only, beta_only = 'ALPHA-SECRET ' * 200, 'BETA-PAYLOAD ' * 200
    legacy = 'LEGACY-UNOWNED ' * 200

    async def setup() -> list[Any]:
        with SQLConversationStore(store_url) as store:
            first = await store.append('conv-alpha', turn('ALPHA-PROMPT', 'alpha answer'), expected_revision=None,
                                       append_id='wf-alpha-1:run-1')
            await store.append('conv-alpha', turn('ALPHA-PROMPT-2', 'again'), expected_revision=first.revision,
                               append_id='wf-alpha-2:run-1')
            await store.append('conv-beta', turn('BETA-PROMPT', 'beta answer'), expected_revision=None,
                               append_id='wf-beta-1:run-9')
        await claim_checks(store_url, 'wf-alpha-1', alpha_only, shared)
        await claim_checks(store_url, 'wf-alpha-2', alpha_only)
        references = await claim_checks(store_url, 'wf-beta-1', shared, beta_only)
        await claim_checks(store_url, None, legacy)  # no context: an owner the store does not know
        return references

    beta_references = run(setup())
    before = everything(store_url)
    # One reference per claim check (its tree's root: the second alpha-only one is the same tree); each string is a
    # piece of its own under a leaf page, with the payload's head and the quotes around it as pieces shared widely.
    assert len(before['durcap_payload_refs']) == 5
    needs = needed(before)
    alpha_needs, beta_needs = needs['wf-alpha-1'] | needs['wf-alpha-2'], needs['wf-beta-1']
    own, shared_rows = alpha_needs - beta_needs, alpha_needs & beta_needs
    assert len(own) == 2  # ALPHA-SECRET's piece and its leaf page
    assert [r for r in before['durcap_payloads'] if r[0] in own and mentions(r, ['ALPHA-SECRET'])] or all(
        r[-1] == 3 for r in before['durcap_payloads'] if r[0] in own and r[-1] != 1)  # stored compressed

    with SQLConversationStore(store_url) as store:
        stats = run(store.stats())
        plan = run(store.purge('conv-alpha', dry_run=True))
    assert everything(store_url) == before  # a dry run changes nothing
    by_id = {c.conversation_id: c for c in stats.conversations}
    assert (by_id['conv-alpha'].payloads, by_id['conv-alpha'].shared_payloads) == (len(own), len(shared_rows))
    assert (by_id['conv-beta'].payloads, by_id['conv-beta'].shared_payloads) == (len(beta_needs - alpha_needs), len(shared_rows))
    assert by_id['conv-alpha'].message_count == 4 and by_id['conv-alpha'].message_bytes > 0
    assert stats.payloads == len(before['durcap_payloads']) and stats.unattributed_payload_bytes > 0
    assert plan.rows == {'durcap_conversations': 1, 'durcap_entries': 4, 'durcap_writes': 2,
                         'durcap_payload_refs': 3, 'durcap_payloads': len(own)}
    assert plan.appends == ['wf-alpha-1:run-1', 'wf-alpha-2:run-1']
    assert [(r.engine, r.run_id) for r in engine_records(plan)] == [('temporal', 'wf-alpha-1'), ('temporal', 'wf-alpha-2')]
    assert plan.shared_payloads == len(shared_rows) and plan.payload_bytes > 0

    with SQLConversationStore(store_url) as store:
        done = run(store.purge('conv-alpha'))
    assert done.rows == plan.rows and not done.dry_run

    after = everything(store_url)
    alpha = ['conv-alpha', 'wf-alpha', 'ALPHA-']
    alpha_rows = {t: [r for r in rows if mentions(r, alpha)] for t, rows in before.items()}
    assert set(after) == set(before)  # every table of the schema read
    for table, rows in after.items():
        if table == 'durcap_payloads':
            continue  # pieces may be stored compressed and pages are digests: checked by digest below
        assert not [r for r in rows if mentions(r, alpha)], table  # nothing of the deleted one
        assert rows == [r for r in before[table] if r not in alpha_rows[table]], table  # nothing else touched
    assert {r[0] for r in after['durcap_payloads']} == {r[0] for r in before['durcap_payloads']} - own  # alpha's own only

    with SQLConversationStore(store_url) as store:
        beta = run(store.read('conv-beta'))
        assert beta.messages[0].parts[0].content == 'BETA-PROMPT' and beta.revision == 1
        with pytest.raises(ConversationNotFoundError):
            run(store.read('conv-alpha'))
        with pytest.raises(ConversationNotFoundError):
            run(store.purge('conv-alpha'))
        again = run(store.append('conv-alpha', turn('new', 'life'), expected_revision=None))
        assert again.revision == 1  # the id starts over: nothing of the old one is left
    converter = DataConverter(payload_codec=ClaimCheckCodec(store_url, threshold=1000))
    assert run(converter.decode(beta_references, [str, str])) == [shared, beta_only]


def test_a_conversation_others_were_forked_from_is_not_deleted(store_url: str) -> None:
    async def go() -> None:
        with SQLConversationStore(store_url) as store:
            await store.append('origin', turn('a', 'b'), expected_revision=None)
            result = await store.load('origin')
            await store.fork(result.conversation_id if hasattr(result, 'conversation_id') else 'origin',
                             new_conversation_id='child')
            with pytest.raises(ConversationHasForksError, match="'child'") as raised:
                await store.purge('origin')
            assert raised.value.code == 'conversation-has-forks' and raised.value.forks == ['child']
            assert len((await store.read('origin')).messages) == 2  # nothing deleted
            await store.purge('child')
            await store.purge('origin')

    run(go())


def test_run_of_reads_each_engines_append_id() -> None:
    """Which engine run wrote an append, from the engines' specs (`append_prefix`, `run_of_append`)."""
    def read(append_id: str) -> tuple[str, str] | None:
        found = run_of(specs(), append_id)
        return None if found is None else (found[0].name, found[1])

    assert read('support-1b2c:0f3e-run') == ('temporal', 'support-1b2c')
    assert read('a:b:c') == ('temporal', 'a:b')
    assert read('wf-1:5e7c:continue-as-new') == ('temporal', 'wf-1')  # the part stored before continue-as-new
    assert read('dbos:wf-1') == ('dbos', 'wf-1')
    assert read('prefect:7d1e') == ('prefect', '7d1e')
    assert read('local:123') == ('local', '123')  # claimed by local, which engine_records skips (not durable)
    assert read('plain') is None


def test_creating_a_store_file_says_where(tmp_path: Path) -> None:
    import durable_capabilities.store as store_module

    heard: list[str] = []
    store_module.on_create(heard.append)
    try:
        url = f'sqlite:///{tmp_path}/deep/conversations.db'
        with SQLConversationStore(url) as store:
            run(store.append('c', turn('x', 'y'), expected_revision=None))
        with SQLConversationStore(url) as store:
            run(store.read('c'))
            assert store.location == str((tmp_path / 'deep' / 'conversations.db').resolve())
    finally:
        store_module.on_create(None)
    assert heard == [str((tmp_path / 'deep' / 'conversations.db').resolve())]  # once, when created


def test_the_ui_conversation_page_shows_its_bytes(tmp_path: Path) -> None:
    from starlette.testclient import TestClient

    from durable_capabilities.settings import Settings
    from durable_capabilities.ui import create_app

    url = f'sqlite:///{tmp_path}/c.db'
    with SQLConversationStore(url) as store:
        run(store.append('page-c', turn('hello there', 'hi'), expected_revision=None, append_id='wf-page:r'))
    run(claim_checks(url, 'wf-page', ''.join(hashlib.sha256(b'%d' % i).hexdigest() for i in range(160))))  # 10 KB of hex
    expected = run(SQLConversationStore(url).conversation_stats('page-c'))
    app = create_app(Settings.resolve(db=f'sqlite:///{tmp_path}/dbos.sqlite', store=url), 'tok', engines=['dbos'])
    page = TestClient(app).get('/conversations/page-c')
    assert page.status_code == 200, page.text[-1500:]
    assert (f'stored: messages {expected.message_bytes:,} bytes, claim checks of its own {expected.payload_bytes:,} bytes, '
            'shared with other conversations 0 bytes') in page.text
    assert expected.payload_bytes > 5000

