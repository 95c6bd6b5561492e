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
            assert await turn_ends(store, 'forked') == [4, 6]  # the kept prefix, then its own turn

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
