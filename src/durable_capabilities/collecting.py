"""Garbage collection of claim checks no run can read any more (`durcap store gc`, and `durcap worker --gc-every`).

A claim check (a Temporal payload too large to travel inline, stored in the conversation store as content-addressed
pieces under pages: `durcap_payloads`) is recorded with every run that refers to it (`durcap_payload_refs.owner`, a
workflow id; one row for the root of its pages since schema 8, which stands for every page and piece under it). A
run's claim checks are needed while its engine can still replay, export or query it: while it is open, and after it
closed until the engine deletes its records (a Temporal namespace's retention period). This module asks
the engines whose runs store claim checks (feature `claim-checks`) for the state of every recorded owner
(`EngineAdapter.run_states`), decides which owners are gone, and has the store delete their references and the
pieces no other owner refers to (`SQLConversationStore.collect`, one transaction).

An owner is gone when its engine says it closed more than the retention ago, or when no engine knows it (deleted,
or already removed by retention) and its newest reference is older than the retention. Nothing is deleted when an
engine cannot be asked or cannot tell its retention (pass `retention`). A grace window (`grace`) protects what was
written in the last moments: a run in flight may have stored a piece its engine does not show yet (a client writes
the start input's claim check before the workflow exists); the store keeps every owner and piece written after
`now - grace`.

Engines are looked up by feature, never named.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .engines import EngineAdapter, RunStates, specs
from .errors import DurcapError
from .reading import durable_adapters, problem_line
from .settings import Settings
from .store import ClaimCheckOwner, CollectReport, SQLConversationStore

__all__ = ['DEFAULT_GRACE', 'Collection', 'GcEngineError', 'GcSchedule', 'collect_garbage', 'gone_owners',
           'parse_duration']

DEFAULT_GRACE = timedelta(minutes=15)
"""What `durcap store gc` never deletes by default: anything written in the last 15 minutes."""

FEATURE = 'claim-checks'
"""The `EngineSpec.features` entry of an engine whose runs store claim checks (and answer `run_states`)."""


class GcEngineError(DurcapError, code='gc-engine-unavailable'):
    """`durcap store gc` refused: an engine whose runs store claim checks could not be asked, or cannot tell its
    retention period. Nothing was deleted."""


_DURATION = re.compile(r'(\d+(?:\.\d+)?)(ms|s|m|h|d|w)')
_UNIT_SECONDS = {'ms': 0.001, 's': 1, 'm': 60, 'h': 3600, 'd': 86400, 'w': 604800}


def parse_duration(text: str, option: str) -> timedelta:
    """A duration such as `90s`, `15m`, `1h30m`, `7d` (units ms, s, m, h, d, w; a bare number is seconds).

    Raises:
        ValueError: not a duration (message: `OPTION 'TEXT' is not a duration ...`, naming the fix).
    """
    value = text.strip().lower()
    if re.fullmatch(r'\d+(?:\.\d+)?', value):
        return timedelta(seconds=float(value))
    if not value or _DURATION.sub('', value) != '':
        raise ValueError(f'{option} {text!r} is not a duration: give a number and a unit, e.g. 90s, 15m, 1h30m, 7d '
                         '(units ms, s, m, h, d, w)')
    return timedelta(seconds=sum(float(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION.findall(value)))


def _shown(delta: timedelta) -> str:
    seconds = delta.total_seconds()
    for unit, size in (('d', 86400), ('h', 3600), ('m', 60)):
        if seconds >= size and seconds % size == 0:
            return f'{int(seconds // size)}{unit}'
    return f'{seconds:g}s'


@dataclass
class Collection:
    """`collect_garbage`'s answer.

    Attributes:
        report: What the store deleted (or would delete): `store.CollectReport`.
        reasons: `{owner: why it is gone}` for every owner handed to the store (`closed ...`, `unknown to ...`).
        kept: `{why: owners}` of the owners kept (open, closed within the retention, unknown but recent).
        retention: `{engine: the retention used}` (the engine's, or the override).
        grace: The grace window used.
        where: `{engine: where it was asked}`.
    """

    report: CollectReport
    reasons: dict[str, str]
    kept: dict[str, int]
    retention: dict[str, timedelta]
    grace: timedelta
    where: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """As JSON-compatible data (durations in seconds, times as ISO 8601)."""
        r = self.report
        return {
            'dry_run': r.dry_run, 'before': r.before.isoformat(), 'grace_seconds': self.grace.total_seconds(),
            'retention_seconds': {e: d.total_seconds() for e, d in self.retention.items()}, 'engines': self.where,
            'freed': {'refs': r.refs, 'payloads': r.payloads, 'payload_bytes': r.payload_bytes},
            'kept_shared': {'payloads': r.shared_payloads, 'payload_bytes': r.shared_payload_bytes},
            'owners': [{**o.__dict__, 'reason': self.reasons.get(o.owner)} for o in r.owners],
            'skipped_recent': r.skipped, 'kept_owners': self.kept,
        }

    def lines(self) -> list[str]:
        """The report for people: a summary line, one line per owner collected, what was kept and why."""
        r = self.report
        verb = 'would free' if r.dry_run else 'freed'
        retention = ', '.join(f'{e} retention {_shown(d)}' for e, d in self.retention.items()) or 'no engine asked'
        out = [f'store gc ({"dry run" if r.dry_run else "applied"}; {retention}; grace {_shown(self.grace)}, nothing '
               f'written after {r.before.isoformat(timespec="seconds")} is touched): {verb} {r.payloads} piece(s), '
               f'{r.payload_bytes:,} bytes, and {r.refs} reference row(s) of {len(r.owners)} workflow(s)']
        for o in r.owners:
            convs = ', '.join(o.conversations) or 'no stored turn'
            out.append(f'  {o.owner} (conversation {convs}): {o.payloads} piece(s), {o.payload_bytes:,} bytes, '
                       f'{o.refs} reference(s); {self.reasons.get(o.owner, "gone")}')
        if r.shared_payloads:
            out.append(f'kept {r.shared_payloads} piece(s), {r.shared_payload_bytes:,} bytes, that a live workflow still '
                       'refers to (or written within the grace window)')
        if r.skipped:
            out.append(f'kept {len(r.skipped)} workflow(s) with a reference written within the grace window: '
                       + ', '.join(r.skipped))
        for why, count in self.kept.items():
            out.append(f'kept {count} workflow(s): {why}')
        if r.dry_run and r.owners:
            out.append('nothing was deleted: pass --apply to delete')
        return out

    def summary(self) -> str:
        """One line (the worker's log line)."""
        r = self.report
        verb = 'would free' if r.dry_run else 'freed'
        return (f'store gc: {verb} {r.payloads} piece(s), {r.payload_bytes:,} bytes, of {len(r.owners)} workflow(s); '
                f'kept {r.shared_payloads} shared piece(s); {sum(self.kept.values()) + len(r.skipped)} workflow(s) live')


def gone_owners(owners: Sequence[ClaimCheckOwner], answers: Sequence[RunStates], now: datetime,
                retention: timedelta | None = None) -> tuple[dict[str, str], dict[str, int]]:
    """`(gone, kept)`: `{owner: why it is gone}` and `{why: count}` of the owners kept, from the engines' answers.

    Gone: an engine says the run closed at least `retention` (default: that engine's) before `now`; or no engine
    knows it and its newest reference is at least the longest retention old. Kept: open on an engine, closed within
    the retention, unknown but recent, or an engine that cannot tell its retention and no `retention` given.
    """
    gone: dict[str, str] = {}
    kept: dict[str, int] = {}
    longest = retention if retention is not None else max(
        (a.retention for a in answers if a.retention is not None), default=None)

    def keep(why: str) -> None:
        kept[why] = kept.get(why, 0) + 1

    for owner in owners:
        states = [(a, a.states[owner.owner]) for a in answers if owner.owner in a.states]
        if any(s.open for _, s in states):
            keep('open')
            continue
        if states:
            closed = []
            for answer, s in states:
                limit = retention if retention is not None else answer.retention
                if limit is None or s.closed_at is None:
                    break
                if now - s.closed_at < limit:
                    break
                closed.append(f'closed {s.closed_at.isoformat(timespec="seconds")} on {answer.engine}, past the '
                              f'{_shown(limit)} retention')
            else:
                gone[owner.owner] = '; '.join(closed)
                continue
            keep('closed within the retention period')
            continue
        if longest is not None and now - owner.newest >= longest:
            engines = ', '.join(a.engine for a in answers)
            gone[owner.owner] = (f'unknown to {engines} (deleted, or past retention) and its newest reference is older '
                                 f'than the {_shown(longest)} retention')
        else:
            keep('unknown to the engines but referenced within the retention period (starting, or another namespace)')
    return gone, kept


async def _ask(adapter: EngineAdapter, owners: list[str], settings: Settings) -> RunStates:
    try:
        return await adapter.run_states(owners, settings.engine())
    except Exception as exc:  # noqa: BLE001 - any failure to ask refuses the collection, worded once
        raise GcEngineError(f'{problem_line(adapter, exc, "run states")}; nothing was deleted. Fix: make the engine '
                            'reachable (--address, --namespace) and run gc again.') from None


async def collect_garbage(store_url: str, *, settings: Settings | None = None, retention: timedelta | None = None,
                          grace: timedelta = DEFAULT_GRACE, apply: bool = False, now: datetime | None = None,
                          answers: Sequence[RunStates] | None = None) -> Collection:
    """Find the claim-check owners whose runs are gone and delete (with `apply`) their references and the pieces no
    live run refers to.

    Args:
        store_url: The conversation store (never created here).
        settings: Where the engines are (default: from the environment).
        retention: How long after a run closed its claim checks are kept, instead of the engine's retention period
            (needed when an engine cannot tell it; tests use a short one).
        grace: Nothing written after `now - grace` is deleted (default `DEFAULT_GRACE`).
        apply: Delete; otherwise count what would be deleted and change nothing.
        now: The current time (UTC), for the cutoffs; default the clock.
        answers: The engines' `RunStates` when the caller has them already; default: ask every installed engine with
            the `claim-checks` feature.

    Returns:
        A `Collection`.

    Raises:
        GcEngineError: an engine cannot be asked, or cannot tell its retention and `retention` is not given.
        StoreUnavailableError, SchemaVersionError: no store at `store_url`, or one this code cannot read.
        ValueError: a negative `retention` or `grace`.
    """
    if grace < timedelta(0) or (retention is not None and retention < timedelta(0)):
        raise ValueError('retention and grace must not be negative')
    settings = settings or Settings.resolve()
    now = now or datetime.now(UTC)
    with SQLConversationStore(store_url, create=False) as store:
        owners = await store.claim_check_owners()
        # Pieces recorded by an engine that gc does not ask (no `claim-checks` feature: Prefect's tool results, owned
        # by `prefect:<flow run id>`) are kept: `durcap history delete` removes them with their conversation.
        foreign = tuple(spec.append_prefix for spec in specs() if spec.append_prefix and FEATURE not in spec.features)
        owners = [o for o in owners if not (foreign and o.owner.startswith(foreign))]
        if answers is None:
            ids = [o.owner for o in owners]
            adapters = [a for a in durable_adapters() if FEATURE in a.features]
            answers = [await _ask(a, ids, settings) for a in adapters] if ids else []
        for answer in answers:
            if answer.retention is None and retention is None:
                raise GcEngineError(f'{answer.engine} ({answer.where}) does not say how long it keeps closed runs; '
                                    'nothing was deleted. Fix: pass --retention DURATION (at least its retention period).')
        gone, kept = gone_owners(owners, answers, now, retention)
        report = await store.collect(sorted(gone), before=now - grace, dry_run=not apply)
    used = {a.engine: retention if retention is not None else a.retention for a in answers}
    return Collection(report, gone, kept, {e: d for e, d in used.items() if d is not None}, grace,
                      {a.engine: a.where for a in answers})


class GcSchedule:
    """`durcap worker ... --gc-every`: `collect_garbage` every `every`, in a daemon thread, logging one line per pass
    (`Collection.summary`), a failed pass logged and retried at the next one.

    Args:
        store_url, settings, retention, grace, apply: As `collect_garbage`.
        every: Time between passes (the first runs one `every` after `start`).
        log: Where each pass's line goes.
    """

    def __init__(self, store_url: str, settings: Settings, every: timedelta, log: Callable[[str], None], *,
                 apply: bool = False, retention: timedelta | None = None, grace: timedelta = DEFAULT_GRACE) -> None:
        if every <= timedelta(0):
            raise ValueError('the gc interval must be positive')
        self.store_url, self.settings, self.every, self.log = store_url, settings, every, log
        self.apply, self.retention, self.grace = apply, retention, grace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name='durcap-store-gc', daemon=True)

    def start(self) -> None:
        """Start the passes."""
        self._thread.start()

    def stop(self) -> None:
        """Stop after the pass in progress, if any."""
        self._stop.set()

    def run_once(self) -> Collection | None:
        """One pass, logged; `None` when it failed (the failure is logged)."""
        try:
            found = asyncio.run(collect_garbage(self.store_url, settings=self.settings, retention=self.retention,
                                                grace=self.grace, apply=self.apply))
        except Exception as exc:  # noqa: BLE001 - a failed pass must not stop the worker
            self.log(f'store gc: failed, nothing deleted: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}')
            return None
        self.log(found.summary() + ('' if self.apply else ' (dry run: --gc-apply deletes)'))
        return found

    def _loop(self) -> None:
        while not self._stop.wait(self.every.total_seconds()):
            self.run_once()
