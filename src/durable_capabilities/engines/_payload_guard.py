"""Temporal: fail a turn that cannot be carried, in workflow code, instead of failing a workflow task forever.

The claim-check codec (`store._claim_check.ClaimCheckCodec`) carries any payload up to its maximum by reference.
What it cannot carry it must refuse, and where it refuses matters: a codec error while a workflow task
completes (the inputs of the activities the workflow schedules) makes Temporal retry that task forever and
the client wait forever. So the sizes are checked where a refusal fails the turn:

- `PayloadGuard`, run in workflow code before every model request (from the durability capability's own
  `before_model_request`: `engines.temporal.GuardedTemporalDurability`), measures the history the
  model-request activity will carry (each message measured once per run) and fails the workflow with a
  non-retryable DC030 `ApplicationError` naming the conversation, the size and the limit.
- `check_loaded`, in the conversation-load activity: a stored history over the maximum fails that activity
  for good, with the same problem.
- `named`: a tool or model activity whose result the codec refused (its completion, which Temporal turns
  into an activity failure) becomes the same problem naming the conversation, raised from workflow code.
"""

from __future__ import annotations

import json
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse
from pydantic_core import to_json
from temporalio import workflow
from temporalio.exceptions import ActivityError, ApplicationError

from ..store._claim_check import (
    DEFAULT_MAXIMUM,
    MAXIMUM_ENV,
    TOO_LARGE,
    UNAVAILABLE,
    _env_int,
    too_large,
)

if TYPE_CHECKING:
    from ._temporal_workflow import AgentRunInput

_MARGIN = 64 * 1024
"""Bytes a model-request input carries besides the messages (settings, tool definitions), counted against the maximum."""

_MAX_TRACKED_RUNS = 1024


def payload_maximum() -> int:
    """The configured single-payload maximum in bytes: `$DURCAP_PAYLOAD_MAXIMUM` or `DEFAULT_MAXIMUM`."""
    return _env_int(MAXIMUM_ENV, DEFAULT_MAXIMUM)


current_run: ContextVar[AgentRunInput | None] = ContextVar('durcap_temporal_run', default=None)
"""The input of the Temporal workflow run whose turn is running (set by `engines.temporal`'s workflow `run`; read
here and by the continue-as-new handler)."""


def _subject(conversation_id: str | None = None) -> str:
    if conversation_id is None:
        state = current_run.get()
        conversation_id = state.conversation_id if state is not None else None
    if conversation_id is not None:
        return f'conversation {conversation_id!r}'
    return f'workflow {workflow.info().workflow_id!r}'


@dataclass
class PayloadGuard:
    """The check `GuardedTemporalDurability` runs before every model request (Temporal): refuse a model request whose
    input would be over `maximum` bytes.

    Attributes:
        maximum: The single-payload maximum in bytes (read from `$DURCAP_PAYLOAD_MAXIMUM` when the worker
            builds the agent; the codec reads the same variable).

    Raises (from `before_model_request`, in workflow code):
        ApplicationError: type `DurcapPayloadTooLarge`, non-retryable, message `DC030 conversation 'id': a
            payload of N bytes is over the maximum of M bytes ...`: the workflow fails, the client returns.
    """

    maximum: int = field(default_factory=payload_maximum)
    _measured: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    async def before_model_request(self, ctx: Any, request_context: Any) -> Any:
        if not workflow.in_workflow():
            return request_context
        messages = request_context.messages
        key = workflow.info().run_id
        count, total = self._measured.get(key, (0, 0))
        if count > len(messages):  # the history was rewritten (compaction): measure it again
            count, total = 0, 0
        total += sum(_estimate(message) for message in messages[count:])
        if len(self._measured) >= _MAX_TRACKED_RUNS and key not in self._measured:
            self._measured.pop(next(iter(self._measured)))
        self._measured[key] = (len(messages), total)
        if total + _MARGIN > self.maximum:
            raise too_large(total + _MARGIN, self.maximum, f'{_subject()}: the model request')
        return request_context


_PART_OVERHEAD = 200
_REQUEST_OVERHEAD = 150
_RESPONSE_OVERHEAD = 700
"""Bytes counted per part and per message besides their strings and data: at least what pydantic-ai's JSON writes
for them (kinds, timestamps, usage, empty fields; measured 83-182 per part, 137 per request, 645 per response),
so the estimate errs on the large side."""

_MESSAGE_FIELDS = ('instructions', 'model_name', 'provider_name', 'provider_response_id', 'run_id', 'provider_details', 'metadata')
_PART_FIELDS = ('content', 'args', 'tool_name', 'tool_call_id', 'id', 'provider_name', 'provider_details', 'signature')


def _size(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, str):
        size = len(value) if value.isascii() else len(value.encode())
        return size + value.count('"') + value.count('\\') + 5 * value.count('\n')  # JSON escapes
    return len(to_json(value))


def _estimate(message: Any) -> int:
    """An upper estimate of a message's JSON size, in bytes, without serializing the message as a whole: the
    guard runs in workflow code, whose activation Temporal fails after 2 s, and a resumed history has 10,000
    messages (about 10 ms for them, against 240 ms to serialize them)."""
    try:
        total = _RESPONSE_OVERHEAD if isinstance(message, ModelResponse) else _REQUEST_OVERHEAD
        total += sum(_size(getattr(message, name, None)) for name in _MESSAGE_FIELDS)
        for part in getattr(message, 'parts', ()):
            total += _PART_OVERHEAD + sum(_size(getattr(part, name, None)) for name in _PART_FIELDS)
    except Exception:  # noqa: BLE001 - something `to_json` cannot write: measure the message exactly
        return len(ModelMessagesTypeAdapter.dump_json([message]))
    return total


def check_loaded(conversation_id: str, messages: list[Any], maximum: int | None = None) -> None:
    """Refuse a loaded history (message JSON) that no payload can carry: DC030, non-retryable.

    Raises:
        ApplicationError: type `DurcapPayloadTooLarge`, naming the conversation, its size and the limit.
    """
    limit = payload_maximum() if maximum is None else maximum
    size = sum(len(str(m)) for m in messages)  # cheap upper-bound-ish first look
    if size <= limit // 2:
        return
    size = len(json.dumps(messages, separators=(',', ':')))
    if size > limit:
        raise too_large(size, limit, f'conversation {conversation_id!r}: its stored history')


def named(error: BaseException, conversation_id: str | None) -> BaseException:
    """`error`, or, when it is an activity failure caused by the codec's refusal, the same refusal naming the
    conversation (a non-retryable `ApplicationError` the workflow fails with). Call in workflow code."""
    cause = error.__cause__ if isinstance(error, ActivityError) else None
    if isinstance(cause, ApplicationError) and cause.type in (TOO_LARGE, UNAVAILABLE):
        code, _, rest = cause.message.partition(' ')
        if conversation_id is not None and rest.startswith(f'conversation {conversation_id!r}'):
            return ApplicationError(cause.message, *cause.details, type=cause.type, non_retryable=True)
        return ApplicationError(f'{code} {_subject(conversation_id)}: {rest}', *cause.details, type=cause.type, non_retryable=True)
    return error
