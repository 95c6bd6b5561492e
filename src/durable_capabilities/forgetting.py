"""Deleting a conversation for good (a user's right to be forgotten), and what the store holds per conversation.

The one implementation behind `durcap history delete` and `durcap store stats` (and the byte counts of `durcap ui`'s
conversation page). The store's part is `SQLConversationStore.purge` / `stats`; this module adds the engines' part:
what each engine still holds of the conversation's runs and how to remove it (`EngineSpec.retains` / `forget`),
and, when asked, the engines' own deletion (`EngineAdapter.delete_run`) and a check that no run of the
conversation is in flight. Engines are looked up by name, never named.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .engines import EngineSpec, RunInfo, get, run_of, specs
from .errors import DurcapError
from .reading import _configured, durable_adapters, problem_line
from .settings import Settings
from .store import PurgeReport, SQLConversationStore, StoreStats

__all__ = ['ConversationInFlightError', 'EngineRecords', 'conversation_bytes', 'delete_conversation', 'engine_records',
           'plan_delete', 'runs_in_flight', 'store_stats']


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
    """What each engine keeps of the runs `purge` names, and how to remove it (engines not registered are skipped)."""
    runs: dict[tuple[str, str], EngineSpec] = {}
    for append_id in purge.appends:
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
    problems: list[str] = []
    found: list[RunInfo] = []
    for adapter in _configured(durable_adapters(), settings, problems):
        for status in ('running', 'queued'):
            try:
                runs = await adapter.list_runs(settings.engine(), status=status, limit=500)
            except Exception as exc:  # noqa: BLE001 - one engine down is reported, not fatal
                problems.append(problem_line(adapter, exc))
                break
            found += [r for r in runs if r.conversation_id == conversation_id]
    return found, problems


async def delete_conversation(store_url: str, conversation_id: str, *, settings: Settings | None = None,
                              engines: bool = False, dry_run: bool = False) -> Deletion:
    """Delete a conversation from the store (`SQLConversationStore.purge`) and, with `engines`, each engine's
    records of its runs (`EngineAdapter.delete_run`), after checking that no engine reports a run of it in flight.

    Args:
        store_url: The conversation store.
        conversation_id: The conversation.
        settings: Where the engines are (needed with `engines`; default: from the environment).
        engines: Check the engines for runs in flight and delete the runs' records there too.
        dry_run: Change nothing; say what would be deleted.

    Returns:
        A `Deletion`: the store's report, what each engine keeps (and whether it was deleted), notes.

    Raises:
        ConversationNotFoundError, ConversationHasForksError, StoreError: as `SQLConversationStore.purge`.
        ConversationInFlightError: with `engines`, an engine reports a run of the conversation running or queued.
    """
    settings = settings or Settings.resolve()
    notes: list[str] = []
    if engines:
        in_flight, problems = await runs_in_flight(conversation_id, settings)
        notes += [f'not checked for runs in flight: {p}' for p in problems]
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
