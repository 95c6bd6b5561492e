"""An agent for crash tests. Model: a scripted `FunctionModel` (no provider).

Side effects and model requests are logged to files under `$DURCAP_CRASH_DIR`, so a test can count
them across killed and restarted processes:
- `charges`: one line per execution of the `charge` tool (the side effect that must happen once);
- `model-requests`: one line per model request, holding the number of model responses already in
  the history (a request from before the crash that runs again shows up as a repeated number);
- `slow-started`: created by the first execution of `slow_export` (holding its pid), which then sleeps so the
  test can kill the process; later executions find it and return at once;
- `exports`: one line per execution of `slow_export` (started), holding the pid of the process that ran it.
With `$DURCAP_CRASH_BUDGET` set, the agent has a run-scoped `Budget` no run reaches (its ledger counts the requests).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import Budget, DurableAgent


def _dir() -> Path:
    path = Path(os.environ['DURCAP_CRASH_DIR'])
    path.mkdir(parents=True, exist_ok=True)
    return path


def _append(name: str, line: str) -> None:
    with open(_dir() / name, 'a', encoding='utf-8') as f:
        f.write(line + '\n')
        f.flush()
        os.fsync(f.fileno())


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    responses = sum(1 for m in messages if m.kind == 'response')
    _append('model-requests', str(responses))
    returned = [p.tool_name for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'ops'})])
    if 'charge' not in returned:
        return ModelResponse(parts=[ToolCallPart('charge', {'order_id': 'A-1'})])
    if 'slow_export' not in returned:
        return ModelResponse(parts=[ToolCallPart('slow_export', {})])
    return ModelResponse(parts=[TextPart('charged and exported')])


ops = Capability(id='ops', description='Use for charging and exporting orders.', instructions='Charge first.', defer_loading=True)


@ops.tool_plain
async def charge(order_id: str) -> str:
    """Charge an order (a side effect that must happen exactly once)."""
    _append('charges', order_id)
    return f'charged {order_id}'


@ops.tool_plain
async def slow_export() -> str:
    """Export the orders (slow the first time, so the test can kill the process mid-tool)."""
    _append('exports', str(os.getpid()))
    marker = _dir() / 'slow-started'
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        await asyncio.sleep(300)
    return 'exported'


def _engine_options() -> dict:
    if not os.environ.get('DURCAP_CRASH_UPSTREAM_PREFECT_CACHE'):
        return {}
    # Upstream's own cache policy for model requests, to show the gap `DeterministicInputs` closes.
    from pydantic_ai.durable_exec.prefect import DEFAULT_PYDANTIC_AI_CACHE_POLICY

    return {'prefect': {'model_task_config': {'cache_policy': DEFAULT_PYDANTIC_AI_CACHE_POLICY}}}


agent = DurableAgent(
    os.environ.get('DURCAP_CRASH_AGENT', 'crashy'), FunctionModel(script), capabilities=[ops], engine_options=_engine_options(),
    # `$DURCAP_CRASH_BUDGET=1`: a run-scoped budget no run reaches, so the ledger counts every model request (test_budgets).
    budget=Budget(total_tokens=10**9, scope='run') if os.environ.get('DURCAP_CRASH_BUDGET') else None,
)
