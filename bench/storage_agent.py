"""The agent `bench_storage.py` runs: one tool call per turn returning ~`$BENCH_RESULT_BYTES` (default 50,000) bytes of
text that differs from turn to turn, then a short answer. Model: a scripted `FunctionModel` (no provider).

`$BENCH_RESULT_KIND`: `hex` (default: lines of sha256 hex, which zlib compresses to ~0.58) or `base64` (base64 of
pseudo-random bytes: ~0.76, about the least compressible a text result gets)."""

from __future__ import annotations

import base64
import hashlib
import os

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Call `fetch_report(turn)` once after each prompt, then answer with the report's size."""
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(p, UserPromptPart) for p in last.parts):
        turn = sum(1 for m in messages if isinstance(m, ModelRequest) and any(isinstance(p, UserPromptPart) for p in m.parts))
        return ModelResponse(parts=[ToolCallPart('fetch_report', {'turn': turn}, tool_call_id=f'call-{turn}')])
    size = sum(len(str(p.content)) for p in getattr(last, 'parts', ()) if isinstance(p, ToolReturnPart))
    return ModelResponse(parts=[TextPart(f'read a report of {size} characters')])


reports = Capability(id='reports', description='Fetches long reports.')


@reports.tool_plain
def fetch_report(turn: int) -> str:
    """The report of a turn: ~$BENCH_RESULT_BYTES characters of hex, different every turn."""
    size = int(os.environ.get('BENCH_RESULT_BYTES') or 50_000)
    if os.environ.get('BENCH_RESULT_KIND') == 'base64':
        blocks = (hashlib.sha256(f'{turn}:{i}'.encode()).digest() for i in range(size * 3 // 4 // 32 + 1))
        return base64.b64encode(b''.join(blocks)).decode()[:size]
    seed = hashlib.sha256(str(turn).encode()).hexdigest()
    lines, total = [], 0
    while total < size:
        seed = hashlib.sha256(seed.encode()).hexdigest()
        lines.append(f'{turn}: {seed}')
        total += len(lines[-1]) + 1
    return '\n'.join(lines)


agent = DurableAgent('storage', FunctionModel(script), capabilities=[reports])
