"""What `durcap serve` keeps in the conversation store (schema version 7), so that any number of serve processes
on one store act as one: conversation owners, the runs requests started, and the `Idempotency-Key`s seen.

Every write is one store transaction (SQLite `BEGIN IMMEDIATE`, PostgreSQL a unique key that makes the second of
two concurrent inserts fail and re-read the winner's row), so two processes receiving the same request at once start
one run.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from ..conversations import process_store
from ..store import ConversationBusyError
from ..store._schema import _WRITER
from ..streams._log import in_thread
from ._errors import IdempotencyConflictError, NotFoundError


def _now() -> str:
    return datetime.now(UTC).isoformat()


class _BusyRefusal(ConversationBusyError):
    """DC050 from the API: a turn refused because another run's turn holds the conversation. Its message names the
    holder (a run the client was given) and the API's fix, not the refused turn's run id (the client never gets
    one)."""

    def __init__(self, conversation_id: str, *, holder: str, claimed_at: str,
                 waiting: tuple[str | None, list[dict[str, Any]]] | None = None):
        super().__init__(conversation_id, run_id='', holder=holder, claimed_at=claimed_at, waiting=waiting)
        decide = ''
        if waiting:
            decide = (f'Decide it first: GET /v1/runs/{holder}/approvals lists the calls with their fingerprints, POST '
                      f'/v1/runs/{holder}/approvals/{{call_id}} decides one; the '
                      'turn is stored once the run ends. ')
        Exception.__init__(self, (
            f'DC050 conversation {conversation_id!r} is busy: run {holder!r} holds it (its turn started at '
            f'{claimed_at} and is not stored yet){self.waits_for()}; this turn was refused before anything was recorded '
            f'or run. {decide}Send it again once run {holder!r} is done (GET /v1/runs/{holder}), or send it with '
            f'"busy": "enqueue" to run it after that turn.'))


def _decision_key(run_id: str, call_id: str) -> str:
    """The idempotency key of call `call_id`'s decision slot (`ServeRows.claim_decision_sync`) in run `run_id`."""
    return f'decide/{run_id}/{call_id}'


@dataclass(frozen=True)
class RunRow:
    """One run a request started (`durcap_serve_runs`)."""

    run_id: str
    principal: str
    conversation_id: str
    agent: str
    engine: str
    created_at: str


@dataclass(frozen=True)
class Started:
    """What `ServeRows.start_turn` decided: the run for the request, and whether this call created it (then the
    caller starts it; otherwise another request, on this process or another, already did)."""

    run: RunRow
    created: bool
    claimed: bool = False
    """Whether this call also took the conversation's turn claim for the run (it was free): the run's own load then
    need not claim it again (`turn.claimed_by_caller`)."""


class ServeRows:
    """The serve tables of the conversation store at `store_url` (the store's process-wide backend)."""

    def __init__(self, store_url: str):
        self.store_url = store_url
        self._backend = process_store(store_url)._sql

    def start_turn_sync(self, *, principal: str, key: str | None, digest: str, conversation_id: str, agent: str,
                        engine: str, run_id: str, reject_busy: bool = False, quick: bool = False,
                        flush: bool = True, key_name: str | None = None) -> Started:
        """Claim conversation `conversation_id` for `principal` (the first request on it owns it) and record run
        `run_id`, unless `key` was sent before by `principal`: then the run it started.

        Raises:
            NotFoundError: DC044, the conversation belongs to another principal (said as "not found": its existence is
                not disclosed).
            IdempotencyConflictError: DC045, `key` was sent before with another request (another digest); the message
                names the key as `key_name` says (a protocol request's own id, from which `key` was derived), else as
                the `Idempotency-Key` header.
            _BusyRefusal: DC050 (a `ConversationBusyError`), `reject_busy` and another run's turn holds the conversation
                (its claim in `durcap_turn_claims`): refused before anything is recorded or started.

        A conversation no run holds is claimed for `run_id` in the same transaction (`durcap_turn_claims`), whatever
        the strategy: two POSTs on one conversation at the same moment, on any serve processes of the store, are
        ordered here (the second is refused, or its run waits for the first at its load). The claim is released by
        the run's append, by its failure, or by `release_claim_sync` when the run could not be handed to the engine.

        `quick`: on the calling thread (an event loop's) without ever waiting, committed relaxed
        (`_SQLBackend._quick_txn`: durable against a crash of any process, flushed to disk with the next flushed commit
        of the store): for a turn this process runs itself (the local engine), whose own writes are no more durable
        than that. Raises `store._sql._WouldWait` before anything is done when it would wait (PostgreSQL, a store not
        migrated yet, the write lock held): the caller runs it in a worker thread instead. `flush=False` (in a worker
        thread): committed relaxed as well, for the same turns.
        """
        integrity = self._backend.engine.dialect.dbapi.IntegrityError  # type: ignore[union-attr]
        for attempt in range(3):
            try:
                return self._start(principal, key, digest, conversation_id, agent, engine, run_id, reject_busy, quick,
                                   flush, key_name)
            except integrity:  # a concurrent request inserted the same key or owner first: read it
                if attempt == 2:
                    raise
            except _BusyRefusal as refused:  # say whether the holder waits for an approval (read after the transaction)
                try:
                    waiting = self._backend.waiting_approval(refused.holder)
                except Exception:  # noqa: BLE001 - only the message's detail depends on it
                    waiting = None
                if waiting is None:
                    raise
                raise _BusyRefusal(conversation_id, holder=refused.holder, claimed_at=refused.claimed_at,
                                   waiting=waiting) from None
        raise AssertionError('unreachable')  # pragma: no cover

    _LOOKUP = (
        'SELECT (SELECT principal FROM durcap_serve_owners WHERE conversation_id = :c), '
        '(SELECT digest FROM durcap_serve_requests WHERE principal = :p AND idempotency_key = :k), '
        '(SELECT run_id FROM durcap_serve_requests WHERE principal = :p AND idempotency_key = :k), '
        '(SELECT run_id FROM durcap_turn_claims WHERE conversation_id = :c), '
        '(SELECT claimed_at FROM durcap_turn_claims WHERE conversation_id = :c), '
        '(SELECT message_count FROM durcap_conversations WHERE conversation_id = :c AND deleted = 0)')

    def _start(self, principal: str, key: str | None, digest: str, conversation_id: str, agent: str, engine: str,
               run_id: str, reject_busy: bool, quick: bool = False, flush: bool = True,
               key_name: str | None = None) -> Started:
        """One write transaction straight to the driver (`_SQLBackend._raw_txn`, fully synchronous; `_quick_txn` with
        `quick`): the owner, the key's request and the conversation's turn claim read in one statement, then the new
        rows."""
        with (self._backend._quick_txn() if quick else self._backend._raw_txn(relaxed=not flush)) as cur:
            owner, seen_digest, seen_run, holder, claimed_at, stored = cur.execute(
                self._LOOKUP, {'c': conversation_id, 'p': principal, 'k': key}).fetchone()
            if owner is not None and owner != principal:
                raise NotFoundError(f'no conversation {conversation_id!r}')
            if owner is None and (stored or holder is not None):
                # Stored (or being run) outside the API (`durcap run --conversation`, `history fork`): no principal
                # owns it here, and the first to post must not take it over and read its history. Refused like another
                # principal's conversation (nothing says it exists).
                raise NotFoundError(f'no conversation {conversation_id!r}')
            if key is not None and seen_run is not None:
                if seen_digest != digest:
                    named = key_name or f'Idempotency-Key {key!r}'
                    raise IdempotencyConflictError(
                        f'{named} was sent before with another request (it started run {seen_run!r}): send a new '
                        f'{"one" if key_name else "key"} for a new turn, or the same body to get that run again')
                found = cur.execute('SELECT run_id, principal, conversation_id, agent, engine, created_at FROM '
                                    'durcap_serve_runs WHERE run_id = :r', {'r': seen_run}).fetchone()
                assert found is not None
                return Started(RunRow(*found), False)
            if reject_busy and holder is not None:
                raise _BusyRefusal(conversation_id, holder=str(holder), claimed_at=str(claimed_at))
            now = _now()
            if holder is None:
                # The conversation is free: this run's turn takes its claim now, in the transaction recording the run,
                # so a second POST, on any serve process, finds it held and is refused (or waits) before its 202. The
                # run's own load finds the claim its own (`claim_turn`: held by the same run id) and goes on.
                cur.execute('INSERT INTO durcap_turn_claims (conversation_id, run_id, claimed_at, writer) VALUES '
                            '(:c, :r, :at, :w)', {'c': conversation_id, 'r': run_id, 'at': now, 'w': _WRITER})
            if owner is None:
                cur.execute('INSERT INTO durcap_serve_owners (conversation_id, principal, created_at) VALUES (:c, :p, :at)',
                            {'c': conversation_id, 'p': principal, 'at': now})
            cur.execute('INSERT INTO durcap_serve_runs (run_id, principal, conversation_id, agent, engine, created_at) '
                        'VALUES (:r, :p, :c, :a, :e, :at)',
                        {'r': run_id, 'p': principal, 'c': conversation_id, 'a': agent, 'e': engine, 'at': now})
            if key is not None:
                cur.execute('INSERT INTO durcap_serve_requests (principal, idempotency_key, digest, run_id, created_at) '
                            'VALUES (:p, :k, :d, :r, :at)', {'p': principal, 'k': key, 'd': digest, 'r': run_id, 'at': now})
            return Started(RunRow(run_id, principal, conversation_id, agent, engine, now), True, claimed=holder is None)

    def release_claim_sync(self, conversation_id: str, run_id: str) -> bool:
        """Release the turn claim `start_turn_sync` took for run `run_id` (when the run could not be handed to its
        engine: nothing ran); a claim another run holds is left alone. Returns whether one was released."""
        return self._backend.release_turn(conversation_id, run_id)

    @staticmethod
    def _run(conn: sa.Connection, run_id: str) -> RunRow | None:
        row = conn.execute(sa.text('SELECT run_id, principal, conversation_id, agent, engine, created_at FROM '
                                   'durcap_serve_runs WHERE run_id = :r'), {'r': run_id}).first()
        return None if row is None else RunRow(*row)

    def run_sync(self, run_id: str) -> RunRow | None:
        """The run `run_id` a request started, `None` when no serve process started it."""
        with self._backend._txn(write=False) as conn:
            return self._run(conn, run_id)

    def latest_run_sync(self, principal: str, conversation_id: str) -> RunRow | None:
        """The newest run `principal` started on `conversation_id`, `None` when there is none."""
        with self._backend._txn(write=False) as conn:
            row = conn.execute(sa.text('SELECT run_id, principal, conversation_id, agent, engine, created_at FROM '
                                       'durcap_serve_runs WHERE conversation_id = :c AND principal = :p ORDER BY '
                                       'created_at DESC LIMIT 1'), {'c': conversation_id, 'p': principal}).first()
        return None if row is None else RunRow(*row)

    DECISION_PRINCIPAL = 'durcap:decision'
    """The `durcap_serve_requests.principal` of a call's decision slot (`claim_decision_sync`); its keys hold a `/`,
    which no Idempotency-Key may (`_app.ID_PATTERN`), so a slot never meets a request's key."""

    def claim_decision_sync(self, run_id: str, call_id: str, decision_json: str) -> str | None:
        """Take the one decision slot of `call_id` of run `run_id` (a row whose primary key two concurrent requests,
        on any serve process of the store, cannot both insert): the store's compare-and-set, which DBOS and Prefect
        do not offer for their decisions.

        Returns:
            `None` when this request took it; else the JSON of the decision that holds it (a `Decision.to_json`).
        """
        integrity = self._backend.engine.dialect.dbapi.IntegrityError  # type: ignore[union-attr]
        key = _decision_key(run_id, call_id)
        try:
            with self._backend._raw_txn(relaxed=False) as cur:
                cur.execute('INSERT INTO durcap_serve_requests (principal, idempotency_key, digest, run_id, created_at) '
                            'VALUES (:p, :k, :d, :r, :at)', {'p': self.DECISION_PRINCIPAL, 'k': key,
                                                               'd': decision_json, 'r': run_id, 'at': _now()})
            return None
        except integrity:
            with self._backend._txn(write=False) as conn:
                held = conn.execute(sa.text('SELECT digest FROM durcap_serve_requests WHERE principal = :p AND '
                                            'idempotency_key = :k'), {'p': self.DECISION_PRINCIPAL, 'k': key}).scalar()
            return str(held) if held is not None else decision_json

    def decision_slot_sync(self, run_id: str, call_id: str) -> str | None:
        """The JSON of the decision holding `call_id`'s slot (`claim_decision_sync`), else `None`."""
        with self._backend._txn(write=False) as conn:
            held = conn.execute(sa.text('SELECT digest FROM durcap_serve_requests WHERE principal = :p AND '
                                        'idempotency_key = :k'), {'p': self.DECISION_PRINCIPAL,
                                                                  'k': _decision_key(run_id, call_id)}).scalar()
        return None if held is None else str(held)

    def release_decision_sync(self, run_id: str, call_id: str) -> None:
        """Give the slot `claim_decision_sync` took back (the decision was not delivered: the call is still pending)."""
        with self._backend._raw_txn(relaxed=False) as cur:
            cur.execute('DELETE FROM durcap_serve_requests WHERE principal = :p AND idempotency_key = :k',
                        {'p': self.DECISION_PRINCIPAL, 'k': _decision_key(run_id, call_id)})

    def owner_sync(self, conversation_id: str) -> str | None:
        """The principal owning `conversation_id`, `None` when no request started a turn on it."""
        with self._backend._txn(write=False) as conn:
            return conn.execute(sa.text('SELECT principal FROM durcap_serve_owners WHERE conversation_id = :c'),
                                {'c': conversation_id}).scalar()

    def milestones_sync(self, run_id: str) -> list[tuple[int, str, str]]:
        """`(offset, kind, body JSON)` of the run's stream events that say where it is (started, approvals, stored,
        completed, failed, waiting for a worker), in offset order."""
        with self._backend._txn(write=False) as conn:
            rows = conn.execute(sa.text(
                'SELECT event_offset, kind, body FROM durcap_run_events WHERE run_id = :r AND kind IN '
                "('run_started', 'approval_waiting', 'approval_decided', 'turn_stored', 'run_completed', 'run_failed', "
                "'run_waiting') "
                'ORDER BY event_offset'), {'r': run_id}).all()
        return [(int(o), str(k), str(b)) for o, k, b in rows]

    async def call(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        """`method(*args, **kwargs)` (one of the `*_sync` methods) in the store's worker threads."""
        return await in_thread(method, *args, **kwargs)
