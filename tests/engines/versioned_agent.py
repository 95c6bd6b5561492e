"""One agent in two deploy versions for Worker Versioning tests, chosen by `$DURCAP_VERSIONED_VARIANT`.

Model: a scripted `FunctionModel`. `v1` has capability `orders`; `v2` renamed it `orders-v2` without an alias,
so its activity names (and its derived build id) differ: a v2 worker cannot run a v1 run's tool activity. The
script loads the capability, calls `hold`, then `record`, then answers `done {run}` (the run is the prompt's
last word). `hold` waits until `$DURCAP_CRASH_DIR/release-{run}` exists when the prompt starts with `wait`.
Every model request and tool appends `{run} {variant} {what}` to `$DURCAP_CRASH_DIR/ledger`, so a test sees
which worker version ran each step. The agent name is `$DURCAP_VERSIONED_AGENT`.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

VARIANT = os.environ.get('DURCAP_VERSIONED_VARIANT', 'v1')
CAP_ID = 'orders' if VARIANT == 'v1' else 'orders-v2'


def _dir() -> Path:
    path = Path(os.environ['DURCAP_CRASH_DIR'])
    path.mkdir(parents=True, exist_ok=True)
    return path


def _log(run: str, what: str) -> None:
    with open(_dir() / 'ledger', 'a', encoding='utf-8') as f:
        f.write(f'{run} {VARIANT} {what}\n')


def _prompt(messages: list[ModelMessage]) -> str:
    return next(str(p.content) for m in messages if isinstance(m, ModelRequest) for p in m.parts
                if isinstance(p, UserPromptPart))


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompt = _prompt(messages)
    run = prompt.split()[-1]
    _log(run, 'model')
    returned = [p.tool_name for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': CAP_ID})])
    if 'hold' not in returned:
        return ModelResponse(parts=[ToolCallPart('hold', {'run': run, 'wait': prompt.startswith('wait')})])
    if 'record' not in returned:
        return ModelResponse(parts=[ToolCallPart('record', {'run': run})])
    return ModelResponse(parts=[TextPart(f'done {run}')])


orders = Capability(id=CAP_ID, description='Orders.', defer_loading=True)


@orders.tool_plain
async def hold(run: str, wait: bool) -> str:
    """Hold the run until the test releases it (when `wait`)."""
    _log(run, 'hold')
    (_dir() / f'held-{run}').write_text('1')
    while wait and not (_dir() / f'release-{run}').exists():
        await asyncio.sleep(0.1)  # the test's release is a file; upstream heartbeats the activity meanwhile
    return 'held'


@orders.tool_plain
async def record(run: str) -> str:
    """Record the run (the step after the hold)."""
    _log(run, 'record')
    return 'recorded'


agent = DurableAgent(os.environ.get('DURCAP_VERSIONED_AGENT', 'versioned'), FunctionModel(script), capabilities=[orders])
