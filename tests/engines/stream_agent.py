"""An agent for stream tests. Model: a scripted `FunctionModel` with a `stream_function` (no provider).

First request: a streamed call of the `order_status` tool. Second request: the answer, streamed word by word,
`$DURCAP_STREAM_DELAY` seconds apart (default 0.1). With `$DURCAP_STREAM_DIR` set, the first execution of the answer
request writes `mid-stream` (holding its pid) after `HANG_AFTER` words and then hangs, so a test can SIGKILL the
process mid-stream; a later execution finds the file and streams the whole answer. With `$DURCAP_STREAM_HANG=first`
it is the first request (the tool call) that writes `mid-stream` after its first delta and hangs instead. With
`$DURCAP_STREAM_PAD=N` the answer ends with a space and N `x` (a large answer).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel

from durable_capabilities import DurableAgent

WORDS = [f'word{n:02d} ' for n in range(30)]
ANSWER = 'Order ABC-123 is shipped: ' + ''.join(WORDS).strip()
HANG_AFTER = 10


async def stream(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str | DeltaToolCalls]:
    returned = [p for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    folder = os.environ.get('DURCAP_STREAM_DIR')
    marker = Path(folder) / 'mid-stream' if folder else None
    first = os.environ.get('DURCAP_STREAM_HANG') == 'first'
    hang = marker is not None and not marker.exists() and first == (not returned)
    if not returned:
        if hang:
            assert marker is not None
            yield {0: DeltaToolCall(name='order_status', tool_call_id='call-1')}
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(os.getpid()))
            await asyncio.sleep(300)
        yield {0: DeltaToolCall(name='order_status', json_args='{"order_id": "ABC-123"}', tool_call_id='call-1')}
        return
    delay = float(os.environ.get('DURCAP_STREAM_DELAY', '0.1'))
    yield 'Order ABC-123 is shipped: '
    for index, word in enumerate(WORDS):
        if hang and index == HANG_AFTER:
            assert marker is not None
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(str(os.getpid()))
            await asyncio.sleep(300)
        await asyncio.sleep(delay)
        yield word if index < len(WORDS) - 1 else word.strip()
    if pad := int(os.environ.get('DURCAP_STREAM_PAD', '0')):
        yield ' ' + 'x' * pad


def order_status(order_id: str) -> str:
    """The status of an order."""
    return f'{order_id}: shipped'


agent = DurableAgent(os.environ.get('DURCAP_STREAM_AGENT', 'streamer'), FunctionModel(stream_function=stream),
                     tools=[order_status])
