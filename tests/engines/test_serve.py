"""`durcap serve` (issue 26): real `durcap serve` subprocesses, real HTTP (httpx), the local engine, DBOS (a real
`durcap worker dbos` on SQLite) and Temporal (a real `durcap worker temporal` at the shared dev server, for the node
clients), the conversation store on SQLite.

Models: scripted `FunctionModel`s (tests/engines/serve_agents.py: `streamer` streams its answer word by word after a
tool call; `gated` calls `revoke_sessions`, which waits for a person's approval and records each execution).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from durable_capabilities.streams import RunEvent, answer_text
from tests._helpers import durcap, sql
from tests.engines._serve import ALICE, TARGET, Proc, free_port, read_sse, start, start_server

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('serve-dbos')]


@dataclass
class Stack:
    """A `durcap serve` on one engine (and, for DBOS, the worker running its turns), sharing one store."""

    url: str
    store: str
    env: dict[str, str]
    crash_dir: Path
    procs: list[Proc]
    tmp: Path
    serve_args: tuple[str, ...] = ('--engine', 'dbos')  # what a further `durcap serve` on this stack is given


def _env(tmp: Path) -> tuple[dict[str, str], Path, str]:
    store = f'sqlite:///{tmp / "conversations.db"}'
    crash = tmp / 'crash'
    return ({'DURCAP_STORE': store, 'DURCAP_STREAM_DELAY': '0.02', 'DURCAP_CRASH_DIR': str(crash)}, crash, store)


@pytest.fixture(scope='module')
def dbos_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp('serve-dbos')
    env, crash, store = _env(tmp)
    db = f'sqlite:///{tmp / "dbos.sqlite"}'
    env['DURCAP_DBOS_DB'] = db
    procs: list[Proc] = []
    try:
        worker = start(['worker', 'dbos', TARGET, '--db', db], tmp / 'worker.log', env)
        procs.append(worker)
        worker.wait_for('dbos worker ready', 120)
        server, url = start_server(tmp, 'serve-a', env, '--engine', 'dbos', '--db', db, '--chat')
        procs.append(server)
        yield Stack(url, store, env, crash, procs, tmp)
    finally:
        for proc in procs:
            proc.kill9()


@pytest.fixture(scope='module')
def temporal_stack(tmp_path_factory: pytest.TempPathFactory, temporal_address: str) -> Iterator[Stack]:
    """A `durcap worker temporal` on a task queue of its own at the shared dev server; the serve processes a test
    starts hand their turns to it (`Stack.serve_args`: `--engine temporal --address A --task-queue Q`)."""
    import uuid

    tmp = tmp_path_factory.mktemp('serve-temporal')
    env, crash, store = _env(tmp)
    queue = f'serve-{uuid.uuid4().hex[:8]}'
    procs: list[Proc] = []
    try:
        worker = start(['worker', 'temporal', TARGET, '--address', temporal_address, '--task-queue', queue],
                       tmp / 'worker.log', env)
        procs.append(worker)
        worker.wait_for('worker ready', 120)
        yield Stack('', store, env, crash, procs, tmp,
                    ('--engine', 'temporal', '--address', temporal_address, '--task-queue', queue))
    finally:
        for proc in procs:
            proc.kill9()


def _post(url: str, conversation: str, body: dict[str, Any], key: str | None = None,
          headers: dict[str, str] = ALICE) -> httpx.Response:
    return httpx.post(f'{url}/v1/conversations/{conversation}/turns', json=body, timeout=30,
                      headers={**headers, **({'Idempotency-Key': key} if key else {})})


async def _post_many(url: str, conversation: str, body: dict[str, Any], key: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30) as client:
        return list(await asyncio.gather(*[
            client.post(f'{url}/v1/conversations/{conversation}/turns', json=body,
                        headers={**ALICE, 'Idempotency-Key': key}) for _ in range(n)]))


def _streamed_idempotent_turn(stack: Stack, conversation: str) -> None:
    """Three concurrent POSTs with one Idempotency-Key, then a fourth after the run: one run, one turn stored; the
    run's SSE stream (offsets as ids, in order) joins to the answer; Last-Event-ID resumes exactly after it."""
    from tests.engines.stream_agent import ANSWER

    body = {'agent': 'streamer', 'prompt': 'where is ABC-123?'}
    responses = asyncio.run(_post_many(stack.url, conversation, body, f'key-{conversation}', 3))
    assert [r.status_code for r in responses] == [202] * 3, [r.text for r in responses]
    answers = [r.json() for r in responses]
    run_id = answers[0]['run_id']
    assert {a['run_id'] for a in answers} == {run_id}
    assert sorted(a['created'] for a in answers) == [False, False, True]
    events = read_sse(stack.url + answers[0]['events_url'], ALICE)
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert [e.data['offset'] for e in events] == [e.id for e in events]
    assert events[0].kind == 'run_started' and events[-1].kind == 'run_completed'
    run_events = [RunEvent.model_validate(e.data) for e in events]
    assert sum(e.kind == 'text_delta' for e in run_events) > 10  # streamed, not one block
    assert answer_text(run_events) == ANSWER == events[-1].data['data']['output']
    middle = len(events) // 2
    rest = read_sse(stack.url + answers[0]['events_url'], ALICE, last_event_id=events[middle].id)
    assert rest == events[middle + 1:]
    again = _post(stack.url, conversation, body, key=f'key-{conversation}')
    assert again.status_code == 202 and again.json()['run_id'] == run_id and again.json()['created'] is False
    status = httpx.get(f'{stack.url}/v1/runs/{run_id}', headers=ALICE, timeout=30).json()
    assert status['status'] == 'completed' and status['report']['output'] == ANSWER
    stored = httpx.get(f'{stack.url}/v1/conversations/{conversation}', headers=ALICE, timeout=30).json()
    assert [w['operation'] for w in stored['writes']] == ['append'] and stored['message_count'] == 4
    assert sql(stack.store, 'SELECT COUNT(*) FROM durcap_serve_runs WHERE conversation_id = :c',
               {'c': conversation}) == [(1,)]


def test_local_turn_streamed_over_sse_and_one_run_per_idempotency_key(tmp_path: Path) -> None:
    """`durcap serve --engine local` (the turn runs in the serve process): see `_streamed_idempotent_turn`; then
    `durcap history delete`'s `delete_conversation` removes the serve rows of the conversation as well."""
    env, crash, store = _env(tmp_path)
    server, url = start_server(tmp_path, 'serve-local', env, '--engine', 'local')
    try:
        _streamed_idempotent_turn(Stack(url, store, env, crash, [server], tmp_path), 'local-1')
        # `durcap history delete` forgets the serve rows too: the owner, the runs, the idempotency keys.
        from durable_capabilities.forgetting import delete_conversation

        asyncio.run(delete_conversation(store, 'local-1'))
        assert [sql(store, f'SELECT COUNT(*) FROM durcap_serve_{t}') for t in ('owners', 'runs', 'requests')] == [[(0,)]] * 3
        assert httpx.get(f'{url}/v1/conversations/local-1', headers=ALICE, timeout=30).status_code == 404
    finally:
        server.kill9()


def test_dbos_turn_streamed_over_sse_and_one_run_per_idempotency_key(dbos_stack: Stack) -> None:
    """`durcap serve --engine dbos` hands the turn to `durcap worker dbos` (another process) and streams it: see
    `_streamed_idempotent_turn`."""
    _streamed_idempotent_turn(dbos_stack, 'dbos-1')


def _json(response: httpx.Response) -> Any:
    return json.loads(response.text)


def _store_rows(store: str) -> dict[str, list[tuple[Any, ...]]]:
    tables = [r[0] for r in sql(store, "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'durcap_%'")]
    return {table: sorted(sql(store, f'SELECT * FROM {table}'), key=repr) for table in sorted(tables)}


def _wait_pending(url: str, run_id: str, timeout: float = 120) -> list[dict[str, Any]]:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(f'{url}/v1/runs/{run_id}/approvals', headers=ALICE, timeout=30)
        if response.status_code in (404, 503):  # not visible yet on a loaded engine: ask again
            time.sleep(0.2)
            continue
        assert 'pending' in response.json(), (response.status_code, response.text)
        pending = response.json()['pending']
        if pending:
            return pending
        time.sleep(0.2)
    status = httpx.get(f'{url}/v1/runs/{run_id}', headers=ALICE, timeout=30).json()
    raise AssertionError(f'run {run_id} never waited for approval: {status}')


def test_dbos_bad_requests_are_refused_with_a_code_and_change_nothing_then_the_approval_runs_the_tool_once(
        dbos_stack: Stack) -> None:
    """A table of 87 bad requests against `durcap serve --engine dbos` while a `gated` run waits for approval (wrong or
    missing token, another principal's conversation and run, oversized and malformed bodies, unknown agent, run and
    call, an Idempotency-Key reused for another request, a decision for other arguments, edited arguments outside the
    tool's schema, unknown routes): each answered with its status and code in a JSON body without a traceback, and
    every store table and the pending call unchanged, the tool not run; each coded message leads with its code (DC042
    and DC044 did not). Then the right decision runs the tool once,
    the SSE stream carries the approval events, and a second decision is refused with 409."""
    from durable_capabilities.approvals import fingerprint
    from tests.engines._serve import BOB

    url, conversation = dbos_stack.url, 'c-table'
    first = _post(url, conversation, {'agent': 'gated', 'prompt': 'revoke alice'}, key='k-table')
    assert first.status_code == 202, first.text
    run_id = first.json()['run_id']
    [call] = _wait_pending(url, run_id)
    assert call['tool_name'] == 'revoke_sessions' and call['args'] == {'user': 'alice'}
    assert call['fingerprint'] == fingerprint('revoke_sessions', {'user': 'alice'}) and call['decided'] is None
    fp, call_id = call['fingerprint'], call['call_id']
    turns, conv, events = f'/v1/conversations/{conversation}/turns', f'/v1/conversations/{conversation}', f'/v1/runs/{run_id}/events'
    status, approvals, decide = f'/v1/runs/{run_id}', f'/v1/runs/{run_id}/approvals', f'/v1/runs/{run_id}/approvals/{call_id}'
    good_turn = json.dumps({'agent': 'gated', 'prompt': 'revoke bob'})
    good = {'decision': 'approve', 'fingerprint': fp}
    big = 1024 * 1024 + 10
    deep: Any = 1
    for _ in range(100):
        deep = [deep]
    endpoints = [('POST', turns, good_turn), ('GET', conv, None), ('GET', events, None), ('GET', status, None),
                 ('GET', approvals, None), ('POST', decide, json.dumps(good))]
    cases: list[tuple[str, str, str, dict[str, str], Any, int, str]] = []
    for method, path, body in endpoints:
        cases.append((f'no token {method} {path}', method, path, {}, body, 401, 'DC043'))
        cases.append((f'wrong token {method} {path}', method, path, {'Authorization': 'Bearer token-mallory'}, body, 401, 'DC043'))
        cases.append((f'bob {method} {path}', method, path, BOB, body, 404, 'DC044'))
    cases += [
        ('basic scheme', 'GET', conv, {'Authorization': 'Basic dG9rZW4tYWxpY2U='}, None, 401, 'DC043'),
        ('bearer without token', 'GET', conv, {'Authorization': 'Bearer'}, None, 401, 'DC043'),
        ('token with a suffix', 'GET', conv, {'Authorization': 'Bearer token-alice-x'}, None, 401, 'DC043'),
        ('token in the query', 'GET', conv + '?token=token-alice', {}, None, 401, 'DC043'),
    ]

    def turn(name: str, body: Any, code_status: tuple[int, str], path: str = turns, **headers: str) -> None:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        cases.append((f'turn: {name}', 'POST', path, {**ALICE, **headers}, content, *code_status))

    bad, too_big, missing = (400, 'DC042'), (413, 'DC041'), (404, 'DC044')
    turn('body over 1 MiB', b'x' * big, too_big)
    turn('prompt over 1 MiB', {'agent': 'gated', 'prompt': 'x' * big}, too_big)
    turn('not JSON', '{', bad)
    turn('empty body', '', bad)
    turn('a list', '[]', bad)
    turn('a string', '"revoke bob"', bad)
    turn('null', 'null', bad)
    turn('no prompt', {'agent': 'gated'}, bad)
    turn('empty prompt', {'agent': 'gated', 'prompt': ''}, bad)
    turn('prompt a number', {'agent': 'gated', 'prompt': 5}, bad)
    turn('prompt null', {'agent': 'gated', 'prompt': None}, bad)
    turn('prompt NaN', '{"agent": "gated", "prompt": NaN}', bad)
    turn('unknown field', {'agent': 'gated', 'prompt': 'x', 'temperature': 2}, bad)
    turn('agent a number', {'agent': 7, 'prompt': 'x'}, bad)
    turn('no agent of two', {'prompt': 'x'}, bad)
    turn('unknown agent', {'agent': 'nope', 'prompt': 'x'}, missing)
    turn('deps for an agent without deps', {'agent': 'gated', 'prompt': 'x', 'deps': {'a': 1}}, bad)
    turn('deps nested 100 deep', {'agent': 'gated', 'prompt': 'x', 'deps': deep}, bad)
    turn('not UTF-8', b'\xff\xfe{}', bad)
    turn('conversation id with a space', {'agent': 'gated', 'prompt': 'x'}, bad, path='/v1/conversations/has%20space/turns')
    turn('conversation id of 300 characters', {'agent': 'gated', 'prompt': 'x'}, bad, path=f'/v1/conversations/{"c" * 300}/turns')
    turn('conversation id not ASCII', {'agent': 'gated', 'prompt': 'x'}, bad, path='/v1/conversations/caf%C3%A9/turns')
    turn('conversation id starting with a dash', {'agent': 'gated', 'prompt': 'x'}, bad, path='/v1/conversations/-x/turns')
    turn('Idempotency-Key with a space', {'agent': 'gated', 'prompt': 'x'}, bad, **{'Idempotency-Key': 'has space'})
    turn('Idempotency-Key of 300 characters', {'agent': 'gated', 'prompt': 'x'}, bad, **{'Idempotency-Key': 'k' * 300})
    turn('Idempotency-Key reused for another prompt', {'agent': 'gated', 'prompt': 'revoke bob'}, (409, 'DC045'),
         **{'Idempotency-Key': 'k-table'})
    turn('Idempotency-Key reused on another conversation', {'agent': 'gated', 'prompt': 'revoke alice'}, (409, 'DC045'),
         path='/v1/conversations/c-other/turns', **{'Idempotency-Key': 'k-table'})
    turn('busy conversation (the agent rejects)', {'agent': 'gated', 'prompt': 'revoke bob'}, (409, 'DC050'))
    turn('busy conversation (reject asked)', {'agent': 'gated', 'prompt': 'revoke bob', 'busy': 'reject'}, (409, 'DC050'),
         **{'Idempotency-Key': 'k-busy'})
    turn('busy strategy unknown', {'agent': 'gated', 'prompt': 'revoke bob', 'busy': 'later'}, bad)
    turn('busy strategy in capitals', {'agent': 'gated', 'prompt': 'revoke bob', 'busy': 'ENQUEUE'}, bad)
    for name, path in [('events', '/v1/runs/nope/events'), ('status', '/v1/runs/nope'), ('approvals', '/v1/runs/nope/approvals')]:
        cases.append((f'unknown run: {name}', 'GET', path, ALICE, None, *missing))
    cases.append(('unknown run: decide', 'POST', '/v1/runs/nope/approvals/x', ALICE, json.dumps(good), *missing))
    for value in ('abc', '-1', '1e3', '9' * 30):
        cases.append((f'Last-Event-ID {value}', 'GET', events, {**ALICE, 'Last-Event-ID': value}, None, *bad))
    for value in ('abc', '-1', '%C2%B9'):  # the query parameter for clients without headers, named; '¹' is a digit int() refuses
        cases.append((f'?after={value}', 'GET', f'{events}?after={value}', ALICE, None, *bad))

    def decision(name: str, body: Any, code_status: tuple[int, str], path: str = decide) -> None:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        cases.append((f'decision: {name}', 'POST', path, ALICE, content, *code_status))

    other = fingerprint('revoke_sessions', {'user': 'mallory'})
    decision('decision maybe', {'decision': 'maybe', 'fingerprint': fp}, bad)
    decision('no decision', {'fingerprint': fp}, bad)
    decision('no fingerprint', {'decision': 'approve'}, bad)
    decision('fingerprint too short', {'decision': 'approve', 'fingerprint': 'abc'}, bad)
    decision('fingerprint in capitals', {'decision': 'approve', 'fingerprint': fp.upper()}, bad)
    decision('fingerprint a boolean', {'decision': 'approve', 'fingerprint': True}, bad)
    decision('fingerprint of other arguments', {'decision': 'approve', 'fingerprint': other}, (409, 'DC055'))
    decision('fingerprint of other arguments, deny', {'decision': 'deny', 'fingerprint': other}, (409, 'DC055'))
    decision('fingerprint of zeros', {'decision': 'approve', 'fingerprint': '0' * 64}, (409, 'DC055'))
    decision('decision in capitals', {'decision': 'APPROVE', 'fingerprint': fp}, bad)
    decision('decision a number', {'decision': 1, 'fingerprint': fp}, bad)
    decision('a list', [good], bad)
    decision('unknown call', good, missing, path=f'/v1/runs/{run_id}/approvals/call-nope')
    decision('args with deny', {'decision': 'deny', 'fingerprint': fp, 'args': {'user': 'bob'}}, bad)
    decision('args a list', {'decision': 'approve', 'fingerprint': fp, 'args': ['bob']}, bad)
    decision('args outside the schema', {'decision': 'approve', 'fingerprint': fp, 'args': {'nope': 1}}, (422, 'DC051'))
    decision('args of the wrong type', {'decision': 'approve', 'fingerprint': fp, 'args': {'user': 5}}, (422, 'DC051'))
    decision('args without the required field', {'decision': 'approve', 'fingerprint': fp, 'args': {}}, (422, 'DC051'))
    decision('args with an extra field', {'decision': 'approve', 'fingerprint': fp, 'args': {'user': 'b', 'x': 1}},
             (422, 'DC051'))
    decision('reason too long', {'decision': 'deny', 'fingerprint': fp, 'reason': 'r' * 5000}, bad)
    decision('reason a number', {'decision': 'deny', 'fingerprint': fp, 'reason': 7}, bad)
    decision('the decider named in the body', {**good, 'by': 'admin'}, bad)
    decision('not JSON', '{', bad)
    decision('empty body', '', bad)
    decision('body over 1 MiB', b'x' * big, too_big)
    cases += [
        ('unknown route', 'GET', '/v1/nope', ALICE, None, 404, 'DC044'),
        ('root', 'GET', '/', ALICE, None, 404, 'DC044'),
        ('GET on turns', 'GET', turns, ALICE, None, 405, 'DC042'),
        ('POST on a run', 'POST', status, ALICE, '{}', 405, 'DC042'),
        ('DELETE a conversation', 'DELETE', conv, ALICE, None, 405, 'DC042'),
    ]
    assert len(cases) >= 60 and len({c[0] for c in cases}) == len(cases)
    # What some refusals say (a fresh-user trial read them): each field named once, the API's fixes (its fields and
    # endpoints, not the CLI's flags), and only run ids the client was given.
    said = {
        'decision: decision maybe': ['decision body: field `decision`: expected "approve" or "deny"'],
        'decision: decision in capitals': ['expected "approve" or "deny"'],
        'decision: no fingerprint': ['decision body: field `fingerprint`: Field required'],
        'decision: fingerprint too short': ["field `fingerprint`: expected the pending call's fingerprint",
                                            'GET /v1/runs/{run_id}/approvals'],
        'decision: a list': ['decision body: expected a JSON object, not list'],
        'turn: a string': ['turn body: expected a JSON object, not str'],
        'decision: fingerprint of other arguments': ['DC055', f'GET /v1/runs/{run_id}/approvals', 'nothing was sent'],
        'decision: args outside the schema': ['DC051', "the decision's `args` field"],
        'decision: args of the wrong type': ["the decision's `args` field"],
        'turn: busy strategy unknown': ['turn body: field `busy`: expected "reject", "enqueue" or "interrupt"'],
        'turn: empty prompt': ['turn body: field `prompt`: '],
        'turn: busy conversation (the agent rejects)': [f"run {run_id!r} holds it", '"busy": "enqueue"',
                                                        f'GET /v1/runs/{run_id}'],
        'DELETE a conversation': ['DC042 DELETE is not allowed on /v1/conversations/', ': it takes GET, HEAD'],
    }
    never = ['decision: decision', 'turn: turn', '--args', 'durcap approvals list', 'was refused before doing anything']
    before = _store_rows(dbos_stack.store)
    failures = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for name, method, path, headers, content, expected, code in cases:
            response = client.request(method, path, headers=headers, content=content)
            text = response.text
            try:
                got = json.loads(text)['error']['code']
            except (ValueError, KeyError, TypeError):
                got = None
            if (response.status_code, got) != (expected, code) or 'Traceback' in text or 'File "' in text:
                failures.append(f'{name}: {response.status_code} {text[:300]}')
            elif code == 'DC041' and ('Fix: ' not in text or '--max-body-bytes' not in text):
                failures.append(f'{name}: no fix line: {text[:300]}')  # every DC041 names its fix
            else:
                message = json.loads(text)['error']['message']
                missing_words = [w for w in said.get(name, []) if w not in message]
                wrong = [w for w in never if w in message]
                others = {r for r in re.findall(r"run '([^']+)'", message) if r != run_id} if 'busy conv' in name else set()
                if code.startswith('DC') and not message.startswith(f'{code} '):  # as every coded error's message
                    failures.append(f'{name}: the message does not lead with {code}: {message!r}')
                elif missing_words or wrong or others:
                    failures.append(f'{name}: says {message!r}: missing {missing_words}, should not say {wrong}, '
                                    f'names runs the client was not given {sorted(others)}')
    assert not failures, '\n'.join(failures)
    assert _store_rows(dbos_stack.store) == before
    assert _wait_pending(url, run_id) == [call]
    assert not (dbos_stack.crash_dir / 'revocations').exists()
    # The right decision: the tool runs once; the stream carries the wait and the decision; a second one is refused.
    approved = httpx.post(f'{url}{decide}', json=good, headers=ALICE, timeout=30)
    assert approved.status_code == 200, approved.text
    assert approved.json()['decision']['by'] == 'serve:alice'
    streamed = read_sse(f'{url}{events}', ALICE)
    kinds = [e.kind for e in streamed]
    assert kinds.index('approval_waiting') < kinds.index('approval_decided') < kinds.index('run_completed')
    assert streamed[-1].data['data']['output'] == 'result: revoked sessions of alice'
    for again in (good, {'decision': 'deny', 'fingerprint': fp}):
        refused = httpx.post(f'{url}{decide}', json=again, headers=ALICE, timeout=30)
        assert refused.status_code == 409 and refused.json()['error']['code'] == 'DC054', refused.text
        assert refused.json()['error']['kind'] == 'already-decided', refused.text
        assert 'approved by serve:alice' in refused.json()['error']['message']
    assert (dbos_stack.crash_dir / 'revocations').read_text().splitlines() == ['alice']
    stored = httpx.get(f'{url}{conv}', headers=ALICE, timeout=30).json()
    assert [a['decision'] for a in stored['approvals']] == ['approved'] and stored['approvals'][0]['by'] == 'serve:alice'


NODE = Path(__file__).with_name('node')
SUPPORT_DEPS = {'orders': {'ABC-123': 'Blue denim jacket (size M): shipped 2026-04-28 via UPS, arriving 2026-05-02.'}}
GATE_PROMPT = 'Someone keeps trying to log into my account acct-42 from abroad.'


def _node(script: str, *args: str) -> dict[str, Any]:
    import subprocess

    if not (NODE / 'node_modules').is_dir():  # .ci/run installs them; a developer's first run does it here
        subprocess.run(['npm', 'ci', '--no-audit', '--no-fund', '--ignore-scripts'], cwd=NODE, check=True,
                       capture_output=True, timeout=300)
    done = subprocess.run(['node', script, *args], cwd=NODE, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr + done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith('RESULT '))
    return json.loads(line.split(' ', 1)[1])


@pytest.mark.parametrize('engine', ['dbos', 'temporal'])
def test_node_clients_stream_a_support_turn_receive_the_approval_and_approve_through_the_api(
        engine: str, request: pytest.FixtureRequest) -> None:
    """Real clients from the npm registry (tests/engines/node: `@ag-ui/client`'s HttpAgent, the `ai` SDK's
    DefaultChatTransport with readUIMessageStream) run by node against a `durcap serve` process (the support example,
    `--deps-json`) on the DBOS stack, and on Temporal (the turn a workflow on the task queue of the module's
    `durcap worker temporal`, at the shared dev server): each streams the support demo's account-takeover turn,
    receives its protocol's approval event (AG-UI `RUN_FINISHED` interrupt, Vercel AI `tool-approval-request`) for
    `revoke_sessions`, and approves it through `/v1/runs/{run}/approvals/{call}`, or (`native`, on DBOS) answers in
    the protocol (AG-UI `resume` entries; Vercel AI the tool part `approval-responded`, as useChat does) and reads the
    rest of the run on that stream; the run completes with the revocation in its answer, a second decision on the call
    is refused (409 `DC054`), and the audit records the one approval by `serve:alice`. Model: the
    support example's scripted `SupportScript` (FunctionModel)."""
    stack: Stack = request.getfixturevalue(f'{engine}_stack')
    server, url = start_server(stack.tmp, f'serve-support-{engine}', stack.env, *stack.serve_args, '--deps-json',
                               json.dumps(SUPPORT_DEPS), target='examples.support.agent:support')
    stack.procs.append(server)
    runs = [('ag_ui_client.mjs', 'agui-1', 'api'), ('ag_ui_client.mjs', 'agui-2', 'native'),
            ('vercel_ai_client.mjs', 'vercel-1', 'api'), ('vercel_ai_client.mjs', 'vercel-2', 'native')]
    if engine == 'temporal':  # lean: one turn per client, approved through the API
        runs = [r for r in runs if r[2] == 'api']
    try:
        for script, thread, mode in runs:
            result = _node(script, url, 'token-alice', 'support', thread, GATE_PROMPT, mode)
            run = result['run']
            assert run['conversation_id'] == thread, result
            if script.startswith('ag_ui'):
                assert result['types'][0] == 'RUN_STARTED' and result['types'][-1] == 'RUN_FINISHED', result['types']
                assert [i['toolCallId'] for i in result['interrupts']] == [d['call_id'] for d in result['decided']]
            else:
                assert result['types'][0] == 'start' and 'tool-approval-request' in result['types'], result['types']
                assert [a['toolCallId'] for a in result['approvals']] == [d['call_id'] for d in result['decided']]
            assert [(d['tool'], d['status']) for d in result['decided']] == [('revoke_sessions', 200)], result
            events = read_sse(url + run['events_url'], ALICE)
            if mode == 'native' and script.startswith('ag_ui'):  # resumed in AG-UI: the rest of the run on its stream
                rest = result['types'][result['types'].index('--native-approval--'):]
                assert rest[1] == 'RUN_STARTED' and 'TOOL_CALL_RESULT' in rest and rest[-1] == 'RUN_FINISHED', rest
                assert result['text'] == events[-1].data['data']['output'], rest
            elif mode == 'native':  # the approval sent back in the chat: its stream carried the rest of the run
                rest = result['types'][result['types'].index('--native-approval--'):]
                assert 'tool-output-available' in rest and rest[-1] == 'finish', rest
                assert result['text'] == events[-1].data['data']['output'], rest
            assert events[-1].kind == 'run_completed', events[-1]
            assert 'acct-42' in events[-1].data['data']['output']
            if mode == 'api':  # a second decision on the call the client approved: refused, coded, on this engine too
                [waiting] = [e for e in events if e.kind == 'approval_waiting']
                [call] = waiting.data['data']['calls']
                again = httpx.post(f'{url}/v1/runs/{run["run_id"]}/approvals/{call["call_id"]}', headers=ALICE,
                                   timeout=30, json={'decision': 'deny', 'fingerprint': call['fingerprint']})
                assert again.status_code == 409, again.text
                assert again.json()['error']['code'] == 'DC054', again.text
                assert again.json()['error']['kind'] == 'already-decided', again.text
            stored = httpx.get(f'{url}/v1/conversations/{thread}', headers=ALICE, timeout=30).json()
            assert [(a['tool'], a['decision'], a['by']) for a in stored['approvals']] == [
                ('revoke_sessions', 'approved', 'serve:alice')]
            # Stored once, by that engine's run (DBOS: `dbos:WORKFLOW`, Temporal: `WORKFLOW:TEMPORAL_RUN_ID`).
            [write] = stored['writes']
            assert write['append_id'].startswith(f'dbos:{run["run_id"]}' if engine == 'dbos' else f'{run["run_id"]}:')
    finally:
        server.kill9()


def test_two_serve_processes_a_client_killed_with_its_server_reconnects_to_the_other_and_misses_nothing(
        dbos_stack: Stack) -> None:
    """Two `durcap serve` processes on one DBOS system database and store: the turn is started on A; a client streams
    it from B; B is SIGKILLed mid-stream (the run goes on in the worker); the client reconnects to A with the last
    `Last-Event-ID` it saw and gets the rest: every event once, offsets 1..N without a gap, the text joined equal to
    the answer, and the tool (`charge`, a ledger line per execution) ran once. The `ledgered` agent of
    tests/engines/serve_agents.py (scripted `FunctionModel`, 0.1 s a word)."""
    from tests.engines.serve_agents import LEDGER_ANSWER

    before = _ledger(dbos_stack)
    b, b_url = start_server(dbos_stack.tmp, 'serve-b', dbos_stack.env, '--engine', 'dbos')
    dbos_stack.procs.append(b)
    started = _post(dbos_stack.url, 'two-1', {'agent': 'ledgered', 'prompt': 'charge order Q-1'}, key='two-1')
    assert started.status_code == 202, started.text
    events_url = started.json()['events_url']
    from_b = read_sse(b_url + events_url, ALICE, stop_after=12)
    assert sum(e.kind == 'text_delta' for e in from_b) >= 2 and from_b[-1].kind != 'run_completed', from_b
    b.kill9()
    with pytest.raises(httpx.TransportError):
        httpx.get(f'{b_url}/v1/runs/x', headers=ALICE, timeout=2)
    rest = read_sse(dbos_stack.url + events_url, ALICE, last_event_id=from_b[-1].id)
    whole = [*from_b, *rest]
    assert [e.id for e in whole] == list(range(1, len(whole) + 1))
    assert whole[-1].kind == 'run_completed' and rest[0].id == from_b[-1].id + 1
    assert answer_text([RunEvent.model_validate(e.data) for e in whole]) == LEDGER_ANSWER
    assert _ledger(dbos_stack) == [*before, 'Q-1']


def _ledger(stack: Stack) -> list[str]:
    path = stack.crash_dir / 'ledger'
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope='module')
def browser() -> Iterator[Any]:
    """Headless Chromium from Debian's packages through its chromedriver (as tests/engines/test_ui.py drives it)."""
    import os

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    os.environ['SE_OFFLINE'] = 'true'  # selenium-manager, if ever asked, must not download anything
    options = webdriver.ChromeOptions()
    options.binary_location = '/usr/bin/chromium'
    for arg in ('--headless=new', '--no-sandbox', '--disable-dev-shm-usage', '--window-size=1200,900'):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path='/usr/bin/chromedriver'))
    try:
        yield driver
    finally:
        driver.quit()


def test_chat_page_streams_the_answer_survives_a_reload_and_approves_showing_arguments_as_text(
        dbos_stack: Stack, browser: Any) -> None:
    """`durcap serve --chat` in headless Chromium (Selenium), on the DBOS stack: the `ledgered` turn's answer appears
    on the page while the run is still running; a reload mid-stream continues where it was (the whole answer, once,
    the tool once); then a `gated` turn whose arguments carry HTML (`<b>mallory</b>`) shows them as text (no element
    made of them) with approve / deny buttons, and Approve runs the tool once."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.engines.serve_agents import LEDGER_ANSWER

    def start_turn(agent: str, conversation: str, prompt: str) -> str:
        browser.get(f'{dbos_stack.url}/chat')
        token = browser.find_element(By.ID, 'token')
        token.clear()
        token.send_keys('token-alice')
        for option in browser.find_elements(By.CSS_SELECTOR, '#agent option'):
            if option.get_attribute('value') == agent:
                option.click()
        field = browser.find_element(By.ID, 'conversation')
        field.clear()
        field.send_keys(conversation)
        browser.find_element(By.ID, 'prompt').send_keys(prompt)
        browser.find_element(By.ID, 'send').click()
        return WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, 'run').text)

    def answer() -> str:
        return browser.find_element(By.ID, 'answer').text

    def run_status(run_id: str) -> str:
        return httpx.get(f'{dbos_stack.url}/v1/runs/{run_id}', headers=ALICE, timeout=30).json()['status']

    before = _ledger(dbos_stack)
    run_id = start_turn('ledgered', 'chat-1', 'charge order Q-1')
    WebDriverWait(browser, 60).until(lambda d: 'part03' in answer())
    assert run_status(run_id) == 'running' and LEDGER_ANSWER.startswith(answer())  # streamed before the run ended
    browser.refresh()
    assert browser.find_element(By.ID, 'run').text == run_id
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, 'status').text == 'completed')
    assert answer() == LEDGER_ANSWER and run_status(run_id) == 'completed'
    assert _ledger(dbos_stack) == [*before, 'Q-1']
    browser.execute_script('sessionStorage.removeItem("durcap-chat")')
    run_id = start_turn('gated', 'chat-2', 'revoke <b>mallory</b>')
    approve = WebDriverWait(browser, 60).until(lambda d: d.find_element(By.CSS_SELECTOR, '#approvals button.approve'))
    args = browser.find_element(By.CSS_SELECTOR, '#approvals pre.args')
    assert '"user": "<b>mallory</b>"' in args.text
    assert browser.find_elements(By.CSS_SELECTOR, '#approvals b') == []  # shown as text, never as HTML
    approve.click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, 'status').text == 'completed')
    assert run_status(run_id) == 'completed'
    assert (dbos_stack.crash_dir / 'revocations').read_text().splitlines().count('<b>mallory</b>') == 1


def test_dbos_second_turn_on_a_busy_conversation_rejected_or_enqueued_per_request(dbos_stack: Stack) -> None:
    """Two turns on one conversation through `durcap serve --engine dbos`, the first waiting for approval (holding
    the conversation): a second with `"busy": "reject"` is refused with 409 DC050 naming the first run, before
    anything is recorded or run; one with `"busy": "enqueue"` is accepted and waits (no call pending); once the first
    is approved and stored, the second runs on top of it: the tool once, both turns stored in order. The `gated`
    agent (scripted `FunctionModel`, `revoke_sessions` records each execution)."""
    url, conversation = dbos_stack.url, 'busy-1'
    first = _post(url, conversation, {'agent': 'gated', 'prompt': 'revoke dora'}, key='busy-1-a').json()
    [call] = _wait_pending(url, first['run_id'])
    refused = _post(url, conversation, {'agent': 'gated', 'prompt': 'revoke erin', 'busy': 'reject'}, key='busy-1-b')
    assert refused.status_code == 409 and refused.json()['error']['code'] == 'DC050', refused.text
    assert refused.json()['error']['holder'] == first['run_id']
    said = refused.json()['error']['message']  # the holder waits for an approval: how to decide it
    assert f"and waits for a person's approval of revoke_sessions (call {call['call_id']})" in said, said
    assert f'POST /v1/runs/{first["run_id"]}/approvals/{{call_id}} decides one' in said, said
    second = _post(url, conversation, {'agent': 'gated', 'prompt': 'revoke erin', 'busy': 'enqueue'}, key='busy-1-c')
    assert second.status_code == 202, second.text
    second_id = second.json()['run_id']
    assert httpx.get(f'{url}/v1/runs/{second_id}/approvals', headers=ALICE, timeout=30).json()['pending'] == []
    decided = httpx.post(f'{url}/v1/runs/{first["run_id"]}/approvals/{call["call_id"]}', headers=ALICE, timeout=30,
                         json={'decision': 'approve', 'fingerprint': call['fingerprint']})
    assert decided.status_code == 200, decided.text
    assert read_sse(f'{url}/v1/runs/{first["run_id"]}/events', ALICE)[-1].kind == 'run_completed'
    # The second turn ran after the first was stored: its model saw the first turn's result (the scripted model
    # answers from the last tool result in the history) and called nothing itself.
    last = read_sse(f'{url}/v1/runs/{second_id}/events', ALICE)
    assert last[-1].kind == 'run_completed' and last[-1].data['data']['output'] == 'result: revoked sessions of dora'
    stored = httpx.get(f'{url}/v1/conversations/{conversation}', headers=ALICE, timeout=30).json()
    assert [w['append_id'] for w in stored['writes']] == [f'dbos:{first["run_id"]}', f'dbos:{second_id}']
    assert [a['args'] for a in stored['approvals']] == [{'user': 'dora'}]
    revoked = (dbos_stack.crash_dir / 'revocations').read_text().splitlines()
    assert revoked.count('dora') == 1 and 'erin' not in revoked


@pytest.mark.parametrize('engine', ['dbos', 'temporal'])
def test_a_second_decision_right_after_an_approval_is_refused_as_already_decided(
        engine: str, request: pytest.FixtureRequest) -> None:
    """Two decisions on one call through `durcap serve` (DBOS; Temporal, its worker on the shared dev server), the
    second sent the moment the first was answered (before the run took it): the second, an approval again or a denial,
    is 409 DC054 `already-decided` naming the approval by serve:alice, and the tool runs once. The `gated` agent
    (scripted `FunctionModel`, `revoke_sessions` records each execution)."""
    import uuid

    stack: Stack = request.getfixturevalue(f'{engine}_stack')
    url = stack.url
    if engine == 'temporal':
        server, url = start_server(stack.tmp, f'serve-twice-{engine}', stack.env, *stack.serve_args)
        stack.procs.append(server)
    conversation, user = f'twice-{uuid.uuid4().hex[:6]}', f'ivan{uuid.uuid4().hex[:6]}'
    first = _post(url, conversation, {'agent': 'gated', 'prompt': f'revoke {user}'}, key=conversation).json()
    [call] = _wait_pending(url, first['run_id'])
    decide = f'{url}/v1/runs/{first["run_id"]}/approvals/{call["call_id"]}'
    with httpx.Client(headers=ALICE, timeout=60) as client:
        answers = [client.post(decide, json={'decision': decision, 'fingerprint': call['fingerprint']})
                   for decision in ('approve', 'approve', 'deny')]
    assert answers[0].status_code == 200, answers[0].text
    for again in answers[1:]:
        assert again.status_code == 409, again.text
        error = again.json()['error']
        assert (error['code'], error['kind']) == ('DC054', 'already-decided'), again.text
        assert 'was already approved by serve:alice at ' in error['message'], again.text
        assert 'has not received it' not in error['message'] and 'a call is decided once' in error['message'], again.text
    assert read_sse(f'{url}/v1/runs/{first["run_id"]}/events', ALICE)[-1].kind == 'run_completed'
    assert (stack.crash_dir / 'revocations').read_text().splitlines().count(user) == 1
    # One time for the first decision everywhere it is named: the API's answer, its refusals, the stored audit and the
    # CLI's refusal (the API's claim and the decision it sent were stamped apart, milliseconds apart).
    at = answers[0].json()['decision']['at']
    def named(message: str) -> str:  # the time a DC054 gives the first decision
        return message.replace('\n', ' ').split('approved by serve:alice at ', 1)[1].split()[0].rstrip(';')

    assert [named(a.json()['error']['message']) for a in answers[1:]] == [at, at], answers
    [audit] = httpx.get(f'{url}/v1/conversations/{conversation}', headers=ALICE, timeout=30).json()['approvals']
    assert (audit['decision'], audit['by'], audit['at']) == ('approved', 'serve:alice', at), audit
    where = [a for a in stack.serve_args[:4] if a != '--task-queue']  # the engine and its address
    cli = durcap('deny', first['run_id'], call['call_id'], '--reason', 'late', *where, env=stack.env)
    assert cli.returncode == 2 and 'DC054' in cli.stderr, cli.stderr
    assert named(cli.stderr) == at, cli.stderr


def _protocol_body(protocol: str, thread: str, n: int, prompt: str, answer: dict[str, Any] | None = None) -> dict[str, Any]:
    """A request of `protocol` on `thread`: the user's `prompt`, and with `answer` (`call`, `approve`) that call's
    approval response as the protocol's client sends it (AG-UI a `resume` entry, Vercel AI the assistant message's tool
    part `approval-responded`)."""
    if protocol == 'ag-ui':
        body: dict[str, Any] = {'threadId': thread, 'runId': f'{thread}-{n}', 'state': None, 'tools': [], 'context': [],
                                'forwardedProps': None,
                                'messages': [] if answer else [{'id': 'm1', 'role': 'user', 'content': prompt}]}
        if answer:
            interrupt = f'int-{answer["call"]["call_id"]}'
            body['resume'] = [{'interruptId': interrupt, 'status': 'resolved', 'payload': {'approved': True}}
                              if answer['approve'] else {'interruptId': interrupt, 'status': 'cancelled'}]
        return body
    messages: list[dict[str, Any]] = [{'id': 'm1', 'role': 'user', 'parts': [{'type': 'text', 'text': prompt}]}]
    if answer:
        call = answer['call']
        messages.append({'id': 'a1', 'role': 'assistant', 'parts': [{
            'type': f'tool-{call["tool_name"]}', 'toolCallId': call['call_id'], 'state': 'approval-responded',
            'input': call['args'], 'approval': {'id': f'approval-{call["call_id"]}', 'approved': answer['approve']}}]})
    return {'id': thread, 'trigger': 'submit-message', 'messages': messages}


@pytest.mark.parametrize('protocol', ['ag-ui', 'vercel-ai'])
def test_a_protocol_approval_response_deciding_a_call_the_other_way_is_refused_and_a_retry_is_not(
        protocol: str, dbos_stack: Stack) -> None:
    """The protocols' own approval responses after the call was approved through the API (`durcap serve --engine
    dbos`, a real `durcap worker dbos`): an AG-UI `resume` entry `cancelled` / a Vercel AI `approval-responded` part
    `approved: false` for that call is 409 DC054 `already-decided` naming the approval, nothing sent; the same
    approval sent again (a retried request) streams the rest of the run. The tool ran once and the audit holds the one
    approval. A fresh-user trial saw the `cancelled` entry answered 200 with the tool's result (every decided call was
    skipped as a retry). The `gated` agent (scripted `FunctionModel`, `revoke_sessions` records each execution)."""
    import uuid

    url, endpoint = dbos_stack.url, f'{dbos_stack.url}/v1/agents/gated/{protocol}'
    thread, user = f'{protocol}-{uuid.uuid4().hex[:6]}', f'lena{uuid.uuid4().hex[:6]}'
    prompt = f'revoke {user}'
    started = httpx.post(endpoint, headers=ALICE, timeout=120, json=_protocol_body(protocol, thread, 1, prompt))
    assert started.status_code == 200, started.text
    run_id = started.headers['x-durcap-run-id']
    [call] = _wait_pending(url, run_id)
    approved = httpx.post(f'{url}/v1/runs/{run_id}/approvals/{call["call_id"]}', headers=ALICE, timeout=60,
                          json={'decision': 'approve', 'fingerprint': call['fingerprint']})
    assert approved.status_code == 200, approved.text
    other_way = httpx.post(endpoint, headers=ALICE, timeout=120,
                           json=_protocol_body(protocol, thread, 2, prompt, {'call': call, 'approve': False}))
    assert other_way.status_code == 409, other_way.text
    error = other_way.json()['error']
    assert (error['code'], error['kind']) == ('DC054', 'already-decided'), other_way.text
    assert 'was already approved by serve:alice' in error['message'], other_way.text
    retried = httpx.post(endpoint, headers=ALICE, timeout=120,
                         json=_protocol_body(protocol, thread, 3, prompt, {'call': call, 'approve': True}))
    assert retried.status_code == 200, retried.text
    assert f'revoked sessions of {user}' in retried.text, retried.text[-2000:]
    assert read_sse(f'{url}/v1/runs/{run_id}/events', ALICE)[-1].kind == 'run_completed'
    stored = httpx.get(f'{url}/v1/conversations/{thread}', headers=ALICE, timeout=30).json()
    assert [(a['decision'], a['by']) for a in stored['approvals']] == [('approved', 'serve:alice')], stored['approvals']
    assert (dbos_stack.crash_dir / 'revocations').read_text().splitlines().count(user) == 1

def test_decisions_sent_at_the_same_moment_one_is_accepted_the_others_refused_as_already_decided(
        dbos_stack: Stack) -> None:
    """Four decisions on one call through `durcap serve --engine dbos` sent at once from four threads (approve, deny,
    approve, approve: two reviewers and a double click): exactly one is 200, the other three 409 DC054
    `already-decided`, and the run does what the accepted one said (the tool once if it was an approval, never if a
    denial). A fresh-user trial saw approve and deny both answered 200 (DBOS checks, then sends). The `gated` agent
    (scripted `FunctionModel`, `revoke_sessions` records each execution)."""
    import threading
    import uuid
    from concurrent.futures import ThreadPoolExecutor

    url = dbos_stack.url
    conversation, user = f'race-{uuid.uuid4().hex[:6]}', f'kim{uuid.uuid4().hex[:6]}'
    first = _post(url, conversation, {'agent': 'gated', 'prompt': f'revoke {user}'}, key=conversation).json()
    [call] = _wait_pending(url, first['run_id'])
    decide = f'{url}/v1/runs/{first["run_id"]}/approvals/{call["call_id"]}'
    decisions = ['approve', 'deny', 'approve', 'approve']
    barrier = threading.Barrier(len(decisions))

    def send(decision: str) -> httpx.Response:
        with httpx.Client(headers=ALICE, timeout=60) as client:
            barrier.wait()
            return client.post(decide, json={'decision': decision, 'fingerprint': call['fingerprint']})

    with ThreadPoolExecutor(len(decisions)) as pool:
        answers = list(pool.map(send, decisions))
    accepted = [d for d, a in zip(decisions, answers, strict=True) if a.status_code == 200]
    assert len(accepted) == 1, [(a.status_code, a.text) for a in answers]
    for answer in answers:
        if answer.status_code != 200:
            assert answer.status_code == 409, answer.text
            assert answer.json()['error']['code'] == 'DC054', answer.text
    assert read_sse(f'{url}/v1/runs/{first["run_id"]}/events', ALICE)[-1].kind == 'run_completed'
    revocations = dbos_stack.crash_dir / 'revocations'
    ran = revocations.read_text().splitlines().count(user) if revocations.exists() else 0
    assert ran == (1 if accepted == ['approve'] else 0), (accepted, ran)


def test_dbos_second_turn_interrupts_the_first_through_the_api(dbos_stack: Stack) -> None:
    """`"busy": "interrupt"` through `durcap serve --engine dbos`: the first turn waits for approval; the second is
    accepted (202) and the serve process denies the first's pending call (reason naming the second run); the first
    turn's next model request is not sent, it ends with the interrupted answer and is stored with its audit, then the
    second runs on top of it. The gated tool never ran. The `gated` agent (scripted `FunctionModel`: it answers from
    the last tool result in the history, so the second turn answers with the first's denial)."""
    url, conversation = dbos_stack.url, 'interrupt-1'
    first = _post(url, conversation, {'agent': 'gated', 'prompt': 'revoke gina'}, key='interrupt-1-a').json()
    _wait_pending(url, first['run_id'])
    second = _post(url, conversation, {'agent': 'gated', 'prompt': 'revoke hank', 'busy': 'interrupt'},
                   key='interrupt-1-b')
    assert second.status_code == 202, second.text
    second_id = second.json()['run_id']
    events = read_sse(f'{url}/v1/runs/{first["run_id"]}/events', ALICE)
    assert events[-1].kind == 'run_completed', events[-1]
    output = events[-1].data['data']['output']
    assert output.startswith(f'Interrupted: a newer turn (run {second_id}) took over this conversation'), output
    last = read_sse(f'{url}/v1/runs/{second_id}/events', ALICE)
    assert last[-1].kind == 'run_completed' and 'interrupted by a newer turn' in last[-1].data['data']['output'], last[-1]
    stored = httpx.get(f'{url}/v1/conversations/{conversation}', headers=ALICE, timeout=30).json()
    assert [w['append_id'] for w in stored['writes']] == [f'dbos:{first["run_id"]}', f'dbos:{second_id}']
    assert [(a['args'], a['decision'], a['by'], a['reason']) for a in stored['approvals']] == [
        ({'user': 'gina'}, 'denied', 'durcap (interrupt)', f'interrupted by a newer turn (run {second_id})')]
    revocations = dbos_stack.crash_dir / 'revocations'
    assert 'gina' not in (revocations.read_text().splitlines() if revocations.exists() else [])


def test_dbos_workflow_ignores_a_stale_decision_sent_straight_to_it(dbos_stack: Stack) -> None:
    """The workflow-side fingerprint check on DBOS (issue 26, item 4): a denial quoting the fingerprint of other
    arguments is sent straight to the waiting workflow (`DBOSClient.send` on the decision topic, past every client
    check), then the right approval through `durcap serve`. The workflow ignores the stale one: the tool runs once
    and the audit records the approval (without the check, the denial, arriving first, would win). The `gated` agent
    (scripted `FunctionModel`)."""
    from dbos import DBOSClient

    from durable_capabilities.approvals import Decision, fingerprint
    from durable_capabilities.engines.dbos._spec import DECISION_TOPIC

    url = dbos_stack.url
    run_id = _post(url, 'stale-1', {'agent': 'gated', 'prompt': 'revoke frank'}, key='stale-1').json()['run_id']
    [call] = _wait_pending(url, run_id)
    stale = Decision(call['call_id'], fingerprint('revoke_sessions', {'user': 'mallory'}), False, 'stale', by='mallory')
    client = DBOSClient(system_database_url=dbos_stack.env['DURCAP_DBOS_DB'])
    try:
        client.send(run_id, stale.to_json(), DECISION_TOPIC, idempotency_key='stale-1')
    finally:
        client.destroy()
    decided = httpx.post(f'{url}/v1/runs/{run_id}/approvals/{call["call_id"]}', headers=ALICE, timeout=30,
                         json={'decision': 'approve', 'fingerprint': call['fingerprint']})
    assert decided.status_code == 200, decided.text
    events = read_sse(f'{url}/v1/runs/{run_id}/events', ALICE)
    assert events[-1].data['data']['output'] == 'result: revoked sessions of frank'
    assert (dbos_stack.crash_dir / 'revocations').read_text().splitlines().count('frank') == 1
    stored = httpx.get(f'{url}/v1/conversations/stale-1', headers=ALICE, timeout=30).json()
    assert [(a['decision'], a['by'], a['fingerprint']) for a in stored['approvals']] == [
        ('approved', 'serve:alice', call['fingerprint'])]


def test_one_run_per_idempotency_key_on_postgresql_under_concurrent_posts(postgres_url: str) -> None:
    """The serve rows on a PostgreSQL conversation store (the unique keys, not a SQLite write lock, decide): eight
    concurrent POSTs with one Idempotency-Key to an in-process app (httpx's ASGI transport, the store's writes in
    worker threads) start one run and store one turn; each answer names that run. Model: pydantic-ai's `TestModel`,
    local engine."""
    from pydantic_ai.models.test import TestModel

    from durable_capabilities import DurableAgent
    from durable_capabilities.serve import bearer_auth, create_app

    app = create_app(DurableAgent('pg-serve', TestModel()), settings={'store': postgres_url},
                     auth=bearer_auth('token-alice'))

    async def scenario() -> tuple[list[httpx.Response], str]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url='http://serve') as client:
            answers = await asyncio.gather(*[client.post('/v1/conversations/pg-1/turns', json={'prompt': 'hello'},
                                                         headers={**ALICE, 'Idempotency-Key': 'pg-key'}) for _ in range(8)])
            events = await client.get(answers[0].json()['events_url'], headers=ALICE)
            return list(answers), events.text

    answers, events = asyncio.run(scenario())
    assert [a.status_code for a in answers] == [202] * 8, [a.text for a in answers]
    assert len({a.json()['run_id'] for a in answers}) == 1 and sum(a.json()['created'] for a in answers) == 1
    assert 'event: run_completed' in events
    assert sql(postgres_url, 'SELECT COUNT(*) FROM durcap_serve_runs') == [(1,)]
    assert sql(postgres_url, 'SELECT COUNT(*) FROM durcap_writes WHERE conversation_id = :c', {'c': 'pg-1'}) == [(1,)]


@pytest.mark.parametrize('engine', ['local', 'dbos', 'temporal'])
def test_new_turns_posted_at_once_on_one_conversation_one_runs_the_others_are_refused_or_queued(
        engine: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Four new turns POSTed at the same moment to one conversation (no Idempotency-Key: four different requests)
    through `durcap serve` (local; DBOS, its worker on SQLite; Temporal, its worker at the shared dev server). With
    `busy` reject (the agent's default): one 202, three 409 DC050 naming that run, before anything was recorded or
    run (one `durcap_serve_runs` row, one turn stored, no DC050 or traceback in any log). With `"busy": "enqueue"`:
    four 202, and the four turns are stored one after another, each once. A fresh-user trial on DBOS got four 202 and
    three runs failing with DC050 and an 80-line traceback in the worker log. The `streamer` agent (scripted
    `FunctionModel`: a tool call, then the answer streamed word by word, 20 ms a word)."""
    import uuid

    from tests.engines.stream_agent import ANSWER

    if engine == 'local':
        env, crash, store = _env(tmp_path)
        server, url = start_server(tmp_path, 'serve-rush-local', env, '--engine', 'local')
        stack = Stack(url, store, env, crash, [server], tmp_path)
    else:
        stack = request.getfixturevalue(f'{engine}_stack')
        url = stack.url
        if engine == 'temporal':
            server, url = start_server(stack.tmp, f'serve-rush-{uuid.uuid4().hex[:6]}', stack.env, *stack.serve_args)
            stack.procs.append(server)
    logs = {log: log.stat().st_size for log in stack.tmp.glob('*.log')}  # the stack's logs so far (other tests')
    try:
        async def rush(conversation: str, busy: str | None) -> list[httpx.Response]:
            async with httpx.AsyncClient(timeout=60) as client:
                return list(await asyncio.gather(*[
                    client.post(f'{url}/v1/conversations/{conversation}/turns', headers=ALICE,
                                json={'agent': 'streamer', 'prompt': f'where is ABC-123? ({n})',
                                      **({'busy': busy} if busy else {})}) for n in range(4)]))

        rejected = f'rush-{uuid.uuid4().hex[:6]}'
        answers = asyncio.run(rush(rejected, None))
        assert sorted(a.status_code for a in answers) == [202, 409, 409, 409], [(a.status_code, a.text) for a in answers]
        [accepted] = [a.json() for a in answers if a.status_code == 202]
        for refused in (a.json()['error'] for a in answers if a.status_code == 409):
            assert refused['code'] == 'DC050' and refused['holder'] == accepted['run_id'], refused
            assert f"run {accepted['run_id']!r} holds it" in refused['message'], refused
            assert 'refused before anything was recorded or run' in refused['message'], refused
        assert read_sse(url + accepted['events_url'], ALICE)[-1].kind == 'run_completed'
        stored = httpx.get(f'{url}/v1/conversations/{rejected}', headers=ALICE, timeout=30).json()
        assert [w['operation'] for w in stored['writes']] == ['append'], stored['writes']
        assert sql(stack.store, 'SELECT COUNT(*) FROM durcap_serve_runs WHERE conversation_id = :c',
                   {'c': rejected}) == [(1,)]
        assert sql(stack.store, 'SELECT COUNT(*) FROM durcap_turn_claims WHERE conversation_id = :c',
                   {'c': rejected}) == [(0,)]

        queued = f'queue-{uuid.uuid4().hex[:6]}'
        answers = asyncio.run(rush(queued, 'enqueue'))
        assert [a.status_code for a in answers] == [202] * 4, [a.text for a in answers]
        for answer in answers:
            events = read_sse(url + answer.json()['events_url'], ALICE, timeout=240)
            assert events[-1].kind == 'run_completed' and events[-1].data['data']['output'] == ANSWER, events[-1]
        stored = httpx.get(f'{url}/v1/conversations/{queued}', headers=ALICE, timeout=30).json()
        assert [w['operation'] for w in stored['writes']] == ['append'] * 4, stored['writes']
        prompts = [p['content'] for m in stored['messages'] if m['kind'] == 'request' for p in m['parts']
                   if p.get('part_kind') == 'user-prompt']
        assert sorted(prompts) == [f'where is ABC-123? ({n})' for n in range(4)], prompts
        for log in stack.tmp.glob('*.log'):
            with open(log, 'rb') as f:
                f.seek(logs.get(log, 0))
                text = f.read().decode(errors='replace')
            assert 'Traceback' not in text and 'DC050' not in text, f'{log.name}:\n{text[-3000:]}'
    finally:
        if engine == 'local':
            server.kill9()


def test_dbos_worker_logs_a_turn_refused_as_busy_in_one_line(dbos_stack: Stack) -> None:
    """Two turns handed straight to the DBOS queue on one conversation at once (`runner.run(queue=...)`, as `durcap
    run --queue` does: no serve process to refuse the second first): the worker refuses the second at its load (DC050)
    and logs it as one warning line naming the workflow, without DBOS's ~80-line traceback. The `streamer` agent
    (scripted `FunctionModel`)."""
    import uuid

    from durable_capabilities import runner
    from durable_capabilities.store import ConversationBusyError
    from tests.engines.serve_agents import streamer

    log = dbos_stack.tmp / 'worker.log'
    seen = log.stat().st_size
    conversation = f'queue-busy-{uuid.uuid4().hex[:6]}'

    async def both() -> list[Any]:
        return list(await asyncio.gather(*[
            runner.run(streamer, f'where is ABC-123? ({n})', engine='dbos', conversation_id=conversation,
                       db=dbos_stack.env['DURCAP_DBOS_DB'], queue='durcap', store=dbos_stack.store,
                       notify=lambda line: None) for n in range(2)], return_exceptions=True))

    results = asyncio.run(both())
    refused = [r for r in results if isinstance(r, ConversationBusyError)]
    assert len(refused) == 1 and len([r for r in results if not isinstance(r, BaseException)]) == 1, results
    with open(log, 'rb') as f:
        f.seek(seen)
        text = f.read().decode(errors='replace')
    [line] = [line for line in text.splitlines() if 'DC050' in line]
    assert 'WARNING' in line and f'workflow {refused[0].run_id} refused: DC050' in line, line
    assert 'Traceback' not in text, text[-3000:]


def test_a_client_leaving_a_local_stream_drops_its_subscription_and_the_turn_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The SSE response (`serve._app._EventStream`, a plain ASGI response) watches the client: one that closes its
    stream mid-turn has its subscription dropped at once (not when the run ends), the turn it watched still runs to its
    end and is stored, and a new client resumes with Last-Event-ID and gets the rest once each. A real uvicorn server
    in this process (so the subscription table is visible), httpx clients; model: `stream_agent`'s scripted
    `FunctionModel`, 100 ms between words (~3 s a turn)."""
    import uvicorn

    from durable_capabilities.serve import bearer_auth, create_app
    from durable_capabilities.streams import _log
    from tests.engines.stream_agent import ANSWER, agent

    monkeypatch.setenv('DURCAP_STREAM_DELAY', '0.1')
    store = f'sqlite:///{tmp_path / "conversations.db"}'
    app = create_app(agent, engine='local', settings={'store': store}, auth=bearer_auth('token-alice'))
    port = free_port()
    url = f'http://127.0.0.1:{port}'

    async def scenario() -> None:
        server = uvicorn.Server(uvicorn.Config(app, host='127.0.0.1', port=port, log_level='warning'))
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not serving.done(), 'uvicorn stopped before it listened'
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=url, headers=ALICE, timeout=30) as client:
                posted = await client.post('/v1/conversations/leaving/turns', json={'prompt': 'where is ABC-123?'})
                assert posted.status_code == 202, posted.text
                run_id, events_url = posted.json()['run_id'], posted.json()['events_url']
                seen: list[int] = []
                async with client.stream('GET', events_url) as response:
                    async for line in response.aiter_lines():
                        if line.startswith('id: '):
                            seen.append(int(line[4:]))
                        if line == 'event: text_delta':
                            break  # the client leaves mid-answer
                assert run_id in app.state.serve.known_runs, 'the turn ended before the client left: nothing shown'
                deadline = time.monotonic() + 10
                while run_id in _log._WAITERS:  # dropped by the disconnect, not by the run's end
                    assert time.monotonic() < deadline, 'the subscription outlived its client'
                    await asyncio.sleep(0.01)
                # The run had not ended when its subscription went: its stream is still open.
                assert sql(store, 'SELECT closed_at FROM durcap_run_streams WHERE run_id = :r', {'r': run_id}) == [(None,)]
                rest = []
                async with client.stream('GET', events_url, headers={'Last-Event-ID': str(seen[-1])}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith('data: '):
                            rest.append(json.loads(line[6:]))
                assert [e['offset'] for e in rest] == list(range(seen[-1] + 1, seen[-1] + 1 + len(rest)))
                assert rest[-1]['kind'] == 'run_completed' and rest[-1]['data']['output'] == ANSWER
                stored = (await client.get('/v1/conversations/leaving')).json()
                assert stored['message_count'] == 4
        finally:
            server.should_exit = True
            await serving

    asyncio.run(scenario())
