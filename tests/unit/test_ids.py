"""Stable leaf-toolset ids (issue 2, item 3): every capability kind, every engine, no mutation, no order or hash dependence."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from pydantic_ai import Agent, ModelSettings, RunContext
from pydantic_ai.capabilities import (
    MCP,
    AbstractCapability,
    Capability,
    CombinedCapability,
    DynamicCapability,
    WebFetch,
    WebSearch,
)
from pydantic_ai.exceptions import UserError
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import CombinedToolset, DynamicToolset, FunctionToolset

from durable_capabilities import (
    MAX_ID_LENGTH,
    DurableAgent,
    DurableConfigError,
    _upstream,
    id_syntax_error,
    load_skills,
    redact_url,
)
from durable_capabilities.ids import collect_leaves
from tests._helpers import subprocess_env

ENGINES = ('local', 'temporal', 'dbos', 'prefect')
MCP_URL = 'http://127.0.0.1:8931/mcp'  # building never connects; nothing needs to listen here


# ---- the user's code: module-level tools, toolsets and capabilities, as the seed writes them ----------------------


def lookup_order(order_id: str) -> str:
    """Look up an order."""
    return f'order {order_id}: shipped'


def search_catalog(query: str) -> str:
    """Search the product catalog."""
    return f'results for {query}'


def check_stock(sku: str) -> str:
    """Check stock for a SKU."""
    return f'{sku}: 3 in stock'


def quote_price(sku: str) -> str:
    """Quote a price."""
    return f'{sku}: $10'


def search_web(query: str) -> str:
    """Search the web."""
    return f'web results for {query}'


def fetch_page(url: str) -> str:
    """Fetch a page."""
    return f'page at {url}'


def current_promotions(code: str) -> str:
    """Look up a promotion code."""
    return f'promo {code}: 10% off'


def inventory_tools(ctx: RunContext[Any]) -> FunctionToolset[Any]:
    return FunctionToolset([check_stock])


def pricing_tools(ctx: RunContext[Any]) -> FunctionToolset[Any]:
    return FunctionToolset([quote_price])


def promotions(ctx: RunContext[Any]) -> Capability[Any]:
    return Capability(tools=[current_promotions])


# The seed's Workflow 2: a module-level FunctionToolset without an id, returned by a custom capability.
security_tools = FunctionToolset[Any]()
REVOKED: list[tuple[str, str]] = []


@security_tools.tool
def revoke_sessions(ctx: RunContext[Any], account_id: str) -> str:
    """Revoke all active sessions for an account."""
    REVOKED.append((ctx.deps, account_id))
    return f'Revoked sessions for {account_id}.'


@dataclass
class AccountSecurity(AbstractCapability[Any]):
    id: str = 'account-security'
    description: str = 'Use for suspicious logins, account takeover, or session revocation.'
    defer_loading: bool = True

    def get_instructions(self) -> str:
        return 'Confirm the customer identity before revoking sessions.'

    def get_toolset(self) -> Any:
        return security_tools

    def get_model_settings(self) -> ModelSettings:
        return ModelSettings(extra_body={'reasoning_effort': 'high'})

    async def before_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any) -> Any:
        return args


def orders_capability() -> Capability[Any]:
    return Capability(
        id='orders',
        description='Use for order tracking.',
        instructions='Quote the order ID.',
        tools=[lookup_order],
        defer_loading=True,
    )


# ---- the configurations of issue 2 item 3 -----------------------------------------------------------------------


@dataclass
class Config:
    make: Callable[[Path], list[Any]]  # receives a skills directory
    leaf_ids: dict[str, list[str]]
    positional_warnings: int = 0


CONFIGS: dict[str, Config] = {
    'capability-tools': Config(lambda _: [orders_capability()], {'orders': ['orders']}),
    'toolset-object': Config(
        lambda _: [
            Capability(id='catalog', description='Catalog.', toolsets=[FunctionToolset([search_catalog])], defer_loading=True)
        ],
        {'catalog': ['catalog']},
    ),
    'toolset-callable': Config(
        lambda _: [Capability(id='inventory', description='Stock.', toolsets=[inventory_tools], defer_loading=True)],
        {'inventory': ['inventory_0']},  # upstream's own id for a callable, kept
    ),
    'mixed-tools-objects-callables': Config(
        lambda _: [
            Capability(
                id='ops',
                description='Ops.',
                tools=[lookup_order],
                toolsets=[FunctionToolset([search_catalog]), inventory_tools, pricing_tools],
                defer_loading=True,
            )
        ],
        # tools= -> 'ops' (upstream); callables -> 'ops_1', 'ops_2' (upstream, by position in toolsets=);
        # the toolset object -> 'ops_0' (ours, positional: warned); upstream's positional callables: warned once.
        {'ops': ['ops', 'ops_0', 'ops_1', 'ops_2']},
        positional_warnings=2,
    ),
    'custom-subclass': Config(lambda _: [AccountSecurity()], {'account-security': ['account-security']}),
    'seed-support': Config(
        lambda _: [orders_capability(), AccountSecurity()],
        {'orders': ['orders'], 'account-security': ['account-security']},
    ),
    'mcp-url-deferred': Config(
        lambda _: [MCP(url=MCP_URL, id='docs', description='Docs server.', defer_loading=True)], {'docs': ['docs']}
    ),
    'mcp-local-toolset': Config(
        lambda _: [MCP(local=MCPToolset(MCP_URL), id='kb', description='Knowledge base.', defer_loading=True)],
        {'kb': ['kb']},
    ),
    'dynamic-capability': Config(lambda _: [DynamicCapability(promotions, id='promos')], {'promos': ['promos']}),
    'web-search-local-function': Config(
        lambda _: [WebSearch(local=search_web, id='web-research', description='Web.', defer_loading=True)],
        {'web-research': ['web-research']},
    ),
    'web-fetch-local-toolset': Config(
        lambda _: [WebFetch(local=FunctionToolset([fetch_page]), id='web-pages', description='Pages.', defer_loading=True)],
        {'web-pages': ['web-pages']},
    ),
    'combined-id-less-members': Config(
        lambda _: [
            CombinedCapability(
                [Capability(tools=[lookup_order]), Capability(toolsets=[FunctionToolset([search_catalog])])],
                id='g',
                description='A group.',
                defer_loading=True,
            )
        ],
        {'g': ['g_0', 'g_1']},
        positional_warnings=2,
    ),
    'nested-groups': Config(
        lambda _: [
            CombinedCapability(
                [
                    CombinedCapability(
                        [Capability(tools=[lookup_order]), Capability(toolsets=[inventory_tools, pricing_tools])]
                    ),
                    Capability(id='inner-named', tools=[search_catalog]),
                ],
                id='bundle',
                description='Nested.',
                defer_loading=True,
            )
        ],
        # the id-less inner group is the only id-less member of 'bundle', so it takes 'bundle' itself; its two
        # id-less members are numbered (warned); named dynamic toolsets use their function names.
        {
            'bundle': ['bundle_0', 'bundle_1_inventory_tools', 'bundle_1_pricing_tools'],
            'inner-named': ['inner-named'],
        },
        positional_warnings=2,
    ),
    'skills': Config(lambda d: load_skills(d), {'refunds': ['refunds'], 'returns': ['returns']}),
}


# ---- what the engines registered ----------------------------------------------------------------------------------

_TEMPORAL_KINDS = ('toolset', 'mcp_server', 'dynamic_toolset')


def durable_toolset_ids(agent: Agent[Any, Any], engine: str) -> set[str]:
    """Leaf toolset ids upstream's durability capability registered for `agent` (the agent's own `<agent>` excluded)."""
    if engine == 'temporal':
        from pydantic_ai.durable_exec.temporal import TemporalDurability

        durability = TemporalDurability.from_agent(agent)
        assert durability is not None
        ids = set()
        for fn in durability.temporal_activities:
            parts = _upstream.temporal_activity_name(fn).split('__')  # agent__{name}__{kind}__{id}__{operation}
            if len(parts) == 5 and parts[2] in _TEMPORAL_KINDS:
                ids.add(parts[3])
        return ids - {'<agent>'}
    if engine == 'dbos':
        from pydantic_ai.durable_exec.dbos import DBOSDurability as durability_cls
    elif engine == 'prefect':
        from pydantic_ai.durable_exec.prefect import PrefectDurability as durability_cls
    else:
        raise AssertionError(engine)
    durability = durability_cls.from_agent(agent)
    assert durability is not None
    registered = getattr(durability, '_toolsets_by_id', None)
    assert isinstance(registered, dict), (
        f'{durability_cls.__name__} no longer keeps `_toolsets_by_id`; update this test helper'
    )
    return set(registered) - {'<agent>'}


@pytest.mark.parametrize('engine', ENGINES)
@pytest.mark.parametrize('config_name', list(CONFIGS))
def test_every_capability_kind_builds_on_every_engine_with_expected_ids(
    config_name: str, engine: str, agent_name: Callable[[str], str], skills_dir: Path
) -> None:
    config = CONFIGS[config_name]
    definition = DurableAgent(agent_name(config_name), 'test', capabilities=config.make(skills_dir))

    assert definition.leaf_ids() == config.leaf_ids
    report = definition.report()
    assert report.ok, report.to_text()
    assert report.codes().count('DC013') == config.positional_warnings, report.to_text()
    assert set(report.codes()) <= {'DC013'}, report.to_text()

    agent = definition.build(engine)  # upstream's id errors would raise here
    assert isinstance(agent, Agent)
    assert definition.build(engine) is agent

    if engine == 'local':
        return
    all_ids = {leaf for leaves in config.leaf_ids.values() for leaf in leaves}
    registered = durable_toolset_ids(agent, engine)
    if engine == 'dbos':
        # DBOS upstream checkpoints MCP and dynamic toolsets as steps; function tools run in workflow code.
        step_kinds = {'MCPToolset', 'DynamicToolset'}
        stepped = {p.toolset_id for plans in definition.leaf_plans().values() for p in plans if p.kind in step_kinds}
        assert stepped <= registered <= all_ids
    else:
        assert registered == all_ids


# ---- upstream alone fails: why the layer exists -------------------------------------------------------------------

UPSTREAM_FAILS = {
    'custom-subclass': lambda: AccountSecurity(),
    'toolset-object': lambda: Capability(
        id='catalog', description='Catalog.', toolsets=[FunctionToolset([search_catalog])], defer_loading=True
    ),
    'mcp-local-toolset': lambda: MCP(local=MCPToolset(MCP_URL), id='kb', description='KB.', defer_loading=True),
}


def _durability(engine: str) -> Any:
    if engine == 'temporal':
        from pydantic_ai.durable_exec.temporal import TemporalDurability

        return TemporalDurability()
    from pydantic_ai.durable_exec.prefect import PrefectDurability

    return PrefectDurability()


@pytest.mark.parametrize('engine', ['temporal', 'prefect'])
@pytest.mark.parametrize('config_name', list(UPSTREAM_FAILS))
def test_upstream_alone_rejects_what_the_layer_accepts(
    config_name: str, engine: str, agent_name: Callable[[str], str]
) -> None:
    """If this starts passing upstream, pydantic-ai fixed id inheritance and the layer may shrink."""
    with pytest.raises(UserError, match=r'need to have a unique `id`'):
        Agent('test', name=agent_name('upstream'), capabilities=[UPSTREAM_FAILS[config_name](), _durability(engine)])
    # ... while the same kind of object passes through the layer.
    DurableAgent(agent_name('layer'), 'test', capabilities=[UPSTREAM_FAILS[config_name]()]).build(engine)


# ---- the user's objects are never mutated -------------------------------------------------------------------------


def _snapshot(obj: Any) -> dict[str, int]:
    return {key: id(value) for key, value in vars(obj).items()}


def test_building_every_engine_mutates_nothing_of_the_users(agent_name: Callable[[str], str], skills_dir: Path) -> None:
    catalog_toolset = FunctionToolset([search_catalog])
    mcp_toolset = MCPToolset(MCP_URL)
    capabilities: list[Any] = [
        AccountSecurity(),
        Capability(id='catalog', description='Catalog.', toolsets=[catalog_toolset], defer_loading=True),
        MCP(local=mcp_toolset, id='kb', description='KB.', defer_loading=True),
        CombinedCapability([Capability(toolsets=[inventory_tools, pricing_tools])], id='g', description='G.'),
    ]
    mcp_id_before = mcp_toolset.id
    before = [(_snapshot(c), c.id, c.defer_loading) for c in capabilities]
    definition = DurableAgent(agent_name('mut'), 'test', capabilities=capabilities)
    for engine in ENGINES:
        definition.build(engine)

    assert security_tools.id is None
    assert catalog_toolset.id is None
    assert mcp_toolset.id == mcp_id_before == '127.0.0.1'  # upstream's derived id, still not explicit
    assert mcp_toolset._explicit_id is None  # pyright: ignore[reportPrivateUsage]
    assert [(_snapshot(c), c.id, c.defer_loading) for c in capabilities] == before
    assert list(capabilities[1].toolsets) == [catalog_toolset]
    assert capabilities[1].toolsets[0] is catalog_toolset
    assert capabilities[3].capabilities[0].id is None
    # The wrapped capabilities handed to upstream are not the user's objects.
    assert not any(c is d for c in capabilities for d in definition.capabilities)


def scripted_model(capability_id: str, tool: str, args: dict[str, Any]) -> FunctionModel:
    """Loads `capability_id`, calls `tool(**args)`, then answers with the tool's return value."""

    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        done = [p.tool_name for p in returns]
        if 'load_capability' not in done:
            return ModelResponse(parts=[ToolCallPart('load_capability', {'id': capability_id})])
        if tool not in done:
            return ModelResponse(parts=[ToolCallPart(tool, args)])
        return ModelResponse(parts=[TextPart(f'done: {returns[-1].content}')])

    return FunctionModel(respond)


def test_module_level_toolset_shared_by_two_agents_works_for_both(agent_name: Callable[[str], str]) -> None:
    first = DurableAgent(agent_name('first'), 'test', capabilities=[orders_capability(), AccountSecurity()])
    second = DurableAgent(agent_name('second'), 'test', capabilities=[AccountSecurity()])
    for definition in (first, second):
        for engine in ENGINES:
            definition.build(engine)
    REVOKED.clear()

    model = scripted_model('account-security', 'revoke_sessions', {'account_id': 'acct-1'})
    result_1 = asyncio.run(first.build('local').run('Someone logged into my account', model=model, deps='store-1'))
    model = scripted_model('account-security', 'revoke_sessions', {'account_id': 'acct-2'})
    result_2 = asyncio.run(second.run('Revoke my sessions', model=model, deps='store-2'))

    assert result_1.output == 'done: Revoked sessions for acct-1.'
    assert result_2.output == 'done: Revoked sessions for acct-2.'
    assert REVOKED == [('store-1', 'acct-1'), ('store-2', 'acct-2')]
    assert security_tools.id is None
    # The tool call is attributed to the stable id in both runs.
    assert first.leaf_ids()['account-security'] == second.leaf_ids()['account-security'] == ['account-security']


def test_tool_registered_after_definition_is_visible(agent_name: Callable[[str], str]) -> None:
    late_tools = FunctionToolset[Any]()

    @dataclass
    class Late(AbstractCapability[Any]):
        id: str = 'late'
        description: str = 'Late tools.'
        defer_loading: bool = True

        def get_toolset(self) -> Any:
            return late_tools

    definition = DurableAgent(agent_name('late'), 'test', capabilities=[Late()])
    definition.build('local')

    @late_tools.tool_plain
    def added_later(x: int) -> str:
        """Registered after the agent was built."""
        return f'late {x}'

    result = asyncio.run(definition.run('go', model=scripted_model('late', 'added_later', {'x': 7})))
    assert result.output == 'done: late 7'
    assert late_tools.id is None


# ---- ordering -----------------------------------------------------------------------------------------------------


@dataclass
class DynamicPair(AbstractCapability[Any]):
    """A custom capability owning several dynamic leaves, each named after its function."""

    funcs: tuple[Any, ...] = (inventory_tools, pricing_tools)

    def get_toolset(self) -> Any:
        return CombinedToolset([DynamicToolset(f) for f in self.funcs])


@dataclass
class ObjectPair(AbstractCapability[Any]):
    """A custom capability owning several id-less FunctionToolsets: nothing but their position tells them apart."""

    toolsets: tuple[Any, ...] = ()

    def get_toolset(self) -> Any:
        return CombinedToolset(list(self.toolsets))


def _plans_by_kind(definition: DurableAgent[Any, Any], cap_id: str) -> list[tuple[str, str]]:
    return [(p.toolset_id, p.source) for p in definition.leaf_plans()[cap_id]]


def test_named_leaves_keep_their_ids_when_reordered(agent_name: Callable[[str], str]) -> None:
    forward = DurableAgent(agent_name('fwd'), 'test', capabilities=[DynamicPair(id='stock')])
    backward = DurableAgent(
        agent_name('bwd'), 'test', capabilities=[DynamicPair(id='stock', funcs=(pricing_tools, inventory_tools))]
    )
    assert forward.leaf_ids() == {'stock': ['stock_inventory_tools', 'stock_pricing_tools']}
    assert backward.leaf_ids() == {'stock': ['stock_pricing_tools', 'stock_inventory_tools']}
    assert sorted(forward.leaf_ids()['stock']) == sorted(backward.leaf_ids()['stock'])
    assert 'DC013' not in forward.report().codes() + backward.report().codes()
    for definition in (forward, backward):
        for engine in ('temporal', 'prefect'):
            assert durable_toolset_ids(definition.build(engine), engine) == set(forward.leaf_ids()['stock'])


def test_named_leaves_of_an_id_less_group_member_keep_their_ids_when_reordered(
    agent_name: Callable[[str], str],
) -> None:
    def group(*funcs: Any) -> CombinedCapability[Any]:
        return CombinedCapability([Capability(toolsets=list(funcs))], id='g', description='G.', defer_loading=True)

    forward = DurableAgent(agent_name('fwd'), 'test', capabilities=[group(inventory_tools, pricing_tools)])
    backward = DurableAgent(agent_name('bwd'), 'test', capabilities=[group(pricing_tools, inventory_tools)])
    assert sorted(forward.leaf_ids()['g']) == sorted(backward.leaf_ids()['g']) == ['g_inventory_tools', 'g_pricing_tools']
    assert 'DC013' not in forward.report().codes() + backward.report().codes()


def test_positional_leaves_are_warned_dc013(agent_name: Callable[[str], str]) -> None:
    a, b = FunctionToolset([check_stock]), FunctionToolset([quote_price])
    forward = DurableAgent(agent_name('fwd'), 'test', capabilities=[ObjectPair(id='pair', toolsets=(a, b))])
    backward = DurableAgent(agent_name('bwd'), 'test', capabilities=[ObjectPair(id='pair', toolsets=(b, a))])
    assert forward.leaf_ids() == backward.leaf_ids() == {'pair': ['pair_0', 'pair_1']}
    assert _plans_by_kind(forward, 'pair') == [('pair_0', 'position'), ('pair_1', 'position')]
    # Same ids, different toolsets behind them: that is exactly what the warning is about.
    for definition in (forward, backward):
        warnings = [p for p in definition.report() if p.code == 'DC013']
        assert len(warnings) == 2
        assert all(p.severity == 'warning' and "'pair'" in p.where and 'ObjectPair' in p.where for p in warnings)
        assert all('reorder' in p.message for p in warnings)


def test_upstream_positional_callable_ids_are_warned_dc013(agent_name: Callable[[str], str]) -> None:
    forward = DurableAgent(
        agent_name('fwd'), 'test', capabilities=[Capability(id='c', toolsets=[inventory_tools, pricing_tools])]
    )
    backward = DurableAgent(
        agent_name('bwd'), 'test', capabilities=[Capability(id='c', toolsets=[pricing_tools, inventory_tools])]
    )
    assert forward.leaf_ids() == backward.leaf_ids() == {'c': ['c_0', 'c_1']}  # the same ids, swapped toolsets
    assert 'DC013' in forward.report().codes()


@dataclass
class ReturnsToolsetFunction(AbstractCapability[Any]):
    def get_toolset(self) -> Any:
        return inventory_tools  # a toolset function: pydantic-ai wraps it in an id-less DynamicToolset


def test_toolset_functions_and_rebuilt_function_toolsets_are_the_same_leaf_objects_on_every_call(
    agent_name: Callable[[str], str],
) -> None:
    """pydantic-ai builds a new `DynamicToolset` per toolset function (and `WebSearch(local=func)` a new
    `FunctionToolset`) on every `get_toolset()` call; durable engines refuse, inside a run, a leaf that is not
    one they wrapped at build time. The wrapper hands out the first one again, with upstream's ids."""
    capabilities = [
        Capability(id='stock', description='Stock.', toolsets=[inventory_tools, pricing_tools], defer_loading=True),
        Capability(id='one', description='One.', toolsets=[inventory_tools], defer_loading=True),
        WebSearch(local=search_web, native=False, id='web-research', description='Web.', defer_loading=True),
        ReturnsToolsetFunction(id='by-function', description='By function.', defer_loading=True),
    ]
    definition = DurableAgent(agent_name('stable'), 'test', capabilities=capabilities)
    assert definition.leaf_ids() == {
        'stock': ['stock_0', 'stock_1'], 'one': ['one_0'], 'web-research': ['web-research'],
        'by-function': ['by-function'],
    }
    for capability in definition.capabilities:
        first, second = capability.get_toolset(), capability.get_toolset()
        assert first is not None and second is not None
        first_leaves, second_leaves = collect_leaves(first), collect_leaves(second)
        assert [leaf.id for leaf in first_leaves] == [leaf.id for leaf in second_leaves]
        assert all(a is b for a, b in zip(first_leaves, second_leaves, strict=True)), capability.id
    # The user's capability keeps building new ones (it is never changed).
    assert collect_leaves(capabilities[0].get_toolset())[0] is not collect_leaves(capabilities[0].get_toolset())[0]
    for engine in ENGINES:
        definition.build(engine)


def test_leaf_ids_never_embed_a_server_host(agent_name: Callable[[str], str]) -> None:
    """Two anonymous MCP servers under one capability: their host-derived ids are not used as suffixes
    (a host change would rename durable units); they get positional ids, warned as DC013."""

    @dataclass
    class Hosts(AbstractCapability[Any]):
        def get_toolset(self) -> Any:
            return CombinedToolset([MCPToolset('http://alpha.internal/mcp'), MCPToolset('http://beta.internal/mcp')])

    definition = DurableAgent(agent_name('hosts'), 'test', capabilities=[Hosts(id='hosts')])
    assert definition.leaf_ids() == {'hosts': ['hosts_0', 'hosts_1']}
    assert definition.report().codes().count('DC013') == 2
    assert not any('internal' in leaf for leaves in definition.leaf_ids().values() for leaf in leaves)


# ---- the same ids in every process ---------------------------------------------------------------------------------

ID_SCRIPT = textwrap.dedent(
    '''
    import json, sys
    from dataclasses import dataclass
    from pydantic_ai.capabilities import MCP, AbstractCapability, Capability, CombinedCapability, DynamicCapability
    from pydantic_ai.mcp import MCPToolset
    from pydantic_ai.toolsets import CombinedToolset, DynamicToolset, FunctionToolset
    from durable_capabilities import DurableAgent, load_skills

    def t1(x: int) -> int: return x
    def t2(x: int) -> int: return x
    def t3(x: int) -> int: return x
    def t4(x: int) -> int: return x
    def t5(x: int) -> int: return x
    def stock_tools(ctx): return FunctionToolset([t1])
    def price_tools(ctx): return FunctionToolset([t1])
    def promo_tools(ctx): return FunctionToolset([t1])
    shared = FunctionToolset([t2])

    @dataclass
    class Many(AbstractCapability):
        def get_toolset(self):
            return CombinedToolset([DynamicToolset(f) for f in (promo_tools, price_tools, stock_tools)])

    @dataclass
    class Custom(AbstractCapability):
        id: str = 'custom'
        def get_toolset(self): return shared

    capabilities = [
        Many(id='many'),
        Custom(),
        Capability(id='ops', tools=[t3], toolsets=[FunctionToolset([t4]), stock_tools], defer_loading=True, description='d'),
        CombinedCapability([Capability(tools=[t5]), Capability(toolsets=[price_tools, stock_tools])], id='g',
                           defer_loading=True, description='d'),
        MCP(local=MCPToolset('http://127.0.0.1:8931/mcp'), id='kb', defer_loading=True, description='d'),
        DynamicCapability(lambda ctx: None, id='dyn'),
        *load_skills(sys.argv[1]),
    ]
    try:
        definition = DurableAgent('ids', 'test', capabilities=capabilities, engines=())
        print(json.dumps(definition.leaf_ids()))
    except Exception as exc:
        print(json.dumps({'error': str(exc)}))
    '''
)


@pytest.mark.slow
def test_ids_identical_across_processes_and_hash_seeds(tmp_path: Path, skills_dir: Path) -> None:
    script = tmp_path / 'print_ids.py'
    script.write_text(ID_SCRIPT)
    outputs = []
    for seed in ('1', '2', '987654'):
        env = subprocess_env({'PYTHONHASHSEED': seed})
        done = subprocess.run(
            [sys.executable, str(script), str(skills_dir)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.strip().splitlines()[-1])
    assert outputs[0] == outputs[1] == outputs[2]
    ids = json.loads(outputs[0])
    assert 'error' not in ids, ids['error']
    assert ids == {
        'many': ['many_promo_tools', 'many_price_tools', 'many_stock_tools'],
        'custom': ['custom'],
        'ops': ['ops', 'ops_0', 'ops_1'],
        'g': ['g_0', 'g_1_price_tools', 'g_1_stock_tools'],
        'kb': ['kb'],
        'dyn': ['dyn'],
        'refunds': ['refunds'],
        'returns': ['returns'],
    }


# ---- property tests -------------------------------------------------------------------------------------------------

_SAFE = set('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-')
_ALNUM = set('ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789')


def reference_is_valid_id(value: object) -> bool:
    """The documented rule, written independently: 1-100 chars of [A-Za-z0-9._-], alnum at both ends, no '__'."""
    return (
        isinstance(value, str)
        and 1 <= len(value) <= 100
        and all(ch in _SAFE for ch in value)
        and value[0] in _ALNUM
        and value[-1] in _ALNUM
        and '__' not in value
    )


_id_alphabet = st.sampled_from([*sorted(_SAFE), ' ', '\t', '\n', ':', '/', '@', 'é', '٣', '\u00a0', '_', '_', '.', '-'])
id_candidates = st.one_of(
    st.text(_id_alphabet, max_size=110),
    st.text(max_size=30),
    st.from_regex(r'[A-Za-z0-9][A-Za-z0-9._-]{0,110}', fullmatch=True),
    st.integers(min_value=95, max_value=105).map(lambda n: 'a' * n),
)


@settings(database=None, max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(id_candidates)
@example('a')
@example('a' * MAX_ID_LENGTH)
@example('a' * (MAX_ID_LENGTH + 1))
@example('')
@example('a b')
@example(' a')
@example('a\n')
@example('a__b')
@example('a:b')
@example('-a')
@example('a.')
@example('a_-_b')
def test_id_syntax_error_matches_the_documented_rule(value: str) -> None:
    error = id_syntax_error(value)
    assert (error is None) == reference_is_valid_id(value), (value, error)
    if error is not None:
        assert isinstance(error, str) and error


@pytest.mark.parametrize('value', ['', ' ', 'a b', '\tx', 'x\n', 'a\u00a0b', 'a__b', 'x' * 101, 'a:b', 'ns:tool', None, 7])
def test_id_syntax_error_rejects(value: object) -> None:
    assert id_syntax_error(value) is not None


valid_ids = st.from_regex(r'[A-Za-z0-9](?:[A-Za-z0-9._-]{0,98}[A-Za-z0-9])?', fullmatch=True).filter(reference_is_valid_id)


def _leaf_ids_of(cap_id: str) -> tuple[list[str], list[str]]:
    """Build a definition whose capability `cap_id` owns named, positional and upstream-numbered leaves."""
    capabilities = [
        DynamicPair(id=cap_id),
        CombinedCapability(
            [Capability(tools=[lookup_order]), Capability(toolsets=[FunctionToolset([search_catalog])])],
            id=f'{cap_id}-g',
        ),
        Capability(id=f'{cap_id}-c', tools=[search_web], toolsets=[FunctionToolset([fetch_page]), inventory_tools]),
    ]
    try:
        definition = DurableAgent('prop', 'test', capabilities=capabilities, engines=())
    except DurableConfigError as exc:
        messages = [p.message for p in exc.report if p.code == 'DC002']
        return [], messages
    return [leaf for leaves in definition.leaf_ids().values() for leaf in leaves], []


@settings(database=None, max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_ids)
@example('a')
@example('x' * 94)
@example('x' * 100)
def test_derived_leaf_ids_are_valid_deterministic_and_unique(cap_id: str) -> None:
    leaves, dc002 = _leaf_ids_of(cap_id)
    leaves_again, dc002_again = _leaf_ids_of(cap_id)
    assert (leaves, dc002) == (leaves_again, dc002_again)  # deterministic
    if dc002:
        # Too long once suffixed: reported, never silently used.
        assert len(cap_id) > MAX_ID_LENGTH - len('_inventory_tools')
        assert all('characters long' in m for m in dc002)
        return
    assert len(leaves) == len(set(leaves)) == 7  # unique
    for leaf in leaves:
        assert id_syntax_error(leaf) is None, leaf
        assert leaf.startswith(cap_id)


_identifiers = st.from_regex(r'[A-Za-z_][A-Za-z0-9_]{0,30}', fullmatch=True)


@settings(database=None, max_examples=150, deadline=None)
@given(st.lists(_identifiers, min_size=2, max_size=3, unique=True))
@example(['fetch___data', 'other'])
def test_leaf_ids_from_arbitrary_function_names_are_valid_and_unique(names: list[str]) -> None:
    funcs = []
    for name in names:

        def factory(ctx: Any) -> None:
            return None

        factory.__name__ = name
        funcs.append(factory)
    definition = DurableAgent('names', 'test', capabilities=[DynamicPair(id='c', funcs=tuple(funcs))], engines=())
    leaves = definition.leaf_ids()['c']
    assert len(leaves) == len(set(leaves)) == len(names)
    for leaf in leaves:
        assert id_syntax_error(leaf) is None, leaf


_userinfo = st.text(
    st.sampled_from(list('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&\'()*+,;=%:@')),
    min_size=1,
    max_size=20,
)


@settings(database=None, max_examples=400)
@given(
    scheme=st.sampled_from(['http', 'https', 'HTTP', 'ws']),
    user=_userinfo,
    password=_userinfo,
    host=st.from_regex(r'[a-z][a-z0-9-]{0,10}(\.[a-z]{2,5}){0,2}', fullmatch=True),
    port=st.none() | st.integers(min_value=1, max_value=65535),
    path=st.from_regex(r'(/[a-z0-9_-]{0,8}){0,3}', fullmatch=True),
    query=st.none() | _userinfo,
    encode=st.booleans(),
)
@example('https', 'user', 's3cret', 'mcp.example.com', 8443, '/api', 'token=t0ps3cret', False)
@example('http', 'u', 'p@ss:word', 'host', None, '/mcp', None, False)
def test_redact_url_never_keeps_credentials(
    scheme: str, user: str, password: str, host: str, port: int | None, path: str, query: str | None, encode: bool
) -> None:
    if encode:
        user, password = quote(user, safe=''), quote(password, safe='')
    secret_places = f'{scheme}://{host}:{port or ""}{path}'.lower()
    assume(password.lower() not in secret_places and user.lower() not in secret_places)
    netloc = f'{user}:{password}@{host}' + (f':{port}' if port else '')
    url = f'{scheme}://{netloc}{path}' + (f'?{query}' if query else '')
    redacted = redact_url(url)
    assert password not in redacted
    assert user not in redacted
    assert '@' not in redacted
    if query:
        assert '?' not in redacted
    if '<unparseable' not in redacted:
        assert host in redacted.lower()


def test_redact_url_examples() -> None:
    assert redact_url('https://user:secret@mcp.example.com:8443/api?token=t#frag') == 'https://mcp.example.com:8443/api'
    assert redact_url('http://[::1]:9000/mcp') == 'http://[::1]:9000/mcp'
    assert 'secret' not in redact_url('http://user:secret@host:notaport/x')


def test_redact_url_without_scheme_drops_credentials() -> None:
    assert 's3cret' not in redact_url('user:s3cret@mcp.example.com/mcp')
