"""What a stored history says: the capabilities it loaded, the tools it called, and its drift from a definition.

`loaded_capability_ids` and `tools_called` read a history; `drift` compares one with the `DurableAgent` it
will resume with (problems DC018 and DC019). All three are re-exported by `durable_capabilities.store`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from pydantic_ai.messages import (
    CapabilityLoadDeltaPart,
    CompactionPart,
    LoadCapabilityCallPart,
    LoadCapabilityReturnPart,
    ModelMessage,
    ModelResponse,
    ToolAvailabilityDeltaPart,
    ToolCallPart,
    ToolSearchCallPart,
    post_compaction_window,
)
from pydantic_ai.output import ToolOutput
from pydantic_ai.toolsets import FunctionToolset

from .budget import RAISE_TOOL
from .validation import Problem


class Definition(Protocol):
    """What `drift` and `known_tool` read of a definition (`DurableAgent` has it): typed here, so the store, which
    imports this module, does not reach the agent module."""

    @property
    def output_type(self) -> Any: ...
    @property
    def tools(self) -> Sequence[Any]: ...

    def capability_ids(self) -> list[str]: ...

    def tool_names_by_capability(self) -> tuple[dict[str, set[str]], set[str]]: ...

__all__ = ['drift', 'loaded_capability_ids', 'tools_called']


def loaded_capability_ids(messages: Sequence[ModelMessage]) -> list[str]:
    """The capability ids a history loaded, in the order first loaded.

    The same rule upstream applies when a run starts from `message_history` (pydantic-ai 2.68 keeps
    it private, `_deferred_capabilities.parse_loaded_capabilities`), written with public names: only
    the messages after the last compaction (`post_compaction_window`) count; a capability is loaded by
    a `load_capability` return that completes its call, or by a `CapabilityLoadDeltaPart` naming it
    (`ctx.load_capability()` from a tool). A failed load loads nothing. Upstream then narrows the set to
    the capabilities the agent registers; `drift` reports the ones it would drop.

    Args:
        messages: A history, oldest first.

    Returns:
        Capability ids, without repeats.
    """
    return list(_window_scan(messages)[0])


@dataclass
class _Load:
    position: int  # 1-based message position of the load
    tools: set[str] = field(default_factory=set)  # tools revealed by the load


_OTHER, _LOAD_CALL, _AVAILABILITY, _LOAD_DELTA, _LOAD_RETURN, _TOOL_CALL, _COMPACTION = range(7)
_ROLES: dict[type, int] = {}


def _role(cls: type) -> int:
    """What a part class means to `_scan`, found once per class with `isinstance` (subclasses included) and kept:
    the scan of a long history then costs one dict lookup per part."""
    role = _ROLES.get(cls)
    if role is None:
        role = (
            _LOAD_CALL if issubclass(cls, LoadCapabilityCallPart)
            else _AVAILABILITY if issubclass(cls, ToolAvailabilityDeltaPart)
            else _LOAD_DELTA if issubclass(cls, CapabilityLoadDeltaPart)
            else _LOAD_RETURN if issubclass(cls, LoadCapabilityReturnPart)
            else _TOOL_CALL if issubclass(cls, ToolCallPart) and not issubclass(cls, ToolSearchCallPart)
            else _COMPACTION if issubclass(cls, CompactionPart)
            else _OTHER
        )
        _ROLES[cls] = role
    return role


def _window_scan(history: Sequence[ModelMessage]) -> tuple[dict[str, _Load], dict[str, int]]:
    """`_scan` of the history's post-compaction window (upstream's `post_compaction_window`, the rule pydantic-ai
    rebuilds loaded capabilities with), positions counted in the whole history.

    One pass when the history holds no `CompactionPart` (the window is then the whole history); otherwise the
    window is taken with upstream's own function and scanned again.
    """
    loads, first_call, compacted = _scan(history)
    if compacted:
        window = post_compaction_window(history)
        loads, first_call, _ = _scan(window, len(history) - len(window))
    return loads, first_call


def _scan(window: Sequence[ModelMessage], offset: int = 0) -> tuple[dict[str, _Load], dict[str, int], bool]:
    """One pass over `window`: `{capability id: where it was loaded and the tools its load revealed}`, in load
    order, `{tool name: position of its first call}` for the model's own tool calls (not `load_capability`
    nor tool search), and whether a `CompactionPart` was seen."""
    compacted = False
    calls: dict[str, str] = {}
    by_call: dict[str | None, list[str]] = {}
    loads: dict[str, _Load] = {}
    first_call: dict[str, int] = {}
    roles = _ROLES
    for index, message in enumerate(window, start=offset + 1):
        for part in message.parts:
            role = roles.get(type(part))
            if role is None:
                role = _role(type(part))
            if role == _OTHER:
                continue
            if role == _COMPACTION:
                compacted = True
                continue
            if role == _TOOL_CALL:
                if isinstance(message, ModelResponse):
                    first_call.setdefault(part.tool_name, index)  # type: ignore[attr-defined]
                continue
            if role == _LOAD_CALL:
                if part.capability_id is not None:  # type: ignore[attr-defined]
                    calls[part.tool_call_id] = part.capability_id  # type: ignore[attr-defined]
                continue
            if role == _AVAILABILITY:
                for capability_id in by_call.get(part.tool_call_id, []):  # type: ignore[attr-defined]
                    loads[capability_id].tools.update(part.tools_added)  # type: ignore[attr-defined]
                continue
            if role == _LOAD_DELTA:
                ids, call_id = list(part.loaded), part.tool_call_id  # type: ignore[attr-defined]
            elif part.tool_call_id in calls:  # type: ignore[attr-defined]  # a load_capability return
                ids, call_id = [calls[part.tool_call_id]], part.tool_call_id  # type: ignore[attr-defined]
            else:
                continue
            for capability_id in ids:
                loads.setdefault(capability_id, _Load(index))
                by_call.setdefault(call_id, []).append(capability_id)
    return loads, first_call, compacted


def tools_called(messages: Sequence[ModelMessage]) -> dict[str, int]:
    """`{tool name: number of calls}` over the model's tool calls, first call first.

    `load_capability` and tool-search calls are counted too; provider-native (builtin) tools are not.
    """
    counts: dict[str, int] = {}
    for message in messages:
        if isinstance(message, ModelResponse):
            for part in message.parts:
                if isinstance(part, ToolCallPart):
                    counts[part.tool_name] = counts.get(part.tool_name, 0) + 1
    return counts


def drift(
    history: Sequence[ModelMessage],
    definition: Definition,
    *,
    severity: Literal['error', 'warning'] = 'error',
    conversation_id: str | None = None,
) -> list[Problem]:
    """What a stored history refers to that `definition` no longer has, as `Problem`s.

    - DC018: the history loaded a capability id the definition does not register (renamed or
      removed). Upstream would silently drop it on resume: the model sees the catalog again, or gets
      "Unknown tool" for its tools. When a current capability has the tools the old one revealed, the
      problem names it as the likely new id. An id the definition keeps as an alias
      (`DurableAgent(aliases={new: old})`) is reported at `'info'`: the agent maps it on resume
      (`aliases.rewrite_history`, `CapabilityAliases`).
    - DC019: the history called a tool no agent tool or capability defines any more. Output tools
      (`final_result*` and `ToolOutput(name=...)`) and `load_capability` are not reported. When some
      capability's tools are only known at run time (MCP, toolset functions), an unknown tool not
      revealed by a missing capability is reported at `'info'`: it may still exist.

    Only the messages after the last compaction count, as upstream's own rebuild.

    Args:
        history: The stored messages, oldest first.
        definition: The definition the conversation will resume with.
        severity: `'error'` (default: a runner refuses to resume) or `'warning'` (resume and report).
        conversation_id: Named in each problem's `where`.

    Returns:
        The problems, DC018 first, each naming the old id, the message position and what to do.
    """
    loads, first_call = _window_scan(history)
    where = f'conversation {conversation_id!r}' if conversation_id else 'history'
    current = set(definition.capability_ids())
    aliased = {old: new for new, old in getattr(definition, 'aliases', {}).items()}
    static, unknown_owners = definition.tool_names_by_capability()
    known_tools = set(static) | set(_agent_tool_names(definition))
    output_names = _output_tool_names(definition.output_type)
    problems: list[Problem] = []
    missing_tools: dict[str, str] = {}  # tool -> missing capability that revealed it
    for capability_id, load in loads.items():
        if capability_id in current:
            continue
        for tool in load.tools:
            missing_tools.setdefault(tool, capability_id)
        if capability_id in aliased:
            problems.append(Problem(
                'DC018', 'info', where,
                f'the history loaded capability {capability_id!r} (message {load.position}), which the definition now '
                f'calls {aliased[capability_id]!r}; its alias maps the load on resume.',
                f"Nothing to do while `aliases={{'{aliased[capability_id]}': '{capability_id}'}}` stays in the "
                'definition; drop the alias only once no stored conversation needs it.',
            ))
            continue
        # The likely new id: the current capability defining most of the tools the old load revealed.
        owners: dict[str, set[str]] = {}
        for tool in load.tools:
            for owner in static.get(tool, ()):
                owners.setdefault(owner, set()).add(tool)
        successors = sorted(owners, key=lambda cid: (-len(owners[cid]), cid))
        if successors:
            hint = f' It looks renamed to {successors[0]!r}, which has {", ".join(sorted(owners[successors[0]]))}.'
        elif load.tools:
            hint = ' No current capability has the tools its load revealed; it looks removed.'
        else:
            hint = ' Its load revealed no tools, so a rename cannot be told from a removal.'

        new_id = successors[0] if successors else 'the new id'
        problems.append(Problem(
            'DC018', severity, where,
            f'the history loaded capability {capability_id!r} (message {load.position}), which the definition no '
            f'longer has; on resume it would silently not be loaded.{hint}',
            f"Keep an alias: `DurableAgent(..., aliases={{'{new_id}': '{capability_id}'}})` (or give a capability "
            f'the id {capability_id!r} back); or start a new conversation.',
        ))
    for tool, position in first_call.items():
        if tool in known_tools or _is_output_tool(tool, output_names):
            continue
        via = missing_tools.get(tool)
        unsure = bool(unknown_owners) and via is None
        source = f', revealed by capability {via!r}, which the definition no longer has' if via else ''
        maybe = (
            f' (the tools of {", ".join(repr(c) for c in sorted(unknown_owners))} are only known at run time, so it '
            'may still exist)' if unsure else ''
        )
        problems.append(Problem(
            'DC019', 'info' if unsure else severity, where,
            f'the history called tool {tool!r} (message {position}{source}), which no capability or agent tool of the '
            f'definition defines{maybe}; on resume the model would get "Unknown tool" if it calls it again.',
            f'Keep a tool named {tool!r} (in the capability that had it, or one aliased to it), or start a new '
            'conversation.',
        ))
    return problems


def known_tool(definition: Definition) -> Callable[[str], bool]:
    """`known(tool name)`: whether `drift` never reports a call of that tool for `definition` (a tool some
    capability or the agent defines, an output tool, `load_capability`), for scans that skip such calls."""
    static, _ = definition.tool_names_by_capability()
    names = set(static) | set(_agent_tool_names(definition)) | {'load_capability'}
    output_names = _output_tool_names(definition.output_type)
    return lambda tool: tool in names or _is_output_tool(tool, output_names)


def _agent_tool_names(definition: Definition) -> list[str]:
    names = list(FunctionToolset(list(definition.tools)).tools)
    if getattr(definition, 'budget', None) is not None:  # its approvals' calls are in the history
        names.append(RAISE_TOOL)
    return names


def _output_tool_names(output_type: Any) -> set[str]:
    found: set[str] = set()
    stack = [output_type]
    while stack:
        item = stack.pop()
        if isinstance(item, ToolOutput) and item.name:
            found.add(item.name)
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return found


def _is_output_tool(tool: str, named: set[str]) -> bool:
    return tool in named or tool == 'final_result' or tool.startswith('final_result_')
