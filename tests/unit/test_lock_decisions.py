"""`durcap lock --measure`'s decisions (`lockfile.decide_local_tools`), kept by a plain `durcap lock`
(`carry_lock_decisions`) and applied to the definitions (`apply_lock_decisions`). No server: the timings are given as
`engines.temporal._measure.ToolTiming` values (what the measurement builds from recorded histories; the real
measurement is tests/engines/test_local_tools.py). The agent's model is pydantic-ai's `TestModel` (never called)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.capabilities import MCP, Capability
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.models.test import TestModel

from durable_capabilities import DurableAgent
from durable_capabilities.engines.temporal import LOCAL_TOOLSETS_OPTION
from durable_capabilities.engines.temporal._measure import ToolTiming
from durable_capabilities.lockfile import (
    LOCAL_SECTION,
    MEASURED_SECTION,
    apply_lock_decisions,
    carry_lock_decisions,
    decide_local_tools,
    lock_data,
    read_lock,
)


def _agent(**engine_options: object) -> DurableAgent:
    def tool(name: str):
        def call() -> str:
            return name

        call.__name__ = f'{name}_tool'
        return call

    caps: list[Any] = [Capability(id=leaf, description=f'{leaf} tools.', tools=[tool(leaf)], defer_loading=True)
            for leaf in ('fast', 'slow', 'flaky', 'rare', 'kept')]
    caps.append(MCP(local=MCPToolset('http://127.0.0.1:8931/mcp'), id='kb', description='KB.', defer_loading=True))
    return DurableAgent('decide', TestModel(), capabilities=caps,
                        engine_options={'temporal': engine_options} if engine_options else None)


def test_decide_local_tools_per_leaf() -> None:
    """Fast and clean: local. Slowest call over the threshold, or any retried/failed call: not local. Too few timed
    calls (including calls already run as local activities, which are not timed): the previous decision. MCP: never."""
    agent = _agent()
    timings = {
        'fast': ToolTiming('fast', [0.01] * 9 + [0.2], runs=3),
        'slow': ToolTiming('slow', [0.01] * 9 + [1.5], runs=3),
        'flaky': ToolTiming('flaky', [0.01] * 10, retried=1, runs=3),
        'rare': ToolTiming('rare', [0.01] * 2, runs=1),
        'kept': ToolTiming('kept', [], local_calls=12, runs=3),
        'kb': ToolTiming('kb', [0.01] * 10, runs=3),
    }
    local, notes = decide_local_tools(agent, timings, previous=['kept', 'slow'], threshold=1.0, min_calls=5)
    assert local == ['fast', 'kept']
    by_leaf = {note.split(':', 1)[0]: note for note in notes}
    assert set(by_leaf) == {'fast', 'slow', 'flaky', 'rare', 'kept', 'kb'}
    assert by_leaf['fast'] == 'fast: local (10 calls in 3 run(s), median 10 ms, slowest 200 ms, threshold 1000 ms)'
    assert by_leaf['slow'].startswith('slow: not local (10 calls') and 'slowest 1500 ms' in by_leaf['slow']
    assert by_leaf['flaky'].startswith('flaky: not local (1 retried and 0 failed of 10 calls')
    assert by_leaf['rare'] == 'rare: not local (kept: 2 timed call(s), fewer than 5 to decide)'
    assert by_leaf['kept'] == 'kept: local (kept: 0 timed call(s), 12 as local activities (not timed), fewer than 5 to decide)'
    assert by_leaf['kb'].startswith('kb: not local (an MCP leaf')


def test_plain_lock_keeps_the_decisions_and_the_definitions_get_them() -> None:
    """`carry_lock_decisions` keeps the old lock's local leaves that still exist (a removed leaf is dropped);
    `apply_lock_decisions` marks them on the agent, and a hand-marked leaf keeps its own options. The lock key is the
    Temporal engine option's name."""
    assert LOCAL_SECTION == LOCAL_TOOLSETS_OPTION
    agent = _agent(**{LOCAL_TOOLSETS_OPTION: {'fast': {'start_to_close_timeout': 3}}})
    old = {'agents': {'decide': {'temporal': {LOCAL_SECTION: ['fast', 'gone', 'rare'],
                                              MEASURED_SECTION: ['fast: local (...)', 'gone: local (...)']}}}}
    data = carry_lock_decisions(lock_data([agent], engines=('temporal',)), old)
    entry = data['agents']['decide']['temporal']
    assert entry[LOCAL_SECTION] == ['fast', 'rare'] and entry[MEASURED_SECTION] == ['fast: local (...)']
    apply_lock_decisions([agent], data)
    assert agent.engine_options['temporal'][LOCAL_TOOLSETS_OPTION] == {'fast': {'start_to_close_timeout': 3}, 'rare': {}}


@pytest.mark.parametrize('decided', [[], ['nope']])
def test_nothing_decided_changes_nothing(decided: list[str]) -> None:
    agent = _agent()
    apply_lock_decisions([agent], {'agents': {'decide': {'temporal': {LOCAL_SECTION: decided}}}})
    assert LOCAL_TOOLSETS_OPTION not in agent.engine_options.get('temporal', {})


_TWO = '''
from pydantic_ai.models.test import TestModel
from durable_capabilities import DurableAgent

{first} = DurableAgent({first!r}, TestModel(), engines=())
two = DurableAgent('two', TestModel(), engines=())
'''


def test_a_module_locked_whole_checks_each_of_its_agents_and_a_rename_is_still_refused(tmp_path: Path) -> None:
    """`durable.lock` is one per module folder: `durcap lock mod.py:one` writes every agent the module defines, and
    `durcap check mod.py:two` against it passes (it failed DC021 for `one`, which the module still defines). An agent
    renamed in the module is in neither the target nor the module: still DC021. The real CLI in a subprocess."""
    from tests._helpers import durcap

    module = tmp_path / 'two_agents.py'
    module.write_text(_TWO.format(first='one'), encoding='utf-8')
    wrote = durcap('lock', f'{module}:one', cwd=tmp_path)
    assert wrote.returncode == 0 and '(one, two)' in wrote.stderr, wrote.stderr
    assert set(read_lock(tmp_path / 'durable.lock')['agents']) == {'one', 'two'}
    checked = durcap('check', f'{module}:two', cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # `one` renamed without previous_names (a name of another length: a rewrite of the same size within the same
    # second would let Python reuse the module's cached bytecode)
    module.write_text(_TWO.format(first='first_renamed'), encoding='utf-8')
    refused = durcap('check', f'{module}:two', cwd=tmp_path)
    assert refused.returncode == 1 and 'DC021' in refused.stdout and "'one'" in refused.stdout, refused.stdout
