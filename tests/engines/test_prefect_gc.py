"""`durcap store gc` on a real Prefect server: the tool-result pieces of a flow run whose process was killed and that
nobody resumes are freed; a live run's are kept (issue 24).

Model: the scripted `FunctionModel` of tests/engines/size_agent.py (no provider). Real parts: the Prefect server at
`$DURCAP_TEST_PREFECT_API_URL` (else one started for the session), a SQLite conversation store, each turn a
`size_driver` subprocess (`durcap run --engine prefect`'s path: a flow run outside a deployment, run in that process)
killed with SIGKILL, and `durcap store gc` / `durcap runs resume` / `durcap store stats` / `durcap history delete` as
subprocesses.

Conversation A's flow run: its tools return 2,000 and 5,000 characters (each result's text a piece owned by
`prefect:<A>`), then its process is killed in the third tool call: the run stays RUNNING in Prefect for good (nobody
marks a flow run outside a deployment CRASHED). Conversation B's flow run: 2,000 (the same text as A's: one shared
piece) and 7,000 characters, then it waits in its third tool call, alive and beating. After both have been silent /
waiting longer than `--abandoned-after 6s`, gc (retention 1 s, grace 0) frees A's own piece only; B's pieces and the
shared one stay. Then B's process is killed and `durcap runs resume` finishes B from its cached tool results (read
back from the pieces: its first two tools do not run again).

Without the change this fails: gc did not ask Prefect at all (its pieces were never freed), and a flow run outside a
deployment did not beat, so B waiting in a tool for 6 s would have looked as silent as A (run with `_flow.py` of main:
gc freed B's pieces too); `history delete` of A's conversation said "not found" (only its run's turn claim was there).
The second test: a new turn of a killed run's conversation, refused with DC050 for good before.
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

from durable_capabilities.engines.prefect._results import piece_digest
from tests._helpers import durcap, sqlite_url, subprocess_env, wait_for, wait_for_line
from tests.unit.test_history_delete import everything

pytestmark = [pytest.mark.slow]

TARGET = 'tests.engines.size_agent:agent'
ABANDONED_AFTER = 6.0
"""`--abandoned-after` in seconds: B waits in its tool longer than this, beating every `BEAT` seconds."""
BEAT = '0.5'


def _env(api: str, tmp_path: Path, store: str, ledger: Path | None = None, hold: str | None = None) -> dict[str, str]:
    extra = {'PREFECT_API_URL': api, 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
             'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'prefect-results'), 'DURCAP_STORE': store,
             'DURCAP_PREFECT_BEAT_SECONDS': BEAT, 'PREFECT_SERVER_ANALYTICS_ENABLED': 'false'}
    if ledger is not None:
        extra['DURCAP_LEDGER'] = str(ledger)
    if hold is not None:
        extra['DURCAP_TOOL_HOLD_AFTER'] = hold
    return extra


def _turn(conversation: str, prompt: str, env: dict[str, str], cwd: Path, name: str) -> tuple[subprocess.Popen[bytes], Path]:
    log = cwd / f'{name}.log'
    with open(log, 'wb') as handle:
        popen = subprocess.Popen([sys.executable, '-m', 'tests.engines.size_driver', 'prefect', '--conversation',
                                  conversation, '--prompt', prompt], cwd=cwd, stdout=handle, stderr=subprocess.STDOUT,
                                 start_new_session=True, env=subprocess_env(env))
    return popen, log


def _kill(popen: subprocess.Popen[bytes]) -> None:
    if popen.poll() is None:
        os.killpg(popen.pid, signal.SIGKILL)
    popen.wait(timeout=30)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def _refs(store: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for digest, owner, _ in everything(store)['durcap_payload_refs']:
        found.setdefault(owner, set()).add(digest)
    return found


def _beats(api: str, flow_run_id: str) -> bool:
    """The flow run carries its beat label (`_liveness.BEAT_LABEL`): its process has beaten at least once (on a busy
    server a beat can take seconds to land)."""
    import httpx

    response = httpx.get(f'{api.rstrip("/")}/flow_runs/{flow_run_id}', timeout=30)
    return response.status_code == 200 and 'durcap.beat' in (response.json().get('labels') or {})


def _piece(size: int) -> str:
    return piece_digest('x' * size)


def test_gc_frees_the_pieces_of_a_killed_prefect_run_nobody_resumes_and_keeps_a_live_ones(
        prefect_api_url: str, temporal_address: str, tmp_path: Path) -> None:
    store = sqlite_url(tmp_path)
    tag = uuid.uuid4().hex[:8]
    conv_a, conv_b = f'pgc-a-{tag}', f'pgc-b-{tag}'
    ledger_a, ledger_b = tmp_path / 'ledger-a', tmp_path / 'ledger-b'
    shared, only_a, only_b = _piece(2000), _piece(5000), _piece(7000)

    a, log_a = _turn(conv_a, 'sizes 2000 5000 1500', _env(prefect_api_url, tmp_path, store, ledger_a, hold='2'),
                     tmp_path, 'a')
    try:
        # The third call runs (its ledger line written): the first two results are stored, A's pieces. Killed there,
        # with its whole process group: nobody reports anything and the flow run stays RUNNING.
        wait_for(lambda: len(_lines(ledger_a)) == 3, 180, message=lambda: log_a.read_text(errors='replace')[-3000:])
        owners = [o for o in _refs(store) if o.startswith('prefect:')]
        assert len(owners) == 1, owners
        owner_a = owners[0]
        wait_for(lambda: _beats(prefect_api_url, owner_a.removeprefix('prefect:')), 60, message='A never beat')
    finally:
        _kill(a)
    killed_at = time.monotonic()
    assert _refs(store)[owner_a] == {shared, only_a}

    b, log_b = _turn(conv_b, 'sizes 2000 7000 1500', _env(prefect_api_url, tmp_path, store, ledger_b, hold='2'),
                     tmp_path, 'b')
    try:
        wait_for(lambda: len(_lines(ledger_b)) == 3, 180, message=lambda: log_b.read_text(errors='replace')[-3000:])
        owner_b = next(o for o in _refs(store) if o.startswith('prefect:') and o != owner_a)
        assert _refs(store)[owner_b] == {shared, only_b}
        wait_for(lambda: _beats(prefect_api_url, owner_b.removeprefix('prefect:')), 60, message='B never beat')
        waiting_since = time.monotonic()
        # What is tested is time without a sign of life: A silent, and B (alive, in its tool) making no task run
        # update, each for longer than --abandoned-after. Nothing to await but the clock.
        time.sleep(max(0.0, ABANDONED_AFTER + 1.5 - (time.monotonic() - max(killed_at, waiting_since))))
        assert b.poll() is None, log_b.read_text(errors='replace')[-3000:]

        env = _env(prefect_api_url, tmp_path, store)
        # `store stats` attributes A's pieces to conversation A (no turn stored: its run holds the turn claim).
        stats = durcap('store', 'stats', '--store', store, '--format', 'json', env=env, timeout=120)
        assert stats.returncode == 0, stats.stderr
        found = {c['conversation_id']: c for c in json.loads(stats.stdout)['conversations']}
        sizes = {row[0]: row[1] for row in everything(store)['durcap_payloads']}
        assert found[conv_a]['message_count'] == 0 and found[conv_a]['payload_bytes'] == sizes[only_a], found
        assert found[conv_a]['shared_payload_bytes'] == sizes[shared] == found[conv_b]['shared_payload_bytes'], found

        args = ('store', 'gc', '--store', store, '--retention', '1s', '--grace', '0s', '--abandoned-after',
                f'{ABANDONED_AFTER:g}s')
        before = everything(store)
        # Without --retention: the server keeps flow runs until deleted (no flow run vacuum), so gc keeps A and says
        # so, naming A as abandoned all the same.
        forever = durcap('store', 'gc', '--store', store, '--grace', '0s', '--abandoned-after', f'{ABANDONED_AFTER:g}s',
                         env=env, timeout=120)
        assert forever.returncode == 0, forever.stdout + forever.stderr
        assert 'prefect keeps its runs until deleted' in forever.stdout.splitlines()[0], forever.stdout
        assert 'would free 0 piece(s)' in forever.stdout and f'treated as abandoned: {owner_a}' in forever.stdout
        plan = durcap(*args, '--format', 'json', env=env, timeout=120)
        assert plan.returncode == 0, plan.stdout + plan.stderr
        assert everything(store) == before  # a dry run
        data = json.loads(plan.stdout)
        assert [o['owner'] for o in data['owners']] == [owner_a], data
        assert data['owners'][0]['reason'].startswith('abandoned on prefect (RUNNING, no beat'), data['owners'][0]
        assert list(data['abandoned']) == [owner_a], data['abandoned']
        assert data['freed'] == {'refs': 2, 'payloads': 1, 'payload_bytes': sizes[only_a]}, data
        assert data['kept_shared']['payloads'] == 1 and data['kept_owners'] == {'open': 1}, data
        text = durcap(*args, env=env, timeout=120)
        assert f'treated as abandoned: {owner_a} (prefect: RUNNING, no beat' in text.stdout, text.stdout
        assert 'would be collected' in text.stdout and owner_b not in text.stdout, text.stdout
        # A worker's scheduled gc takes the same setting (`--gc-abandoned-after`, passed through; without it the
        # default 1 h kept A): its dry-run pass names A's piece and counts A as abandoned.
        _worker_gc_pass(env, store, temporal_address, tmp_path, sizes[only_a])
        assert everything(store) == before

        done = durcap(*args, '--apply', '--format', 'json', env=env, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout)['freed'] == data['freed']
        left = {row[0] for row in everything(store)['durcap_payloads']}
        assert only_a not in left and {shared, only_b} <= left
        assert owner_a not in _refs(store) and _refs(store)[owner_b] == {shared, only_b}
        assert b.poll() is None  # B never noticed
    finally:
        _kill(b)

    # B, killed in its third tool call, finishes from its cached results: the pieces gc kept are read back, so its
    # first two tools do not run again (only the third, which never returned).
    env = _env(prefect_api_url, tmp_path, store)
    resumed = durcap('runs', 'resume', owner_b.removeprefix('prefect:'), '--engine', 'prefect', '--target', TARGET,
                     '--store', store, env=_env(prefect_api_url, tmp_path, store, ledger_b), timeout=180)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert 'produced 10500 chars' in resumed.stdout, resumed.stdout
    assert _lines(ledger_b) == ['2000', '7000', '1500', '1500']
    assert _lines(ledger_a) == ['2000', '5000', '1500']  # A was never resumed

    # `history delete` of A (no turn stored, only its dead run's claim and what gc left of it): found, and its claim
    # goes, so the conversation takes turns again; B untouched.
    b_rows = {k: [r for r in v if conv_b in map(str, r)] for k, v in everything(store).items()}
    deleted = durcap('history', 'delete', conv_a, '--store', store, '--yes', '--format', 'json', env=env, timeout=120)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    assert not [r for v in everything(store).values() for r in v if conv_a in map(str, r)]
    assert {k: [r for r in v if conv_b in map(str, r)] for k, v in everything(store).items()} == b_rows


def _worker_gc_pass(env: dict[str, str], store: str, temporal_address: str, cwd: Path, freed_bytes: int) -> None:
    """`durcap worker temporal --gc-every 1s --gc-abandoned-after 6s` (a dry run, retention 1 s, grace 0): its first
    pass logs one piece of one workflow, A treated as abandoned; the worker is stopped by process group."""
    log = cwd / 'gc-worker.log'
    with open(log, 'wb') as handle:
        worker = subprocess.Popen(
            [sys.executable, '-m', 'durable_capabilities.cli', 'worker', 'temporal', TARGET, '--address', temporal_address,
             '--store', store, '--task-queue', f'pgc-{uuid.uuid4().hex[:8]}', '--gc-every', '1s', '--gc-retention', '1s',
             '--gc-grace', '0s', '--gc-abandoned-after', f'{ABANDONED_AFTER:g}s'],
            cwd=cwd, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True, env=subprocess_env(env))
    try:
        line = wait_for_line(log, 'store gc: would free ', 180, alive=lambda: worker.poll() is None)
        assert line.startswith(f'store gc: would free 1 piece(s), {freed_bytes:,} bytes, of 1 workflow(s);'), line
        assert line.endswith('; 1 treated as abandoned (dry run: --gc-apply deletes)'), line
        assert f'(dry run, logged; abandoned after {ABANDONED_AFTER:g}s)' in log.read_text(errors='replace')
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)


def test_a_new_turn_takes_over_the_conversation_a_killed_prefect_run_outside_a_deployment_left_claimed(
        prefect_api_url: str, tmp_path: Path) -> None:
    """The same killed run holds its conversation's turn claim, and its flow run stays RUNNING for good: every later
    turn of the conversation was refused (DC050, `busy='reject'`) or waited forever (`'enqueue'`). A holder that has
    not beaten for `$DURCAP_PREFECT_STALE_SECONDS` (2 s here) is dead: the next turn takes the claim over and runs."""
    store = sqlite_url(tmp_path)
    conversation = f'pgc-claim-{uuid.uuid4().hex[:8]}'
    ledger = tmp_path / 'ledger'
    env = _env(prefect_api_url, tmp_path, store, ledger, hold='1') | {'DURCAP_PREFECT_STALE_SECONDS': '2'}
    first, log = _turn(conversation, 'sizes 2000 3000', env, tmp_path, 'first')
    try:
        wait_for(lambda: len(_lines(ledger)) == 2, 180, message=lambda: log.read_text(errors='replace')[-3000:])
        flow_run_id = log.read_text().split('prefect flow run id: ', 1)[1].split()[0]
        wait_for(lambda: _beats(prefect_api_url, flow_run_id), 60, message='the first run never beat')
    finally:
        _kill(first)
    time.sleep(2.5)  # the stale time itself is what is tested: nothing to await but the clock
    env.pop('DURCAP_TOOL_HOLD_AFTER')
    second, log2 = _turn(conversation, 'hello', env, tmp_path, 'second')
    try:
        second.wait(timeout=180)
    finally:
        _kill(second)
    out = log2.read_text(errors='replace')
    assert 'REPORT ' in out, out[-3000:]
    assert json.loads(out.split('REPORT ', 1)[1].splitlines()[0])['output'].startswith('seen '), out[-3000:]

    # `history delete` names both runs and deletes the killed one's piece too (its first tool's result; it was killed
    # in the second): its claim, taken over, stays tied to the conversation (`durcap_turn_takeovers`). Before, only the
    # new flow run was listed and the killed run's piece was left behind.
    killed = f'prefect:{flow_run_id}'
    assert _refs(store)[killed] == {_piece(2000)}
    plan = durcap('history', 'delete', conversation, '--store', store, '--dry-run', '--format', 'json', env=env,
                  timeout=120)
    assert plan.returncode == 0, plan.stdout + plan.stderr
    data = json.loads(plan.stdout)
    runs = [r['run_id'] for r in data['engines'] if r['engine'] == 'prefect']
    assert flow_run_id in runs and len(runs) == 2, data['engines']
    sizes = {row[0]: row[1] for row in everything(store)['durcap_payloads']}
    assert data['store']['payload_bytes'] == sizes[_piece(2000)], data['store']
    deleted = durcap('history', 'delete', conversation, '--store', store, '--yes', env=env, timeout=120)
    assert deleted.returncode == 0, deleted.stdout + deleted.stderr
    assert killed not in _refs(store) and not everything(store)['durcap_payloads'], everything(store)
    assert not [r for v in everything(store).values() for r in v if conversation in map(str, r)]
