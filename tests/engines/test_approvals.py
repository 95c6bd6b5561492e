"""Durable human approval on real servers (Temporal dev server, DBOS on SQLite and PostgreSQL).

Model: a scripted `FunctionModel` (tests/engines/approval_agent.py): it calls the gated tool
`revoke_sessions(user)` (requires approval), then answers with the tool's result text. The tool appends
one line per execution to `$DURCAP_CRASH_DIR/revocations`. Decisions go through the real CLI
(`python -m durable_capabilities.cli approve|deny`) in subprocesses; workers / DBOS processes are
subprocesses killed with SIGKILL while the run waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._helpers import ROOT, durcap, subprocess_env, wait_for

TARGET = 'tests.engines.approval_agent:gated'


def env_for(tmp_path: Path, timeout: float | None = None) -> tuple[dict[str, str], Path]:
    crash_dir = tmp_path / 'crash'
    env = {'DURCAP_CRASH_DIR': str(crash_dir), 'DURCAP_STORE': f'sqlite:///{tmp_path / "conv.db"}'}
    if timeout is not None:
        env['DURCAP_APPROVAL_TIMEOUT'] = str(timeout)
    return env, crash_dir


def start_gated_temporal(address: str, run_id: str, queue: str, prompt: str = 'revoke dave') -> None:
    """Start a `durcap.gated` workflow (tests/engines/approval_agent.py) with `prompt` as `run_id` on task queue
    `queue` of the Temporal server at `address`, from this process, and return once the server took it."""
    from durable_capabilities.engines.temporal import AgentRunInput, connect

    async def start() -> None:
        client = await connect(address)
        await client.start_workflow('durcap.gated', AgentRunInput(prompt=prompt), id=run_id, task_queue=queue)

    asyncio.run(start())


def pending(engine_args: list[str], run_id: str | None = None, timeout: float = 90) -> list[dict]:
    """Poll `durcap approvals list --format json` until a call of `run_id` (or any) waits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = durcap('approvals', 'list', *engine_args, '--format', 'json')
        assert out.returncode == 0, out.stderr
        calls = [c for c in json.loads(out.stdout) if run_id is None or c['run_id'] == run_id]
        if calls:
            return calls
        time.sleep(0.3)
    raise AssertionError(f'no pending call for {run_id} within {timeout} s')


def revocations(crash_dir: Path) -> list[str]:
    path = crash_dir / 'revocations'
    return path.read_text().splitlines() if path.exists() else []


def check_refusals(engine_args: list[str], run_id: str, call: dict, crash_dir: Path) -> None:
    """Stale fingerprint, unknown call, unknown run: exit 2, and the call still waits unchanged."""
    stale = durcap('approve', run_id, call['call_id'], '--fingerprint', '0' * 64, *engine_args)
    assert stale.returncode == 2, stale.stdout + stale.stderr
    assert 'stale-fingerprint' in stale.stderr
    unknown = durcap('approve', run_id, 'no-such-call', *engine_args)
    assert unknown.returncode == 2 and 'unknown-call' in unknown.stderr, unknown.stderr
    no_run = durcap('deny', f'no-such-run-{uuid.uuid4().hex[:6]}', call['call_id'], '--reason', 'x', *engine_args)
    assert no_run.returncode == 2 and 'unknown-run' in no_run.stderr, no_run.stderr
    assert pending(engine_args, run_id) == [call]  # nothing changed
    assert revocations(crash_dir) == []


# ---- DBOS --------------------------------------------------------------------------------------


def _dbos_db(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    return f'sqlite:///{tmp_path / "dbos.sqlite"}' if backend == 'sqlite' else request.getfixturevalue('postgres_url')


@pytest.mark.parametrize('backend', ['sqlite', 'postgresql'])
def test_dbos_approve_after_process_killed_while_waiting(backend: str, spawn, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    """On PostgreSQL the decision reaches the workflow recovered by a second process and waiting again; on SQLite it
    is made while no process runs the workflow (it reads it when recovered), and a second decision made meanwhile is
    refused naming the first (issue 13: it was accepted and silently dropped)."""
    db = _dbos_db(backend, tmp_path, request)
    env, crash_dir = env_for(tmp_path)
    run_id = f'gate-{uuid.uuid4().hex[:8]}'
    args = ('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', run_id, '--prompt', 'revoke alice')
    engine_args = ['--engine', 'dbos', '--db', db]
    first = spawn(*args, env=env)
    [call] = pending(engine_args, run_id)
    assert call['tool_name'] == 'revoke_sessions' and call['args'] == {'user': 'alice'} and call['agent'] == 'gated'
    listed = durcap('approvals', 'list', *engine_args)
    assert listed.returncode == 0 and run_id in listed.stdout and 'revoke_sessions' in listed.stdout, listed.stdout
    check_refusals(engine_args, run_id, call, crash_dir)
    first.kill9()  # SIGKILL while the workflow waits for the decision
    if backend == 'sqlite':  # decided while no process runs the workflow: the decision waits for it
        approved = durcap('approve', run_id, call['call_id'], '--by', 'alice-admin', *engine_args)
        assert approved.returncode == 0, approved.stderr
        second_decision = durcap('deny', run_id, call['call_id'], '--reason', 'no', '--by', 'bob', *engine_args)
        assert second_decision.returncode == 2, second_decision.stdout + second_decision.stderr
        said = second_decision.stderr.replace('\n', ' ')
        assert 'DC054' in said and '(already-decided)' in said and run_id in said and call['call_id'] in said, said
        assert 'already approved by alice-admin' in said and 'the run takes it at its next step, or when it runs again if its process is down' in said, said
        # Still published as pending (only the first decision was sent), and listed as decided, not yet received.
        [waiting] = pending(engine_args, run_id)
        assert waiting == {**call, 'decided': waiting['decided']}, waiting
        assert waiting['decided'].startswith('approved by alice-admin at '), waiting
        listed = durcap('approvals', 'list', *engine_args)  # too wide for a table at 160 columns: a block per call
        lines = [' '.join(line.split()) for line in listed.stdout.splitlines()]
        assert listed.returncode == 0 and f'call {call["call_id"]}' in lines, listed.stdout
        assert any(line.startswith('decided, not yet received approved by alice-admin at ') for line in lines), lines
        assert 'durcap runs resume' in listed.stderr, listed.stderr
        as_json = durcap('approvals', 'list', *engine_args, '--format', 'json')  # the note on stderr, stdout JSON
        assert json.loads(as_json.stdout)[0]['decided'] and 'durcap runs resume' in as_json.stderr, as_json.stderr
    second = spawn(*args, env=env)  # DBOS recovers the workflow: it waits again, until the same deadline
    second.wait_for('DBOS STARTED', 90)
    if backend != 'sqlite':
        approved = durcap('approve', run_id, call['call_id'], '--by', 'alice-admin', *engine_args)
        assert approved.returncode == 0, approved.stderr
    report = second.report(timeout=120)
    assert report['output'] == 'result: revoked sessions of alice'
    assert revocations(crash_dir) == ['alice']  # exactly once
    audit = [m['metadata']['durcap_approvals'] for m in report['new_messages'] if (m.get('metadata') or {}).get('durcap_approvals')]
    assert audit and audit[0][0]['decision'] == 'approved' and audit[0][0]['by'] == 'alice-admin'
    assert audit[0][0]['fingerprint'] == call['fingerprint']
    again = durcap('approve', run_id, call['call_id'], *engine_args)  # the run is over: nothing waits
    assert again.returncode == 2 and 'already approved by alice-admin' in again.stderr.replace('\n', ' '), again.stderr


def test_dbos_deny_returns_reason_and_tool_never_runs(spawn, tmp_path: Path) -> None:
    """Also traced (docs/tracing.md): the run's process and `durcap deny` export over OTLP to a receiver on
    127.0.0.1; the wait is one `durcap.approval_wait` span with the decision, in the run's trace with the run's units."""
    from durable_capabilities import telemetry
    from tests._otlp import OtlpReceiver

    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    env, crash_dir = env_for(tmp_path)
    run_id = f'gate-{uuid.uuid4().hex[:8]}'
    with OtlpReceiver() as receiver:
        env |= {'OTEL_EXPORTER_OTLP_ENDPOINT': receiver.endpoint, 'OTEL_BSP_SCHEDULE_DELAY': '100'}
        proc = spawn('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', run_id, '--prompt', 'revoke bob',
                     env=env)
        engine_args = ['--engine', 'dbos', '--db', db]
        [call] = pending(engine_args, run_id)
        denied = durcap('deny', run_id, call['call_id'], '--reason', 'bob is the CEO, ask first', *engine_args, env=env)
        assert denied.returncode == 0, denied.stderr
        report = proc.report(timeout=120)
        assert report['output'] == 'result: bob is the CEO, ask first'
        assert revocations(crash_dir) == []
        proc.popen.wait(30)  # its spans are flushed before it exits
        assert {s['trace_id'] for s in receiver.spans} == {telemetry.trace_id(run_id)}
        [wait] = [s for s in receiver.spans if s['name'] == 'durcap.approval_wait']
        assert wait['attributes']['durcap.decision'] == 'denied' and wait['attributes']['durcap.tool'] == call['tool_name']
        assert wait['attributes']['durcap.decision_reason'] == 'bob is the CEO, ask first'
        assert sum(s['name'] == 'durcap.model_request' for s in receiver.spans) >= 2


def test_dbos_timeout_denies_and_run_completes(tmp_path: Path) -> None:
    """`durcap run` (the CLI, DBOS on SQLite): while the run waits it says so once on stderr, with the run id and the
    commands that decide; nobody decides, so at the deadline the call is denied and the run completes."""
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    env, crash_dir = env_for(tmp_path, timeout=5)
    result = durcap('run', TARGET, 'revoke carol', '--engine', 'dbos', '--db', db, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'answer (dbos): result: No one approved the call to revoke_sessions before its deadline' in result.stdout
    paused = [line for line in result.stderr.splitlines() if line.startswith('paused: ')]
    assert len(paused) == 1, result.stderr
    run_id = result.stderr.split('dbos workflow id: ', 1)[1].split()[0]
    assert paused[0].startswith(f'paused: revoke_sessions({{"user": "carol"}}) waits for a person (workflow id {run_id}, '
                                'deadline '), paused[0]
    call_id = paused[0].split(f'`durcap approve {run_id} ', 1)[1].split()[0]
    commands = (f'`durcap approve {run_id} {call_id} --engine dbos --db {db}` or '
                f'`durcap deny {run_id} {call_id} --engine dbos --db {db} --reason TEXT`')
    assert paused[0].endswith(f'In another terminal: {commands}'), paused[0]
    assert revocations(crash_dir) == []


def test_dbos_workflow_drops_a_stale_decision_sent_straight_to_it(spawn, tmp_path: Path) -> None:
    """Edited arguments the tool does not take are refused by `durcap approve --args` (DC051, nothing sent). A
    decision for other arguments sent straight to the waiting workflow (`DBOSClient.send`, bypassing `decide`'s
    check) approving with other arguments is dropped by the workflow's own fingerprint check: the real decision
    that follows runs the tool once, for the reviewed arguments (without the workflow-side check, the stale one
    would run it for `mallory`)."""
    from dbos import DBOSClient

    from durable_capabilities.approvals import Decision
    from durable_capabilities.engines.dbos._spec import DECISION_TOPIC

    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    env, crash_dir = env_for(tmp_path)
    run_id = f'gate-{uuid.uuid4().hex[:8]}'
    proc = spawn('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', run_id, '--prompt', 'revoke kim', env=env)
    engine_args = ['--engine', 'dbos', '--db', db]
    [call] = pending(engine_args, run_id)
    assert call['schema']['required'] == ['user'], call  # the tool's schema is published with the call
    bad = durcap('approve', run_id, call['call_id'], '--args', '{"nope": 1}', *engine_args)
    assert bad.returncode == 2, bad.stdout + bad.stderr
    said = bad.stderr.replace('\n', ' ')
    assert 'DC051' in said and 'nope' in said and 'invalid-args' in said and 'Traceback' not in said, said
    assert pending(engine_args, run_id) == [call]  # nothing sent
    client = DBOSClient(system_database_url=db)
    try:
        stale = Decision(call['call_id'], '0' * 64, True, override_args={'user': 'mallory'}, by='mallory')
        client.send(run_id, stale.to_json(), DECISION_TOPIC)
    finally:
        client.destroy()
    approved = durcap('approve', run_id, call['call_id'], '--by', 'ops', *engine_args)
    assert approved.returncode == 0, approved.stderr
    report = proc.report(timeout=120)
    assert report['output'] == 'result: revoked sessions of kim'
    assert revocations(crash_dir) == ['kim']
    audit = [r for m in report['new_messages'] for r in (m.get('metadata') or {}).get('durcap_approvals', [])]
    assert [(r['decision'], r['by'], r['override_args']) for r in audit] == [('approved', 'ops', None)]


# ---- Temporal ----------------------------------------------------------------------------------


def test_temporal_approve_after_worker_killed_while_waiting(temporal_address: str, spawn, tmp_path: Path) -> None:
    from durable_capabilities.engines.temporal import (
        AgentRunOutput,
        connect,
    )

    env, crash_dir = env_for(tmp_path)
    queue = f'gate-{uuid.uuid4().hex[:8]}'
    worker_args = ('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue)
    engine_args = ['--engine', 'temporal', '--address', temporal_address]
    first = spawn(*worker_args, env=env)
    first.wait_for('WORKER READY', 90)
    run_id = f'gate-{uuid.uuid4().hex[:8]}'
    start_gated_temporal(temporal_address, run_id, queue)
    [call] = pending(engine_args, run_id)
    assert call['args'] == {'user': 'dave'} and call['engine'] == 'temporal'
    check_refusals(engine_args, run_id, call, crash_dir)

    async def update_directly() -> list[str]:
        # Bypassing the client-side check: the update's validator rejects the stale decision before it is recorded.
        from temporalio.api.enums.v1 import EventType
        from temporalio.client import WorkflowUpdateFailedError

        from durable_capabilities.approvals import Decision
        from durable_capabilities.engines.temporal import DECIDE_UPDATE

        client = await connect(temporal_address)
        handle = client.get_workflow_handle(run_id)
        with pytest.raises(WorkflowUpdateFailedError):
            await handle.execute_update(DECIDE_UPDATE, Decision(call['call_id'], '0' * 64, True, by='x').to_json())
        return [EventType.Name(e.event_type) async for e in handle.fetch_history_events()]

    events = asyncio.run(update_directly())
    assert not any('UPDATE' in name for name in events), events  # rejected updates leave no trace in the history
    first.kill9()  # SIGKILL while the workflow waits on its durable timer
    second = spawn(*worker_args, env=env)
    second.wait_for('WORKER READY', 90)
    approved = durcap('approve', run_id, call['call_id'], '--args', '{"user": "dave2"}', *engine_args)
    assert approved.returncode == 0, approved.stderr
    # A second decision is refused naming the first: the run's history holds the decision update it accepted (was:
    # `unknown-run`, the kind of a run that waits for nothing).
    second_decision = durcap('deny', run_id, call['call_id'], '--reason', 'no', *engine_args)
    assert second_decision.returncode == 2, second_decision.stdout + second_decision.stderr
    said = second_decision.stderr.replace('\n', ' ')
    assert said.startswith(f"durcap: error: DC054 run {run_id!r}: call {call['call_id']!r} was already approved by "), said
    assert '(already-decided)' in said and 'Fix: ' in said, said

    async def result() -> AgentRunOutput:
        client = await connect(temporal_address)
        return await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=AgentRunOutput).result(), 90)

    output = asyncio.run(result())
    assert output.output == 'result: revoked sessions of dave2'  # override_args used
    assert revocations(crash_dir) == ['dave2']  # exactly once


def test_temporal_decision_no_worker_accepted_is_refused_and_never_delivered_later(temporal_address: str, spawn,
                                                                                      tmp_path: Path) -> None:
    """Issue 26 item 5: with the run's only worker killed (SIGKILL; the dead worker is still listed as a poller for
    minutes, so the decision is sent), `durcap approve` gives up after `$DURCAP_DECISION_WAIT` with DC052
    (`not-delivered`) instead of blocking; a worker started later receives that decision (the server kept the update)
    and its validator refuses it as expired, so the call still waits: a second approval with other arguments is the one
    that runs, once. Without the `not_after` check the first decision would run the tool with `dave2` and the second
    approval would be refused."""
    from durable_capabilities.engines.temporal import AgentRunOutput, connect

    env, crash_dir = env_for(tmp_path)
    queue = f'gate-{uuid.uuid4().hex[:8]}'
    worker_args = ('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue)
    engine_args = ['--engine', 'temporal', '--address', temporal_address]
    first = spawn(*worker_args, env=env)
    first.wait_for('WORKER READY', 90)
    run_id = f'late-decision-{uuid.uuid4().hex[:8]}'
    start_gated_temporal(temporal_address, run_id, queue)
    [call] = pending(engine_args, run_id)
    first.kill9()
    gave_up = durcap('approve', run_id, call['call_id'], '--args', '{"user": "dave2"}', *engine_args,
                     env={'DURCAP_DECISION_WAIT': '2'}, timeout=60)
    assert gave_up.returncode == 2, gave_up.stdout + gave_up.stderr
    assert 'DC052' in gave_up.stderr and 'not-delivered' in gave_up.stderr, gave_up.stderr
    assert 'Traceback' not in gave_up.stderr
    second = spawn(*worker_args, env=env)
    second.wait_for('WORKER READY', 90)
    approved = durcap('approve', run_id, call['call_id'], '--args', '{"user": "dave3"}', *engine_args)
    assert approved.returncode == 0, approved.stderr

    async def result() -> AgentRunOutput:
        client = await connect(temporal_address)
        return await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=AgentRunOutput).result(), 90)

    output = asyncio.run(result())
    assert output.output == 'result: revoked sessions of dave3'
    assert revocations(crash_dir) == ['dave3']  # the expired decision never ran the tool


def test_temporal_pending_calls_listed_when_another_runs_memo_cannot_be_read(temporal_address: str,
                                                                             tmp_path: Path) -> None:
    """A running `durcap.*` workflow whose pending-calls memo is a claim check in a store this client does not use
    (started through another store) made every Temporal approval listing fail with CorruptedRowError (found by a
    helper on the shared dev server): it is skipped, the listing works. The same run, running and once terminated,
    made `durcap runs list --engine temporal` fail for the whole namespace (so a test listing runs on the shared server
    failed after this one): it is listed, with a note that its memo needs its own store. No worker, no model: the
    workflow never runs."""
    from durable_capabilities import runner
    from durable_capabilities.engines.temporal import PENDING_MEMO, connect
    from durable_capabilities.engines.temporal._runs import list_runs

    run_id = f'unreadable-memo-{uuid.uuid4().hex[:8]}'

    other = {'address': temporal_address, 'store': f'sqlite:///{tmp_path / "other.db"}'}

    async def listed_runs(status: str) -> list:  # visibility lags the start and the termination a little
        for _ in range(100):
            if infos := [info for info in await list_runs(other, status=status, limit=1000) if info.run_id == run_id]:
                return infos
            await asyncio.sleep(0.1)
        return []

    async def scenario() -> tuple[list, list, list]:
        private = await connect(temporal_address, store=f'sqlite:///{tmp_path / "private.db"}')
        big = [{'call_id': f'c{i}', 'padding': 'x' * 20_000} for i in range(2)]  # over the 16 KiB threshold
        handle = await private.start_workflow('durcap.unreadable', id=run_id, task_queue=f'none-{uuid.uuid4().hex[:8]}',
                                              memo={PENDING_MEMO: big})
        try:
            calls = await runner.approvals(engine='temporal', **other)
            running = await listed_runs('running')
        finally:
            await handle.terminate('test done')
        return calls, running, await listed_runs('cancelled')

    calls, running, terminated = asyncio.run(scenario())
    assert all(call.run_id != run_id for call in calls)
    for infos in (running, terminated):
        assert len(infos) == 1 and any('memo cannot be read with this store' in n for n in infos[0].notes), infos


def test_temporal_deny_and_timeout(temporal_address: str, spawn, tmp_path: Path) -> None:
    from durable_capabilities.engines.temporal import (
        AgentRunInput,
        AgentRunOutput,
        connect,
    )

    env, crash_dir = env_for(tmp_path, timeout=15)
    queue = f'gate-{uuid.uuid4().hex[:8]}'
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue, env=env)
    worker.wait_for('WORKER READY', 90)
    engine_args = ['--engine', 'temporal', '--address', temporal_address]

    async def start(run_id: str, prompt: str) -> Any:
        client = await connect(temporal_address)
        return await client.start_workflow('durcap.gated', AgentRunInput(prompt=prompt), id=run_id, task_queue=queue,
                                           result_type=AgentRunOutput)

    denied_id, timed_out_id = f'deny-{uuid.uuid4().hex[:8]}', f'late-{uuid.uuid4().hex[:8]}'

    async def scenario() -> tuple[AgentRunOutput, AgentRunOutput]:
        denied_handle = await start(denied_id, 'revoke erin')
        late_handle = await start(timed_out_id, 'revoke frank')
        [call] = await asyncio.to_thread(pending, engine_args, denied_id)
        out = await asyncio.to_thread(durcap, 'deny', denied_id, call['call_id'], '--reason', 'not without a ticket',
                                      *engine_args)
        assert out.returncode == 0, out.stderr
        return await asyncio.wait_for(denied_handle.result(), 60), await asyncio.wait_for(late_handle.result(), 60)

    denied, late = asyncio.run(scenario())
    assert denied.output == 'result: not without a ticket'
    assert late.output.startswith('result: No one approved the call to revoke_sessions before its deadline')
    assert revocations(crash_dir) == []


def test_temporal_twenty_runs_waiting_approved_in_random_order(temporal_address: str, spawn, tmp_path: Path) -> None:
    from durable_capabilities import runner
    from durable_capabilities.engines.temporal import (
        AgentRunInput,
        AgentRunOutput,
        connect,
    )

    env, crash_dir = env_for(tmp_path)
    queue = f'gate-{uuid.uuid4().hex[:8]}'
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue, env=env)
    worker.wait_for('WORKER READY', 90)
    users = [f'user{i}' for i in range(20)]
    ids = {user: f'many-{user}-{uuid.uuid4().hex[:6]}' for user in users}
    approve = {user: i % 2 == 0 for i, user in enumerate(users)}

    async def scenario() -> dict[str, AgentRunOutput]:
        client = await connect(temporal_address)
        handles = {user: await client.start_workflow('durcap.gated', AgentRunInput(prompt=f'revoke {user}'), id=ids[user],
                                                     task_queue=queue, result_type=AgentRunOutput) for user in users}
        calls: dict[str, dict] = {}
        deadline = time.monotonic() + 90
        while len(calls) < len(users) and time.monotonic() < deadline:
            for user in users:
                if user not in calls:
                    found = await runner.approvals(ids[user], engine='temporal', address=temporal_address)
                    if found:
                        calls[user] = found[0].to_json()
            await asyncio.sleep(0.2)
        assert len(calls) == len(users)
        order = list(users)
        random.Random(13).shuffle(order)  # noqa: S311 - a fixed, repeatable order, not a secret
        for user in order:
            await runner.decide(ids[user], calls[user]['call_id'], approve=approve[user], reason=f'no for {user}',
                                by='tester', engine='temporal', address=temporal_address)
        return {user: await asyncio.wait_for(handles[user].result(), 90) for user in users}

    results = asyncio.run(scenario())
    for user in users:
        expected = f'result: revoked sessions of {user}' if approve[user] else f'result: no for {user}'
        assert results[user].output == expected
    assert sorted(revocations(crash_dir)) == sorted(u for u in users if approve[u])


def test_dbos_twenty_runs_waiting_in_one_process_approved_in_random_order(tmp_path: Path) -> None:
    """One `durcap worker dbos` process (DBOS on SQLite) runs 20 workflows of the gated agent, enqueued on its queue;
    all 20 wait in `DBOS.recv` at once; decisions (half approvals, half denials with a reason naming the user) are
    sent in a shuffled order; each run completes with its own decision and no decision reaches another run.
    Model: the scripted `FunctionModel` of tests/engines/approval_agent.py."""
    from dbos import DBOSClient

    from durable_capabilities import runner

    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    env, crash_dir = env_for(tmp_path)
    log = tmp_path / 'worker.log'
    with open(log, 'wb') as handle:
        # --concurrency 20: all 20 at once in this one worker (its default, 8, leaves the rest queued for other workers)
        worker = subprocess.Popen([sys.executable, '-m', 'durable_capabilities.cli', 'worker', 'dbos', TARGET, '--db', db,
                                   '--concurrency', '20'],
                                  cwd=ROOT, env=subprocess_env(env), stdout=handle,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    client = None
    try:
        deadline = time.monotonic() + 90
        while 'dbos worker ready' not in log.read_text():
            assert time.monotonic() < deadline and worker.poll() is None, log.read_text()
            time.sleep(0.2)
        users = [f'user{i}' for i in range(20)]
        ids = {user: f'many-{user}-{uuid.uuid4().hex[:6]}' for user in users}
        approve = {user: i % 2 == 0 for i, user in enumerate(users)}
        client = DBOSClient(system_database_url=db)
        for user in users:
            client.enqueue({'queue_name': 'durcap', 'workflow_name': 'durcap.gated', 'workflow_id': ids[user]},
                           f'revoke {user}', None, None, None)

        async def scenario() -> None:
            calls: dict[str, dict] = {}
            deadline = time.monotonic() + 120
            while len(calls) < len(users) and time.monotonic() < deadline:
                for user in users:
                    if user not in calls and (found := await runner.approvals(ids[user], engine='dbos', db=db)):
                        calls[user] = found[0].to_json()
                await asyncio.sleep(0.2)
            assert len(calls) == len(users), sorted(calls)
            # All 20 wait at once, in the one worker process (executor `local`), none decided yet.
            waiting = await runner.approvals(engine='dbos', db=db)
            assert sorted(c.run_id for c in waiting if c.run_id in ids.values()) == sorted(ids.values())
            assert revocations(crash_dir) == []
            order = list(users)
            random.Random(29).shuffle(order)  # noqa: S311 - a fixed, repeatable order, not a secret
            for user in order:
                await runner.decide(ids[user], calls[user]['call_id'], approve=approve[user], reason=f'no for {user}',
                                    by='tester', engine='dbos', db=db)

        asyncio.run(scenario())
        statuses = client.list_workflows(workflow_ids=list(ids.values()), load_input=False, load_output=False)
        assert {s.executor_id for s in statuses} == {'local'}
        for user in users:
            result = client.retrieve_workflow(ids[user]).get_result()
            expected = f'result: revoked sessions of {user}' if approve[user] else f'result: no for {user}'
            assert result['output'] == expected, (user, result['output'])
    finally:
        if client is not None:
            client.destroy()
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    assert sorted(revocations(crash_dir)) == sorted(u for u in users if approve[u])


# ---- Prefect -----------------------------------------------------------------------------------


def _prefect_flow_run_id(proc) -> str:
    return proc.wait_for('PREFECT FLOW RUN ', 90).split('PREFECT FLOW RUN ', 1)[1].strip()


def test_prefect_approve_after_process_killed_while_paused(prefect_api_url: str, spawn, tmp_path: Path) -> None:
    env, crash_dir = env_for(tmp_path)
    env['PREFECT_API_URL'] = prefect_api_url
    first = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke hana', env=env)
    run_id = _prefect_flow_run_id(first)
    engine_args = ['--engine', 'prefect']
    [call] = pending_prefect(engine_args, run_id, env)
    assert call['args'] == {'user': 'hana'} and call['engine'] == 'prefect'
    stale = durcap('approve', run_id, call['call_id'], '--fingerprint', '0' * 64, *engine_args, env=env)
    assert stale.returncode == 2 and 'stale-fingerprint' in stale.stderr, stale.stderr
    unknown = durcap('approve', run_id, 'no-such-call', *engine_args, env=env)
    assert unknown.returncode == 2 and 'unknown-call' in unknown.stderr, unknown.stderr
    first.kill9()  # SIGKILL while the flow run is Paused
    second = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke hana', '--flow-run-id', run_id, env=env)
    second.wait_for('PREFECT FLOW RUN ', 90)
    approved = durcap('approve', run_id, call['call_id'], '--by', 'ops', *engine_args, env=env)
    assert approved.returncode == 0, approved.stderr
    second_decision = durcap('deny', run_id, call['call_id'], '--reason', 'no', *engine_args, env=env)  # issue 13
    assert second_decision.returncode == 2, second_decision.stdout + second_decision.stderr
    said = second_decision.stderr.replace('\n', ' ')
    assert 'DC054' in said and '(already-decided)' in said and run_id in said and 'already approved by ops' in said, said
    report = second.report(timeout=180)
    assert report['output'] == 'result: revoked sessions of hana'
    assert revocations(crash_dir) == ['hana']  # exactly once


def test_prefect_deny_and_timeout(prefect_api_url: str, spawn, tmp_path: Path) -> None:
    """Two flow runs, each in its own process: one denied (its gate's timeout 60 s, so that the deny lands first
    whatever the load), one left alone until its gate's deadline (5 s; both were 20 s, so the test waited them out)."""
    env, crash_dir = env_for(tmp_path, timeout=60)
    env['PREFECT_API_URL'] = prefect_api_url
    denied = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke ivan', env=env)
    late = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke jade', env=env | {'DURCAP_APPROVAL_TIMEOUT': '5'})
    run_id = _prefect_flow_run_id(denied)
    [call] = pending_prefect(['--engine', 'prefect'], run_id, env)
    out = durcap('deny', run_id, call['call_id'], '--reason', 'needs a ticket', '--engine', 'prefect', env=env)
    assert out.returncode == 0, out.stderr
    assert denied.report(timeout=180)['output'] == 'result: needs a ticket'
    assert late.report(timeout=180)['output'].startswith('result: No one approved the call to revoke_sessions')
    assert revocations(crash_dir) == []


def _write_stale_decision(prefect_api_url: str, run_id: str, user: str, stale_user: str, timeout: float = 60) -> None:
    """In this process (Prefect's client, pointed at `prefect_api_url` for the call only): wait until flow run `run_id`
    is Paused with one pending call (for `user`), then write a decision for other arguments (`stale_user`) straight
    to its decision input and resume it, bypassing `decide`'s check.

    Raises:
        AssertionError: the run was not Paused with its call within `timeout` s, or the call is not `user`'s.
    """
    from prefect import get_client
    from prefect.flow_runs import aresume_flow_run
    from prefect.input import acreate_flow_run_input, aread_flow_run_input
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from durable_capabilities.approvals import Decision
    from durable_capabilities.engines.prefect._approvals import _input_key
    from durable_capabilities.engines.prefect._spec import DECISION_INPUT_PREFIX, PENDING_INPUT

    flow_run_id = uuid.UUID(run_id)

    async def main() -> None:
        deadline = time.monotonic() + timeout
        async with get_client() as client:
            while True:  # the run publishes its calls just before it pauses
                state = (await client.read_flow_run(flow_run_id)).state
                calls = await aread_flow_run_input(PENDING_INPUT, flow_run_id=flow_run_id) or []
                if state is not None and state.is_paused() and calls:
                    break
                assert time.monotonic() < deadline, f'flow run {run_id} not Paused with its call within {timeout} s'
                await asyncio.sleep(0.1)
        [call] = calls
        assert call['args'] == {'user': user}, call
        stale = Decision(call['call_id'], '0' * 64, True, override_args={'user': stale_user}, by=stale_user)
        await acreate_flow_run_input(DECISION_INPUT_PREFIX + _input_key(call['call_id']), stale.to_json(),
                                     flow_run_id=flow_run_id)
        await aresume_flow_run(flow_run_id)

    with temporary_settings(updates={PREFECT_API_URL: prefect_api_url}):
        asyncio.run(main())


def test_prefect_flow_drops_a_stale_decision_written_straight_to_it(prefect_api_url: str, spawn, tmp_path: Path) -> None:
    """A decision for other arguments written straight to the paused flow run (its decision input, then a resume;
    bypassing `decide`'s check), approving with other arguments: the flow's own fingerprint check drops it, the
    call stays undecided until its deadline and is denied; the tool never runs (without the flow-side check it would
    run for `mallory`). The decision is written from this process as soon as the run pauses (it was a new process,
    after `durcap approvals list` in another: the gate's timeout was 60 s to leave room for both imports; 20 s now)."""
    # Prefect and the engine module imported here before the run starts: not on its gate's clock
    import durable_capabilities.engines.prefect._approvals  # noqa: F401

    env, crash_dir = env_for(tmp_path, timeout=20)
    env['PREFECT_API_URL'] = prefect_api_url
    proc = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke lee', env=env)
    run_id = _prefect_flow_run_id(proc)
    _write_stale_decision(prefect_api_url, run_id, 'lee', 'mallory')
    report = proc.report(timeout=180)
    assert report['output'].startswith('result: No one approved the call to revoke_sessions before its deadline')
    assert revocations(crash_dir) == []


def pending_prefect(engine_args: list[str], run_id: str, env: dict[str, str], timeout: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = durcap('approvals', 'list', *engine_args, '--run', run_id, '--format', 'json', env=env)
        assert out.returncode == 0, out.stderr
        if calls := json.loads(out.stdout):
            return calls
        time.sleep(0.5)
    raise AssertionError(f'no pending call for {run_id} within {timeout} s')


# ---- durcap demo --approve / --deny ----------------------------------------------------------------


@pytest.mark.parametrize(('engine', 'flag'), [
    ('dbos', '--approve'), ('dbos', '--deny'), ('temporal', '--deny'),
    # its Temporal demo looks at 127.0.0.1:7233 (tests/engines/test_local_servers.py): one worker runs those
    pytest.param('temporal-embedded', '--approve', marks=pytest.mark.xdist_group('port-7233')),
    ('prefect', '--approve')])
def test_demo_shows_pause_pending_call_and_decision(engine: str, flag: str, tmp_path: Path, temporal_address: str,
                                                    prefect_api_url: str) -> None:
    """Model: the support example's scripted FunctionModel; account-security's gate is on by default (the demo's
    definition is the example's `support`). `temporal-embedded`: no --address, so the demo starts its own dev server
    (or uses the one on 127.0.0.1:7233) and decides there."""
    extra = ['--address', temporal_address] if engine == 'temporal' else []
    result = subprocess.run(
        [sys.executable, '-m', 'durable_capabilities.cli', 'demo', '--engine', engine.split('-')[0], flag, *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env=subprocess_env({'PREFECT_API_URL': prefect_api_url, 'DURCAP_TEMPORAL_ADDRESS': '',
                            'TEMPORAL_ADDRESS': ''}),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert 'waits for a person' in out
    assert 'pending call' in out and 'revoke_sessions({"account_id": "acct-42"})' in out
    if flag == '--approve':
        assert 'decision: approved by' in out
        assert 'Revoked sessions for acct-42.' in out
    else:
        assert 'decision: denied by' in out
        assert 'escalated your account to our security team' in out
        assert 'Revoked sessions' not in out


def test_demo_without_a_decision_says_how_to_approve_and_waits(tmp_path: Path) -> None:
    """`durcap demo` (DBOS on SQLite) with a prompt that reaches the gate and neither --approve nor --deny: it says the
    run waits for a person, with the exact `durcap approve` command; that command, run as printed from another
    process, lets the demo finish with the call run once. Model: the support example's scripted FunctionModel."""
    env = subprocess_env()
    log = tmp_path / 'demo.log'
    with open(log, 'wb') as handle:
        demo = subprocess.Popen([sys.executable, '-m', 'durable_capabilities.cli', 'demo', '--engine', 'dbos', '--prompt',
                                 'Someone keeps trying to log into my account acct-42 from abroad.'],
                                cwd=tmp_path, env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while 'paused: ' not in log.read_text():
            assert time.monotonic() < deadline and demo.poll() is None, log.read_text()
            time.sleep(0.2)
        line = next(x for x in log.read_text().splitlines() if x.startswith('paused: '))
        assert 'revoke_sessions({"account_id": "acct-42"}) waits for a person' in line, line
        approve = line.split('`durcap approve ')[1].split('`')[0].split()
        decided = subprocess.run([sys.executable, '-m', 'durable_capabilities.cli', 'approve', *approve], cwd=tmp_path,
                                 env=env, capture_output=True, text=True, timeout=120)
        assert decided.returncode == 0, decided.stdout + decided.stderr
        assert demo.wait(timeout=120) == 0, log.read_text()
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
    out = log.read_text()
    assert 'Revoked sessions for acct-42.' in out, out
    assert out.count('paused: ') == 1


def test_runs_resume_of_a_run_parked_on_an_approval_says_it_waits_and_how_to_decide(tmp_path: Path) -> None:
    """`durcap runs resume` of a run whose process was killed while it waited for a person (DBOS on SQLite): the resumed
    run waits again, and the command says so in the one `paused: ` line `durcap run` prints, with the `durcap deny`
    command that decides it; that command, run as printed from another process, lets the resume finish with the call
    denied (it used to wait in silence, a fresh-user trial saw nothing for a minute). Model: the support example's
    scripted FunctionModel."""
    env = subprocess_env()
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    common = ['--engine', 'dbos', '--db', db, '--store', f'sqlite:///{tmp_path / "conversations.db"}']
    procs: list[subprocess.Popen[bytes]] = []

    def start(log: Path, *args: str) -> subprocess.Popen[bytes]:
        with open(log, 'wb') as handle:
            procs.append(subprocess.Popen([sys.executable, '-m', 'durable_capabilities.cli', *args], cwd=tmp_path,
                                          env=env, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True))
        return procs[-1]

    def paused(log: Path, proc: subprocess.Popen[bytes]) -> str:
        deadline = time.monotonic() + 120
        while 'paused: ' not in log.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        return next(x for x in log.read_text().splitlines() if x.startswith('paused: '))

    try:
        first = start(tmp_path / 'run.log', 'run', 'examples.support.agent:support',
                      'Someone keeps trying to log into my account acct-42 from abroad.', *common,
                      '--deps-json', '{"orders": {}}')
        paused(tmp_path / 'run.log', first)
        run_id = (tmp_path / 'run.log').read_text().split('dbos workflow id: ', 1)[1].split()[0]
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        resume = start(tmp_path / 'resume.log', 'runs', 'resume', run_id, '--target', 'examples.support.agent:support',
                       *common)
        line = paused(tmp_path / 'resume.log', resume)
        assert f'revoke_sessions({{"account_id": "acct-42"}}) waits for a person (workflow id {run_id}, ' in line, line
        deny = line.split('`durcap deny ')[1].split('`')[0].replace('--reason TEXT', '').split()
        decided = subprocess.run([sys.executable, '-m', 'durable_capabilities.cli', 'deny', *deny, '--reason', 'no'],
                                 cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert decided.returncode == 0, decided.stdout + decided.stderr
        assert resume.wait(timeout=120) == 0, (tmp_path / 'resume.log').read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    out = (tmp_path / 'resume.log').read_text()
    assert 'escalated your account to our security team' in out, out
    assert out.count('paused: ') == 1, out


# ---- Prefect: a flow run of a deployment suspends ------------------------------------------------


def _deploy_driver(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, '-m', 'tests.engines.prefect_deploy_driver', *args], cwd=ROOT,
                         capture_output=True, text=True, env=subprocess_env(env),
                         timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _flow_run_state_name(run_id: str, env: dict[str, str]) -> str:
    """Flow run `run_id`'s state name (Suspended, Completed, ...), read from the server's REST API (`-` when it has
    none yet). Polled in-process: the driver's `state` command costs a Prefect import (~2 s of CPU) per look."""
    import httpx

    response = httpx.get(f'{env["PREFECT_API_URL"].rstrip("/")}/flow_runs/{run_id}', timeout=30)
    response.raise_for_status()
    return (response.json().get('state') or {}).get('name') or '-'


def _wait_state(run_id: str, wanted: str, env: dict[str, str], timeout: float = 120) -> Any:
    """Poll until flow run `run_id` is in state `wanted` (a name: Suspended, Completed); its output if Completed (read
    once, by the driver's `state` command: the flow's persisted result, through Prefect's client)."""
    deadline = time.monotonic() + timeout
    seen = ''
    while time.monotonic() < deadline:
        seen = _flow_run_state_name(run_id, env)
        if seen == wanted:
            if wanted != 'Completed':
                return None
            lines = _deploy_driver('state', run_id, env=env).splitlines()
            assert f'STATE {wanted}' in lines, lines
            return next(json.loads(line.split(' ', 1)[1]) for line in lines if line.startswith('OUTPUT '))
        assert seen not in ('Failed', 'Crashed', 'Cancelled'), f'flow run {run_id} ended {seen}'
        time.sleep(0.3)
    raise AssertionError(f'flow run {run_id} not {wanted} within {timeout} s (last: {seen})')


def _process_gone(pid: int, timeout: float = 30) -> bool:
    """True once `pid` has exited (no such process, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            stat = Path(f'/proc/{pid}/stat').read_text()
        except FileNotFoundError:
            return True
        if stat.rsplit(')', 1)[1].split()[0] == 'Z':
            return True
        time.sleep(0.2)
    return False


def _live_children(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid`, from /proc."""
    children = []
    for task_dir in Path(f'/proc/{pid}/task').iterdir():
        for child in (task_dir / 'children').read_text().split():
            if not _process_gone(int(child), timeout=0):
                children.append(int(child))
    return children


def _live_flow_run_processes(pid: int) -> list[int]:
    """Live descendants of serving process `pid` other than multiprocessing's helpers (its fork server, whose
    children are the flow-run processes, and its resource tracker), from /proc."""
    found = []
    for child in _live_children(pid):
        args = Path(f'/proc/{child}/cmdline').read_bytes().replace(b'\0', b' ')
        if b'multiprocessing.forkserver' in args or b'multiprocessing.resource_tracker' in args:
            found += _live_flow_run_processes(child)
        else:
            found.append(child)
    return found


@contextlib.contextmanager
def _serving(tmp_path: Path, env: dict[str, str], deployment: str) -> Iterator[subprocess.Popen[bytes]]:
    """Serve the gated agent's flow as `deployment` from a subprocess; SIGKILL its process group at the end."""
    log = tmp_path / f'serve-{deployment}.log'
    with open(log, 'wb') as handle:
        server = subprocess.Popen(
            [sys.executable, '-m', 'tests.engines.prefect_deploy_driver', 'serve', TARGET, 'gated', deployment],
            cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            env=subprocess_env(env))
    try:
        deadline = time.monotonic() + 90
        while 'SERVING' not in log.read_text(errors='replace'):
            assert server.poll() is None and time.monotonic() < deadline, log.read_text(errors='replace')
            time.sleep(0.2)
        yield server
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


def _start_runs(deployment: str, users: list[str], env: dict[str, str]) -> dict[str, str]:
    """One flow run of `deployment` per user (`revoke USER`), created by one driver process; {user: flow run id}."""
    out = _deploy_driver('start', f'durcap-gated/{deployment}', *(f'revoke {user}' for user in users), env=env)
    ids = [line.split('FLOW RUN ', 1)[1].split()[0] for line in out.splitlines() if line.startswith('FLOW RUN ')]
    assert len(ids) == len(users), out
    return dict(zip(users, ids, strict=True))


def test_prefect_deployment_run_suspends_without_a_process_then_approve_and_deny(prefect_api_url: str,
                                                                                 tmp_path: Path) -> None:
    """A flow run started from a served deployment suspends on the gate (state Suspended, its process exits,
    the serving process runs no flow-run process for it); `durcap approve` resumes it, Prefect starts it again
    from the deployment, cached tasks replay, the tool runs exactly once. A denied run gives the model the reason.

    Model: the scripted `FunctionModel` of tests/engines/approval_agent.py. The serving process (`prefect.serve`,
    as `durcap schedule prefect` uses) is a real subprocess stopped by pid (SIGKILL of its group) at the end."""
    env, crash_dir = env_for(tmp_path)
    env.update({'PREFECT_API_URL': prefect_api_url, 'PREFECT_RUNNER_POLL_FREQUENCY': '1', 'DURCAP_RECORD_PIDS': '1'})
    with _serving(tmp_path, env, 'suspend-test') as server:
        runs = _start_runs('suspend-test', ['kai', 'lea'], env)
        for run_id in runs.values():
            _wait_state(run_id, 'Suspended', env)
        flow_run_pids = {int(p) for p in (crash_dir / 'model-pids').read_text().split()}
        assert len(flow_run_pids) == 2 and os.getpid() not in flow_run_pids | {server.pid}
        assert all(_process_gone(pid) for pid in flow_run_pids), 'a suspended flow run still has its process'
        # Within 30 s, as each run's own process above (`_process_gone`): the states are read by REST now, at once
        # (the driver's `state` subprocess per look took seconds, tens under load, and this check came that much
        # later); at load 20 one more child of the serving process, not a run's own, was once still alive right then
        wait_for(lambda: not _live_flow_run_processes(server.pid), 30, interval=0.2,
                 message=lambda: f'the serving process still runs a flow-run process: {_live_flow_run_processes(server.pid)}')
        assert revocations(crash_dir) == []

        [call] = pending_prefect(['--engine', 'prefect'], runs['kai'], env)
        assert call['args'] == {'user': 'kai'}
        approved = durcap('approve', runs['kai'], call['call_id'], '--by', 'ops', '--engine', 'prefect', env=env)
        assert approved.returncode == 0, approved.stderr
        [call] = pending_prefect(['--engine', 'prefect'], runs['lea'], env)
        denied = durcap('deny', runs['lea'], call['call_id'], '--reason', 'needs a ticket', '--engine', 'prefect',
                        env=env)
        assert denied.returncode == 0, denied.stderr

        assert _wait_state(runs['kai'], 'Completed', env, timeout=180) == 'result: revoked sessions of kai'
        assert _wait_state(runs['lea'], 'Completed', env, timeout=180) == 'result: needs a ticket'
        assert revocations(crash_dir) == ['kai']  # exactly once, and never for the denied call
        resumed_pids = {int(p) for p in (crash_dir / 'model-pids').read_text().split()} - flow_run_pids
        assert len(resumed_pids) == 2  # each run continued in a new process started from the deployment


def test_prefect_deployment_run_suspended_past_its_deadline_is_denied(prefect_api_url: str, tmp_path: Path) -> None:
    """Timeout of a suspended flow run: no process waits, the serving process's `watch_deadlines` resumes it once
    the deadline (8 s) has passed, and the rerun denies the call with the timeout reason; the tool never runs.
    Model: the scripted `FunctionModel` of tests/engines/approval_agent.py."""
    env, crash_dir = env_for(tmp_path, timeout=8)
    env.update({'PREFECT_API_URL': prefect_api_url, 'PREFECT_RUNNER_POLL_FREQUENCY': '1'})
    with _serving(tmp_path, env, 'suspend-timeout-test'):
        [run_id] = _start_runs('suspend-timeout-test', ['max'], env).values()
        _wait_state(run_id, 'Suspended', env)
        output = _wait_state(run_id, 'Completed', env, timeout=120)
        assert output.startswith('result: No one approved the call to revoke_sessions'), output
        assert revocations(crash_dir) == []


# ---- decisions sent at the same moment (issue 26, item 4) -------------------------------------------------------

_RACE = """
import asyncio, json, sys
from durable_capabilities import runner
from durable_capabilities.approvals import ApprovalError
engine, run_id, call_id, fingerprint, settings = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5])
decisions = sys.argv[6:]
async def one(n, decision):
    try:
        await runner.decide(run_id, call_id, approve=decision == 'approve', reason='racing', by=f'racer-{n}',
                            fingerprint_=fingerprint, engine=engine, **settings)
        return {'decision': decision, 'by': f'racer-{n}', 'ok': True}
    except ApprovalError as exc:
        return {'decision': decision, 'ok': False, 'code': exc.code, 'kind': exc.kind, 'message': str(exc)}
async def main():
    print('RACE ' + json.dumps(await asyncio.gather(*[one(n, d) for n, d in enumerate(decisions)])), flush=True)
asyncio.run(main())
"""


def _race(engine: str, run_id: str, call: dict, settings: dict[str, Any], env: dict[str, str], log: Path,
          decisions: tuple[str, ...] = ('approve', 'deny', 'approve', 'deny')) -> list[dict[str, Any]]:
    """`runner.decide` on one call, once per entry of `decisions`, all at once (`asyncio.gather` in one new process:
    each reads the call, then sends, interleaved with the others: the race two deciders make)."""
    with open(log, 'wb') as out:
        raced = subprocess.run([sys.executable, '-c', _RACE, engine, run_id, call['call_id'], call['fingerprint'],
                                json.dumps(settings), *decisions], cwd=ROOT, env=subprocess_env(env), stdout=out,
                               stderr=subprocess.STDOUT, timeout=240, check=False)
    text = log.read_text()
    assert raced.returncode == 0, text[-3000:]
    return json.loads(text.split('RACE ', 1)[1].splitlines()[0])


def _one_accepted(results: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    """The one decision accepted; every other one refused with DC054 naming it."""
    accepted = [r for r in results if r['ok']]
    assert len(accepted) == 1, results
    [winner] = accepted
    verb = 'approved' if winner['decision'] == 'approve' else 'denied'
    for refused in (r for r in results if not r['ok']):
        assert (refused['code'], refused['kind']) == ('DC054', 'already-decided'), results
        assert refused['message'].startswith(f'DC054 run {run_id!r}: call '), refused
        assert f'was already {verb} by {winner["by"]} at ' in refused['message'], (refused, winner)
    return winner


def test_dbos_decisions_sent_at_the_same_moment_one_is_accepted(spawn, tmp_path: Path) -> None:
    """Four decisions (approve, deny, approve, deny) on one waiting call of a DBOS run (SQLite), sent at the same moment
    by four `runner.decide` calls in another process (what `durcap approve` and the API do): exactly one is accepted,
    the other three are refused DC054 naming it, and the run does what the accepted one said: the tool once if an
    approval, never if a denial. Before the decision slot in the system database (`dbos._runs._claim`), all four read
    the call undecided and all four were told yes (the first message stored won, silently). The `gated` agent
    (scripted `FunctionModel`)."""
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    env, crash_dir = env_for(tmp_path)
    run_id = f'race-{uuid.uuid4().hex[:8]}'
    proc = spawn('dbos', 'run', '--target', TARGET, '--db', db, '--workflow-id', run_id, '--prompt', 'revoke lena',
                 env=env)
    engine_args = ['--engine', 'dbos', '--db', db]
    [call] = pending(engine_args, run_id)
    winner = _one_accepted(_race('dbos', run_id, call, {'db': db}, env, tmp_path / 'race.log'), run_id)
    report = proc.report(timeout=120)
    if winner['decision'] == 'approve':
        assert report['output'] == 'result: revoked sessions of lena'
        assert revocations(crash_dir) == ['lena']
    else:
        assert report['output'] == 'result: racing' and revocations(crash_dir) == []
    audit = [r for m in report['new_messages'] for r in (m.get('metadata') or {}).get('durcap_approvals', [])]
    assert [r['by'] for r in audit] == [winner['by']], audit


def test_prefect_decisions_sent_at_the_same_moment_one_is_accepted(prefect_api_url: str, spawn, tmp_path: Path) -> None:
    """As the DBOS test above, on Prefect (the shared server): four decisions at once on one paused flow run's call;
    exactly one accepted, three refused DC054 naming it (the decision input is write-once on the server), the tool
    once if the accepted one approved. The `gated` agent (scripted `FunctionModel`)."""
    env, crash_dir = env_for(tmp_path)
    env['PREFECT_API_URL'] = prefect_api_url
    proc = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke mona', env=env)
    run_id = _prefect_flow_run_id(proc)
    [call] = pending_prefect(['--engine', 'prefect'], run_id, env)
    winner = _one_accepted(_race('prefect', run_id, call, {}, env, tmp_path / 'race.log'), run_id)
    report = proc.report(timeout=180)
    if winner['decision'] == 'approve':
        assert report['output'] == 'result: revoked sessions of mona'
        assert revocations(crash_dir) == ['mona']
    else:
        assert report['output'] == 'result: racing' and revocations(crash_dir) == []


def test_prefect_run_sigtermed_while_paused_keeps_its_approval_listed_and_finishes_once(
        prefect_api_url: str, tmp_path: Path) -> None:
    """`durcap run --engine prefect` (the shared server) given SIGTERM while its run waits for an approval: the flow
    run ends Crashed (Prefect's own SIGTERM handling; Paused when the signal misses it). Either way `durcap approvals
    list` (all runs, no --run) still lists the call (a Crashed run's calls were not listed: the wait was lost from
    view), `durcap approve` is accepted, the listing then says the call is decided and waits for the run, and `durcap
    runs resume --target` finishes it: the approved tool ran once. The `gated` agent (scripted `FunctionModel`)."""
    env, crash_dir = env_for(tmp_path)
    env['PREFECT_API_URL'] = prefect_api_url
    log = tmp_path / 'run.log'
    with open(log, 'wb') as handle:
        proc = subprocess.Popen([sys.executable, '-m', 'durable_capabilities.cli', 'run', TARGET, 'revoke nina',
                                 '--engine', 'prefect'], cwd=ROOT, env=subprocess_env(env), stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith('paused: ') for line in log.read_text().splitlines()):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()
            time.sleep(0.2)
        run_id = log.read_text().split('prefect flow run id: ', 1)[1].split()[0]
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=60) == 143, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    state = json.loads(durcap('runs', 'show', run_id, '--engine', 'prefect', '--format', 'json', env=env).stdout)
    assert state['engine_status'] in ('PAUSED', 'CRASHED'), state
    listed = durcap('approvals', 'list', '--engine', 'prefect', '--format', 'json', env=env)
    assert listed.returncode == 0, listed.stderr
    [call] = [c for c in json.loads(listed.stdout) if c['run_id'] == run_id]
    assert call['args'] == {'user': 'nina'} and call['decided'] is None, (state['engine_status'], call)
    approved = durcap('approve', run_id, call['call_id'], '--engine', 'prefect', '--by', 'ops', env=env)
    assert approved.returncode == 0, approved.stdout + approved.stderr
    if state['engine_status'] == 'CRASHED':  # nothing runs it: listed as decided, waiting for the run
        again = json.loads(durcap('approvals', 'list', '--engine', 'prefect', '--format', 'json', env=env).stdout)
        [waiting] = [c for c in again if c['run_id'] == run_id]
        assert waiting['decided'].startswith('approved by ops at '), waiting
    resumed = durcap('runs', 'resume', run_id, '--engine', 'prefect', '--target', TARGET, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert 'result: revoked sessions of nina' in resumed.stdout, resumed.stdout
    assert revocations(crash_dir) == ['nina']  # exactly once
    after = json.loads(durcap('approvals', 'list', '--engine', 'prefect', '--format', 'json', env=env).stdout)
    assert [c for c in after if c['run_id'] == run_id] == []


def test_temporal_decisions_sent_at_the_same_moment_one_is_accepted(temporal_address: str, spawn,
                                                                     tmp_path: Path) -> None:
    """As the DBOS and Prefect tests above, on Temporal (the shared dev server, a driver worker): four decisions at
    once on one waiting call; exactly one accepted, three refused DC054 naming it (the workflow takes one decision
    update per call: the first handler removes the call, a later update is refused), the tool once if the accepted one
    approved. The `gated` agent (scripted `FunctionModel`)."""
    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput, connect

    env, crash_dir = env_for(tmp_path)
    queue = f'race-{uuid.uuid4().hex[:8]}'
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue, env=env)
    worker.wait_for('WORKER READY', 90)
    run_id = f'race-{uuid.uuid4().hex[:8]}'

    async def scenario() -> tuple[dict[str, Any], AgentRunOutput]:
        client = await connect(temporal_address)
        handle = await client.start_workflow('durcap.gated', AgentRunInput(prompt='revoke olga'), id=run_id,
                                             task_queue=queue, result_type=AgentRunOutput)
        [call] = await asyncio.to_thread(pending, ['--engine', 'temporal', '--address', temporal_address], run_id)
        results = await asyncio.to_thread(_race, 'temporal', run_id, call, {'address': temporal_address}, env,
                                          tmp_path / 'race.log')
        return _one_accepted(results, run_id), await asyncio.wait_for(handle.result(), 120)

    winner, output = asyncio.run(scenario())
    if winner['decision'] == 'approve':
        assert output.output == 'result: revoked sessions of olga' and revocations(crash_dir) == ['olga']
    else:
        assert output.output == 'result: racing' and revocations(crash_dir) == []
