"""The agent `bench_scaleout.py` serves from several worker processes (DBOS, Temporal, Prefect). Model: a scripted
`FunctionModel`.

Run: `load_capability('io')`, `wait_on_io(key=<the prompt>)` (sleeps `$BENCH_SCALEOUT_TOOL_SECONDS`, default 1 s: a
tool waiting on I/O, no CPU), then the answer. The bench gives every run its own prompt (its key), so the tool's
ledger says which run each side effect belongs to.

Ledger (`$BENCH_SCALEOUT_LEDGER`, one line per event, appended): `start KEY PID PPID UNIX_TIME` when the tool starts,
`done KEY PID PPID UNIX_TIME` when its side effect is done (just before it returns). PID is the process running the
tool (the worker on Temporal and DBOS; on Prefect the flow run's own process, whose parent PPID is the serving
process).
"""

from __future__ import annotations

import asyncio
import os
import time

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

ANSWER = 'done waiting'
LEDGER_ENV = 'BENCH_SCALEOUT_LEDGER'
SECONDS_ENV = 'BENCH_SCALEOUT_TOOL_SECONDS'


def _prompt(messages: list[ModelMessage]) -> str:
    for m in messages:
        for p in getattr(m, 'parts', ()):
            if isinstance(p, UserPromptPart) and isinstance(p.content, str):
                return p.content
    return ''


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Load the capability, call the tool once with the prompt as its key, answer."""
    returned = {p.tool_name for m in messages for p in getattr(m, 'parts', ()) if isinstance(p, ToolReturnPart)}
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'io'})])
    if 'wait_on_io' not in returned:
        return ModelResponse(parts=[ToolCallPart('wait_on_io', {'key': _prompt(messages)})])
    return ModelResponse(parts=[TextPart(ANSWER)])


io = Capability(id='io', description='Use to wait on I/O.', instructions='Wait once.', defer_loading=True)


def _log(event: str, key: str) -> None:
    ledger = os.environ.get(LEDGER_ENV)
    if ledger:
        with open(ledger, 'a', encoding='utf-8') as f:  # one short append per line: lines never interleave
            f.write(f'{event} {key or "-"} {os.getpid()} {os.getppid()} {time.time():.3f}\n')


@io.tool_plain
async def wait_on_io(key: str = '') -> str:
    """Wait on I/O (sleeps `$BENCH_SCALEOUT_TOOL_SECONDS`; no CPU). `key`: the run's key (its prompt), written to the
    ledger (`$BENCH_SCALEOUT_LEDGER`, see the module docstring) with this process's pid at start and at the end."""
    _log('start', key)
    await asyncio.sleep(float(os.environ.get(SECONDS_ENV, '1')))
    _log('done', key)
    return 'waited'


agent = DurableAgent('scaleout', FunctionModel(script), capabilities=[io])
