"""One decision per approval on DBOS: the decision slot of a waiting call, in the system database.

DBOS offers no compare-and-set for a message: `send` with an idempotency key drops a second message with the same
key without saying so, and `decide` reads the call before it sends, so two deciders at the same moment (two `durcap
approve`, the API and the CLI, two `durcap serve` on different stores) both read the call undecided and both were
told yes while only the first message counted. Here the slot is a row of `durcap_dbos_decisions` (primary key: run,
call, the call's `requested_at`, so a later pause that reuses a call id gets a slot of its own), inserted in the same
transaction as the message (`DBOSClient.send_in_transaction`): of two deciders exactly one inserts it and sends; the
other's insert fails on the key, nothing of it is sent, and it is told the decision that holds the slot. A process
killed inside the transaction leaves neither the row nor the message.
"""

from __future__ import annotations

import json
import time
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from ._schema import ensure_table

TABLE = 'durcap_dbos_decisions'
"""The decision slots, in the DBOS system database beside DBOS's own tables (as `_peers.TABLE`)."""

_METADATA = sa.MetaData()
_DECISIONS = sa.Table(
    TABLE, _METADATA,
    sa.Column('run_id', sa.String(255), primary_key=True),
    sa.Column('call_id', sa.String(255), primary_key=True),
    sa.Column('requested_at', sa.String(64), primary_key=True),
    sa.Column('decision', sa.Text, nullable=False),  # the `Decision.to_json()` sent, as JSON text
    sa.Column('decided_at', sa.Float, nullable=False),  # seconds since the epoch (this host's clock)
)


def _engine(url: str) -> sa.Engine:
    return sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://', 1) if url.startswith('postgresql://')
                            else url)


def claim_and_send(url: str, client: Any, run_id: str, call_id: str, requested_at: str, decision_json: dict[str, Any],
                   topic: str, idempotency_key: str) -> dict[str, Any] | None:
    """Take the decision slot of call `call_id` (asked at `requested_at`) of workflow `run_id` and send the decision
    on `topic`, in one transaction of the system database at `url` (blocking: run it in a thread).

    Args:
        url: The DBOS system database URL (SQLite or PostgreSQL), the one `client` (a `DBOSClient`) is on.
        decision_json: The `Decision.to_json()` to send and record.

    Returns:
        `None` when this call took the slot (the decision is sent); else the decision JSON holding it (nothing sent).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database cannot be reached or refused the write (nothing sent).
    """
    engine = _engine(url)
    try:
        ensure_table(engine, _DECISIONS)
        key = {'run_id': run_id, 'call_id': call_id, 'requested_at': requested_at}
        try:
            with engine.begin() as conn:
                conn.execute(_DECISIONS.insert().values(**key, decision=json.dumps(decision_json),
                                                        decided_at=time.time()))
                client.send_in_transaction(conn, run_id, decision_json, topic, idempotency_key=idempotency_key)
            return None
        except IntegrityError:
            with engine.connect() as conn:  # a new connection: PostgreSQL aborted the failed transaction
                held = conn.execute(sa.select(_DECISIONS.c.decision).filter_by(**key)).scalar()
            return json.loads(held) if held is not None else decision_json
    finally:
        engine.dispose()


def forget(url: str, run_ids: list[str]) -> None:
    """Delete the decision slots of workflows `run_ids` (their workflows are deleted; blocking)."""
    engine = _engine(url)
    try:
        if not sa.inspect(engine).has_table(TABLE):
            return
        with engine.begin() as conn:
            conn.execute(_DECISIONS.delete().where(_DECISIONS.c.run_id.in_(run_ids)))
    finally:
        engine.dispose()
