"""`durcap serve` when no worker runs its turns yet (issue 26 leftovers): real `durcap serve` and `durcap worker`
subprocesses, real HTTP (httpx), DBOS on SQLite and Temporal at the shared dev server, the conversation store on SQLite.

- A system database no DBOS worker ever created: serve starts with one coded warning line naming the fix; a turn
  fails at once, its error one DC040 line (no exception class name); once a worker has created the database, turns
  are handed over.
- A queue / task queue no worker serves: serve starts with a warning; a turn is accepted (202) and its stream and
  status say it waits for a worker (`run_waiting`, `notice`); a worker started later runs it to the end.

Model: the scripted `FunctionModel` of tests/fixtures/input_agents.py (`input-plain` answers `ok`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests._helpers import ROOT, pg_url, sql
from tests.engines._serve import Proc, free_port, read_sse, start

pytestmark = [pytest.mark.slow]

TARGET = f'{ROOT / "tests" / "fixtures" / "input_agents.py"}:no_deps'
TOKEN = {'Authorization': 'Bearer t'}


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.kill9()


def _serve(procs: list[Proc], tmp: Path, env: dict[str, str], *args: str) -> tuple[str, str]:
    """`durcap serve TARGET *args` on a free port; its base URL and its start lines (the warnings) once it listens."""
    port = free_port()
    proc = start(['serve', TARGET, '--port', str(port), *args], tmp / f'serve-{port}.log', {**env, 'DURCAP_SERVE_TOKEN': 't'})
    procs.append(proc)
    proc.wait_for('durcap serve: bearer token', 120)
    url = f'http://127.0.0.1:{port}'
    for _ in range(600):  # uvicorn binds right after the lines
        try:
            httpx.get(f'{url}/v1/runs/none', headers=TOKEN, timeout=2)
            break
        except httpx.TransportError:
            assert proc.popen.poll() is None, proc.log.read_text()
            time.sleep(0.05)
    return url, proc.log.read_text()


def _turn(url: str, conversation: str) -> dict[str, Any]:
    answer = httpx.post(f'{url}/v1/conversations/{conversation}/turns', json={'prompt': 'hi'}, headers=TOKEN, timeout=60)
    assert answer.status_code == 202, answer.text  # accepted: a worker may come later
    return answer.json()


def _status(url: str, run_id: str) -> dict[str, Any]:
    return httpx.get(f'{url}/v1/runs/{run_id}', headers=TOKEN, timeout=30).json()


def test_dbos_database_no_worker_created_is_one_coded_line_then_a_queue_without_worker_is_said_and_waited_for(
        procs: list[Proc], tmp_path: Path) -> None:
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}', 'DURCAP_WAIT_NOTICE': '2'}
    queue = f'q-{uuid.uuid4().hex[:6]}'
    url, lines = _serve(procs, tmp_path, env, '--engine', 'dbos', '--db', db, '--queue', queue)
    # At start: one coded line naming the fix; serve starts all the same, and creates nothing.
    assert ('durcap serve: warning: DC040 --db: no DBOS worker has ever run on ' f'{db}: every turn fails until one has; '
            f'start `durcap worker dbos TARGET --db URL --queue {queue}`') in lines, lines
    assert not (tmp_path / 'dbos.sqlite').exists()
    failed = _turn(url, 'c-never')
    events = read_sse(url + failed['events_url'], TOKEN, timeout=60)
    assert [e.kind for e in events] == ['run_failed'], events
    assert events[0].data['data']['code'] == 'DC040'
    status = _status(url, failed['run_id'])
    assert status['status'] == 'failed', status
    assert status['error'].startswith(f'DC040 --db: no DBOS worker has ever run on {db}: start `durcap worker dbos'), status
    assert 'InputError' not in status['error'] and status['error'] == events[0].data['data']['error']

    # A worker on another queue creates the database: a turn on `queue` is handed over and waits, said in its stream
    # and status, until a worker serving `queue` starts and runs it.
    other = start(['worker', 'dbos', TARGET, '--db', db, '--queue', 'elsewhere', '--executor-id', 'w-elsewhere',
                   '--allow-drift'], tmp_path / 'worker-elsewhere.log', env)
    procs.append(other)
    other.wait_for('dbos worker ready', 120)
    waiting = _turn(url, 'c-waits')
    [said] = read_sse(url + waiting['events_url'], TOKEN, stop_after=1, timeout=60)
    assert said.kind == 'run_waiting', said
    assert said.data['data']['notice'].startswith(f'no `durcap worker dbos` serving queue {queue!r} was seen'), said
    # The worker command named is the one to run: its system database and its store too.
    assert (f'(start `durcap worker dbos TARGET --db {db} --queue {queue} --store {env["DURCAP_STORE"]}`)'
            in said.data['data']['notice']), said
    status = _status(url, waiting['run_id'])
    assert status['status'] == 'queued' and status['notice'] == said.data['data']['notice'], status
    worker = start(['worker', 'dbos', TARGET, '--db', db, '--queue', queue, '--executor-id', 'w-queue', '--allow-drift'],
                   tmp_path / 'worker-queue.log', env)
    procs.append(worker)
    rest = read_sse(url + waiting['events_url'], TOKEN, last_event_id=said.id, timeout=180)
    assert rest[-1].kind == 'run_completed' and rest[-1].data['data']['output'] == 'ok', rest
    status = _status(url, waiting['run_id'])
    assert status['status'] == 'completed' and status['notice'] is None, status


def test_temporal_task_queue_without_worker_is_said_at_start_and_in_the_run_then_a_worker_started_later_runs_it(
        procs: list[Proc], tmp_path: Path, temporal_address: str) -> None:
    store = f'sqlite:///{tmp_path / "conversations.db"}'
    queue = f'waiting-{uuid.uuid4().hex[:8]}'
    url, lines = _serve(procs, tmp_path, {'DURCAP_STORE': store}, '--engine', 'temporal', '--address', temporal_address,
                        '--task-queue', queue, '--keepalive', '1')
    # The worker command named is the one to run: its store too (a worker on another store runs the turn, but its
    # events and messages go where serve never reads them: the run would show `queued` forever).
    command = f'durcap worker temporal TARGET --address {temporal_address} --task-queue {queue} --store {store}'
    assert (f'durcap serve: warning: no worker polls task queue {queue!r} at {temporal_address} yet: turns wait until '
            f'one does (start `{command}`)') in lines, lines
    run = _turn(url, 'c-temporal')
    with httpx.stream('GET', url + run['events_url'], headers=TOKEN, timeout=60) as response:
        first = next(response.iter_raw())
    # The reconnect delay comes with the stream's first write, here the keepalive comment of a run that waits.
    assert first.startswith(b'retry: 1000\n\n'), first
    [said] = read_sse(url + run['events_url'], TOKEN, stop_after=1, timeout=60)
    assert said.kind == 'run_waiting', said
    notice = said.data['data']['notice']
    assert notice.startswith(f'no worker polls task queue {queue!r}: the run waits until one does'), notice
    assert '--inline-worker' not in notice  # a flag of `durcap run`, not of the API
    assert f'(start `{command}`; ' in notice, notice
    status = _status(url, run['run_id'])
    assert status['status'] == 'queued' and status['notice'] == notice, status
    # The worker as the notice says, in a folder of its own and without $DURCAP_STORE.
    (tmp_path / 'elsewhere').mkdir()
    worker = start(['worker', 'temporal', TARGET, '--address', temporal_address, '--task-queue', queue, '--store', store,
                    '--allow-drift'], tmp_path / 'worker.log', {}, cwd=tmp_path / 'elsewhere')
    procs.append(worker)
    rest = read_sse(url + run['events_url'], TOKEN, last_event_id=said.id, timeout=180)
    assert rest[0].kind == 'run_started' and rest[-1].kind == 'run_completed', [e.kind for e in rest]
    assert rest[-1].data['data']['output'] == 'ok'
    status = _status(url, run['run_id'])
    assert status['status'] == 'completed' and status['notice'] is None, status


def test_dbos_postgresql_database_no_worker_created_fails_each_turn_with_the_coded_line(
        procs: list[Proc], tmp_path: Path) -> None:
    """As the SQLite case above, on PostgreSQL (the shared server): a system database the server does not have yet is
    one DC040 --db warning at start, and a turn fails at once with that coded line as its error (before: the client's
    `RuntimeError: cannot connect to the DBOS system database ...`, class name and all). Nothing is created."""
    name = f'durcap_missing_{uuid.uuid4().hex[:8]}'
    db = pg_url(name)
    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}'}
    queue = f'q-{uuid.uuid4().hex[:6]}'
    url, lines = _serve(procs, tmp_path, env, '--engine', 'dbos', '--db', db, '--queue', queue)
    assert f'durcap serve: warning: DC040 --db: no DBOS worker has ever run on {db}: every turn fails' in lines, lines
    failed = _turn(url, 'c-never-pg')
    events = read_sse(url + failed['events_url'], TOKEN, timeout=60)
    assert [e.kind for e in events] == ['run_failed'], events
    status = _status(url, failed['run_id'])
    assert status['status'] == 'failed', status
    assert status['error'].startswith(f'DC040 --db: no DBOS worker has ever run on {db}: start `durcap worker dbos'), status
    assert status['error'] == events[0].data['data']['error'] and 'Error' not in status['error'], status
    assert not sql(pg_url('postgres'), 'SELECT 1 FROM pg_database WHERE datname = :name', {'name': name})
