"""`workers/dbos_app.py` (the DBOS app of deploy/compose and deploy/kubernetes) stopped with SIGTERM mid-run, next
to a peer: what a rolling update does to one of its 3 replicas, each with its own executor id.

Real parts: two `workers/dbos_app.py` subprocesses on one PostgreSQL system database and queue (their executor ids,
concurrency, peer timeout and drain time from the environment, as the manifests set them), runs enqueued with
`DBOSClient`. Model: the ledger agent's scripted `FunctionModel` (tests/engines/ledger_agent.py), whose `charge`
tool logs each execution to a file.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests._helpers import ROOT, subprocess_env
from tests.engines.test_crash import wait_file
from tests.engines.test_runs import wait_status

pytestmark = pytest.mark.slow

LEDGER = 'tests/engines/ledger_agent.py:agent'


def start_app(tmp_path: Path, name: str, env: dict[str, str], **settings: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`workers/dbos_app.py` with executor id `name` and `settings` (DURCAP_* variables); returns it and its log."""
    log = tmp_path / f'{name}.log'
    app_env = env | {'DURCAP_DBOS_EXECUTOR_ID': name, 'DURCAP_READY_FILE': str(tmp_path / f'{name}.ready'), **settings}
    with open(log, 'wb') as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / 'workers' / 'dbos_app.py')], cwd=ROOT, env=app_env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, log


def wait_ready(proc: subprocess.Popen[bytes], name: str, tmp_path: Path, log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not (tmp_path / f'{name}.ready').exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f'{name} not ready:\n{log.read_text()}'
        time.sleep(0.2)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.fixture
def ledger(tmp_path: Path, postgres_url: str) -> dict[str, str]:
    agent = f'ledger-{uuid.uuid4().hex[:6]}'
    return subprocess_env({
        'DURCAP_LEDGER_DIR': str(tmp_path / 'ledger'), 'DURCAP_LEDGER_AGENT': agent, 'DURCAP_TARGET': LEDGER,
        'DBOS_SYSTEM_DATABASE_URL': postgres_url, 'DURCAP_DBOS_QUEUE': f'drain-{uuid.uuid4().hex[:6]}',
        'DURCAP_DBOS_CONCURRENCY': '2',
    })


def enqueue(env: dict[str, str], order: str) -> str:
    from dbos import DBOSClient

    client = DBOSClient(system_database_url=env['DBOS_SYSTEM_DATABASE_URL'])
    try:
        agent = env['DURCAP_LEDGER_AGENT']
        return client.enqueue({'queue_name': env['DURCAP_DBOS_QUEUE'], 'workflow_name': f'durcap.{agent}',
                               'workflow_id': f'{agent}-{order}'}, f'charge order {order}', None, None, None).workflow_id
    finally:
        client.destroy()


def run_on(a: subprocess.Popen[bytes], b: subprocess.Popen[bytes], env: dict[str, str], tmp_path: Path,
           order: str) -> str:
    """Enqueue a run of `order` while replica b is paused (SIGSTOP), so replica a takes it; b resumes once the run's
    `charge` started in a. Returns the workflow id."""
    os.killpg(b.pid, signal.SIGSTOP)
    try:
        workflow_id = enqueue(env, order)
        wait_file(tmp_path / 'ledger' / f'charge-started-{order}', 120)
    finally:
        os.killpg(b.pid, signal.SIGCONT)
    assert (tmp_path / 'ledger' / f'charge-started-{order}').read_text() == str(a.pid)
    return workflow_id


def heartbeats(url: str) -> set[str]:
    from durable_capabilities.engines.dbos._peers import live_executors

    return {e['executor_id'] for e in live_executors(url)}


def test_sigterm_past_the_drain_leaves_the_run_to_a_peer(tmp_path: Path, ledger: dict[str, str]) -> None:
    """A replica stopped while its run's `charge` (8 s) outlasts its drain (DURCAP_GRACEFUL_SHUTDOWN=1): it exits 0,
    says the workflow stays PENDING, keeps its heartbeat row (stale from then on), and the other replica (peer
    timeout 4 s) recovers and completes the run with no operator action: the in-flight charge re-ran once. Before,
    the row was deleted on every stop, and with a per-pod executor id nothing would ever recover the run."""
    env = ledger | {'DURCAP_LEDGER_CHARGE_SECONDS': '8'}
    a, a_log = start_app(tmp_path, 'replica-a', env, DURCAP_GRACEFUL_SHUTDOWN='1', DURCAP_DBOS_PEER_TIMEOUT='4')
    b, b_log = start_app(tmp_path, 'replica-b', env, DURCAP_GRACEFUL_SHUTDOWN='30', DURCAP_DBOS_PEER_TIMEOUT='4')
    try:
        wait_ready(a, 'replica-a', tmp_path, a_log)
        wait_ready(b, 'replica-b', tmp_path, b_log)
        workflow_id = run_on(a, b, env, tmp_path, 'D-1')
        os.killpg(a.pid, signal.SIGTERM)
        assert a.wait(timeout=40) == 0, a_log.read_text()
        text = a_log.read_text()
        assert "dbos worker 'replica-a': 1 workflows still running when the 1 s drain ended stay PENDING" in text, text
        assert 'Traceback' not in text, text
        (tmp_path / 'ledger' / 'release').touch()  # a is gone mid-charge: b's re-run returns at once, not after 8 s
        wait_status(env['DBOS_SYSTEM_DATABASE_URL'], workflow_id, 'SUCCESS', 90)
        assert "executor 'replica-a' silent for" in b_log.read_text()  # found through the row a kept
    finally:
        stop(a)
        stop(b)
    assert (tmp_path / 'ledger' / 'charges').read_text().splitlines() == ['D-1', 'D-1']  # in flight, re-run once


def test_sigterm_within_the_drain_finishes_the_run_there_once(tmp_path: Path, ledger: dict[str, str]) -> None:
    """A replica stopped while its run's `charge` (8 s) fits in its drain (DURCAP_GRACEFUL_SHUTDOWN=30): the run
    completes in the stopping replica, the charge ran once, and the other replica (peer timeout 5 s, shorter than
    the drain) recovered nothing, because the stopping replica kept beating while it drained; once drained with
    nothing pending, its heartbeat row is gone."""
    env = ledger | {'DURCAP_LEDGER_CHARGE_SECONDS': '8'}
    a, a_log = start_app(tmp_path, 'replica-a', env, DURCAP_GRACEFUL_SHUTDOWN='30', DURCAP_DBOS_PEER_TIMEOUT='5')
    b, b_log = start_app(tmp_path, 'replica-b', env, DURCAP_GRACEFUL_SHUTDOWN='30', DURCAP_DBOS_PEER_TIMEOUT='5')
    try:
        wait_ready(a, 'replica-a', tmp_path, a_log)
        wait_ready(b, 'replica-b', tmp_path, b_log)
        workflow_id = run_on(a, b, env, tmp_path, 'D-2')
        os.killpg(a.pid, signal.SIGTERM)
        assert a.wait(timeout=60) == 0, a_log.read_text()
        assert 'Traceback' not in a_log.read_text(), a_log.read_text()
        wait_status(env['DBOS_SYSTEM_DATABASE_URL'], workflow_id, 'SUCCESS', 30)
        assert 'replica-a' not in heartbeats(env['DBOS_SYSTEM_DATABASE_URL'])
        assert "executor 'replica-a' silent for" not in b_log.read_text(), b_log.read_text()
    finally:
        stop(a)
        stop(b)
    assert (tmp_path / 'ledger' / 'charges').read_text().splitlines() == ['D-2']


def test_durcap_worker_dbos_cut_short_names_what_it_left_and_exits_1(tmp_path: Path) -> None:
    """`durcap worker dbos --graceful-shutdown 1 --peer-timeout 0` (SQLite system database) stopped with SIGTERM while
    its run sleeps in `slow_export` (the crash agent's scripted `FunctionModel`): the drain ends with the workflow
    still PENDING, so the worker says so in one line naming the workflow id and who finishes it, does not say
    "drained", and exits 1 (before: "worker drained and stopped", exit 0, nothing said with peer recovery off). A
    worker launched again as that executor id finishes the run, as the line says."""
    from dbos import DBOSClient

    from tests.engines.test_crash import crash_env
    from tests.engines.test_runs import CRASH, kill9, start, wait_text

    env, crash_dir = crash_env(tmp_path)
    env = subprocess_env(env)
    db, queue, executor = f'sqlite:///{tmp_path / "dbos.sqlite"}', f'drain-{uuid.uuid4().hex[:6]}', 'drain-w1'
    args = ['worker', 'dbos', CRASH, '--db', db, '--task-queue', queue, '--executor-id', executor,
            '--graceful-shutdown', '1', '--peer-timeout', '0']
    worker = start(args, tmp_path / 'w1.log', env)
    again = None
    client = None
    try:
        wait_text(tmp_path / 'w1.log', 'dbos worker ready', worker, 120)
        client = DBOSClient(system_database_url=db)
        workflow_id = client.enqueue({'queue_name': queue, 'workflow_name': f'durcap.{env["DURCAP_CRASH_AGENT"]}',
                                      'workflow_id': f'drain-{uuid.uuid4().hex[:8]}'},
                                     'charge order A-1 and export', None, None, None).workflow_id
        wait_file(crash_dir / 'slow-started', 90)
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=60) == 1, (tmp_path / 'w1.log').read_text()
        text = (tmp_path / 'w1.log').read_text()
        [line] = [line for line in text.splitlines() if 'still running' in line]
        assert line == (f"durcap: worker stopped before its runs ended: dbos worker '{executor}': 1 workflows still "
                        f'running when the 1 s drain ended stay PENDING ({workflow_id}); peer recovery is off '
                        f'(--peer-timeout 0): a worker launched as this executor id recovers them (`durcap worker '
                        f'dbos TARGET --queue {queue} --executor-id {executor}`), or `durcap runs resume ID` one '
                        'by one'), text
        assert 'drained' not in text and 'Traceback' not in text, text
        # Only our lines: DBOS's own warning per cancelled workflow and step ("Asyncio task cancelled for workflow or
        # step ...", two of them before the summary) is not printed.
        assert 'Asyncio task cancelled' not in text and 'cancelled for workflow' not in text, text
        again = start(args, tmp_path / 'w1-again.log', env)  # what the line says: the run finishes
        wait_status(db, workflow_id, 'SUCCESS', 120)
    finally:
        if client is not None:
            client.destroy()
        kill9(worker)
        if again is not None:
            kill9(again)


def test_a_run_parked_on_an_approval_does_not_hold_the_drain_and_resumes_on_a_peer(tmp_path: Path,
                                                                                   postgres_url: str) -> None:
    """`durcap worker dbos` (PostgreSQL system database, drain 600 s) stopped with SIGTERM while its only run waits for
    an approval (the gated agent's scripted `FunctionModel`, tests/engines/approval_agent.py): the drain says at its
    start what it waits for (nothing running; the parked run named, not waited for), ends at once with exit 0 and a
    line saying the parked run stays PENDING for a peer. The other worker (peer timeout 4 s) recovers it, the approval
    sent then reaches it there, and the gated tool runs once. Before, the drain waited its whole time (30 s by default)
    for the parked run, saying nothing; 600 s here, past the 120 s this test waits for the exit."""
    import asyncio

    from dbos import DBOSClient

    from durable_capabilities import runner
    from tests.engines.test_approvals import TARGET, env_for, revocations
    from tests.engines.test_runs import DURCAP, env_with, kill9, wait_text

    env, crash_dir = env_for(tmp_path)
    env = env_with(**env)
    queue = f'park-{uuid.uuid4().hex[:6]}'

    def worker(name: str) -> subprocess.Popen[bytes]:
        with open(tmp_path / f'{name}.log', 'wb') as handle:
            proc = subprocess.Popen([*DURCAP, 'worker', 'dbos', TARGET, '--db', postgres_url, '--task-queue', queue,
                                     '--executor-id', name, '--graceful-shutdown', '600', '--peer-timeout', '4'],
                                    cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
        wait_text(tmp_path / f'{name}.log', 'dbos worker ready', proc, 120)
        return proc

    workflow_id = f'parked-{uuid.uuid4().hex[:6]}'
    procs = [worker('park-a')]
    try:
        client = DBOSClient(system_database_url=postgres_url)
        try:
            client.enqueue({'queue_name': queue, 'workflow_name': 'durcap.gated', 'workflow_id': workflow_id},
                           'revoke alice', None, None, None)
        finally:
            client.destroy()

        async def waiting() -> list:
            deadline = time.monotonic() + 120
            while not (calls := await runner.approvals(workflow_id, engine='dbos', db=postgres_url)):
                assert time.monotonic() < deadline, 'the run never waited for its approval'
                await asyncio.sleep(0.3)
            return calls

        [call] = asyncio.run(waiting())
        procs.append(worker('park-b'))
        os.killpg(procs[0].pid, signal.SIGTERM)
        assert procs[0].wait(timeout=120) == 0, (tmp_path / 'park-a.log').read_text()
        text = (tmp_path / 'park-a.log').read_text()
        assert (f"dbos worker 'park-a': draining: no workflow is running here; not waiting for 1 parked on an approval "
                f'({workflow_id}): their decisions wait in the system database and a peer resumes them after 4 s') in text, text
        assert f"1 workflow(s) parked on an approval stay PENDING ({workflow_id}): a peer resumes them" in text, text
        assert 'Traceback' not in text and 'still running when' not in text, text
        wait_text(tmp_path / 'park-b.log', "executor 'park-a' silent for", procs[1], 120)
        approved = subprocess.run([*DURCAP, 'approve', workflow_id, call.call_id, '--engine', 'dbos', '--db', postgres_url],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert approved.returncode == 0, approved.stdout + approved.stderr
        wait_status(postgres_url, workflow_id, 'SUCCESS', 120)
    finally:
        for proc in procs:
            kill9(proc)
    assert revocations(crash_dir) == ['alice']
