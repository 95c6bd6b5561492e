"""An agent for the one-turn-at-a-time tests (`test_turn_claims.py`). Model: a scripted `FunctionModel` (no provider).

Each turn works on the prompt of its own turn (the last user prompt), whatever the history holds: the prompt
`revoke NAME` makes the model call the gated tool `revoke_sessions(user=NAME)` (requires approval), then answer
with the tool's result; the prompt `charge NAME` calls `charge(user=NAME)` (no approval), which creates
`started-NAME` and, with `$DURCAP_RACE_HOLD=1`, waits until the test creates `go-NAME` (both in
`$DURCAP_CRASH_DIR`), so a test can start another turn while it runs. Every execution of a tool
appends one line `tool:NAME` to `$DURCAP_CRASH_DIR/side-effects` (the side effects that must happen once per turn),
and every model request `request:NAME` to the same file (a turn refused before any side effect has none).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from pydantic_ai import ModelResponse, TextPart, Tool, ToolCallPart
from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent


def _record(line: str) -> None:
    path = Path(os.environ['DURCAP_CRASH_DIR'])
    path.mkdir(parents=True, exist_ok=True)
    with open(path / 'side-effects', 'a', encoding='utf-8') as f:
        f.write(line + '\n')
        f.flush()
        os.fsync(f.fileno())


def _this_turn(messages: list[ModelMessage]) -> tuple[str, list[ModelMessage]]:
    """The last user prompt and the messages from its request on."""
    for index in range(len(messages) - 1, -1, -1):
        message = messages[index]
        if isinstance(message, ModelRequest):
            prompts = [p.content for p in message.parts if isinstance(p, UserPromptPart)]
            if prompts:
                return str(prompts[-1]), messages[index:]
    raise AssertionError('no user prompt')


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompt, turn = _this_turn(messages)
    verb, name = prompt.split()[0], prompt.split()[-1]
    _record(f'request:{name}')
    returns = [p for m in turn for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    if returns:
        return ModelResponse(parts=[TextPart(f'result: {returns[-1].content}')])
    tool = 'revoke_sessions' if verb == 'revoke' else 'charge'
    return ModelResponse(parts=[ToolCallPart(tool, {'user': name})])


def revoke_sessions(user: str) -> str:
    """Revoke every session of a user (needs a person's approval)."""
    _record(f'tool:{user}')
    return f'revoked sessions of {user}'


async def charge(user: str) -> str:
    """Charge a user (no approval; with `$DURCAP_RACE_HOLD=1` it waits for the test's `go-NAME` file first)."""
    _record(f'tool:{user}')
    folder = Path(os.environ['DURCAP_CRASH_DIR'])
    (folder / f'started-{user}').write_text(str(os.getpid()))
    while os.environ.get('DURCAP_RACE_HOLD') == '1' and not (folder / f'go-{user}').exists():
        await asyncio.sleep(0.05)
    return f'charged {user}'


racer = DurableAgent('racer', FunctionModel(script), tools=[Tool(revoke_sessions, requires_approval=True), charge])
"""Strategy from the run (`busy=` / `--busy`), else the default (`'reject'`)."""

queued = DurableAgent('queued', FunctionModel(script), tools=[Tool(revoke_sessions, requires_approval=True), charge],
                      busy='enqueue')
"""The same agent with `DurableAgent(busy='enqueue')`."""
