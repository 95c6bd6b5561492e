"""The conversation load/append unit, shared by every durable engine: one body and one retry policy.

Each engine wraps `load_unit(agent)` and `append_unit(agent)` in its own durable unit (a Temporal activity, a DBOS
step, a Prefect task), so store I/O runs only inside a unit, and takes its retry numbers from `UnitRetry` values in
its `_spec`. What every engine shares: the bodies below, and which store errors no retry can fix
(`PERMANENT_LOAD_ERRORS`, `PERMANENT_APPEND_ERRORS`: fail the unit at once).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import telemetry
from ..conversations import (
    LoadedConversation,
    LoadedHead,
    append_conversation,
    claim_turn,
    load_conversation,
    read_loaded_head,
    release_turn,
)
from ..store import (
    AppendIdReuseError,
    ConversationBusyError,
    ConversationConflictError,
    CorruptedRowError,
    NewerHistoryError,
    SchemaVersionError,
    StoreReadOnlyError,
    StoreURLError,
)
from ..validation import DurableConfigError

if TYPE_CHECKING:
    from ..agent import DurableAgent

_NEVER_FIXED_BY_A_RETRY: tuple[type[BaseException], ...] = (
    DurableConfigError, ConversationConflictError, CorruptedRowError, NewerHistoryError, SchemaVersionError, StoreURLError,
)
PERMANENT_LOAD_ERRORS: tuple[type[BaseException], ...] = (*_NEVER_FIXED_BY_A_RETRY, StoreReadOnlyError,
                                                          ConversationBusyError)
"""Errors a retried load cannot fix: the definition, the stored rows or the URL are wrong, or the conversation is
busy and the turn's strategy is `'reject'` (refused before any side effect)."""

PERMANENT_APPEND_ERRORS: tuple[type[BaseException], ...] = (*_NEVER_FIXED_BY_A_RETRY, AppendIdReuseError)
"""Errors a retried append cannot fix: another run appended since this one loaded, the append id was reused with
other messages, the store is corrupted or newer. A read-only store is retried: it may be a failover in progress."""


def error_names(errors: tuple[type[BaseException], ...]) -> list[str]:
    """The class names of `errors` (Temporal's `RetryPolicy(non_retryable_error_types=...)` matches on names)."""
    return [error.__name__ for error in errors]


@dataclass(frozen=True)
class UnitRetry:
    """How an engine retries one conversation unit.

    Attributes:
        attempts: Attempts in all, the first included (0: no cap).
        initial_seconds: Wait before the first retry.
        backoff: Multiplier of the wait after each retry.
        maximum_seconds: Cap of one wait.
    """

    attempts: int
    initial_seconds: float = 1.0
    backoff: float = 2.0
    maximum_seconds: float = 60.0

    def delays(self) -> list[float]:
        """The waits before each retry, in seconds (`attempts - 1` of them; needs a capped `attempts`)."""
        waits, wait = [], self.initial_seconds
        for _ in range(max(self.attempts - 1, 0)):
            waits.append(min(wait, self.maximum_seconds))
            wait *= self.backoff
        return waits


LoadUnit = Callable[..., Awaitable[LoadedConversation | LoadedHead]]
AppendUnitBody = Callable[..., Awaitable[int]]
StoreSource = str | Callable[[], str | None] | None
"""Where a unit finds its store URL: the URL, a callable read each time the unit runs (an engine whose units are
built once per process but run for callers with different stores), or `None` (`$DURCAP_STORE`, else the default).
`DurableAgent(conversation_store=...)` wins over it (`conversations.store_url`)."""

RunOf = Callable[[], str]
"""Inside a unit: the id of the durable run it belongs to (Temporal workflow id, DBOS workflow id, Prefect flow run
id), the holder of the run's turn claim (`conversations.claim_turn`)."""


def _url(store: StoreSource) -> str | None:
    return store() if callable(store) else store


def load_unit(agent: DurableAgent[Any, Any], check: Callable[[str, list[Any]], None] | None = None, *,
              store: StoreSource = None, run_of: RunOf | None = None,
              beat: Callable[[], None] | None = None,
              alive: Callable[[str], Awaitable[bool]] | None = None, by_head: bool = False) -> LoadUnit:
    """The body of the conversation-load unit of `agent`: claim the conversation for the run's turn, then read it
    (checked for drift). `load(conversation_id, busy=None)`.

    Args:
        agent: The definition whose conversations are read.
        check: Called with the conversation id and the rows (or messages) read, before they cross the engine's
            boundary (Temporal's payload guard: DC030 in the activity, not in a workflow task).
        store: The store URL (or where to read it, see `StoreSource`): the run's or the worker's `--store`.
        run_of: The run's id inside the unit (`RunOf`); `None`: no claim (a caller that takes none).
        beat: Called while an enqueued turn waits for the conversation (Temporal's activity heartbeat).
        alive: Whether the run holding the conversation still runs (asked of the engine's server): the claim of a
            run that ended without releasing it is taken over (`conversations.claim_turn`).
        by_head: Return a stored conversation as its `conversations.LoadedHead` (revision, head entry id, count), not
            its rows: what an engine that records the unit's result in its own database (DBOS, Prefect) returns, so a
            turn records a few bytes instead of the whole history; its container reads the rows back
            (`conversations.read_loaded_head`).

    The load's `busy` (`'reject'` | `'enqueue'`, `None`: `DurableAgent(busy=...)`) says what to do when another run
    holds the conversation (`conversations.claim_turn`): `ConversationBusyError` (DC050), or wait.
    """

    async def load(conversation_id: str, busy: str | None = None) -> LoadedConversation | LoadedHead:
        with telemetry.unit_span('store.load', agent=agent.name, conversation_id=conversation_id) as span:
            loaded = await _load(conversation_id, busy)
            if span is not None:
                span.set_attribute('durcap.revision', loaded.revision or 0)
            return loaded

    async def _load(conversation_id: str, busy: str | None = None) -> LoadedConversation | LoadedHead:
        holder = run_of() if run_of is not None else None
        if holder is not None:
            await claim_turn(agent, conversation_id, holder, busy or agent.busy, store=_url(store), beat=beat,
                             alive=alive)
        try:
            loaded = await load_conversation(agent, conversation_id, store=_url(store), by_head=by_head)
            if check is not None and isinstance(loaded, LoadedConversation):
                check(conversation_id, loaded.rows if loaded.rows is not None else loaded.messages)
        except BaseException:
            if holder is not None:  # the turn does not start: the conversation is free again
                await release_turn(agent, conversation_id, holder, store=_url(store))
            raise
        return loaded

    return load


def read_back(agent: DurableAgent[Any, Any], *, store: StoreSource = None,
              release: Callable[[str], Awaitable[Any]] | None = None) -> Callable[[str, Any], Awaitable[Any]]:
    """In the container's code (a DBOS workflow, a Prefect flow), after a `load_unit(by_head=True)` unit:
    `read(conversation_id, result)` turns the unit's result into the `LoadedConversation` the turn runs from.

    A `LoadedHead` is read back (`conversations.read_loaded_head`: from this process's cache when the unit just ran
    here, else from the store by entry id, the same rows in a recovery however the conversation grew since); any
    other result is returned as it is: a new conversation, or a unit recorded before heads existed, whose result
    holds the rows themselves. When the read fails, the run's turn claim is released (`release`) and the error raised.

    Raises:
        ConversationNotFoundError: the conversation was deleted while the turn ran; CorruptedRowError, StoreError.
    """

    async def read(conversation_id: str, loaded: Any) -> Any:
        if not isinstance(loaded, LoadedHead):
            return loaded
        try:
            return await read_loaded_head(agent, conversation_id, loaded, store=_url(store))
        except BaseException:
            if release is not None:  # the turn does not start: the conversation is free again
                await release(conversation_id)
            raise

    return read


def append_unit(agent: DurableAgent[Any, Any], *, store: StoreSource = None, run_of: RunOf | None = None) -> AppendUnitBody:
    """The body of the conversation-append unit of `agent`: `(conversation_id, messages, expected_revision,
    append_id, usage) -> new revision`, idempotent by `append_id`, on the store `store` (see `load_unit`).

    A turn whose side effects happened is always stored: when another writer appended since the turn loaded, the
    messages go after it (`rebase`). The run's turn claim (`run_of`) is released in the append's transaction.

    Raises (from the store): one of `PERMANENT_APPEND_ERRORS`, or a `StoreError` another attempt may fix.
    """

    async def append(conversation_id: str, messages: list[dict[str, Any]], expected_revision: int | None,
                     append_id: str, usage: dict[str, Any] | None = None) -> int:
        with telemetry.unit_span('store.append', agent=agent.name, conversation_id=conversation_id,
                                 messages=len(messages)):
            return await append_conversation(agent, conversation_id, messages, expected_revision=expected_revision,
                                             append_id=append_id, usage=usage, store=_url(store), rebase=True,
                                             release_claim=run_of() if run_of is not None else None)

    return append


def release_unit(agent: DurableAgent[Any, Any], *, store: StoreSource = None, run_of: RunOf) -> Callable[[str], Awaitable[bool]]:
    """The body of a turn's release: `release(conversation_id)` frees the run's turn claim when the turn ends without
    an append (it failed, was cancelled). Idempotent: running it again (a recovered workflow) changes nothing."""

    async def release(conversation_id: str) -> bool:
        return await release_turn(agent, conversation_id, run_of(), store=_url(store))

    return release
