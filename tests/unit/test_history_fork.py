"""`durcap history fork ID --at-turn N --to NEW_ID` (`forks.fork_at_turn`, issue 28 item 4) on real SQLite files and
real PostgreSQL databases (the `store_url` fixture), and end to end through `durcap` subprocesses: a conversation of
turns stored by `durcap run --conversation` (local engine), forked, and continued on DBOS (SQLite). Model: the ledger
agent's scripted `FunctionModel`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart

from durable_capabilities.forks import ForkError, fork_at_turn, turn_ends
from durable_capabilities.store import ConversationNotFoundError, SQLConversationStore
from tests._helpers import durcap
from tests.unit.test_history_delete import everything


def turn(n: int) -> list[Any]:
    return [ModelRequest(parts=[UserPromptPart(f'question {n}')]), ModelResponse(parts=[TextPart(f'answer {n}')])]


async def five_turns(store: SQLConversationStore, conversation_id: str) -> None:
    for n in range(1, 6):
        revision = (await store.read(conversation_id)).revision if n > 1 else None
        await store.append(conversation_id, turn(n), expected_revision=revision)


def test_fork_at_turn_2_of_5_shares_the_first_two_turns_and_changes_nothing_else(store_url: str) -> None:
    """The fork's history is the first 2 turns (4 messages); the source's rows are as they were; the fork wrote one
    conversation row and one write-log row, and no message row (the entries are shared). Its next turn appends
    after them and the source stays at 5 turns."""

    async def go() -> None:
        with SQLConversationStore(store_url) as store:
            await five_turns(store, 'source')
            assert await turn_ends(store, 'source') == [2, 4, 6, 8, 10]
            before = everything(store_url)
            done = await fork_at_turn(store, 'source', 2, 'forked')
            assert (done.turns, done.source_turns, done.messages) == (2, 5, 4)
            after = everything(store_url)
            assert after['durcap_entries'] == before['durcap_entries'], 'the fork copied messages'
            assert len(after['durcap_conversations']) == len(before['durcap_conversations']) + 1
            assert [r for r in before['durcap_conversations'] if r[0] == 'source'] == \
                   [r for r in after['durcap_conversations'] if r[0] == 'source'], 'the source changed'
            forked = await store.read('forked')
            assert [m.parts[0].content for m in forked.messages] == ['question 1', 'answer 1', 'question 2', 'answer 2']
            await store.append('forked', turn(9), expected_revision=(await store.read('forked')).revision)
            assert [m.parts[0].content for m in (await store.read('forked')).messages][-2:] == ['question 9', 'answer 9']
            assert len((await store.read('source')).messages) == 10
            assert await turn_ends(store, 'forked') == [2, 4, 6]  # the kept prefix's two turns, then its own

    asyncio.run(go())


@pytest.mark.parametrize(('turns', 'new_id', 'fragment'), [
    (0, 'f', '--at-turn 0: conversation \'source\' has 5 turn(s): give 1 to 5'),
    (6, 'f', '--at-turn 6'),
    (-1, 'f', '--at-turn -1'),
    (2, 'source', 'is the conversation being forked'),
    (2, 'other', "a conversation with that id is already stored"),
    (2, ' ', 'the new conversation id is empty'),
])
def test_a_bad_fork_is_refused_and_writes_nothing(store_url: str, turns: int, new_id: str, fragment: str) -> None:
    async def go() -> None:
        with SQLConversationStore(store_url) as store:
            await five_turns(store, 'source')
            await store.append('other', turn(1), expected_revision=None)
            before = everything(store_url)
            with pytest.raises(ForkError, match=fragment.replace('(', r'\(').replace(')', r'\)')) as raised:
                await fork_at_turn(store, 'source', turns, new_id)
            assert raised.value.code == 'fork'
            assert everything(store_url) == before
            with pytest.raises(ConversationNotFoundError):
                await fork_at_turn(store, 'nosuch', 1, 'f2')

    asyncio.run(go())


LEDGER = 'tests/engines/ledger_agent.py:agent'


def test_history_fork_from_the_cli_continues_on_another_engine(tmp_path: Path) -> None:
    """Two turns by `durcap run --engine local --conversation c` (real subprocesses), `durcap history fork c
    --at-turn 1 --to c2`, then a turn on DBOS (SQLite) continues c2: its history is c's first turn plus the new one,
    the capability the first turn loaded is loaded again without a `load_capability` call, and c is unchanged.
    A bad fork from the CLI: exit 2, one line, no traceback (the other cases: the table test above)."""
    url = f'sqlite:///{tmp_path / "conversations.db"}'
    env = {'DURCAP_LEDGER_DIR': str(tmp_path / 'ledger'), 'DURCAP_LEDGER_CHARGE_SECONDS': '0', 'DURCAP_STORE': url}
    for n in range(1, 3):
        result = durcap('run', LEDGER, f'charge order F-{n}', '--conversation', 'c', env=env, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr

    async def read(conversation_id: str) -> list[str]:
        with SQLConversationStore(url, create=False) as store:
            return list((await store.read_json(conversation_id)).messages)

    source = asyncio.run(read('c'))
    forked = durcap('history', 'fork', 'c', '--at-turn', '1', '--to', 'c2', env=env)
    assert forked.returncode == 0, forked.stdout + forked.stderr
    assert "forked 'c' at turn 1 of 2 into 'c2'" in forked.stdout and 'capabilities loaded: billing' in forked.stdout
    kept = int(forked.stdout.split("into 'c2': ")[1].split(' messages')[0])
    assert 0 < kept < len(source)
    result = durcap('run', LEDGER, 'charge order F-9', '--conversation', 'c2', '--engine', 'dbos', '--db',
                    f'sqlite:///{tmp_path / "dbos.sqlite"}', env=env, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    continued = asyncio.run(read('c2'))
    assert asyncio.run(read('c')) == source, 'the source conversation changed'
    assert continued[:kept] == source[:kept] and len(continued) > kept
    assert 'F-9' in ''.join(continued[kept:]) and 'F-2' not in ''.join(continued)
    assert '"load_capability"' not in ''.join(continued[kept:]), 'the fork lost its loaded capability'
    bad = durcap('history', 'fork', 'c', '--at-turn', '3', '--to', 'c3', env=env)
    assert bad.returncode == 2 and 'has 2 turn(s): give 1 to 2' in bad.stderr and 'Traceback' not in bad.stderr


def test_runs_fork_reruns_a_dbos_runs_turn_on_a_fork_before_it_on_the_local_engine(tmp_path: Path) -> None:
    """Turns 1-2 of conversation c by `durcap run` (local), turn 3 by `durcap run --engine dbos` (SQLite); `durcap runs
    fork <that DBOS run> --on local --to c2` forks c before turn 3 and runs turn 3's prompt again on c2: c2 holds
    c's first 2 turns plus the new one, c is unchanged. Model: tests/engines/budget_agent.py's scripted
    `FunctionModel` (its budget far from spent). A run still unknown: exit 2, one line."""
    url = f'sqlite:///{tmp_path / "conversations.db"}'
    db = f'sqlite:///{tmp_path / "dbos.sqlite"}'
    env = {'DURCAP_STORE': url, 'DURCAP_BUDGET_LIMIT': '100000', 'DURCAP_BUDGET_AGENT': 'fork_runs'}
    target = 'tests.engines.budget_agent:agent'
    for n in (1, 2):
        result = durcap('run', target, f'question {n}', '--conversation', 'c', '--deps-json', '{}', env=env, timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
    third = durcap('run', target, 'question 3', '--conversation', 'c', '--deps-json', '{}', '--engine', 'dbos', '--db', db,
                   env=env, timeout=180)
    assert third.returncode == 0, third.stdout + third.stderr
    run_id = third.stderr.split('dbos workflow id: ', 1)[1].split()[0]

    async def read(conversation_id: str) -> list[str]:
        with SQLConversationStore(url, create=False) as store:
            return list((await store.read_json(conversation_id)).messages)

    source = asyncio.run(read('c'))
    forked = durcap('runs', 'fork', run_id, '--target', target, '--engine', 'dbos', '--db', db, '--on', 'local', '--to',
                    'c2', '--deps-json', '{}', env=env, timeout=180)
    assert forked.returncode == 0, forked.stdout + forked.stderr
    assert 'forked c at turn 2 of 3 into c2 (4 messages shared)' in forked.stderr
    assert 'answer to question 3' in forked.stdout
    continued = asyncio.run(read('c2'))
    assert asyncio.run(read('c')) == source, 'the source conversation changed'
    assert continued[:4] == source[:4] and len(continued) == 6
    assert 'question 3' in ''.join(continued[4:])
    unknown = durcap('runs', 'fork', 'no-such-run', '--target', target, '--engine', 'dbos', '--db', db, env=env)
    assert unknown.returncode == 2 and 'Traceback' not in unknown.stderr, unknown.stderr


# ---- a fork carries the spend of the turns it keeps (its conversation budget) ---------------------------------------


def raise_turn(n: int, call_id: str, by: int, outcome: str) -> list[Any]:
    """A turn whose model request was answered by a `durcap_raise_budget` call (a spent `on_exceed='approval'` budget),
    decided `outcome` ('success': approved; 'denied'), then the answer."""
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart

    from durable_capabilities.budget import RAISE_TOOL

    args = {'budget': 'total_tokens', 'key': 'conversation:s', 'by': by, 'spent': 100, 'limit': 100}
    return [ModelRequest(parts=[UserPromptPart(f'question {n}')]),
            ModelResponse(parts=[ToolCallPart(RAISE_TOOL, args, tool_call_id=call_id)]),
            ModelRequest(parts=[ToolReturnPart(RAISE_TOOL, 'raised' if outcome == 'success' else 'no',
                                               tool_call_id=call_id, outcome=outcome)]),  # type: ignore[arg-type]
            ModelResponse(parts=[TextPart(f'answer {n}')])]


def test_a_fork_inherits_the_spend_and_raises_of_the_turns_it_keeps(store_url: str) -> None:
    """Turn 1 (one request, 100 tokens), a run that failed after one request (billed, nothing stored), turn 2 (one
    request; an approved raise of 50 and a denied one of 70), turn 3 (one request): a fork at turn 2 starts its key
    `conversation:f` with the 300 tokens / 3 requests reserved up to turn 2's write and the approved raise only; a fork
    at turn 1 with 100 tokens; upstream's `store.fork(at=...)` (the Python API) the same; the source's ledger is
    unchanged. A fork of the fork at its kept prefix (its turn 2, as in s) inherits the prefix's 300, at its turn 1 100, at its own next turn 300 + that
    turn's; a conversation that spent nothing gives its fork no ledger row."""

    async def spend(store: SQLConversationStore, key: str, request: str, tokens: tuple[int, int] = (60, 40)) -> None:
        assert await store.budget_reserve(key, request, request.split('#')[0], {'total_tokens': 10_000}) is None
        await store.budget_settle(key, request, request.split('#')[0], input_tokens=tokens[0], output_tokens=tokens[1])

    async def go() -> None:
        with SQLConversationStore(store_url) as store:
            await spend(store, 'conversation:s', 'run1#1')
            revision = (await store.append('s', turn(1), expected_revision=None)).revision
            await spend(store, 'conversation:s', 'failed#3')  # a run that failed: billed, not stored
            await spend(store, 'conversation:s', 'run2#3')
            second = [*raise_turn(2, 'r-yes', 50, 'success')[:3], *raise_turn(2, 'r-no', 70, 'denied')[1:]]
            revision = (await store.append('s', second, expected_revision=revision)).revision
            await spend(store, 'conversation:s', 'run3#9')
            await store.append('s', turn(3), expected_revision=revision)
            source = [r.to_json() for r in await store.budgets('conversation:s')]

            done = await fork_at_turn(store, 's', 2, 'f')
            assert done.budget is not None
            assert done.budget['spent'] == {'input_tokens': 180, 'output_tokens': 120, 'total_tokens': 300, 'cost': 0.0,
                                            'requests': 3}
            assert done.budget['raised'] == {'total_tokens': 50} and done.budget['limits'] == {'total_tokens': 10_000}
            assert (await fork_at_turn(store, 's', 1, 'f1')).budget['spent']['total_tokens'] == 100  # type: ignore[index]
            await store.fork('s', at=1, new_conversation_id='g')  # upstream's API: cut inside turn 1's write
            [g] = await store.budgets('conversation:g')
            assert (g.spent['total_tokens'], g.spent['requests'], g.raised) == (100, 1, {})
            assert [r.to_json() for r in await store.budgets('conversation:s')] == source

            # A fork of the fork: its kept prefix (turns 1-2 of f, s's) is what f inherited; its own turn adds to it.
            assert (await fork_at_turn(store, 'f', 1, 'f-1')).budget['spent']['total_tokens'] == 100  # type: ignore[index]
            prefix = (await fork_at_turn(store, 'f', 2, 'ff')).budget
            assert prefix is not None and (prefix['spent']['total_tokens'], prefix['spent']['requests']) == (300, 3)
            assert prefix['raised'] == {'total_tokens': 50}
            await spend(store, 'conversation:f', 'run4#13', (10, 5))
            await store.append('f', turn(4), expected_revision=(await store.read('f')).revision)
            whole = (await fork_at_turn(store, 'f', 3, 'fw')).budget
            assert whole is not None and (whole['spent']['total_tokens'], whole['spent']['requests']) == (315, 4)
            # Inside f's prefix (message 2 of its 8: the end of s's turn 1): followed back to s, which wrote it.
            await store.fork('f', at=2, new_conversation_id='fi')
            [inside] = await store.budgets('conversation:fi')
            assert inside.spent['total_tokens'] == 100

            await store.append('quiet', turn(1), expected_revision=None)
            assert (await fork_at_turn(store, 'quiet', 1, 'quiet-2')).budget is None
            assert await store.budgets('conversation:quiet-2') == []

    asyncio.run(go())


def test_forking_does_not_get_around_a_spent_conversation_budget(tmp_path: Path) -> None:
    """Three turns of a conversation under `Budget(total_tokens=250)` (local runs in this process, 100 tokens a turn:
    the third passes the limit, admitted at 200). `durcap history fork c --at-turn 2 --to c2` says what the fork
    carries (200 tokens, 2 requests); c2's next turn is admitted at 200 and its turn after that fails with DC060 at
    300; a fork at turn 3 fails its first turn at once. Model: tests/engines/budget_agent.py's scripted
    `FunctionModel`."""
    from pydantic_ai import ModelResponse as Response
    from pydantic_ai.models.function import FunctionModel
    from pydantic_ai.usage import RequestUsage

    from durable_capabilities import Budget, BudgetExceededError, DurableAgent, runner
    from tests._helpers import durcap_here

    url = f'sqlite:///{tmp_path / "conversations.db"}'
    agent = DurableAgent('fork-budget', FunctionModel(
        lambda messages, info: Response(parts=[TextPart('ok')], usage=RequestUsage(input_tokens=60, output_tokens=40))),
        engines=[], budget=Budget(total_tokens=250))

    async def turn_on(conversation: str) -> Any:
        try:
            return (await runner.run(agent, 'hello', conversation_id=conversation, store=url,
                                     notify=lambda line: None)).budget
        except BudgetExceededError as exc:
            return exc

    for _ in range(3):
        assert isinstance(asyncio.run(turn_on('c')), dict)
    forked = durcap_here('history', 'fork', 'c', '--at-turn', '2', '--to', 'c2', '--store', url)
    assert forked.exit_code == 0, forked.stdout + forked.stderr
    assert "budget conversation:c2 carries the kept turns' spend: 200 tokens, 0 USD, 2 request(s)" in forked.stdout
    assert asyncio.run(turn_on('c2'))['spent']['total_tokens'] == 300
    refused = asyncio.run(turn_on('c2'))
    assert isinstance(refused, BudgetExceededError) and (refused.key, refused.spent, refused.limit) == (
        'conversation:c2', 300, 250)
    assert durcap_here('history', 'fork', 'c', '--at-turn', '3', '--to', 'c3', '--store', url).exit_code == 0
    spent = asyncio.run(turn_on('c3'))
    assert isinstance(spent, BudgetExceededError) and spent.spent == 300, spent


def test_a_fork_of_a_fork_numbers_its_turns_as_its_messages_do(tmp_path: Path) -> None:
    """A fork at turn 2 of 3, continued by two turns, has 4 turns: `--at-turn 3` keeps 3 of them (6 messages), as
    `durcap history evals` numbers them (its cases `f#turn-1..4`), `--at-turn 4` keeps all, 5 is refused (the kept
    prefix was counted as one turn: "turn 2 of 3" kept 3 turns, and the fork's last turn could not be named).
    The prefix is one turn when its source is gone. Real SQLite store, no model."""
    from durable_capabilities.evals import recorded_turns

    async def go() -> None:
        with SQLConversationStore(f'sqlite:///{tmp_path / "s.db"}') as store:
            await five_turns(store, 's')
            await fork_at_turn(store, 's', 2, 'f')
            for n in (8, 9):
                await store.append('f', turn(n), expected_revision=(await store.read('f')).revision)
            assert await turn_ends(store, 'f') == [2, 4, 6, 8]
            assert [t.number for t in await recorded_turns(store, 'f')] == [1, 2, 3, 4]
            kept = await fork_at_turn(store, 'f', 3, 'ff')
            assert (kept.turns, kept.source_turns, kept.messages) == (3, 4, 6)
            assert [m.parts[0].content for m in (await store.read('ff')).messages][-2:] == ['question 8', 'answer 8']
            assert await turn_ends(store, 'ff') == [2, 4, 6]  # a fork of a fork follows the prefix back to s
            assert (await fork_at_turn(store, 'f', 4, 'f4')).messages == 8
            with pytest.raises(ForkError, match='has 4 turn'):
                await fork_at_turn(store, 'f', 5, 'f5')
            await store.delete('s')
            assert await turn_ends(store, 'f') == [4, 6, 8]

    asyncio.run(go())
