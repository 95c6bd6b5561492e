"""Budgets on every engine (issue 28): a conversation-scoped token budget stops the third turn before its model
request; a DBOS process SIGKILLed after model requests completed, resumed by another, counts each request once.

Model: scripted `FunctionModel`s (tests/engines/budget_agent.py: 100 tokens per request; tests/engines/crash_agent.py),
no provider. Real parts: the session's Temporal dev server (an inline worker) and Prefect server, DBOS on SQLite, the
conversation store (and its budget ledger) on SQLite; every run in a subprocess (`budget_driver.py`, `drive.py`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests._helpers import ROOT, durcap, sql, subprocess_env, wait_for_file
from tests.engines.test_approvals import pending

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('budgets')]

ENGINES = ('local', 'temporal', 'dbos', 'prefect')


@pytest.fixture(scope='module')
def three_turns(temporal_address: str, prefect_api_url: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per engine, at once (one driver process each): three turns of one conversation under `Budget(total_tokens=150,
    scope='conversation')`; `{engine: (turns, store URL, conversation, model request log lines)}`."""
    tmp = tmp_path_factory.mktemp('budgets')
    store = f'sqlite:///{tmp / "conversations.db"}'
    name = f'budgeted_{uuid.uuid4().hex[:6]}'
    procs = {}
    for engine in ENGINES:
        conversation = f'{engine}-{uuid.uuid4().hex[:6]}'
        env = subprocess_env({'DURCAP_BUDGET_AGENT': name, 'DURCAP_BUDGET_LOG': str(tmp / f'{engine}.log'),
                              'DURCAP_TEST_TEMPORAL_ADDRESS': temporal_address, 'PREFECT_API_URL': prefect_api_url})
        procs[engine] = (conversation, subprocess.Popen(
            [sys.executable, '-m', 'tests.engines.budget_driver', engine, conversation, store], cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
    results = {}
    try:
        for engine, (conversation, proc) in procs.items():
            out, _ = proc.communicate(timeout=240)
            assert proc.returncode == 0 and 'REPORT ' in out, out[-3000:]
            log = tmp / f'{engine}.log'
            results[engine] = (json.loads(out.split('REPORT ', 1)[1].splitlines()[0]), store, conversation,
                               log.read_text().splitlines() if log.exists() else [])
    finally:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return results


@pytest.mark.parametrize('engine', ENGINES)
def test_conversation_budget_stops_the_third_turn_before_its_model_request(engine: str, three_turns: dict) -> None:
    """Turns 1 and 2 complete (100 tokens each: the second passes the limit of 150, admitted while the spend was 100);
    turn 3 fails with DC060 naming the budget, its key, spent and limit, and the model never saw its prompt. The
    ledger holds exactly the two requests' usage, and each turn's `RunReport.budget` its spend so far."""
    turns, store, conversation, requests = three_turns[engine]
    first, second, third = turns
    assert first['ok'] and second['ok'], turns
    assert first['budget']['spent']['total_tokens'] == 100 and second['budget']['spent']['total_tokens'] == 200
    assert not third['ok'], turns
    key = f'conversation:{conversation}'
    assert f"DC060 budget total_tokens of key '{key}' is spent: 200 tokens of the limit 150 tokens" in third['message']
    assert requests == [f'{conversation} turn 1', f'{conversation} turn 2'], requests  # no request of turn 3
    rows = sql(store, 'SELECT input_tokens, output_tokens, total_tokens, requests FROM durcap_budget_ledger '
                      'WHERE budget_key = :k', {'k': key})
    assert rows == [(120, 80, 200, 2)]
    assert sql(store, "SELECT COUNT(*) FROM durcap_budget_reservations WHERE budget_key = :k AND state = 'reserved'",
               {'k': key}) == [(0,)]


def test_dbos_process_killed_after_model_requests_counts_each_once(spawn, tmp_path: Path) -> None:
    """A DBOS process SIGKILLed in a tool after three model requests completed (each settled in the ledger); another
    process recovers the workflow: the ledger of the run-scoped budget holds 4 requests, and exactly the tokens the
    provider (the scripted model) reported for the 4 responses of the run."""
    store = f'sqlite:///{tmp_path / "conversations.db"}'
    crash_dir = tmp_path / 'crash'
    workflow_id = f'budget-crash-{uuid.uuid4()}'
    env = {'DURCAP_CRASH_DIR': str(crash_dir), 'DURCAP_CRASH_AGENT': f'crashy-{uuid.uuid4().hex[:8]}',
           'DURCAP_CRASH_BUDGET': '1', 'DURCAP_STORE': store}
    args = ('dbos', 'run', '--target', 'tests.engines.crash_agent:agent', '--db', f'sqlite:///{tmp_path / "dbos.sqlite"}',
            '--workflow-id', workflow_id)
    first = spawn(*args, env=env)
    wait_for_file(crash_dir / 'slow-started', 90)
    first.kill9()
    report = spawn(*args, env=env).report(timeout=120)
    assert report['output'] == 'charged and exported'
    assert (crash_dir / 'model-requests').read_text().splitlines() == ['0', '1', '2', '3']  # none ran twice
    reported = [m['usage'] for m in report['new_messages'] if m['kind'] == 'response']
    assert len(reported) == 4
    rows = sql(store, 'SELECT input_tokens, output_tokens, requests FROM durcap_budget_ledger WHERE budget_key = :k',
               {'k': f'run:{workflow_id}'})
    assert rows == [(sum(u['input_tokens'] for u in reported), sum(u['output_tokens'] for u in reported), 4)]


def test_dbos_spent_budget_waits_for_approval_approve_raises_it_deny_fails_the_run(spawn, tmp_path: Path) -> None:
    """`Budget(total_tokens=50, on_exceed='approval')`, 100 tokens a request, on DBOS: turn 1 completes (spend 100);
    turn 2 waits as a durable approval of `durcap_raise_budget` ("raise total_tokens of the key by 51?"), `durcap
    approve` raises the limit to 101 and the turn completes; turn 3 waits again, `durcap deny` fails it with DC060
    before its model request. The model saw 2 requests, never the raise calls."""
    store = f'sqlite:///{tmp_path / "conversations.db"}'
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    conversation = f'approve-{uuid.uuid4().hex[:6]}'
    log = tmp_path / 'requests.log'
    env = {'DURCAP_STORE': store, 'DURCAP_BUDGET_AGENT': f'budget_gate_{uuid.uuid4().hex[:6]}', 'DURCAP_BUDGET_LIMIT': '50',
           'DURCAP_BUDGET_ON_EXCEED': 'approval', 'DURCAP_BUDGET_LOG': str(log)}
    engine_args = ['--engine', 'dbos', '--db', db]

    def turn(n: int) -> tuple[str, Any]:
        run_id = f'{conversation}-{n}'
        return run_id, spawn('dbos', 'run', '--target', 'tests.engines.budget_agent:agent', '--db', db, '--workflow-id',
                             run_id, '--prompt', f'turn {n}', '--conversation', conversation, env=env)

    _, first = turn(1)
    assert first.report(timeout=120)['output'] == 'answer to turn 1'
    second_id, second = turn(2)
    [call] = pending(engine_args, second_id)
    assert call['tool_name'] == 'durcap_raise_budget'
    assert call['args'] == {'budget': 'total_tokens', 'key': f'conversation:{conversation}', 'by': 51, 'spent': 100,
                            'limit': 50, 'store': store}
    approved = durcap('approve', second_id, call['call_id'], *engine_args, env=env)
    assert approved.returncode == 0, approved.stderr
    assert second.report(timeout=120)['output'] == 'answer to turn 2'
    third_id, third = turn(3)
    [call] = pending(engine_args, third_id)
    denied = durcap('deny', third_id, call['call_id'], '--reason', 'enough for today', '--by', 'alice', *engine_args, env=env)
    assert denied.returncode == 0, denied.stderr
    line = third.wait_for('DC060', timeout=120)
    assert (f"DC060 budget total_tokens for key 'conversation:{conversation}': spent 200 tokens of limit 101 tokens; the "
            'raise by 101 was denied by alice (enough for today); the model request was not sent. Fix: approve a raise '
            'when the next run asks for one') in line, line
    assert log.read_text().splitlines() == ['turn 1', 'turn 2']
    assert sql(store, 'SELECT total_tokens, requests, raised FROM durcap_budget_ledger') == [(200, 2, '{"total_tokens": 51}')]


def test_twenty_concurrent_runs_of_one_tenant_on_postgresql(store_url: str) -> None:
    """tests/unit/test_budgets.py's 20 concurrent runs of one tenant key, the ledger on a fresh PostgreSQL database
    (`store_url` under tests/engines; row locks `SELECT ... FOR UPDATE`, commits with `synchronous_commit = off`): at
    most 10 + 20 requests billed and exactly their tokens recorded."""
    from tests.unit.test_budgets import twenty_concurrent_runs

    assert store_url.startswith('postgresql')
    _, billed = twenty_concurrent_runs(store_url)
    assert 10 <= billed <= 30


@pytest.mark.parametrize('engine', ['temporal', 'prefect'])
def test_spent_budget_waits_for_approval_approve_raises_it_deny_fails_the_run(
        engine: str, spawn, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The DBOS test above on Temporal (an inline worker on the session's dev server; the decision is a workflow update)
    and on Prefect (the session's server; the flow run pauses, the decision is its input and a resume): one driver
    process runs the three turns of one conversation (`runner.run`, as `durcap run` does) under `Budget(total_tokens=50,
    on_exceed='approval')`, and lists the calls its runs wait on (`runner.approvals`, what `durcap approvals list`
    prints; the DBOS test lists them with the CLI). Turn 1 completes (spend 100); turn 2 waits for
    `durcap_raise_budget`, `durcap approve` raises the limit by 51 and the turn completes; turn 3 waits again, `durcap
    deny` fails it with DC060 before its model request. The model saw 2 requests. Model: the scripted `FunctionModel`
    of tests/engines/budget_agent.py."""
    store = f'sqlite:///{tmp_path / "conversations.db"}'
    conversation = f'approve-{engine}-{uuid.uuid4().hex[:6]}'
    log = tmp_path / 'requests.log'
    env = {'DURCAP_STORE': store, 'DURCAP_BUDGET_AGENT': f'budget_gate_{uuid.uuid4().hex[:6]}', 'DURCAP_BUDGET_LIMIT': '50',
           'DURCAP_BUDGET_ON_EXCEED': 'approval', 'DURCAP_BUDGET_LOG': str(log)}
    if engine == 'temporal':
        address = request.getfixturevalue('temporal_address')
        env['DURCAP_TEST_TEMPORAL_ADDRESS'] = address
        engine_args = ['--engine', 'temporal', '--address', address]
    else:
        env['PREFECT_API_URL'] = request.getfixturevalue('prefect_api_url')
        engine_args = ['--engine', 'prefect']

    def waiting(n: int) -> tuple[str, dict]:
        run_id = proc.wait_for(f'TURN {n} STARTED ', 120).split(f'TURN {n} STARTED ', 1)[1].strip()
        call = json.loads(proc.wait_for(f'TURN {n} WAITING ', 120).split(f'TURN {n} WAITING ', 1)[1])
        assert call['run_id'] == run_id
        return run_id, call

    def outcome(n: int) -> dict:
        line = proc.wait_for(f'TURN {n} {{', 120)
        return json.loads(line.split(f'TURN {n} ', 1)[1])

    proc = spawn(engine, 'turns', '--target', 'tests.engines.budget_agent:agent', '--conversation', conversation,
                 '--store', store, env=env)
    first = outcome(1)
    assert first['ok'] and first['output'] == f'answer to {conversation} turn 1', first
    second_id, call = waiting(2)
    assert call['tool_name'] == 'durcap_raise_budget' and call['engine'] == engine
    assert {k: v for k, v in call['args'].items() if k != 'store'} == {
        'budget': 'total_tokens', 'key': f'conversation:{conversation}', 'by': 51, 'spent': 100, 'limit': 50}
    approved = durcap('approve', second_id, call['call_id'], *engine_args, env=env)
    assert approved.returncode == 0, approved.stdout + approved.stderr
    second = outcome(2)
    assert second['ok'] and second['output'] == f'answer to {conversation} turn 2', second
    assert second['budget']['raised'] == {'total_tokens': 51} and second['budget']['spent']['total_tokens'] == 200
    third_id, call = waiting(3)
    denied = durcap('deny', third_id, call['call_id'], '--reason', 'enough for today', '--by', 'alice', *engine_args, env=env)
    assert denied.returncode == 0, denied.stdout + denied.stderr
    third = outcome(3)
    assert not third['ok'], third
    assert (f"DC060 budget total_tokens for key 'conversation:{conversation}': spent 200 tokens of limit 101 tokens; the "
            'raise by 101 was denied by alice (enough for today); the model request was not sent.') in third['message'], third
    assert log.read_text().splitlines() == [f'{conversation} turn 1', f'{conversation} turn 2']
    assert sql(store, 'SELECT total_tokens, requests, raised FROM durcap_budget_ledger') == [(200, 2, '{"total_tokens": 51}')]


def test_a_fork_inherits_the_spend_of_its_kept_turns_on_postgresql(store_url: str) -> None:
    """tests/unit/test_history_fork.py's fork-budget test, the ledger on a fresh PostgreSQL database (`store_url` under
    tests/engines: the time cut compares ISO 8601 strings with the "C" collation there)."""
    from tests.unit.test_history_fork import test_a_fork_inherits_the_spend_and_raises_of_the_turns_it_keeps as on

    assert store_url.startswith('postgresql')
    on(store_url)


def test_ledger_counts_a_settled_request_once_releases_and_resets_on_postgresql(store_url: str) -> None:
    """tests/unit/test_budgets.py's `ledger_semantics` on a fresh PostgreSQL database (the settle's row lock, the
    relaxed connections' `synchronous_commit=off`). No model."""
    from tests.unit.test_budgets import ledger_semantics

    assert store_url.startswith('postgresql')
    ledger_semantics(store_url)
