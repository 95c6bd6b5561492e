"""Claim check for Temporal: payloads above a threshold travel by reference, stored in the conversation store.

Temporal refuses a payload over 2 MiB and a history over 50 MB. `ClaimCheckCodec` is a
`temporalio.converter.PayloadCodec` (Temporal's own extension point): every payload whose serialized size
is above `threshold` (16 KiB) is written to the conversation store's database (table `durcap_payloads`) and replaced
by a small reference payload:

    metadata: {'encoding': b'binary/durcap-claim-check'}
    data:     {"sha256": "<hex>", "size": <bytes>, "head": "<base64>", "root": "<hex>", "height": <levels>}

What repeats is stored once (issue 24: a conversation's storage grows linearly with its messages, whatever the
number of model requests). Every model request carries the whole conversation, and so does every conversation load;
a ~50 KB tool result is carried by its activity's result, every later model request, the append and every later
load. The payload's body is cut into pieces where its content says (`pieces`): around each message (so a message is
the same pieces last in a list, in the middle, or as a stored message's text), around the inside of every long JSON
string (a tool result is one piece wherever it is carried), inside a string that holds JSON text one level down with
its pieces kept unescaped (the load result's rows are then the same pieces as the messages of the model requests),
and around what changes from one model request to the next in its run context. Each piece is a `durcap_payloads` row
keyed by its sha256 and written once, compressed when that pays (`_pack`, kind 3). The ordered entries (a depth byte
and a piece's sha256) are cut into pages of `PAGE_DIGESTS`, and the page digests into pages again up to one root; the
reference names the root and its height, carries the payload's head (its protobuf header and a short first piece:
they differ with every payload) and the sha256 of the whole payload, checked after joining. The workflow that writes
it records one `durcap_payload_refs` row, for the root (schema 8); `purge`, `collect` and `stats` read the pages under
it. A payload whose body makes a single piece is stored whole, as in 0.2. References written by 0.2 (`sha256` and
`size` only) and by 0.3 (`pages`: one level of pages of 32-byte piece digests) decode as before.

Decoding fetches the bytes back and checks the whole payload's digest (once per payload, the codec that
has just stored it hands its first decode the bytes it wrote: `_Recent`). Workflow inputs, activity inputs and results
(model requests, tool results, the conversation history), signals, queries and failures all pass through
it, so the size of a conversation is bounded by the database, not by Temporal. `temporal workflow show`
prints the references; `durcap history export` writes them as they are, and `durcap replay` decodes them
through this codec (it needs the store).

Bounds, both configurable: a payload over `maximum` is refused with a non-retryable `ApplicationError` of
type `DurcapPayloadTooLarge` (code DC030); when the store cannot be written, a payload that Temporal can
still carry inline (up to `inline_limit`) goes inline, and a larger one is refused with
`DurcapClaimCheckUnavailable` (DC031). Where the codec runs in an activity's completion, that error fails
the activity for good; the workflow (`engines/temporal/_workflow.py`) turns it into a failed turn naming the
conversation. See `docs/quickstart/temporal.md`.

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
import base64
import copy
import hashlib
import json
import logging
import os
import re
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import ModelMessagesTypeAdapter, ModelResponse
from pydantic_core import to_json
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.converter import DataConverter, PayloadCodec, SerializationContext, WithSerializationContext
from temporalio.exceptions import ActivityError, ApplicationError

from ... import telemetry
from ...store import CorruptedRowError, SQLConversationStore, StoreError, resolve_url

ENCODING = b'binary/durcap-claim-check'
"""`encoding` metadata of a reference payload."""

DEFAULT_THRESHOLD = 16 * 1024
"""Payloads above this many bytes (serialized, metadata included) travel by reference: 16 KiB (0.3: 256 KiB). Under a
tool result of tens of KB, so that it is one stored piece instead of inline in three events of every turn's history
(its activity's result, the append's input, the workflow's result) and in every early model request: Temporal's
database went from 4-6x the conversation's bytes to ~0.65x (`bench/bench_storage.py`). The cost: a store write per
payload over it (~4 ms for 50 KB on SQLite) and a read back (~1 ms)."""

DEFAULT_MAXIMUM = 64 * 1024 * 1024
"""A single payload above this many bytes is refused (DC030): 64 MiB."""

INLINE_LIMIT = 2 * 1024 * 1024 - 64 * 1024
"""Largest payload sent inline when the store cannot be written: under Temporal's 2 MiB, with room for the
rest of the request."""

THRESHOLD_ENV = 'DURCAP_CLAIM_CHECK_THRESHOLD'
MAXIMUM_ENV = 'DURCAP_PAYLOAD_MAXIMUM'
"""Environment variables overriding `DEFAULT_THRESHOLD` / `DEFAULT_MAXIMUM` (bytes), read where the client or
worker connects; give every client and worker of a deployment the same values."""

PAGE_DIGESTS = 16
"""Entries per page (a leaf's are a depth byte and a piece's sha256, 33 bytes; a page of pages' are sha256s): the last
page of each level of a growing list is written again with every payload, so pages are small (measured: 16 stores
less than 32 or 8)."""

INLINE_FIRST = 256
"""Bytes up to which a payload's first piece goes in the reference with its head instead of in a page."""

_TOKEN = re.compile(
    # Skipped whole, never given back (possessive): what cuts nothing, short strings without escapes among it.
    rb'(?:[^"\[,}]++|"[^"\\]{0,127}"|[\[,](?!\{"parts":\[)(?!"(?:serialized_run_context|usage_limits)":)|\}(?!\]))*+'
    # Then, if any, the token (group 1).
    rb'("[^"\\]*(?:\\.[^"\\]*)*"|[\[,](?=\{"parts":\[)|\}(?=\])|,(?="(?:serialized_run_context|usage_limits)":))?',
    re.DOTALL)
"""What `pieces` reads (a match is what it skips, then the token it found, group 1; one pass, linear: nothing skipped
is read again): a JSON string (whole, so nothing inside one is taken for structure), the `[` or `,` before a
message (pydantic-ai writes `parts` first in both message kinds), the `}` that ends the last element of a list of
objects (a message's parts, the message list), and the two keys of a model request's run context around what changes
from request to request (its usage and step). A message is cut from the comma before it and from the `]` after it, so
it is the same pieces whether another message follows it, it ends the list, or it is a stored message's text (the
load result). Any cut is correct (the pieces are joined back as they were); only what is shared depends on where they
fall."""

_UNESCAPE = re.compile(rb'\\([\\"])')

LONG_STRING = 1024
"""Bytes from which the inside of a JSON string is a piece of its own (a tool result, a long prompt or answer)."""

EMBEDDED_JSON = 128
"""Bytes from which the inside of a JSON string holding JSON text (escaped quotes: a stored message's text in the
conversation-load result) is cut one level down. `_TOKEN` skips strings up to 127 bytes without escapes: keep the two
together."""

MAX_DEPTH = 3
"""How many levels of JSON-in-a-JSON-string `pieces` cuts into."""

KIND_PIECE, KIND_LEAF, KIND_PAGE, KIND_ZPIECE = 0, 1, 2, 3
"""`durcap_payloads.kind` (schema 8): a piece (or a whole payload, or a page of 0.3's layout, whose owners refer to
each of its pieces), a leaf page (entries of a depth byte and a piece's sha256), a page of page digests, a piece
stored compressed (zlib; its sha256 is that of its bytes before)."""

COMPRESS_FROM = 256
"""Bytes from which a piece is stored compressed, when zlib (level 1: ~0.7 ms for 50 KB) saves at least a tenth."""

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
        self._recent = _Recent(RECENT_BYTES)  # shared by the `with_context` copies (the worker's workflows, activities)
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
            self._recent.keep(reference, data)
        return result

    def _put(self, data: bytes, body: int) -> bytes:
        """Store `data`, a serialized payload whose last `body` bytes are its `data` field (its pieces and pages,
        or whole), and return the reference's JSON. Runs in a thread."""
        digest = hashlib.sha256(data).hexdigest()
        head = len(data) - body  # metadata and the body's length: differs with every size
        found = pieces(data[head:])
        if len(found) <= 1:  # the body in one piece: stored whole, 0.2's layout
            self._store._sql.put_payload(digest, data, self.owner)
            return json.dumps({'sha256': digest, 'size': len(data)}).encode()
        # The head, and the body's first piece when it is short (`{"messages":[`, a load result's revision), go in the
        # reference: they differ from payload to payload, and as the first entry they would make every payload's first
        # page a new one.
        prefix = data[:head]
        if found[0][0] == 0 and len(found[0][1]) <= INLINE_FIRST:
            prefix += found.pop(0)[1]
        rows: dict[str, tuple[bytes, int]] = {}
        entries: list[bytes] = []
        for depth, piece in found:
            raw = hashlib.sha256(piece).digest()
            entries.append(bytes((depth,)) + raw)
            rows.setdefault(raw.hex(), (piece, KIND_PIECE))
        level, height = entries, 0
        while height == 0 or len(level) > 1:  # pages of pages until one page: the root
            height += 1
            above: list[bytes] = []
            for start in range(0, len(level), PAGE_DIGESTS):
                page = b''.join(level[start:start + PAGE_DIGESTS])
                raw = hashlib.sha256(page).digest()
                rows.setdefault(raw.hex(), (page, KIND_LEAF if height == 1 else KIND_PAGE))
                above.append(raw)
            level = above
        root = level[0].hex()
        self._store._sql.put_tree(root, [(d, piece, kind) for d, (piece, kind) in rows.items()], self.owner, _pack)
        reference = {'sha256': digest, 'size': len(data), 'head': base64.b64encode(prefix).decode(), 'root': root, 'height': height}
        return json.dumps(reference, separators=(',', ':')).encode()

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
            data = self._recent.take(payload.data)
            if data is None:
                data = await asyncio.to_thread(self._get, json.loads(payload.data))
            telemetry.claim_check_bytes('read', len(data))
            result.append(Payload.FromString(data))
        return result

    def _get(self, reference: dict[str, Any]) -> bytes:
        """The bytes a reference names (whole, or from its pages and pieces), checked. Runs in a thread."""
        digest = reference['sha256']
        sql = self._store._sql
        if 'root' in reference:  # a tree of pages: entries of a depth byte and a piece digest at the leaves
            level: list[str] = [reference['root']]
            for _ in range(int(reference['height']) - 1):  # pages of page digests, down to the leaves
                found = self._pages(reference, level)
                level = [raw.hex() for page in level for raw in _split(found[page], 32)]
            found = self._pages(reference, level)
            entries = [(raw[0], raw[1:].hex()) for page in level for raw in _split(found[page], 33)]
            rows = sql.get_rows([d for _, d in entries])
            missing = next((d for _, d in entries if d not in rows), None)
            if missing is not None:
                raise self._corrupted(reference, missing, 'has a piece that is not in')
            try:
                plain = {d: zlib.decompress(raw) if kind == KIND_ZPIECE else raw for d, (raw, kind) in rows.items()}
            except zlib.error:
                bad = next(d for d, (raw, kind) in rows.items() if kind == KIND_ZPIECE and not _inflates(raw))
                raise self._corrupted(reference, bad, 'has a piece that does not decompress in') from None
            data = base64.b64decode(reference.get('head', '')) + b''.join(_escape(plain[d], depth) for depth, d in entries)
        elif (pages := reference.get('pages')) is not None:  # one level of pages of piece digests (0.3)
            found = self._pages(reference, pages)
            digests = [raw.hex() for page in pages for raw in _split(found[page], 32)]
            stored = sql.get_payloads(digests)
            missing = next((d for d in digests if d not in stored), None)
            if missing is not None:
                raise self._corrupted(reference, missing, 'has a piece that is not in')
            data = b''.join(stored[d] for d in digests)
        else:  # stored whole (0.2, or a single piece)
            whole = sql.get_payload(digest)
            if whole is None:
                raise self._corrupted(reference, digest, 'is not in')
            data = whole
        if hashlib.sha256(data).hexdigest() != digest:
            raise self._corrupted(reference, digest, 'does not match its sha256 in')
        return data

    def _pages(self, reference: dict[str, Any], pages: list[str]) -> dict[str, bytes]:
        """`{digest: bytes}` of `pages`, each checked against its digest."""
        found = self._store._sql.get_payloads(pages)
        for page in pages:
            if page not in found:
                raise self._corrupted(reference, page, 'has a page that is not in')
            if hashlib.sha256(found[page]).hexdigest() != page:
                raise self._corrupted(reference, page, 'has a page that does not match its sha256 in')
        return found

    def _corrupted(self, reference: dict[str, Any], row: str, what: str) -> CorruptedRowError:
        return CorruptedRowError(
            f'claim check {reference["sha256"]} ({reference.get("size")} bytes) {what} durcap_payloads of '
            f'{self._store._sql.display_url}: a Temporal history refers to it (row {row}). Restore the row from a '
            'backup, or point the worker at the store its clients use ($DURCAP_STORE).',
            conversation_id=None, table='durcap_payloads', row=row,
        )


class _Recent:
    """Payloads a codec (with its `with_context` copies: one worker's) has just stored by reference, each handed once
    to the first decode of its reference there instead of read back from the store: a model request's input is stored
    when the workflow task that schedules it completes and decoded by that activity, which the same worker usually
    runs (`bench/bench_throughput.py`: ~0.9 ms of CPU and a thread hop saved per payload over the threshold). Only
    once, and only bytes this codec wrote after their write committed (the bytes whose sha256 the reference names):
    every later decode (a retried attempt, a replay, another process) reads the store and checks the digest as before.
    At most `RECENT_BYTES`, the oldest dropped first (what another worker decodes is never taken here)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.size = limit, 0
        self.entries: OrderedDict[bytes, bytes] = OrderedDict()
        self.lock = threading.Lock()

    def take(self, reference: bytes) -> bytes | None:
        """The payload `reference` (a reference payload's data) names, removed, if this codec stored it and has not
        handed it out yet; else `None`."""
        with self.lock:
            data = self.entries.pop(reference, None)
            if data is not None:
                self.size -= len(data)
            return data

    def keep(self, reference: bytes, data: bytes) -> None:
        """Remember `data`, just stored under `reference`, for one `take`."""
        if len(data) > self.limit // 4:
            return
        with self.lock:
            if reference in self.entries:
                return
            self.entries[reference] = data
            self.size += len(data)
            while self.size > self.limit:
                _, dropped = self.entries.popitem(last=False)
                self.size -= len(dropped)


RECENT_BYTES = 8 * 1024 * 1024
"""Bytes of just-stored payloads a codec keeps for their first decode (`_Recent`): 8 MiB."""

BOUND_CONVERTERS = 4096
"""Workflow ids whose context-bound data converter a `ClaimCheckDataConverter` keeps (`with_context`), the oldest
dropped first: about as many runs as a worker has in flight (the SDK's default: 100 workflow tasks, 100 activities)."""


@dataclass(frozen=True)
class ClaimCheckDataConverter(DataConverter):
    """temporalio's `DataConverter` for the claim-check codec, whose `with_context` reuses one bound copy per workflow
    id (the owner the codec records, `ClaimCheckCodec.with_context`) instead of building a new one per call.

    Why: temporalio binds the data converter to a serialization context for every payload sequence of a workflow
    activation and its completion (`_CommandAwareDataConverter`, each command's own context) and for every activity.
    With a context-aware codec, `DataConverter.with_context` clones the converter, which builds a new payload
    converter (pydantic-ai's) each time: measured 15 us a call against 1.4 us without the codec, several hundred
    calls per run (`bench/bench_throughput.py`, bench/README.md "Issue 29"). A bound copy depends on the context only
    through the codec's owner when the payload converter, failure converter and external storage return themselves
    from `with_context` (pydantic-ai's do); otherwise every call binds a new copy, as `DataConverter` does.
    Bound copies are immutable (frozen), so sharing one is safe.
    """

    _bound: dict[str | None, DataConverter] = field(default_factory=dict, init=False, repr=False, compare=False)
    _bound_lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False, compare=False)

    def with_context(self, context: SerializationContext) -> DataConverter:
        """This converter bound to `context` (the same object for every context of one workflow id; see the class)."""
        if not isinstance(self.payload_codec, ClaimCheckCodec) or not self._only_codec_bound(context):
            return super().with_context(context)
        owner = getattr(context, 'workflow_id', None) or None
        bound = self._bound.get(owner)
        if bound is None:
            bound = super().with_context(context)
            with self._bound_lock:
                if len(self._bound) >= BOUND_CONVERTERS:
                    self._bound.pop(next(iter(self._bound)))
                self._bound[owner] = bound
        return bound

    def _only_codec_bound(self, context: SerializationContext) -> bool:
        """Whether only the codec changes with `context` (every other part returns itself from `with_context`)."""
        for part in (self.payload_converter, self.failure_converter, self.external_storage):
            if isinstance(part, WithSerializationContext) and part.with_context(context) is not part:
                return False
        return True



def _pack(data: bytes, kind: int) -> tuple[bytes, int]:
    """What the store keeps of a row not stored yet: a piece of `COMPRESS_FROM` bytes or more compressed (`KIND_ZPIECE`)
    when that saves a tenth, else as it is."""
    if kind == KIND_PIECE and len(data) >= COMPRESS_FROM:
        packed = zlib.compress(data, 1)
        if len(packed) <= len(data) * 0.9:
            return packed, KIND_ZPIECE
    return data, kind


def _inflates(data: bytes) -> bool:
    try:
        zlib.decompress(data)
    except zlib.error:
        return False
    return True


def _split(page: bytes, width: int) -> list[bytes]:
    return [page[i:i + width] for i in range(0, len(page), width)]


def _escape(text: bytes, depth: int) -> bytes:
    """`text` written `depth` times more as the inside of a JSON string (`\\` and `"` escaped)."""
    for _ in range(depth):
        text = text.replace(b'\\', b'\\\\').replace(b'"', b'\\"')
    return text


def _unescape(text: bytes) -> bytes | None:
    """The JSON text `text` is the inside of a JSON string of, when `_escape(., 1)` gives `text` back exactly (only
    `\\` and `"` escaped: the form pydantic's and Temporal's JSON give a string holding JSON); else `None`."""
    plain = _UNESCAPE.sub(rb'\1', text)
    return plain if _escape(plain, 1) == text else None


def pieces(data: bytes, depth: int = 0) -> list[tuple[int, bytes]]:
    """The pieces of `data` (JSON text, or any bytes) as `(depth, bytes)`, cut where its content says (`_TOKEN`):
    before each message (`{"parts":[` opening an element of a list), after each list of objects (`}]`), and around the
    inside of every JSON string of at least `LONG_STRING` bytes. A long string that holds JSON text (a stored
    message's text, as the conversation-load result carries it) is cut the same way, one level down: its pieces are
    kept with `"` and `\\` unescaped once (`depth` + 1), so they are the same pieces as the messages the other
    payloads carry; `_escape(piece, depth)` gives the bytes back. `data` is at `depth` already.

    Content-defined: where a cut falls depends only on the bytes around it, not on what came before, so a message
    list that grew at its end shares every piece but the last with the shorter one, and the same message or long
    string carried in another payload (a tool's result, a model request, the append, the conversation-load result)
    is the same piece.
    """
    found: list[tuple[int, bytes]] = []
    start = 0
    for match in _TOKEN.finditer(data):
        begin, end = match.span(1)
        if begin < 0:  # the end, or a quote that opens no string
            continue
        first = data[begin]
        if first == 0x22:  # a string
            size = end - begin - 2
            if size < EMBEDDED_JSON:
                continue
            inside = data[begin + 1:end - 1]
            plain = _unescape(inside) if depth < MAX_DEPTH and b'\\"' in inside else None
            if plain is None and size < LONG_STRING:
                continue
            if begin + 1 > start:
                found.append((depth, data[start:begin + 1]))
            if plain is not None:
                found += pieces(plain, depth + 1)
            else:
                found.append((depth, inside))
            start = end - 1
            continue
        if first == 0x2C:  # `,`: a piece of its own before a message, else the start of the next piece
            cuts = (begin, end) if data.startswith(b'{"parts":[', end) else (begin,)
        else:  # after the `[` before the first message, after the `}` ending a list
            cuts = (end,)
        for at in cuts:
            if at > start:
                found.append((depth, data[start:at]))
                start = at
    if start < len(data) or not found:
        found.append((depth, data[start:]))
    return found


def default_codec(store: str | None = None) -> ClaimCheckCodec:
    """The codec every durcap Temporal client, worker and replayer uses: on `store`, else `$DURCAP_STORE`,
    else the default store (`store.DEFAULT_URL`), as the conversation activities resolve it."""
    return ClaimCheckCodec(resolve_url(store))


def default_data_converter(store: str | None = None) -> ClaimCheckDataConverter:
    """The data converter of every durcap Temporal client, worker and replayer: `default_codec(store)` in a
    `ClaimCheckDataConverter` (`PydanticAIPlugin` keeps it and its codec, and sets pydantic-ai's payload converter)."""
    return ClaimCheckDataConverter(payload_codec=default_codec(store))


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
