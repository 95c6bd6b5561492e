"""Claim check for Temporal: payloads above a threshold travel by reference, stored in the conversation store.

Temporal refuses a payload over 2 MiB and a history over 50 MB. `ClaimCheckCodec` is a
`temporalio.converter.PayloadCodec` (Temporal's own extension point): every payload whose serialized size
is above `threshold` is written to the conversation store's database (table `durcap_payloads`, keyed by the
sha256 of its bytes, written once) and replaced by a small reference payload:

    metadata: {'encoding': b'binary/durcap-claim-check'}
    data:     {"sha256": "<hex>", "size": <bytes>}

Decoding fetches the bytes back and checks their digest. Workflow inputs, activity inputs and results
(model requests, tool results, the conversation history), signals, queries and failures all pass through
it, so the size of a conversation is bounded by the database, not by Temporal. `temporal workflow show`
prints the references; `durcap history export` writes them as they are, and `durcap replay` decodes them
through this codec (it needs the store).

Bounds, both configurable: a payload over `maximum` is refused with a non-retryable `ApplicationError` of
type `DurcapPayloadTooLarge` (code DC030); when the store cannot be written, a payload that Temporal can
still carry inline (up to `inline_limit`) goes inline, and a larger one is refused with
`DurcapClaimCheckUnavailable` (DC031). Where the codec runs in an activity's completion, that error fails
the activity for good; the workflow (`engines/temporal.py`) turns it into a failed turn naming the
conversation. See `docs/temporal.md`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
from collections.abc import Sequence

from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec
from temporalio.exceptions import ApplicationError

from . import DEFAULT_URL, STORE_ENV, CorruptedRowError, SQLConversationStore, StoreError

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


class ClaimCheckCodec(PayloadCodec):
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
            digest = hashlib.sha256(data).hexdigest()
            try:
                await asyncio.to_thread(self._store._sql.put_payload, digest, data)
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
            reference = json.dumps({'sha256': digest, 'size': len(data)}).encode()
            result.append(Payload(metadata={'encoding': ENCODING}, data=reference))
        return result

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
            digest = reference['sha256']
            data = await asyncio.to_thread(self._store._sql.get_payload, digest)
            if data is None or hashlib.sha256(data).hexdigest() != digest:
                what = 'is not in' if data is None else 'does not match its sha256 in'
                raise CorruptedRowError(
                    f'claim check {digest} ({reference.get("size")} bytes) {what} durcap_payloads of '
                    f'{self._store._sql.display_url}: a Temporal history refers to it. Restore the row from a backup, '
                    'or point the worker at the store its clients use ($DURCAP_STORE).',
                    conversation_id=None, table='durcap_payloads', row=digest,
                )
            result.append(Payload.FromString(data))
        return result


def default_codec(store: str | None = None) -> ClaimCheckCodec:
    """The codec every durcap Temporal client, worker and replayer uses: on `store`, else `$DURCAP_STORE`,
    else the default store (`store.DEFAULT_URL`), as the conversation activities resolve it."""
    return ClaimCheckCodec(store or os.environ.get(STORE_ENV) or DEFAULT_URL)
