"""The checks of a definition: one function per code, in one registry, over one shared context.

`DurableAgent` builds one `CheckContext` (its name, engines, tools, malformed skills and the `Stabilized`
result, whose toolset walk every check shares) and `run_checks` runs every function of `CHECKS` on it.
Message and fix wording lives in `validation.CODES`; a check only decides what is wrong and fills it in.

A check yields `Finding(stage, at, problem)`. The report lists problems by `Stage` (which part of the
definition they are about, in the order below), then by `at` (the position of that part in the
definition), then by code: the order `durcap check` has always printed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from functools import cached_property
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from pydantic_ai.capabilities import MCP, AbstractCapability, Capability
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset

from . import _upstream
from .ids import (
    CapabilityWalk,
    PlanIssue,
    PlannedCapability,
    Stabilized,
    collect_leaves,
    id_syntax_error,
    redact_url,
)
from .runbook import runbook_requirements
from .validation import CODES, Problem, Report, describe_capability, problem

if TYPE_CHECKING:
    from .skills import InvalidSkill


class Stage(IntEnum):
    """Where a problem sits in a report; problems of one stage are ordered by position, then code."""

    ENGINES = 0  # DC017, per listed engine
    AGENT_NAME = 1  # DC002 of the agent name
    SKILLS = 2  # DC016, per malformed skill file
    LEAF_PLANS = 3  # DC023, DC013, DC014, DC015, DC024: per wrapped capability, then per leaf
    CAPABILITIES = 4  # DC001, DC002, DC006: per registered capability
    URL_IDS = 5  # DC005, per URL-derived id
    CAPABILITY_IDS = 6  # DC003, per explicit capability id
    LEAF_IDS = 7  # DC002 of leaf ids, per leaf
    SHARED_LEAVES = 8  # DC004, per leaf id
    RESERVED_TOOL = 9  # DC008
    SHARED_TOOLS = 10  # DC007, per tool name
    RUNBOOKS = 11  # DC009, DC010: per runbook capability, then per requirement


class Finding(NamedTuple):
    """A problem and where it goes in the report (`stage`, then `at`: positions, outermost first)."""

    stage: Stage
    at: tuple[int, ...]
    problem: Problem


class EngineSpecInfo(Protocol):
    """What the checks read of an engine's spec (`engines.EngineSpec`, DC024)."""

    def rejected_at_run_time(self) -> frozenset[str]: ...


class EngineInfo(Protocol):
    """What the checks read of an engine's registry entry (DC017, DC024)."""

    @property
    def extra(self) -> str | None: ...

    @property
    def spec(self) -> EngineSpecInfo: ...

    def available(self) -> bool: ...


@dataclass
class ToolIndex:
    """Tool names of a definition, from the shared walk.

    Attributes:
        first: `{tool name: the capability walk that defines it first}`; `None` for the agent's own tools.
        shared: `{tool name: labels of every capability (or the agent) defining it}` for names defined
            by more than one capability object.
        all_static: False when some capability's tools are only known at run time (MCP, dynamic toolsets).
    """

    first: dict[str, CapabilityWalk | None]
    shared: dict[str, list[str]]
    all_static: bool


@dataclass
class CapabilityIds:
    """Registered capability ids, grouped.

    Attributes:
        explicit: `{id: capabilities registered under it}` for ids not derived from an MCP URL, in order.
        url_derived: `{id: MCP capabilities deriving it from their URL}`, in order.
        url_derived_at: `(position among registered capabilities, id, MCP capability)` of each URL-derived id.
    """

    explicit: dict[str, list[AbstractCapability[Any]]]
    url_derived: dict[str, list[MCP]]
    url_derived_at: list[tuple[int, str, MCP]]


@dataclass
class CheckContext:
    """What every check reads: the definition and what was computed from it once (shared, cached).

    Attributes:
        name: The agent name.
        engines: The engines the definition must be valid for (as given, unknown ones included).
        known_engines: The engine registry, `{name: entry}` (`'local'` included); passed in so that the
            checks, part of the core, do not import the engines.
        durable_engines: The names of the durable engines, in the order problems list them.
        agent_tools: The agent-level tools (functions or `Tool`s).
        invalid_skills: Placeholders of malformed skill files (DC016).
        stabilized: The wrapped capabilities, one toolset walk per registered capability and the planned leaf ids.
    """

    name: str
    engines: tuple[str, ...]
    known_engines: Mapping[str, EngineInfo]
    durable_engines: tuple[str, ...]
    agent_tools: Sequence[Any]
    invalid_skills: Sequence[InvalidSkill]
    stabilized: Stabilized

    @property
    def registered(self) -> list[CapabilityWalk]:
        return self.stabilized.registered

    @property
    def planned(self) -> list[PlannedCapability]:
        return self.stabilized.planned

    @cached_property
    def durable(self) -> tuple[str, ...]:
        """The durable engines among `engines`: the scope of every problem but DC016 and DC017."""
        return tuple(e for e in self.engines if e in self.durable_engines)

    def problem(self, code: str, where: str, variant: str = '', **fields: Any) -> Problem:
        """`validation.problem(...)` scoped to the durable engines."""
        return problem(code, where, self.durable, variant, **fields)

    @cached_property
    def capability_ids(self) -> set[str]:
        return {walk.cap_id for walk in self.registered if walk.cap_id is not None}

    @cached_property
    def ids(self) -> CapabilityIds:
        """Registered capability ids, grouped in one pass."""
        ids = CapabilityIds(defaultdict(list), defaultdict(list), [])
        for index, walk in enumerate(self.registered):
            if walk.cap_id is None:
                continue
            if (mcp := _url_derived(walk)) is None:
                ids.explicit[walk.cap_id].append(walk.user)
            else:
                ids.url_derived[walk.cap_id].append(mcp)
                ids.url_derived_at.append((index, walk.cap_id, mcp))
        return ids

    @cached_property
    def duplicated_ids(self) -> set[str]:
        """Explicit ids shared by distinct capability objects (DC003)."""
        return {cap_id for cap_id, users in self.ids.explicit.items() if len(users) > 1 and len(_distinct(users)) > 1}

    @cached_property
    def colliding_url_ids(self) -> set[str]:
        """URL-derived ids shared by two MCP capabilities or with an explicit id (DC005)."""
        ids = self.ids
        return {cap_id for cap_id, users in ids.url_derived.items() if len(users) > 1 or cap_id in ids.explicit}

    @cached_property
    def plan_issues(self) -> list[tuple[tuple[int, ...], PlannedCapability, PlanIssue]]:
        """`(position, planned capability, issue)` of every leaf id plan issue (DC013, DC014, DC015), in order."""
        return [
            ((index, 1, number), planned, issue)
            for index, planned in enumerate(self.planned)
            for number, issue in enumerate(planned.issues)
        ]

    @cached_property
    def deferred_without_id(self) -> set[str]:
        """How deferred capabilities without an id are described (their DC015 repeats their DC001)."""
        return {describe_capability(w.user, None) for w in self.registered if w.user.defer_loading and w.cap_id is None}

    @cached_property
    def tools(self) -> ToolIndex:
        """Who defines each tool name; lists stay short (a list only for names defined twice)."""
        first: dict[str, CapabilityWalk | None] = dict.fromkeys(FunctionToolset(list(self.agent_tools)).tools)
        shared: dict[str, list[str]] = {}
        all_static = True
        for walk in self.registered:
            if walk.toolset is None:
                continue
            names = walk.tool_names
            if names is None:
                all_static = False
                continue
            for tool in names:
                seen = first.setdefault(tool, walk)
                if seen is not walk and (seen is None or seen.user is not walk.user):
                    label = describe_capability(walk.user, walk.cap_id)
                    shown = shared.setdefault(tool, [self.owner_label(seen)])
                    if label not in shown:
                        shown.append(label)
        return ToolIndex(first, shared, all_static)

    def owner_label(self, walk: CapabilityWalk | None) -> str:
        """`"capability 'x' (Cls)"`, or `"agent 'name' tools"` for the agent's own tools (`None`)."""
        return f'agent {self.name!r} tools' if walk is None else describe_capability(walk.user, walk.cap_id)

    @cached_property
    def runbooks(self) -> list[tuple[int, CapabilityWalk, list[tuple[str, str]]]]:
        """`(position, walk, sorted (tool, required capability) pairs)` of every capability with requirements."""
        found = []
        for index, walk in enumerate(self.registered):
            requirements = runbook_requirements(walk.user)
            if requirements is not None:
                found.append((index, walk, sorted(requirements.items())))
        return found


Check = Callable[[CheckContext], Iterable[Finding]]

CHECKS: dict[str, Check] = {}
"""`{code: the function that finds its problems}`, for every code a definition is checked for at construction."""


def check(code: str) -> Callable[[Check], Check]:
    """Register the decorated function as the check for `code` (one function per code)."""

    def register(function: Check) -> Check:
        assert code in CODES and code not in CHECKS, code
        CHECKS[code] = function
        return function

    return register


def run_checks(context: CheckContext) -> Report:
    """Every problem of every registered check, in report order (see `Stage`). Never raises for a bad definition."""
    findings = [finding for function in CHECKS.values() for finding in function(context)]
    findings.sort(key=lambda finding: (finding.stage, finding.at, finding.problem.code))
    return Report([finding.problem for finding in findings])


def _url_derived(walk: CapabilityWalk) -> MCP | None:
    """The MCP capability of `walk` when its id is derived from its URL, else `None`."""
    user = walk.user
    return user if isinstance(user, MCP) and _upstream.derived_id_source(user) is not None else None


def _distinct(users: list[AbstractCapability[Any]]) -> list[AbstractCapability[Any]]:
    return list({id(u): u for u in users}.values())


def _where(planned: PlannedCapability) -> str:
    return describe_capability(planned.stable.wrapped, planned.stable.scope)


# ---- the definition -------------------------------------------------------------------------------------------------


@check('DC017')
def engine_not_available(ctx: CheckContext) -> Iterator[Finding]:
    where = f'agent {ctx.name!r}'
    for index, engine in enumerate(ctx.engines):
        spec = ctx.known_engines.get(engine)
        if spec is None:
            found = problem('DC017', where, (), 'unknown', engine=engine, known=', '.join(ctx.durable_engines))
        elif engine != 'local' and not spec.available():
            found = problem('DC017', where, (engine,), 'missing', engine=engine, extra=spec.extra)
        else:
            continue
        yield Finding(Stage.ENGINES, (index,), found)


@check('DC016')
def malformed_skill(ctx: CheckContext) -> Iterator[Finding]:
    for index, skill in enumerate(ctx.invalid_skills):
        yield Finding(Stage.SKILLS, (index,), skill.problem)


@check('DC002')
def unsafe_id(ctx: CheckContext) -> Iterator[Finding]:
    if (reason := id_syntax_error(ctx.name)) is not None:
        yield Finding(Stage.AGENT_NAME, (), ctx.problem('DC002', f'agent {ctx.name!r}', 'agent', reason=reason))
    for index, walk in enumerate(ctx.registered):
        if walk.cap_id is not None and (reason := id_syntax_error(walk.cap_id)) is not None:
            where = describe_capability(walk.user, walk.cap_id)
            yield Finding(
                Stage.CAPABILITIES, (index,), ctx.problem('DC002', where, 'capability', cap_id=walk.cap_id, reason=reason)
            )
    for index, planned in enumerate(ctx.planned):
        for number, plan in enumerate(planned.plans):
            # A leaf named after its capability repeats the capability id's DC002; report it once.
            if plan.toolset_id != planned.owner and (reason := id_syntax_error(plan.toolset_id)) is not None:
                where = describe_capability(planned.stable.wrapped, planned.owner)
                found = ctx.problem('DC002', where, 'leaf', toolset_id=plan.toolset_id, kind=plan.kind, reason=reason)
                yield Finding(Stage.LEAF_IDS, (index, number), found)


# ---- leaf id plans: per wrapped capability, then per leaf ------------------------------------------------------------


@check('DC023')
def get_toolset_raised(ctx: CheckContext) -> Iterator[Finding]:
    for index, planned in enumerate(ctx.planned):
        if (error := planned.walk.error) is not None:
            found = ctx.problem('DC023', _where(planned), error_type=type(error).__name__, error=error)
            yield Finding(Stage.LEAF_PLANS, (index, 0, 0), found)


@check('DC013')
def positional_leaf_id(ctx: CheckContext) -> Iterator[Finding]:
    for index, planned in enumerate(ctx.planned):
        user, scope = planned.stable.wrapped, planned.stable.scope
        if planned.positional and planned.plans:
            found = ctx.problem('DC013', _where(planned), 'group', cls=type(user).__name__, scope=scope)
            yield Finding(Stage.LEAF_PLANS, (index, 0, 0), found)
        if planned.walk.toolset is not None and _numbers_functions(user):
            yield Finding(Stage.LEAF_PLANS, (index, 2, 0), ctx.problem('DC013', _where(planned), 'callables', scope=scope))
    for at, planned, issue in ctx.plan_issues:
        if issue.code == 'DC013':
            fields = {'kind': issue.kind, 'position': issue.position, 'toolset_id': issue.toolset_id}
            yield Finding(Stage.LEAF_PLANS, at, ctx.problem('DC013', _where(planned), 'leaf', **fields))


def _numbers_functions(user: AbstractCapability[Any]) -> bool:
    """Whether pydantic-ai numbers toolset functions of `user` by position (only under a capability with its own id)."""
    return (
        isinstance(user, Capability)
        and bool(user.id)
        and len(user.toolsets) > 1
        and any(not isinstance(t, AbstractToolset) for t in user.toolsets)
    )


@check('DC014')
def uncopyable_leaf(ctx: CheckContext) -> Iterator[Finding]:
    for at, planned, issue in ctx.plan_issues:
        if issue.code == 'DC014':
            yield Finding(Stage.LEAF_PLANS, at, ctx.problem('DC014', _where(planned), kind=issue.kind))


@check('DC015')
def leaf_without_scope(ctx: CheckContext) -> Iterator[Finding]:
    for at, planned, issue in ctx.plan_issues:
        # A deferred capability without an id gets DC001; its DC015 (no id for its leaves) is the same fix.
        if issue.code == 'DC015' and (where := _where(planned)) not in ctx.deferred_without_id:
            found = ctx.problem('DC015', where, kind=issue.kind, cls=type(planned.stable.wrapped).__name__)
            yield Finding(Stage.LEAF_PLANS, at, found)


_LEAF_KIND = {'FunctionToolset': 'function', 'MCPToolset': 'mcp', 'DynamicToolset': 'dynamic'}
"""Leaf classes in upstream's words for them (`RuntimeToolsetKind`)."""


def _refusing(ctx: CheckContext, kind: str) -> tuple[str, ...]:
    """The durable engines of the definition that refuse a new leaf of `kind` inside a run unless it is the object
    they wrapped at build time: what each engine's spec reads from upstream (`EngineSpec.rejected_at_run_time`;
    DBOS runs function tools inline, so it accepts a new `FunctionToolset`)."""
    return tuple(e for e in ctx.durable if e in ctx.known_engines and kind in ctx.known_engines[e].spec.rejected_at_run_time())


@check('DC024')
def new_leaves_per_call(ctx: CheckContext) -> Iterator[Finding]:
    for index, planned in enumerate(ctx.planned):
        walk = planned.walk
        if not ctx.durable or not walk.user.defer_loading or walk.toolset is None:
            continue
        again = _leaves_again(walk)
        if again is None or len(again) != len(walk.leaves):
            continue
        for number, (first, second) in enumerate(zip(walk.leaves, again, strict=True)):
            kind = type(first).__name__
            if kind not in _LEAF_KIND or _upstream.interchangeable_leaves(first, second):
                continue
            if scope := _refusing(ctx, _LEAF_KIND[kind]):
                found = problem('DC024', _where(planned), scope, kind=kind, toolset_id=first.id or planned.stable.scope)
                yield Finding(Stage.LEAF_PLANS, (index, 3, number), found)


def _leaves_again(walk: CapabilityWalk) -> list[AbstractToolset[Any]] | None:
    """The leaves of a second `get_toolset()` call (what the model's load of a deferred capability gets), or
    `None` when it raised or returned nothing. `StableIdCapability` hands out the first of interchangeable leaves
    again (`_upstream.interchangeable_leaves`), so only leaves that are not are a problem."""
    try:
        toolset = walk.user.get_toolset()
    except Exception:  # noqa: BLE001 - the user's code; its first failure is reported as DC023
        return None
    if toolset is None:
        return None
    if not isinstance(toolset, AbstractToolset):
        toolset = _upstream.DynamicToolset(toolset)  # a toolset function, as upstream wraps it
    return collect_leaves(toolset)


# ---- capability ids ---------------------------------------------------------------------------------------------------


@check('DC001')
def deferred_without_id(ctx: CheckContext) -> Iterator[Finding]:
    for index, walk in enumerate(ctx.registered):
        user = walk.user
        if walk.cap_id is not None or not user.defer_loading:
            continue
        where, cls = describe_capability(user, None), type(user).__name__
        if isinstance(user, MCP) and user.url:
            derived = _upstream.capability_url_derived_id(user)
            found = ctx.problem('DC001', where, 'url', cls=cls, url=redact_url(user.url), derived=derived)
        else:
            found = ctx.problem('DC001', where, cls=cls)
        yield Finding(Stage.CAPABILITIES, (index,), found)


@check('DC006')
def url_derived_id(ctx: CheckContext) -> Iterator[Finding]:
    for index, cap_id, mcp in ctx.ids.url_derived_at:
        fields = {'cap_id': cap_id, 'url': redact_url(mcp.url or ''), 'suggested': cap_id.replace('.', '-')}
        yield Finding(Stage.CAPABILITIES, (index,), ctx.problem('DC006', describe_capability(mcp, cap_id), **fields))


@check('DC005')
def url_ids_collide(ctx: CheckContext) -> Iterator[Finding]:
    for index, (cap_id, users) in enumerate(ctx.ids.url_derived.items()):
        if cap_id in ctx.colliding_url_ids:
            urls = ', '.join(sorted({redact_url(u.url or '') for u in users}))
            found = ctx.problem('DC005', f'capability {cap_id!r} (MCP)', count=len(users), cap_id=cap_id, urls=urls)
            yield Finding(Stage.URL_IDS, (index,), found)


@check('DC003')
def shared_capability_id(ctx: CheckContext) -> Iterator[Finding]:
    for index, (cap_id, users) in enumerate(ctx.ids.explicit.items()):
        if cap_id in ctx.duplicated_ids:
            distinct = _distinct(users)
            classes = ', '.join(type(u).__name__ for u in distinct)
            found = ctx.problem('DC003', f'capability {cap_id!r}', count=len(distinct), classes=classes, cap_id=cap_id)
            yield Finding(Stage.CAPABILITY_IDS, (index,), found)


@check('DC004')
def shared_leaf_id(ctx: CheckContext) -> Iterator[Finding]:
    owners: dict[str, list[PlannedCapability]] = defaultdict(list)
    for planned in ctx.planned:
        for plan in planned.plans:
            owners[plan.toolset_id].append(planned)
    for index, (toolset_id, sharing) in enumerate(owners.items()):
        # Leaves named after a duplicated capability id repeat DC003 (or DC005); report it once.
        if len(sharing) < 2 or toolset_id in ctx.duplicated_ids or toolset_id in ctx.colliding_url_ids:
            continue
        labels = '; '.join(describe_capability(p.stable.wrapped, p.owner) for p in sharing)
        fields = {'count': len(sharing), 'toolset_id': toolset_id, 'owners': labels}
        yield Finding(Stage.SHARED_LEAVES, (index,), ctx.problem('DC004', f'leaf toolset {toolset_id!r}', **fields))


# ---- tools ------------------------------------------------------------------------------------------------------------


@check('DC008')
def reserved_tool_name(ctx: CheckContext) -> Iterator[Finding]:
    first = ctx.tools.first
    if (reserved := _upstream.LOAD_CAPABILITY_TOOL_NAME) in first:
        yield Finding(Stage.RESERVED_TOOL, (), ctx.problem('DC008', ctx.owner_label(first[reserved])))


@check('DC007')
def shared_tool_name(ctx: CheckContext) -> Iterator[Finding]:
    for index, (tool, labels) in enumerate(ctx.tools.shared.items()):
        if len(labels) > 1:
            found = ctx.problem('DC007', f'tool {tool!r}', tool=tool, owners=', '.join(labels))
            yield Finding(Stage.SHARED_TOOLS, (index,), found)


@check('DC009')
def runbook_unknown_capability(ctx: CheckContext) -> Iterator[Finding]:
    known = ', '.join(sorted(ctx.capability_ids)) or 'none'
    for index, walk, requirements in ctx.runbooks:
        for number, (tool, required) in enumerate(requirements):
            if required not in ctx.capability_ids:
                where = describe_capability(walk.user, walk.cap_id)
                found = ctx.problem('DC009', where, tool=tool, required=required, known=known)
                yield Finding(Stage.RUNBOOKS, (index, number), found)


@check('DC010')
def runbook_unknown_tool(ctx: CheckContext) -> Iterator[Finding]:
    for index, walk, requirements in ctx.runbooks:
        for number, (tool, _) in enumerate(requirements):
            if tool not in ctx.tools.first:
                variant = '' if ctx.tools.all_static else 'dynamic'
                found = ctx.problem('DC010', describe_capability(walk.user, walk.cap_id), variant, tool=tool)
                yield Finding(Stage.RUNBOOKS, (index, number), found)
