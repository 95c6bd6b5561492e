"""The SQL of budgets (schema version 6): a ledger row per budget key, a reservation row per model request.

Synchronous, run by `SQLConversationStore` in a worker thread (the per-request writes on SQLite first on the calling
event loop's thread, `quick=True`, in a transaction that never waits), on the backend's connections and transactions
(`_SQLBackend._txn`): a write transaction is `BEGIN IMMEDIATE` on SQLite and locks the key's ledger row
(`SELECT ... FOR UPDATE`) on PostgreSQL, so two requests of one key are checked and settled one after the other.
The per-request writes (`reserve`: usually one statement, `_admit`; `settle`, `release`) and the report's read
(`record`) go straight to the driver (`_SQLBackend._raw_txn`, `_quick_run`): SQLAlchemy's statement machinery was ~1.2 ms of CPU per request of their ~1.5 ms. They are
relaxed: durable against a crash of any process (a SIGKILLed worker), not against an OS crash or power loss, which
may lose the last settles (an undercount); no disk flush per request, which cost 2 x ~3 ms per request on this
machine's SQLite.

A model request is admitted when what the key's settled requests spent is under every limit (plus what an operator
raised it by); it is then reserved (`state='reserved'`) and, when it completes, settled with the provider's usage
(`state='settled'`): the ledger takes the difference, so settling the same request again (a retried unit) replaces
its usage instead of adding it. A reserved request was admitted once: a retry of it is admitted again unchecked.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from .._limits import is_digits
from ._schema import _WRITER

if TYPE_CHECKING:
    from ._sql import _SQLBackend

FIELDS = ('input_tokens', 'output_tokens', 'total_tokens', 'cost')
"""The limits a budget can set, in the order they are checked (cost in USD)."""

NANOS = 1_000_000_000
"""Cost is stored in nano-USD (1e-9 USD), as an integer."""


@dataclass
class BudgetRecord:
    """One budget key as stored.

    Attributes:
        key: The budget key (`run:{id}`, `conversation:{id}`, or the key computed from the deps).
        spent: `{'input_tokens', 'output_tokens', 'total_tokens', 'cost' (USD), 'requests'}` of its settled requests.
        limits: The limits last checked against it (`{field: value}`), as the definition gave them.
        raised: What operators raised each limit by (`{field: amount}`, approvals of `on_exceed='approval'`).
        in_flight: Requests reserved and not settled (running, or lost with a killed worker).
        updated_at: ISO 8601 UTC of the last change.
    """

    key: str
    spent: dict[str, float] = field(default_factory=dict)
    limits: dict[str, float] = field(default_factory=dict)
    raised: dict[str, float] = field(default_factory=dict)
    in_flight: int = 0
    updated_at: str = ''

    def limit(self, name: str) -> float | None:
        """The effective limit `name` (given plus raised), `None` when the budget sets none."""
        given = self.limits.get(name)
        return None if given is None else given + self.raised.get(name, 0)

    def to_json(self) -> dict[str, Any]:
        """As JSON-compatible data (`durcap budgets show --json`)."""
        return {'key': self.key, 'spent': self.spent, 'limits': self.limits, 'raised': self.raised,
                'in_flight': self.in_flight, 'updated_at': self.updated_at}


_SECOND: tuple[int, str] = (-1, '')
"""The last second `_now` formatted: `(seconds since the epoch, 'YYYY-MM-DDTHH:MM:SS')` (one tuple, replaced whole)."""


def _now() -> str:
    """The time now in ISO 8601 UTC with microseconds, as `_sql._utcnow` writes it (`'2026-12-06T08:00:00.123456+00:00'`),
    with the date and time of day formatted once a second (`datetime.isoformat` was ~13,000 instructions a call, two
    calls per model request)."""
    global _SECOND
    second, micro = divmod(time.time_ns() // 1000, 1_000_000)
    cached = _SECOND
    if cached[0] != second:
        cached = _SECOND = (second, datetime.fromtimestamp(second, UTC).strftime('%Y-%m-%dT%H:%M:%S'))
    return f'{cached[1]}.{micro:06d}+00:00'


def _ledger(sql: _SQLBackend, conn: sa.Connection, key: str, *, lock: bool) -> Any:
    """The key's ledger row (created empty when missing), locked for the transaction on PostgreSQL with `lock`."""
    suffix = ' FOR UPDATE' if lock and sql.is_pg else ''
    row = conn.execute(sa.text('SELECT * FROM durcap_budget_ledger WHERE budget_key = :k' + suffix), {'k': key}).first()
    if row is not None:
        return row
    conn.execute(sa.text(
        'INSERT INTO durcap_budget_ledger (budget_key, input_tokens, output_tokens, total_tokens, cost_nanos, requests, '
        "limits, raised, updated_at, writer) VALUES (:k, 0, 0, 0, 0, 0, '{}', '{}', :at, :w) "
        'ON CONFLICT (budget_key) DO NOTHING'), {'k': key, 'at': _now(), 'w': _WRITER})
    return conn.execute(sa.text('SELECT * FROM durcap_budget_ledger WHERE budget_key = :k' + suffix), {'k': key}).first()


def _record(row: Any, in_flight: int = 0) -> BudgetRecord:
    spent = {'input_tokens': int(row.input_tokens), 'output_tokens': int(row.output_tokens),
             'total_tokens': int(row.total_tokens), 'cost': int(row.cost_nanos) / NANOS, 'requests': int(row.requests)}
    return BudgetRecord(str(row.budget_key), spent, json.loads(row.limits), json.loads(row.raised), in_flight,
                        str(row.updated_at))


_LEDGER_COLUMNS = 'budget_key, input_tokens, output_tokens, total_tokens, cost_nanos, requests, limits, raised, updated_at'
_CREATE_LEDGER = (
    'INSERT INTO durcap_budget_ledger (budget_key, input_tokens, output_tokens, total_tokens, cost_nanos, requests, '
    "limits, raised, updated_at, writer) VALUES (:k, 0, 0, 0, 0, 0, '{}', '{}', :at, :w) "
    'ON CONFLICT (budget_key) DO NOTHING')


@dataclass
class _LedgerRow:
    """A ledger row read by `_raw_txn` (a tuple, named)."""

    budget_key: str
    input_tokens: int
    output_tokens: int
    total_tokens: int
    cost_nanos: int
    requests: int
    limits: str
    raised: str
    updated_at: str


_LEDGER_AND_KNOWN = (f'SELECT {_LEDGER_COLUMNS}, (SELECT 1 FROM durcap_budget_reservations r WHERE r.budget_key = :k '
                     'AND r.request_id = :r) FROM durcap_budget_ledger WHERE budget_key = :k')


def _raw_ledger(sql: _SQLBackend, cur: Any, key: str, request_id: str | None = None) -> tuple[_LedgerRow, bool]:
    """In a `_raw_txn`: the key's ledger row, created empty when missing, locked for the transaction on PostgreSQL;
    and whether `request_id` has a reservation (read in the same statement)."""
    lock = ' FOR UPDATE' if sql.is_pg else ''
    params = {'k': key, 'r': request_id}
    row = cur.execute(_LEDGER_AND_KNOWN + lock, params).fetchone()
    if row is None:
        cur.execute(_CREATE_LEDGER, {'k': key, 'at': _now(), 'w': _WRITER})
        row = cur.execute(_LEDGER_AND_KNOWN + lock, params).fetchone()
    return _LedgerRow(*row[:-1]), row[-1] is not None


def reserve(sql: _SQLBackend, key: str, request_id: str, run_id: str, limits: dict[str, float], *,
            quick: bool = False) -> BudgetRecord | None:
    """Admit and reserve model request `request_id` of `key`: `None` when admitted (or reserved before: a retry),
    else the key's `BudgetRecord` (nothing reserved), whose `spent` reached one of `limits` (plus raised).

    `quick` (`_SQLBackend._quick_run`: on the calling thread, never waiting; `_WouldWait` when it would): first one
    statement, its own transaction, that reserves the request when the key's ledger row is under every limit, no
    operator raised it and its limits last checked are `limits` (`_ADMIT`: the usual request); when it reserved
    nothing (a new key, a retry, a raised or changed budget, a limit reached), or without `quick`: one relaxed write
    transaction (`_SQLBackend._raw_txn`, or `_quick_run`) that reads the ledger row with whether the request is
    reserved, in one statement (the row locked on PostgreSQL; SQLite's `BEGIN IMMEDIATE` holds the write lock), then
    writes the new reservation and the limits when they changed."""
    if quick:
        statement, params = _admit(key, request_id, run_id, limits)
        if sql._quick_run(lambda raw: raw.execute(statement, params).rowcount, begin=False) == 1:
            return None
        return sql._quick_run(lambda raw: _reserve(sql, raw, key, request_id, run_id, limits), begin=True)
    with sql._raw_txn() as cur:
        return _reserve(sql, cur, key, request_id, run_id, limits)


def _reserve(sql: _SQLBackend, cur: Any, key: str, request_id: str, run_id: str,
             limits: dict[str, float]) -> BudgetRecord | None:
    """`reserve`'s transaction, on `cur` (a `_RawCursor`, or a `sqlite3.Connection` in `_quick_run`)."""
    row, known = _raw_ledger(sql, cur, key, request_id)
    if known:
        return None
    record = _record(row)
    record.limits = dict(limits)
    if exceeded(record) is not None:
        return record
    cur.execute(_RESERVE, {'k': key, 'r': request_id, 'run': run_id, 'at': _now()})
    given = _given(limits)
    if given != row.limits:  # the limits last checked, for `durcap budgets` (written when they change)
        cur.execute('UPDATE durcap_budget_ledger SET limits = :l WHERE budget_key = :k', {'k': key, 'l': given})
    return None


_RESERVE = (
    'INSERT INTO durcap_budget_reservations (budget_key, request_id, run_id, state, input_tokens, output_tokens, '
    "cost_nanos, created_at) VALUES (:k, :r, :run, 'reserved', 0, 0, 0, :at)")
_SPENT = {'input_tokens': 'input_tokens', 'output_tokens': 'output_tokens', 'total_tokens': 'total_tokens',
          'cost': f'cost_nanos / {NANOS}.0'}
"""What the ledger row spent of each limit, as SQL (cost in USD: the integer of nano-USD made a double and divided, as
`_record`'s `int / NANOS` does in Python, so both compare the same number)."""
_ADMITS: dict[tuple[str, ...], str] = {}
_GIVEN: dict[tuple[tuple[str, float], ...], str] = {}


def _given(limits: dict[str, float]) -> str:
    """`limits` as the ledger's `limits` column holds them (JSON, sorted keys), remembered per limits."""
    items = tuple(limits.items())
    given = _GIVEN.get(items)
    if given is None:
        if len(_GIVEN) > 256:
            _GIVEN.clear()
        given = _GIVEN[items] = json.dumps(limits, sort_keys=True)
    return given


def _admit(key: str, request_id: str, run_id: str, limits: dict[str, float]) -> tuple[str, dict[str, Any]]:
    """`reserve`'s one statement and its parameters: the reservation inserted from the key's ledger row when that row
    is under every limit of `limits` (`spent < limit`: `exceeded` finds none), has no operator raise (`raised = '{}'`,
    so each limit is the given one) and already holds `limits` as the limits last checked; nothing inserted (rowcount
    0) otherwise, and for a request reserved before (`ON CONFLICT DO NOTHING`)."""
    names = tuple(limits)
    statement = _ADMITS.get(names)
    if statement is None:
        checks = ''.join(f' AND {_SPENT[name]} < :{name}' for name in names)
        statement = _ADMITS[names] = (
            'INSERT INTO durcap_budget_reservations (budget_key, request_id, run_id, state, input_tokens, '
            "output_tokens, cost_nanos, created_at) SELECT :k, :r, :run, 'reserved', 0, 0, 0, :at FROM "
            f"durcap_budget_ledger WHERE budget_key = :k AND raised = '{{}}' AND limits = :given{checks} "
            'ON CONFLICT (budget_key, request_id) DO NOTHING')
    return statement, {'k': key, 'r': request_id, 'run': run_id, 'at': _now(), 'given': _given(limits), **limits}


_KNOWN = ('SELECT state, input_tokens, output_tokens, cost_nanos FROM durcap_budget_reservations '
          'WHERE budget_key = :k AND request_id = :r')
_ADD = (
    'UPDATE durcap_budget_ledger SET input_tokens = input_tokens + :di, output_tokens = output_tokens + :do, '
    'total_tokens = total_tokens + :dt, cost_nanos = cost_nanos + :dc, requests = requests + :dr, '
    'updated_at = :at WHERE budget_key = :k')
_SETTLE_RESERVED = (
    "UPDATE durcap_budget_reservations SET state = 'settled', input_tokens = :i, output_tokens = :o, cost_nanos = :c, "
    "settled_at = :at WHERE budget_key = :k AND request_id = :r AND state = 'reserved'")
_LOCK_LEDGER = 'SELECT 1 FROM durcap_budget_ledger WHERE budget_key = :k FOR UPDATE'
_RELEASE = ("DELETE FROM durcap_budget_reservations WHERE budget_key = :k AND request_id = :r AND "
            "state = 'reserved'")


def exceeded(record: BudgetRecord) -> str | None:
    """The first limit of `record` its spend reached (`FIELDS` order), or `None`."""
    for name in FIELDS:
        limit = record.limit(name)
        if limit is not None and record.spent.get(name, 0) >= limit:
            return name
    return None


def settle(sql: _SQLBackend, key: str, request_id: str, run_id: str, input_tokens: int, output_tokens: int,
           cost: float, *, quick: bool = False) -> None:
    """Record the provider's usage of completed request `request_id` of `key` (replacing what an earlier settle of
    it recorded, so a retried unit counts once); the ledger takes the difference.

    One relaxed write transaction (`_SQLBackend._raw_txn`, or with `quick` `_SQLBackend._quick_run`: on the calling
    thread, never waiting; `_WouldWait` when it would). On PostgreSQL the key's ledger row is locked first. The usual
    case, a reservation settled for the first time (its usage still 0), is two statements: the reservation marked
    settled, the ledger given its usage; a request settled before (a retried unit) or whose key was reset since its
    reservation reads what was recorded first."""
    params = {'k': key, 'r': request_id, 'run': run_id, 'i': input_tokens, 'o': output_tokens,
              'c': round(cost * NANOS), 'at': _now()}
    if quick:
        sql._quick_run(lambda raw: _settle(sql, raw, params), begin=True)
        return
    with sql._raw_txn() as cur:
        _settle(sql, cur, params)


def _settle(sql: _SQLBackend, cur: Any, params: dict[str, Any]) -> None:
    """`settle`'s transaction, on `cur` (a `_RawCursor`, or a `sqlite3.Connection` in `_quick_run`)."""
    key = params['k']
    if sql.is_pg:  # SQLite's BEGIN IMMEDIATE already holds the write lock
        cur.execute(_LOCK_LEDGER, {'k': key})
    if cur.execute(_SETTLE_RESERVED, params).rowcount == 1:  # reserved: its recorded usage was 0
        cur.execute(_ADD, {'k': key, 'di': params['i'], 'do': params['o'], 'dt': params['i'] + params['o'],
                           'dc': params['c'], 'dr': 1, 'at': params['at']})
        return
    old = cur.execute(_KNOWN, {'k': key, 'r': params['r']}).fetchone()
    if old is None:  # the key was reset since the reservation: start its ledger again
        _raw_ledger(sql, cur, key)
        cur.execute(
            'INSERT INTO durcap_budget_reservations (budget_key, request_id, run_id, state, input_tokens, '
            "output_tokens, cost_nanos, created_at, settled_at) VALUES (:k, :r, :run, 'settled', :i, :o, :c, "
            ':at, :at)', params)
    else:
        cur.execute(
            "UPDATE durcap_budget_reservations SET state = 'settled', input_tokens = :i, output_tokens = :o, "
            'cost_nanos = :c, settled_at = :at WHERE budget_key = :k AND request_id = :r', params)
    before = old if old is not None and old[0] == 'settled' else None
    di = params['i'] - (int(before[1]) if before is not None else 0)
    do = params['o'] - (int(before[2]) if before is not None else 0)
    dc = params['c'] - (int(before[3]) if before is not None else 0)
    cur.execute(_ADD, {'k': key, 'di': di, 'do': do, 'dt': di + do, 'dc': dc, 'dr': 0 if before is not None else 1,
                       'at': params['at']})


def release(sql: _SQLBackend, key: str, request_id: str, *, quick: bool = False) -> None:
    """Drop the reservation of a request that failed (the provider billed nothing it reported): one statement.
    `quick`: as `settle`'s."""
    params = {'k': key, 'r': request_id}
    if quick:
        sql._quick_run(lambda raw: raw.execute(_RELEASE, params), begin=False)
        return
    with sql._raw_txn() as cur:
        cur.execute(_RELEASE, params)


def records(sql: _SQLBackend, key: str | None = None) -> list[BudgetRecord]:
    """Every budget key (or only `key`), sorted by key, with its count of requests in flight."""
    where, params = (' WHERE budget_key = :k', {'k': key}) if key is not None else ('', {})
    with sql._txn(write=False) as conn:
        rows = conn.execute(sa.text('SELECT * FROM durcap_budget_ledger' + where + ' ORDER BY budget_key'), params).all()
        flying = dict(conn.execute(sa.text(
            "SELECT budget_key, COUNT(*) FROM durcap_budget_reservations WHERE state = 'reserved'"
            + where.replace('WHERE', 'AND') + ' GROUP BY budget_key'), params).all())
    return [_record(row, int(flying.get(row.budget_key, 0))) for row in rows]


def record(sql: _SQLBackend, key: str) -> BudgetRecord | None:
    """`key`'s record with its count of requests in flight (`None`: the key has no ledger row), in one statement
    (`_SQLBackend._raw_txn`): what a run's report reads after every budgeted run."""
    with sql._raw_txn(write=False) as cur:
        row = cur.execute(f'SELECT {_LEDGER_COLUMNS}, (SELECT COUNT(*) FROM durcap_budget_reservations r WHERE '
                          "r.budget_key = :k AND r.state = 'reserved') FROM durcap_budget_ledger WHERE budget_key = :k",
                          {'k': key}).fetchone()
    return None if row is None else _record(_LedgerRow(*row[:-1]), int(row[-1]))


def reset(sql: _SQLBackend, key: str) -> bool:
    """Forget what `key` spent, its reservations and raises; whether it existed."""
    with sql._txn(write=True, relaxed=True) as conn:
        conn.execute(sa.text('DELETE FROM durcap_budget_reservations WHERE budget_key = :k'), {'k': key})
        return conn.execute(sa.text('DELETE FROM durcap_budget_ledger WHERE budget_key = :k'), {'k': key}).rowcount > 0


def raise_limit(sql: _SQLBackend, key: str, name: str, amount: float) -> BudgetRecord:
    """Raise limit `name` of `key` by `amount` (added to earlier raises); the key's record after."""
    with sql._txn(write=True, relaxed=True) as conn:
        row = _ledger(sql, conn, key, lock=True)
        raised = json.loads(row.raised)
        value = raised.get(name, 0) + amount
        raised[name] = int(value) if float(value).is_integer() else value
        conn.execute(sa.text('UPDATE durcap_budget_ledger SET raised = :r, updated_at = :at WHERE budget_key = :k'),
                     {'k': key, 'r': json.dumps(raised, sort_keys=True), 'at': _now()})
        row = conn.execute(sa.text('SELECT * FROM durcap_budget_ledger WHERE budget_key = :k'), {'k': key}).first()
    return _record(row)


SEED_RUN = 'fork:'
"""The run id prefix of a fork's inherited row: `fork:{requests it stands for}`."""


def _requests_of(run_id: str) -> int:
    if run_id.startswith(SEED_RUN):
        tail = run_id[len(SEED_RUN):]
        return int(tail) if is_digits(tail) else 1
    return 1


def inherit(sql: _SQLBackend, source_key: str, new_key: str, until: str | None,
            raised: dict[str, float]) -> BudgetRecord | None:
    """Start `new_key` (a fork's conversation key) with the settled spend of `source_key` up to `until` (requests
    reserved at or before that ISO 8601 UTC time; `None`: only the rows the source itself inherited when it was forked)
    and with `raised` added to its raises. The limits last checked on the source are copied for `durcap budgets`.

    Returns:
        The new key's `BudgetRecord`, or `None` when there was nothing to inherit (nothing is written then).
    """
    with sql._txn(write=True) as conn:
        if until is None:
            rows = conn.execute(sa.text(
                "SELECT run_id, input_tokens, output_tokens, cost_nanos FROM durcap_budget_reservations WHERE "
                "budget_key = :k AND state = 'settled' AND run_id LIKE 'fork:%'"), {'k': source_key}).all()
        else:
            # ISO 8601 UTC strings of one format compare as the times do, byte by byte ("C" on PostgreSQL, whose
            # database collation may not be; SQLite compares bytes).
            collate = ' COLLATE "C"' if sql.is_pg else ''
            rows = conn.execute(sa.text(
                "SELECT run_id, input_tokens, output_tokens, cost_nanos FROM durcap_budget_reservations WHERE "
                f"budget_key = :k AND state = 'settled' AND created_at{collate} <= :until"),
                {'k': source_key, 'until': until}).all()
        if not rows and not raised:
            return None
        di = sum(int(r.input_tokens) for r in rows)
        do = sum(int(r.output_tokens) for r in rows)
        dc = sum(int(r.cost_nanos) for r in rows)
        dr = sum(_requests_of(str(r.run_id)) for r in rows)
        source = conn.execute(sa.text('SELECT limits FROM durcap_budget_ledger WHERE budget_key = :k'),
                              {'k': source_key}).first()
        row = _ledger(sql, conn, new_key, lock=True)
        at = _now()
        if rows:
            conn.execute(sa.text(
                'INSERT INTO durcap_budget_reservations (budget_key, request_id, run_id, state, input_tokens, '
                "output_tokens, cost_nanos, created_at, settled_at) VALUES (:k, :r, :run, 'settled', :i, :o, :c, :at, "
                ':at) ON CONFLICT (budget_key, request_id) DO NOTHING'),
                {'k': new_key, 'r': f'fork:{source_key}', 'run': f'{SEED_RUN}{dr}', 'i': di, 'o': do, 'c': dc, 'at': at})
            conn.execute(sa.text(_ADD), {'k': new_key, 'di': di, 'do': do, 'dt': di + do, 'dc': dc, 'dr': dr, 'at': at})
        merged = json.loads(row.raised)
        for name, amount in raised.items():
            value = merged.get(name, 0) + amount
            merged[name] = int(value) if float(value).is_integer() else value
        limits = source.limits if source is not None and row.limits == '{}' else row.limits
        conn.execute(sa.text('UPDATE durcap_budget_ledger SET raised = :r, limits = :l, updated_at = :at '
                             'WHERE budget_key = :k'),
                     {'k': new_key, 'r': json.dumps(merged, sort_keys=True), 'l': limits, 'at': at})
        row = conn.execute(sa.text('SELECT * FROM durcap_budget_ledger WHERE budget_key = :k'), {'k': new_key}).first()
    return _record(row)
