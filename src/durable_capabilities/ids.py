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
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic_ai.capabilities import (
    AbstractCapability,
    Capability,
    CombinedCapability,
    WrapperCapability,
)
from pydantic_ai.toolsets import AbstractToolset

from . import _upstream
from .validation import Problem, describe_capability

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
    from pydantic_ai.mcp import MCPToolset

    if isinstance(leaf, _upstream.DynamicToolset):
        name = getattr(leaf.toolset_func, '__name__', None)
        if name and name != '<lambda>':
            return sanitize_name(name)
    if isinstance(leaf, MCPToolset) and _upstream.explicit_toolset_id(leaf) is not None:
        return sanitize_name(leaf.id or '')
    # An MCP server's host-derived id is not used: it would put the host in durable unit names.
    return None


def plan_leaf_ids(
    scope: str | None, leaves: list[AbstractToolset[Any]], renamed_from: str | None = None
) -> tuple[dict[int, str], list[LeafPlan], list[tuple[str, str]]]:
    """Choose ids for `leaves` (in traversal order) owned by a capability whose id (scope) is `scope`.

    `renamed_from` is the capability's previous id (an alias): leaves then keep the ids they had under
    it, explicit ids upstream derived from the new id included (`new` -> `old`, `new_0` -> `old_0`),
    so durable unit names do not change with the rename.

    Returns `(assignments, plans, issues)`: `assignments` maps `id(leaf)` to the new id for each
    anonymous leaf; `plans` lists every leaf's final id in order; `issues` lists `(code, detail)` pairs
    for DC013 (positional id), DC014 (uncopyable leaf) and DC015 (no scope).
    """
    explicit = [_upstream.explicit_toolset_id(leaf) for leaf in leaves]
    new_scope = None
    if renamed_from is not None and scope is not None:
        new_scope, scope = scope, renamed_from
    anonymous = [i for i, e in enumerate(explicit) if e is None]
    taken = {e for e in explicit if e is not None}
    assignments: dict[int, str] = {}
    plans: list[LeafPlan] = []
    issues: list[tuple[str, str]] = []
    for index, leaf in enumerate(leaves):
        kind = type(leaf).__name__
        current = explicit[index]
        if current is not None and new_scope is not None and (current == new_scope or current.startswith(f'{new_scope}_')):
            old_id = scope + current[len(new_scope):]  # type: ignore[operator]
            if _upstream.toolset_with_id(leaf, old_id) is not None:
                assignments[id(leaf)] = old_id
                taken.add(old_id)
                plans.append(LeafPlan(old_id, kind, 'alias'))
                continue
        if current is not None:
            plans.append(LeafPlan(current, kind, 'explicit'))
            continue
        if scope is None:
            issues.append(('DC015', kind))
            continue
        name = _leaf_name(leaf)
        if len(anonymous) == 1 and scope not in taken:
            new_id, source = scope, 'capability'
        elif name is not None and f'{scope}_{name}' not in taken:
            new_id, source = f'{scope}_{name}', 'name'
        else:
            # Position among this capability's anonymous leaves, skipping numbers upstream already gave
            # (`Capability(toolsets=[callable])` names callables `{id}_{index}`).
            number = anonymous.index(index)
            while f'{scope}_{number}' in taken:
                number += 1
            new_id, source = f'{scope}_{number}', 'position'
            issues.append(('DC013', f'{kind} at position {index} gets id {new_id!r}'))
        if _upstream.toolset_with_id(leaf, new_id) is None:
            issues.append(('DC014', kind))
            continue
        taken.add(new_id)
        assignments[id(leaf)] = new_id
        plans.append(LeafPlan(new_id, kind, source))
    return assignments, plans, issues


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
    _copies: dict[int, tuple[AbstractToolset[Any], AbstractToolset[Any]]] = field(
        default_factory=dict, repr=False, compare=False
    )

    def get_description(self) -> Any:
        return self.wrapped.get_description()

    def get_toolset(self) -> Any:
        toolset = self.wrapped.get_toolset()
        if toolset is None:
            return None
        if not isinstance(toolset, AbstractToolset):
            # A toolset function: upstream would wrap it in an id-less DynamicToolset.
            key = id(toolset)
            cached = self._copies.get(key)
            if cached is None or cached[0] is not toolset:
                cached = (toolset, _upstream.DynamicToolset(toolset, per_run_step=True, id=None))
                self._copies[key] = cached
            toolset = cached[1]
        assignments, _, _ = plan_leaf_ids(self.scope, collect_leaves(toolset), self.renamed_from)
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
class Stabilized:
    """The result of `stabilize`.

    Attributes:
        capabilities: The capabilities to hand to `pydantic_ai.Agent`, in the user's order.
        leaves: `[(user capability, owning capability id, [LeafPlan, ...])]` in definition order; the
            owning id is the capability's own or, for an id-less member, its group's.
        problems: DC013 / DC014 / DC015 findings.
    """

    capabilities: list[AbstractCapability[Any]]
    leaves: list[tuple[AbstractCapability[Any], str | None, list[LeafPlan]]]
    problems: list[Problem]


def stabilize(capabilities: list[AbstractCapability[Any]], aliases: dict[str, str] | None = None) -> Stabilized:
    """Wrap every leaf capability of `capabilities` in `StableIdCapability` and plan its leaf ids.

    Args:
        capabilities: The user's capabilities (already instances, not callables).
        aliases: `{current capability id: previous id}`; leaves of a renamed capability keep the ids
            (and so the durable unit names) they had under the previous id.

    Returns:
        A `Stabilized`; never raises for a bad definition (problems are returned instead).
    """
    scopes: dict[int, _Scope] = {}
    for capability in capabilities:
        _assign_scopes(capability, _Scope(None, None, False), scopes)

    wrapped_list: list[StableIdCapability] = []

    def wrap(capability: AbstractCapability[Any]) -> AbstractCapability[Any]:
        if isinstance(capability, StableIdCapability) or not _is_leaf_capability(capability):
            return capability
        scope = scopes.get(id(capability), _Scope(capability.id, capability.id, False)).scope
        stable = StableIdCapability(wrapped=capability, scope=scope, renamed_from=(aliases or {}).get(scope or ''))
        wrapped_list.append(stable)
        return stable

    result: list[AbstractCapability[Any]] = []
    for capability in capabilities:
        replaced = capability.visit_and_replace(wrap)
        if replaced is not None:
            result.append(replaced)

    leaves: list[tuple[AbstractCapability[Any], str | None, list[LeafPlan]]] = []
    problems: list[Problem] = []
    for stable in wrapped_list:
        try:
            toolset = stable.wrapped.get_toolset()
        except Exception as exc:  # noqa: BLE001 - the user's code; reported, never raised half-way
            problems.append(
                Problem(
                    'DC023',
                    'error',
                    describe_capability(stable.wrapped, stable.scope),
                    f'`get_toolset()` raised {type(exc).__name__}: {exc}',
                    'Fix the capability\'s `get_toolset()`; it is called once when the agent is built.',
                )
            )
            continue
        if toolset is None:
            continue
        if not isinstance(toolset, AbstractToolset):
            toolset = _upstream.DynamicToolset(toolset)
        _, plans, issues = plan_leaf_ids(stable.scope, collect_leaves(toolset), stable.renamed_from)
        user_cap = stable.wrapped
        where = describe_capability(user_cap, stable.scope)
        scope_info = scopes.get(id(user_cap), _Scope(stable.scope, stable.scope, False))
        if scope_info.positional and plans:
            problems.append(
                Problem(
                    'DC013',
                    'warning',
                    where,
                    f'{type(user_cap).__name__} has no id, so its leaf toolsets take the id {stable.scope!r} '
                    'from its position among the id-less members of its group; reordering the group renames '
                    'its durable units.',
                    f'Give this {type(user_cap).__name__} its own `id=`.',
                )
            )
        for code, detail in issues:
            if code == 'DC013':
                problems.append(
                    Problem(
                        code,
                        'warning',
                        where,
                        f'{detail} from its position in the toolsets list; reordering the list renames its '
                        'durable units and strands in-flight runs.',
                        'Give the toolset its own id (`FunctionToolset(id=...)`) or keep the list order fixed.',
                    )
                )
            elif code == 'DC014':
                problems.append(
                    Problem(
                        code,
                        'error',
                        where,
                        f'leaf toolset {detail} has no id and durable-capabilities cannot copy it to give it one.',
                        f'Construct the {detail} with an explicit `id=`.',
                    )
                )
            elif code == 'DC015':
                problems.append(
                    Problem(
                        code,
                        'error',
                        where,
                        f'the capability contributes a leaf toolset ({detail}) but has no `id`, so durable '
                        'engines cannot name its activities, steps or tasks.',
                        f'Construct it as `{type(user_cap).__name__}(id=...)`.',
                    )
                )
        callables = [t for t in getattr(user_cap, 'toolsets', None) or [] if not isinstance(t, AbstractToolset)]
        # Upstream numbers callables only under a capability with its own id.
        if isinstance(user_cap, Capability) and user_cap.id and callables and len(user_cap.toolsets) > 1:
            problems.append(
                Problem(
                    'DC013',
                    'warning',
                    where,
                    f"toolset functions in `toolsets=` get the ids '{stable.scope}_<position>' from pydantic-ai; "
                    'reordering the list renames their durable units and strands in-flight runs.',
                    "Wrap each function with its own id: `DynamicToolset(func, id='...')`.",
                )
            )
        leaves.append((user_cap, scope_info.owner, plans))
    return Stabilized(result, leaves, problems)
