"""An agent whose model records the history it receives, for tests/engines/test_provider_parts.py.

Model: a scripted `FunctionModel` (no provider): it writes the messages of each request it gets, as pydantic-ai's
message JSON, to `$DURCAP_PARTS_DIR/seen-{pid}-{n}.json` (in whatever process runs the model request: the
Temporal worker, the DBOS or Prefect process), then answers `seen N messages`. `rich_history()` is a stored
conversation holding every provider-specific part kind: thinking with a signature and provider details,
native (built-in) tool call and return parts, text with provider details, a 1 MB PNG image and a 1 MB PDF file in
the prompt, a 1 MB image the model returned (`FilePart`).
"""

from __future__ import annotations

import itertools
import os
from datetime import UTC, datetime
from pathlib import Path

from pydantic_ai.messages import (
    BinaryContent,
    FilePart,
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    NativeToolCallPart,
    NativeToolReturnPart,
    TextPart,
    ThinkingPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from durable_capabilities import DurableAgent

MB = 1024 * 1024
_counter = itertools.count()


def _bytes(seed: int) -> bytes:
    """1 MB of non-repeating bytes (compression cannot hide it)."""
    import hashlib

    return b''.join(hashlib.sha256(f'{seed}-{i}'.encode()).digest() for i in range(MB // 32))


def rich_history() -> list[ModelMessage]:
    """A two-message conversation holding every provider-specific part kind (timestamps fixed)."""
    at = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    return [
        ModelRequest(parts=[UserPromptPart(
            ['Is this jacket damaged? Photo and receipt attached.',
             BinaryContent(_bytes(1), media_type='image/png', identifier='photo-1'),
             BinaryContent(_bytes(2), media_type='application/pdf', identifier='receipt-1')],
            timestamp=at)], timestamp=at, run_id='r-1'),
        ModelResponse(
            parts=[
                ThinkingPart('The photo shows a torn seam.', id='rs_1', signature='c2lnbmF0dXJl' * 40,
                             provider_name='anthropic', provider_details={'redacted': False, 'budget': 2048}),
                NativeToolCallPart('web_search', {'query': 'denim jacket warranty'}, tool_call_id='ws_1',
                                   provider_name='openai', provider_details={'status': 'completed'}),
                NativeToolReturnPart('web_search', {'results': [{'url': 'https://example.com/w', 'title': 'Warranty'}]},
                                     tool_call_id='ws_1', timestamp=at, provider_name='openai'),
                TextPart('The seam is torn: covered by the warranty.', id='msg_1', provider_name='openai',
                         provider_details={'annotations': [{'type': 'url_citation', 'url': 'https://example.com/w'}]}),
                FilePart(BinaryContent(_bytes(3), media_type='image/png'), id='ig_1', provider_name='openai',
                         provider_details={'revised_prompt': 'a torn seam'}),
            ],
            usage=RequestUsage(input_tokens=1200, output_tokens=80, cache_read_tokens=300,
                               details={'reasoning_tokens': 40}),
            model_name='claude-sonnet-4-5', timestamp=at, provider_name='anthropic',
            provider_details={'finish_reason': 'end_turn', 'stop_sequence': None},
            provider_response_id='msg_wire_1', finish_reason='stop', run_id='r-1'),
    ]


def dump(messages: list[ModelMessage]) -> bytes:
    return ModelMessagesTypeAdapter.dump_json(messages)


def _record(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    where = Path(os.environ['DURCAP_PARTS_DIR'])
    where.mkdir(parents=True, exist_ok=True)
    (where / f'seen-{os.getpid()}-{next(_counter)}.json').write_bytes(dump(messages))
    return ModelResponse(parts=[TextPart(f'seen {len(messages)} messages')])


agent = DurableAgent('parts', FunctionModel(_record, model_name='parts-recorder'))
