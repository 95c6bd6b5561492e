"""Adding an engine is one adapter and one `register` call: a fake "inline" engine defined in this module
appears in `durcap check`, `durcap lock` and `durcap run --engine` without touching any other module.

The CLI runs in-process (typer's `CliRunner`); the model is a `FunctionModel` that calls one tool, then answers.
"""

from __future__ import annotations

import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from durable_capabilities import engines
from durable_capabilities.agent import DurableAgent
from durable_capabilities.engines import EngineAdapter, RunOptions
from durable_capabilities.report import RunReport
from durable_capabilities.turn import run_turn


class InlineAdapter(EngineAdapter):
    """Runs a turn in-process and calls each run a "batch" of "calls" (no durability: a test double of an engine)."""

    name = 'inline'
    unit, units, container, run_id_label = 'call', 'calls', 'batch', 'batch id'
    lock_sections = {'batches': 'batch', 'calls': 'call'}  # noqa: RUF012 - a class constant

    def __init__(self) -> None:
        self.runs: list[str] = []

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        return {
            'batches': [f'inline.{agent.name}'],
            'calls': sorted(f'inline.{agent.name}.{tool}' for tool in agent.static_tool_names()),
        }

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        turn = await run_turn(agent, agent.build(self.name).run, prompt, deps=options.deps,
                              message_history=options.message_history, conversation_id=options.conversation_id)
        batch = options.run_id or f'batch-{len(self.runs) + 1}'
        self.runs.append(batch)
        calls = [f'inline.{agent.name}.{call.tool_name}' for message in turn.result.new_messages()
                 for call in getattr(message, 'parts', []) if getattr(call, 'part_kind', '') == 'tool-call']
        return RunReport(self.name, batch, turn.result.output, turn.result.new_messages(), turn.result.usage, calls)


AGENT_MODULE = '''
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import FunctionModel

from durable_capabilities import DurableAgent


def respond(messages, info):
    returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if not returns:
        return ModelResponse(parts=[ToolCallPart('order_status', {'order_id': 'ABC-123'})])
    return ModelResponse(parts=[TextPart(f'inline answer: {returns[-1].content}')])


def order_status(order_id: str) -> str:
    """Where an order is."""
    return f'{order_id} shipped'


helper = DurableAgent('helper', FunctionModel(respond), engines=['inline'], tools=[order_status])
'''


@pytest.fixture
def inline() -> Iterator[InlineAdapter]:
    """The inline engine, registered for the test and removed after it."""
    adapter = InlineAdapter()
    engines.register(adapter)
    try:
        yield adapter
    finally:
        del engines.ENGINES[adapter.name]


@pytest.fixture
def target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module defining agent `helper` for the inline engine (a unique module name: each test imports it anew)."""
    path = tmp_path / f'inline_agents_{uuid.uuid4().hex[:8]}.py'
    path.write_text(textwrap.dedent(AGENT_MODULE), encoding='utf-8')
    monkeypatch.chdir(tmp_path)
    return f'{path}:helper'


def durcap(*args: str) -> Any:
    from durable_capabilities.cli import app

    return CliRunner().invoke(app, list(args))


def test_unregistered_engine_is_refused(target: str) -> None:
    result = durcap('check', target, '--engine', 'inline')
    assert result.exit_code == 2, result.output
    assert "'inline' is not one of" in result.output


def test_check_offers_the_registered_engine(inline: InlineAdapter, target: str) -> None:
    result = durcap('check', target, '--engine', 'inline')
    assert result.exit_code == 0, result.output
    assert "'helper': no problems found" in result.output
    assert 'inline' in engines.DURABLE_ENGINES and 'inline' in engines.ALL_ENGINES


def test_lock_writes_the_adapters_names_and_check_sees_them_drift(inline: InlineAdapter, target: str, tmp_path: Path) -> None:
    result = durcap('lock', target, '--output', str(tmp_path / 'durable.lock'))
    assert result.exit_code == 0, result.output
    locked = yaml.safe_load((tmp_path / 'durable.lock').read_text())
    assert locked['agents']['helper']['inline'] == {'batches': ['inline.helper'], 'calls': ['inline.helper.order_status']}

    # The adapter now names its units differently: the lock diff reports it in the engine's words.
    inline.durable_names = lambda agent: {'batches': ['inline.helper'], 'calls': ['inline.helper.v2.order_status']}  # type: ignore[method-assign]
    result = durcap('check', target, '--lock', str(tmp_path / 'durable.lock'))
    assert result.exit_code == 1, result.output
    assert 'DC020' in result.output and "inline: call 'inline.helper.order_status'" in result.output


def test_run_on_the_registered_engine_prints_its_words(inline: InlineAdapter, target: str) -> None:
    result = durcap('run', target, 'Where is ABC-123?', '--engine', 'inline')
    assert result.exit_code == 0, result.output
    assert 'answer (inline): inline answer: ABC-123 shipped' in result.output
    assert 'batch id: batch-1' in result.output
    assert 'durable units recorded (calls, in order):' in result.output
    assert '  inline.helper.order_status' in result.output
    assert inline.runs == ['batch-1']


def test_runner_runs_any_registered_engine(inline: InlineAdapter, target: str) -> None:
    import asyncio
    import importlib.util

    from durable_capabilities import runner

    path = target.rpartition(':')[0]
    spec = importlib.util.spec_from_file_location(f'{Path(path).stem}_direct', path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    agent = module.helper
    report = asyncio.run(runner.run(agent, 'Where is ABC-123?', engine='inline', run_id='batch-x'))
    assert (report.engine, report.run_id, report.output) == ('inline', 'batch-x', 'inline answer: ABC-123 shipped')
    assert report.durable_units == ['inline.helper.order_status']


def test_runner_points_a_per_run_stream_handler_to_engine_options(inline: InlineAdapter, target: str) -> None:
    """A per-run `event_stream_handler` would be an engine setting no engine reads (silently ignored): refused."""
    import asyncio

    from durable_capabilities import runner

    async def handler(ctx: Any, events: Any) -> None:
        async for _ in events:
            pass

    with pytest.raises(TypeError, match=r"engine_options=\{'inline': \{'event_stream_handler': handler\}\}"):
        asyncio.run(runner.run(object(), 'hi', engine='inline', event_stream_handler=handler))  # type: ignore[arg-type]
    assert inline.runs == []
