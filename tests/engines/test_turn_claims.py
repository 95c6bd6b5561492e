"""One conversation, one turn at a time, and never a lost turn (issue 26 item 5), on every engine with real servers
(local, DBOS on SQLite, Temporal and Prefect on the shared servers).

Model: a scripted `FunctionModel` (tests/engines/race_agent.py): `revoke NAME` calls the gated tool
`revoke_sessions` (needs approval), `charge NAME` calls `charge` (no approval; held until the test says go). Every
model request and every tool execution is a line in `$DURCAP_CRASH_DIR/side-effects`: a turn refused before any
side effect has no line, a tool that ran once has one. Runs are real `durcap run` processes; decisions go through
`durcap approve`.

The race as a new user met it: a run on a conversation waits for an approval, another turn arrives on the same
conversation, the approval is given. Before: the approved tool ran, then the first turn's append was refused as a
conflict and neither the turn nor its approval audit was stored.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart

from durable_capabilities.store import SQLConversationStore
from tests._helpers import DURCAP, ROOT, durcap, subprocess_env

TARGET = 'tests.engines.race_agent:racer'
ENGINES = ['local', 'dbos', 'temporal', 'prefect']
RUN_ID_LINE = re.compile(r'(?:dbos workflow id|temporal workflow id|prefect flow run id): (\S+)')


@dataclass
class Run:
    """A `durcap run` process (own process group, output in a file)."""

    popen: subprocess.Popen[bytes]
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors='replace') if self.log.exists() else ''

    def run_id(self, timeout: float = 90) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if found := RUN_ID_LINE.search(self.text()):
                return found.group(1)
            assert self.popen.poll() is None, self.text()
            time.sleep(0.1)
        raise AssertionError(f'no run id within {timeout} s:\n{self.text()}')

    def finish(self, timeout: float = 180) -> tuple[int, str]:
        return self.popen.wait(timeout=timeout), self.text()

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)


@dataclass
class World:
    """One engine's connection flags, environment and processes for a test."""

    engine: str
    tmp: Path
    env: dict[str, str]
    run_flags: list[str]
    decide_flags: list[str]
    runs: list[Run] = field(default_factory=list)

    @property
    def crash_dir(self) -> Path:
        return Path(self.env['DURCAP_CRASH_DIR'])

    @property
    def store(self) -> str:
        return self.env['DURCAP_STORE']

    def start(self, prompt: str, conversation: str, *flags: str, env: dict[str, str] | None = None) -> Run:
        log = self.tmp / f'run-{len(self.runs)}.log'
        with open(log, 'wb') as out:
            popen = subprocess.Popen(
                [*DURCAP, 'run', TARGET, prompt, '--conversation', conversation, *self.run_flags, *flags],
                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env=subprocess_env({**self.env, **(env or {})}),
            )
        run = Run(popen, log)
        self.runs.append(run)
        return run

    def side_effects(self) -> list[str]:
        path = self.crash_dir / 'side-effects'
        return path.read_text().splitlines() if path.exists() else []

    def wait_file(self, name: str, run: Run, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while not (self.crash_dir / name).exists():
            assert run.popen.poll() is None, run.text()
            assert time.monotonic() < deadline, f'no {name} within {timeout} s:\n{run.text()}'
            time.sleep(0.05)

    def pending(self, run_id: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = durcap('approvals', 'list', *self.decide_flags, '--format', 'json', env=self.env)
            assert out.returncode == 0, out.stderr
            calls = [c for c in json.loads(out.stdout) if c['run_id'] == run_id]
            if calls:
                return calls[0]
            time.sleep(0.3)
        raise AssertionError(f'no pending call of {run_id} within {timeout} s')

    def hold_first(self, conversation: str) -> tuple[Run, str]:
        """Start the first turn and return it once it waits: for an approval (durable engines; its run id), or
        inside its held tool (local: no durable wait for approvals; `local`)."""
        if self.engine == 'local':
            first = self.start('charge alice', conversation, env={'DURCAP_RACE_HOLD': '1'})
            self.wait_file('started-alice', first)
            return first, 'local-'  # the local run's id (its claim's holder): only its prefix is known here
        first = self.start('revoke alice', conversation)
        run_id = first.run_id()
        self.pending(run_id)
        return first, run_id

    def release_first(self, run_id: str) -> None:
        """Let the first turn go on: approve its call, or let its held tool return."""
        if self.engine == 'local':
            (self.crash_dir / 'go-alice').write_text('go')
            return
        call = self.pending(run_id)
        approved = durcap('approve', run_id, call['call_id'], '--by', 'ops', *self.decide_flags, env=self.env)
        assert approved.returncode == 0, approved.stdout + approved.stderr

    def first_output(self) -> str:
        return 'result: charged alice' if self.engine == 'local' else 'result: revoked sessions of alice'


@pytest.fixture(params=ENGINES)
def world(request: pytest.FixtureRequest, tmp_path: Path, spawn: Any) -> Any:
    engine = request.param
    env = {'DURCAP_CRASH_DIR': str(tmp_path / 'crash'), 'DURCAP_STORE': f'sqlite:///{tmp_path / "conv.db"}'}
    run_flags = ['--engine', engine]
    decide_flags = ['--engine', engine]
    if engine == 'dbos':
        db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
        run_flags += ['--db', db]
        decide_flags += ['--db', db]
    elif engine == 'temporal':
        address = request.getfixturevalue('temporal_address')
        queue = f'race-{uuid.uuid4().hex[:8]}'
        worker = spawn('temporal', 'worker', '--target', TARGET, '--address', address, '--task-queue', queue, env=env)
        worker.wait_for('WORKER READY', 90)
        run_flags += ['--address', address, '--task-queue', queue]
        decide_flags += ['--address', address]
    elif engine == 'prefect':
        env['PREFECT_API_URL'] = request.getfixturevalue('prefect_api_url')
    built = World(engine, tmp_path, env, run_flags, decide_flags)
    try:
        yield built
    finally:
        for run in built.runs:
            run.kill()


def stored(store: str, conversation: str) -> tuple[list[str], list[Any], int]:
    """The conversation's user prompts in order, its approval audit records, and its revision."""

    async def read() -> Any:
        async with SQLConversationStore(store) as opened:
            return await opened.read(conversation), await opened.turn_claim(conversation)

    conv, claim = asyncio.run(read())
    assert claim is None, f'the claim was not released: {claim}'
    prompts = [p.content for m in conv.messages if isinstance(m, ModelRequest) for p in m.parts
               if isinstance(p, UserPromptPart)]
    audit = [r for m in conv.messages if isinstance(m, ModelRequest) for r in (m.metadata or {}).get('durcap_approvals', [])]
    return prompts, audit, conv.revision


def test_reject_refuses_the_second_turn_before_any_side_effect(world: World) -> None:
    """`--busy reject`: the second turn fails with DC050 naming the run that holds the conversation, and made no model
    request and ran no tool; the first turn is approved, its tool runs once and it is stored with its audit. On the
    durable engines the holder waits for an approval, and the refusal says so: the tool and call it waits on and the
    commands that decide it (before, only that the conversation was busy)."""
    conversation = f'race-2-{uuid.uuid4().hex[:6]}'
    first, first_id = world.hold_first(conversation)
    second = world.start('charge bob', conversation, '--busy', 'reject')
    code, said = second.finish()
    assert code != 0, said
    assert 'DC050' in said and f"is busy: run '{first_id}" in said, said
    if world.engine != 'local':  # the local holder waits inside its tool, not for an approval
        call = world.pending(first_id)
        flat = ' '.join(said.split())
        assert (f"and waits for a person's approval of revoke_sessions (call {call['call_id']})" in flat), flat
        assert f"`durcap approvals list --run {first_id} --engine {world.engine}`" in flat, flat
        assert f"`durcap approve {first_id} {call['call_id']} --engine {world.engine}`" in flat, flat
    else:
        assert "waits for a person's approval" not in said, said
    [line] = [line for line in said.splitlines() if line.startswith('durcap: ')]  # durcap's own report: one line
    assert line.startswith('durcap: error: DC050 ') or 'DC050' in line, line
    if world.engine != 'prefect':  # Prefect's own logger prints the failed task's traceback
        assert 'Traceback' not in said, said
    assert not [line for line in world.side_effects() if line.endswith(':bob')]  # refused before anything ran
    world.release_first(first_id)
    code, said = first.finish()
    assert code == 0 and world.first_output() in said, said
    prompts, audit, _ = stored(world.store, conversation)
    assert prompts == (['charge alice'] if world.engine == 'local' else ['revoke alice'])
    assert world.side_effects().count('tool:alice') == 1
    if world.engine != 'local':
        assert [(r['decision'], r['by']) for r in audit] == [('approved', 'ops')]


def test_enqueue_runs_the_second_turn_after_the_first_is_stored(world: World) -> None:
    """`--busy enqueue`: the second turn waits (no model request) while the first waits for its approval; once the
    first is approved and stored, the second runs on top of it: both turns stored in order, each tool once."""
    conversation = f'race-2-{uuid.uuid4().hex[:6]}'
    first, first_id = world.hold_first(conversation)
    second = world.start('charge bob', conversation, '--busy', 'enqueue')
    if world.engine != 'local':
        second.run_id()  # the engine has the second run: it waits on the conversation
    assert second.popen.poll() is None, second.text()
    assert not [line for line in world.side_effects() if line.endswith(':bob')]
    world.release_first(first_id)
    code, said = first.finish()
    assert code == 0 and world.first_output() in said, said
    code, said = second.finish()
    assert code == 0 and 'result: charged bob' in said, said
    prompts, audit, revision = stored(world.store, conversation)
    assert prompts == [('charge alice' if world.engine == 'local' else 'revoke alice'), 'charge bob']
    assert revision == 2
    effects = world.side_effects()
    assert effects.count('tool:alice') == 1 and effects.count('tool:bob') == 1, effects
    assert effects.index('tool:alice') < effects.index('request:bob'), effects  # bob's turn started after alice's
    if world.engine != 'local':
        assert [(r['decision'], r['by']) for r in audit] == [('approved', 'ops')]


def test_interrupt_stops_the_first_turn_at_its_safe_point_and_runs_the_second_after_it(world: World) -> None:
    """`--busy interrupt`: the second turn asks the first to stop and waits (no model request of its own). On a durable
    engine the first waits for an approval: the second's `durcap run` denies that call through the engine's decision
    path (reason naming the second run), so the gated tool never runs; on local the first is inside its held tool,
    which returns and its result is kept. Either way the first turn's next model request is not sent: it ends with the
    interrupted answer naming the second run and is stored (with its audit), then the second runs on top of it; every
    side effect once, both claims released."""
    conversation = f'race-2-{uuid.uuid4().hex[:6]}'
    first, first_id = world.hold_first(conversation)
    second = world.start('charge bob', conversation, '--busy', 'interrupt')
    if world.engine == 'local':
        deadline = time.monotonic() + 60

        async def stop() -> Any:
            async with SQLConversationStore(world.store) as store:
                return await store.turn_stop(conversation)

        while (claim := asyncio.run(stop())) is None or claim[1] is None:  # the second turn asked the first to stop
            assert second.popen.poll() is None and time.monotonic() < deadline, second.text()
            time.sleep(0.05)
        second_id = claim[1]
        world.release_first(first_id)  # the held tool returns
    else:
        second_id = second.run_id()
    code, said = first.finish()
    assert code == 0, said
    assert f'Interrupted: a newer turn (run {second_id}) took over this conversation' in said, said
    code, said = second.finish()
    assert code == 0 and 'result: charged bob' in said, said
    prompts, audit, revision = stored(world.store, conversation)
    assert prompts == [('charge alice' if world.engine == 'local' else 'revoke alice'), 'charge bob'] and revision == 2
    effects = world.side_effects()
    assert effects.count('request:alice') == 1, effects  # its second model request was never sent
    assert effects.count('tool:bob') == 1 and effects.index('request:bob') > effects.index('request:alice'), effects
    if world.engine == 'local':
        assert effects.count('tool:alice') == 1, effects  # the held tool ran once; its result is stored
    else:
        assert 'tool:alice' not in effects, effects  # denied: the gated tool never ran
        assert [(r['decision'], r['by'], r['reason']) for r in audit] == [
            ('denied', 'durcap (interrupt)', f'interrupted by a newer turn (run {second_id})')]
        assert f'was denied: interrupted by a newer turn (run {second_id})' in said, said


def test_a_turn_stored_meanwhile_by_another_writer_is_kept_and_the_waiting_turn_goes_after_it(world: World) -> None:
    """The original race, with a writer that takes no claim (a direct store append while the first turn waits): the
    approved tool runs once and the first turn is stored after the other write (rebased), its audit with it;
    nothing is lost and nothing conflicts."""
    conversation = f'race-2-{uuid.uuid4().hex[:6]}'
    first, first_id = world.hold_first(conversation)

    async def meanwhile() -> None:
        async with SQLConversationStore(world.store) as store:
            await store.append(conversation, [ModelRequest(parts=[UserPromptPart('meanwhile')]),
                                              ModelResponse(parts=[TextPart('noted')])], expected_revision=None)

    asyncio.run(meanwhile())
    world.release_first(first_id)
    code, said = first.finish()
    assert code == 0 and world.first_output() in said, said
    assert 'ConversationConflictError' not in said, said
    prompts, audit, revision = stored(world.store, conversation)
    assert prompts == ['meanwhile', 'charge alice' if world.engine == 'local' else 'revoke alice']
    assert revision == 2
    assert world.side_effects().count('tool:alice') == 1
    if world.engine != 'local':
        assert [(r['decision'], r['by']) for r in audit] == [('approved', 'ops')]


def test_a_claim_left_by_a_run_that_is_gone_is_taken_over(world: World) -> None:
    """A claim whose run is not running (never existed, or ended without releasing it): a durable engine's load asks
    its server, finds the run gone and takes the conversation; the local engine cannot ask, refuses with DC050, and
    `durcap history release` frees it."""
    conversation = f'gone-{uuid.uuid4().hex[:6]}'

    async def claim() -> None:
        async with SQLConversationStore(world.store) as store:
            await store.claim_turn(conversation, 'gone-run')

    asyncio.run(claim())
    turn = world.start('charge bob', conversation)
    if world.engine == 'local':
        code, said = turn.finish()
        assert code == 2 and 'DC050' in said and "run 'gone-run' holds it" in said, said
        released = durcap('history', 'release', conversation, '--store', world.store, env=world.env)
        assert released.returncode == 0, released.stderr
        assert f'conversation {conversation}: released the turn of run gone-run' in released.stdout, released.stdout
        turn = world.start('charge bob', conversation)
    code, said = turn.finish()
    assert code == 0 and 'result: charged bob' in said, said
    prompts, _, _ = stored(world.store, conversation)
    assert prompts == ['charge bob'] and world.side_effects().count('tool:bob') == 1


def test_claims_and_rebased_appends_on_postgresql(store: SQLConversationStore) -> None:
    """The claim's one-statement insert and the rebased append on PostgreSQL (the `store` fixture of tests/engines):
    eight runs claim one conversation at once and exactly one holds it; a stale append with `rebase` goes after."""

    async def scenario() -> None:
        holders = await asyncio.gather(*(store.claim_turn('pg-c', f'run-{i}') for i in range(8)))
        assert sum(1 for h in holders if h is None) == 1, holders
        [winner] = [f'run-{i}' for i, h in enumerate(holders) if h is None]
        assert {h[0] for h in holders if h is not None} == {winner}
        await store.append('pg-c', [ModelRequest(parts=[UserPromptPart('other')])], expected_revision=None)
        result = await store.append('pg-c', [ModelRequest(parts=[UserPromptPart('mine')])], expected_revision=None,
                                    rebase=True, release_claim=winner)
        assert result.rebased and result.revision == 2
        assert await store.turn_claim('pg-c') is None
        # A stop request (`busy='interrupt'`): on the holder's claim row, read by its run id, gone with the claim.
        assert await store.claim_turn('pg-c', 'run-0') is None
        assert await store.request_stop('pg-c', 'run-0', 'run-1') == 'run-1'
        assert await store.request_stop('pg-c', 'run-0', 'run-2') == 'run-1'
        assert await store.stop_requested('run-0') == 'run-1' and await store.turn_stop('pg-c') == ('run-0', 'run-1')
        assert await store.release_turn('pg-c', 'run-0') and await store.stop_requested('run-0') is None

    asyncio.run(scenario())
