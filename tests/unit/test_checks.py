"""The check registry (issue 9, item 5): one function per code, wording in `CODES`, one toolset walk per capability.

No model runs here: definitions are only constructed and inspected.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic_ai.capabilities import AbstractCapability, Capability
from pydantic_ai.toolsets import CombinedToolset, ExternalToolset, FunctionToolset

from durable_capabilities import CODES, DurableAgent, DurableConfigError
from durable_capabilities.checks import CHECKS
from durable_capabilities.validation import problem


def lookup(order_id: str) -> str:
    """Look up an order."""
    return order_id


def refund(order_id: str) -> str:
    """Refund an order."""
    return order_id


def test_every_check_has_a_code_and_every_templated_code_a_producer() -> None:
    assert set(CHECKS) <= set(CODES)
    for code, spec in CODES.items():
        assert spec.severity in ('error', 'warning', 'info'), code
        if spec.written_by == 'checks':
            assert spec.texts, f'{code} is written by checks but has no message template'
            assert code in CHECKS or code == 'DC012', f'{code} has templates but no registered check'  # DC012: per run
        else:
            assert not spec.texts, f'{code} is written by {spec.written_by}; its wording must live in one place'
    assert 'DC016' in CHECKS  # reported at construction, worded by skills.py


def test_problem_renders_the_template_and_the_variant_severity() -> None:
    found = problem('DC010', "capability 'r' (RunbookRequired)", ('dbos',), 'dynamic', tool='refnd')
    assert found.severity == 'warning' and found.engines == ('dbos',)
    assert found.message == (
        "requirements names tool 'refnd', which no capability or agent tool defines statically (MCP or dynamic "
        'toolsets may still provide it).'
    )
    assert problem('DC010', 'w', tool='refnd').severity == 'error'
    with pytest.raises(KeyError):
        problem('DC010', 'w', variant='no-such-variant', tool='x')


@dataclass
class Counting(AbstractCapability[Any]):
    """A capability that counts how often its toolset is asked for."""

    toolset: FunctionToolset[Any] = field(default_factory=FunctionToolset)
    calls: int = 0

    def get_toolset(self) -> Any:
        self.calls += 1
        return self.toolset


def test_get_toolset_is_called_once_at_construction_and_feeds_every_consumer(
    agent_name: Callable[[str], str],
) -> None:
    counting = Counting(id='orders', defer_loading=True, toolset=FunctionToolset([lookup]))
    definition = DurableAgent(agent_name('walk'), 'test', capabilities=[counting])
    # Id planning, the tool checks and the tool-name queries share one walk; DC024 fetches a deferred
    # capability's toolset once more, as the model's load will, to see that it hands out the same leaves.
    assert counting.calls == 2
    assert definition.static_tool_names() == ['lookup']
    assert definition.tool_names_by_capability() == ({'lookup': {'orders'}}, set())
    assert definition.leaf_ids() == {'orders': ['orders']}
    assert counting.calls == 2

    # The walk keeps the toolset, not a copy of its names: a tool added to it later is listed.
    counting.toolset.add_function(refund)
    assert definition.static_tool_names() == ['lookup', 'refund']


def test_tools_behind_a_combined_toolset_are_static_and_a_wrapper_makes_them_dynamic(
    agent_name: Callable[[str], str],
) -> None:
    static = Counting(id='static', toolset=CombinedToolset([FunctionToolset([lookup], id='a'), FunctionToolset([refund], id='b')]))  # type: ignore[arg-type]
    prefixed = Capability(id='prefixed', toolsets=[FunctionToolset([lookup], id='p').prefixed('x')])
    definition = DurableAgent(agent_name('mixed'), 'test', capabilities=[static, prefixed])
    tools, unknown = definition.tool_names_by_capability()
    assert tools == {'lookup': {'static'}, 'refund': {'static'}}
    assert unknown == {'prefixed'}
    assert definition.leaf_ids() == {'static': ['a', 'b'], 'prefixed': ['p']}


@dataclass
class Mixed(AbstractCapability[Any]):
    """Three anonymous leaves; the first cannot be copied: DC013 and DC014 for it, then DC013 for the others."""

    def get_toolset(self) -> Any:
        return CombinedToolset([ExternalToolset([]), FunctionToolset([lookup]), FunctionToolset([refund])])


def test_problems_of_one_capability_stay_in_leaf_order_across_codes(agent_name: Callable[[str], str]) -> None:
    with pytest.raises(DurableConfigError) as info:
        DurableAgent(agent_name('order'), 'test', capabilities=[Mixed(id='c')])
    report = info.value.report
    assert report.codes() == ['DC013', 'DC014', 'DC013', 'DC013'], report.to_text()
    assert [p.message.split(' gets id ')[0] for p in report if p.code == 'DC013'] == [
        'ExternalToolset at position 0',
        'FunctionToolset at position 1',
        'FunctionToolset at position 2',
    ]
