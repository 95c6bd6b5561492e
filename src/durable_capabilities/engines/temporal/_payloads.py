"""Claim check for Temporal: payloads above a threshold travel by reference, stored in the conversation store.

Temporal refuses a payload over 2 MiB and a history over 50 MB. `ClaimCheckCodec` is a
`temporalio.converter.PayloadCodec` (Temporal's own extension point): every payload whose serialized size
is above `threshold` is written to the conversation store's database (table `durcap_payloads`, keyed by the
sha256 of its bytes, written once; the workflow it belongs to is recorded in `durcap_payload_refs`) and replaced
by a small reference payload:

    metadata: {'encoding': b'binary/durcap-claim-check'}
    data:     {"sha256": "<hex>", "size": <bytes>, "pages": ["<hex>", ...]}

Pieces that repeat are stored once. Every model request carries the whole conversation, so storing each
large payload whole (0.2's layout) made a conversation's storage grow with the square of its length. The
payload's body is cut into pieces where its content says (`cut`): before each message and after each list of
objects, so an appended message never changes the pieces before it, and a message is the same piece in every
payload that carries it. Each piece is a `durcap_payloads` row keyed by its sha256 and written once; the ordered
list of piece digests (32 bytes each) is cut into pages of `PAGE_DIGESTS` digests, stored the same way; the
reference lists the pages and the sha256 of the whole payload. A payload whose body makes a single piece is
stored whole, as in 0.2. References written by 0.2 (no `pages`) decode as before.

Decoding fetches the bytes back and checks the whole payload's digest. Workflow inputs, activity inputs and results
(model requests, tool results, the conversation history), signals, queries and failures all pass through
it, so the size of a conversation is bounded by the database, not by Temporal. `temporal workflow show`
prints the references; `durcap history export` writes them as they are, and `durcap replay` decodes them
through this codec (it needs the store).

Bounds, both configurable: a payload over `maximum` is refused with a non-retryable `ApplicationError` of
type `DurcapPayloadTooLarge` (code DC030); when the store cannot be written, a payload that Temporal can
still carry inline (up to `inline_limit`) goes inline, and a larger one is refused with
`DurcapClaimCheckUnavailable` (DC031). Where the codec runs in an activity's completion, that error fails
the activity for good; the workflow (`engines/temporal/_workflow.py`) turns it into a failed turn naming the
conversation. See `docs/temporal.md`.

The guard, second half of this module: Temporal: fail a turn that cannot be carried, in workflow code, instead of failing a workflow task forever.

The claim-check codec (`ClaimCheckCodec` above) carries any payload up to its maximum by reference.
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

import asyncio
import copy
import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse
from pydantic_core import to_json
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec, SerializationContext, WithSerializationContext
from temporalio.exceptions import ActivityError, ApplicationError

from ... import telemetry
from ...store import CorruptedRowError, SQLConversationStore, StoreError, resolve_url

ENCODING = b'binary/durcap-claim-check'
"""`encoding` metadata of a reference payload."""

DEFAULT_THRESHOLD = 256 * 1024
"""Payloads above this many bytes (serialized, metadata included) travel by reference: 256 KiB."""

DEFAULT_MAXIMUM = 64 * 1024 * 1024
"""A single payload above this many bytes is refused (DC030): 64 MiB."""

INLINE_LIMIT = 2 * 1024 * 1024 - 64 * 1024
"""Largest payload sent inline when the store cannot be written: under Temporal's 2 MiB, with room for the
rest of the request."""

THRESHOLD_ENV = 'DURCAP_CLAIM_CHECK_THRESHOLD'
MAXIMUM_ENV = 'DURCAP_PAYLOAD_MAXIMUM'
"""Environment variables overriding `DEFAULT_THRESHOLD` / `DEFAULT_MAXIMUM` (bytes), read where the client or
worker connects; give every client and worker of a deployment the same values."""

PAGE_DIGESTS = 32
"""Piece digests per page (1 KiB a page: the last page of a growing list is written again with every payload)."""

_CUT = re.compile(rb'(?<=[\[,])\{"parts":\[|\}\]')
"""Where pieces are cut: before a message (pydantic-ai writes `parts` first in both message kinds) that opens an
element of a list, and after the end of a list of objects (a message's parts, the message list itself). A quote
inside a JSON string is escaped, so `{"parts":[` never matches inside one (`}]` may; any cut is correct, only
sharing depends on where they fall)."""

PAYLOAD_TOO_LARGE = 'DC030'
CLAIM_CHECK_UNAVAILABLE = 'DC031'
"""The codes of the two refusals (see `validation.CODES`, `docs/errors.md`)."""

TOO_LARGE = 'DurcapPayloadTooLarge'
UNAVAILABLE = 'DurcapClaimCheckUnavailable'
"""`ApplicationError.type` of the codec's refusals (both non-retryable)."""

logger = logging.getLogger('durable_capabilities.claim_check')


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f'${name} must be a number of bytes, got {raw!r}') from None
    if value < 1:
        raise ValueError(f'${name} must be at least 1 byte, got {value}')
    return value


def too_large(size: int, maximum: int, where: str) -> ApplicationError:
    """The DC030 refusal: a payload of `size` bytes over `maximum` bytes, `where` naming what carried it."""
    return ApplicationError(
        f'{PAYLOAD_TOO_LARGE} {where}: a payload of {size:,} bytes is over the maximum of {maximum:,} bytes. Fix: keep tool '
        f'results and messages smaller (store large data elsewhere and return a reference), or raise '
        f'${MAXIMUM_ENV} on every client and worker.',
        size, maximum,
        type=TOO_LARGE,
        non_retryable=True,
    )


class ClaimCheckCodec(PayloadCodec, WithSerializationContext):
    """Stores payloads above `threshold` bytes in the conversation store and sends a reference instead.

    Args:
        store_url: The conversation store (SQLite or PostgreSQL URL, see `SQLConversationStore`). Every
            client and worker of a task queue must use the same database; the codec creates its table on
            first use (schema migration 2).
        threshold: Bytes above which a payload goes by reference (default `$DURCAP_CLAIM_CHECK_THRESHOLD`
            or `DEFAULT_THRESHOLD`).
        maximum: Bytes above which a payload is refused with DC030 (default `$DURCAP_PAYLOAD_MAXIMUM` or
            `DEFAULT_MAXIMUM`).
        inline_limit: Bytes up to which a payload is sent inline when the store cannot be written.

    Raises:
        StoreURLError: `store_url` is malformed (at construction).
        ValueError: a threshold or maximum below 1, or an environment override that is not a number.
    """

    def __init__(
        self,
        store_url: str,
        *,
        threshold: int | None = None,
        maximum: int | None = None,
        inline_limit: int = INLINE_LIMIT,
    ) -> None:
        self.threshold = threshold if threshold is not None else _env_int(THRESHOLD_ENV, DEFAULT_THRESHOLD)
        self.maximum = maximum if maximum is not None else _env_int(MAXIMUM_ENV, DEFAULT_MAXIMUM)
        if self.threshold < 1 or self.maximum < 1:
            raise ValueError('claim-check threshold and maximum must be at least 1 byte')
        self.inline_limit = inline_limit
        self.store_url = store_url
        self._store = SQLConversationStore(store_url)
        self.owner: str | None = None
        """The workflow id the payloads being encoded belong to (Temporal's serialization context), recorded with
        each claim check (`durcap_payload_refs`) so `durcap history delete` can delete a conversation's own."""

    def with_context(self, context: SerializationContext) -> ClaimCheckCodec:
        """A copy (same store) that records `context.workflow_id` as the owner of what it stores (Temporal calls
        this for each workflow and activity)."""
        bound = copy.copy(self)
        bound.owner = getattr(context, 'workflow_id', None) or None
        return bound

    def __repr__(self) -> str:
        return f'ClaimCheckCodec({self._store._sql.display_url!r}, threshold={self.threshold}, maximum={self.maximum})'

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload as it is, or, above the threshold, stored and replaced by a reference.

        Raises:
            ApplicationError: `DurcapPayloadTooLarge` (over `maximum`) or `DurcapClaimCheckUnavailable`
                (the store cannot be written and the payload is over `inline_limit`); non-retryable.
        """
        result: list[Payload] = []
        for payload in payloads:
            size = payload.ByteSize()
            if size <= self.threshold:
                result.append(payload)
                continue
            if size > self.maximum:
                raise too_large(size, self.maximum, 'Temporal payload')
            data = payload.SerializeToString(deterministic=True)
            try:
                body = len(payload.data) if data.endswith(payload.data) else len(data)
                reference = await asyncio.to_thread(self._put, data, body)
            except StoreError as exc:
                if size <= self.inline_limit:
                    logger.warning('claim check: %s; sending a payload of %d bytes inline', exc, size)
                    result.append(payload)
                    continue
                raise ApplicationError(
                    f'{CLAIM_CHECK_UNAVAILABLE} cannot store a payload of {size:,} bytes by reference (over the {self.inline_limit:,} '
                    f'bytes Temporal carries inline): {exc}. Fix: make the conversation store reachable and writable.',
                    size, self.inline_limit,
                    type=UNAVAILABLE,
                    non_retryable=True,
                ) from None
            result.append(Payload(metadata={'encoding': ENCODING}, data=reference))
            telemetry.claim_check_bytes('written', len(data))
        return result

    def _put(self, data: bytes, body: int) -> bytes:
        """Store `data`, a serialized payload whose last `body` bytes are its `data` field (its pieces and pages,
        or whole), and return the reference's JSON. Runs in a thread."""
        digest = hashlib.sha256(data).hexdigest()
        head = len(data) - body  # metadata and the body's length: differs with every size, so a piece of its own
        bounds = [(head + start, head + end) for start, end in cut(data[head:])]
        if head:
            bounds.insert(0, (0, head))
        if len(bounds) <= 2:  # the body in one piece: stored whole, 0.2's layout
            self._store._sql.put_payload(digest, data, self.owner)
            return json.dumps({'sha256': digest, 'size': len(data)}).encode()
        rows: list[tuple[str, bytes]] = []
        digests = bytearray()
        for start, end in bounds:
            piece = data[start:end]
            raw = hashlib.sha256(piece).digest()
            digests += raw
            rows.append((raw.hex(), piece))
        pages: list[str] = []
        step = 32 * PAGE_DIGESTS
        for start in range(0, len(digests), step):
            page = bytes(digests[start:start + step])
            pages.append(hashlib.sha256(page).hexdigest())
            rows.append((pages[-1], page))
        self._store._sql.put_payloads(rows, self.owner)
        return json.dumps({'sha256': digest, 'size': len(data), 'pages': pages}).encode()

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        """Each payload as it is, or, for a reference, the stored payload it names.

        Raises:
            StoreUnavailableError: the store cannot be read (Temporal retries the task that needed it).
            CorruptedRowError: the reference names a payload the store does not hold, or its bytes no
                longer match their sha256.
        """
        result: list[Payload] = []
        for payload in payloads:
            if payload.metadata.get('encoding') != ENCODING:
                result.append(payload)
                continue
            reference = json.loads(payload.data)
            data = await asyncio.to_thread(self._get, reference)
            telemetry.claim_check_bytes('read', len(data))
            result.append(Payload.FromString(data))
        return result

    def _get(self, reference: dict[str, Any]) -> bytes:
        """The bytes a reference names (whole, or from its pages and pieces), checked. Runs in a thread."""
        digest = reference['sha256']
        pages = reference.get('pages')
        sql = self._store._sql
        if pages is None:  # stored whole (0.2, or a single piece)
            data = sql.get_payload(digest)
            if data is None:
                raise self._corrupted(reference, digest, 'is not in')
        else:
            found = sql.get_payloads(pages)
            for page in pages:
                if page not in found:
                    raise self._corrupted(reference, page, 'has a page that is not in')
                if hashlib.sha256(found[page]).hexdigest() != page:
                    raise self._corrupted(reference, page, 'has a page that does not match its sha256 in')
            digests = [raw.hex() for page in pages for raw in _split(found[page])]
            pieces = sql.get_payloads(digests)
            missing = next((d for d in digests if d not in pieces), None)
            if missing is not None:
                raise self._corrupted(reference, missing, 'has a piece that is not in')
            data = b''.join(pieces[d] for d in digests)
        if hashlib.sha256(data).hexdigest() != digest:
            raise self._corrupted(reference, digest, 'does not match its sha256 in')
        return data

    def _corrupted(self, reference: dict[str, Any], row: str, what: str) -> CorruptedRowError:
        return CorruptedRowError(
            f'claim check {reference["sha256"]} ({reference.get("size")} bytes) {what} durcap_payloads of '
            f'{self._store._sql.display_url}: a Temporal history refers to it (row {row}). Restore the row from a '
            'backup, or point the worker at the store its clients use ($DURCAP_STORE).',
            conversation_id=None, table='durcap_payloads', row=row,
        )


def _split(page: bytes) -> list[bytes]:
    return [page[i:i + 32] for i in range(0, len(page), 32)]


def cut(data: bytes) -> list[tuple[int, int]]:
    """The `(start, end)` of each piece of `data`, cut where its content says (`_CUT`): before each message
    (`{"parts":[` opening an element of a list) and after each list of objects (`}]`).

    Content-defined: where a cut falls depends only on the bytes around it, not on what came before, so a message
    list that grew at its end shares every piece but the last with the shorter one, and the same message carried
    in another payload (the conversation-load result, a later model request) is the same piece.
    """
    bounds: list[tuple[int, int]] = []
    start = 0
    for match in _CUT.finditer(data):
        end = match.start() if match.group() != b'}]' else match.end()
        if end > start:
            bounds.append((start, end))
            start = end
    if start < len(data) or not bounds:
        bounds.append((start, len(data)))
    return bounds


def default_codec(store: str | None = None) -> ClaimCheckCodec:
    """The codec every durcap Temporal client, worker and replayer uses: on `store`, else `$DURCAP_STORE`,
    else the default store (`store.DEFAULT_URL`), as the conversation activities resolve it."""
    return ClaimCheckCodec(resolve_url(store))


# ---- the guard: refuse in workflow code what no payload can carry ----------------------------------------------

_MARGIN = 64 * 1024
"""Bytes a model-request input carries besides the messages (settings, tool definitions), counted against the maximum."""

_MAX_TRACKED_RUNS = 1024


def payload_maximum() -> int:
    """The configured single-payload maximum in bytes: `$DURCAP_PAYLOAD_MAXIMUM` or `DEFAULT_MAXIMUM`."""
    return _env_int(MAXIMUM_ENV, DEFAULT_MAXIMUM)


current_run: ContextVar[Any] = ContextVar('durcap_temporal_run', default=None)
"""The `AgentRunInput` of the Temporal workflow run whose turn is running (set by the workflow's `run` in `_workflow`;
read here and by the continue-as-new handler). Typed `Any`: `_workflow` imports this module, not the other way."""


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


_TOOL_ACTIVITY = re.compile(r'__toolset__(?P<capability>.+)__call_tool$')


def _carrier(error: ActivityError, tool: str | None) -> str | None:
    """What the refused payload was, from the activity that carried it: a tool's result (its capability is the
    toolset id in the activity type `agent__{agent}__toolset__{id}__call_tool`) or a model request's response."""
    activity = error.activity_type or ''
    if match := _TOOL_ACTIVITY.search(activity):
        name = f'tool {tool!r}' if tool else 'a tool'
        return f'the result of {name} (capability {match["capability"]!r}, activity {activity!r})'
    if '__model_request' in activity:
        return f'the response of the model request (activity {activity!r})'
    return None


def named(error: BaseException, conversation_id: str | None, tool: str | None = None) -> BaseException:
    """`error`, or, when it is an activity failure caused by the codec's refusal, the same refusal naming the
    conversation and what the payload was (the tool, `tool` when given, and its capability, or the model request):
    a non-retryable `ApplicationError` the workflow fails with. Call in workflow code."""
    cause = error.__cause__ if isinstance(error, ActivityError) else None
    if isinstance(error, ActivityError) and isinstance(cause, ApplicationError) and cause.type in (TOO_LARGE, UNAVAILABLE):
        code, _, rest = cause.message.partition(' ')
        what = _carrier(error, tool)
        if what is not None and rest.startswith('Temporal payload: '):
            rest = f'{what}: {rest.removeprefix("Temporal payload: ")}'
        elif what is not None and code == CLAIM_CHECK_UNAVAILABLE:
            rest = f'{what}: {rest}'
        if conversation_id is not None and rest.startswith(f'conversation {conversation_id!r}'):
            return ApplicationError(f'{code} {rest}', *cause.details, type=cause.type, non_retryable=True)
        return ApplicationError(f'{code} {_subject(conversation_id)}: {rest}', *cause.details, type=cause.type, non_retryable=True)
    return error
