"""`POST /v1/agents/{agent}/ag-ui` and `/v1/agents/{agent}/vercel-ai`: a durable turn in the AG-UI and Vercel AI
data-stream protocols, through pydantic-ai's own adapters (`pydantic_ai.ui`).

The request is read by the protocol's adapter (`build_run_input`, `messages`, `conversation_id`): its thread (AG-UI
`threadId`, Vercel AI chat `id`) is the conversation, its last user prompt the turn's prompt; the history the
client sends is not used (the conversation store holds the turn's history). The run's stream (`streams.watch`) is
fed to the protocol's event stream (`build_event_stream().transform_stream`): pydantic-ai's own stream events as
the model and the tools produced them, then the run's end as an `AgentRunResultEvent` built through the public
serialization of `AgentRunResult`. A call waiting for approval ends the protocol run with that protocol's approval
event (AG-UI: `RUN_FINISHED` with an interrupt outcome; Vercel AI: `tool-approval-request`), its `tool_call_id`
the pending call's id; the client decides through `POST /v1/runs/{run}/approvals/{call}` and follows the rest on
`/v1/runs/{run}/events`. Where the run is: an AG-UI `CUSTOM` event `durcap.run` / a Vercel AI `data-durcap-run` part
first, `{run_id, events_url, approvals_url, conversation_id}`, and the `X-Durcap-Run-Id` response header.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pydantic
from starlette.requests import Request
from starlette.responses import Response

from .._limits import one_line, printable
from ._errors import BadRequestError

if TYPE_CHECKING:
    from ._app import ServeApp
    from ._rows import RunRow

RUN_ID_HEADER = 'X-Durcap-Run-Id'
"""The protocol responses' header naming the run (`durcap serve --cors-origin` exposes it to browser scripts)."""

_RESULT: Any = None


def _run_result(output: Any, response: Any) -> Any:
    """An `AgentRunResult` with `output` and the one model response `response`, validated from pydantic-ai's own
    serialized form of a result (`{'output', 'messages', ...}`)."""
    global _RESULT
    from pydantic_ai import AgentRunResult
    from pydantic_ai.messages import ModelMessagesTypeAdapter
    from pydantic_ai.tools import DeferredToolRequests

    if _RESULT is None:
        _RESULT = pydantic.TypeAdapter(AgentRunResult[DeferredToolRequests | Any])
    messages = ModelMessagesTypeAdapter.dump_python([response], mode='json')
    return _RESULT.validate_python({'output': output, 'messages': messages})


def _prompt(adapter: Any) -> str:
    """The text of the last user prompt of the protocol request."""
    from pydantic_ai.messages import ModelRequest, UserPromptPart

    for message in reversed(adapter.messages):
        if isinstance(message, ModelRequest):
            for part in reversed(message.parts):
                if isinstance(part, UserPromptPart):
                    content = part.content
                    text = content if isinstance(content, str) else ' '.join(c for c in content if isinstance(c, str))
                    if text.strip():
                        return text
    raise BadRequestError('the request carries no user message with text: send the user\'s prompt as the last '
                          'user message', field='messages')


async def _native_events(app: ServeApp, row: RunRow, after: int = 0) -> AsyncIterator[Any]:
    """The run's pydantic-ai events after offset `after`, ended by an `AgentRunResultEvent` (the answer, or the calls
    waiting for approval), or by the run's error."""
    from pydantic_ai import AgentRunResultEvent
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.tools import DeferredToolRequests

    from ..streams import watch

    async for event in watch(row.run_id, engine=row.engine, store=app.store, from_offset=after):
        if event.event is not None:
            yield event.event
        elif event.kind == 'approval_waiting':
            calls = [ToolCallPart(c['tool_name'], c['args'], c['call_id']) for c in event.data.get('calls') or []]
            response = ModelResponse(parts=list(calls), finish_reason='tool_call')
            yield AgentRunResultEvent(result=_run_result(DeferredToolRequests(approvals=calls), response))
            return
        elif event.kind == 'run_completed':
            output = event.data.get('output')
            response = ModelResponse(parts=[TextPart(output if isinstance(output, str) else str(output))],
                                     finish_reason='stop')
            yield AgentRunResultEvent(result=_run_result(output, response))
            return
        elif event.kind == 'run_failed':
            raise RuntimeError(one_line(str(event.data.get('error') or 'the run failed')))


def _where(app: ServeApp, request: Request, row: RunRow) -> dict[str, str]:
    root = request.scope.get('root_path', '')
    return {'run_id': row.run_id, 'conversation_id': row.conversation_id,
            'events_url': f'{root}/v1/runs/{row.run_id}/events', 'approvals_url': f'{root}/v1/runs/{row.run_id}/approvals'}


async def protocol_turn(app: ServeApp, request: Request, protocol: str) -> Response:
    """One turn in `protocol` (`'ag-ui'` or `'vercel-ai'`), streamed in that protocol."""
    from pydantic_ai.exceptions import UserError

    principal = await app.principal(request)
    agent = app.agent(request.path_params['agent'])
    _value, raw = await app.json_body(request, protocol)  # bounded and JSON, with our codes
    try:
        if protocol == 'ag-ui':
            from pydantic_ai.ui.ag_ui import AGUIAdapter

            adapter: Any = AGUIAdapter(agent.build('local'), AGUIAdapter.build_run_input(raw),
                                       accept=request.headers.get('accept'))
            key = f'ag-ui:{adapter.run_input.run_id}'
            key_name = f'AG-UI runId {printable(adapter.run_input.run_id[:120])!r}'
        else:
            from pydantic_ai.ui.vercel_ai import VercelAIAdapter

            adapter = VercelAIAdapter(agent.build('local'), VercelAIAdapter.build_run_input(_without_raw_input(raw)),
                                      accept=request.headers.get('accept'), sdk_version=6)
            if getattr(adapter.run_input, 'trigger', 'submit-message') == 'regenerate-message':
                # The ai SDK's `regenerate()`: it would replace the chat's last answer, but a stored turn stays (its
                # tools' side effects happened, the store only appends); answered with the stored run before this,
                # as if the same message were sent again: refused instead, saying what does work.
                raise BadRequestError(
                    "vercel-ai: trigger 'regenerate-message': a stored turn is not replaced (its tools ran; the "
                    'conversation only grows): send the prompt again as a new message, or start a new conversation '
                    'from the turns before it (`durcap history fork ID --at-turn N`)', field='trigger')
            users = [m for m in adapter.run_input.messages if getattr(m, 'role', None) == 'user']
            message = getattr(users[-1], 'id', '') if users else ''
            key = f'vercel-ai:{adapter.run_input.id}:{message}'
            key_name = f'Vercel AI message id {printable(str(message)[:120])!r} of chat {printable(adapter.run_input.id[:120])!r}'
        conversation_id = adapter.conversation_id
        results = adapter.deferred_tool_results
        prompt = _prompt(adapter) if results is None or not results.approvals else ''
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = '.'.join(map(str, first['loc'])) or '(the body)'
        raise BadRequestError(f'{protocol}: {where}: {one_line(first["msg"])}', field=where) from None
    except UserError as exc:
        raise BadRequestError(f'{protocol}: {one_line(str(exc))}') from None
    if not conversation_id:
        raise BadRequestError(f'{protocol}: the request names no thread (the conversation id)', field='threadId')
    app.checked_id(conversation_id, 'conversation_id')
    after = 0
    if results is not None and results.approvals:
        row, after = await _decide(app, principal, conversation_id, results)
    else:
        deps = await app.deps(agent, None, principal, request)
        row, _created = await app.start_turn(principal, conversation_id, agent, prompt, deps, _safe_key(key),
                                             [protocol, conversation_id, agent.name, prompt], key_name=key_name)
    stream = adapter.build_event_stream()
    where = _where(app, request, row)

    async def events() -> AsyncIterator[Any]:
        first = True
        async for event in stream.transform_stream(_native_events(app, row, after)):
            yield event
            if first:  # after the protocol's own start event (AG-UI's RUN_STARTED, Vercel AI's start)
                first = False
                yield _announce(protocol, where)

    response = stream.streaming_response(events())
    response.headers[RUN_ID_HEADER] = row.run_id
    return response


async def _decide(app: ServeApp, principal: str, conversation_id: str, results: Any) -> tuple[RunRow, int]:
    """Apply the protocol's approval responses (Vercel AI `approval-responded` parts, AG-UI `resume` entries) to the
    principal's newest run on the conversation, as `POST /v1/runs/{run}/approvals/{call}` does (the pending call's
    fingerprint: the protocols name the call only); a call decided already the same way (approved or denied: a retried
    request) is skipped, and a response deciding a call the other way than it was decided is refused whole, before any
    of its decisions is sent (409 DC054, as the decision endpoint refuses a second decision). Returns the run and the
    offset of its last `approval_waiting` event, from which the rest streams."""
    from pydantic_ai.tools import ToolApproved, ToolDenied

    from ..approvals import already_decided
    from ._app import _coded, _Refused
    from ._errors import NotFoundError

    row = await app.rows.call(app.rows.latest_run_sync, principal, conversation_id)
    if row is None:
        raise NotFoundError(f'no run on conversation {conversation_id!r} waits for these approvals',
                            field='conversation_id')
    undecided = []
    for call_id, value in results.approvals.items():
        approve = value is True or isinstance(value, ToolApproved)
        earlier = await app._decided(row, call_id)
        if earlier is None:
            undecided.append((call_id, value, approve))
        elif earlier.approve != approve:  # not a retry: a second decision (a denial after an approval, or the reverse)
            refused = already_decided(row.run_id, printable(call_id[:120]), earlier)
            raise _Refused(_coded(409, refused.code, str(refused), kind=refused.kind, field='call_id'))
    for call_id, value, approve in undecided:
        await app.apply_decision(row, principal, call_id, approve=approve,
                                 reason=value.message if isinstance(value, ToolDenied) else None,
                                 args=value.override_args if isinstance(value, ToolApproved) else None, fingerprint=None)
    waits = [o for o, kind, _ in await app.rows.call(app.rows.milestones_sync, row.run_id) if kind == 'approval_waiting']
    return row, (waits[-1] if waits else 0)


def _announce(protocol: str, where: dict[str, str]) -> Any:
    if protocol == 'ag-ui':
        from ag_ui.core import CustomEvent

        return CustomEvent(name='durcap.run', value=where)
    from pydantic_ai.ui.vercel_ai.response_types import DataChunk

    return DataChunk(type='data-durcap-run', data=where)


_APPROVAL_STATES = ('approval-requested', 'approval-responded')


def _without_raw_input(raw: bytes) -> bytes:
    """The Vercel AI request without `rawInput` on tool parts in an approval state.

    The `ai` SDK (6.x and 7.x) keeps a streamed tool call's `rawInput` on its part when it moves to
    `approval-requested` and, after `addToolApprovalResponse`, `approval-responded`; pydantic-ai 2.68's request
    models (`vercel_ai.request_types`, `extra='forbid'`) accept `rawInput` on `output-error` parts only, so the SDK's
    own approval response is refused whole. Only the approval (`approval.approved`, `approval.reason`) of such a part
    is read here (the stored conversation, not the client's copy, is the turn's history), so dropping the field loses
    nothing.
    """
    import json

    data = json.loads(raw)
    # Only lists are walked: a body of another shape (`"messages": 5`) is left as it is for the adapter's validation to
    # refuse with DC042 (iterating it failed the request with a 500).
    messages = data.get('messages') if isinstance(data, dict) else None
    for message in messages if isinstance(messages, list) else []:
        parts = message.get('parts') if isinstance(message, dict) else None
        for part in parts if isinstance(parts, list) else []:
            if isinstance(part, dict) and part.get('state') in _APPROVAL_STATES:
                part.pop('rawInput', None)
    return json.dumps(data).encode()


def _safe_key(key: str) -> str:
    """An Idempotency-Key of the API's alphabet for a protocol request's own ids (AG-UI run id, Vercel AI message)."""
    import hashlib

    return 'p-' + hashlib.sha256(key.encode()).hexdigest()[:40]
