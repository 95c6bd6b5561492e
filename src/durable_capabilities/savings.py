"""What deferral saves: per deferred capability, its always-on prompt cost against its catalog entry.

A deferred capability costs one catalog line per request (`- {id}: {description}`, the format
pydantic-ai renders under its "The following capabilities are deferred ..." header) until the model
loads it. Always on, it would cost its instructions plus the JSON schemas of its tools on every
request. `measure_savings` counts both, in tokens:

- with the model's own counter (`Model.count_tokens`, a provider endpoint) when the agent's model
  offers one and the call succeeds; each figure is the difference between a one-word request with the
  text (or tools) and the same request without;
- otherwise with an estimate of `ceil(UTF-8 bytes / 4)` per text, tool schemas serialized as compact
  JSON of `{name, description, parameters}`. Every estimated figure is labelled as such.

What cannot be known without running the agent is reported as not counted, never guessed: tools of
MCP servers and toolset functions ("unknown (dynamic)"), instruction and description callables or
templates, provider-side native tools. The fixed catalog header and the `load_capability` tool, paid
once per request whenever any capability is deferred, are not included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import AbstractCapability, WrapperCapability
from pydantic_ai.messages import InstructionPart, ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models import Model, ModelRequestParameters, infer_model
from pydantic_ai.tools import ToolDefinition
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset
from pydantic_ai.usage import RunUsage

logger = logging.getLogger(__name__)

ESTIMATE_METHOD = 'estimate: ceil(UTF-8 bytes / 4) per text; tool schemas as compact JSON of name, description, parameters'
"""How estimated counts are made; printed with every estimated result."""

MODEL_COUNT_TIMEOUT = 20.0
"""Seconds one `Model.count_tokens` call may take before the whole measurement falls back to the estimate."""

UNKNOWN_TOOLS = 'unknown (dynamic)'


@dataclass
class CapabilitySavings:
    """The prompt cost of one deferred capability. All counts are in tokens.

    Attributes:
        id: The capability id (`'<no id>'` if it has none).
        kind: The capability's class name.
        instruction_tokens: Its static instructions, as sent when always on.
        tool_count: How many tools it exposes, or `None` when they are only known at run time.
        tool_schema_tokens: Their JSON schemas, or `None` when unknown (dynamic).
        catalog_entry: Its one-line catalog entry (`- {id}: {description}`).
        catalog_tokens: The cost of that line.
        not_counted: What could not be counted statically (dynamic instructions, MCP tools, ...).
    """

    id: str
    kind: str
    instruction_tokens: int
    tool_count: int | None
    tool_schema_tokens: int | None
    catalog_entry: str
    catalog_tokens: int
    not_counted: list[str] = field(default_factory=list)

    @property
    def always_on_tokens(self) -> int:
        """Instructions plus tool schemas (a lower bound when the tools are unknown)."""
        return self.instruction_tokens + (self.tool_schema_tokens or 0)

    @property
    def saved_tokens(self) -> int:
        """Tokens saved on each request while the capability is not loaded: always-on cost minus catalog line."""
        return self.always_on_tokens - self.catalog_tokens


@dataclass
class SavingsReport:
    """`measure_savings`' result for one agent.

    Attributes:
        agent: The agent name.
        estimated: True when counts use the estimate rather than the model's own counter.
        method: `ESTIMATE_METHOD`, or the model counter used (`'AnthropicModel.count_tokens'`).
        fallback_reason: Why the model's counter was not used (`None` when it was, or when not asked).
        capabilities: One row per deferred capability, in definition order.
        first_request: The agent's first model request with capabilities deferred and always on, counted the
            same way (`compare_first_request`): its `saved_tokens` is the per-request figure `durcap demo`
            prints. `None` when the agent could not run locally without deps (`first_request_error` says why).
        first_request_error: Why `first_request` is `None`.
    """

    agent: str
    estimated: bool
    method: str
    fallback_reason: str | None
    capabilities: list[CapabilitySavings]
    first_request: FirstRequest | None = None
    first_request_error: str | None = None

    @property
    def fixed_cost_tokens(self) -> int | None:
        """What deferring costs on every request whatever is deferred (the catalog header and the
        `load_capability` tool): the per-capability total minus the first request's saving. `None` without
        a first request."""
        if self.first_request is None:
            return None
        return self.totals()['saved_tokens'] - self.first_request.saved_tokens

    @property
    def complete(self) -> bool:
        """False when some tool list is unknown or something was not counted: totals are lower bounds."""
        return all(c.tool_schema_tokens is not None and not c.not_counted for c in self.capabilities)

    def totals(self) -> dict[str, int]:
        """Sums over the capabilities: `instruction_tokens`, `tool_schema_tokens`, `always_on_tokens`,
        `catalog_tokens`, `saved_tokens`, and `tool_count` (known tools only)."""
        rows = self.capabilities
        return {
            'tool_count': sum(c.tool_count or 0 for c in rows),
            'instruction_tokens': sum(c.instruction_tokens for c in rows),
            'tool_schema_tokens': sum(c.tool_schema_tokens or 0 for c in rows),
            'always_on_tokens': sum(c.always_on_tokens for c in rows),
            'catalog_tokens': sum(c.catalog_tokens for c in rows),
            'saved_tokens': sum(c.saved_tokens for c in rows),
        }

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; `tool_schema_tokens: null` with `tools: "unknown (dynamic)"` marks unknown tools."""
        rows = []
        for c in self.capabilities:
            row = asdict(c) | {'always_on_tokens': c.always_on_tokens, 'saved_tokens': c.saved_tokens}
            if c.tool_count is None:
                row['tools'] = UNKNOWN_TOOLS
            rows.append(row)
        return {
            'agent': self.agent,
            'unit': 'tokens',
            'estimated': self.estimated,
            'method': self.method,
            'fallback_reason': self.fallback_reason,
            'complete': self.complete,
            'capabilities': rows,
            'totals': self.totals(),
            'first_request': None if self.first_request is None else asdict(self.first_request)
            | {'saved_tokens': self.first_request.saved_tokens},
            'first_request_error': self.first_request_error,
            'fixed_cost_tokens': self.fixed_cost_tokens,
        }


# ---- what a capability would put in the prompt ------------------------------------------------


@dataclass
class _Static:
    cap: AbstractCapability[Any]
    id: str
    instructions: str | None
    tools: list[ToolDefinition] | None
    entry: str
    not_counted: list[str]


def deferred_capabilities(capabilities: Sequence[AbstractCapability[Any]]) -> list[AbstractCapability[Any]]:
    """Every capability registered with `defer_loading=True`, in definition order.

    A deferred group counts once, members included; deferred members inside it are not listed again.
    """
    result: list[AbstractCapability[Any]] = []
    inside: set[int] = set()
    for top in capabilities:
        registered: list[AbstractCapability[Any]] = []
        top.apply(registered.append)
        for cap in registered:
            if id(cap) in inside or cap.defer_loading is not True:
                continue
            result.append(cap)
            members: list[AbstractCapability[Any]] = []
            cap.apply(members.append)
            inside.update(id(m) for m in members)
    return result


def _instruction_texts(value: Any, dynamic: list[str]) -> list[str]:
    """Static texts in an `AgentInstructions` value; callables and templates are noted in `dynamic`."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value.strip() else []
    if isinstance(value, InstructionPart):
        return [value.content] if value.content.strip() else []
    if isinstance(value, (list, tuple)):
        return [text for item in value for text in _instruction_texts(item, dynamic)]
    dynamic.append(f'dynamic instructions ({getattr(value, "__name__", type(value).__name__)})')
    return []


async def _static_tools(toolset: Any) -> list[ToolDefinition] | None:
    """Tool definitions known without running the agent, or `None` when only a run can list them."""
    if toolset is None:
        return []
    if not isinstance(toolset, AbstractToolset):
        return None  # a toolset function, called per run
    leaves: list[AbstractToolset[Any]] = []
    toolset.apply(leaves.append)
    if not all(isinstance(leaf, FunctionToolset) for leaf in leaves):
        return None  # MCP servers, dynamic or external toolsets
    from pydantic_ai.models.test import TestModel  # imported when counting, not by `durcap --help`

    ctx = RunContext(deps=None, model=TestModel(), usage=RunUsage())
    try:
        tools = await toolset.get_tools(ctx)
    except Exception:  # noqa: BLE001 - a `prepare` that needs real deps: only a run can tell
        return None
    return [tool.tool_def for tool in tools.values()]


async def _collect(cap: AbstractCapability[Any]) -> _Static:
    cap_id = cap.id if cap.id is not None else '<no id>'
    not_counted: list[str] = []
    texts = _instruction_texts(cap.get_instructions(), not_counted)
    tools = await _static_tools(cap.get_toolset())
    if tools is None:
        not_counted.append(f'tools: {UNKNOWN_TOOLS}')
    if cap.get_native_tools():
        not_counted.append('native (provider-side) tools')
    description = cap.get_description()
    if description is None:
        entry = f'- {cap_id}'
    elif isinstance(description, str):
        entry = f'- {cap_id}: {description}'
    else:
        entry = f'- {cap_id}: '
        not_counted.append('dynamic description in the catalog entry')
    return _Static(cap, cap_id, '\n\n'.join(texts) or None, tools, entry, not_counted)


# ---- counting -------------------------------------------------------------------------------


def estimate_tokens(text: str) -> int:
    """Estimated tokens in `text`: `ceil(len(text.encode('utf-8')) / 4)`; 0 for an empty string."""
    return math.ceil(len(text.encode('utf-8')) / 4)


def tool_schema_json(tool: ToolDefinition) -> str:
    """The compact JSON the estimate counts for one tool: `{"name", "description", "parameters"}`."""
    payload = {'name': tool.name, 'description': tool.description or '', 'parameters': tool.parameters_json_schema}
    return json.dumps(payload, separators=(',', ':'), ensure_ascii=False)


class _Estimator:
    async def text(self, text: str | None) -> int:
        return estimate_tokens(text) if text else 0

    async def tools(self, tools: list[ToolDefinition]) -> int:
        return sum(estimate_tokens(tool_schema_json(t)) for t in tools)


class _ModelCounter:
    """Counts with `Model.count_tokens`: a request with the text or tools minus the same request without."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self._baseline: int | None = None

    async def _count(self, instructions: str | None, tools: list[ToolDefinition]) -> int:
        messages: list[Any] = [ModelRequest(parts=[UserPromptPart('Hi')], instructions=instructions)]
        params = ModelRequestParameters(function_tools=list(tools))
        usage = await asyncio.wait_for(self.model.count_tokens(messages, None, params), MODEL_COUNT_TIMEOUT)
        return usage.input_tokens

    async def _delta(self, instructions: str | None, tools: list[ToolDefinition]) -> int:
        if self._baseline is None:
            self._baseline = await self._count(None, [])
        return max(0, await self._count(instructions, tools) - self._baseline)

    async def text(self, text: str | None) -> int:
        return await self._delta(text, []) if text else 0

    async def tools(self, tools: list[ToolDefinition]) -> int:
        return await self._delta(None, tools) if tools else 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f'{type(exc).__name__}: {text[0]}' if text else type(exc).__name__


def _model_counter(model: Any) -> tuple[_ModelCounter | None, str]:
    """The model's own counter, or `None` and why not."""
    if model is None:
        return None, 'the agent has no model'
    if not isinstance(model, Model):
        try:
            model = infer_model(model)
        except Exception as exc:  # noqa: BLE001 - missing provider package or credentials
            return None, f'cannot construct model {model!r} here ({_one_line(exc)})'
    if type(model).count_tokens is Model.count_tokens:
        return None, f'{type(model).__name__} has no token counting'
    return _ModelCounter(model), f'{type(model).__name__}.count_tokens'


async def _measure(statics: list[_Static], counter: Any) -> list[CapabilitySavings]:
    rows = []
    for s in statics:
        rows.append(
            CapabilitySavings(
                id=s.id,
                kind=type(s.cap).__name__,
                instruction_tokens=await counter.text(s.instructions),
                tool_count=None if s.tools is None else len(s.tools),
                tool_schema_tokens=None if s.tools is None else await counter.tools(s.tools),
                catalog_entry=s.entry,
                catalog_tokens=await counter.text(s.entry),
                not_counted=s.not_counted,
            )
        )
    return rows


async def measure_savings_async(agent: Any, *, use_model: bool = True) -> SavingsReport:
    """Async form of `measure_savings` (same arguments, result and errors)."""
    statics = [await _collect(cap) for cap in deferred_capabilities(agent.user_capabilities)]
    reason: str | None = None
    if use_model:
        counter, detail = _model_counter(agent.model)
        if counter is not None:
            try:
                rows = await _measure(statics, counter)
                report = SavingsReport(agent.name, False, detail, None, rows)
                return await _with_first_request(report, agent, counter)
            except Exception as exc:  # noqa: BLE001 - network, credentials, unsupported: fall back
                reason = f'{detail} failed ({_one_line(exc)})'
        else:
            reason = detail
    rows = await _measure(statics, _Estimator())
    return await _with_first_request(SavingsReport(agent.name, True, ESTIMATE_METHOD, reason, rows), agent, _Estimator())


async def _with_first_request(report: SavingsReport, agent: Any, counter: Any) -> SavingsReport:
    try:
        report.first_request = await _first_request(agent, FIRST_REQUEST_PROMPT, None, counter, report.method)
    except Exception as exc:  # noqa: BLE001 - an instruction or hook that needs deps: say so, keep the table
        report.first_request_error = f'the agent did not run locally without deps ({_one_line(exc)})'
    return report


def measure_savings(agent: Any, *, use_model: bool = True) -> SavingsReport:
    """Count what deferral saves for each deferred capability of `agent` (a `DurableAgent`).

    Args:
        agent: A constructed `DurableAgent` (anything with `name`, `model` and `user_capabilities`).
        use_model: Try the model's own token counter first (a provider call per figure, each bounded
            by `MODEL_COUNT_TIMEOUT` seconds). False uses the estimate without any network access.

    Returns:
        A `SavingsReport` with counts in tokens. When the model's counter is unavailable or fails,
        every count is an estimate, `estimated` is True and `fallback_reason` says why.

    Raises:
        Nothing for an unusual capability: what cannot be counted statically is listed in
        `not_counted`. Must not be called from a running event loop (use `measure_savings_async`).
    """
    return asyncio.run(measure_savings_async(agent, use_model=use_model))


# ---- the first request, deferred against always on --------------------------------------------


FIRST_REQUEST_PROMPT = 'Hello'
"""The prompt `durcap savings` measures the first request with. It is counted on both sides alike (a text of
its own), so the saving does not depend on it: `durcap demo` gets the same saving with its own prompt."""


@dataclass
class FirstRequest:
    """Prompt tokens of a run's first model request, with capabilities deferred and always on.

    Attributes:
        deferred_tokens: Instructions (catalog included) + tool schemas + prompt, as defined.
        always_on_tokens: The same with every capability always on (its instructions and tools sent).
        deferred_tools: Tool names offered with deferral (`load_capability` and agent-level tools).
        always_on_tools: Tool names offered with every capability always on.
        method: How tokens were counted: `ESTIMATE_METHOD` or the model's counter (`'AnthropicModel.count_tokens'`).
    """

    deferred_tokens: int
    always_on_tokens: int
    deferred_tools: list[str]
    always_on_tools: list[str]
    method: str = ESTIMATE_METHOD

    @property
    def ratio(self) -> float:
        """`deferred_tokens / always_on_tokens`."""
        return self.deferred_tokens / self.always_on_tokens if self.always_on_tokens else 1.0

    @property
    def saved_tokens(self) -> int:
        """Tokens deferral saves on every request while nothing is loaded: `always_on_tokens - deferred_tokens`."""
        return self.always_on_tokens - self.deferred_tokens

    @property
    def estimated(self) -> bool:
        """True when the counts are the estimate, not the model's own counter."""
        return self.method == ESTIMATE_METHOD


async def compare_first_request(agent: Any, prompt: str, *, deps: Any = None, use_model: bool = True) -> FirstRequest:
    """Capture the first request the model would get, as defined and with every capability always on, and count both.

    Nothing is sent to the agent's model to run: both agents run locally with a `FunctionModel` that records
    its first request and answers at once. Tokens are counted per part (the instructions, the prompt, the
    tool schemas) with the agent's model's own counter when it has one and `use_model` (as `measure_savings`
    does; a provider call per part, bounded by `MODEL_COUNT_TIMEOUT` seconds each), else with
    `estimate_tokens` / `tool_schema_json`. `durcap demo` and `durcap savings` print this same figure.

    Args:
        agent: A `DurableAgent` (anything with `instructions`, `deps_type`, `tools`, `capabilities`, `model`).
        prompt: The user prompt of the first request.
        deps: The run's deps, for instructions or hooks that read them.
        use_model: Try the model's counter first; False always estimates (no network).

    Returns:
        A `FirstRequest`; `method` says how it was counted.

    Raises:
        Whatever the agent's own instructions, hooks or tools raise when run with `deps`.
    """
    if use_model:
        counter, detail = _model_counter(agent.model)
        if counter is not None:
            try:
                return await _first_request(agent, prompt, deps, counter, detail)
            except Exception as exc:  # noqa: BLE001 - the counter failed (network, credentials): estimate instead
                logger.info('%s failed (%s); the first request is estimated', detail, _one_line(exc))
    return await _first_request(agent, prompt, deps, _Estimator(), ESTIMATE_METHOD)


async def _first_request(agent: Any, prompt: str, deps: Any, counter: Any, method: str) -> FirstRequest:
    from pydantic_ai.models.function import AgentInfo, FunctionModel
    async def first_request(capabilities: list[Any]) -> tuple[int, list[str]]:
        seen: list[tuple[str, list[ToolDefinition]]] = []

        def capture(messages: list[Any], info: AgentInfo) -> ModelResponse:
            seen.append((info.instructions or '', list(info.function_tools)))
            return ModelResponse(parts=[TextPart('ok')])

        local = Agent(
            FunctionModel(capture), instructions=agent.instructions, deps_type=agent.deps_type,
            tools=agent.tools, capabilities=capabilities,
        )
        await local.run(prompt, deps=deps)
        instructions, tools = seen[0]
        tokens = await counter.text(instructions) + await counter.text(prompt) + await counter.tools(tools)
        return tokens, sorted(t.name for t in tools)

    deferred_tokens, deferred_tools = await first_request(agent.capabilities)
    # An explicit id on the wrapper keeps it from adopting the wrapped capability's deferral.
    always_on = [
        WrapperCapability(wrapped=c, id=c.id, defer_loading=False) if c.defer_loading and c.id else c
        for c in agent.capabilities
    ]
    always_tokens, always_tools = await first_request(always_on)
    return FirstRequest(deferred_tokens, always_tokens, deferred_tools, always_tools, method)
