"""A deferred capability built from toolset functions, `Capability(id='stock', toolsets=[func, ...])`.

Model: a scripted `FunctionModel`: load `stock`, call `count_units` (from the first toolset function) and
`price_of` (from the second), then answer. pydantic-ai builds a new `DynamicToolset` around each function on
every `get_toolset()` call; durable engines refused those inside a run until `StableIdCapability` handed out
one object per function. Each tool call appends a line to `$DURCAP_CRASH_DIR/tool-calls`.
The agent name is `$DURCAP_TOOLSET_AGENT` (unique per test).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic_ai import ModelResponse, RunContext, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import FunctionToolset

from durable_capabilities import DurableAgent


def _log(line: str) -> None:
    directory = Path(os.environ['DURCAP_CRASH_DIR'])
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / 'tool-calls', 'a', encoding='utf-8') as f:
        f.write(line + '\n')


def count_units(sku: str) -> int:
    """Units of `sku` in stock."""
    _log(f'count_units {sku}')
    return 3


def price_of(sku: str) -> str:
    """The price of `sku`."""
    _log(f'price_of {sku}')
    return '9.50 EUR'


_counting = FunctionToolset([count_units])


def counting_tools(ctx: RunContext[Any]) -> FunctionToolset[Any]:
    return _counting


def pricing_tools(ctx: RunContext[Any]) -> FunctionToolset[Any]:
    return FunctionToolset([price_of])  # a new toolset each step: the function is what stays the same


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    returned = {p.tool_name: p.content for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)}
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'stock'})])
    if 'count_units' not in returned:
        return ModelResponse(parts=[ToolCallPart('count_units', {'sku': 'A-1'})])
    if 'price_of' not in returned:
        return ModelResponse(parts=[ToolCallPart('price_of', {'sku': 'A-1'})])
    return ModelResponse(parts=[TextPart(f'{returned["count_units"]} units at {returned["price_of"]}')])


stock = Capability(id='stock', description='Stock levels and prices.', toolsets=[counting_tools, pricing_tools],
                   defer_loading=True)
agent = DurableAgent(os.environ.get('DURCAP_TOOLSET_AGENT', 'stock-keeper'), FunctionModel(script), capabilities=[stock])
