"""`durcap store gc` against a real Temporal dev server, and its race safety on PostgreSQL (issue 24 item 2).

Model: the scripted `FunctionModel` of tests/engines/size_agent.py (no provider). Real servers: the session's Temporal
dev server (tests/engines/conftest.py), PostgreSQL on 127.0.0.1:5432 (a fresh database per test). Each turn runs in a
`size_driver` subprocess (an inline worker; client and worker use the claim-check codec on the test's store).

- Two conversations: A's workflow completed (closed, and past the short retention `--retention 1s` gives it: the
  dev server refuses a namespace retention under 1 h); B's workflow is left open (its worker killed while its second
  tool call runs). gc frees exactly A's unshared pieces and references, keeps B's and the pieces B shares with A, and
  B's history, exported from Temporal right after gc, replays against the code through the store.
- PostgreSQL, two connections: a gc that starts while a writer has recorded a reference (not committed yet) waits for
  it and keeps the piece; a writer that starts while gc's deleting transaction holds the references table waits for it
  and then writes the piece it deleted again.
- Every unit test of tests/unit/test_store_gc.py that takes `store_url`, on PostgreSQL (`REUSES_STORE_TESTS`).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from durable_capabilities.collecting import collect_garbage
from durable_capabilities.engines import RunState, RunStates
from durable_capabilities.settings import Settings
from durable_capabilities.store import SQLConversationStore
from tests._helpers import durcap, postgres_database, sqlite_url, subprocess_env, wait_for, wait_for_line
from tests.unit.test_store_gc import *  # noqa: F403
from tests.unit.test_store_gc import codec_converter, decodes, everything, history, needed

REUSES_STORE_TESTS = True
pytestmark = [pytest.mark.slow]


def driver(conversation: str, prompt: str, workflow_id: str, *, store: str, address: str, cwd: Path,
           env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], Path]:
    """A `size_driver` turn on Temporal in its own process group (the caller stops it by pid); its log file."""
    log = cwd / f'{workflow_id}.log'
    args = [sys.executable, '-m', 'tests.engines.size_driver', 'temporal', '--conversation', conversation, '--prompt', prompt,
            '--address', address, '--workflow-id', workflow_id]
    with open(log, 'wb') as handle:
        popen = subprocess.Popen(args, cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                 env=subprocess_env({'DURCAP_STORE': store, **(env or {})}))
    return popen, log


def stop(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is None:
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait(timeout=30)


def refs_of(url: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for digest, owner, _ in everything(url)['durcap_payload_refs']:
        found.setdefault(owner, set()).add(digest)
    return found


def terminate(address: str, workflow_id: str) -> None:
    from durable_capabilities.engines.temporal import connect

    async def go() -> None:
        client = await connect(address)
        try:
            await client.get_workflow_handle(workflow_id).terminate(reason='test_store_gc cleanup')
        except Exception:  # noqa: BLE001, S110 - already closed
            pass

    asyncio.run(go())


def test_gc_on_temporal_frees_only_the_closed_runs_unshared_data_and_the_open_run_replays(
        temporal_address: str, tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    tag = uuid.uuid4().hex[:8]
    wf_a, wf_b = f'gc-a-{tag}', f'gc-b-{tag}'
    closed, log_a = driver(f'gc-conv-a-{tag}', 'tool 300000', wf_a, store=store, address=temporal_address, cwd=tmp_path)
    try:
        closed.wait(timeout=300)
    finally:
        stop(closed)
    assert 'REPORT ' in log_a.read_text(), log_a.read_text()[-3000:]
    ledger = tmp_path / 'ledger-b'
    held, log_b = driver(f'gc-conv-b-{tag}', 'tools 2 300000', wf_b, store=store, address=temporal_address, cwd=tmp_path,
                         env={'DURCAP_LEDGER': str(ledger), 'DURCAP_TOOL_HOLD_AFTER': '1'})
    try:
        # The second call runs (its ledger line written): the first 300 kB result and the model request that carried
        # it are claim checks of B. Killing the worker there leaves B open on Temporal.
        wait_for(lambda: ledger.exists() and len(ledger.read_text().splitlines()) == 2, 240,
                 message=lambda: log_b.read_text(errors='replace')[-3000:])
    finally:
        stop(held)
    try:
        owners = needed(everything(store))  # every row each run needs: its references' and the pages and pieces under them
        a, b = owners[wf_a], owners[wf_b]
        a_refs = len(refs_of(store)[wf_a])
        shared = a & b
        assert len(a - b) > 0 and len(b - a) > 0, owners
        assert shared, 'the identical 300 kB tool result is one piece both runs refer to'
        sizes = {row[0]: row[1] for row in everything(store)['durcap_payloads']}

        args = ('store', 'gc', '--store', store, '--address', temporal_address, '--retention', '1s', '--grace', '0s',
                '--format', 'json')
        before = everything(store)
        plan = durcap(*args, timeout=120)
        assert plan.returncode == 0, plan.stderr
        assert everything(store) == before  # a dry run
        data = json.loads(plan.stdout)
        assert [o['owner'] for o in data['owners']] == [wf_a], data
        assert data['owners'][0]['conversations'] == [f'gc-conv-a-{tag}']
        assert data['freed'] == {'refs': a_refs, 'payloads': len(a - b), 'payload_bytes': sum(sizes[d] for d in a - b)}
        assert data['kept_shared']['payloads'] == len(shared) and data['kept_owners'] == {'open': 1}
        assert data['owners'][0]['reason'].startswith('closed ') and 'temporal' in data['engines']

        done = durcap(*args, '--apply', timeout=120)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)['freed'] == data['freed']
        left = {row[0] for row in everything(store)['durcap_payloads']}
        assert not (a - b) & left and b <= left  # A's own gone; B's, the shared pieces among them, all kept
        assert refs_of(store).get(wf_a) is None and needed(everything(store))[wf_b] == b

        # Right after gc: B's history, as Temporal holds it, replays against the code through the store.
        exported = tmp_path / 'b.json'
        got = durcap('history', 'export', '--workflow-id', wf_b, '-o', str(exported), '--address', temporal_address,
                     env={'DURCAP_STORE': store}, timeout=120)
        assert got.returncode == 0, got.stderr
        replayed = durcap('replay', str(exported), '--target', 'tests.engines.size_agent:agent', '--store', store,
                          timeout=180)
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        assert '1 of 1 histories replay' in replayed.stderr
    finally:
        terminate(temporal_address, wf_b)


def test_gc_of_the_real_namespace_retention_keeps_a_run_that_just_closed(temporal_address: str, tmp_path: Path) -> None:
    """Without --retention, gc reads the namespace's retention (DescribeNamespace: the dev server's is at least 1 h), so
    a workflow that closed a moment ago keeps its claim checks; the text report says which retention it used."""
    store = sqlite_url(tmp_path)
    wf = f'gc-r-{uuid.uuid4().hex[:8]}'
    popen, log = driver(f'gc-conv-r-{wf}', 'tool 300000', wf, store=store, address=temporal_address, cwd=tmp_path)
    try:
        popen.wait(timeout=300)
    finally:
        stop(popen)
    assert 'REPORT ' in log.read_text(), log.read_text()[-3000:]
    before = everything(store)
    done = durcap('store', 'gc', '--store', store, '--address', temporal_address, '--grace', '0s', '--apply', timeout=120)
    assert done.returncode == 0, done.stderr
    assert everything(store) == before
    first = done.stdout.splitlines()[0]
    assert first.startswith('store gc (applied; temporal retention ') and 'freed 0 piece(s)' in first, done.stdout
    assert 'kept 1 workflow(s): closed within the retention period' in done.stdout


# ---- race safety on PostgreSQL: two connections ------------------------------------------------------


def _waiting_on_refs(url: str) -> bool:
    """Some session waits for a lock on durcap_payload_refs (read from pg_locks on a third connection)."""
    engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://'))
    try:
        with engine.connect() as conn:
            return bool(conn.execute(sa.text(
                "SELECT COUNT(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                "WHERE c.relname = 'durcap_payload_refs' AND NOT l.granted")).scalar())
    finally:
        engine.dispose()


def _gone_answer(now: datetime) -> list[RunStates]:
    return [RunStates('temporal', 'given', timedelta(hours=1), {'wf-old': RunState('wf-old', False, now - timedelta(hours=2))})]


def test_postgresql_gc_waits_for_a_writer_that_recorded_a_reference_and_keeps_the_piece() -> None:
    with postgres_database('durcap_gc_race') as url:
        references = asyncio.run(codec_converter(url, 'wf-old').encode([history(3, 'OLD')]))
        snapshot = everything(url)
        pieces = needed(snapshot)['wf-old']  # its tree: the root its reference names, the pages and pieces under it
        piece = sorted(row[0] for row in snapshot['durcap_payloads'] if row[0] in pieces and row[-1] in (0, 3))[0]
        engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://'))
        writer = engine.connect()
        result: dict[str, Any] = {}
        try:
            # A writer (another run, whose payload holds the same piece) has recorded its reference and, having seen the
            # piece stored, will not write it again; it has not committed yet.
            tx = writer.begin()
            writer.execute(sa.text("INSERT INTO durcap_payload_refs (sha256, owner, created_at) VALUES (:d, 'wf-new', :at)"),
                           {'d': piece, 'at': datetime.now(UTC).isoformat(timespec='microseconds')})
            now = datetime.now(UTC)

            def collect() -> None:
                result['found'] = asyncio.run(collect_garbage(url, answers=_gone_answer(now), apply=True,
                                                              grace=timedelta(0), now=now, settings=Settings.resolve()))

            thread = threading.Thread(target=collect)
            thread.start()
            wait_for(lambda: _waiting_on_refs(url), 60, message='gc waiting for the writer')
            assert 'found' not in result  # gc is held by the writer's uncommitted reference
            tx.commit()
            thread.join(timeout=60)
        finally:
            writer.close()
            engine.dispose()
        found = result['found']
        left = {row[0] for row in everything(url)['durcap_payloads']}
        assert piece in left and found.report.shared_payloads == 1  # the writer's reference keeps it
        assert not (pieces - {piece}) & left and found.report.payloads == len(pieces) - 1
        assert refs_of(url) == {'wf-new': {piece}}
        assert references


def test_postgresql_a_writer_during_gcs_delete_waits_and_writes_the_deleted_piece_again() -> None:
    with postgres_database('durcap_gc_race') as url:
        data = b'PIECE ' * 1000
        import hashlib

        digest = hashlib.sha256(data).hexdigest()
        with SQLConversationStore(url) as store:
            store._sql.put_payloads([(digest, data)], 'wf-old')
        engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://'))
        gc_conn = engine.connect()
        done: dict[str, Any] = {}
        try:
            # gc's deleting transaction (`_SQLBackend.collect`'s statements, held open here): the table held, wf-old's
            # references and its now unreferenced piece deleted, not committed yet.
            tx = gc_conn.begin()
            gc_conn.execute(sa.text('LOCK TABLE durcap_payload_refs IN SHARE ROW EXCLUSIVE MODE'))
            gc_conn.execute(sa.text("DELETE FROM durcap_payload_refs WHERE owner = 'wf-old'"))
            gc_conn.execute(sa.text('DELETE FROM durcap_payloads WHERE sha256 = :d AND NOT EXISTS (SELECT 1 FROM '
                                    'durcap_payload_refs r WHERE r.sha256 = durcap_payloads.sha256)'), {'d': digest})
            writer_store = SQLConversationStore(url)

            def write() -> None:  # the real writer: another run stores a payload holding the same piece
                done['written'] = writer_store._sql.put_payloads([(digest, data)], 'wf-new')

            thread = threading.Thread(target=write)
            thread.start()
            wait_for(lambda: _waiting_on_refs(url), 60, message='the writer waiting for gc')
            assert 'written' not in done
            tx.commit()
            thread.join(timeout=60)
            writer_store.close()
        finally:
            gc_conn.close()
            engine.dispose()
        # The writer looked for the piece after gc committed: it wrote it again, so its reference resolves.
        assert done['written'] == len(data)
        with SQLConversationStore(url) as store:
            assert store._sql.get_payload(digest) == data
        assert refs_of(url) == {'wf-new': {digest}}


def test_postgresql_gc_decodes_what_it_kept(store_url: str) -> None:
    """After a gc on PostgreSQL, the open run's references (read back through the codec) still decode."""
    refs = asyncio.run(codec_converter(store_url, 'wf-live').encode([history(4, 'LIVE')]))
    asyncio.run(codec_converter(store_url, 'wf-old').encode([history(4, 'OLD')]))
    now = datetime.now(UTC)
    asyncio.run(collect_garbage(store_url, answers=[*_gone_answer(now), RunStates('x', 'y', timedelta(hours=1), {'wf-live': RunState('wf-live', True)})], apply=True, grace=timedelta(0), now=now, settings=Settings.resolve()))
    assert decodes(store_url, 'wf-live', refs) == [history(4, 'LIVE')]
    assert set(refs_of(store_url)) == {'wf-live'}



def test_a_worker_with_gc_every_frees_a_closed_runs_claim_checks_on_schedule(temporal_address: str, tmp_path: Path) -> None:
    """`durcap worker temporal ... --gc-every 1s --gc-apply` (with a 1 s retention, no grace): a pass logs what it
    freed, and the closed workflow's claim checks are gone from the store while the worker keeps serving."""
    store = sqlite_url(tmp_path)
    wf = f'gc-w-{uuid.uuid4().hex[:8]}'
    popen, log = driver(f'gc-conv-w-{wf}', 'tool 300000', wf, store=store, address=temporal_address, cwd=tmp_path)
    try:
        popen.wait(timeout=300)
    finally:
        stop(popen)
    assert 'REPORT ' in log.read_text(), log.read_text()[-3000:]
    own = refs_of(store)[wf]
    assert own
    worker_log = tmp_path / 'worker.log'
    with open(worker_log, 'wb') as handle:
        worker = subprocess.Popen(
            [sys.executable, '-m', 'durable_capabilities.cli', 'worker', 'temporal', 'tests.engines.size_agent:agent',
             '--address', temporal_address, '--store', store, '--task-queue', f'gc-{wf}', '--gc-every', '1s', '--gc-apply',
             '--gc-retention', '1s', '--gc-grace', '0s'],
            cwd=tmp_path, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=subprocess_env())
    try:
        line = wait_for_line(worker_log, 'store gc: freed ', 180, alive=lambda: worker.poll() is None)
        assert not line.startswith('store gc: freed 0 piece(s)') and 'of 1 workflow(s)' in line, line
        assert refs_of(store).get(wf) is None
        text = worker_log.read_text(errors='replace')
        assert f'store gc every 1s on {store} (deleting)' in text and 'Traceback' not in text
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)
