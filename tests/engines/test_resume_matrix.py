"""Resume a stored conversation on any engine: the 16-pair matrix, drift on resume, retried appends.

Model: the scripted support model of examples/support/scripted.py (`SupportScript`, a pydantic-ai
`FunctionModel` named `scripted-support`; every decision is a function of the messages it receives, no
provider is called), through `tests/engines/resume_driver.py`, which records what the model was offered
per request where the request ran (in the driver's process on every engine: the Temporal worker runs
inline there).

Real servers: the session's Temporal dev server and Prefect server (tests/engines/conftest.py), DBOS on
SQLite or PostgreSQL, PostgreSQL on 127.0.0.1:5432. The conversation store is one SQLite file, or one fresh
PostgreSQL database, shared by every process of a backend.

Runs are grouped to keep the runtime down: per backend, phase 1 starts one driver process per engine (all
four at once) that performs every first run made on that engine; phase 2 then starts one per engine for
every second run. Each test reads the reports of the phases (a module-scoped fixture) and the store.

Conversations, per backend:
- `m-{first}-{second}`: 'Where is my order ABC-123?' on `first` (the model loads `orders`), then a follow-up
  about the order on `second`; 16 pairs.
- `d-{kind}-{engine}`: loaded `orders` on `engine`, resumed on `engine` with a definition that drifted
  (`orders` renamed to `orders-v2` without an alias, with drift='error' and drift='warning'; `orders`
  dropped; `orders` keeping its id while its tool `order_status` became `order_lookup`).
- `retry-{engine}` (durable engines): both runs fail right after the store committed their append (an
  injected error), so the engine retries the append unit (Temporal activity retry, DBOS step retry,
  Prefect task retry).
Plus a DBOS process and a Prefect process killed with SIGKILL inside the append unit after the store
committed, the run taken over by another process; and a DBOS workflow that failed on drift, read back from
another process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities.engines import DURABLE_ENGINES
from examples.support.agent import make_store
from tests._helpers import ROOT, create_database, drop_database, subprocess_env

# One worker runs this module's tests (pytest-xdist `loadgroup`): they share a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('resume-matrix')]


DRIVER_TIMEOUT = 300.0
DURABLE = tuple(DURABLE_ENGINES)
ENGINES = ('local', *DURABLE)
BACKENDS = ('sqlite', 'postgres')

FIRST = 'Where is my order ABC-123?'
FOLLOW_UP = 'Any news on ABC-123 since we last spoke?'
THANKS = 'Thanks!'
ORDER_ANSWER = f'Order ABC-123: {make_store().orders["ABC-123"]}'
CHAT_ANSWER = 'Happy to help! Could you tell me your order id or what happened?'
ORDERS_INSTRUCTIONS = 'Quote the order ID and item name when discussing an order.'

# kind -> (variant, drift) of the definition the second run resumes with (see resume_driver.VARIANTS)
DRIFT_KINDS: dict[str, tuple[str, str]] = {
    'renamed': ('renamed', 'error'),
    'renamed-warning': ('renamed', 'warning'),
    'dropped': ('dropped', 'error'),
    'tool-gone': ('tool-gone', 'error'),
}


# ---- driver processes ----------------------------------------------------------------------------


@dataclass
class Driver:
    """One `resume_driver` process in its own process group, its output in `log`."""

    engine: str
    popen: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=30)

    def report(self, deadline: float) -> dict[str, Any]:
        try:
            self.popen.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        finally:
            self.kill()
        text = self.log.read_text(errors='replace')
        for line in text.splitlines():
            if line.startswith('REPORT '):
                return json.loads(line.removeprefix('REPORT '))
        raise AssertionError(f'resume driver ({self.engine}) gave no report (exit {self.popen.returncode}):\n{text[-6000:]}')


def start_driver(engine: str, plan: list[dict[str, Any]], out_dir: Path, env: dict[str, str], *extra: str) -> Driver:
    out_dir.mkdir(parents=True, exist_ok=True)
    plan_path = out_dir / 'plan.json'
    plan_path.write_text(json.dumps(plan))
    log = out_dir / 'driver.log'
    with open(log, 'wb') as handle:
        popen = subprocess.Popen(
            [sys.executable, '-m', 'tests.engines.resume_driver', engine, '--plan', str(plan_path), '--out-dir', str(out_dir),
             *extra],
            cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            env=subprocess_env(env),
        )
    return Driver(engine, popen, log)


def read_appends(out_dir: Path) -> list[dict[str, Any]]:
    path = out_dir / 'appends.jsonl'
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- the store, read from this process -----------------------------------------------------------


def stored(url: str, conversation_id: str) -> tuple[Any, list[Any]]:
    """`(StoredConversation, write log)`."""
    from durable_capabilities.store import SQLConversationStore

    async def read() -> tuple[Any, list[Any]]:
        async with SQLConversationStore(url) as store:
            return await store.read(conversation_id), await store.writes(conversation_id)

    return asyncio.run(read())


def as_json(messages: list[Any]) -> list[dict[str, Any]]:
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    return ModelMessagesTypeAdapter.dump_python(messages, mode='json')


# ---- one backend's world: the phases, run once per module -----------------------------------------


@dataclass
class World:
    backend: str
    store_url: str
    dbos_url: str
    root: Path
    env: dict[str, str]
    address: str
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)  # '{cid}/{phase}' -> step report
    appends: list[dict[str, Any]] = field(default_factory=list)

    def step(self, conversation_id: str, phase: int) -> dict[str, Any]:
        report = self.steps[f'{conversation_id}/{phase}']
        assert report['conversation_id'] == conversation_id
        return report

    def engine_args(self, engine: str) -> tuple[list[str], dict[str, str]]:
        env = {'DURCAP_STORE': self.store_url, **self.env}
        if engine == 'temporal':
            return ['--address', self.address], env
        if engine == 'dbos':
            return ['--db', self.dbos_url], env
        return [], env

    def run_phase(self, phase: int, plans: dict[str, list[dict[str, Any]]]) -> None:
        """One driver process per engine, all at once; each performs its plan's steps in order."""
        name = f'phase{phase}'
        drivers: list[Driver] = []
        try:
            for engine, plan in plans.items():
                extra, env = self.engine_args(engine)
                if engine == 'prefect':
                    env = {**env, 'PREFECT_HOME': str(self.root / name / 'prefect-home'),
                           'PREFECT_LOCAL_STORAGE_PATH': str(self.root / name / 'prefect-results')}
                drivers.append(start_driver(engine, plan, self.root / name / engine, env, *extra))
            deadline = time.monotonic() + DRIVER_TIMEOUT
            for driver in drivers:
                report = driver.report(deadline)
                for step in report['steps']:
                    step['engine'] = driver.engine
                    self.steps[f'{step["conversation_id"]}/{phase}'] = step
                self.appends += read_appends(self.root / name / driver.engine)
        finally:
            for driver in drivers:
                driver.kill()


def _step(cid: str, prompt: str, variant: str = 'support', drift: str = 'error', **more: Any) -> dict[str, Any]:
    return {'label': cid, 'conversation_id': cid, 'prompt': prompt, 'variant': variant, 'drift': drift, **more}


def plans(tag: str) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """Phase 1 and phase 2 plans, per engine."""
    phase1: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    phase2: dict[str, list[dict[str, Any]]] = {e: [] for e in ENGINES}
    for first in ENGINES:
        for second in ENGINES:
            phase1[first].append(_step(f'm-{first}-{second}', FIRST))
            phase2[second].append(_step(f'm-{first}-{second}', FOLLOW_UP))
    for engine in ENGINES:
        for kind, (variant, drift) in DRIFT_KINDS.items():
            cid = f'd-{kind}-{engine}'
            phase1[engine].append(_step(cid, FIRST))
            phase2[engine].append(_step(cid, THANKS, variant, drift, workflow_id=f'{tag}-{cid}') if engine in ('temporal', 'dbos')
                                  else _step(cid, THANKS, variant, drift))
    for engine in DURABLE:
        phase1[engine].append(_step(f'retry-{engine}', FIRST, fault='raise'))
        phase2[engine].append(_step(f'retry-{engine}', FOLLOW_UP, fault='raise'))
    return phase1, phase2


def _create_postgres_database() -> str:
    return create_database('durcap_resume')


def _drop_postgres_database(name: str) -> None:
    drop_database(name)


@pytest.fixture(scope='module')
def worlds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], World]]:
    """`worlds(backend)`: both phases run on `backend` ('sqlite' or 'postgres'), once per module."""
    built: dict[str, World | str] = {}
    databases: list[str] = []

    def get(backend: str) -> World:
        if backend not in built:
            root = tmp_path_factory.mktemp(f'resume-{backend}')
            if backend == 'sqlite':
                store_url, dbos_url = f'sqlite:///{root / "conversations.db"}', f'sqlite:///{root / "dbos.sqlite"}'
            else:
                databases.extend([_create_postgres_database(), _create_postgres_database()])
                store_url = f'postgresql://postgres@127.0.0.1:5432/{databases[-2]}'
                dbos_url = f'postgresql://postgres@127.0.0.1:5432/{databases[-1]}'
            world = World(
                backend, store_url, dbos_url, root,
                {'PREFECT_API_URL': request.getfixturevalue('prefect_api_url')},
                request.getfixturevalue('temporal_address'),
            )
            # Create the schema first, so the four processes of phase 1 never race to migrate it.
            from durable_capabilities.store import SQLConversationStore

            async def create() -> None:
                async with SQLConversationStore(store_url) as store:
                    await store.read_records()

            asyncio.run(create())
            phase1, phase2 = plans(f'{backend}-{uuid.uuid4().hex[:6]}')
            try:
                world.run_phase(1, phase1)
                world.run_phase(2, phase2)
                built[backend] = world
            except AssertionError as exc:
                built[backend] = str(exc)
        world_or_error = built[backend]
        if isinstance(world_or_error, str):
            pytest.fail(world_or_error, pytrace=False)
        return world_or_error

    try:
        yield get
    finally:
        for name in databases:
            _drop_postgres_database(name)


def ok(step: dict[str, Any]) -> dict[str, Any]:
    assert step['ok'], f'{step["engine"]} {step["label"]}: {step["error"]}'
    return step


def calls(step: dict[str, Any], tool: str) -> list[dict[str, Any]]:
    return [
        part for message in step['new_messages'] if message['kind'] == 'response'
        for part in message['parts'] if part['part_kind'] == 'tool-call' and part['tool_name'] == tool
    ]


def instruction_parts(step: dict[str, Any]) -> list[str]:
    labels = []
    for message in step['new_messages']:
        for part in message['parts']:
            if part['part_kind'] == 'instruction-delta':
                labels.append(f'delta@{part["id"]}')
            elif part['part_kind'] == 'instruction-baseline':
                labels.extend(f'baseline@{i["id"]}' for i in part['instructions'])
    return labels


def user_prompts(messages: list[dict[str, Any]]) -> list[str]:
    return [
        part['content'] for message in messages if message['kind'] == 'request'
        for part in message['parts'] if part['part_kind'] == 'user-prompt'
    ]


def append_id_prefix(step: dict[str, Any]) -> str:
    """The append id every engine derives from its durable run (the whole id for DBOS and Prefect)."""
    engine, run_id = step['engine'], step['run_id']
    return {'local': 'local:', 'temporal': f'{run_id}:', 'dbos': f'dbos:{run_id}', 'prefect': f'prefect:{run_id}'}[engine]


def conversation_units(engine: str, step: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(load units, append units) among the durable units the engine recorded for the run."""
    agent = 'resume-support-error'
    units = step['units']
    if engine == 'temporal':
        return ([u for u in units if u == f'agent__{agent}__conversation_load'],
                [u for u in units if u == f'agent__{agent}__conversation_append'])
    if engine == 'dbos':
        return ([u for u in units if u == f'durcap__{agent}__conversation.load'],
                [u for u in units if u == f'durcap__{agent}__conversation.append'])
    return [], []  # Prefect: the flow's own code loads and appends (engines.prefect._conversation), no task runs


def _matrix_params() -> list[Any]:
    return [
        pytest.param(backend, first, second, id=f'{backend}-{first}-then-{second}')
        for backend in BACKENDS for first in ENGINES for second in ENGINES
    ]


# ---- 1. the resume matrix ------------------------------------------------------------------------


@pytest.mark.parametrize(('backend', 'first', 'second'), _matrix_params())
def test_resume_on_another_engine_keeps_the_loaded_capability(worlds, backend: str, first: str, second: str) -> None:
    world = worlds(backend)
    cid = f'm-{first}-{second}'
    run1, run2 = ok(world.step(cid, 1)), ok(world.step(cid, 2))
    assert (run1['engine'], run2['engine']) == (first, second)

    # Run 1: the model saw only the loader, loaded `orders`, then used its tool.
    assert [r['response'] for r in run1['requests']] == [
        'load_capability(orders)', "order_status(order_id='ABC-123')", f'text: {ORDER_ANSWER}',
    ]
    assert 'order_status' not in run1['requests'][0]['tools']
    assert run1['output'] == ORDER_ANSWER

    # Run 2, on the other engine, from the store: the FIRST request already offers `order_status` and carries
    # `orders`' instructions from the history; no `load_capability` call, and nothing is delivered again.
    first_request = run2['requests'][0]
    assert sorted(first_request['tools']) == ['issue_refund', 'load_capability', 'order_status']
    assert first_request['context'] == {'orders': ORDERS_INSTRUCTIONS}
    assert [r['response'] for r in run2['requests']] == ["order_status(order_id='ABC-123')", f'text: {ORDER_ANSWER}']
    assert calls(run2, 'load_capability') == []
    assert instruction_parts(run2) == []
    assert run2['output'] == ORDER_ANSWER
    if second not in ('local', 'prefect'):  # the store I/O ran once each, inside the engine's durable units
        loads, appends = conversation_units(second, run2)
        assert (len(loads), len(appends)) == (1, 1), run2['units']
    elif second == 'prefect':  # in the flow's code: no conversation task among the task runs
        assert not [u for u in run2['units'] if 'Conversation' in u], run2['units']

    # The store: revision 2, run 1's messages then run 2's, each exactly once, as the runs reported them.
    conversation, writes = stored(world.store_url, cid)
    assert conversation.revision == 2
    assert as_json(conversation.messages) == run1['new_messages'] + run2['new_messages']
    assert user_prompts(as_json(conversation.messages)) == [FIRST, FOLLOW_UP]
    assert [w.revision for w in writes] == [1, 2]
    assert [w.operation for w in writes] == ['append', 'append']
    assert [len(w.entry_ids) for w in writes] == [len(run1['new_messages']), len(run2['new_messages'])]
    for write, run in zip(writes, (run1, run2), strict=True):
        assert write.append_id.startswith(append_id_prefix(run)), (write.append_id, run['engine'], run['run_id'])


@pytest.mark.parametrize('backend', BACKENDS)
def test_replaying_any_engines_append_stores_nothing(worlds, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The append body a retried unit runs again (same append id, the revision it read before its first
    attempt, the same messages): for every run of the matrix, on every engine, it returns the revision of
    the first attempt and the store is unchanged, even though the stored revision has moved on."""
    from durable_capabilities.conversations import append_conversation
    from examples.support.scripted import SupportScript
    from tests.engines.resume_driver import build

    world = worlds(backend)
    monkeypatch.setenv('DURCAP_STORE', world.store_url)
    agent = build('support', 'error', SupportScript())
    for first in ENGINES:
        for second in ENGINES:
            cid = f'm-{first}-{second}'
            before, writes = stored(world.store_url, cid)
            run1, run2 = world.step(cid, 1), world.step(cid, 2)
            for write, run, expected in ((writes[0], run1, None), (writes[1], run2, 1)):
                revision = asyncio.run(append_conversation(
                    agent, cid, run['new_messages'], expected_revision=expected, append_id=write.append_id,
                ))
                assert revision == write.revision, cid
            after, writes_after = stored(world.store_url, cid)
            assert (after.revision, as_json(after.messages)) == (before.revision, as_json(before.messages)), cid
            assert writes_after == writes, cid


# ---- 2. drift on resume --------------------------------------------------------------------------


def _drift_params() -> list[Any]:
    return [
        pytest.param(backend, engine, kind, id=f'{backend}-{engine}-{kind}')
        for backend in BACKENDS for engine in ENGINES for kind in DRIFT_KINDS
    ]


def error_text(step: dict[str, Any]) -> str:
    assert not step['ok'], f'{step["engine"]} {step["label"]} resumed: {step["output"]!r}'
    return '\n'.join(step['error']['chain'])


@pytest.mark.parametrize(('backend', 'engine', 'kind'), _drift_params())
def test_drift_on_resume_is_reported(worlds, backend: str, engine: str, kind: str) -> None:
    world = worlds(backend)
    cid = f'd-{kind}-{engine}'
    run1, run2 = ok(world.step(cid, 1)), world.step(cid, 2)
    assert run1['output'] == ORDER_ANSWER
    conversation, writes = stored(world.store_url, cid)

    if kind == 'renamed-warning':
        # drift='warning': the run resumes, and the store load reports DC018 with the old id and the fix.
        ok(run2)
        assert len(run2['warnings']) == 1, run2['warnings']
        warning = run2['warnings'][0]
        assert warning.startswith(f"warning DC018 conversation '{cid}': the history loaded capability 'orders' (message 3)")
        assert "It looks renamed to 'orders-v2', which has order_status." in warning
        assert "aliases={'orders-v2': 'orders'}" in warning
        # What the warning warns about: without an alias `orders` is not loaded on resume.
        assert 'order_status' not in run2['requests'][0]['tools']
        assert run2['output'] == CHAT_ANSWER
        assert conversation.revision == 2
        assert as_json(conversation.messages) == run1['new_messages'] + run2['new_messages']
        return

    text = error_text(run2)
    # Refused before any model request, nothing appended.
    assert run2['requests'] == []
    assert conversation.revision == 1 and len(writes) == 1
    assert as_json(conversation.messages) == run1['new_messages']
    if engine == 'temporal':
        # A failed workflow: WorkflowFailureError -> ActivityError (the load activity) -> ApplicationError.
        chain = run2['error']['chain']
        assert run2['error']['type'] == 'WorkflowFailureError'
        assert chain[1].startswith('ActivityError: ')
        assert chain[2].startswith('ApplicationError: DurableConfigError: ')
    else:
        assert run2['error']['type'] == 'DurableConfigError'
    assert f"conversation '{cid}'" in text

    if kind == 'renamed':
        assert f"error DC018 conversation '{cid}': the history loaded capability 'orders' (message 3), which the definition " \
            'no longer has' in text
        assert "It looks renamed to 'orders-v2', which has order_status." in text
        assert "Fix: Keep an alias: `DurableAgent(..., aliases={'orders-v2': 'orders'})`" in text
        assert 'DC019' not in text  # `orders-v2` still has `order_status`
    elif kind == 'dropped':
        assert f"error DC018 conversation '{cid}': the history loaded capability 'orders' (message 3)" in text
        assert 'it looks removed' in text
        assert "give a capability the id 'orders' back" in text and 'or start a new conversation' in text
        assert f"error DC019 conversation '{cid}': the history called tool 'order_status' (message 4, revealed by " \
            "capability 'orders', which the definition no longer has)" in text
    elif kind == 'tool-gone':
        assert 'DC018' not in text  # `orders` is still there
        assert f"error DC019 conversation '{cid}': the history called tool 'order_status' (message 4), which no capability " \
            'or agent tool of the definition defines' in text
        assert "Fix: Keep a tool named 'order_status'" in text


def test_a_dbos_workflow_failed_on_drift_reads_back_as_the_drift_error(worlds, tmp_path: Path) -> None:
    world = worlds('sqlite')
    cid = 'd-renamed-dbos'
    assert 'DC018' in error_text(world.step(cid, 2))  # it failed in its own process with the drift error
    # The workflow id the phase-2 plan gave this step (a failed run reports none).
    phase2_plan = json.loads((world.root / 'phase2' / 'dbos' / 'plan.json').read_text())
    workflow_id = next(s['workflow_id'] for s in phase2_plan if s['conversation_id'] == cid)
    extra, env = world.engine_args('dbos')
    driver = start_driver('dbos', [_step(cid, THANKS, 'renamed', 'error')], tmp_path / 'retrieve', env, *extra,
                          '--recover', workflow_id)
    report = driver.report(time.monotonic() + DRIVER_TIMEOUT)
    step = report['steps'][0]
    assert not step['ok']
    assert step['error']['type'] == 'DurableConfigError', step['error']['chain']
    assert 'DC018' in error_text(step)


# ---- 3. a retried unit never appends twice --------------------------------------------------------


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('engine', DURABLE)
def test_an_append_unit_retried_after_its_commit_stores_once(worlds, backend: str, engine: str) -> None:
    """Both runs' append units failed right after the store committed (an injected error): the engine ran
    each again (Temporal activity retry, DBOS step retry, the Prefect flow's own retry of its append) with the same
    append id, which
    returned the first attempt's revision and wrote nothing."""
    world = worlds(backend)
    cid = f'retry-{engine}'
    run1, run2 = ok(world.step(cid, 1)), ok(world.step(cid, 2))
    assert run1['output'] == run2['output'] == ORDER_ANSWER
    calls_seen = [a for a in world.appends if a['conversation_id'] == cid]
    conversation, writes = stored(world.store_url, cid)
    assert [w.revision for w in writes] == [1, 2]
    assert [(a['append_id'], a['revision']) for a in calls_seen] == [
        (writes[0].append_id, 1), (writes[0].append_id, 1), (writes[1].append_id, 2), (writes[1].append_id, 2),
    ]
    assert [a['expected_revision'] for a in calls_seen] == [None, None, 1, 1]
    assert conversation.revision == 2
    assert as_json(conversation.messages) == run1['new_messages'] + run2['new_messages']
    assert user_prompts(as_json(conversation.messages)) == [FIRST, FOLLOW_UP]


@pytest.mark.parametrize('backend', BACKENDS)
@pytest.mark.parametrize('engine', ['dbos', 'prefect'])
def test_killed_after_the_append_committed_recovers_without_a_second_write(
    worlds, backend: str, engine: str, tmp_path: Path
) -> None:
    """SIGKILL inside the append unit, after the store committed but before the engine recorded the unit as done.

    Another process takes the run over: DBOS recovers the workflow at launch; the Prefect flow run is set back
    to Scheduled and run again. Every earlier unit comes back from its checkpoint / cache (no model request
    runs again), the append unit runs again with the same append id, and the store holds the run's messages
    once. (Temporal is covered by the retried-activity test: a killed worker's store activity is only retried
    after its 60 s start-to-close timeout.)
    """
    world = worlds(backend)
    cid = f'kill-{engine}-{uuid.uuid4().hex[:6]}'
    extra, env = world.engine_args(engine)
    if engine == 'prefect':  # both processes share Prefect's result storage: the cache lives there
        env = {**env, 'PREFECT_HOME': str(tmp_path / 'prefect-home'), 'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'results')}
    run_id = f'resume-kill-{uuid.uuid4().hex[:8]}'
    plan = [_step(cid, FIRST, fault='kill', **({'workflow_id': run_id} if engine == 'dbos' else {}))]
    out = tmp_path / 'kill'
    first = start_driver(engine, plan, out, env, *extra)
    try:
        first.popen.wait(timeout=DRIVER_TIMEOUT)
    finally:
        first.kill()
    assert first.popen.returncode == -signal.SIGKILL, first.log.read_text()[-4000:]
    if engine == 'prefect':
        run_id = (out / 'flow-run-id').read_text()
    append_id = f'{engine}:{run_id}'
    [committed] = read_appends(out)
    assert (committed['append_id'], committed['revision']) == (append_id, 1)
    assert stored(world.store_url, cid)[0].revision == 1

    second = start_driver(engine, plan, out, env, *extra, '--recover', run_id)
    report = second.report(time.monotonic() + DRIVER_TIMEOUT)
    recovered = ok(report['steps'][0])
    assert recovered['output'] == ORDER_ANSWER
    assert recovered['requests'] == []  # every model request came back from its checkpoint / the cache
    if engine == 'prefect':
        states = [unit.rsplit(' ', 1)[1] for unit in recovered['units']]
        # 3 model requests and the tool call; the load is the flow run's recorded one (no task), the append replayed
        # by its append id (no task).
        assert states.count('Cached') == 4, recovered['units']
        assert not [u for u in recovered['units'] if 'Conversation' in u], recovered['units']
    appends = read_appends(out)
    assert [(a['append_id'], a['revision']) for a in appends] == [(append_id, 1)] * 2
    assert appends[0]['pid'] != appends[1]['pid']
    conversation, writes = stored(world.store_url, cid)
    assert conversation.revision == 1 and [w.append_id for w in writes] == [append_id]
    assert user_prompts(as_json(conversation.messages)) == [FIRST]
    assert len(conversation.messages) == len(recovered['new_messages']) == 6
    assert [m['kind'] for m in as_json(conversation.messages)] == [m['kind'] for m in recovered['new_messages']]
