"""Agents on real pydantic-ai provider models pointed at the wire server (`durable_capabilities.wire`), for
tests/engines/test_providers.py. No `FunctionModel`: the model is `OpenAIChatModel`, `OpenAIResponsesModel` or
`AnthropicModel` (`$DURCAP_WIRE_KIND`: openai-chat | openai-responses | anthropic) talking HTTP to
`$DURCAP_WIRE_URL` (the wire server the test started).

- `support`: the support example (examples/support) on that model.
- `ledger`: tests/engines/ledger_agent.py's `billing` capability (`charge` writes one ledger line per execution)
  on that model; the wire script decides the calls.

`openai-chat` agents stream the way a user makes them stream: an `event_stream_handler` given to each engine's
durability capability (`engine_options={engine: {'event_stream_handler': record_stream}}`), so every model request goes
through the SSE path inside the engine's model unit and the handler sees the live events there (written to
`$DURCAP_STREAM_LOG` when set). AnthropicModel streams every request by itself.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterable
from datetime import timedelta
from typing import Any

from pydantic_ai import RunContext
from pydantic_ai.messages import (
    AgentStreamEvent,
    FunctionToolCallEvent,
    PartDeltaEvent,
    PartStartEvent,
    TextPart,
    TextPartDelta,
)
from pydantic_ai.models import Model

from durable_capabilities import DurableAgent
from durable_capabilities.engines import DURABLE_ENGINES
from examples.support.agent import make_support
from tests.engines.ledger_agent import billing


async def record_stream(ctx: RunContext[Any], events: AsyncIterable[AgentStreamEvent]) -> None:
    """Event stream handler: appends one JSON line per event (`kind`, and the text of a text part or delta, the tool
    name of a tool call) to `$DURCAP_STREAM_LOG` when set. Runs inside the model request unit for model events and in
    the engine's per-event unit for tool events."""
    path = os.environ.get('DURCAP_STREAM_LOG')
    async for event in events:
        if not path:
            continue
        text = ''
        if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart):
            text = event.part.content
        elif isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
            text = event.delta.content_delta
        tool = event.part.tool_name if isinstance(event, FunctionToolCallEvent) else ''
        with open(path, 'a', encoding='utf-8') as handle:
            handle.write(json.dumps({'kind': event.event_kind, 'text': text, 'tool': tool}) + '\n')


def streaming(kind: str | None = None) -> dict[str, dict[str, Any]]:
    """`engine_options` making an `openai-chat` agent stream on every engine (`record_stream`); none otherwise."""
    if (kind or os.environ.get('DURCAP_WIRE_KIND', 'openai-responses')) != 'openai-chat':
        return {}
    return {engine: {'event_stream_handler': record_stream} for engine in DURABLE_ENGINES}


def provider_model(kind: str | None = None, url: str | None = None) -> Model:
    """The real pydantic-ai model of `kind` at the wire server `url` (defaults: the environment)."""
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.anthropic import AnthropicProvider
    from pydantic_ai.providers.openai import OpenAIProvider

    kind = kind or os.environ.get('DURCAP_WIRE_KIND', 'openai-responses')
    url = url or os.environ.get('DURCAP_WIRE_URL', 'http://127.0.0.1:9')
    if kind == 'anthropic':
        return AnthropicModel('claude-sonnet-4-5', provider=AnthropicProvider(base_url=url, api_key='test'))
    if kind == 'openai-chat':
        return OpenAIChatModel('gpt-4o', provider=OpenAIProvider(base_url=url + '/v1', api_key='test'))
    return OpenAIResponsesModel('gpt-5', provider=OpenAIProvider(base_url=url + '/v1', api_key='test'))


support = make_support(provider_model())
for _engine, _options in streaming().items():  # make_support takes no engine_options: set before the first build
    support.engine_options.setdefault(_engine, {}).update(_options)
_stream = streaming()
ledger = DurableAgent(
    os.environ.get('DURCAP_LEDGER_AGENT', 'wireledger'), provider_model(), capabilities=[billing],
    engine_options={**_stream, 'temporal': {
        **_stream.get('temporal', {}),
        # A killed worker's model activity is retried after 10 s, not pydantic-ai's default 60 s start-to-close.
        'model_activity_config': {'start_to_close_timeout': timedelta(seconds=10)}}},
)
