"""The stable-id policy: every leaf toolset under every capability gets an id derived from its capability id.

Durable engines name their units after leaf toolset ids (Temporal activity
`agent__{name}__toolset__{id}__call_tool`, DBOS step `{name}__mcp_server__{id}.call_tool`, Prefect task
cache keys), so those ids are compatibility data: they must be the same in every process, on every
machine and for every engine, and a rename strands in-flight runs.

Rules (see docs/concepts/ids.md):

1. A leaf that already has an explicit id keeps it. Upstream's own ids (`Capability(tools=..., id='x')`
   gives `x`, callables in `toolsets=` give `x_0`, `x_1`) are therefore never changed, so an agent
   hand-wired on upstream and the same agent defined here record the same names.
2. A capability's only anonymous leaf takes the capability id.
3. Several anonymous leaves take `{capability id}_{name}` where the leaf has a name of its own (a
   dynamic toolset's function name, an MCP server's host) and `{capability id}_{position}` otherwise;
   the positional form is reported as warning DC013 because reordering renames it.
4. A capability without an id inside a group (`CombinedCapability(id='g', ...)`) takes the group id as
   its scope (`g`, or `g_{position}` when the group holds several id-less members).
5. The user's objects are never mutated: an anonymous leaf is replaced by a copy that carries the id
   (`_upstream.toolset_with_id`), so a module-level toolset shared by two capabilities or two agents
   keeps working for all of them.

Nothing here depends on `hash()`, `id()` ordering or set iteration, so ids do not change with
`PYTHONHASHSEED`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic_ai.capabilities import (
    AbstractCapability,
    CombinedCapability,
    WrapperCapability,
)
from pydantic_ai.toolsets import AbstractToolset, CombinedToolset, FunctionToolset

from . import _upstream

MAX_ID_LENGTH = 100
"""Longest id accepted, in characters. Temporal activity type names and DBOS step names carry the id
plus the agent name and a suffix; 100 keeps the whole name well under Temporal's 1,000-byte limit on
identifiers (`limit.maxIDLength`)."""

_ID_RE = re.compile(r'[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?')
_UNSAFE_CHARS_RE = re.compile(r'[^A-Za-z0-9._-]')


def id_syntax_error(value: object) -> str | None:
    """Why `value` is not a safe id, or `None` when it is.

    Safe: a non-empty string of at most `MAX_ID_LENGTH` characters from `A-Z a-z 0-9 . _ -`, starting
    and ending with a letter or digit, without `__` (Temporal's operation names use `__` as the
    separator between agent, toolset and operation, so an id containing it makes names ambiguous) and
    without `:` (upstream uses it to separate instruction id segments).
    """
    if not isinstance(value, str):
        return f'is {type(value).__name__}, not a string'
    if len(value) <= MAX_ID_LENGTH and '__' not in value and _ID_RE.fullmatch(value):
        return None  # the common case, decided in one match
    if value == '':
        return 'is empty'
    if value != value.strip() or any(ch.isspace() for ch in value):
        return 'contains whitespace'
    if len(value) > MAX_ID_LENGTH:
        return f'is {len(value)} characters long; the limit is {MAX_ID_LENGTH}'
    bad = sorted(set(_UNSAFE_CHARS_RE.findall(value)))
    if bad:
        return f'contains {", ".join(repr(b) for b in bad)}, unsafe in Temporal activity and DBOS step names'
    if '__' in value:
        return "contains '__', the separator in Temporal operation names"
    if not _ID_RE.fullmatch(value):
        return 'must start and end with a letter or digit'
    return None


def sanitize_name(value: str) -> str:
    """Turn a free-form name into an id fragment: unsafe characters become `-`, runs collapse."""
    cleaned = re.sub(r'_{2,}', '_', _UNSAFE_CHARS_RE.sub('-', value))
    cleaned = re.sub(r'-{2,}', '-', cleaned).strip('-_.')
    return cleaned or 'x'


def redact_url(url: str) -> str:
    """`url` without user info, query or fragment: what may appear in ids, messages and logs.

    `https://user:secret@mcp.example.com:8443/api?token=t` becomes `https://mcp.example.com:8443/api`.
    """
    try:
        parts = urlsplit(url)
        host = parts.hostname or ''
        if ':' in host:
            host = f'[{host}]'
        port = f':{parts.port}' if parts.port else ''
    except ValueError:
        return '<unparseable URL>'
    redacted = urlunsplit((parts.scheme, f'{host}{port}', parts.path, '', ''))
    # Without a scheme nothing parses as a host, and user info would stay in the path.
    return '<redacted URL>' if '@' in redacted else redacted


@dataclass(frozen=True)
class LeafPlan:
    """The id a leaf toolset gets and how it was chosen."""

    toolset_id: str
    kind: str  # class name of the leaf toolset
    source: str  # 'explicit' | 'capability' | 'name' | 'position' | 'alias'


def _leaf_name(leaf: AbstractToolset[Any]) -> str | None:
    """A name of the leaf's own that does not depend on list order, or `None`."""
    if isinstance(leaf, _upstream.DynamicToolset):
        name = getattr(leaf.toolset_func, '__name__', None)
        if name and name != '<lambda>':
            return sanitize_name(name)
    if _upstream.is_mcp_toolset(leaf) and _upstream.explicit_toolset_id(leaf) is not None:
        return sanitize_name(leaf.id or '')
    # An MCP server's host-derived id is not used: it would put the host in durable unit names.
    return None


@dataclass(frozen=True)
class PlanIssue:
    """A leaf whose id could not be planned cleanly.

    Attributes:
        code: `'DC013'` (the id depends on the leaf's position), `'DC014'` (the leaf cannot be copied to
            carry an id) or `'DC015'` (the capability has no id to derive one from).
        kind: Class name of the leaf toolset.
        position: The leaf's index among the capability's leaves (traversal order).
        toolset_id: The positional id given (DC013 only).
    """

    code: str
    kind: str
    position: int
    toolset_id: str | None = None


def plan_leaf_ids(
    scope: str | None, leaves: list[AbstractToolset[Any]], renamed_from: str | None = None
) -> tuple[dict[int, str], list[LeafPlan], list[PlanIssue]]:
    """Choose ids for `leaves` (in traversal order) owned by a capability whose id (scope) is `scope`.

    `renamed_from` is the capability's previous id (an alias): leaves then keep the ids they had under
    it, explicit ids upstream derived from the new id included (`new` -> `old`, `new_0` -> `old_0`),
    so durable unit names do not change with the rename.

    Returns `(assignments, plans, issues)`: `assignments` maps `id(leaf)` to the new id for each
    anonymous leaf; `plans` lists every leaf's final id in order; `issues` lists a `PlanIssue` for each
    DC013 (positional id), DC014 (uncopyable leaf) and DC015 (no scope), in leaf order.
    """
    explicit = [_upstream.explicit_toolset_id(leaf) for leaf in leaves]
    new_scope = None
    if renamed_from is not None and scope is not None:
        new_scope, scope = scope, renamed_from
    anonymous = [i for i, e in enumerate(explicit) if e is None]
    taken = {e for e in explicit if e is not None}
    assignments: dict[int, str] = {}
    plans: list[LeafPlan] = []
    issues: list[PlanIssue] = []
    for index, leaf in enumerate(leaves):
        kind = type(leaf).__name__
        current = explicit[index]
        if current is not None:
            plan = _previous_id(leaf, current, kind, scope, new_scope) or LeafPlan(current, kind, 'explicit')
        elif scope is None:
            issues.append(PlanIssue('DC015', kind, index))
            continue
        elif (plan := _anonymous_id(leaf, index, kind, scope, anonymous, taken, issues)) is None:
            continue
        if plan.source != 'explicit':
            taken.add(plan.toolset_id)
            assignments[id(leaf)] = plan.toolset_id
        plans.append(plan)
    return assignments, plans, issues


def _previous_id(
    leaf: AbstractToolset[Any], current: str, kind: str, old_scope: str | None, new_scope: str | None
) -> LeafPlan | None:
    """Under an alias, the old id for a leaf whose explicit id upstream derived from the new capability id."""
    if new_scope is None or old_scope is None or not (current == new_scope or current.startswith(f'{new_scope}_')):
        return None
    old_id = old_scope + current[len(new_scope):]
    return LeafPlan(old_id, kind, 'alias') if _upstream.toolset_with_id(leaf, old_id) is not None else None


def _anonymous_id(
    leaf: AbstractToolset[Any],
    index: int,
    kind: str,
    scope: str,
    anonymous: list[int],
    taken: set[str],
    issues: list[PlanIssue],
) -> LeafPlan | None:
    """The id of an anonymous leaf: the capability id, `{scope}_{name}`, else `{scope}_{position}` (DC013);
    `None` when the leaf cannot be copied to carry it (DC014). Issues are appended to `issues`."""
    if len(anonymous) == 1 and scope not in taken:
        new_id, source = scope, 'capability'
    elif (name := _leaf_name(leaf)) is not None and f'{scope}_{name}' not in taken:
        new_id, source = f'{scope}_{name}', 'name'
    else:
        # Position among this capability's anonymous leaves, skipping numbers upstream already gave
        # (`Capability(toolsets=[callable])` names callables `{id}_{index}`).
        number = anonymous.index(index)
        while f'{scope}_{number}' in taken:
            number += 1
        new_id, source = f'{scope}_{number}', 'position'
        issues.append(PlanIssue('DC013', kind, index, new_id))
    if _upstream.toolset_with_id(leaf, new_id) is None:
        issues.append(PlanIssue('DC014', kind, index))
        return None
    return LeafPlan(new_id, kind, source)


def collect_leaves(toolset: AbstractToolset[Any]) -> list[AbstractToolset[Any]]:
    leaves: list[AbstractToolset[Any]] = []
    toolset.apply(leaves.append)
    return leaves


@dataclass
class StableIdCapability(WrapperCapability[Any]):
    """A transparent wrapper that gives every anonymous leaf toolset of `wrapped` a stable id.

    It adopts the wrapped capability's `id`, `description` and `defer_loading` (upstream's
    `WrapperCapability` contract), delegates every hook, and only rewrites `get_toolset()`: leaves
    without an explicit id are replaced by copies that carry the id chosen by `plan_leaf_ids`.

    Attributes:
        wrapped: The user's capability, never mutated.
        scope: The id leaf ids derive from: the capability's own id, or its group's.
    """

    scope: str | None = None
    renamed_from: str | None = None
    _copies: dict[int, tuple[Any, AbstractToolset[Any]]] = field(
        default_factory=dict, repr=False, compare=False
    )
    _templates: dict[str | None, list[AbstractToolset[Any]]] = field(default_factory=dict, repr=False, compare=False)

    def get_description(self) -> Any:
        return self.wrapped.get_description()

    def get_toolset(self) -> Any:
        toolset = self.wrapped.get_toolset()
        if toolset is None:
            return None
        if not isinstance(toolset, AbstractToolset):
            # A toolset function: upstream would wrap it in an id-less DynamicToolset.
            toolset = self._interned(_upstream.DynamicToolset(toolset, per_run_step=True, id=None))
        leaves = collect_leaves(toolset)
        interned = {id(leaf): self._interned(leaf) for leaf in leaves if isinstance(leaf, _INTERNED)}
        if any(interned[key] is not leaf for leaf in leaves if (key := id(leaf)) in interned):
            toolset = toolset.visit_and_replace(lambda leaf: interned.get(id(leaf), leaf))
            leaves = collect_leaves(toolset)
        assignments, _, _ = plan_leaf_ids(self.scope, leaves, self.renamed_from)
        if not assignments:
            return toolset

        def replace_leaf(leaf: AbstractToolset[Any]) -> AbstractToolset[Any]:
            new_id = assignments.get(id(leaf))
            if new_id is None:
                return leaf
            cached = self._copies.get(id(leaf))
            if cached is None or cached[0] is not leaf or cached[1].id != new_id:
                copy = _upstream.toolset_with_id(leaf, new_id)
                assert copy is not None  # plan_leaf_ids only assigns copyable leaves
                cached = (leaf, copy)
                self._copies[id(leaf)] = cached
            return cached[1]

        return toolset.visit_and_replace(replace_leaf)

    def _interned(self, leaf: AbstractToolset[Any]) -> AbstractToolset[Any]:
        """The first leaf this wrapper handed out that `leaf` can stand in for (`leaf` itself when there is none).

        `Capability(toolsets=[func])` builds a new `DynamicToolset(func, id='x_0')` on every `get_toolset()`
        call, and `WebSearch(local=func)` a new `FunctionToolset` around the same `Tool`. Durable engines wrap
        the leaves they see when the agent is built and, inside a workflow or flow, refuse a leaf that is not
        one of those very objects ("cannot be added at runtime"); a deferred capability's toolset is fetched
        again when the model loads it. `_upstream.interchangeable_leaves` says when two leaves behave the
        same; a run never uses the template itself (`for_run` makes per-run copies), so one template is safe
        to share between runs. At most `_MAX_TEMPLATES` are kept per id, so a capability that builds a
        different toolset on every call (DC024) cannot grow the cache.
        """
        templates = self._templates.setdefault(_upstream.explicit_toolset_id(leaf), [])
        for template in templates:
            if _upstream.interchangeable_leaves(template, leaf):
                return template
        templates.append(leaf)
        del templates[:-_MAX_TEMPLATES]
        return leaf


_MAX_TEMPLATES = 8
"""Leaf templates kept per leaf id by one `StableIdCapability` (see `_interned`)."""


_INTERNED = (_upstream.DynamicToolset, FunctionToolset)
"""Leaf kinds `StableIdCapability._interned` may hand out again instead of a new but interchangeable one."""


def _is_leaf_capability(capability: AbstractCapability[Any]) -> bool:
    registered: list[AbstractCapability[Any]] = []
    capability.apply(registered.append)
    return len(registered) == 1 and registered[0] is capability


@dataclass(frozen=True)
class _Scope:
    scope: str | None  # what leaf ids derive from
    owner: str | None  # the nearest capability id (the capability itself or its group)
    positional: bool  # whether `scope` depends on a position in a group


def _assign_scopes(
    capability: AbstractCapability[Any], inherited: _Scope, out: dict[int, _Scope]
) -> None:
    mine = inherited if capability.id is None else _Scope(capability.id, capability.id, False)
    if isinstance(capability, CombinedCapability):
        members = list(capability.capabilities)
        idless = [m for m in members if m.id is None]
        for member in members:
            if member.id is None and mine.scope is not None and len(idless) > 1:
                child = _Scope(f'{mine.scope}_{idless.index(member)}', mine.owner, True)
            else:
                child = mine
            _assign_scopes(member, child, out)
    elif isinstance(capability, WrapperCapability) and not _is_leaf_capability(capability):
        out[id(capability)] = mine
        _assign_scopes(capability.wrapped, mine, out)
    else:
        out[id(capability)] = mine


@dataclass
class CapabilityWalk:
    """One registered capability and its toolset, fetched and walked once when the definition is built.

    Every consumer reads this instead of calling `get_toolset()` again: leaf id planning (`stabilize`),
    the tool checks, `DurableAgent.static_tool_names` and `tool_names_by_capability`.

    Attributes:
        node: The capability as registered in the stabilized tree (a `StableIdCapability` for a leaf).
        cap_id: The id it is registered under, `None` when it has none.
        user: The user's capability (`node` unwrapped from `StableIdCapability`).
        toolset: What `get_toolset()` returned (a toolset function wrapped in `DynamicToolset`); `None`
            when it returned `None` or raised.
        error: The exception `get_toolset()` raised, else `None`.
        leaves: The toolset's leaf toolsets, in upstream's `apply` order.
        function_toolsets: The `FunctionToolset`s holding every tool of `toolset`, or `None` when some tool
            names are only known at run time (MCP, toolset functions, wrappers such as prefixes).
    """

    node: AbstractCapability[Any]
    cap_id: str | None
    user: AbstractCapability[Any]
    toolset: AbstractToolset[Any] | None
    error: Exception | None
    leaves: list[AbstractToolset[Any]]
    function_toolsets: list[FunctionToolset[Any]] | None

    @property
    def tool_names(self) -> list[str] | None:
        """Tool names known without running anything, read now (tools added to a toolset later count), or
        `None` when there is no toolset or some of it is dynamic."""
        sources = self.function_toolsets
        if self.toolset is None or sources is None:
            return None
        if len(sources) == 1:
            return list(sources[0].tools)
        names: list[str] = []
        for toolset in sources:
            names.extend(toolset.tools)
        return names


def _walk_toolset(toolset: AbstractToolset[Any], leaves: list[AbstractToolset[Any]]) -> list[FunctionToolset[Any]] | None:
    """Append `toolset`'s leaves to `leaves` (upstream's `apply` order); return the function toolsets that hold
    all its tools, or `None` when a part other than `CombinedToolset` / `FunctionToolset` is in the way."""
    if isinstance(toolset, CombinedToolset) and type(toolset).apply is CombinedToolset.apply:
        return _walk_children(toolset.toolsets, leaves)
    toolset.apply(leaves.append)
    if isinstance(toolset, FunctionToolset):
        return [toolset]
    if isinstance(toolset, CombinedToolset):  # a subclass with its own `apply`: leaves as it says, tools per child
        return _walk_children(toolset.toolsets, [])
    return None


def _walk_children(
    children: Sequence[AbstractToolset[Any]], leaves: list[AbstractToolset[Any]]
) -> list[FunctionToolset[Any]] | None:
    sources: list[FunctionToolset[Any]] | None = []
    for child in children:
        child_sources = _walk_toolset(child, leaves)
        if child_sources is None:
            sources = None
        elif sources is not None:
            sources.extend(child_sources)
    return sources


def walk_capability(node: AbstractCapability[Any]) -> CapabilityWalk:
    """Call `get_toolset()` of the user's capability behind `node` once and walk the result; never raises."""
    user = node.wrapped if isinstance(node, StableIdCapability) else node
    try:
        toolset = user.get_toolset()
    except Exception as exc:  # noqa: BLE001 - the user's code; reported as DC023, never raised half-way
        return CapabilityWalk(node, node.id, user, None, exc, [], None)
    if toolset is None:
        return CapabilityWalk(node, node.id, user, None, None, [], None)
    if not isinstance(toolset, AbstractToolset):
        toolset = _upstream.DynamicToolset(toolset)  # a toolset function, as upstream wraps it
    leaves: list[AbstractToolset[Any]] = []
    return CapabilityWalk(node, node.id, user, toolset, None, leaves, _walk_toolset(toolset, leaves))


def walk_registered(capabilities: list[AbstractCapability[Any]]) -> list[CapabilityWalk]:
    """A `CapabilityWalk` for every capability the trees of `capabilities` register (upstream's `apply`), in order."""
    walks: list[CapabilityWalk] = []
    for capability in capabilities:
        capability.apply(lambda node: walks.append(walk_capability(node)))
    return walks


@dataclass
class PlannedCapability:
    """A leaf capability `stabilize` wrapped, with the ids planned for its leaf toolsets.

    Attributes:
        stable: The wrapper handed to pydantic-ai (`stable.wrapped` is the user's capability, `stable.scope`
            the id its leaf ids derive from).
        walk: Its toolset walk (shared with the other consumers).
        owner: The nearest capability id: its own or, for an id-less member, its group's.
        positional: Whether `stable.scope` comes from its position among the id-less members of a group.
        plans: Every leaf's id, in leaf order (empty when `get_toolset()` returned `None` or raised).
        issues: DC013 / DC014 / DC015 findings of the plan, in leaf order.
    """

    stable: StableIdCapability
    walk: CapabilityWalk
    owner: str | None
    positional: bool
    plans: list[LeafPlan]
    issues: list[PlanIssue]


@dataclass
class Stabilized:
    """The result of `stabilize`.

    Attributes:
        capabilities: The capabilities to hand to `pydantic_ai.Agent`, in the user's order.
        registered: One `CapabilityWalk` per registered capability (groups and members), in definition order.
        planned: One `PlannedCapability` per wrapped leaf capability, in definition order.
    """

    capabilities: list[AbstractCapability[Any]]
    registered: list[CapabilityWalk]
    planned: list[PlannedCapability]


def stabilize(capabilities: list[AbstractCapability[Any]], aliases: dict[str, str] | None = None) -> Stabilized:
    """Wrap every leaf capability of `capabilities` in `StableIdCapability`, walk every toolset once and plan leaf ids.

    Args:
        capabilities: The user's capabilities (already instances, not callables).
        aliases: `{current capability id: previous id}`; leaves of a renamed capability keep the ids
            (and so the durable unit names) they had under the previous id.

    Returns:
        A `Stabilized`; never raises for a bad definition (`checks` turns what it holds into problems).
    """
    scopes: dict[int, _Scope] = {}
    for capability in capabilities:
        _assign_scopes(capability, _Scope(None, None, False), scopes)
    wrapped: list[StableIdCapability] = []
    result = _wrap_leaves(capabilities, scopes, aliases or {}, wrapped)
    registered = walk_registered(result)
    by_node = {id(walk.node): walk for walk in registered}
    planned = [_plan(stable, by_node.get(id(stable)), scopes) for stable in wrapped]
    return Stabilized(result, registered, planned)


def _wrap_leaves(
    capabilities: list[AbstractCapability[Any]],
    scopes: dict[int, _Scope],
    aliases: dict[str, str],
    wrapped: list[StableIdCapability],
) -> list[AbstractCapability[Any]]:
    """`capabilities` with every leaf capability replaced by a `StableIdCapability` (also appended to `wrapped`)."""

    def wrap(capability: AbstractCapability[Any]) -> AbstractCapability[Any]:
        if isinstance(capability, StableIdCapability) or not _is_leaf_capability(capability):
            return capability
        known = scopes.get(id(capability))
        scope = known.scope if known is not None else capability.id
        stable = StableIdCapability(wrapped=capability, scope=scope, renamed_from=aliases.get(scope or ''))
        wrapped.append(stable)
        return stable

    result: list[AbstractCapability[Any]] = []
    for capability in capabilities:
        replaced = capability.visit_and_replace(wrap)
        if replaced is not None:
            result.append(replaced)
    return result


def _plan(stable: StableIdCapability, walk: CapabilityWalk | None, scopes: dict[int, _Scope]) -> PlannedCapability:
    """Plan the leaf ids of one wrapped capability from its walk (walked here if it is not registered)."""
    if walk is None:
        walk = walk_capability(stable)
    scope = scopes.get(id(stable.wrapped))
    owner, positional = (scope.owner, scope.positional) if scope is not None else (stable.scope, False)
    if walk.toolset is None:
        return PlannedCapability(stable, walk, owner, positional, [], [])
    _, plans, issues = plan_leaf_ids(stable.scope, walk.leaves, stable.renamed_from)
    return PlannedCapability(stable, walk, owner, positional, plans, issues)
