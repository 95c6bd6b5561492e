"""Shared pieces of `bench_engines.py`: the scripted 6-step run, its tools, and upstream's hand-wired Temporal workflow.

The scripted model makes 6 model requests per run:

    1. load_capability(id='ops')   2. lookup_order   3. check_stock   4. quote_shipping   5. add_note   6. the answer

Every side of the benchmark (durcap and upstream, every engine) builds its own `FunctionModel` and its own
`Capability` from the same functions, so nothing is shared between agents but code.

The upstream Temporal agent and workflow live here, at module level, written the way pydantic-ai's
Temporal docs write them (`Agent(..., capabilities=[TemporalDurability()])`, a `PydanticAIWorkflow`
listing it in `__pydantic_ai_agents__`). The benchmark's upstream worker passes this module through
Temporal's sandbox, as durcap's worker passes `durable_capabilities` through, so both sides run under
the same sandbox configuration.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import Agent, ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

PROMPT = 'Get order A-1 ready to ship to the EU.'
ANSWER = 'Order A-1 is paid, 12 in stock, ships to the EU for 4.50; note added.'
INSTRUCTIONS = 'You are an order-operations agent.'
CAPABILITY_ID = 'ops'
MODEL_REQUESTS = 6

# The tool calls the model makes, in order (the 6th response is the answer).
STEPS: tuple[tuple[str, dict[str, Any]], ...] = (
    ('load_capability', {'id': CAPABILITY_ID}),
    ('lookup_order', {'order_id': 'A-1'}),
    ('check_stock', {'sku': 'SKU-9'}),
    ('quote_shipping', {'order_id': 'A-1', 'zone': 'EU'}),
    ('add_note', {'order_id': 'A-1', 'text': 'ready to ship'}),
)
TOOL_NAMES = tuple(name for name, _ in STEPS[1:])


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Deterministic: the next step is the number of tool returns already in the history."""
    done = sum(1 for m in messages for p in getattr(m, 'parts', ()) if isinstance(p, ToolReturnPart))
    if done < len(STEPS):
        name, args = STEPS[done]
        return ModelResponse(parts=[ToolCallPart(name, dict(args), tool_call_id=f'call-{done}')])
    return ModelResponse(parts=[TextPart(ANSWER)])


def make_model() -> FunctionModel:
    return FunctionModel(script)


def lookup_order(order_id: str) -> dict[str, str]:
    """Look up an order."""
    return {'order_id': order_id, 'status': 'paid', 'sku': 'SKU-9'}


def check_stock(sku: str) -> int:
    """Units in stock for a SKU."""
    return 12


def quote_shipping(order_id: str, zone: str) -> float:
    """Shipping price for an order to a zone."""
    return 4.5


def add_note(order_id: str, text: str) -> str:
    """Add a note to an order."""
    return f'noted on {order_id}'


TOOLS = (lookup_order, check_stock, quote_shipping, add_note)


def make_capability(tools: Sequence[Any] = TOOLS) -> Capability[Any]:
    """The one deferred capability. `Capability(tools=...)` has the id `ops` upstream too: it runs on every engine.
    `tools`: the same four tools wrapped some other way (e.g. each a `@DBOS.step`)."""
    return Capability(
        id=CAPABILITY_ID,
        description='Order operations: look orders up, check stock, quote shipping, add notes.',
        instructions='Look the order up before anything else.',
        defer_loading=True,
        tools=list(tools),
    )


def dbos_step_tools(prefix: str) -> list[Any]:
    """The four tools each decorated with `@DBOS.step` (named `{prefix}.{tool}`), as DBOS's docs tell a user to make
    a function a step, with the retry policy durcap's tool steps default to (`engines.dbos.ToolStepConfig`: 3
    attempts, 1 s then 2 s apart). Call before `DBOS.launch()`."""
    from dbos import DBOS

    return [DBOS.step(name=f'{prefix}.{tool.__name__}', retries_allowed=True, max_attempts=3, interval_seconds=1.0,
                      backoff_rate=2.0)(tool) for tool in TOOLS]


def upstream_agent(name: str, durability: Any | None, tools: Sequence[Any] = TOOLS) -> Agent[None, str]:
    """The hand-wired upstream agent: the same model, instructions and capability, plus upstream's durability."""
    capabilities: list[Any] = [make_capability(tools)]
    if durability is not None:
        capabilities.append(durability)
    return Agent(make_model(), name=name, instructions=INSTRUCTIONS, capabilities=capabilities)


def check_messages(messages: Sequence[ModelMessage] | Sequence[dict[str, Any]]) -> None:
    """Raise unless `messages` (objects or pydantic-ai message JSON) is one complete scripted run: 6 model
    responses, every tool returned."""
    if messages and isinstance(messages[0], dict):
        from pydantic_ai.messages import ModelMessagesTypeAdapter

        messages = ModelMessagesTypeAdapter.validate_python(messages)
    responses = [m for m in messages if m.kind == 'response']
    returned = [p.tool_name for m in messages for p in getattr(m, 'parts', ()) if isinstance(p, ToolReturnPart)]
    if len(responses) != MODEL_REQUESTS or returned != [name for name, _ in STEPS]:
        raise AssertionError(f'not the scripted run: {len(responses)} responses, tool returns {returned}')


# ---- statistics -----------------------------------------------------------------------------------


@dataclass
class Series:
    """Wall-clock seconds of repeated runs of one variant."""

    label: str
    seconds: list[float] = field(default_factory=list)
    cpu_seconds: list[float] = field(default_factory=list)
    """CPU time of this whole process (every thread) during each run: what the run cost here, whatever the
    servers and other processes on the machine were doing."""

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu_seconds)

    def quartiles(self) -> tuple[float, float]:
        q = statistics.quantiles(self.seconds, n=4, method='inclusive')
        return q[0], q[2]


def paired_ratio(a: Series, b: Series) -> float:
    """Median of per-round ratios a[i] / b[i] (rounds are interleaved, so each pair saw the same conditions)."""
    return statistics.median(x / y for x, y in zip(a.seconds, b.seconds, strict=True))


# ---- upstream on Temporal, as pydantic-ai's docs write it -------------------------------------------

try:
    from pydantic_ai.durable_exec.temporal import PydanticAIWorkflow, TemporalDurability
    from temporalio import workflow
    from temporalio.activity import defn as activity_defn
except ImportError:  # pragma: no cover - temporal extra not installed
    pass
else:
    UPSTREAM_TEMPORAL_AGENT = upstream_agent('bench_up_temporal', TemporalDurability())

    @workflow.defn(name='bench.upstream')
    class UpstreamWorkflow(PydanticAIWorkflow):
        __pydantic_ai_agents__ = [UPSTREAM_TEMPORAL_AGENT]  # noqa: RUF012 - as upstream's docs write it

        @workflow.run
        async def run(self, prompt: str) -> str:
            result = await UPSTREAM_TEMPORAL_AGENT.run(prompt)
            return result.output

    @activity_defn(name='bench.noop')
    async def noop_activity(i: int) -> int:
        """The floor's activity: does nothing but return its argument."""
        return i

    @workflow.defn(name='bench.floor')
    class FloorWorkflow:
        """The Temporal floor of a run: `count` no-op activities one after another (no agent, no model)."""

        @workflow.run
        async def run(self, count: int) -> int:
            from datetime import timedelta

            for i in range(count):
                await workflow.execute_activity(noop_activity, i, start_to_close_timeout=timedelta(seconds=60))
            return count
