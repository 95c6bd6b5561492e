"""The entry points users know, run as real processes: `durcap worker temporal` (and its SIGTERM drain),
`durcap run`, a DBOS user's decorated workflow, `durcap schedule prefect`, and `durcap demo`.

Model: the scripted support `FunctionModel` (examples/support/scripted.py). Servers: the session's
Temporal dev server and Prefect server; DBOS on SQLite. Every process is stopped by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests._helpers import ROOT, subprocess_env, wait_for_line

pytestmark = pytest.mark.slow


ENV = subprocess_env()
FLOW_PREFIX = 'durcap-'  # engines.prefect._spec.FLOW_NAME_PREFIX: the flow of agent A is `durcap-A`
DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']


def start(args: list[str], log: Path, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.Popen[bytes]:
    handle = open(log, 'wb')
    proc = subprocess.Popen(args, cwd=cwd, env={**ENV, **(env or {})}, stdout=handle, stderr=subprocess.STDOUT,
                            start_new_session=True)
    handle.close()
    return proc


def wait_for(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    wait_for_line(log, needle, timeout, alive=lambda: proc.poll() is None)


def kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def test_worker_serves_runs_and_drains_on_sigterm(temporal_address: str, tmp_path: Path) -> None:
    queue = f'cli-{uuid.uuid4().hex[:8]}'
    worker = start([*DURCAP, 'worker', 'temporal', 'examples.support.agent:support', '--task-queue', queue,
                    '--address', temporal_address], tmp_path / 'worker.log')
    try:
        wait_for(tmp_path / 'worker.log', 'worker ready', worker, 90)
        run = subprocess.run(
            [*DURCAP, 'run', 'examples.support.agent:support', 'Where is my order ABC-123?', '--engine', 'temporal',
             '--address', temporal_address, '--task-queue', queue,
             '--deps-json', json.dumps({'orders': {'ABC-123': 'Blue jacket: shipped'}})],
            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
        )
        assert run.returncode == 0, run.stdout + run.stderr
        assert 'answer (temporal): Order ABC-123: Blue jacket: shipped' in run.stdout
        assert 'agent__support__toolset__orders__call_tool' in run.stdout
        os.killpg(worker.pid, signal.SIGTERM)
        assert worker.wait(timeout=60) == 0, (tmp_path / 'worker.log').read_text()
    finally:
        kill(worker)


def test_worker_refuses_to_start_on_errors(tmp_path: Path) -> None:
    result = subprocess.run([*DURCAP, 'worker', 'temporal', 'tests/fixtures/bad_agent.py:bad'], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert 'DC001' in result.stdout and 'Traceback' not in result.stderr


def test_dbos_users_decorated_workflow_checkpoints_each_step(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, '-m', 'tests.engines.dbos_user_app', f'sqlite:///{tmp_path / "app.sqlite"}'],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.split('REPORT ', 1)[1].splitlines()[0])
    name = report['name']
    assert report['answer'].startswith('Revoked sessions for acct-42')
    assert report['workflow'] == 'handle_ticket'
    # The gated call waited (DBOS.recv on the run's topic, the approval clock) and ran once after the approval.
    assert 'DBOS.recv' in report['steps'] and f'durcap__{name}__approval.clock' in report['steps'], report['steps']
    gate = {'DBOS.recv', 'DBOS.sleep', 'DBOS.setEvent', f'durcap__{name}__approval.clock'}
    assert [s for s in report['steps'] if s not in gate] == [
        f'{name}__model.request', f'{name}__model.request', f'{name}__function_toolset__account-security.call_tool',
        f'{name}__model.request']


@pytest.mark.parametrize('how', ['fork', 'spawn'])
def test_schedule_prefect_serves_a_deployment_whose_runs_complete(how: str, prefect_api_url: str, tmp_path: Path) -> None:
    """The support example served on a 5 s interval until a flow run completed, its flow-run processes forked from the
    serving process's preloaded fork server (the default; the other tests here check the process tree) or, with
    `--spawn`, started by Prefect as new processes (no fork server). Model: the support example's scripted model."""
    import httpx

    deployment = f'support-every-5s-{uuid.uuid4().hex[:6]}'
    # The runner polls for due runs every second (Prefect's default: 10 s), as in test_approvals' serving tests.
    # `--limit 1`: one flow run at a time (the default, 5, let a run fall due every 5 s start beside the first while it
    # was still starting: with --spawn under load, five new interpreters importing Prefect at once, 143 s at load 15)
    env = {'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
           'PREFECT_RUNNER_POLL_FREQUENCY': '1'}
    serve = start([*DURCAP, 'schedule', 'prefect', 'examples.support.agent:support', '--interval', '5', '--limit', '1',
                   '--prompt', 'Where is my order ABC-123?', '--name', deployment,
                   '--deps-json', json.dumps({'orders': {'ABC-123': 'jacket'}}), *(['--spawn'] if how == 'spawn' else [])],
                  tmp_path / 'serve.log', env)

    def completed_runs() -> list[dict]:
        # Prefect's REST API directly: this test process's Prefect settings point elsewhere.
        found = httpx.post(f'{prefect_api_url}/deployments/filter',
                           json={'deployments': {'name': {'any_': [deployment]}}}, timeout=10).json()
        if not found:
            return []
        runs = httpx.post(f'{prefect_api_url}/flow_runs/filter',
                          json={'flow_runs': {'deployment_id': {'any_': [found[0]['id']]}}}, timeout=10).json()
        return [r for r in runs if r['state_type'] == 'COMPLETED']

    try:
        deadline = time.monotonic() + 150
        done: list[dict] = []
        while time.monotonic() < deadline and not done:
            assert serve.poll() is None, (tmp_path / 'serve.log').read_text()[-3000:]
            done = completed_runs()
            time.sleep(0.5)
        assert done, (tmp_path / 'serve.log').read_text()[-3000:]
        assert done[0]['parameters']['prompt'] == 'Where is my order ABC-123?'
        forkers = [c for c in _children(serve.pid) if 'multiprocessing.forkserver' in _args(c)]
        assert len(forkers) == (1 if how == 'fork' else 0), forkers
        assert ('flow runs start from a fork server' in (tmp_path / 'serve.log').read_text()) is (how == 'fork')
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGTERM)
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill(serve)


# Its Temporal demo looks at 127.0.0.1:7233 (tests/engines/test_local_servers.py): one worker runs those.
@pytest.mark.parametrize('engine', ['dbos', pytest.param('temporal', marks=pytest.mark.xdist_group('port-7233'))])
def test_demo_runs_in_an_empty_folder_and_leaves_no_server(engine: str, tmp_path: Path) -> None:
    """The main job: `durcap demo` with nothing started first (DBOS on SQLite; Temporal starts its own dev server)."""
    result = subprocess.run([*DURCAP, 'demo', '--engine', engine], cwd=tmp_path, env={**ENV, 'DURCAP_TEMPORAL_ADDRESS': ''},
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert 'Order ABC-123: Blue denim jacket' in result.stdout
    assert 'capabilities loaded in this run: orders' in result.stdout
    assert 'with deferred capabilities vs' in result.stdout
    if engine == 'temporal':
        assert 'agent__support__toolset__orders__call_tool' in result.stdout
        # It said which server it used: its own embedded one, or the one it found on 127.0.0.1:7233.
        assert ('starting an embedded in-memory dev server for this demo' in result.stderr
                or 'temporal server: using the existing server at 127.0.0.1:7233' in result.stderr), result.stderr
        leftover = subprocess.run(['pgrep', '-f', f'{tmp_path}'], capture_output=True, text=True).stdout.strip()
        assert not leftover, f'processes left behind: {leftover}'
    else:
        assert 'support__function_toolset__orders.call_tool' in result.stdout
        assert (tmp_path / '.durcap' / 'dbos.sqlite').exists()


def test_two_prefect_serving_processes_share_a_deployment_and_one_reschedules_a_crashed_run(
        prefect_api_url: str, tmp_path: Path) -> None:
    """Issue 29 item 3, on the session's Prefect server; model: the ledger agent's scripted `FunctionModel`. Two
    `durcap schedule prefect` processes serve one deployment (`--limit 1` each). Two flow runs created at once go
    one to each process. The flow-run process running the first charge is SIGKILLed (the kill -9 of a flow run's
    process): its serving process marks it CRASHED, exactly one of the two processes claims the crash and
    reschedules it, and it completes from its cached tasks: the model requests before the charge are not made
    again and the killed charge re-ran once. SIGTERM of one serving process leaves the deployment unpaused."""
    import httpx

    ledger = tmp_path / 'ledger'
    agent_name = f'ledger-{uuid.uuid4().hex[:6]}'
    deployment = f'shared-{uuid.uuid4().hex[:6]}'
    env = {'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
           'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'results'), 'DURCAP_LEDGER_DIR': str(ledger),
           'DURCAP_LEDGER_AGENT': agent_name, 'DURCAP_LEDGER_CHARGE_SECONDS': '10',
           'PREFECT_RUNNER_POLL_FREQUENCY': '1'}  # each runner looks for scheduled runs every second (10 by default)
    argv = [*DURCAP, 'schedule', 'prefect', 'tests/engines/ledger_agent.py:agent', '--prompt', 'charge order P-0',
            '--interval', '86400', '--name', deployment, '--limit', '1']
    serving = [start(argv, tmp_path / f's{i}.log', env) for i in range(2)]

    def found() -> dict:  # Prefect's REST API directly: this test process's Prefect settings point elsewhere
        response = httpx.get(f'{prefect_api_url}/deployments/name/{FLOW_PREFIX}{agent_name}/{deployment}', timeout=10)
        response.raise_for_status()
        return response.json()

    def create(parameters: dict) -> str:
        # The second serving process upserts the deployment too, possibly just now: a refusal in that window is
        # retried with the deployment read again (seen once in CI: a response without an id).
        deadline = time.monotonic() + 30
        while True:
            response = httpx.post(f'{prefect_api_url}/deployments/{found()["id"]}/create_flow_run',
                                  json={'parameters': parameters}, timeout=10)
            if response.status_code < 300 or time.monotonic() > deadline:
                assert response.status_code < 300, (response.status_code, response.text)
                return response.json()['id']
            time.sleep(0.3)

    def state(flow_run_id: str) -> str:
        return httpx.get(f'{prefect_api_url}/flow_runs/{flow_run_id}', timeout=10).json()['state_type']

    try:
        for i, proc in enumerate(serving):
            # 'serving deployment' comes before the fork server's preload: wait until each is ready to take runs, so
            # that under load the first does not take both runs one after the other while the second still preloads
            wait_for(tmp_path / f's{i}.log', 'flow runs start from a fork server', proc, 120)
        deadline = time.monotonic() + 120
        while httpx.get(f'{prefect_api_url}/deployments/name/{FLOW_PREFIX}{agent_name}/{deployment}',
                        timeout=10).status_code == 404:  # `serve` creates it after the line above
            assert time.monotonic() < deadline and all(p.poll() is None for p in serving), 'no deployment'
            time.sleep(0.3)
        runs = [create({'prompt': f'charge order P-{n}', 'deps': None}) for n in (1, 2)]
        for n in (1, 2):
            wait_file_(ledger / f'charge-started-P-{n}', 150)  # both in flight at once (10 s charges)
        # Each flow-run process was forked by its serving process's fork server (preloaded: `_prefork`); its parent
        # as the charge saw it (under load the first charge may have ended before the second started).
        forkers = {n: int((ledger / f'charge-parent-P-{n}').read_text()) for n in (1, 2)}
        assert all('multiprocessing.forkserver' in _args(f) for f in forkers.values()), forkers
        parents = {n: _parent(str(f)) for n, f in forkers.items()}
        assert parents[1] != parents[2] and set(parents.values()) == {p.pid for p in serving}, parents
        (ledger / 'charge-started-P-1').rename(ledger / 'first-charge-P-1')
        os.kill(int((ledger / 'first-charge-P-1').read_text()), signal.SIGKILL)  # the flow-run process only
        # Both were in flight at once and the first is killed: P-2's charge and P-1's re-run return now (ledger_agent's
        # `release`), instead of charging out their 10 s each
        (ledger / 'release').touch()
        deadline = time.monotonic() + 150
        while state(runs[0]) != 'COMPLETED' or state(runs[1]) != 'COMPLETED':
            assert time.monotonic() < deadline, [(tmp_path / f's{i}.log').read_text()[-2000:] for i in range(2)]
            time.sleep(0.5)
        os.killpg(serving[0].pid, signal.SIGTERM)
        assert serving[0].wait(timeout=60) in (0, 143, -15), (tmp_path / 's0.log').read_text()[-2000:]
        assert found()['paused'] is False, 'stopping one serving process paused the shared deployment'
    finally:
        for proc in serving:
            kill(proc)
    said = [i for i in range(2) if f'prefect flow run {runs[0]}' in (tmp_path / f's{i}.log').read_text()]
    assert len(said) == 1, 'not exactly one serving process rescheduled the crashed run'
    assert sorted((ledger / 'charges').read_text().splitlines()) == ['P-1', 'P-1', 'P-2'], 'a charge ran again'
    requests = (ledger / 'model-requests').read_text().splitlines()
    assert requests.count('P-1:0') == 1 and requests.count('P-1:1') == 1, requests  # cached: not requested again


def test_a_prefect_flow_run_lost_with_its_serving_process_is_found_and_finished_by_the_other(
        prefect_api_url: str, tmp_path: Path) -> None:
    """Issue 29 item 3, on the session's Prefect server; model: the ledger agent's scripted `FunctionModel`. Two
    `durcap schedule prefect` processes serve one deployment (`--limit 1` each) and run one flow run each. One serving
    process and its flow-run process are SIGKILLed at once (a lost machine): nobody reports a crash, so Prefect keeps
    that run RUNNING. Its beats stop (`_liveness`), the surviving serving process marks it CRASHED and reschedules it,
    and runs it from its cached tasks: the model requests before the charge are not made again, and the killed charge
    re-ran once. Without the beats the run would stay RUNNING and the test time out."""
    import httpx

    ledger = tmp_path / 'ledger'
    agent_name = f'ledger-{uuid.uuid4().hex[:6]}'
    deployment = f'lost-{uuid.uuid4().hex[:6]}'
    env = {'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
           'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'results'), 'DURCAP_LEDGER_DIR': str(ledger),
           'DURCAP_LEDGER_AGENT': agent_name, 'DURCAP_LEDGER_CHARGE_SECONDS': '10',
           'PREFECT_RUNNER_POLL_FREQUENCY': '1', 'DURCAP_PREFECT_BEAT_SECONDS': '1', 'DURCAP_PREFECT_STALE_SECONDS': '5'}
    argv = [*DURCAP, 'schedule', 'prefect', 'tests/engines/ledger_agent.py:agent', '--prompt', 'charge order P-0',
            '--interval', '86400', '--name', deployment, '--limit', '1']
    serving = [start(argv, tmp_path / f's{i}.log', env) for i in range(2)]
    url = f'{prefect_api_url}/deployments/name/{FLOW_PREFIX}{agent_name}/{deployment}'

    def create(parameters: dict) -> str:
        deadline = time.monotonic() + 30
        while True:  # the other serving process may be upserting the deployment just now: retried
            response = httpx.post(f'{prefect_api_url}/deployments/{httpx.get(url, timeout=10).json()["id"]}/create_flow_run',
                                  json={'parameters': parameters}, timeout=10)
            if response.status_code < 300 or time.monotonic() > deadline:
                assert response.status_code < 300, (response.status_code, response.text)
                return response.json()['id']
            time.sleep(0.3)

    def state(flow_run_id: str) -> str:
        return httpx.get(f'{prefect_api_url}/flow_runs/{flow_run_id}', timeout=10).json()['state_type']

    try:
        for i, proc in enumerate(serving):  # ready to take runs: its fork server preloaded (see the test above)
            wait_for(tmp_path / f's{i}.log', 'flow runs start from a fork server', proc, 120)
        deadline = time.monotonic() + 120
        while httpx.get(url, timeout=10).status_code == 404:  # `serve` creates it after the line above
            assert time.monotonic() < deadline and all(p.poll() is None for p in serving), 'no deployment'
            time.sleep(0.3)
        runs = [create({'prompt': f'charge order P-{n}', 'deps': None}) for n in (1, 2)]
        for n in (1, 2):
            wait_file_(ledger / f'charge-started-P-{n}', 150)  # both in flight at once (10 s charges)
        flow_process = int((ledger / 'charge-started-P-1').read_text())
        forker = int((ledger / 'charge-parent-P-1').read_text())
        lost = next(p for p in serving if p.pid == _parent(str(forker)))  # via its fork server
        survivor = next(i for i, p in enumerate(serving) if p is not lost)
        (ledger / 'charge-started-P-1').rename(ledger / 'first-charge-P-1')
        os.kill(lost.pid, signal.SIGKILL)  # the serving process first, so nobody sees its flow run end
        os.kill(flow_process, signal.SIGKILL)
        lost.wait(timeout=30)
        # Both were in flight at once and P-1 is lost: P-2's charge and P-1's re-run return now (ledger_agent's
        # `release`): the survivor (`--limit 1`) took P-1 again only once P-2's 10 s charge had ended
        (ledger / 'release').touch()
        deadline = time.monotonic() + 240
        while state(runs[0]) != 'COMPLETED' or state(runs[1]) != 'COMPLETED':
            assert time.monotonic() < deadline, (state(runs[0]), (tmp_path / f's{survivor}.log').read_text()[-3000:])
            time.sleep(0.5)
    finally:
        for proc in serving:
            kill(proc)
    said = (tmp_path / f's{survivor}.log').read_text()
    assert f'prefect flow run {runs[0]}' in said and 'stopped beating' in said, said[-3000:]
    assert sorted((ledger / 'charges').read_text().splitlines()) == ['P-1', 'P-1', 'P-2'], 'a charge ran again'
    requests = (ledger / 'model-requests').read_text().splitlines()
    assert requests.count('P-1:0') == 1 and requests.count('P-1:1') == 1, requests  # cached: not requested again


def _ledger_deployment(prefect_api_url: str, tmp_path: Path, **extra_env: str) -> tuple[dict[str, str], list[str], str]:
    """The environment, `durcap schedule prefect` argv (`--limit 1`) and deployment URL of a fresh ledger deployment."""
    agent_name = f'ledger-{uuid.uuid4().hex[:6]}'
    deployment = f'pending-{uuid.uuid4().hex[:6]}'
    env = {'PREFECT_API_URL': prefect_api_url, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
           'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'results'), 'DURCAP_LEDGER_DIR': str(tmp_path / 'ledger'),
           'DURCAP_LEDGER_AGENT': agent_name, 'DURCAP_LEDGER_CHARGE_SECONDS': '0.5',
           'PREFECT_RUNNER_POLL_FREQUENCY': '1', **extra_env}
    argv = [*DURCAP, 'schedule', 'prefect', 'tests/engines/ledger_agent.py:agent', '--prompt', 'charge order P-0',
            '--interval', '86400', '--name', deployment, '--limit', '1']
    return env, argv, f'{prefect_api_url}/deployments/name/{FLOW_PREFIX}{agent_name}/{deployment}'


def _create_flow_run(prefect_api_url: str, url: str, order: str, proc: subprocess.Popen[bytes]) -> str:
    """Create a flow run of the deployment at `url` once `serve` has created it (REST: this process's Prefect
    settings point elsewhere); returns its id."""
    import httpx

    deadline = time.monotonic() + 120
    while (found := httpx.get(url, timeout=10)).status_code == 404:  # `serve` creates it after its first lines
        assert time.monotonic() < deadline and proc.poll() is None, 'no deployment'
        time.sleep(0.3)
    deadline = time.monotonic() + 30
    while True:  # a busy shared server on SQLite answers 503 for a moment: retried
        response = httpx.post(f'{prefect_api_url}/deployments/{found.json()["id"]}/create_flow_run',
                              json={'parameters': {'prompt': f'charge order {order}', 'deps': None}}, timeout=10)
        if response.status_code < 300 or time.monotonic() > deadline:
            assert response.status_code < 300, (response.status_code, response.text)
            return response.json()['id']
        time.sleep(0.3)


def _states(prefect_api_url: str, flow_run_id: str) -> list[dict]:
    """Flow run `flow_run_id`'s state history, oldest first (Prefect's REST API)."""
    import httpx

    states = httpx.get(f'{prefect_api_url}/flow_run_states/', params={'flow_run_id': flow_run_id}, timeout=10).json()
    return sorted(states, key=lambda s: s['timestamp'])


def test_a_prefect_flow_run_left_pending_by_a_killed_serving_process_is_finished_by_another(
        prefect_api_url: str, tmp_path: Path) -> None:
    """Issue 29 item 3, on the session's Prefect server; model: the ledger agent's scripted `FunctionModel`. A serving
    process takes a flow run (PENDING) and is SIGKILLed, with its whole process group, before the run's process exists:
    its fork server is stopped (SIGSTOP), so the fork hangs and the run carries no beat label at all (the kill bench's
    lost run: forked 0.5 s before the kill, never RUNNING). A serving process started afterwards finds the PENDING
    run silent (`_liveness.DeadRunWatch`), marks it CRASHED, reschedules it and runs it: it completes with no operator
    action, its charge made once and each model request once. Before PENDING runs were watched it stayed PENDING."""
    import httpx

    env, argv, url = _ledger_deployment(prefect_api_url, tmp_path, DURCAP_PREFECT_BEAT_SECONDS='1',
                                        DURCAP_PREFECT_STALE_SECONDS='5')
    ledger = tmp_path / 'ledger'
    taker = start(argv, tmp_path / 'taker.log', env)
    survivor = None
    try:
        wait_for(tmp_path / 'taker.log', 'flow runs start from a fork server', taker, 120)
        forkers = [c for c in _children(taker.pid) if 'multiprocessing.forkserver' in _args(c)]
        assert len(forkers) == 1, forkers
        os.kill(forkers[0], signal.SIGSTOP)  # the taker's next fork hangs: its run stays PENDING, unlabelled
        run = _create_flow_run(prefect_api_url, url, 'P-1', taker)
        deadline = time.monotonic() + 60
        while httpx.get(f'{prefect_api_url}/flow_runs/{run}', timeout=10).json()['state_type'] != 'PENDING':
            assert time.monotonic() < deadline, (tmp_path / 'taker.log').read_text()[-3000:]
            time.sleep(0.05)
        os.killpg(taker.pid, signal.SIGKILL)  # the serving process, its fork server: nobody reports anything
        taker.wait(timeout=30)
        assert httpx.get(f'{prefect_api_url}/flow_runs/{run}', timeout=10).json()['state_type'] == 'PENDING'
        survivor = start(argv, tmp_path / 'survivor.log', env)
        deadline = time.monotonic() + 150
        while (state := httpx.get(f'{prefect_api_url}/flow_runs/{run}', timeout=10).json())['state_type'] != 'COMPLETED':
            assert time.monotonic() < deadline, (state['state_type'], (tmp_path / 'survivor.log').read_text()[-3000:])
            assert survivor.poll() is None, (tmp_path / 'survivor.log').read_text()[-3000:]
            time.sleep(0.3)
    finally:
        kill(taker)
        if survivor is not None:
            kill(survivor)
    said = (tmp_path / 'survivor.log').read_text()
    assert f'prefect flow run {run}' in said and 'PENDING) stopped beating' in said, said[-3000:]
    kinds = [s['type'] for s in _states(prefect_api_url, run)]
    assert kinds.count('CRASHED') == 1 and kinds[-1] == 'COMPLETED', kinds
    assert (ledger / 'charges').read_text().splitlines() == ['P-1'], 'the charge ran again'
    requests = (ledger / 'model-requests').read_text().splitlines()
    assert sorted(requests) == sorted(set(requests)), requests  # each model request once


STALE = 5
"""`$DURCAP_PREFECT_STALE_SECONDS` of the spawned-run test (seconds; the default 15 s would make the test wait 20 s)."""


def test_a_spawned_prefect_flow_run_pending_longer_than_the_stale_time_is_not_declared_dead(
        prefect_api_url: str, tmp_path: Path) -> None:
    """Issue 29 item 3, on the session's Prefect server; model: the ledger agent's scripted `FunctionModel`. With
    `--spawn` a flow run stays PENDING while its new Python process imports Prefect, pydantic-ai and the target
    (here a slow one: 8 s), longer than the stale time (5 s here; 15 s by default): the serving process beats it meanwhile
    (`_prefork.beat_spawned`), so the watch that declares silent PENDING runs dead leaves it alone: it completes on
    its first try, never CRASHED (and its flow, whose serving process beats it, does not beat itself)."""
    import httpx

    env, argv, url = _ledger_deployment(prefect_api_url, tmp_path, DURCAP_PREFECT_BEAT_SECONDS='1',
                                        DURCAP_PREFECT_STALE_SECONDS=str(STALE), DURCAP_LEDGER_IMPORT_SECONDS='8')
    serving = start([*argv, '--spawn'], tmp_path / 'serve.log', env)
    try:
        run = _create_flow_run(prefect_api_url, url, 'P-1', serving)
        deadline = time.monotonic() + 150
        while (state := httpx.get(f'{prefect_api_url}/flow_runs/{run}', timeout=10).json())['state_type'] != 'COMPLETED':
            assert time.monotonic() < deadline, (state['state_type'], (tmp_path / 'serve.log').read_text()[-3000:])
            assert state['state_type'] in ('SCHEDULED', 'PENDING', 'RUNNING'), (tmp_path / 'serve.log').read_text()[-3000:]
            time.sleep(0.3)
    finally:
        kill(serving)
    history = _states(prefect_api_url, run)
    kinds = [s['type'] for s in history]
    assert 'CRASHED' not in kinds and kinds[-1] == 'COMPLETED', kinds
    assert 'stopped beating' not in (tmp_path / 'serve.log').read_text()
    from datetime import datetime

    pending = next(datetime.fromisoformat(s['timestamp']) for s in history if s['type'] == 'PENDING')
    running = next(datetime.fromisoformat(s['timestamp']) for s in history if s['type'] == 'RUNNING')
    assert (running - pending).total_seconds() > STALE, 'the run was not PENDING past the stale time: nothing was shown'
    assert (tmp_path / 'ledger' / 'charges').read_text().splitlines() == ['P-1']


def test_a_prefect_flow_run_whose_serving_process_alone_was_killed_beats_itself_and_completes_once(
        prefect_api_url: str, tmp_path: Path) -> None:
    """Issue 29 item 3, on the session's Prefect server; model: the ledger agent's scripted `FunctionModel`. Two
    serving processes share a deployment; the one whose flow-run process is charging is SIGKILLed alone (its fork
    server exits with it; the forked flow-run process lives on). The serving process beat the run until then
    (`_prefork`); the run's own process now beats it (`_liveness.beating`, `HELD_ENV`), so the other serving process
    does not declare the live run dead (stale time 10 s here, the charge 20 s): it completes on its first try, never
    CRASHED, its charge made once."""
    import httpx

    env, argv, url = _ledger_deployment(prefect_api_url, tmp_path, DURCAP_PREFECT_BEAT_SECONDS='1',
                                        DURCAP_PREFECT_STALE_SECONDS='10', DURCAP_LEDGER_CHARGE_SECONDS='20')
    ledger = tmp_path / 'ledger'
    serving = [start(argv, tmp_path / f's{i}.log', env) for i in range(2)]
    try:
        for i, proc in enumerate(serving):  # ready to take runs: its fork server preloaded
            wait_for(tmp_path / f's{i}.log', 'flow runs start from a fork server', proc, 120)
        run = _create_flow_run(prefect_api_url, url, 'P-1', serving[0])
        wait_file_(ledger / 'charge-started-P-1', 150)
        forker = int((ledger / 'charge-parent-P-1').read_text())
        holder = next(p for p in serving if p.pid == _parent(str(forker)))
        survivor = next(i for i, p in enumerate(serving) if p is not holder)
        os.kill(holder.pid, signal.SIGKILL)  # the serving process alone: its flow-run process charges on
        holder.wait(timeout=30)
        deadline = time.monotonic() + 120
        while (state := httpx.get(f'{prefect_api_url}/flow_runs/{run}', timeout=10).json())['state_type'] != 'COMPLETED':
            assert time.monotonic() < deadline, (state['state_type'], (tmp_path / f's{survivor}.log').read_text()[-3000:])
            assert state['state_type'] == 'RUNNING', (tmp_path / f's{survivor}.log').read_text()[-3000:]
            time.sleep(0.3)
    finally:
        for proc in serving:
            kill(proc)
    kinds = [s['type'] for s in _states(prefect_api_url, run)]
    assert 'CRASHED' not in kinds and kinds[-1] == 'COMPLETED', kinds
    assert 'stopped beating' not in (tmp_path / f's{survivor}.log').read_text()
    assert (ledger / 'charges').read_text().splitlines() == ['P-1']


def _children(pid: int) -> list[int]:
    """The process ids of `pid`'s children (from /proc)."""
    return [int(c) for task in os.listdir(f'/proc/{pid}/task')
            for c in Path(f'/proc/{pid}/task/{task}/children').read_text().split()]


def _args(pid: int) -> str:
    """Process `pid`'s command line, its arguments joined by spaces ('' once it is gone)."""
    try:
        return Path(f'/proc/{pid}/cmdline').read_text().replace('\0', ' ')
    except OSError:
        return ''


def _parent(pid: str) -> int:
    """The parent pid of process `pid` (from /proc; the process is alive)."""
    return int(Path(f'/proc/{pid.strip()}/stat').read_text().rsplit(')', 1)[1].split()[1])


def wait_file_(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f'{path} not created within {timeout} s'
        time.sleep(0.1)
