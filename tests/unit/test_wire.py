"""The provider wire server (`durable_capabilities.wire`) against the real pydantic-ai model classes.

Model: `OpenAIChatModel`, `OpenAIResponsesModel` and `AnthropicModel` through their providers' `base_url`,
speaking HTTP to the wire server (uvicorn in a thread of this process), which plays `SUPPORT_SCRIPT` or a script
of the test. No engine: the local agent graph (the engine matrix is tests/engines/test_providers.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from durable_capabilities.wire import Fault, Script, Step, ToolCall, Turn, WireServer, load_script

pytest.importorskip('openai')
pytest.importorskip('anthropic')

from pydantic_ai.messages import ThinkingPart, ToolCallPart
from pydantic_ai.models.anthropic import AnthropicModel
from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
from pydantic_ai.providers.anthropic import AnthropicProvider
from pydantic_ai.providers.openai import OpenAIProvider

from examples.support.agent import make_store, make_support

ANSWER = 'Order ABC-123 (Blue denim jacket) shipped via UPS and arrives 2026-05-02.'
KINDS = ('openai-chat', 'openai-responses', 'anthropic')


def model_for(kind: str, url: str, **settings: Any) -> Any:
    """A real pydantic-ai model of `kind` pointed at the wire server at `url` (`max_retries`: the SDK's own)."""
    if kind == 'anthropic':
        return AnthropicModel('claude-sonnet-4-5', provider=AnthropicProvider(base_url=url, api_key='test'))
    cls = OpenAIChatModel if kind == 'openai-chat' else OpenAIResponsesModel
    return cls('gpt-4o', provider=OpenAIProvider(base_url=url + '/v1', api_key='test'))


@pytest.mark.parametrize('stream', [False, True], ids=['plain', 'stream'])
@pytest.mark.parametrize('kind', KINDS)
def test_support_conversation_over_the_wire(kind: str, stream: bool) -> None:
    """The support agent loads `orders`, calls `order_status` once, answers; thinking (with its signature) and the
    provider's usage fields come back in the pydantic-ai messages."""

    async def go() -> Any:
        agent = make_support(model=model_for(kind, wire.url)).build()
        if not stream:
            return await agent.run('Where is my order ABC-123?', deps=make_store())
        async with agent.run_stream('Where is my order ABC-123?', deps=make_store()) as result:
            await result.get_output()
            return result

    with WireServer() as wire:
        result = asyncio.run(go())
        # AnthropicModel streams every request (pydantic-ai's choice for long generations): `stream` is always true.
        streamed = stream or kind == 'anthropic'
        assert [(e['step'], e['stream']) for e in wire.log] == [(0, streamed), (1, streamed), (2, streamed)]
    messages = result.all_messages()
    calls = [p for m in messages for p in m.parts if isinstance(p, ToolCallPart)]
    assert [(c.tool_name, c.args_as_dict()) for c in calls] == [
        ('load_capability', {'id': 'orders'}), ('order_status', {'order_id': 'ABC-123'})]
    thinking = [p for m in messages for p in m.parts if isinstance(p, ThinkingPart)]
    assert [t.content for t in thinking] == ['The orders capability is loaded; look the order up.']
    if kind != 'openai-chat':  # Chat Completions has no signature field
        assert thinking[0].signature == 'wire-signature-0_1'
    if not stream:
        assert result.output == ANSWER
        assert (result.usage.input_tokens, result.usage.output_tokens) == (612 + 701 + 790, 18 + 24 + 31)


@pytest.mark.parametrize('kind', KINDS)
def test_429_honours_retry_after_in_the_sdk_and_a_cut_stream_fails_the_request(kind: str) -> None:
    """A 429 with `retry-after: 1` is answered again no sooner than 1 s later; a stream cut half way raises a
    pydantic-ai model error naming the model (the durable engines retry it as one model request)."""
    script = Script((Turn((
        Step(tool_calls=(ToolCall('noop'),), faults=(Fault(status=429, retry_after=1),)),
        Step(text='done', faults=(Fault(cut=True),)),
    )),))

    async def go() -> None:
        agent = make_support(model=model_for(kind, wire.url)).build()

        @agent.tool_plain
        def noop() -> str:
            return 'ok'

        async with agent.run_stream('hello', deps=make_store()) as result:
            await result.get_output()

    from pydantic_ai.exceptions import ModelAPIError

    with WireServer(script) as wire:
        with pytest.raises(ModelAPIError):
            asyncio.run(go())
        first, second = wire.log[0], wire.log[1]
    assert first['fault'] == {'status': 429, 'retry_after': 1, 'cut': False, 'delay': 0.0}
    assert second['at'] - first['at'] >= 1.0


def test_load_script_reads_yaml(tmp_path) -> None:
    path = tmp_path / 's.yaml'
    path.write_text('turns:\n  - match: hi\n    steps:\n      - text: hello\n        faults: [{status: 500}]\n')
    assert load_script(path) == Script((Turn((Step(text='hello', faults=(Fault(status=500),)),), match='hi'),))
    path.write_text('turns: []\n')
    with pytest.raises(ValueError, match='non-empty `turns`'):
        load_script(path)
    _ = time


@pytest.mark.parametrize('kind', KINDS)
def test_text_deltas_split_the_streamed_text_and_a_cut_delivers_part_of_it(kind: str) -> None:
    """`text_deltas: 8`: the model streams the text in 8 deltas, split between words; with `{cut: true}` the client
    read part of it (a proper prefix, at least one delta) before the model error. A bad value is refused."""
    text = 'one two three four five six seven eight nine ten'
    script = load_script({'turns': [{'steps': [{'text': text, 'text_deltas': 8}]}]})
    assert script.turns[0].steps[0].text_deltas == 8

    async def deltas(wire: WireServer) -> list[str]:
        from pydantic_ai.messages import ModelRequest, PartDeltaEvent, PartStartEvent, TextPart, TextPartDelta, UserPromptPart
        from pydantic_ai.models import ModelRequestParameters

        got: list[str] = []
        model = model_for(kind, wire.url)
        try:
            async with model.request_stream([ModelRequest(parts=[UserPromptPart('hi')])], None,
                                            ModelRequestParameters()) as stream:
                async for event in stream:
                    if isinstance(event, PartStartEvent) and isinstance(event.part, TextPart) and event.part.content:
                        got.append(event.part.content)
                    elif isinstance(event, PartDeltaEvent) and isinstance(event.delta, TextPartDelta):
                        got.append(event.delta.content_delta)
        except Exception as error:  # noqa: BLE001 - the cut stream's model error, returned with what was read
            got.append(f'ERROR {type(error).__name__}')
        return got

    with WireServer(script) as wire:
        whole = asyncio.run(deltas(wire))
    assert len(whole) == 8 and ''.join(whole) == text, whole
    assert all(piece.endswith(' ') for piece in whole[:-1]), whole  # split between words
    cut = Script((Turn((Step(text=text, text_deltas=8, faults=(Fault(cut=True),)),)),))
    with WireServer(cut) as wire:
        partial = asyncio.run(deltas(wire))
    assert partial[-1].startswith('ERROR Model'), partial
    assert 1 <= len(partial) - 1 < 8 and text.startswith(''.join(partial[:-1])), partial
    with pytest.raises(ValueError, match='text_deltas: 0 is not a whole number >= 1'):
        load_script({'turns': [{'steps': [{'text': text, 'text_deltas': 0}]}]})


def test_durcap_wire_refuses_a_bad_script_with_one_line(tmp_path) -> None:
    """`durcap wire --script` of a file that is not a wire script: exit 2, one line naming the file, no traceback."""
    from tests._helpers import durcap

    bad = tmp_path / 'bad.yaml'
    bad.write_text('steps: []\n')
    out = durcap('wire', '--script', str(bad), timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == f'durcap: error: DC040 cannot read the wire script {bad}: {bad}: a wire script is a mapping ' \
                                 'with a non-empty `turns` list'


@pytest.mark.parametrize('stream', [False, True], ids=['plain', 'stream'])
def test_responses_image_generation_becomes_a_file_part(stream: bool) -> None:
    """A Responses `image_generation_call` item (base64 PNG) reaches pydantic-ai as a `FilePart` with the same bytes."""
    import base64

    from pydantic_ai.messages import FilePart

    png = base64.b64encode(b'\x89PNG\r\n\x1a\n' + bytes(range(256)) * 64).decode()
    script = Script((Turn((Step(text='Here is the label.', image_png_b64=png),)),))

    async def go() -> Any:
        agent = make_support(model=model_for('openai-responses', wire.url)).build()
        if not stream:
            return (await agent.run('draw a label', deps=make_store())).all_messages()
        async with agent.run_stream('draw a label', deps=make_store()) as result:
            await result.get_output()
            return result.all_messages()

    with WireServer(script) as wire:
        messages = asyncio.run(go())
    files = [p for m in messages for p in m.parts if isinstance(p, FilePart)]
    assert [f.content.data for f in files] == [base64.b64decode(png)]
