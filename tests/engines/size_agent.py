"""An agent for payload-size and store-outage tests. Model: a scripted `FunctionModel` (no provider).

- prompt `tool N`: the model calls `produce(size=N)`, then answers `produced N chars after M messages`;
- prompt `tools K N`: the model calls `produce(size=N)` K times, one call per response, then answers;
- prompt `sizes N1 N2 ...`: the model calls `produce(size=N1)`, then `produce(size=N2)`, ..., one call per response,
  then answers (distinct results: a test tells each call's piece apart);
- any other prompt: the model answers `seen M messages` (M: the messages it was sent).
`produce` appends one line per execution to `$DURCAP_LEDGER` (the side effect a test counts), sleeps
`$DURCAP_TOOL_PAUSE` seconds after writing it (so a test can cut the store before the append), and returns
N characters. With `$DURCAP_TOOL_HOLD_AFTER=K`, every call after the first K in this process never returns (its
ledger line written first): a test kills the process there, leaving the run open on its engine.
"""

from __future__ import annotations

import asyncio
import os

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompt_at = max(i for i, m in enumerate(messages) if isinstance(m, ModelRequest) and any(
        isinstance(p, UserPromptPart) for p in m.parts))
    prompt = next(p.content for p in messages[prompt_at].parts if isinstance(p, UserPromptPart))
    returns = [p for m in messages[prompt_at:] for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    words = str(prompt).split()
    if words[0] in ('tool', 'tools', 'sizes'):
        if words[0] == 'sizes':
            sizes = [int(w) for w in words[1:]]
        else:
            calls, size = (1, int(words[1])) if words[0] == 'tool' else (int(words[1]), int(words[2]))
            sizes = [size] * calls
        if len(returns) < len(sizes):
            return ModelResponse(parts=[ToolCallPart('produce', {'size': sizes[len(returns)]},
                                                     tool_call_id=f'call-{len(returns)}')])
        return ModelResponse(parts=[TextPart(f'produced {sum(len(str(r.content)) for r in returns)} chars after {len(messages)} messages')])
    return ModelResponse(parts=[TextPart(f'seen {len(messages)} messages')])


def _record(ledger: str, size: int) -> None:
    with open(ledger, 'a', encoding='utf-8') as f:
        f.write(f'{size}\n')
        f.flush()
        os.fsync(f.fileno())


bulk = Capability(id='bulk', description='Produces text of a given size.')
_calls = 0


@bulk.tool_plain
async def produce(size: int) -> str:
    """Produce `size` characters (a side effect counted in the ledger)."""
    ledger = os.environ.get('DURCAP_LEDGER')
    if ledger:
        await asyncio.to_thread(_record, ledger, size)
    global _calls
    _calls += 1
    hold = os.environ.get('DURCAP_TOOL_HOLD_AFTER')
    if hold and _calls > int(hold):
        await asyncio.Event().wait()  # never set: the test kills this process
    pause = float(os.environ.get('DURCAP_TOOL_PAUSE') or 0)
    if pause:
        await asyncio.sleep(pause)
    return 'x' * size


agent = DurableAgent('sizes', FunctionModel(script), capabilities=[bulk])
