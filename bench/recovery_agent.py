"""The agent `bench_recovery.py` serves from two `durcap worker temporal` processes. Model: a scripted `FunctionModel`.

Run: `load_capability('ops')`, `charge(order_id)` (the counted side effect), `slow_export()` (3 s, the tool whose
worker the benchmark kills), then the answer. Every tool execution appends one line to a ledger file under
`$BENCH_RECOVERY_DIR` (`<event> <order> <pid> <wall-clock seconds>`), fsynced, so the benchmark can read across killed
processes when and where each execution started and finished.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

TOOL_SECONDS = 3.0
ANSWER = 'charged and exported'


def ledger(event: str, order_id: str) -> None:
    """Append `<event> <order_id> <pid> <time.time()>` to `$BENCH_RECOVERY_DIR/ledger`."""
    path = Path(os.environ['BENCH_RECOVERY_DIR']) / 'ledger'
    with open(path, 'a', encoding='utf-8') as f:
        f.write(f'{event} {order_id} {os.getpid()} {time.time():.6f}\n')
        f.flush()
        os.fsync(f.fileno())


def _order(messages: list[ModelMessage]) -> str:
    first = messages[0]
    return str(getattr(first, 'parts', [None])[-1].content).split()[-1]  # prompt: 'charge and export ORDER'


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    returned = [p.tool_name for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    order = _order(messages)
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'ops'})])
    if 'charge' not in returned:
        return ModelResponse(parts=[ToolCallPart('charge', {'order_id': order})])
    if 'slow_export' not in returned:
        return ModelResponse(parts=[ToolCallPart('slow_export', {'order_id': order})])
    return ModelResponse(parts=[TextPart(ANSWER)])


ops = Capability(id='ops', description='Charge and export orders.', instructions='Charge first.', defer_loading=True)


@ops.tool_plain
async def charge(order_id: str) -> str:
    """Charge an order: the side effect the benchmark counts."""
    ledger('charge', order_id)
    return f'charged {order_id}'


@ops.tool_plain
async def slow_export(order_id: str) -> str:
    """Export an order: takes `TOOL_SECONDS` every time it runs."""
    ledger('export-start', order_id)
    await asyncio.sleep(TOOL_SECONDS)
    ledger('export-done', order_id)
    return 'exported'


agent = DurableAgent('bench-recovery', FunctionModel(script), capabilities=[ops])
