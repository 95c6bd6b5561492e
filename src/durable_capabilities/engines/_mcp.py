"""MCP capabilities on durable engines: no discovery before a deferred one is loaded, bounded retries, clear errors.

Measured on pydantic-ai-slim 2.68 with a server that is down: every run lists the tools of every
MCP server before its first model request, deferred or not, loaded or not. A deferred `MCP` the
model never loads therefore fails every run: on DBOS and Prefect at once with `RuntimeError: Client
failed to connect: All connection attempts failed` (naming neither the capability nor the server),
and on Temporal the `...__mcp_server__{id}__get_tools` activity is retried forever (Temporal's
default retry policy), its failure recorded as `Failure exceeds size limit.`

`MCPGuard` closes that gap. It is an always-on capability whose `get_wrapper_toolset` wraps every
MCP leaf of the agent (the durable wrapper upstream put around it, or the bare `MCPToolset`) in a
`GuardedMCPToolset` that runs in workflow / flow code and

- returns no tools and no instructions, and does not connect, while the capability that gates the
  server (the deferred `MCP` itself, or a deferred group holding it) is not active
  (`ctx.active_capability_ids`, rebuilt by upstream from the message history before every step);
- turns any failure of the server's durable units (after the engine's own, bounded, retries) into
  `MCPCapabilityError`, whose message names the capability id and the server URL without user
  info, query or fragment (`ids.redact_url`). It subclasses `AgentRunError`, which upstream's
  Temporal plugin lists in `workflow_failure_exception_types`, so the workflow fails instead of
  retrying its workflow task forever.

The retry bounds themselves are engine configuration, merged in each engine adapter's
`durability_parts` (`temporal.mcp_activity_config`, `dbos.mcp_step_config`, `prefect.mcp_task_config`).

What the model sees is unchanged: upstream treats a loaded deferred capability's own tools as
revealed by the load itself (`RunContext.is_tool_available`), so listing them from the step after
the load shows the model the same tools on the same request as before. The history differs in one
detail: the `load_capability` return carries no `ToolAvailabilityDeltaPart` (nothing was listed when
the load ran); upstream records the newcomers with its ordinary mid-run delta on the next request
instead (`tests/test_upstream_mcp_contract.py` pins the visibility).

Temporal histories recorded before the guard existed keep upstream's schedule on replay (a
`workflow.patched(TEMPORAL_PATCH_ID)` check), so in-flight workflows survive the upgrade.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self
from urllib.parse import parse_qsl, urlsplit

from pydantic_ai.capabilities import (
    MCP,
    AbstractCapability,
    CombinedCapability,
    WrapperCapability,
)
from pydantic_ai.exceptions import (
    AgentRunError,
    ApprovalRequired,
    CallDeferred,
    ModelRetry,
    SkipToolExecution,
    SkipToolValidation,
    ToolFailed,
    UserError,
)
from pydantic_ai.toolsets import AbstractToolset, CombinedToolset, WrapperToolset

from .._upstream import is_mcp_toolset
from ..errors import DurcapError
from ..ids import StableIdCapability, collect_leaves, redact_url
from . import get

if TYPE_CHECKING:
    from pydantic_ai.tools import RunContext
    from pydantic_ai.toolsets.abstract import ToolsetTool

    from ..agent import DurableAgent

DEFAULT_MCP_ATTEMPTS = 3
"""Attempts (first included) each MCP discovery, instructions or tool-call unit gets before the run fails."""

DEFAULT_MCP_RETRY_INTERVAL_SECONDS = 1.0
"""Delay before the first retry of an MCP unit; doubled for each later retry."""

TEMPORAL_PATCH_ID = 'durcap.deferred-mcp-discovery'
"""`workflow.patched()` id: histories recorded before `MCPGuard` keep upstream's discovery schedule on replay."""

_CONTROL_FLOW: tuple[type[BaseException], ...] = (
    ModelRetry,
    CallDeferred,
    ApprovalRequired,
    ToolFailed,
    SkipToolExecution,
    SkipToolValidation,
    UserError,
    AgentRunError,  # includes MCPCapabilityError raised by an inner guard
)


class MCPCapabilityError(AgentRunError, DurcapError, code='mcp-capability'):
    """An MCP capability's server could not be used: it names the capability id and the redacted URL.

    Attributes:
        capability_id: The capability whose server failed.
        url: The server URL without credentials (`ids.redact_url`), or `None` when the capability has none.
        operation: What failed: `'list tools'`, `'read instructions'`, `'connect'` or `"call tool 'x'"`.
    """

    def __init__(self, message: str, capability_id: str = '', url: str | None = None, operation: str = ''):
        super().__init__(message)
        self.capability_id = capability_id
        self.url = url
        self.operation = operation

    def __reduce__(self) -> Any:
        # DBOS pickles a workflow's exception; keep every attribute.
        return (type(self), (self.message, self.capability_id, self.url, self.operation))


@dataclass(frozen=True)
class MCPLeaf:
    """What the guard knows about one MCP leaf toolset.

    Attributes:
        toolset_id: The leaf's id (what durable unit names carry).
        capability_id: The id the `MCP` capability is registered under, or `None` (then it is never gated).
        url: The server URL as configured (credentials included; only ever shown through `redact_url`).
        gated: Whether a deferred capability (the `MCP` itself or a group holding it) decides when it is active.
        attempts: Attempts each unit gets on this engine (for the message), or `None` when unknown.
    """

    toolset_id: str
    capability_id: str | None
    url: str | None
    gated: bool
    attempts: int | None = None


def mcp_leaves(agent: DurableAgent[Any, Any]) -> dict[str, MCPLeaf]:
    """Every MCP leaf of `agent`'s capabilities, keyed by leaf toolset id (definition order)."""
    found: dict[str, MCPLeaf] = {}

    def walk(capability: AbstractCapability[Any], deferred_above: bool) -> None:
        gated = deferred_above or capability.defer_loading is True
        if isinstance(capability, StableIdCapability):
            user = capability.wrapped
            if not isinstance(user, MCP):
                return
            toolset = capability.get_toolset()
            if not isinstance(toolset, AbstractToolset):
                return
            for leaf in collect_leaves(toolset):
                if is_mcp_toolset(leaf) and leaf.id is not None:
                    found.setdefault(leaf.id, MCPLeaf(leaf.id, user.id, user.url, gated))
        elif isinstance(capability, CombinedCapability):
            for member in capability.capabilities:
                walk(member, gated)
        elif isinstance(capability, WrapperCapability):
            walk(capability.wrapped, gated)

    for capability in agent.capabilities:
        walk(capability, False)
    return found


def _scrub(text: str, url: str | None) -> str:
    """`text` with the URL's credentials (user info, query values) replaced by the redacted URL or `***`."""
    if not url:
        return text
    text = text.replace(url, redact_url(url))
    try:
        parts = urlsplit(url)
        secrets = [parts.password, parts.username, *(value for _, value in parse_qsl(parts.query))]
    except ValueError:
        return text
    for secret in secrets:
        if secret and len(secret) >= 3:
            text = text.replace(secret, '***')
    return text


def _summary(error: BaseException, url: str | None, limit: int = 600) -> str:
    """`Type: message` for `error` and its causes, deepest last, duplicates dropped, scrubbed and capped."""
    seen: set[int] = set()
    items: list[str] = []
    current: BaseException | None = error
    while current is not None and id(current) not in seen and len(items) < 6:
        seen.add(id(current))
        message = str(current).strip()
        kind = type(current).__name__
        # Temporal wraps a remote error as `ActivityError('Activity task failed')` around an `ApplicationError`
        # whose message already reads `Type: message`; neither wrapper says anything of its own.
        if kind == 'ActivityError':
            item = ''
        elif kind == 'ApplicationError':
            item = message
        else:
            item = f'{kind}: {message}' if message else kind
        if item and item not in items:
            items.append(item)
        current = current.__cause__ or getattr(current, 'cause', None) or current.__context__
    text = _scrub(' <- '.join(items), url)
    text = re.sub(r'\s+', ' ', text)
    return text if len(text) <= limit else text[: limit - 3] + '...'


@dataclass
class _EntryState:
    """Whether this run entered the wrapped toolset (shared by the copies `for_run_step` makes)."""

    entered: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # tools and instructions may be resolved concurrently


class GuardedMCPToolset(WrapperToolset[Any]):
    """Workflow-side wrapper of one MCP leaf: discovery only once its capability is active, clear errors.

    Entering is lazy for a gated leaf: the wrapped toolset is entered the first time the run needs the
    server, and exited with the run only if it was entered.
    """

    def __init__(self, wrapped: AbstractToolset[Any], guard: MCPGuard, leaf: MCPLeaf, state: _EntryState | None = None):
        super().__init__(wrapped)
        self.guard = guard
        self.leaf = leaf
        self._state = state or _EntryState()

    @property
    def id(self) -> str | None:
        return self.wrapped.id

    @property
    def label(self) -> str:
        return f'GuardedMCPToolset({self.wrapped.label})'

    def _copy(self, wrapped: AbstractToolset[Any], state: _EntryState) -> GuardedMCPToolset:
        return GuardedMCPToolset(wrapped, self.guard, self.leaf, state)

    def visit_and_replace(self, visitor: Callable[[AbstractToolset[Any]], AbstractToolset[Any]]) -> AbstractToolset[Any]:
        # Upstream's durability swaps the leaf for its durable wrapper through here when it runs after us.
        replaced = self.wrapped.visit_and_replace(visitor)
        return self if replaced is self.wrapped else self._copy(replaced, self._state)

    async def for_run(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        # Always a fresh copy: the entry state belongs to one run.
        return self._copy(await self.wrapped.for_run(ctx), _EntryState())

    async def for_run_step(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        wrapped = await self.wrapped.for_run_step(ctx)
        return self if wrapped is self.wrapped else self._copy(wrapped, self._state)

    # ---- gating ---------------------------------------------------------------------------------

    def _active(self, ctx: RunContext[Any]) -> bool:
        if not self.leaf.gated or self.leaf.capability_id is None:
            return True
        if self.guard.upstream_schedule is not None and self.guard.upstream_schedule():
            return True
        if self.leaf.capability_id not in ctx.capabilities:
            return True  # not a capability of this run (e.g. overridden): behave as upstream
        return self.leaf.capability_id in ctx.active_capability_ids

    async def _enter(self) -> None:
        async with self._state.lock:
            if not self._state.entered:
                with self._errors('connect'):
                    await self.wrapped.__aenter__()
                self._state.entered = True

    async def __aenter__(self) -> Self:
        if not self.leaf.gated:
            await self._enter()
        return self

    async def __aexit__(self, *args: object) -> bool | None:
        if not self._state.entered:
            return None
        self._state.entered = False
        return await self.wrapped.__aexit__(*args)

    # ---- errors ---------------------------------------------------------------------------------

    @contextmanager
    def _errors(self, operation: str) -> Iterator[None]:
        try:
            yield
        except _CONTROL_FLOW:
            raise
        except Exception as error:
            if self.guard.passes_through(error):
                raise
            raise self.error(operation, error) from error

    def error(self, operation: str, cause: BaseException) -> MCPCapabilityError:
        """The `MCPCapabilityError` for `operation` failing with `cause` (message scrubbed of credentials)."""
        leaf = self.leaf
        cap = leaf.capability_id or leaf.toolset_id
        where = f' at {redact_url(leaf.url)}' if leaf.url else ''
        tries = f' after {leaf.attempts} attempt{"s" if leaf.attempts != 1 else ""}' if leaf.attempts else ''
        hint = self.guard.retry_hint(leaf.toolset_id)
        message = (
            f'MCP capability {cap!r}: could not {operation} on its server{where}{tries} ({_summary(cause, leaf.url)}). '
            'Check that the server is running and reachable from where the run executes'
            + (f'; attempts are set by `{hint}`.' if hint else '.')
        )
        return MCPCapabilityError(message, cap, redact_url(leaf.url) if leaf.url else None, operation)

    # ---- toolset API ----------------------------------------------------------------------------

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        if not self._active(ctx):
            return {}
        await self._enter()
        with self._errors('list tools'):
            return await self.wrapped.get_tools(ctx)

    async def get_instructions(self, ctx: RunContext[Any]) -> Any:
        if not self._active(ctx):
            return None
        await self._enter()
        with self._errors('read instructions'):
            return await super().get_instructions(ctx)

    async def call_tool(self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]) -> Any:
        await self._enter()
        with self._errors(f'call tool {name!r}'):
            return await self.wrapped.call_tool(name, tool_args, ctx, tool)


def _rebuild(node: AbstractToolset[Any], replace_node: Callable[[AbstractToolset[Any]], AbstractToolset[Any] | None]) -> AbstractToolset[Any]:
    """`node` with each descendant for which `replace_node` returns a toolset replaced by it (copies on the path only).

    Unlike `visit_and_replace`, this also reaches upstream's durable wrappers, which never pass a visitor on.
    """
    replacement = replace_node(node)
    if replacement is not None:
        return replacement
    if isinstance(node, GuardedMCPToolset):
        return node
    if isinstance(node, CombinedToolset):
        children = [_rebuild(child, replace_node) for child in node.toolsets]
        if all(new is old for new, old in zip(children, node.toolsets, strict=True)):
            return node
        return dataclasses.replace(node, toolsets=children)
    if isinstance(node, WrapperToolset):
        child = _rebuild(node.wrapped, replace_node)
        if child is node.wrapped:
            return node
        if dataclasses.is_dataclass(node):
            return dataclasses.replace(node, wrapped=child)
        clone = copy.copy(node)
        clone.wrapped = child
        return clone
    return node


@dataclass
class MCPGuard(AbstractCapability[Any]):
    """Always-on capability installing `GuardedMCPToolset` around every MCP leaf in `leaves`.

    Attributes:
        leaves: `mcp_leaves(agent)`, with `attempts` filled in by the engine adapter.
        engine: Engine name, for messages.
        passes_through: Errors re-raised unchanged (engine control flow such as cancellation).
        upstream_schedule: When it returns True, gated leaves list their tools as upstream does (Temporal:
            a history recorded before the guard existed, so replay schedules the same activities).
        retry_hint: Where a user sets a leaf's attempts, by leaf id (named in the error), or `None`.
    """

    leaves: dict[str, MCPLeaf] = field(default_factory=dict)
    engine: str = 'local'
    passes_through: Callable[[BaseException], bool] = field(default=lambda error: False)
    upstream_schedule: Callable[[], bool] | None = None
    retry_hint: Callable[[str], str | None] = field(default=lambda leaf_id: None)

    def get_wrapper_toolset(self, toolset: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
        if not self.leaves:
            return None

        def guard(node: AbstractToolset[Any]) -> AbstractToolset[Any] | None:
            if isinstance(node, (CombinedToolset, GuardedMCPToolset)):
                return None
            leaf = self.leaves.get(node.id) if node.id is not None else None
            return None if leaf is None else GuardedMCPToolset(node, self, leaf)

        result = _rebuild(toolset, guard)
        return None if result is toolset else result


# ---- per engine: each adapter module merges its retry defaults and calls `guard` -----------------------


def guard(agent: DurableAgent[Any, Any], engine: str, attempts: Callable[[str], int | None]) -> MCPGuard | None:
    """The `MCPGuard` for `agent` on `engine` (`None` when the agent has no MCP capability).

    Args:
        agent: The definition.
        engine: A registered engine's name (its adapter gives the errors that pass through, the retry hint,
            and the replay schedule).
        attempts: Attempts each unit of a leaf gets, by leaf id (for messages only).
    """
    leaves = {key: dataclasses.replace(leaf, attempts=attempts(key)) for key, leaf in mcp_leaves(agent).items()}
    if not leaves:
        return None
    adapter = get(engine)
    return MCPGuard(
        leaves=leaves,
        engine=engine,
        passes_through=adapter.mcp_passes_through,
        upstream_schedule=adapter.mcp_upstream_schedule,
        retry_hint=adapter.mcp_retry_hint,
    )


GUARD_OPTION = 'mcp_guard'
"""Engine option (`DurableAgent(engine_options={engine: {'mcp_guard': False}})`) that leaves MCP as upstream has it:
no guard and no retry defaults."""
