"""`durcap history evals` (`durable_capabilities.evals`) without a model: how stored conversations split into turns
(a turn stored in two writes, a fork's kept prefix), and what the command refuses (exit 2, one line, nothing
written): no pydantic-evals (DC070), a file of another type (DC040), an unknown conversation. Real SQLite stores;
the command in this process (typer's runner). The dataset end to end, with pydantic-evals and a provider model on
the wire server: tests/engines/test_evals.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, ToolCallPart, ToolReturnPart, UserPromptPart

from durable_capabilities.budget import RAISE_TOOL
from durable_capabilities.evals import EVALS_INSTALL, EvalsNotInstalledError, outcome_of, recorded_turns
from durable_capabilities.forks import fork_at_turn
from durable_capabilities.store import SQLConversationStore
from tests._helpers import durcap_here


def turn(n: int) -> list[Any]:
    return [ModelRequest(parts=[UserPromptPart(f'question {n}')]),
            ModelResponse(parts=[ToolCallPart('lookup', {'q': n}, tool_call_id=f'c{n}')], model_name='m'),
            ModelRequest(parts=[ToolReturnPart('lookup', f'found {n}', tool_call_id=f'c{n}')]),
            ModelResponse(parts=[TextPart(f'answer {n}')], model_name='m')]


async def three_turns(store: SQLConversationStore, conversation_id: str) -> None:
    """Turns 1 and 3 in one write each; turn 2 in two (its tool call, then the rest: as Temporal stores a turn that
    continued as new)."""
    first, second, third = turn(1), turn(2), turn(3)
    revision = (await store.append(conversation_id, first, expected_revision=None)).revision
    revision = (await store.append(conversation_id, second[:2], expected_revision=revision)).revision
    revision = (await store.append(conversation_id, second[2:], expected_revision=revision)).revision
    await store.append(conversation_id, third, expected_revision=revision)


def test_turns_split_at_user_prompts_and_a_fork_keeps_its_prefix_turns(tmp_path: Path) -> None:
    """A turn stored in two writes is one case; each case's history is every message before it; a fork at turn 2
    yields the two kept turns, then its own."""

    async def go() -> None:
        with SQLConversationStore(f'sqlite:///{tmp_path / "s.db"}') as store:
            await three_turns(store, 'c')
            turns = await recorded_turns(store, 'c')
            assert [(t.number, t.inputs.prompt, len(t.inputs.message_history)) for t in turns] == [
                (1, 'question 1', 0), (2, 'question 2', 4), (3, 'question 3', 8)]
            assert turns[1].expected.model_dump() == {
                'output': 'answer 2', 'tool_calls': [{'tool_name': 'lookup', 'args': {'q': 2}}]}
            assert turns[1].inputs.messages() == (await store.read('c')).messages[:4]
            assert turns[2].metadata() == {'conversation_id': 'c', 'turn': 3, 'model_name': 'm',
                                           'usage': {'input_tokens': 0, 'output_tokens': 0, 'requests': 2}}
            await fork_at_turn(store, 'c', 3, 'f')  # the write log counts 4 writes: turn 2's two and the others
            await store.append('f', turn(9), expected_revision=(await store.read('f')).revision)
            forked = await recorded_turns(store, 'f')
            assert [t.inputs.prompt for t in forked] == ['question 1', 'question 2', 'question 9']
            assert [t.name for t in forked] == ['f#turn-1', 'f#turn-2', 'f#turn-3']

    asyncio.run(go())


def test_outcome_leaves_out_the_budget_raise_calls() -> None:
    """The budget's `durcap_raise_budget` calls (the model never made them) are not expected tool calls, and a
    response holding only one is not the answer."""
    messages = [*turn(1)[:2], ModelRequest(parts=[ToolReturnPart('lookup', 'x', tool_call_id='c1')]),
                ModelResponse(parts=[TextPart('answer')]),
                ModelResponse(parts=[ToolCallPart(RAISE_TOOL, {'by': 1}, tool_call_id='r')])]
    outcome = outcome_of(messages)
    assert outcome.output == 'answer' and [c.tool_name for c in outcome.tool_calls] == ['lookup']
    structured = outcome_of([ModelResponse(parts=[ToolCallPart('final_result', {'ok': True})])])
    assert structured.output == {'ok': True}


def test_history_evals_without_pydantic_evals_exits_2_with_dc070(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic-evals hidden from the import system: exit 2, one line naming DC070 and the install command, no
    file written, no traceback."""
    url = f'sqlite:///{tmp_path / "s.db"}'

    async def seed() -> None:
        with SQLConversationStore(url) as store:
            await three_turns(store, 'c')

    asyncio.run(seed())
    monkeypatch.setitem(sys.modules, 'pydantic_evals', None)  # `import pydantic_evals` raises ImportError
    out = tmp_path / 'evals.yaml'
    result = durcap_here('history', 'evals', 'c', '--out', str(out), '--store', url)
    assert result.exit_code == 2, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith('durcap: error: DC070 writing an evals dataset needs pydantic-evals') and EVALS_INSTALL in line
    assert not out.exists() and 'Traceback' not in result.stderr
    assert issubclass(EvalsNotInstalledError, ImportError) and EvalsNotInstalledError.code == 'DC070'


@pytest.mark.parametrize(('args', 'fragment'), [
    (['c', '--out', 'evals.txt'], "DC040 --out: 'evals.txt' is neither .yaml, .yml nor .json"),
    (['nosuch', '--out', 'evals.yaml'], "'nosuch'"),
])
def test_history_evals_refuses_bad_input(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str],
                                         fragment: str) -> None:
    """A file of another type, an unknown conversation: exit 2, one line, nothing written (checked before
    pydantic-evals is imported, so these say what is wrong whether it is installed or not)."""
    url = f'sqlite:///{tmp_path / "s.db"}'

    async def seed() -> None:
        with SQLConversationStore(url) as store:
            await three_turns(store, 'c')

    asyncio.run(seed())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, 'pydantic_evals', None)
    result = durcap_here('history', 'evals', *args, '--store', url)
    assert result.exit_code == 2, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert fragment in line and 'DC070' not in line, line
    assert not (tmp_path / args[2]).exists()


@pytest.mark.parametrize('where', ['a-file/evals.yaml', 'a-folder.yaml'])
def test_history_evals_unwritable_out_exits_2_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          where: str) -> None:
    """--out under a regular file, or naming a folder: exit 2 with one DC040 line naming --out, no traceback (was a
    FileExistsError / IsADirectoryError traceback, exit 1). pydantic-evals installed (the write is what fails)."""
    pytest.importorskip('pydantic_evals')  # .ci/run installs it; DC070 covers its absence
    url = f'sqlite:///{tmp_path / "s.db"}'

    async def seed() -> None:
        with SQLConversationStore(url) as store:
            await three_turns(store, 'c')

    asyncio.run(seed())
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'a-file').write_text('not a folder')
    (tmp_path / 'a-folder.yaml').mkdir()
    result = durcap_here('history', 'evals', 'c', '--out', where, '--store', url)
    assert result.exit_code == 2, result.stdout + result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith('durcap: error: DC040 --out: '), line
    assert ('cannot write' in line) if where.startswith('a-file/') else ('is a folder' in line), line
    assert 'Traceback' not in result.stderr
    assert not (tmp_path / 'a-folder_schema.json').exists()
