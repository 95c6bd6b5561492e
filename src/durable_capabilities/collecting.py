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
or already removed by retention) and its newest reference is older than the retention. An engine judges only the
owners of its runs (Prefect: `prefect:<flow run id>`, the flow run's tool-result pieces; Temporal: the workflow ids).
A Prefect flow run in a final state closed at its end; one left RUNNING by a process killed without a word (nobody
marks a flow run outside a deployment CRASHED) counts as abandoned, closed at its last sign of life, once it has shown
none (every running flow run beats every 2 s) for `abandoned_after`. Nothing is deleted when an engine cannot be asked
or cannot tell its retention (pass `retention`); an engine that keeps its runs until deleted (a Prefect server without
flow run vacuum) has its closed runs' claim checks kept unless `retention` is given. A grace window (`grace`) protects what was
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

__all__ = ['DEFAULT_GRACE', 'Collection', 'GcEngineError', 'GcSchedule', 'abandoned_owners', 'collect_garbage',
           'gone_owners', 'parse_duration']

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
        abandoned: `{owner: 'ENGINE: why'}` of the runs an engine shows as running but counts as abandoned (their
            process is gone: `RunState.abandoned`), collected or not.
        forever: Engines that keep their runs until deleted, asked with no `retention` given (their closed runs'
            claim checks were kept).
        notes: One line per engine not asked (not configured: Prefect without `PREFECT_API_URL`), its runs kept.
    """

    report: CollectReport
    reasons: dict[str, str]
    kept: dict[str, int]
    retention: dict[str, timedelta]
    grace: timedelta
    where: dict[str, str] = field(default_factory=dict)
    abandoned: dict[str, str] = field(default_factory=dict)
    forever: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """As JSON-compatible data (durations in seconds, times as ISO 8601)."""
        r = self.report
        return {
            'dry_run': r.dry_run, 'before': r.before.isoformat(), 'grace_seconds': self.grace.total_seconds(),
            'retention_seconds': {e: d.total_seconds() for e, d in self.retention.items()}, 'engines': self.where,
            'freed': {'refs': r.refs, 'payloads': r.payloads, 'payload_bytes': r.payload_bytes},
            'kept_shared': {'payloads': r.shared_payloads, 'payload_bytes': r.shared_payload_bytes},
            'owners': [{**o.__dict__, 'reason': self.reasons.get(o.owner)} for o in r.owners],
            'skipped_recent': r.skipped, 'kept_owners': self.kept, 'abandoned': self.abandoned,
            'keeps_runs_until_deleted': self.forever, 'notes': self.notes,
        }

    def lines(self) -> list[str]:
        """The report for people: a summary line, one line per owner collected, what was kept and why."""
        r = self.report
        verb = 'would free' if r.dry_run else 'freed'
        retention = ', '.join([*(f'{e} retention {_shown(d)}' for e, d in self.retention.items()),
                               *(f'{e} keeps its runs until deleted' for e in self.forever)]) or 'no engine asked'
        out = [f'store gc ({"dry run" if r.dry_run else "applied"}; {retention}; grace {_shown(self.grace)}, nothing '
               f'written after {r.before.isoformat(timespec="seconds")} is touched): {verb} {r.payloads} piece(s), '
               f'{r.payload_bytes:,} bytes, and {r.refs} reference row(s) of {len(r.owners)} workflow(s)']
        for o in r.owners:
            convs = (f'conversation {o.conversations[0]}' if len(o.conversations) == 1 else
                     f'conversations {", ".join(o.conversations)}' if o.conversations else 'stored no turn in a conversation')
            out.append(f'  {o.owner} ({convs}): {o.payloads} piece(s), {o.payload_bytes:,} bytes, '
                       f'{o.refs} reference(s); {self.reasons.get(o.owner, "gone")}')
        if r.shared_payloads:
            out.append(f'kept {r.shared_payloads} piece(s), {r.shared_payload_bytes:,} bytes, that a live workflow still '
                       'refers to (or written within the grace window)')
        if r.skipped:
            out.append(f'kept {len(r.skipped)} workflow(s) with a reference written within the grace window: '
                       + ', '.join(r.skipped))
        for why, count in self.kept.items():
            out.append(f'kept {count} workflow(s): {why}')
        for owner, why in self.abandoned.items():
            out.append(f'treated as abandoned: {owner} ({why}); '
                       + (('would be collected' if r.dry_run else 'collected') if owner in self.reasons else 'kept'))
        out += [f'note: {note}' for note in self.notes]
        if r.dry_run and r.owners:
            out.append('nothing was deleted: pass --apply to delete')
        return out

    def summary(self) -> str:
        """One line (the worker's log line), ending with how many runs were treated as abandoned when any were."""
        r = self.report
        verb = 'would free' if r.dry_run else 'freed'
        abandoned = f'; {len(self.abandoned)} treated as abandoned' if self.abandoned else ''
        return (f'store gc: {verb} {r.payloads} piece(s), {r.payload_bytes:,} bytes, of {len(r.owners)} workflow(s); '
                f'kept {r.shared_payloads} shared piece(s); {sum(self.kept.values()) + len(r.skipped)} workflow(s) live'
                f'{abandoned}')


def _prefix_of(engine: str) -> str | None:
    """The `append_prefix` of registered engine `engine` (its runs' owner ids begin with it), `None` for others."""
    return next((spec.append_prefix for spec in specs() if spec.name == engine), None) or None


def _owner_prefix(owner: str, prefixes: Sequence[str]) -> str | None:
    return next((p for p in prefixes if owner.startswith(p)), None)


def gone_owners(owners: Sequence[ClaimCheckOwner], answers: Sequence[RunStates], now: datetime,
                retention: timedelta | None = None) -> tuple[dict[str, str], dict[str, int]]:
    """`(gone, kept)`: `{owner: why it is gone}` and `{why: count}` of the owners kept, from the engines' answers.

    Each owner is judged by the engines its id belongs to: one beginning with a registered engine's `append_prefix`
    (`prefect:<flow run id>`) by that engine's answer only (kept when it was not asked); any other by the answers of
    engines without a prefix (Temporal's workflow ids). Gone: such an engine says the run closed (or was abandoned:
    `RunState.abandoned`, closed at its last sign of life) at least `retention` (default: that engine's) before `now`;
    or none of them knows it and its newest reference is at least their longest retention old. Kept: open, closed
    within the retention, unknown but recent, an engine that keeps its runs until deleted (`keeps_forever`) and no
    `retention` given, or one that cannot tell its retention and no `retention` given.
    """
    gone: dict[str, str] = {}
    kept: dict[str, int] = {}
    prefixes = sorted({p for spec in specs() if (p := spec.append_prefix)}, key=len, reverse=True)
    by_prefix: dict[str | None, list[RunStates]] = {}
    for answer in answers:
        by_prefix.setdefault(_prefix_of(answer.engine), []).append(answer)

    def keep(why: str) -> None:
        kept[why] = kept.get(why, 0) + 1

    for owner in owners:
        group = by_prefix.get(_owner_prefix(owner.owner, prefixes), [])
        if not group:
            keep('their engine was not asked')
            continue
        limits = [retention if retention is not None else a.retention for a in group]
        longest = max((d for d in limits if d is not None), default=None)
        states = [(a, limit, a.states[owner.owner]) for a, limit in zip(group, limits, strict=True)
                  if owner.owner in a.states]
        if any(s.open for _, _, s in states):
            keep('open')
            continue
        if states:
            closed = []
            why_kept = 'closed within the retention period'
            for answer, limit, s in states:
                if limit is None or s.closed_at is None:
                    if answer.keeps_forever:
                        why_kept = (f'closed or abandoned on {answer.engine}, which keeps its runs until deleted (pass '
                                    '--retention DURATION to free what closed that long ago)')
                    break
                if now - s.closed_at < limit:
                    if s.abandoned:
                        why_kept = 'abandoned within the retention period'
                    break
                when = s.closed_at.isoformat(timespec='seconds')
                closed.append(f'abandoned on {answer.engine} ({s.abandoned}), past the {_shown(limit)} retention'
                              if s.abandoned else
                              f'closed {when} on {answer.engine}, past the {_shown(limit)} retention')
            else:
                gone[owner.owner] = '; '.join(closed)
                continue
            keep(why_kept)
            continue
        if longest is not None and now - owner.newest >= longest:
            engines = ', '.join(a.engine for a in group)
            gone[owner.owner] = (f'unknown to {engines} (deleted, or past retention) and its newest reference is older '
                                 f'than the {_shown(longest)} retention')
        elif longest is None and all(a.keeps_forever for a in group):
            keep('unknown to an engine that keeps its runs until deleted (pass --retention DURATION to free those '
                 'referenced that long ago)')
        else:
            keep('unknown to the engines but referenced within the retention period (starting, or another namespace)')
    return gone, kept


def abandoned_owners(answers: Sequence[RunStates]) -> dict[str, str]:
    """`{owner: 'ENGINE: why'}` of the runs an engine counts as abandoned (`RunState.abandoned`)."""
    return {owner: f'{a.engine}: {s.abandoned}' for a in answers for owner, s in a.states.items() if s.abandoned}


async def _ask(adapter: EngineAdapter, owners: list[str], settings: Settings,
               abandoned_after: timedelta | None = None) -> RunStates:
    engine = dict(settings.engine())
    if abandoned_after is not None:
        engine['abandoned_after'] = abandoned_after.total_seconds()
    try:
        return await adapter.run_states(owners, engine)
    except Exception as exc:  # noqa: BLE001 - any failure to ask refuses the collection, worded once
        raise GcEngineError(f'{problem_line(adapter, exc, "run states")}; nothing was deleted. Fix: make the engine '
                            f'reachable ({adapter.spec.where or "--address, --namespace"}) and run gc again.') from None


async def collect_garbage(store_url: str, *, settings: Settings | None = None, retention: timedelta | None = None,
                          grace: timedelta = DEFAULT_GRACE, apply: bool = False, now: datetime | None = None,
                          answers: Sequence[RunStates] | None = None,
                          abandoned_after: timedelta | None = None) -> Collection:
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
            the `claim-checks` feature about the owners of its runs (`gone_owners`), an engine with none not asked.
        abandoned_after: How long a run its engine shows as running must show no sign of life to count as abandoned
            (Prefect: `engines.prefect._runs.DEFAULT_ABANDONED_AFTER`, 1 h, by default).

    Returns:
        A `Collection`.

    Raises:
        GcEngineError: an engine cannot be asked, or cannot tell its retention and `retention` is not given.
        StoreUnavailableError, SchemaVersionError: no store at `store_url`, or one this code cannot read.
        ValueError: a negative `retention` or `grace`, or an `abandoned_after` not above 0.
    """
    if grace < timedelta(0) or (retention is not None and retention < timedelta(0)):
        raise ValueError('retention and grace must not be negative')
    if abandoned_after is not None and abandoned_after <= timedelta(0):
        raise ValueError('abandoned_after must be above 0')
    settings = settings or Settings.resolve()
    now = now or datetime.now(UTC)
    notes: list[str] = []
    with SQLConversationStore(store_url, create=False) as store:
        owners = await store.claim_check_owners()
        # Pieces recorded by an engine that gc does not ask (no `claim-checks` feature) are kept: `durcap history
        # delete` removes them with their conversation.
        foreign = tuple(spec.append_prefix for spec in specs() if spec.append_prefix and FEATURE not in spec.features)
        owners = [o for o in owners if not (foreign and o.owner.startswith(foreign))]
        if answers is None:
            prefixes = sorted({p for spec in specs() if (p := spec.append_prefix)}, key=len, reverse=True)
            answers = []
            for adapter in (a for a in durable_adapters() if FEATURE in a.features):
                mine = adapter.spec.append_prefix or None
                ids = [o.owner for o in owners if _owner_prefix(o.owner, prefixes) == mine]
                if not ids:
                    continue
                if (note := adapter.unconfigured(settings.engine())) is not None:
                    # Prefect without PREFECT_API_URL: asking would start a temporary server (in a worker's every
                    # pass); its runs' claim checks are kept, and the line says how to have them judged.
                    notes.append(f'{note}: its {len(ids)} run(s) kept, not asked')
                    continue
                answers.append(await _ask(adapter, ids, settings, abandoned_after))
        for answer in answers:
            if answer.retention is None and retention is None and not answer.keeps_forever:
                raise GcEngineError(f'{answer.engine} ({answer.where}) does not say how long it keeps closed runs; '
                                    'nothing was deleted. Fix: pass --retention DURATION (at least its retention period).')
        gone, kept = gone_owners(owners, answers, now, retention)
        report = await store.collect(sorted(gone), before=now - grace, dry_run=not apply)
    used = {a.engine: retention if retention is not None else a.retention for a in answers}
    return Collection(report, gone, kept, {e: d for e, d in used.items() if d is not None}, grace,
                      {a.engine: a.where for a in answers}, abandoned_owners(answers),
                      sorted(a.engine for a in answers if a.keeps_forever and retention is None), notes)


class GcSchedule:
    """`durcap worker ... --gc-every`: `collect_garbage` every `every`, in a daemon thread, logging one line per pass
    (`Collection.summary`), a failed pass logged and retried at the next one.

    Args:
        store_url, settings, retention, grace, apply: As `collect_garbage`.
        every: Time between passes (the first runs one `every` after `start`).
        log: Where each pass's line goes.
        abandoned_after: As `collect_garbage`.
    """

    def __init__(self, store_url: str, settings: Settings, every: timedelta, log: Callable[[str], None], *,
                 apply: bool = False, retention: timedelta | None = None, grace: timedelta = DEFAULT_GRACE,
                 abandoned_after: timedelta | None = None) -> None:
        if every <= timedelta(0):
            raise ValueError('the gc interval must be positive')
        self.store_url, self.settings, self.every, self.log = store_url, settings, every, log
        self.apply, self.retention, self.grace, self.abandoned_after = apply, retention, grace, abandoned_after
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
                                                grace=self.grace, apply=self.apply,
                                                abandoned_after=self.abandoned_after))
        except Exception as exc:  # noqa: BLE001 - a failed pass must not stop the worker
            self.log(f'store gc: failed, nothing deleted: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}')
            return None
        self.log(found.summary() + ('' if self.apply else ' (dry run: --gc-apply deletes)'))
        return found

    def _loop(self) -> None:
        while not self._stop.wait(self.every.total_seconds()):
            self.run_once()
