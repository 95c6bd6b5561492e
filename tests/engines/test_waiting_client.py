"""A waiting `durcap run` whose only worker dies mid-run says so, keeps waiting, and prints the answer once a new
worker finishes the run (`engines/_stall.py`).

Real parts: a Temporal dev server (the shared one) and a DBOS SQLite system database; the worker is a real
subprocess (`tests.engines.drive temporal worker`, `durcap worker dbos`) SIGKILLed inside the crash agent's
`slow_export` tool; the client is `durcap run` in its own subprocess. Model: the crash agent's scripted
`FunctionModel` (tests/engines/crash_agent.py). `$DURCAP_WAIT_NOTICE=2` makes the notice's interval 2 s (default 30).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from tests._helpers import subprocess_env, wait_for_file
from tests.engines.test_crash import assert_exactly_once, crash_env
from tests.engines.test_runs import CRASH, kill9, start, wait_text

pytestmark = pytest.mark.slow

NOTICE = 2.0
"""`$DURCAP_WAIT_NOTICE` of the clients here (seconds)."""

SLACK = 8.0
"""Seconds allowed on top of the engine's own notice of the dead worker and `NOTICE`: a loaded 2-core machine."""


def notice_lines(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith('still waiting:')]


def assert_answered_once(log: Path, crash_dir: Path) -> None:
    """How a waiting client's run ends once a new worker finished it: the client printed the answer, said it was
    waiting exactly once (one stall, one notice), and each side effect of the crash agent ran once."""
    text = log.read_text()
    assert 'charged and exported' in text, text
    assert len(notice_lines(log)) == 1, text
    assert_exactly_once(crash_dir)


def test_temporal_client_says_no_worker_picked_up_the_run_then_prints_the_answer(temporal_address: str, spawn,
                                                                                   tmp_path: Path) -> None:
    """The worker is SIGKILLed inside `slow_export`; within the tool's heartbeat timeout (1 s) plus the notice's 2 s
    (plus slack) the client says, once, that no worker has picked up the run on its task queue (the activity is
    SCHEDULED again and the history does not grow; the dead worker may still be listed as a poller). A new worker
    finishes the run: the client prints the answer and exits 0; the charge ran once. Before, the client waited in
    silence."""
    env, crash_dir = crash_env(tmp_path)
    queue = f'waiting-{uuid.uuid4().hex[:8]}'
    worker_args = ('temporal', 'worker', '--target', 'tests.engines.crash_agent:agent', '--address', temporal_address,
                   '--task-queue', queue)
    first = spawn(*worker_args, env=env)
    first.wait_for('WORKER READY', 90)
    log = tmp_path / 'run.log'
    client = start(['run', CRASH, 'charge order A-1 and export', '--engine', 'temporal', '--address', temporal_address,
                    '--task-queue', queue], log, subprocess_env({**env, 'DURCAP_WAIT_NOTICE': str(NOTICE)}))
    try:
        wait_for_file(crash_dir / 'slow-started', 90)
        assert notice_lines(log) == [], log.read_text()  # a run that moves is not reported
        first.kill9()
        killed = time.monotonic()
        line = wait_text(log, 'still waiting:', client, 1.0 + NOTICE + SLACK)
        took = time.monotonic() - killed
        assert took >= NOTICE, (took, line)
        assert line.startswith('still waiting: no worker has picked up run ') and f"task queue '{queue}'" in line, line
        assert 'activity ' in line and '(attempt 2) scheduled, the history not growing' in line, line
        assert f'`durcap worker temporal TARGET --address {temporal_address} --task-queue {queue}' in line, line
        second = spawn(*worker_args, env=env)
        second.wait_for('WORKER READY', 90)
        assert client.wait(timeout=120) == 0, log.read_text()
    finally:
        kill9(client)
    assert_answered_once(log, crash_dir)


def test_dbos_queue_client_says_no_worker_picked_up_the_run_then_prints_the_answer(tmp_path: Path) -> None:
    """`durcap run --engine dbos --queue Q` waits on a `durcap worker dbos` (executor `w1`, peer recovery off) that is
    SIGKILLed inside `slow_export`: once its heartbeat row is older than the notice's 2 s and no step was recorded,
    the client says, once, that no worker has picked up the run, naming the queue and the executor. A worker
    launched again as `w1` recovers and finishes the run: the client prints the answer and exits 0; the charge ran
    once."""
    env, crash_dir = crash_env(tmp_path)
    env = subprocess_env(env)
    db, queue = f'sqlite:///{tmp_path / "dbos.sqlite"}', f'waiting-{uuid.uuid4().hex[:6]}'
    # `--queue`: the DBOS queue's spelling on the worker too (its first one, --task-queue, is an alias: other tests)
    worker_args = ['worker', 'dbos', CRASH, '--db', db, '--queue', queue, '--executor-id', 'w1',
                   '--peer-timeout', '0']
    first = start(worker_args, tmp_path / 'w1.log', env)
    log = tmp_path / 'run.log'
    client = second = None
    try:
        wait_text(tmp_path / 'w1.log', 'dbos worker ready', first, 120)
        client = start(['run', CRASH, 'charge order A-1 and export', '--engine', 'dbos', '--db', db, '--queue', queue],
                       log, env | {'DURCAP_WAIT_NOTICE': str(NOTICE)})
        wait_for_file(crash_dir / 'slow-started', 90)
        assert notice_lines(log) == [], log.read_text()
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        killed = time.monotonic()
        line = wait_text(log, 'still waiting:', client, NOTICE + SLACK)
        took = time.monotonic() - killed
        assert line.startswith('still waiting: no worker has picked up run ') and f"on queue '{queue}'" in line, line
        assert f'`durcap worker dbos TARGET --db {db} --queue {queue}' in line, line
        assert "its worker, executor 'w1', sends no heartbeat; no step recorded meanwhile" in line, (took, line)
        second = start(worker_args, tmp_path / 'w1-again.log', env)  # launched as w1: recovers the run
        assert client.wait(timeout=120) == 0, log.read_text()
    finally:
        for proc in (client, first, second):
            if proc is not None:
                kill9(proc)
    assert_answered_once(log, crash_dir)


def test_dbos_queue_client_says_no_worker_took_a_run_nobody_serves(tmp_path: Path) -> None:
    """No worker serves the queue (the one worker serves another queue): after the notice's 2 s the client says the
    run is ENQUEUED and no worker took it, and keeps waiting (killed here; the run stays on the queue)."""
    env, _ = crash_env(tmp_path)
    env = subprocess_env(env)
    db, queue = f'sqlite:///{tmp_path / "dbos.sqlite"}', f'nobody-{uuid.uuid4().hex[:6]}'
    other = start(['worker', 'dbos', CRASH, '--db', db, '--task-queue', f'other-{queue}'], tmp_path / 'other.log', env)
    log = tmp_path / 'run.log'
    client = None
    try:
        wait_text(tmp_path / 'other.log', 'dbos worker ready', other, 120)
        client = start(['run', CRASH, 'charge order A-1 and export', '--engine', 'dbos', '--db', db, '--queue', queue],
                       log, env | {'DURCAP_WAIT_NOTICE': str(NOTICE)})
        line = wait_text(log, 'still waiting:', client, 60)
        assert f"on queue '{queue}' for 2 s (it is ENQUEUED: no worker took it; no step recorded meanwhile)" in line, line
        assert client.poll() is None  # still waiting
        # SIGTERM (a CI step's timeout, a stopped container) is said as Ctrl-C is: the run goes on, how to reach it;
        # exit 143. Before, the client died in silence.
        client.send_signal(signal.SIGTERM)
        assert client.wait(timeout=30) == 143, log.read_text()
        said = log.read_text()
        assert 'interrupted; the run goes on in dbos (workflow id ' in said and '`durcap runs show ' in said, said
    finally:
        for proc in (client, other):
            if proc is not None:
                kill9(proc)


def test_dbos_worker_starts_on_a_postgresql_database_that_does_not_exist_yet(tmp_path: Path) -> None:
    """A new PostgreSQL system database, as a team starting out names it: `durcap run --engine dbos --queue Q --db
    postgresql://.../new` before any worker is one line naming the database and `createdb`, exit 2, and creates
    nothing; `durcap worker dbos --db` on it starts (DBOS creates the database at launch, as for its own apps; it
    refused to start with 'cannot connect ... does not exist'), and a run handed to its queue then gets its answer.
    The database is dropped afterwards. Real PostgreSQL (127.0.0.1:5432), real `durcap` subprocesses; model: the
    support example's scripted `FunctionModel`."""
    import psycopg

    from tests._helpers import PG_ADMIN_URL, drop_database, pg_url

    def exists() -> bool:
        with psycopg.connect(PG_ADMIN_URL) as conn:
            return conn.execute('SELECT 1 FROM pg_database WHERE datname = %s', (name,)).fetchone() is not None

    name = f'durcap_new_{uuid.uuid4().hex[:12]}'
    db, queue = pg_url(name), f'newdb-{uuid.uuid4().hex[:6]}'
    env = subprocess_env(unset=['DURCAP_DBOS_DB', 'DURCAP_STORE'])
    store = f'sqlite:///{tmp_path / "c.db"}'
    support = ['examples/support/agent.py:support', 'Where is order ABC-123?', '--deps-json',
               '{"orders": {"ABC-123": "Blue jacket: shipped"}}', '--store', store]
    run_args = ['run', *support, '--engine', 'dbos', '--db', db, '--queue', queue]
    worker = client = None
    try:
        early = start(run_args, tmp_path / 'early.log', env)
        assert early.wait(timeout=120) == 2, (tmp_path / 'early.log').read_text()
        errors = [line for line in (tmp_path / 'early.log').read_text().splitlines() if line.startswith('durcap: error')]
        assert len(errors) == 1 and f'does not exist); create the database (`createdb {name}` on that server)' in errors[0], errors
        assert not exists()
        worker = start(['worker', 'dbos', 'examples/support/agent.py:support', '--db', db, '--task-queue', queue,
                        '--executor-id', f'w-{queue}', '--store', store], tmp_path / 'worker.log', env)
        wait_text(tmp_path / 'worker.log', 'dbos worker ready', worker, 120)
        assert f"the server has no database '{name}' yet: DBOS creates it" in (tmp_path / 'worker.log').read_text()
        assert exists()
        client = start(run_args, tmp_path / 'run.log', env)
        assert client.wait(timeout=120) == 0, (tmp_path / 'run.log').read_text()
        assert 'answer (dbos): Order ABC-123: Blue jacket: shipped' in (tmp_path / 'run.log').read_text()
    finally:
        for proc in (client, worker):
            if proc is not None:
                kill9(proc)
        drop_database(name)
    assert not exists()


@pytest.mark.parametrize('engine', ['dbos', 'temporal', 'prefect'])
def test_sigterm_of_a_one_shot_run_says_where_the_run_is_and_exits_at_once(engine: str, tmp_path: Path,
                                                                          request: pytest.FixtureRequest) -> None:
    """`durcap run` running the run in its own process (DBOS on a SQLite system database; Temporal with its in-process
    worker at the shared dev server; Prefect, a flow run outside a deployment on the session's server), stopped with
    SIGTERM while the ledger agent's `charge` tool sleeps 300 s: it prints what Ctrl-C prints (the run goes on, or on
    Prefect, where the flow run ran in the command's process, that it stopped with it; its id, `durcap runs show` /
    `runs resume` / `runs cancel`) and exits 143 without waiting for the tool or a worker's graceful stop (well within
    the 30 s the test allows; before, it died in silence; a Prefect run was said to go on). Model: the ledger agent's
    scripted `FunctionModel` (tests/engines/ledger_agent.py)."""
    ledger = tmp_path / 'ledger'
    extra = {'PREFECT_API_URL': request.getfixturevalue('prefect_api_url'), 'PREFECT_HOME': str(tmp_path / 'ph')} \
        if engine == 'prefect' else {}
    env = subprocess_env({'DURCAP_LEDGER_DIR': str(ledger), 'DURCAP_LEDGER_AGENT': f'ledger-{uuid.uuid4().hex[:6]}',
                          'DURCAP_LEDGER_CHARGE_SECONDS': '300', **extra}, unset=['DURCAP_STORE'])
    args = ['run', 'tests/engines/ledger_agent.py:agent', 'charge order S-1', '--engine', engine,
            '--store', f'sqlite:///{tmp_path / "c.db"}']
    if engine == 'dbos':
        args += ['--db', f'sqlite:///{tmp_path / "dbos.sqlite"}']
    elif engine == 'temporal':
        args += ['--address', request.getfixturevalue('temporal_address'), '--task-queue', f'term-{uuid.uuid4().hex[:6]}',
                 '--inline-worker']
    log = tmp_path / 'run.log'
    run = start(args, log, env)
    try:
        wait_for_file(ledger / 'charge-started-S-1', 120)
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=30) == 143, log.read_text()
    finally:
        kill9(run)
    said = log.read_text()
    if engine == 'prefect':
        assert 'interrupted; the run (flow run id ' in said and 'ran in this command and stopped with it' in said, said
    else:
        assert f'interrupted; the run goes on in {engine} (workflow id ' in said, said
    assert '`durcap runs show ' in said and '`durcap runs resume ' in said and '`durcap runs cancel ' in said, said
    assert 'Traceback' not in said, said


def test_dbos_queue_stream_from_another_store_is_said_not_waited_for(tmp_path: Path) -> None:
    """`durcap run --engine dbos --queue Q --stream` whose worker writes the run's events to its own `--store` (not
    the client's): the client says, on stderr, that the run published no event to its store and which `--store` to
    pass, and prints the answer; before, it printed no text and waited its 10 s stream drain in silence. Real `durcap
    worker dbos` and `durcap run` subprocesses on a DBOS SQLite system database; model: the support example's
    scripted `FunctionModel`."""
    env = subprocess_env(unset=['DURCAP_DBOS_DB', 'DURCAP_STORE'])
    db, queue = f'sqlite:///{tmp_path / "dbos.sqlite"}', f'stream-{uuid.uuid4().hex[:6]}'
    target = 'examples/support/agent.py:support'
    worker = start(['worker', 'dbos', target, '--db', db, '--task-queue', queue,
                    '--store', f'sqlite:///{tmp_path / "worker.db"}'], tmp_path / 'worker.log', env)
    client = None
    try:
        wait_text(tmp_path / 'worker.log', 'dbos worker ready', worker, 120)
        client = start(['run', target, 'Where is order ABC-123?', '--deps-json',
                        '{"orders": {"ABC-123": "Blue jacket: shipped"}}', '--engine', 'dbos', '--db', db, '--queue',
                        queue, '--stream', '--store', f'sqlite:///{tmp_path / "client.db"}'], tmp_path / 'run.log', env)
        assert client.wait(timeout=120) == 0, (tmp_path / 'run.log').read_text()
    finally:
        for proc in (client, worker):
            if proc is not None:
                kill9(proc)
    text = (tmp_path / 'run.log').read_text()
    assert 'answer (dbos): Order ABC-123: Blue jacket: shipped' in text, text
    [note] = [line for line in text.splitlines() if line.startswith('durcap: --stream:')]
    assert 'published no event to sqlite:///' in note and "the worker's --store" in note, note
