"""The upstream behaviour `durable_capabilities.engines._mcp` relies on (or works around), checked against the
installed pydantic-ai, temporalio and dbos. Each failure says what changed and what to revisit.

No private pydantic-ai name is used by `_mcp.py`; what it depends on is behaviour, pinned here:
1. upstream lists an unloaded deferred MCP capability's tools (the gap `MCPGuard` closes; if this starts failing,
   upstream closed it and the guard's skip may be redundant);
2. a loaded deferred capability's own tools reach the model without being listed at load time (what makes skipping
   discovery before the load safe);
3. upstream's durable wrapper of an MCP leaf reports the leaf's id (how the guard finds it) and does not pass
   `visit_and_replace` visitors on (why the guard walks the tree itself);
4. `PydanticAIPlugin` fails the workflow, not the workflow task, on `AgentRunError` (so `MCPCapabilityError`
   ends a Temporal run instead of retrying forever);
5. dbos keeps `DBOSMaxStepRetriesExceeded` / `DBOSException` in `dbos._error` (the DBOS pass-through rule).

Model: a scripted `FunctionModel`. MCP server: an in-process `FastMCP` (no network).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pydantic_ai
import pytest
from fastmcp import FastMCP
from fastmcp.server.middleware import Middleware
from pydantic_ai import Agent, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import MCP
from pydantic_ai.exceptions import AgentRunError
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import CombinedToolset, WrapperToolset

from durable_capabilities import DurableAgent
from durable_capabilities.engines import _mcp

HINT = 'pydantic-ai {version}: {what} -- revisit durable_capabilities/engines/_mcp.py'


def changed(what: str) -> str:
    return HINT.format(version=pydantic_ai.__version__, what=what)


class Counter(Middleware):
    def __init__(self) -> None:
        self.list_tools = 0

    async def on_list_tools(self, context: Any, call_next: Any) -> Any:
        self.list_tools += 1
        return await call_next(context)


def server() -> tuple[FastMCP, Counter]:
    counter = Counter()
    mcp = FastMCP('calc', middleware=[counter])

    @mcp.tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    return mcp, counter


def scripted(plan: list[ToolCallPart], seen: list[list[str]]) -> FunctionModel:
    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(sorted(t.name for t in info.function_tools))
        step = sum(1 for m in messages if m.kind == 'response')
        if step < len(plan):
            return ModelResponse(parts=[plan[step]])
        returns = [str(p.content) for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
        return ModelResponse(parts=[TextPart('done: ' + ', '.join(returns[1:]))])

    return FunctionModel(respond)


def test_upstream_lists_the_tools_of_an_unloaded_deferred_mcp() -> None:
    mcp, counter = server()
    agent = Agent(scripted([], []), capabilities=[MCP(local=mcp, id='calc', defer_loading=True, description='adds')])
    assert asyncio.run(agent.run('hi')).output == 'done: '
    assert counter.list_tools >= 1, changed(
        'an unloaded deferred MCP is no longer listed; MCPGuard may be unnecessary'
    )


def test_loaded_deferred_capability_tools_reach_the_model_without_listing_at_load_time() -> None:
    """With `MCPGuard`, the server is first listed on the step after `load_capability`; upstream must still show its
    tools from that step on (a loaded deferred capability's tools count as revealed by the load itself)."""
    mcp, _counter = server()
    definition = DurableAgent(
        f'contract-{uuid.uuid4().hex[:6]}',
        scripted([], []),
        capabilities=[MCP(local=mcp, id='calc', defer_loading=True, description='adds')],
        engines=(),
    )
    guard = _mcp.guard(definition, 'local', lambda leaf: None)
    assert guard is not None
    seen: list[list[str]] = []
    plan = [ToolCallPart('load_capability', {'id': 'calc'}), ToolCallPart('add', {'a': 2, 'b': 3})]
    agent = Agent(scripted(plan, seen), capabilities=[*definition.capabilities, guard])
    result = asyncio.run(agent.run('hi'))
    assert seen[0] == ['load_capability'], changed('the first request shows more than load_capability')
    assert seen[1] == ['add', 'load_capability'], changed(
        "a loaded deferred capability's tools no longer reach the model unless listed when it was loaded"
    )
    assert result.output == 'done: 5'


def test_durable_mcp_wrapper_reports_the_leaf_id_and_hides_its_leaf_from_visitors() -> None:
    from pydantic_ai.durable_exec.temporal import TemporalDurability
    from pydantic_ai.mcp import MCPToolset

    leaf = MCPToolset('http://127.0.0.1:9/mcp', id='calc')
    agent = Agent(scripted([], []), name=f'contract_{uuid.uuid4().hex[:6]}', toolsets=[leaf], capabilities=[TemporalDurability()])
    durability = TemporalDurability.from_agent(agent)
    assert durability is not None
    wrapped = durability.get_wrapper_toolset(CombinedToolset([leaf]))
    assert isinstance(wrapped, CombinedToolset)
    (node,) = wrapped.toolsets
    assert isinstance(node, WrapperToolset) and node.wrapped is leaf, changed('MCP leaves are no longer wrapped this way')
    assert node.id == 'calc', changed("the durable MCP wrapper no longer reports its leaf's id")
    visited: list[Any] = []
    node.visit_and_replace(lambda ts: visited.append(ts) or ts)
    assert visited == [], changed('durable wrappers now pass visitors on: `_rebuild` could use visit_and_replace')


def test_temporal_plugin_fails_the_workflow_on_agent_run_error() -> None:
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin

    types = PydanticAIPlugin().workflow_failure_exception_types
    assert isinstance(types, (list, tuple)) and AgentRunError in types, changed(
        'AgentRunError no longer fails a Temporal workflow; MCPCapabilityError would retry the workflow task forever'
    )
    assert issubclass(_mcp.MCPCapabilityError, AgentRunError)


def test_dbos_error_names() -> None:
    from dbos._error import DBOSException, DBOSMaxStepRetriesExceeded

    assert issubclass(DBOSMaxStepRetriesExceeded, DBOSException)


def test_mcp_capability_error_pickles_with_its_fields() -> None:
    """DBOS records a failed workflow's exception with pickle."""
    import pickle

    error = _mcp.MCPCapabilityError('boom', 'calc', 'http://127.0.0.1:9/mcp', 'list tools')
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.capability_id, again.url, again.operation) == ('boom', 'calc', 'http://127.0.0.1:9/mcp', 'list tools')


@pytest.mark.parametrize(
    'url',
    ['http://u:pw-123@127.0.0.1:9/mcp?token=tok-456', 'https://host.example/mcp?key=tok-456&x=1'],
)
def test_error_messages_never_carry_url_credentials(url: str) -> None:
    definition = DurableAgent(
        f'contract-{uuid.uuid4().hex[:6]}', scripted([], []), capabilities=[MCP(url=url, id='calc', defer_loading=True, description='x')],
        engines=(),
    )
    guard = _mcp.guard(definition, 'dbos', lambda leaf: 3)
    assert guard is not None
    toolset = _mcp.GuardedMCPToolset(CombinedToolset([]), guard, guard.leaves['calc'])
    cause = RuntimeError(f'failed for {url} (token tok-456)')
    message = str(toolset.error('list tools', cause))
    assert 'pw-123' not in message and 'tok-456' not in message
    assert "MCP capability 'calc'" in message and 'after 3 attempts' in message
    assert url.split('?')[0].replace('u:pw-123@', '') in message
