"""Agents on real pydantic-ai provider models pointed at the wire server (`durable_capabilities.wire`), for
tests/engines/test_providers.py. No `FunctionModel`: the model is `OpenAIChatModel`, `OpenAIResponsesModel` or
`AnthropicModel` (`$DURCAP_WIRE_KIND`: openai-chat | openai-responses | anthropic) talking HTTP to
`$DURCAP_WIRE_URL` (the wire server the test started).

- `support`: the support example (examples/support) on that model.
- `ledger`: tests/engines/ledger_agent.py's `billing` capability (`charge` writes one ledger line per execution)
  on that model; the wire script decides the calls.

`openai-chat` requests stream (`StreamedRequests`: every request goes through the SSE path), so the Chat
Completions stream crosses every engine's model unit; AnthropicModel streams every request by itself.
"""

from __future__ import annotations

import os
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

from pydantic_ai.models import Model
from pydantic_ai.models.wrapper import WrapperModel

from durable_capabilities import DurableAgent
from examples.support.agent import make_support
from tests.engines.ledger_agent import billing


class StreamedRequests(WrapperModel):
    """Sends every `request` as a streamed request and returns the assembled response."""

    async def request(self, messages: Any, model_settings: Any, model_request_parameters: Any) -> Any:
        async with self.wrapped.request_stream(messages, model_settings, model_request_parameters) as stream:
            async for _ in stream:
                pass
        return stream.get()

    @asynccontextmanager
    async def request_stream(self, *args: Any, **kwargs: Any):  # type: ignore[override]
        async with self.wrapped.request_stream(*args, **kwargs) as stream:
            yield stream


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
        return StreamedRequests(OpenAIChatModel('gpt-4o', provider=OpenAIProvider(base_url=url + '/v1', api_key='test')))
    return OpenAIResponsesModel('gpt-5', provider=OpenAIProvider(base_url=url + '/v1', api_key='test'))


support = make_support(provider_model())
ledger = DurableAgent(
    os.environ.get('DURCAP_LEDGER_AGENT', 'wireledger'), provider_model(), capabilities=[billing],
    # A killed worker's model activity is retried after 10 s, not pydantic-ai's default 60 s start-to-close.
    engine_options={'temporal': {'model_activity_config': {'start_to_close_timeout': timedelta(seconds=10)}}},
)
