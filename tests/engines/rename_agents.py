"""One agent in the variants a deploy may ship, chosen by `$DURCAP_RENAME_VARIANT`.

Model: a scripted `FunctionModel`. Variants: `v1` (capability `greet`, agent `$DURCAP_RENAME_AGENT`),
`v2` (capability renamed `greet-v2`, no alias), `v2-alias` (renamed, with `aliases={'greet-v2': 'greet'}`),
`agent-v2` / `agent-v2-alias` (agent renamed to `<name>-v2`, without / with `previous_names`).
Tool side effects are logged to `$DURCAP_CRASH_DIR` like `crash_agent.py`; `slow` sleeps the first time.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

VARIANT = os.environ.get('DURCAP_RENAME_VARIANT', 'v1')
BASE_NAME = os.environ.get('DURCAP_RENAME_AGENT', 'greeter')
CAP_ID = 'greet' if VARIANT in ('v1', 'agent-v2', 'agent-v2-alias') else 'greet-v2'


def _log(name: str, line: str) -> None:
    directory = Path(os.environ.get('DURCAP_CRASH_DIR', '.durcap/rename'))
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / name, 'a', encoding='utf-8') as f:
        f.write(line + '\n')


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    _log('model-requests', str(sum(1 for m in messages if m.kind == 'response')))
    returned = [p.tool_name for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    if 'load_capability' not in returned:
        # Loads by the id of the variant the run started with: a recorded history keeps `greet`.
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': CAP_ID})])
    if 'hello' not in returned:
        return ModelResponse(parts=[ToolCallPart('hello', {'name': 'ada'})])
    if 'slow' not in returned:
        return ModelResponse(parts=[ToolCallPart('slow', {})])
    return ModelResponse(parts=[TextPart('greeted')])


greet = Capability(id=CAP_ID, description='Greets people.', instructions='Be warm.', defer_loading=True)


@greet.tool_plain
async def hello(name: str) -> str:
    """Greet someone (a counted side effect)."""
    _log('hellos', name)
    return f'hello {name}'


@greet.tool_plain
async def slow() -> str:
    """Slow the first time (so a test can kill the process mid-tool)."""
    marker = Path(os.environ.get('DURCAP_CRASH_DIR', '.durcap/rename')) / 'slow-started'
    if os.environ.get('DURCAP_RENAME_SLOW') and not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text('1')
        await asyncio.sleep(300)
    return 'done'


_name = BASE_NAME if VARIANT in ('v1', 'v2', 'v2-alias') else f'{BASE_NAME}-v2'
agent = DurableAgent(
    _name,
    FunctionModel(script),
    capabilities=[greet],
    aliases={'greet-v2': 'greet'} if VARIANT == 'v2-alias' else None,
    previous_names=[BASE_NAME] if VARIANT == 'agent-v2-alias' else (),
)
