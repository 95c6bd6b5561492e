"""Integrity on read (issue 10 item 5): a `durcap_conversations` row that disagrees with its entries or its
write log is a `CorruptedRowError` naming the conversation on the next read and before any append; nothing
is written past the end. Also the claim-check table and the writability probe. Real SQLite files and real
PostgreSQL databases (the `store_url` fixture of tests/conftest.py; PostgreSQL in
tests/engines/test_stores_on_postgresql.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart

from durable_capabilities.store import (
    CorruptedRowError,
    SQLConversationStore,
    StoreReadOnlyError,
    StoreUnavailableError,
)
from tests._helpers import snapshot, sql
from tests.unit.test_store import run

TURN = [ModelRequest(parts=[UserPromptPart('hi')]), ModelResponse(parts=[TextPart('hello')])]


def _two_turns(opened: SQLConversationStore, cid: str) -> None:
    first = run(opened.append(cid, TURN, expected_revision=None))
    run(opened.append(cid, TURN, expected_revision=first.revision))


@pytest.mark.parametrize(
    ('edit', 'says'),
    [
        ("UPDATE durcap_conversations SET message_count = 7 WHERE conversation_id = 'c'",
         "says 7 message(s) but its head entry"),
        ("UPDATE durcap_conversations SET message_count = 3 WHERE conversation_id = 'c'",
         "says 3 message(s) but its head entry"),
        ("UPDATE durcap_conversations SET revision = 9 WHERE conversation_id = 'c'",
         'is at revision 9 but its write log ends at revision 2'),
        ("UPDATE durcap_conversations SET head_id = 'nowhere' WHERE conversation_id = 'c'",
         "names head entry 'nowhere', which is not in durcap_entries"),
        ("UPDATE durcap_conversations SET head_id = NULL WHERE conversation_id = 'c'",
         'says 4 message(s) but has no head entry'),
    ],
    ids=['count-up', 'count-down', 'revision', 'head-missing', 'head-null'],
)
def test_a_header_that_disagrees_with_its_rows_is_refused(store: SQLConversationStore, store_url: str, edit: str, says: str) -> None:
    _two_turns(store, 'c')
    sql(store_url, edit)
    before = snapshot(store_url)
    with pytest.raises(CorruptedRowError, match=re.escape(f"conversation 'c': its durcap_conversations row {says}")) as raised:
        run(store.read('c'))
    assert (raised.value.conversation_id, raised.value.table, raised.value.row) == ('c', 'durcap_conversations', 'c')
    revision = int(sql(store_url, "SELECT revision FROM durcap_conversations WHERE conversation_id = 'c'")[0][0])
    with pytest.raises(CorruptedRowError, match="conversation 'c'"):
        run(store.append('c', TURN, expected_revision=revision))
    with pytest.raises(CorruptedRowError, match="conversation 'c'"):
        run(store.read_record('c'))  # upstream's load starts here
    assert snapshot(store_url) == before  # nothing written past the end, nothing rewritten


def test_a_damaged_conversation_of_another_scope_reads_as_not_found(store: SQLConversationStore, store_url: str) -> None:
    """A reader of scope `b` learns nothing about a conversation of scope `a`, damaged or not: the header check runs in
    the same statement as the row (`_checked_row`), but only for the scope asked."""
    from durable_capabilities.store import ConversationNotFoundError

    run(store.append('c', TURN, expected_revision=None, scope='a'))
    sql(store_url, "UPDATE durcap_conversations SET message_count = 7 WHERE conversation_id = 'c'")
    with pytest.raises(ConversationNotFoundError, match="with scope 'b'"):
        run(store.read('c', scope='b'))
    with pytest.raises(CorruptedRowError, match="says 7 message"):
        run(store.read('c', scope='a'))


def test_a_header_missing_a_write_log_row_is_refused(store: SQLConversationStore, store_url: str) -> None:
    _two_turns(store, 'c')
    sql(store_url, "DELETE FROM durcap_writes WHERE conversation_id = 'c' AND revision = 2")
    with pytest.raises(CorruptedRowError, match='is at revision 2 but its write log ends at revision 1'):
        run(store.append('c', TURN, expected_revision=2))
    assert sql(store_url, "SELECT COUNT(*) FROM durcap_entries WHERE conversation_id = 'c'")[0][0] == 4


def test_a_consistent_conversation_still_reads_and_appends(store: SQLConversationStore) -> None:
    _two_turns(store, 'c')
    stored = run(store.read('c'))
    assert (stored.message_count, stored.revision) == (4, 2)
    assert run(store.read('c', limit=1)).first_position == 4
    assert run(store.append('c', TURN, expected_revision=2)).message_count == 6


def test_claim_check_rows_are_content_addressed_and_idempotent(store: SQLConversationStore, store_url: str) -> None:
    backend = store._sql
    backend.put_payload('ab' * 32, b'\x00big\xff' * 1000)
    backend.put_payload('ab' * 32, b'\x00big\xff' * 1000)  # a retried encode
    assert backend.get_payload('ab' * 32) == b'\x00big\xff' * 1000
    assert backend.get_payload('cd' * 32) is None
    assert sql(store_url, 'SELECT COUNT(*), MAX(size) FROM durcap_payloads')[0] == (1, 5000)


def test_writability_probe(tmp_path: Path, store_url: str) -> None:
    with SQLConversationStore(store_url) as writable:
        writable._sql.probe_writable()
    unreachable = SQLConversationStore('postgresql://postgres@127.0.0.1:1/none')
    with pytest.raises(StoreUnavailableError, match=re.escape('127.0.0.1:1')):
        unreachable._sql.probe_writable()
    # A SQLite file the process can only read: opened read-only (chmod does not stop root, which runs the tests).
    import sqlite3

    import sqlalchemy as sa

    from durable_capabilities.store import _sql as _store_sql

    path = tmp_path / 'ro.db'
    with SQLConversationStore(f'sqlite:///{path}') as made:
        run(made.append('c', TURN, expected_revision=None))
    wal = path.with_name(path.name + '-wal')

    def files() -> tuple[bytes, bytes]:
        return path.read_bytes(), wal.read_bytes() if wal.exists() else b''

    before = files()
    read_only = SQLConversationStore(f'sqlite:///{path}')
    read_only._sql.engine = sa.create_engine(
        'sqlite://', creator=lambda: sqlite3.connect(f'file:{path}?mode=ro', uri=True, check_same_thread=False)
    )
    sa.event.listen(read_only._sql.engine, 'connect', _store_sql._sqlite_connect)
    sa.event.listen(read_only._sql.engine, 'begin', _store_sql._sqlite_begin)
    assert run(read_only.read('c')).message_count == 2  # it reads
    with pytest.raises(StoreReadOnlyError, match='is read-only'):
        run(read_only.check_writable())
    read_only.close()
    with SQLConversationStore(f'sqlite:///{path}') as writable:
        run(writable.check_writable())
        assert files() == before  # the probe's write was rolled back: nothing reached the file or its WAL


def test_the_store_a_worker_keeps_open_follows_a_replaced_or_deleted_sqlite_file(tmp_path: Path) -> None:
    """`conversations.process_store` keeps one store per URL for the process's life (load and append units run
    on every turn). A SQLite file restored from a backup (replaced) or deleted under it must be used as the new
    file, never written through a pooled connection to the old one (whose writes would be lost)."""
    import os

    from durable_capabilities.conversations import process_store

    path = tmp_path / 'kept.db'
    url = f'sqlite:///{path}'
    kept = process_store(url)
    assert process_store(url) is kept
    run(kept.append('a', TURN, expected_revision=None))
    # A backup holding another conversation replaces the file (os.replace, as a restore does).
    backup = tmp_path / 'backup.db'
    with SQLConversationStore(f'sqlite:///{backup}') as other:
        run(other.append('b', TURN, expected_revision=None))
    os.replace(backup, path)
    for suffix in ('-wal', '-shm'):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    assert run(kept.read('b')).message_count == 2
    run(kept.append('b', TURN, expected_revision=run(kept.read('b')).revision))
    with SQLConversationStore(url) as fresh:  # the write reached the restored file
        assert run(fresh.read('b')).message_count == 4
        assert [r.conversation_id for r in run(fresh.read_records())] == ['b']
    # Deleted: the next use creates a new, empty store there, as a first use would.
    kept.close()
    for suffix in ('', '-wal', '-shm'):
        path.with_name(path.name + suffix).unlink(missing_ok=True)
    run(kept.append('c', TURN, expected_revision=None))
    with SQLConversationStore(url) as fresh:
        assert [r.conversation_id for r in run(fresh.read_records())] == ['c']
