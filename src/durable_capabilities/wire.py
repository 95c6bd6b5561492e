"""A provider wire server: OpenAI Chat Completions, OpenAI Responses and Anthropic Messages on 127.0.0.1.

It plays a script instead of a language model, so the real pydantic-ai model classes (`OpenAIChatModel`,
`OpenAIResponsesModel`, `AnthropicModel`) can run against it through their providers' `base_url`, in tests and
for anyone who wants to try `durcap demo --model openai:gpt-4o` without an API key:

    $ durcap wire --port 8765                     # the bundled support conversation
    $ durcap demo --engine dbos --model openai:gpt-4o --base-url http://127.0.0.1:8765/v1

Routes (request and response shapes follow the providers' public API references):

- `POST /v1/chat/completions`: a `chat.completion` object, or with `"stream": true` server-sent
  `chat.completion.chunk` events ending with `data: [DONE]`;
- `POST /v1/responses`: a `response` object, or with `"stream": true` the typed `response.*` events;
- `POST /v1/messages`: an Anthropic `message`, or with `"stream": true` the `message_start` ...
  `message_stop` events;
- `GET /_wire/log`: every request served so far (route, step, fault played, monotonic time in seconds).

Which step answers a request is a pure function of the request (the latest customer prompt picks the turn, the
number of tool-result groups after it picks the step), so a request a durable engine sends again after a crash
or a retry gets the same answer, with the same tool call ids. Faults are the only state: a step's `faults`
are played, in order, on its first requests (counted per turn and step), then the step answers normally.

A script (JSON or YAML, or `Script`/`Turn`/`Step` objects):

    turns:
      - match: ABC-123            # a substring of the customer prompt; omitted: any prompt
        steps:
          - tool_calls: [{name: load_capability, args: {id: orders}}]
            faults: [{status: 429, retry_after: 2}]
          - thinking: Checking the carrier.   # + `signature` (Anthropic) / encrypted_content (Responses)
            tool_calls: [{name: order_status, args: {order_id: ABC-123}}]
          - text: Order ABC-123 is on its way.
            usage: {input_tokens: 900, output_tokens: 40}
            text_deltas: 6            # streamed in 6 deltas (default 2: two halves)

Fault kinds: `{status: 429|500|..., retry_after: SECONDS}` (an error body shaped like the provider's),
`{cut: true}` (the response stops half way: a stream after half its events, a plain body after half its bytes,
then the connection closes: with `text_deltas` above 2, part of the text reaches the client before the cut),
`{delay: SECONDS}` (the answer waits, e.g. past the client's timeout).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from ._limits import load_yaml, one_line

__all__ = ['SUPPORT_SCRIPT', 'Fault', 'Script', 'Step', 'ToolCall', 'Turn', 'WireServer', 'create_app', 'load_script']


@dataclass(frozen=True)
class ToolCall:
    """One function tool call the model makes: `name` and its JSON `args`."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fault:
    """One injected failure, played instead of (or, for `delay`, before) a step's answer.

    Attributes:
        status: HTTP status of an error answer (429, 500, 529, 401, 404...); 0: no error status.
        retry_after: Seconds sent in the `retry-after` header of an error answer (None: no header).
        cut: Stop the answer half way and close the connection.
        delay: Seconds to wait before answering (past the client's timeout, the client gives up).
    """

    status: int = 0
    retry_after: float | None = None
    cut: bool = False
    delay: float = 0.0


@dataclass(frozen=True)
class Step:
    """One model response.

    Attributes:
        text: Final text (an empty string: none).
        thinking: Reasoning text sent before the rest (Anthropic `thinking` block, Responses `reasoning`
            item with a summary, Chat Completions `reasoning_content`).
        signature: The thinking's signature (Anthropic) / `encrypted_content` (Responses); default derived.
        tool_calls: Function tool calls.
        image_png_b64: A base64 PNG the model returns (Responses: an `image_generation_call` item).
        usage: `{'input_tokens': N, 'output_tokens': M}` reported in the provider's own usage fields.
        faults: Played in order on this step's first requests.
        text_deltas: How many deltas a streamed answer sends `text` in (split between words, at most one word a
            delta; default 2: two halves). More deltas put some of the text before a `cut` fault's cut.
    """

    text: str = ''
    thinking: str = ''
    signature: str = ''
    tool_calls: tuple[ToolCall, ...] = ()
    image_png_b64: str = ''
    usage: dict[str, int] = field(default_factory=dict)
    faults: tuple[Fault, ...] = ()
    text_deltas: int = 2


@dataclass(frozen=True)
class Turn:
    """The steps that answer one customer prompt: the first turn whose `match` is in the prompt (or is empty)."""

    steps: tuple[Step, ...]
    match: str = ''


@dataclass(frozen=True)
class Script:
    """Every turn the server can play; see the module docstring for the file format."""

    turns: tuple[Turn, ...]

    def pick(self, prompt: str) -> tuple[int, Turn]:
        """The index and turn answering `prompt`.

        Raises:
            LookupError: no turn matches (the server answers 400 naming the prompt).
        """
        for index, turn in enumerate(self.turns):
            if not turn.match or turn.match in prompt:
                return index, turn
        raise LookupError(f'no script turn matches the prompt {prompt[:80]!r}')


def _step(raw: dict[str, Any]) -> Step:
    calls = tuple(ToolCall(c['name'], dict(c.get('args') or {})) for c in raw.get('tool_calls') or ())
    faults = tuple(Fault(**f) for f in raw.get('faults') or ())
    known = {'text', 'thinking', 'signature', 'image_png_b64', 'usage', 'text_deltas'}
    deltas = raw.get('text_deltas', 2)
    if not isinstance(deltas, int) or isinstance(deltas, bool) or deltas < 1:
        raise ValueError(f'text_deltas: {deltas!r} is not a whole number >= 1 (how many deltas a streamed answer '
                         'sends the text in); e.g. text_deltas: 8')
    return Step(tool_calls=calls, faults=faults, **{k: v for k, v in raw.items() if k in known})


def load_script(source: str | Path | dict[str, Any]) -> Script:
    """A `Script` from a JSON/YAML file path or an already parsed mapping (`{'turns': [...]}`).

    Raises:
        ValueError: the file is neither JSON nor YAML (`yaml.YAMLError` is a `ValueError` here), nests deeper than
            `_limits.MAX_DEPTH` levels, uses a YAML alias, or a turn has no steps.
    """
    data: Any = source
    if isinstance(source, str | Path):
        import yaml

        try:  # YAML is a superset of JSON; bounded: a 3,000-level script is an error, not a RecursionError
            data = load_yaml(Path(source).read_text(encoding='utf-8'), where=str(source))
        except yaml.YAMLError as exc:
            raise ValueError(f'{source}: not a wire script: {one_line(str(exc))}') from None
    if not isinstance(data, dict) or not data.get('turns'):
        raise ValueError(f'{source}: a wire script is a mapping with a non-empty `turns` list')
    turns = []
    for i, raw in enumerate(data['turns']):
        if not raw.get('steps'):
            raise ValueError(f'{source}: turn {i} has no `steps`')
        turns.append(Turn(tuple(_step(s) for s in raw['steps']), match=raw.get('match') or ''))
    return Script(tuple(turns))


SUPPORT_SCRIPT = load_script({
    'turns': [
        {'match': 'ABC-123', 'steps': [
            {'tool_calls': [{'name': 'load_capability', 'args': {'id': 'orders'}}],
             'usage': {'input_tokens': 612, 'output_tokens': 18}},
            {'thinking': 'The orders capability is loaded; look the order up.',
             'tool_calls': [{'name': 'order_status', 'args': {'order_id': 'ABC-123'}}],
             'usage': {'input_tokens': 701, 'output_tokens': 24}},
            {'text': 'Order ABC-123 (Blue denim jacket) shipped via UPS and arrives 2026-05-02.',
             'usage': {'input_tokens': 790, 'output_tokens': 31}},
        ]},
        {'steps': [{'text': 'Could you tell me your order ID so I can look into it?',
                    'usage': {'input_tokens': 600, 'output_tokens': 15}}]},
    ]
})
"""The bundled script: the support example's order conversation (`durcap demo`'s default prompt names ABC-123)."""


# --- reading requests: the latest customer prompt and how many tool-result groups follow it ---------------------

def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return '\n'.join(str(c.get('text', '')) for c in content if isinstance(c, dict) and 'text' in c)
    return ''


def _is_prompt(text: str) -> bool:
    """Customer text, not a note pydantic-ai adds (`<system>` text, capability context blocks)."""
    stripped = text.lstrip()
    return bool(stripped) and not stripped.startswith(('<system>', '<pyai:'))


_WIRE_ID = '_wire_'
"""Marks the tool call ids this server hands out: only results answering them advance the script (pydantic-ai
also sends results of calls it made up itself, such as Anthropic's tool-search references)."""


def _events(api: str, body: dict[str, Any]) -> list[tuple[str, str]]:
    """`[('prompt', text) | ('tool', '') | ('other', '')]` in order, from any of the three request shapes."""
    items: Any = body.get('input') if api == 'responses' else body.get('messages')
    if isinstance(items, str):
        return [('prompt', items)]
    out: list[tuple[str, str]] = []
    for item in items or ():
        role, kind, content = item.get('role'), item.get('type'), item.get('content')
        blocks = content if isinstance(content, list) else []
        output_of = item.get('call_id') if kind == 'function_call_output' else None  # not the call itself
        answered = [item.get('tool_call_id') or output_of or '', *(
            b.get('tool_use_id', '') for b in blocks if isinstance(b, dict) and b.get('type') == 'tool_result')]
        if any(_WIRE_ID in str(a) for a in answered):
            out.append(('tool', ''))
        elif role == 'user' and _is_prompt(_text_of(content)):
            out.append(('prompt', _text_of(content)))
        else:
            out.append(('other', ''))
    return out


def locate(api: str, body: dict[str, Any]) -> tuple[str, int]:
    """`(latest customer prompt, step index)` of a request: the step is the number of tool-result groups after
    the prompt (consecutive results of this server's calls are one group: the answers to one response's calls)."""
    events = _events(api, body)
    last = max((i for i, (kind, _) in enumerate(events) if kind == 'prompt'), default=-1)
    prompt = events[last][1] if last >= 0 else ''
    groups, previous = 0, ''
    for kind, _ in events[last + 1:]:
        if kind == 'tool' and previous != 'tool':
            groups += 1
        previous = kind
    return prompt, groups


# --- writing answers ---------------------------------------------------------------------------------------------

def _usage(step: Step) -> tuple[int, int]:
    return int(step.usage.get('input_tokens', 100)), int(step.usage.get('output_tokens', 20))


def _signature(step: Step, key: str) -> str:
    return step.signature or f'wire-signature-{key}'


def _call_id(key: str, i: int) -> str:
    return f'call{_WIRE_ID}{key}_{i}'


def chat_completion(step: Step, model: str, key: str) -> dict[str, Any]:
    """A `chat.completion` object for `step`; `key` makes ids deterministic (turn and step)."""
    message: dict[str, Any] = {'role': 'assistant', 'content': step.text or None}
    if step.thinking:
        message['reasoning_content'] = step.thinking
    if step.tool_calls:
        message['tool_calls'] = [
            {'id': _call_id(key, i), 'type': 'function', 'function': {'name': c.name, 'arguments': json.dumps(c.args)}}
            for i, c in enumerate(step.tool_calls)]
    prompt_tokens, completion_tokens = _usage(step)
    return {
        'id': f'chatcmpl-{key}', 'object': 'chat.completion', 'created': 1_767_225_600, 'model': model,
        'choices': [{'index': 0, 'message': message, 'logprobs': None,
                     'finish_reason': 'tool_calls' if step.tool_calls else 'stop'}],
        'usage': {'prompt_tokens': prompt_tokens, 'completion_tokens': completion_tokens,
                  'total_tokens': prompt_tokens + completion_tokens},
    }


def chat_chunks(step: Step, model: str, key: str) -> Iterable[dict[str, Any]]:
    """The `chat.completion.chunk` events streaming `step` (text in two pieces, arguments in two pieces)."""
    full = chat_completion(step, model, key)

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {'id': full['id'], 'object': 'chat.completion.chunk', 'created': full['created'], 'model': model,
                'choices': [{'index': 0, 'delta': delta, 'finish_reason': finish, 'logprobs': None}]}

    yield chunk({'role': 'assistant', 'content': ''})
    if step.thinking:
        yield chunk({'reasoning_content': step.thinking})
    for piece in _text_pieces(step):
        yield chunk({'content': piece})
    for i, call in enumerate(step.tool_calls):
        args = json.dumps(call.args)
        yield chunk({'tool_calls': [{'index': i, 'id': _call_id(key, i), 'type': 'function',
                                     'function': {'name': call.name, 'arguments': ''}}]})
        for piece in _halves(args):
            yield chunk({'tool_calls': [{'index': i, 'function': {'arguments': piece}}]})
    yield chunk({}, full['choices'][0]['finish_reason'])
    yield {'id': full['id'], 'object': 'chat.completion.chunk', 'created': full['created'], 'model': model,
           'choices': [], 'usage': full['usage']}


def _halves(text: str) -> list[str]:
    if not text:
        return []
    middle = max(1, len(text) // 2)
    return [p for p in (text[:middle], text[middle:]) if p]


def _text_pieces(step: Step) -> list[str]:
    """`step.text` in the `step.text_deltas` pieces a stream sends it in (two halves by default; else split between
    words, as even as the words allow, never an empty piece)."""
    if step.text_deltas == 2 or not step.text:
        return _halves(step.text)
    words = re.findall(r'\S+\s*|\s+', step.text)
    count = min(step.text_deltas, len(words))
    bounds = [round(i * len(words) / count) for i in range(count + 1)]
    return [''.join(words[bounds[i]:bounds[i + 1]]) for i in range(count)]


def _response_items(step: Step, key: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if step.thinking:
        items.append({'type': 'reasoning', 'id': f'rs_{key}', 'encrypted_content': _signature(step, key),
                      'summary': [{'type': 'summary_text', 'text': step.thinking}]})
    if step.image_png_b64:
        items.append({'type': 'image_generation_call', 'id': f'ig_{key}', 'status': 'completed',
                      'result': step.image_png_b64})
    if step.text:
        items.append({'type': 'message', 'id': f'msg_{key}', 'role': 'assistant', 'status': 'completed',
                      'content': [{'type': 'output_text', 'text': step.text, 'annotations': []}]})
    for i, call in enumerate(step.tool_calls):
        items.append({'type': 'function_call', 'id': f'fc_{key}_{i}', 'call_id': _call_id(key, i), 'name': call.name,
                      'arguments': json.dumps(call.args), 'status': 'completed'})
    return items


def response_object(step: Step, model: str, key: str, *, status: str = 'completed',
                    output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """A Responses API `response` object for `step`."""
    input_tokens, output_tokens = _usage(step)
    return {
        'id': f'resp_{key}', 'object': 'response', 'created_at': 1_767_225_600, 'model': model, 'status': status,
        'output': _response_items(step, key) if output is None else output,
        'parallel_tool_calls': True, 'tool_choice': 'auto', 'tools': [], 'error': None, 'incomplete_details': None,
        'instructions': None, 'metadata': {}, 'temperature': 1.0, 'top_p': 1.0,
        'usage': {'input_tokens': input_tokens, 'output_tokens': output_tokens,
                  'total_tokens': input_tokens + output_tokens,
                  'input_tokens_details': {'cached_tokens': 0},
                  'output_tokens_details': {'reasoning_tokens': len(step.thinking.split())}},
    }


def response_events(step: Step, model: str, key: str) -> Iterable[dict[str, Any]]:
    """The typed `response.*` streaming events of `step` (created, per item added/deltas/done, completed)."""
    yield {'type': 'response.created', 'response': response_object(step, model, key, status='in_progress', output=[])}
    for index, item in enumerate(_response_items(step, key)):
        kind = item['type']
        if kind == 'message':
            yield {'type': 'response.output_item.added', 'output_index': index,
                   'item': {**item, 'status': 'in_progress', 'content': []}}
            part = {'type': 'output_text', 'text': '', 'annotations': []}
            yield {'type': 'response.content_part.added', 'item_id': item['id'], 'output_index': index,
                   'content_index': 0, 'part': part}
            for piece in _text_pieces(step):
                yield {'type': 'response.output_text.delta', 'item_id': item['id'], 'output_index': index,
                       'content_index': 0, 'delta': piece, 'logprobs': []}
            yield {'type': 'response.output_text.done', 'item_id': item['id'], 'output_index': index,
                   'content_index': 0, 'text': step.text, 'logprobs': []}
            yield {'type': 'response.content_part.done', 'item_id': item['id'], 'output_index': index,
                   'content_index': 0, 'part': item['content'][0]}
        elif kind == 'function_call':
            yield {'type': 'response.output_item.added', 'output_index': index,
                   'item': {**item, 'arguments': '', 'status': 'in_progress'}}
            for piece in _halves(item['arguments']):
                yield {'type': 'response.function_call_arguments.delta', 'item_id': item['id'],
                       'output_index': index, 'delta': piece}
            yield {'type': 'response.function_call_arguments.done', 'item_id': item['id'], 'output_index': index,
                   'arguments': item['arguments'], 'name': item['name']}
        elif kind == 'reasoning':
            yield {'type': 'response.output_item.added', 'output_index': index, 'item': {**item, 'summary': []}}
            where = {'item_id': item['id'], 'output_index': index, 'summary_index': 0}
            yield {'type': 'response.reasoning_summary_part.added', **where, 'part': {'type': 'summary_text', 'text': ''}}
            for piece in _halves(step.thinking):
                yield {'type': 'response.reasoning_summary_text.delta', **where, 'delta': piece}
            yield {'type': 'response.reasoning_summary_text.done', **where, 'text': step.thinking}
            yield {'type': 'response.reasoning_summary_part.done', **where, 'part': item['summary'][0]}
        else:  # image generation: announced, then done whole
            yield {'type': 'response.output_item.added', 'output_index': index, 'item': {**item, 'status': 'in_progress'}}
        yield {'type': 'response.output_item.done', 'output_index': index, 'item': item}
    yield {'type': 'response.completed', 'response': response_object(step, model, key)}


def _anthropic_blocks(step: Step, key: str) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if step.thinking:
        blocks.append({'type': 'thinking', 'thinking': step.thinking, 'signature': _signature(step, key)})
    if step.text:
        blocks.append({'type': 'text', 'text': step.text})
    blocks.extend({'type': 'tool_use', 'id': f'toolu{_WIRE_ID}{key}_{i}', 'name': c.name, 'input': c.args}
                  for i, c in enumerate(step.tool_calls))
    return blocks


def anthropic_message(step: Step, model: str, key: str) -> dict[str, Any]:
    """An Anthropic Messages `message` object for `step`."""
    input_tokens, output_tokens = _usage(step)
    return {
        'id': f'msg_{key}', 'type': 'message', 'role': 'assistant', 'model': model,
        'content': _anthropic_blocks(step, key), 'stop_reason': 'tool_use' if step.tool_calls else 'end_turn',
        'stop_sequence': None,
        'usage': {'input_tokens': input_tokens, 'output_tokens': output_tokens,
                  'cache_creation_input_tokens': 0, 'cache_read_input_tokens': 0},
    }


def anthropic_events(step: Step, model: str, key: str) -> Iterable[dict[str, Any]]:
    """The Anthropic streaming events of `step`: message_start, per block start/deltas/stop, message_delta, stop."""
    full = anthropic_message(step, model, key)
    yield {'type': 'message_start', 'message': {**full, 'content': [], 'stop_reason': None,
                                                'usage': {**full['usage'], 'output_tokens': 1}}}
    for index, block in enumerate(full['content']):
        kind = block['type']
        start = {'thinking': {'type': 'thinking', 'thinking': '', 'signature': ''}, 'text': {'type': 'text', 'text': ''},
                 'tool_use': {**block, 'input': {}}}[kind]
        yield {'type': 'content_block_start', 'index': index, 'content_block': start}
        if kind == 'thinking':
            for piece in _halves(block['thinking']):
                yield {'type': 'content_block_delta', 'index': index, 'delta': {'type': 'thinking_delta', 'thinking': piece}}
            yield {'type': 'content_block_delta', 'index': index,
                   'delta': {'type': 'signature_delta', 'signature': block['signature']}}
        elif kind == 'text':
            for piece in _text_pieces(step):
                yield {'type': 'content_block_delta', 'index': index, 'delta': {'type': 'text_delta', 'text': piece}}
        else:
            for piece in _halves(json.dumps(block['input'])):
                yield {'type': 'content_block_delta', 'index': index,
                       'delta': {'type': 'input_json_delta', 'partial_json': piece}}
        yield {'type': 'content_block_stop', 'index': index}
    yield {'type': 'message_delta', 'delta': {'stop_reason': full['stop_reason'], 'stop_sequence': None},
           'usage': {'output_tokens': full['usage']['output_tokens']}}
    yield {'type': 'message_stop'}


# --- the app -----------------------------------------------------------------------------------------------------

_ERROR_TYPES = {400: 'invalid_request_error', 401: 'authentication_error', 404: 'not_found_error',
                429: 'rate_limit_error', 500: 'api_error', 529: 'overloaded_error'}


def _error_body(api: str, status: int, message: str) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(status, 'api_error')
    if api == 'anthropic':
        return {'type': 'error', 'error': {'type': kind, 'message': message}}
    return {'error': {'message': message, 'type': kind, 'param': None, 'code': kind}}


class _Cut(Exception):
    """Raised inside a streaming body: uvicorn drops the connection mid-response."""


def create_app(script: Script | None = None) -> Any:
    """The Starlette app serving `script` (default: `SUPPORT_SCRIPT`); `app.state.log` lists requests served."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    playing = script or SUPPORT_SCRIPT
    served: dict[tuple[int, int], int] = {}
    log: list[dict[str, Any]] = []

    async def answer(request: Request, api: str) -> Response:
        body = await request.json()
        model, stream = str(body.get('model', 'wire')), bool(body.get('stream'))
        prompt, step_index = locate(api, body)
        try:
            turn_index, turn = playing.pick(prompt)
        except LookupError as exc:
            return JSONResponse(_error_body(api, 400, str(exc)), status_code=400)
        step = turn.steps[min(step_index, len(turn.steps) - 1)]
        hits = served.get((turn_index, step_index), 0)
        served[(turn_index, step_index)] = hits + 1
        fault = step.faults[hits] if hits < len(step.faults) else None
        log.append({'api': api, 'stream': stream, 'turn': turn_index, 'step': step_index, 'model': model,
                    'fault': None if fault is None else fault.__dict__, 'at': time.monotonic()})
        key = f'{turn_index}_{step_index}'
        if fault and fault.delay:
            await asyncio.sleep(fault.delay)
        if fault and fault.status:
            headers = {} if fault.retry_after is None else {'retry-after': f'{fault.retry_after:g}'}
            return JSONResponse(_error_body(api, fault.status, f'wire server: injected {fault.status}'),
                                status_code=fault.status, headers=headers)
        cut = bool(fault and fault.cut)
        if not stream:
            whole = {'chat': chat_completion, 'responses': response_object, 'anthropic': anthropic_message}[api](
                step, model, key)
            if not cut:
                return JSONResponse(whole)
            data = json.dumps(whole).encode()
            return StreamingResponse(_cut_after([data[: len(data) // 2]]), media_type='application/json')
        events = list({'chat': chat_chunks, 'responses': response_events, 'anthropic': anthropic_events}[api](
            step, model, key))
        frames = [_sse(api, e, i) for i, e in enumerate(events)]
        if api == 'chat':
            frames.append(b'data: [DONE]\n\n')
        if cut:
            return StreamingResponse(_cut_after(frames[: len(frames) // 2]), media_type='text/event-stream')
        return StreamingResponse(_frames(frames), media_type='text/event-stream')

    async def chat(request: Request) -> Response:
        return await answer(request, 'chat')

    async def responses(request: Request) -> Response:
        return await answer(request, 'responses')

    async def messages(request: Request) -> Response:
        return await answer(request, 'anthropic')

    async def wire_log(request: Request) -> Response:
        return JSONResponse(log)

    app = Starlette(routes=[
        Route('/v1/chat/completions', chat, methods=['POST']), Route('/chat/completions', chat, methods=['POST']),
        Route('/v1/responses', responses, methods=['POST']), Route('/responses', responses, methods=['POST']),
        Route('/v1/messages', messages, methods=['POST']),
        Route('/_wire/log', wire_log, methods=['GET']),
    ])
    app.state.log = log
    return app


def _sse(api: str, event: dict[str, Any], sequence: int) -> bytes:
    if api == 'chat':
        return f'data: {json.dumps(event)}\n\n'.encode()
    if api == 'responses':
        event = {**event, 'sequence_number': sequence}
    return f'event: {event["type"]}\ndata: {json.dumps(event)}\n\n'.encode()


async def _frames(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame


async def _cut_after(frames: list[bytes]) -> AsyncIterator[bytes]:
    for frame in frames:
        yield frame
    await asyncio.sleep(0.05)  # let the frames reach the client before the connection drops
    raise _Cut('wire server: stream cut by the script')


class WireServer:
    """The wire server in a background thread of this process (tests, notebooks): `with WireServer() as w: w.url`.

    Args:
        script: What to play (default `SUPPORT_SCRIPT`).
        port: TCP port on 127.0.0.1 (0: a free one).

    Attributes:
        url: `http://127.0.0.1:PORT` (OpenAI clients take `url + '/v1'`, Anthropic's takes `url`).
        log: The requests served (see `create_app`).
    """

    def __init__(self, script: Script | None = None, port: int = 0) -> None:
        import socket

        if not port:
            with socket.socket() as sock:
                sock.bind(('127.0.0.1', 0))
                port = sock.getsockname()[1]
        self.port = port
        self.url = f'http://127.0.0.1:{port}'
        self.app = create_app(script)
        self.log: list[dict[str, Any]] = self.app.state.log
        self._server: Any = None
        self._thread: Any = None

    def __enter__(self) -> Self:
        import threading

        import uvicorn

        config = uvicorn.Config(self.app, host='127.0.0.1', port=self.port, log_level='warning', lifespan='off')
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name='durcap-wire', daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f'the wire server did not start on {self.url}')
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
