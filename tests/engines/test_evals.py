"""Evals from recorded turns (issue 28 item 5): `durcap history evals` writes a pydantic-evals dataset of a stored
conversation's turns, and pydantic-evals evaluates the agent on it.

Model: the real `OpenAIChatModel` against the wire server (`durable_capabilities.wire.WireServer`, uvicorn in a thread
of this process), both when the turns are recorded and when they are evaluated; the agent is the support example
(its `orders` capability is deferred: loaded by the first turn, rebuilt from the history by the cases after it).
Real parts: the conversation store on a SQLite file, `durcap history evals` in a subprocess, pydantic-evals' own
`Dataset.from_file` and `evaluate`. pydantic-evals is not a dependency of the package (its releases pin an older
pydantic-ai-slim): `.ci/run` installs it with `--no-deps`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import yaml

from durable_capabilities.wire import Script, Step, ToolCall, Turn, WireServer
from tests._helpers import durcap

pytestmark = pytest.mark.slow

ORDERS = {'ABC-123': 'UPS, arriving 2026-05-02', 'DEF-456': 'delivered 2026-04-20', 'GHI-789': 'awaiting stock'}
PROMPTS = ['Where is my order ABC-123?', 'And DEF-456?', 'What about GHI-789?',
           *(f'Thanks. Follow-up question {n}.' for n in range(4, 11))]


def script(changed_turn: int | None = None) -> Script:
    """Ten turns: the first loads `orders` and looks ABC-123 up, the next two look an order up (the capability is
    already loaded), the other seven answer with text. `changed_turn`: that turn's answer differs (a changed model)."""
    turns = [Turn(match='ABC-123', steps=(
        Step(tool_calls=(ToolCall('load_capability', {'id': 'orders'}),), usage={'input_tokens': 600, 'output_tokens': 12}),
        Step(tool_calls=(ToolCall('order_status', {'order_id': 'ABC-123'}),), usage={'input_tokens': 700, 'output_tokens': 20}),
        Step(text='ABC-123 ships via UPS.', usage={'input_tokens': 780, 'output_tokens': 9})))]
    for order in ('DEF-456', 'GHI-789'):
        turns.append(Turn(match=order, steps=(
            Step(tool_calls=(ToolCall('order_status', {'order_id': order}),)),
            Step(text=f'{order}: {ORDERS[order]}.'))))
    for n in range(4, 11):
        text = f'Answer {n}, changed.' if n == changed_turn else f'Answer {n}.'
        turns.append(Turn(match=f'question {n}.', steps=(Step(text=text),)))
    return Script(tuple(turns))


def test_ten_recorded_turns_exported_and_evaluated_with_pydantic_evals(tmp_path: Path) -> None:
    """Ten turns of conversation `support-evals` run (local engine) on `OpenAIChatModel` against the wire server and
    are stored; `durcap history evals support-evals --out evals.yaml` writes pydantic-evals' YAML (10 cases: prompt,
    history before it, capabilities loaded; expected answer and tool calls). `Dataset.from_file` reads it back and
    `evaluate` runs every case again (`turn_task`, the same agent on the wire server): 10 of 10 pass `EqualsExpected`.
    Against a changed model (turn 7 answers otherwise) exactly that case fails."""
    pydantic_evals = pytest.importorskip('pydantic_evals', reason='pip install --no-deps pydantic-evals==2.62.0 '
                                                                  '(.ci/run installs it)')
    from durable_capabilities import runner
    from durable_capabilities.evals import TurnInputs, TurnOutcome, turn_task
    from examples.support.agent import Store, make_support
    from tests.engines.wire_agent import provider_model

    store = f'sqlite:///{tmp_path / "conversations.db"}'
    out = tmp_path / 'evals.yaml'

    def deps() -> Store:
        return Store(orders=dict(ORDERS))

    with WireServer(script()) as wire:
        agent = make_support(provider_model('openai-chat', wire.url), name='support_evals')

        async def record() -> list[str]:
            answers = []
            for prompt in PROMPTS:
                report = await runner.run(agent, prompt, deps=deps(), conversation_id='support-evals', store=store,
                                          notify=lambda line: None)
                answers.append(report.output)
            return answers

        answers = asyncio.run(record())
        assert answers[0] == 'ABC-123 ships via UPS.' and answers[-1] == 'Answer 10.'
        recorded = len(wire.log)

        exported = durcap('history', 'evals', 'support-evals', '--out', str(out), '--store', store)
        assert exported.returncode == 0, exported.stdout + exported.stderr
        assert 'wrote 10 case(s)' in exported.stdout and 'support-evals 10' in exported.stdout
        data = yaml.safe_load(out.read_text())
        cases = data['cases']
        assert [c['inputs']['prompt'] for c in cases] == PROMPTS
        assert [len(c['inputs']['message_history']) for c in cases][:3] == [0, 6, 10]
        assert cases[0]['inputs']['capabilities'] == [] and all(c['inputs']['capabilities'] == ['orders'] for c in cases[1:])
        assert cases[0]['expected_output'] == {'output': 'ABC-123 ships via UPS.', 'tool_calls': [
            {'tool_name': 'load_capability', 'args': {'id': 'orders'}},
            {'tool_name': 'order_status', 'args': {'order_id': 'ABC-123'}}]}
        assert cases[1]['expected_output']['tool_calls'] == [{'tool_name': 'order_status', 'args': {'order_id': 'DEF-456'}}]
        assert cases[9]['expected_output'] == {'output': 'Answer 10.', 'tool_calls': []}
        assert cases[0]['metadata']['model_name'] == 'gpt-4o' and cases[0]['metadata']['usage'] == {
            'input_tokens': 2080, 'output_tokens': 41, 'requests': 3}
        assert data['evaluators'] == ['EqualsExpected']

        dataset = pydantic_evals.Dataset[TurnInputs, TurnOutcome, dict].from_file(out)
        assert len(dataset.cases) == 10 and isinstance(dataset.cases[3].inputs, TurnInputs)
        report = dataset.evaluate_sync(turn_task(agent, deps=deps()), progress=False)
        assert _passed(report) == {c.name: True for c in dataset.cases}, report.failures
        assert len(wire.log) - recorded == 14  # every case ran on the wire server: 3 + 2 + 2 + 7 requests

    with WireServer(script(changed_turn=7)) as changed:
        agent = make_support(provider_model('openai-chat', changed.url), name='support_evals')
        report = dataset.evaluate_sync(turn_task(agent, deps=deps()), progress=False)
    passed = _passed(report)
    assert [name for name, ok in passed.items() if not ok] == ['support-evals#turn-7'], passed
    failed = next(c for c in report.cases if c.name == 'support-evals#turn-7')
    assert failed.output.output == 'Answer 7, changed.'


def _passed(report: Any) -> dict[str, bool]:
    """`{case name: whether EqualsExpected held}` of an `EvaluationReport` (a case whose task failed counts False)."""
    return {**{c.name: bool(c.assertions['EqualsExpected'].value) for c in report.cases},
            **{f.name: False for f in report.failures}}
