"""The agent `bench_scaleout.py` serves from several `durcap worker dbos` processes. Model: a scripted `FunctionModel`.

Run: `load_capability('io')`, `wait_on_io()` (sleeps `$BENCH_SCALEOUT_TOOL_SECONDS`, default 1 s: a tool waiting on
I/O, no CPU), then the answer.
"""

from __future__ import annotations

import asyncio
import os

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

ANSWER = 'done waiting'


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Load the capability, call the tool once, answer."""
    returned = {p.tool_name for m in messages for p in getattr(m, 'parts', ()) if isinstance(p, ToolReturnPart)}
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'io'})])
    if 'wait_on_io' not in returned:
        return ModelResponse(parts=[ToolCallPart('wait_on_io', {})])
    return ModelResponse(parts=[TextPart(ANSWER)])


io = Capability(id='io', description='Use to wait on I/O.', instructions='Wait once.', defer_loading=True)


@io.tool_plain
async def wait_on_io() -> str:
    """Wait on I/O (sleeps; no CPU). With `$BENCH_SCALEOUT_LEDGER` set, appends this process's pid to that file
    (which worker ran the tool, on engines that do not record it)."""
    await asyncio.sleep(float(os.environ.get('BENCH_SCALEOUT_TOOL_SECONDS', '1')))
    ledger = os.environ.get('BENCH_SCALEOUT_LEDGER')
    if ledger:
        with open(ledger, 'a', encoding='utf-8') as f:
            f.write(f'{os.getpid()}\n')
    return 'waited'


agent = DurableAgent('scaleout', FunctionModel(script), capabilities=[io])
