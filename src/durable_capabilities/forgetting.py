"""Deleting a conversation for good (a user's right to be forgotten), and what the store holds per conversation.

The one implementation behind `durcap history delete` and `durcap store stats` (and the byte counts of `durcap ui`'s
conversation page). The store's part is `SQLConversationStore.purge` / `stats`; this module adds the engines' part:
what each engine still holds of the conversation's runs and how to remove it (`EngineSpec.retains` / `forget`),
and, when asked, the engines' own deletion (`EngineAdapter.delete_run`) and a check that no run of the
conversation is in flight. Engines are looked up by name, never named.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from ._limits import InputError, one_line
from .engines import EngineSpec, RunInfo, RunNotFoundError, get, run_of, specs
from .errors import DurcapError
from .reading import durable_adapters, problem_line
from .settings import Settings
from .store import PurgeReport, SQLConversationStore, StoreStats

__all__ = ['ConversationInFlightError', 'EngineRecords', 'check_engines_configured', 'conversation_bytes',
           'delete_conversation', 'engine_records', 'plan_delete', 'runs_in_flight', 'store_stats']


class ConversationInFlightError(DurcapError, code='conversation-in-flight'):
    """`durcap history delete` refused: an engine reports a run of the conversation still running or queued.
    Nothing was deleted. Attributes: `conversation_id`, `runs` (`RunInfo` of each)."""

    def __init__(self, conversation_id: str, runs: list[RunInfo]):
        self.conversation_id = conversation_id
        self.runs = runs
        names = ', '.join(f'{r.engine} {r.run_id} ({r.status})' for r in runs)
        super().__init__(
            f'conversation {conversation_id!r} has a run in flight ({names}); nothing was deleted. Wait for it to end, '
            'or cancel it (`durcap runs cancel RUN_ID`), then delete again.')


@dataclass
class EngineRecords:
    """What one engine keeps of one run of the conversation.

    Attributes:
        engine: The engine's name.
        run_id: The run's id on the engine (workflow id, flow run id).
        retains: What the engine keeps and for how long (`EngineSpec.retains`).
        remove: How to remove it by hand (`EngineSpec.forget` with the run id).
        deleted: `True` once `--engines` deleted it, `False` when that failed (`error` says why), `None` when not asked.
        error: Why the engine's deletion failed.
    """

    engine: str
    run_id: str
    retains: str
    remove: str
    deleted: bool | None = None
    error: str | None = None

    def to_json(self) -> dict[str, object]:
        """As JSON-compatible data."""
        return dict(self.__dict__)


@dataclass
class Deletion:
    """`delete_conversation`'s answer.

    Attributes:
        purge: What the store deleted (or would delete, with `dry_run`).
        engines: One `EngineRecords` per durable run that appended to the conversation.
        notes: Warnings for the operator (an engine that could not be checked, the store's lack of leases).
    """

    purge: PurgeReport
    engines: list[EngineRecords] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def engine_records(purge: PurgeReport) -> list[EngineRecords]:
    """What each engine keeps of the runs `purge` names (by their appends, then by the claim-check owners of runs that
    stored no append: killed, their claim taken over), and how to remove it (engines not registered are skipped)."""
    runs: dict[tuple[str, str], EngineSpec] = {}
    for append_id in [*purge.appends, *purge.owners]:
        found = run_of(specs(), append_id)
        if found is not None and found[0].durable:
            runs.setdefault((found[0].name, found[1]), found[0])
    return [EngineRecords(name, run_id, spec.retains or 'nothing known',
                          spec.forget.format(run_id=run_id) if spec.forget else 'nothing to remove')
            for (name, run_id), spec in runs.items()]


async def plan_delete(store_url: str, conversation_id: str) -> PurgeReport:
    """What deleting the conversation would delete from the store (nothing is changed, nothing is created).

    Raises:
        ConversationNotFoundError, ConversationHasForksError, StoreError: as `SQLConversationStore.purge`.
    """
    with SQLConversationStore(store_url, create=False) as store:
        return await store.purge(conversation_id, dry_run=True)


async def runs_in_flight(conversation_id: str, settings: Settings) -> tuple[list[RunInfo], list[str]]:
    """`(runs, problems)`: the runs of the conversation that an engine reports running or queued, and one line per
    configured engine that could not be asked (`reading.problem_line`) or is not configured."""
    found, problems = await _runs_in_flight(conversation_id, settings, ())
    return found, list(problems.values())


async def _runs_in_flight(conversation_id: str, settings: Settings,
                          skip: Collection[str]) -> tuple[list[RunInfo], dict[str, str]]:
    """`runs_in_flight` without the engines named in `skip`, its problems by engine name."""
    problems: dict[str, str] = {}
    found: list[RunInfo] = []
    adapters = [a for a in durable_adapters() if a.name not in skip]
    for adapter in adapters:
        if (note := adapter.unconfigured(settings.engine())) is not None:
            problems[adapter.name] = note
            continue
        for status in ('running', 'queued'):
            try:
                runs = await adapter.list_runs(settings.engine(), status=status, limit=500)
            except Exception as exc:  # noqa: BLE001 - one engine down is reported, not fatal
                problems[adapter.name] = problem_line(adapter, exc)
                break
            found += [r for r in runs if r.conversation_id == conversation_id]
    return found, problems


def _held(records: list[EngineRecords], skip: Collection[str]) -> dict[str, list[str]]:
    """`{engine: [run id, ...]}` of `records`, without the engines in `skip`."""
    held: dict[str, list[str]] = {}
    for record in records:
        if record.engine not in skip:
            held.setdefault(record.engine, []).append(record.run_id)
    return held


def _refusal(conversation_id: str, engine: str, run_ids: list[str], why: str, fix: str) -> InputError:
    """DC040 for `--engines` on a conversation whose runs on `engine` this command cannot reach: nothing deleted."""
    runs = ', '.join(run_ids[:5]) + (f' and {len(run_ids) - 5} more' if len(run_ids) > 5 else '')
    return InputError('--engines', (
        f'conversation {conversation_id!r} has {engine} runs ({runs}), and {why}: nothing was deleted. Fix: {fix}, or '
        f"pass --skip-engine {engine} to delete the store's rows and leave {engine}'s records (listed with how to "
        'remove them)'))


def check_engines_configured(purge: PurgeReport, settings: Settings, skip: Collection[str] = ()) -> None:
    """Refuse `delete_conversation(engines=True)` before anything is deleted (or asked) when an engine holding runs of
    the conversation (`purge.appends`) is not configured, so deleting its records would read another place (Prefect
    without `PREFECT_API_URL` would start a temporary server of its own, which never holds them).

    Args:
        purge: What the store holds of the conversation (`plan_delete`).
        settings: Where the engines are.
        skip: Engines left out (`--skip-engine`).

    Raises:
        InputError: DC040 naming the engine, its runs, what is missing and the fix.
    """
    for engine, run_ids in _held(engine_records(purge), skip).items():
        if get(engine).unconfigured(settings.engine()) is not None:
            where = get(engine).spec.where or 'its server'
            raise _refusal(purge.conversation_id, engine, run_ids, f'{where} is not set',
                           f'set {where} to the {engine} server that holds them')


async def _none_found(engine: str, run_ids: list[str], settings: Settings) -> str | None:
    """The first run's not-found line when `engine` knows none of `run_ids` (each asked with `show_run` until one is
    found), else `None`: the engine was asked somewhere else than where the runs are (a DBOS `--db` from another
    folder, a typo), so deleting their records there would delete nothing after the store's rows were gone. Another
    error than not-found is `None` here (the deletion reports it per run)."""
    adapter, first = get(engine), None
    for run_id in run_ids:
        try:
            await adapter.show_run(run_id, settings.engine())
        except RunNotFoundError as exc:
            first = first or one_line(str(exc))
            continue
        except Exception:  # noqa: BLE001 - not a not-found answer: left to the deletion, which reports it
            return None
        return None
    return first


async def delete_conversation(store_url: str, conversation_id: str, *, settings: Settings | None = None,
                              engines: bool = False, dry_run: bool = False, skip: Collection[str] = ()) -> Deletion:
    """Delete a conversation from the store (`SQLConversationStore.purge`) and, with `engines`, each engine's
    records of its runs (`EngineAdapter.delete_run`), after checking that no engine reports a run of it in flight.

    Args:
        store_url: The conversation store.
        conversation_id: The conversation.
        settings: Where the engines are (needed with `engines`; default: from the environment).
        engines: Check the engines for runs in flight and delete the runs' records there too. Every engine that holds
            runs of the conversation must be configured and answer, else nothing is deleted (`InputError`).
        dry_run: Change nothing; say what would be deleted.
        skip: With `engines`, engines left out: not asked, their records not deleted (`EngineRecords.deleted` is
            `None`: how to remove them is listed).

    Returns:
        A `Deletion`: the store's report, what each engine keeps (and whether it was deleted), notes.

    Raises:
        ConversationNotFoundError, ConversationHasForksError, StoreError: as `SQLConversationStore.purge`.
        ConversationInFlightError: with `engines`, an engine reports a run of the conversation running or queued.
        InputError: DC040, with `engines`: an engine that holds runs of the conversation is not configured
            (`check_engines_configured`), could not be asked, or knows none of its runs there (`_none_found`: the
            wrong `--db` or `--address`); nothing was deleted.
    """
    settings = settings or Settings.resolve()
    notes: list[str] = []
    if engines:
        planned = await plan_delete(store_url, conversation_id)
        check_engines_configured(planned, settings, skip)
        in_flight, problems = await _runs_in_flight(conversation_id, settings, skip)
        for engine, run_ids in _held(engine_records(planned), skip).items():
            if engine in problems:  # its records could not be deleted either: refuse before the store's part
                raise _refusal(conversation_id, engine, run_ids, f'it could not be asked ({problems[engine]})',
                               f'check {get(engine).spec.where or "where it is"}')
        for engine, run_ids in _held(engine_records(planned), skip).items():
            if (absent := await _none_found(engine, run_ids, settings)) is not None:  # the wrong --db / --address
                raise _refusal(conversation_id, engine, run_ids, f'none of them is where it was asked ({absent})',
                               f'pass the {get(engine).spec.where or "server"} the runs used (their records gone '
                               'already, deleted or past retention: --skip-engine)')
        notes += [f'not checked for runs in flight: {p}' for p in problems.values()]
        if in_flight:
            raise ConversationInFlightError(conversation_id, in_flight)
    else:
        notes.append('the store records no lease on a conversation, so it cannot tell whether a run of it is in flight '
                     '(a run that appends after the delete stores the conversation again); check with `durcap runs list '
                     '--status running`, or pass --engines to have the engines checked')
    with SQLConversationStore(store_url, create=False) as store:
        purge = await store.purge(conversation_id, dry_run=dry_run)
    records = engine_records(purge)
    if engines and not dry_run:
        for record in records:
            if record.engine in skip:
                continue
            adapter = get(record.engine)
            try:
                await adapter.delete_run(record.run_id, settings.engine())
                record.deleted = True
            except Exception as exc:  # noqa: BLE001 - reported per run; the store's part is done
                record.deleted, record.error = False, f'{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ""}'
    return Deletion(purge, records, notes)


async def store_stats(store_url: str) -> StoreStats:
    """`SQLConversationStore.stats` of the store at `store_url` (never creates one).

    Raises:
        StoreUnavailableError: no store there; StoreError: as `stats`.
    """
    with SQLConversationStore(store_url, create=False) as store:
        return await store.stats()


async def conversation_bytes(store_url: str, conversation_id: str) -> dict[str, int] | None:
    """The conversation's bytes in the store (`message_bytes`, `payload_bytes`, `shared_payload_bytes`), or `None`
    when the store does not know it or cannot be read (the UI's conversation page shows nothing then)."""
    from .store import StoreError

    try:
        with SQLConversationStore(store_url, create=False) as store:
            item = await store.conversation_stats(conversation_id)
    except StoreError:
        return None
    return {'message_bytes': item.message_bytes, 'payload_bytes': item.payload_bytes,
            'shared_payload_bytes': item.shared_payload_bytes}
