"""What an operator reads: runs across the configured engines, one run, one stored conversation.

The one implementation behind `durcap runs list|show`, `durcap history show` and the pages of `durcap ui`
(approvals are `runner.approvals` / `runner.decide`). Engines are looked up by name, never named.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ModelResponse
from pydantic_ai.usage import RequestUsage
from pydantic_core import to_jsonable_python

from .engines import DURABLE_ENGINES, EngineAdapter, RunInfo, RunNotFoundError, get
from .errors import DurcapError
from .settings import Settings
from .store import SQLConversationStore, StoredConversation, WriteRecord, loaded_capability_ids, tools_called

__all__ = ['RunListing', 'approval_audit', 'durable_adapters', 'find_run', 'list_runs', 'read_conversation', 'summarize']


class EngineNotInstalled(LookupError, DurcapError, code='engine-not-installed'):
    """`--engine NAME` names a durable engine whose extra is not installed (message says what to install)."""


def durable_adapters(engine: str | None = None) -> list[EngineAdapter]:
    """The adapter of `engine`, or of every installed durable engine when `None`.

    Raises:
        EngineNotInstalled: `engine` is registered but its SDK is not installed.
        ValueError: `engine` names no registered engine.
    """
    if engine is not None:
        adapter = get(engine)
        if not adapter.available():
            raise EngineNotInstalled(f'engine {engine!r} is not installed (pip install "durable-capabilities[{adapter.extra}]")')
        return [adapter]
    return [get(name) for name in DURABLE_ENGINES if get(name).available()]


def problem_line(adapter: EngineAdapter, exc: BaseException, what: str = 'runs') -> str:
    """`'{engine}: cannot read {what}: {Error}: {first line}'`: how one unreachable engine is reported. `{Error}: `
    is left out for durcap's own errors and `RuntimeError` (the engines' worded reasons, e.g. `cannot connect to the
    DBOS system database ...`); a driver's or the OS's error keeps its class name (`ConnectionRefusedError: ...`)."""
    detail = str(exc).splitlines()[0] if str(exc) else ''
    ours = type(exc) is RuntimeError or type(exc).__module__.startswith('durable_capabilities')
    kind = '' if ours and detail else f'{type(exc).__name__}: '
    return f'{adapter.name}: cannot read {what}: {kind}{detail}'


@dataclass
class RunListing:
    """Runs of several engines.

    Attributes:
        runs: Every engine's runs, newest first per engine, engines in registry order.
        problems: One line per engine that could not be read (`problem_line`); its runs are missing.
        notes: One line per engine skipped because it is not configured (`EngineAdapter.unconfigured`: asking it
            would start a server of its own, e.g. Prefect's temporary one), and per engine whose given address holds
            nothing yet or may not be the user's (`EngineAdapter.listing_note`, e.g. a mistyped `--db` SQLite path).
    """

    runs: list[RunInfo] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _configured(adapters: list[EngineAdapter], settings: Settings, notes: list[str]) -> list[EngineAdapter]:
    """The adapters that are configured; one line in `notes` for each of the others."""
    kept = []
    for adapter in adapters:
        if (note := adapter.unconfigured(settings.engine())) is not None:
            notes.append(note)
        else:
            kept.append(adapter)
    return kept


def _with_store(settings: Settings) -> dict[str, Any]:
    """The engine settings an adapter reads runs with, plus `store` (the conversation store URL): a run's result that
    names its append is read back from it (`--store`, else `$DURCAP_STORE`, else the default)."""
    return {**settings.engine(), 'store': settings.store}


async def list_runs(settings: Settings, *, engines: list[str] | None = None, status: str | None = None,
                    limit: int = 20) -> RunListing:
    """The durcap runs of `engines` (default: every installed durable engine), at most `limit` per engine.

    Args:
        settings: Where the engines are.
        engines: Engine names (each must be installed), or `None`: every installed engine that is configured
            (the others are named in `RunListing.notes`).
        status: One of `engines.RUN_STATUSES`, or `None` for all.
        limit: Runs per engine, newest first.

    Raises:
        EngineNotInstalled / ValueError: as `durable_adapters`.
    """
    listing = RunListing()
    if engines:
        adapters = [a for name in engines for a in durable_adapters(name)]
    else:
        adapters = _configured(durable_adapters(), settings, listing.notes)
    for adapter in adapters:
        if (note := adapter.listing_note(settings.engine())) is not None:
            listing.notes.append(note)
        try:
            listing.runs += await adapter.list_runs(_with_store(settings), status=status, limit=limit)
            if status == 'running':
                await _note_orphans(adapter, settings, listing.notes, limit)
        except Exception as exc:  # noqa: BLE001 - one engine down must not hide the others' runs
            listing.problems.append(problem_line(adapter, exc))
    return listing


async def _note_orphans(adapter: EngineAdapter, settings: Settings, notes: list[str], limit: int) -> None:
    """Under `--status running`: a note naming how many runs of `adapter` are `orphaned` (started, their process
    gone: a DBOS workflow whose executor died), which that filter leaves out, and how to see and finish them."""
    orphans = await adapter.list_runs(_with_store(settings), status='orphaned', limit=limit)
    if orphans:
        shown = f'{len(orphans)}+' if len(orphans) >= limit else str(len(orphans))
        notes.append(f'{adapter.name}: {shown} orphaned run(s) not listed (started, their process is gone): '
                     f'`durcap runs list --engine {adapter.name} --status orphaned`, then `durcap runs resume ID`')


async def find_run(run_id: str, settings: Settings, engine: str | None = None) -> tuple[EngineAdapter, RunInfo]:
    """`(adapter, RunInfo)` of run `run_id` (with its durable units); every installed engine is asked when
    `engine` is `None` (every configured one: an unconfigured engine is skipped with a note in `args[1]`).

    Raises:
        RunNotFoundError: no engine has the run; `args[1]` lists each engine's answer (not found, unreachable,
            skipped).
        EngineNotInstalled / ValueError: as `durable_adapters`.
    """
    problems: list[str] = []
    adapters = durable_adapters(engine) if engine is not None else _configured(durable_adapters(), settings, problems)
    for adapter in adapters:
        try:
            return adapter, await adapter.show_run(run_id, _with_store(settings))
        except RunNotFoundError as exc:
            problems.append(str(exc))
        except Exception as exc:  # noqa: BLE001 - unreachable engine: say so, try the next
            problems.append(problem_line(adapter, exc))
    raise RunNotFoundError(f'no run {run_id!r} found', problems)


async def read_conversation(store: str, conversation_id: str) -> tuple[StoredConversation, list[WriteRecord]]:
    """The stored conversation and its write log from the store at URL `store`.

    Raises:
        store.StoreError: no store there, unknown conversation, a row that does not decode, a newer schema.
    """
    with SQLConversationStore(store, create=False) as opened:
        stored = await opened.read(conversation_id)
        writes = await opened.writes(conversation_id)
    return stored, writes


def summarize(stored: StoredConversation, writes: list[WriteRecord]) -> dict[str, Any]:
    """What `durcap history show --format json` prints and the conversation view of `durcap ui` shows.

    Returns:
        `{conversation_id, revision, message_count, scope, updated_at, loaded_capabilities (ids in load
        order), tools_called ({name: calls}), usage (summed over the model responses, `requests` = number
        of responses), stored_usage (the record's running total, tool calls included), writes (the write
        log), approvals (`approval_audit`), messages (pydantic-ai message JSON)}`.
    """
    usage = RequestUsage()
    responses = 0
    for message in stored.messages:
        if isinstance(message, ModelResponse):
            usage = usage + message.usage
            responses += 1
    return {
        'conversation_id': stored.conversation_id,
        'revision': stored.revision,
        'message_count': stored.message_count,
        'scope': stored.record.scope,
        'updated_at': stored.record.updated_at.isoformat(),
        'loaded_capabilities': loaded_capability_ids(stored.messages),
        'tools_called': tools_called(stored.messages),
        'usage': {'requests': responses, **_nonzero(to_jsonable_python(usage))},
        'stored_usage': _nonzero(to_jsonable_python(stored.record.usage)),
        'writes': [
            {
                'revision': w.revision,
                'operation': w.operation,
                'append_id': w.append_id,
                'first_position': w.first_position,
                'messages': len(w.entry_ids),
                'written_at': w.written_at.isoformat(),
                'writer': w.writer,
            }
            for w in writes
        ],
        'approvals': approval_audit(stored.messages),
        'messages': ModelMessagesTypeAdapter.dump_python(stored.messages, mode='json'),
    }


def approval_audit(messages: list[ModelMessage]) -> list[dict[str, Any]]:
    """The approval audit records the durable runs stored in the conversation (`approvals.AUDIT_METADATA_KEY`
    in a request's metadata), in order: tool, arguments, fingerprint, requested at, deadline, decision, by, at,
    reason."""
    from .approvals import AUDIT_METADATA_KEY

    return [record for message in messages for record in ((getattr(message, 'metadata', None) or {})
                                                          .get(AUDIT_METADATA_KEY) or [])]


def _nonzero(usage: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in usage.items() if v not in (0, 0.0, None, {}, [])}
