"""All-problems validation (issue 2, item 4): every mistake reported at once, each with a stable code, never a secret."""

from __future__ import annotations

import asyncio
import json
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai import Agent, Tool
from pydantic_ai.capabilities import MCP, AbstractCapability, Capability
from pydantic_ai.exceptions import UserError
from pydantic_ai.toolsets import CombinedToolset, ExternalToolset, FunctionToolset

from durable_capabilities import (
    CODES,
    DurableAgent,
    DurableConfigError,
    Problem,
    Report,
    RunbookRequired,
    load_skills,
    validate_together,
)
from durable_capabilities.engines import DURABLE_ENGINES

# test_zz_every_code_is_exercised reads what every test of this module produced: the module runs on one xdist worker.
pytestmark = pytest.mark.xdist_group('validation-codes')

SEEN_CODES: set[str] = set()
"""Every code any test in this module produced; the last test checks it covers `CODES`."""



def codes_with_a_producer() -> set[str]:
    """Codes some module of the package writes as a literal, other than as a key of `CODES` itself."""
    import ast

    import durable_capabilities

    found: set[str] = set()
    for path in sorted(Path(durable_capabilities.__file__).parent.rglob('*.py')):
        tree = ast.parse(path.read_text(encoding='utf-8'))
        catalogue_keys = {
            id(key)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Dict)
            and any(getattr(t, 'id', None) == 'CODES' for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
            for key in node.value.keys
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and re.fullmatch(r'DC\d{3}', node.value)
                and id(node) not in catalogue_keys
            ):
                found.add(node.value)
    return found


def seen(report: Report) -> Report:
    SEEN_CODES.update(report.codes())
    return report


def problems_of(name: str, capabilities: list[Any], **kwargs: Any) -> Report:
    """The full report of a definition, whether or not construction raised."""
    try:
        return seen(DurableAgent(name, 'test', capabilities=capabilities, **kwargs).report())
    except DurableConfigError as exc:
        return seen(exc.report)


# ---- the user's code ----------------------------------------------------------------------------------------------


def check_a(x: int) -> int:
    """A."""
    return x


def check_b(x: int) -> int:
    """B."""
    return x


def check_c(x: int) -> int:
    """C."""
    return x


def refund_a(order_id: str) -> str:
    """Refund through billing."""
    return order_id


def refund_b(order_id: str) -> str:
    """Refund through payments."""
    return order_id


def issue_refund(order_id: str, amount: float) -> str:
    """Issue a refund."""
    return f'refunded {amount} for {order_id}'


def load_capability(name: str) -> str:
    """A user tool that takes the reserved name."""
    return name


@dataclass
class Playbook(AbstractCapability[Any]):
    """Instructions only: no toolset, so an id mistake here is exactly one mistake."""

    def get_instructions(self) -> str:
        return 'Follow the playbook.'


@dataclass
class External(AbstractCapability[Any]):
    """Contributes a leaf kind the layer cannot copy (an id-less ExternalToolset)."""

    def get_toolset(self) -> Any:
        return ExternalToolset([])


@dataclass
class ObjectPair(AbstractCapability[Any]):
    def get_toolset(self) -> Any:
        return CombinedToolset([FunctionToolset([check_a]), FunctionToolset([check_b])])


@dataclass
class Exploding(AbstractCapability[Any]):
    def get_toolset(self) -> Any:
        raise RuntimeError('cannot reach the tool registry')


@dataclass
class FreshToolsets(AbstractCapability[Any]):
    """Builds a new leaf on every `get_toolset()` call: a `FunctionToolset` or a closure (`kind`)."""

    kind: str = 'function'

    def get_toolset(self) -> Any:
        if self.kind == 'function':
            return FunctionToolset([check_a])
        return lambda ctx: FunctionToolset([check_a])


CREDENTIAL_URL = 'http://user:s3cret@mcp.example.com:8443/mcp?token=t0ps3cret'
SECRETS = ('s3cret', 't0ps3cret', 'user:', 'user@')


@pytest.fixture
def bad_skills(tmp_path: Path) -> Path:
    directory = tmp_path / 'bad-skills'
    directory.mkdir()
    (directory / 'broken.md').write_text('---\nid: [unclosed\ndescription: x\n---\nBody.\n', encoding='utf-8')
    return directory


# ---- N mistakes, N problems, one error ----------------------------------------------------------------------------


def many_mistakes(bad_skills: Path) -> tuple[list[Any], dict[str, Any]]:
    capabilities: list[Any] = [
        Playbook(description='Play.', defer_loading=True),  # DC001: deferred without id
        Playbook(id='has space'),  # DC002 x5: bad id syntax
        Playbook(id='a__b'),
        Playbook(id='ns:tool'),
        Playbook(id='x' * 101),
        Playbook(id=''),
        Playbook(id='faq'),  # DC003: duplicate capability id
        Playbook(id='faq'),
        Capability(id='left', toolsets=[FunctionToolset([check_a], id='shared')]),  # DC004: duplicate leaf id
        Capability(id='right', toolsets=[FunctionToolset([check_b], id='shared')]),
        MCP(url=CREDENTIAL_URL),  # DC006 (warning): id derived from the URL's host
        Capability(id='billing', tools=[Tool(refund_a, name='refund')]),  # DC007: one tool name, two capabilities
        Capability(id='payments', tools=[Tool(refund_b, name='refund')]),
        Capability(id='loader', tools=[load_capability]),  # DC008: reserved name
        RunbookRequired(requirements={'issue_refund': 'no-such-runbook'}),  # DC009: unknown capability
        Capability(id='refund-policy', description='Policy.', instructions='Max $500.', defer_loading=True),
        RunbookRequired(requirements={'issue_refnd': 'refund-policy'}),  # DC010: unknown tool (typo)
        External(id='external'),  # DC014: a leaf that cannot be given an id
        Capability(tools=[check_c]),  # DC015: non-deferred, leaves, no id
        *load_skills(bad_skills),  # DC016: malformed skill file
    ]
    kwargs = {'tools': [issue_refund], 'engines': ('temporal', 'dbos', 'prefect', 'nomad')}  # DC017: unknown engine
    return capabilities, kwargs


MANY_MISTAKES_EXPECTED = Counter(
    {
        'DC001': 1,
        'DC002': 5,
        'DC003': 1,
        'DC004': 1,
        'DC006': 1,
        'DC007': 1,
        'DC008': 1,
        'DC009': 1,
        'DC010': 1,
        'DC014': 1,
        'DC015': 1,
        'DC016': 1,
        'DC017': 1,
    }
)


def test_n_distinct_mistakes_yield_exactly_n_problems_in_one_error(
    bad_skills: Path, agent_name: Callable[[str], str]
) -> None:
    capabilities, kwargs = many_mistakes(bad_skills)
    with pytest.raises(DurableConfigError) as info:
        DurableAgent(agent_name('many'), 'test', capabilities=capabilities, **kwargs)
    report = seen(info.value.report)

    assert Counter(report.codes()) == MANY_MISTAKES_EXPECTED, report.to_text()
    warnings = {p.code for p in report.warnings}
    # DC010 is a warning here because an MCP server's tools are not known statically.
    assert warnings == {'DC006', 'DC010'}, report.to_text()
    assert len(report.errors) == sum(MANY_MISTAKES_EXPECTED.values()) - 2
    message = str(info.value)
    assert f'has {len(report.errors)} error(s)' in message
    for problem in report.errors:
        assert problem.code in message
    assert all(p.code not in message.split('\n', 1)[0] for p in report.warnings)

    by_code: dict[str, list[Problem]] = {}
    for p in report:
        by_code.setdefault(p.code, []).append(p)
    assert by_code['DC001'][0].where == 'capability without id (Playbook)'
    bad_ids = {'has space', 'a__b', 'ns:tool', 'x' * 101, ''}
    assert {p.where for p in by_code['DC002']} == {f'capability {i!r} (Playbook)' for i in bad_ids}
    reasons = ' '.join(p.message for p in by_code['DC002'])
    for word in ('whitespace', "'__'", "':'", '101 characters', 'empty'):
        assert word in reasons
    assert "'faq'" in by_code['DC003'][0].where and 'Playbook' in by_code['DC003'][0].message
    assert "'shared'" in by_code['DC004'][0].where
    assert "capability 'left' (Capability)" in by_code['DC004'][0].message
    assert "capability 'right' (Capability)" in by_code['DC004'][0].message
    assert by_code['DC006'][0].where == "capability 'mcp.example.com' (MCP)"
    assert "capability 'billing' (Capability)" in by_code['DC007'][0].message
    assert "capability 'payments' (Capability)" in by_code['DC007'][0].message
    assert by_code['DC008'][0].where == "capability 'loader' (Capability)"
    assert 'no-such-runbook' in by_code['DC009'][0].message
    assert 'RunbookRequired' in by_code['DC009'][0].where
    assert 'issue_refnd' in by_code['DC010'][0].message
    assert by_code['DC014'][0].where == "capability 'external' (External)"
    assert 'ExternalToolset' in by_code['DC014'][0].message
    assert by_code['DC015'][0].where == 'capability without id (Capability)'
    assert re.fullmatch(r'.*broken\.md:\d+', by_code['DC016'][0].where)
    assert 'nomad' in by_code['DC017'][0].message


ONE_MISTAKE_CASES = {
    # mistake -> (capabilities, the problems it should yield)
    'deferred-capability-with-tools-without-id': (
        lambda: [Capability(tools=[check_a], description='d', defer_loading=True)],
        {'DC001': 1},
    ),
    'bad-id-on-capability-with-tools': (lambda: [Capability(id='has space', tools=[check_a])], {'DC002': 1}),
    'duplicate-id-on-capabilities-with-tools': (
        lambda: [Capability(id='dup', tools=[check_a]), Capability(id='dup', tools=[check_b])],
        {'DC003': 1},
    ),
    'same-host-mcp-servers': (
        lambda: [MCP(url='http://mcp.internal:8001/mcp'), MCP(url='http://mcp.internal:8002/mcp')],
        {'DC005': 1, 'DC006': 2},
    ),
}


@pytest.mark.parametrize(
    'case',
    [
        'deferred-capability-with-tools-without-id',
        'bad-id-on-capability-with-tools',
        'duplicate-id-on-capabilities-with-tools',
        pytest.param(
            'same-host-mcp-servers',
        ),
    ],
)
def test_one_mistake_yields_one_problem(case: str, agent_name: Callable[[str], str]) -> None:
    """A mistake that also breaks a derived id (leaf id copied from the capability id) is still one problem."""
    make, expected = ONE_MISTAKE_CASES[case]
    report = problems_of(agent_name(case), make())
    assert Counter(report.codes()) == Counter(expected), report.to_text()


# ---- URL-derived ids against upstream's own derivation ------------------------------------------------------------

MCP_PAIRS = {
    'same-host-other-port': ('http://mcp.internal:8001/mcp', 'http://mcp.internal:8002/mcp'),
    'same-host-other-path': ('http://mcp.internal/tickets', 'http://mcp.internal/orders'),
    'other-host': ('http://alpha.internal/mcp', 'http://beta.internal/mcp'),
    'same-url-twice': ('http://mcp.internal/mcp', 'http://mcp.internal/mcp'),
    'same-url-rotated-credential': ('http://u:old@mcp.internal/mcp', 'http://u:new@mcp.internal/mcp'),
}


def _upstream_accepts(urls: tuple[str, str]) -> bool:
    try:
        Agent('test', capabilities=[MCP(url=urls[0]), MCP(url=urls[1])])
    except UserError:
        return False
    return True


@pytest.mark.parametrize('pair', list(MCP_PAIRS))
def test_url_derived_collisions_error_exactly_when_upstream_rejects(pair: str, agent_name: Callable[[str], str]) -> None:
    urls = MCP_PAIRS[pair]
    report = problems_of(agent_name(pair), [MCP(url=urls[0]), MCP(url=urls[1])])
    assert report.ok == _upstream_accepts(urls), report.to_text()
    assert report.codes().count('DC006') == 2  # both ids embed a host


def test_url_derived_collision_examples_match_upstream() -> None:
    """Documents upstream 2.68's derivation (hostname only): if it changes, DC005's wording must too."""
    assert not _upstream_accepts(MCP_PAIRS['same-host-other-port'])
    assert not _upstream_accepts(MCP_PAIRS['same-host-other-path'])
    assert _upstream_accepts(MCP_PAIRS['other-host'])
    assert MCP(url='http://user:pw@mcp.internal:8001/mcp').id == 'mcp.internal'


@pytest.mark.parametrize(
    'pair',
    [
        'same-host-other-port',
        'same-host-other-path',
        'other-host',
        pytest.param(
            'same-url-twice',
        ),
        pytest.param(
            'same-url-rotated-credential',
        ),
    ],
)
def test_dc005_fires_exactly_when_upstream_rejects_a_derived_collision(
    pair: str, agent_name: Callable[[str], str]
) -> None:
    urls = MCP_PAIRS[pair]
    report = problems_of(agent_name(pair), [MCP(url=urls[0]), MCP(url=urls[1])])
    assert ('DC005' in report.codes()) == (not _upstream_accepts(urls)), report.to_text()
    if 'DC005' in report.codes():
        dc005 = next(p for p in report if p.code == 'DC005')
        assert dc005.where == "capability 'mcp.internal' (MCP)"
        assert dc005.severity == 'error'


def test_dc006_warns_but_does_not_block(agent_name: Callable[[str], str]) -> None:
    definition = DurableAgent(agent_name('mcp'), 'test', capabilities=[MCP(url='https://tools.example.com/mcp')])
    report = seen(definition.report())
    assert report.ok
    [warning] = report.problems
    assert (warning.code, warning.severity) == ('DC006', 'warning')
    assert warning.where == "capability 'tools.example.com' (MCP)"
    assert 'host' in warning.message and 'id=' in warning.fix
    assert definition.leaf_ids() == {'tools.example.com': ['tools.example.com']}
    # An explicit id silences it.
    explicit = DurableAgent(agent_name('mcp'), 'test', capabilities=[MCP(url='https://tools.example.com/mcp', id='tools')])
    assert seen(explicit.report()).problems == []


def test_credentials_never_appear_in_problems(agent_name: Callable[[str], str]) -> None:
    other_port = CREDENTIAL_URL.replace(':8443', ':9443')
    definitions = [
        [MCP(url=CREDENTIAL_URL, description='d', defer_loading=True)],  # DC001, naming what it would derive
        [MCP(url=CREDENTIAL_URL), MCP(url=other_port)],  # DC005 + DC006
        [MCP(url=CREDENTIAL_URL, id='bad id')],  # DC002
        [MCP(url=CREDENTIAL_URL)],  # DC006
    ]
    codes: set[str] = set()
    for capabilities in definitions:
        try:
            definition = DurableAgent(agent_name('creds'), 'test', capabilities=capabilities)
            report, text = definition.report(), ''
        except DurableConfigError as exc:
            report, text = exc.report, str(exc)
        seen(report)
        codes.update(report.codes())
        rendered = [text, report.to_text(), report.to_json(), report.to_github(), repr(report)]
        rendered += [field for p in report for field in (p.where, p.message, p.fix)]
        for secret in SECRETS:
            assert not any(secret in r for r in rendered), (secret, report.to_text())
    assert {'DC001', 'DC002', 'DC005', 'DC006'} <= codes
    assert 'mcp.example.com' in ''.join(p.message for p in problems_of(agent_name('c'), definitions[0]))


# ---- tools and runbooks ---------------------------------------------------------------------------------------------


def test_tool_name_in_two_capabilities_dc007(agent_name: Callable[[str], str]) -> None:
    report = problems_of(
        agent_name('dup-tool'),
        [Capability(id='billing', tools=[Tool(refund_a, name='refund')])],
        tools=[Tool(refund_b, name='refund')],
    )
    [problem] = report.problems
    assert problem.code == 'DC007' and problem.where == "tool 'refund'"
    assert "capability 'billing' (Capability)" in problem.message and 'tools' in problem.message


def test_reserved_tool_name_dc008_also_for_agent_tools(agent_name: Callable[[str], str]) -> None:
    report = problems_of(agent_name('reserved'), [], tools=[load_capability])
    assert report.codes() == ['DC008']
    assert 'load_capability' in report.problems[0].message


def test_runbook_unknown_capability_dc009_and_tool_dc010(agent_name: Callable[[str], str]) -> None:
    policy = Capability(id='refund-policy', description='Policy.', instructions='Max $500.', defer_loading=True)
    good = problems_of(
        agent_name('ok'), [policy, RunbookRequired(requirements={'issue_refund': 'refund-policy'})], tools=[issue_refund]
    )
    assert good.problems == []

    report = problems_of(
        agent_name('bad'),
        [policy, RunbookRequired(requirements={'issue_refund': 'refund-polcy', 'issue_refnd': 'refund-policy'})],
        tools=[issue_refund],
    )
    assert sorted(report.codes()) == ['DC009', 'DC010']
    dc009 = next(p for p in report if p.code == 'DC009')
    dc010 = next(p for p in report if p.code == 'DC010')
    assert "'refund-polcy'" in dc009.message and 'refund-policy' in dc009.fix  # says which ids exist
    assert dc010.severity == 'error'  # every tool is known statically here
    assert "'issue_refnd'" in dc010.message


def test_runbook_seed_copy_is_recognized(agent_name: Callable[[str], str]) -> None:
    """The seed pastes its own `RunbookRequired` class into user code; it is validated the same way."""

    @dataclass
    class RunbookRequired(AbstractCapability[Any]):
        requirements: dict[str, str] | None = None

    report = problems_of(agent_name('seed'), [RunbookRequired(requirements={'issue_refund': 'refund-policy'})])
    assert 'DC009' in report.codes() and 'DC010' in report.codes()


# ---- several definitions, per-run capabilities ----------------------------------------------------------------------


def test_duplicate_agent_names_dc011(agent_name: Callable[[str], str]) -> None:
    name = agent_name('support')
    first = DurableAgent(name, 'test', capabilities=[MCP(url='http://a.internal/mcp')])
    second = DurableAgent(name, 'test')
    third = DurableAgent(agent_name('billing'), 'test')

    report = seen(validate_together([first, second, third]))
    assert report.codes().count('DC011') == 1
    assert 'DC006' in report.codes()  # each member's own problems are included
    dc011 = next(p for p in report if p.code == 'DC011')
    assert dc011.severity == 'error' and repr(name) in dc011.where
    assert not report.ok
    assert 'DC011' not in seen(validate_together([first, third])).codes()


def test_per_run_capabilities_dc012_name_the_ids(agent_name: Callable[[str], str]) -> None:
    definition = DurableAgent(
        agent_name('run'), 'test', capabilities=[Capability(id='orders', instructions='x', description='d', defer_loading=True)]
    )
    definition.check_run_capabilities(None)
    definition.check_run_capabilities([])

    with pytest.raises(DurableConfigError) as info:
        definition.check_run_capabilities([Capability(id='extra-tools'), Capability()])
    [problem] = seen(info.value.report).problems
    assert problem.code == 'DC012' and problem.severity == 'error'
    assert "'extra-tools'" in problem.message and 'Capability' in problem.message
    assert 'construction' in problem.fix

    with pytest.raises(DurableConfigError) as info:
        asyncio.run(definition.run('hello', capabilities=[Capability(id='late-addition')]))
    assert seen(info.value.report).codes() == ['DC012']
    assert "'late-addition'" in str(info.value)


# ---- the remaining codes ----------------------------------------------------------------------------------------------


def test_positional_leaf_ids_dc013(agent_name: Callable[[str], str]) -> None:
    report = problems_of(agent_name('pair'), [ObjectPair(id='pair')])
    assert report.ok and report.codes() == ['DC013', 'DC013']
    assert all(p.where == "capability 'pair' (ObjectPair)" for p in report)


def test_uncopyable_leaf_dc014_is_fixed_by_an_explicit_id(agent_name: Callable[[str], str]) -> None:
    assert problems_of(agent_name('ext'), [External(id='ext')]).codes() == ['DC014']

    @dataclass
    class ExternalWithId(AbstractCapability[Any]):
        def get_toolset(self) -> Any:
            return ExternalToolset([], id='ext-tools')

    definition = DurableAgent(agent_name('ext'), 'test', capabilities=[ExternalWithId(id='ext')])
    assert definition.leaf_ids() == {'ext': ['ext-tools']}
    definition.build('temporal')


def test_leaves_without_any_id_dc015(agent_name: Callable[[str], str]) -> None:
    report = problems_of(agent_name('noid'), [Capability(tools=[check_a])])
    assert report.codes() == ['DC015']
    assert 'id=' in report.problems[0].fix


def test_malformed_skill_dc016_and_unknown_engine_dc017(bad_skills: Path, agent_name: Callable[[str], str]) -> None:
    report = problems_of(agent_name('skills'), load_skills(bad_skills), engines=('temporal', 'mars'))
    assert sorted(report.codes()) == ['DC016', 'DC017']


def test_agent_name_is_an_id_too(agent_name: Callable[[str], str]) -> None:
    report = problems_of('support agent', [])
    assert report.codes() == ['DC002']
    assert 'agent name' in report.problems[0].message


# ---- Problem and Report -----------------------------------------------------------------------------------------------

CAPABILITY_WHERE = re.compile(r"capability ('(?:[^']|\\')*'|without id) \((\w+)\)")


def test_every_problem_is_complete(bad_skills: Path, agent_name: Callable[[str], str]) -> None:
    capabilities, kwargs = many_mistakes(bad_skills)
    report = problems_of(agent_name('many'), capabilities, **kwargs)
    report.extend(problems_of(agent_name('pair'), [ObjectPair(id='pair')]))
    report.extend(problems_of(agent_name('mcp'), [MCP(url='http://h.internal:1/a'), MCP(url='http://h.internal:2/a')]))
    assert len(report) > 20
    for problem in report:
        assert problem.code in CODES
        assert problem.severity in ('error', 'warning', 'info')
        for field in (problem.where, problem.message, problem.fix):
            assert isinstance(field, str) and field.strip(), problem
        assert set(problem.engines) <= {'temporal', 'dbos', 'prefect'}
        text = f'{problem.where} {problem.message}'
        if problem.code in ('DC001', 'DC002', 'DC006', 'DC008', 'DC009', 'DC010', 'DC013', 'DC014', 'DC015', 'DC005'):
            if problem.where.startswith('agent '):
                continue  # DC002/DC008 about the agent itself
            assert CAPABILITY_WHERE.fullmatch(problem.where), problem
        elif problem.code in ('DC003', 'DC004', 'DC007'):
            assert CAPABILITY_WHERE.search(text) or re.search(r"'[^']*'.*\((\w+)", text), problem
        assert problem.format().startswith(f'{problem.severity} {problem.code} {problem.where}')


def test_report_never_raises_and_is_a_copy(agent_name: Callable[[str], str]) -> None:
    definition = DurableAgent(agent_name('fine'), 'test', capabilities=[ObjectPair(id='pair')])
    first = definition.report()
    first.add(Problem('DC001', 'error', 'x', 'y', 'z'))
    assert definition.report().codes() == ['DC013', 'DC013']
    definition.build('local')
    assert definition.report().ok
    assert Report().to_text() == 'no problems found'
    assert json.loads(Report().to_json()) == {'ok': True, 'errors': 0, 'warnings': 0, 'problems': []}


def test_a_capability_that_raises_becomes_a_problem(agent_name: Callable[[str], str]) -> None:
    with pytest.raises(DurableConfigError) as info:
        DurableAgent(agent_name('boom'), 'test', capabilities=[Exploding(id='boom')])
    SEEN_CODES.update(info.value.report.codes())
    assert [p.code for p in info.value.report if "'boom'" in p.where] == ['DC023']


def test_a_deferred_capability_building_new_leaves_per_call_is_dc024(agent_name: Callable[[str], str]) -> None:
    """Durable engines run only the leaf objects they wrapped at build time; the model's load fetches the toolset
    again. A new `FunctionToolset` fails on Temporal and Prefect (DBOS runs function tools inline), a new toolset
    function on every engine. Toolset functions in `Capability(toolsets=[...])` and not-deferred capabilities pass."""
    for kind, engines in (('function', ('temporal', 'prefect')), ('closure', tuple(DURABLE_ENGINES))):
        capability = FreshToolsets(id=f'fresh-{kind}', description='Fresh.', defer_loading=True, kind=kind)
        with pytest.raises(DurableConfigError) as info:
            DurableAgent(agent_name(kind), 'test', capabilities=[capability])
        SEEN_CODES.update(info.value.report.codes())
        [found] = info.value.report.problems
        assert found.code == 'DC024' and found.where == f"capability 'fresh-{kind}' (FreshToolsets)"
        assert found.engines == engines and '`get_toolset()`' in found.message and '__init__' in found.fix
    assert DurableAgent(agent_name('local'), 'test', engines=('local',), capabilities=[
        FreshToolsets(id='fresh', description='Fresh.', defer_loading=True, kind='closure')]).report().ok
    assert DurableAgent(agent_name('eager'), 'test', capabilities=[FreshToolsets(id='eager', kind='closure')]).report().ok

    def lookup_tools(ctx: Any) -> FunctionToolset[Any]:
        return FunctionToolset([check_a])

    deferred = Capability(id='lookups', description='Lookups.', toolsets=[lookup_tools], defer_loading=True)
    assert DurableAgent(agent_name('callables'), 'test', capabilities=[deferred]).report().ok


def test_report_formats(bad_skills: Path, agent_name: Callable[[str], str]) -> None:
    capabilities, kwargs = many_mistakes(bad_skills)
    report = problems_of(agent_name('many'), capabilities, **kwargs)

    data = json.loads(report.to_json())
    assert data['ok'] is False
    assert data['errors'] == len(report.errors) and data['warnings'] == len(report.warnings)
    assert [p['code'] for p in data['problems']] == report.codes()
    assert set(data['problems'][0]) == {'code', 'severity', 'where', 'message', 'fix', 'engines'}

    lines = report.to_github().splitlines()
    assert len(lines) == len(report)
    assert sum(line.startswith('::error ') for line in lines) == len(report.errors)
    assert sum(line.startswith('::warning ') for line in lines) == len(report.warnings)
    for line, problem in zip(lines, report, strict=True):
        assert f'title={problem.code}::' in line
    skill_line = next(line for line, p in zip(lines, report, strict=True) if p.code == 'DC016')
    assert re.match(r'::error file=.*broken\.md,line=\d+,title=DC016::', skill_line)

    assert len(report.to_text().splitlines()) == len(report)

    tricky = Report([Problem('DC002', 'error', "capability 'a' (X)", 'line one\nline two 100%', 'fix\r\nit')])
    [line] = tricky.to_github().splitlines()
    assert '%0A' in line and '%25' in line and '%0D' in line


def test_lockfile_diff_codes_dc020_dc021_dc022(agent_name: Callable[[str], str]) -> None:
    """The lockfile's own checks report through the same `Report` (engines limited to Temporal: no global registry)."""
    from durable_capabilities.lockfile import diff_lock, lock_data

    name, gone = agent_name('locked'), agent_name('gone')

    def orders(cap_id: str) -> Capability[Any]:
        return Capability(id=cap_id, description='Orders.', tools=[check_a], defer_loading=True)

    before = DurableAgent(name, 'test', capabilities=[orders('orders')], engines=('temporal',))
    locked = lock_data([before, DurableAgent(gone, 'test', engines=('temporal',))])
    assert seen(diff_lock(locked, [before, DurableAgent(gone, 'test', engines=('temporal',))])).problems == []

    after = DurableAgent(name, 'test', capabilities=[orders('orders-v2')], engines=('temporal',))
    report = seen(diff_lock(locked, [after]))
    codes = set(report.codes())
    assert {'DC020', 'DC021', 'DC022'} <= codes, report.to_text()
    dc020 = next(p for p in report if p.code == 'DC020')
    assert "'orders'" in dc020.where and dc020.severity == 'error'
    assert any(p.code == 'DC021' and repr(gone) in p.where for p in report)
    assert all(p.severity == 'info' for p in report if p.code == 'DC022')


def test_lockfile_diff_scoped_to_one_engine_compares_only_its_names(agent_name: Callable[[str], str]) -> None:
    """`diff_lock(..., engines=('dbos',))` (what `durcap run --engine dbos` and a DBOS worker run): a rename is still
    DC020, naming DBOS's steps only; the Temporal section of the same lock is neither computed nor reported."""
    from durable_capabilities.lockfile import diff_lock, lock_data

    name = agent_name('scoped')

    def orders(cap_id: str) -> Capability[Any]:
        return Capability(id=cap_id, description='Orders.', tools=[check_a], defer_loading=True)

    before = DurableAgent(name, 'test', capabilities=[orders('orders')], engines=('temporal', 'dbos'))
    locked = lock_data([before])
    assert set(locked['agents'][name]) >= {'temporal', 'dbos'}
    assert set(lock_data([before], ('dbos',))['agents'][name]) & {'temporal', 'dbos'} == {'dbos'}
    after = DurableAgent(name, 'test', capabilities=[orders('orders-v2')], engines=('temporal', 'dbos'))
    everything = seen(diff_lock(locked, [after]))
    assert {p.engines for p in everything if p.code == 'DC020'} == {('temporal', 'dbos')}, everything.to_text()
    scoped = seen(diff_lock(locked, [after], ('dbos',)))
    [dc020] = [p for p in scoped if p.code == 'DC020']
    assert dc020.engines == ('dbos',) and "'orders'" in dc020.where
    assert 'dbos: step' in dc020.message and 'temporal' not in dc020.message
    assert all(p.engines in ((), ('dbos',)) for p in scoped), scoped.to_text()
    assert seen(diff_lock(locked, [before], ('dbos',))).problems == []


def test_lockfile_diff_a_name_moved_to_another_section_of_its_engine_is_no_drift(agent_name: Callable[[str], str]) -> None:
    """Prefect's conversation tasks moved from `tasks` to `recovered_tasks` (issue 24: the flow's own code loads and
    appends; a resumed flow run recorded before still reads the tasks' records): a lock written before the move is
    satisfied (no DC020, no DC022, so workers start), and a name gone from every section is still DC020."""
    from durable_capabilities.lockfile import diff_lock, lock_data

    name = agent_name('moved')
    orders = Capability(id='orders', description='Orders.', tools=[check_a], defer_loading=True)
    agent = DurableAgent(name, 'test', capabilities=[orders], engines=('prefect',))
    locked = lock_data([agent])
    section = locked['agents'][name]['prefect']
    assert section['recovered_tasks'] == ['Append Conversation', 'Load Conversation']
    assert not set(section['tasks']) & set(section['recovered_tasks']), section
    section['tasks'] = sorted([*section['tasks'], *section.pop('recovered_tasks')])  # as earlier versions wrote it
    assert seen(diff_lock(locked, [agent])).problems == []
    section['tasks'].append('Gone Task')
    report = seen(diff_lock(locked, [agent]))
    [dc020] = [p for p in report if p.code == 'DC020']
    assert "'Gone Task'" in dc020.message and 'Conversation' not in dc020.message, dc020.message
    assert [p.code for p in report] == ['DC020'], report.to_text()


# ---- must stay last -------------------------------------------------------------------------------------------------


def test_zz_every_code_is_exercised(request: pytest.FixtureRequest) -> None:
    module_tests = {item.name.split('[')[0] for item in request.session.items if item.module is request.module}
    defined = {name for name in globals() if name.startswith('test_')}
    if module_tests != defined:
        pytest.skip('only meaningful when the whole module runs')
    unreachable = set(CODES) - codes_with_a_producer()  # declared, but no module ever writes them
    assert unreachable <= {'DC018', 'DC019'}, f'codes nothing produces: {sorted(unreachable)}'
    elsewhere = {'DC018', 'DC019'}  # history drift: produced by history.py, exercised in tests/unit/test_store.py
    # Temporal payload limits: produced by engines/temporal/_payloads.py, exercised in tests/engines/test_payload_sizes.py and
    # by the examples of docs/errors.md (tests/unit/test_docs.py).
    elsewhere |= {'DC030', 'DC031'}
    # Unusable input (lockfiles, histories, JSON options, URLs): produced by _limits, lockfile, replay and the CLI,
    # exercised in tests/unit/test_bad_inputs.py and by the examples of docs/errors.md.
    elsewhere |= {'DC040'}
    # A busy conversation and edited approval arguments: produced by conversations.py and approvals.py, exercised in
    # tests/unit/test_turn_claims.py, tests/engines/test_turn_claims.py and by the examples of docs/errors.md.
    elsewhere |= {'DC050', 'DC051'}
    # A decision no worker took (Temporal): produced by approvals.py and engines/temporal/_runs.py, exercised in
    # tests/engines/test_approvals.py and by the examples of docs/errors.md.
    elsewhere |= {'DC052'}
    # `busy='interrupt'` for an agent whose output is not text: produced by agent.py and conversations.py, exercised in
    # tests/unit/test_turn_claims.py and by the examples of docs/errors.md.
    elsewhere |= {'DC053'}
    # A second decision on a decided call: produced by approvals.py (every engine, serve), exercised in
    # tests/unit/test_approvals_core.py, tests/engines/test_approvals.py and by the examples of docs/errors.md.
    elsewhere |= {'DC054'}
    # A decision whose fingerprint names other arguments than the call's: produced by approvals.py, exercised in
    # tests/engines/test_serve.py (the table of bad requests) and by the examples of docs/errors.md.
    elsewhere |= {'DC055'}
    # Refused HTTP requests of `durcap serve`: produced by serve/, exercised in tests/engines/test_serve.py (the table of
    # bad requests) and by the examples of docs/errors.md.
    elsewhere |= {'DC041', 'DC042', 'DC043', 'DC044', 'DC045'}
    # A spent budget: produced by budget.py, exercised in tests/unit/test_budgets.py, tests/engines/test_budgets.py and
    # by the examples of docs/errors.md.
    elsewhere |= {'DC060'}
    # A turn that made its request limit across approval rounds: produced by turn.py, exercised in
    # tests/unit/test_error_codes.py (a local `durcap run`) and by the examples of docs/errors.md.
    elsewhere |= {'DC061'}
    # pydantic-evals missing for `durcap history evals`: produced by evals.py, exercised in tests/unit/test_evals.py and by
    # the examples of docs/errors.md.
    elsewhere |= {'DC070'}
    missing = set(CODES) - SEEN_CODES - unreachable - elsewhere
    assert not missing, f'codes no test produced: {sorted(missing)}'
