"""DBOS, operator side: the runs (`durcap runs list|show|cancel|resume`) and the approvals (`durcap approvals`) of
`durcap.*` workflows, read and driven through a `DBOSClient` on the system database.

`DBOSAdapter` (its `operator`) delegates to these functions: the shared operator methods of `EngineAdapter`.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from dbos import DBOS
from sqlalchemy.exc import OperationalError, ProgrammingError, SQLAlchemyError

from ..._limits import redact_database_url
from ...approvals import ApprovalError, Decision, PendingCall, already_decided, check_decision, describe_decision
from ...conversations import resolve_payload, store_url
from ...report import RunReport
from .._adapter import RunInfo, RunNotFoundError, RunOptions, RunUnit, loaded_capabilities_in, unit_kind
from . import _decisions
from ._client import client as _client
from ._client import database_error_line, quiet_dbos_log
from ._server import executor_process_gone, launch, system_database_file, system_database_url
from ._spec import APP_NAME, DECISION_TOPIC, ENGINE, PENDING_EVENT, RUN_EXECUTOR_PREFIX, WORKFLOW_NAME_PREFIX
from ._workflow import agent_workflow

if TYPE_CHECKING:
    from ...agent import DurableAgent


# ---- runs (`durcap runs`) ------------------------------------------------------------------------------


async def _info(client: Any, status: Any, with_steps: bool = True, with_units: bool = False,
                settings: Mapping[str, Any] | None = None) -> RunInfo:
    steps = await client.list_workflow_steps_async(status.workflow_id) if with_steps else []
    name = status.name or ''
    agent = name[len(WORKFLOW_NAME_PREFIX):] if name.startswith(WORKFLOW_NAME_PREFIX) else None
    inputs: Any = status.input or {}
    args, kwargs = list(inputs.get('args') or ()), dict(inputs.get('kwargs') or {})
    conversation = kwargs.get('conversation_id', args[3] if len(args) > 3 else None)
    output, unread = await _read_output(status.output, settings)
    outputs = [output] + [step.get('output') for step in steps]
    engine_status = str(status.status)
    gone = engine_status in ('PENDING', 'ENQUEUED') and executor_process_gone(status.executor_id)
    # The database the caller named goes into the commands (password shown as ***), so they find the same run.
    db = f' --db {redact_database_url(settings["db"])}' if settings and settings.get('db') else ''
    notes = [(f'its process ({status.executor_id}) is gone: finish it with `durcap runs resume '
              f'{status.workflow_id} --engine dbos{db} --target TARGET`, or by `durcap worker dbos TARGET{db} '
              f'--executor-id {status.executor_id}` (a worker recovers only its own executor\'s workflows)')] if gone else []
    notes += unread
    return RunInfo(
        ENGINE, status.workflow_id, agent, 'orphaned' if gone else _DBOS_STATUS.get(engine_status, 'running'),
        engine_status,
        datetime.fromtimestamp(status.created_at / 1000, UTC) if status.created_at else None,
        loaded_capabilities_in(outputs), conversation, sum(1 for step in steps if step.get('error') is None), notes,
        {'executor_id': status.executor_id, 'queue': status.queue_name, 'workflow_name': name,
         'app_version': status.app_version, 'orphaned': gone, 'error': _error_line(status.error)},
        [_unit(step) for step in steps] if with_units else [],
    )


async def _read_output(output: Any, settings: Mapping[str, Any] | None) -> tuple[Any, list[str]]:
    """The workflow's output with its messages (`conversations.resolve_payload`, from the store `--store` names) and the
    notes to print: one when the append it names cannot be read back (deleted, or another store)."""
    try:
        return await resolve_payload(output, store=(settings or {}).get('store')), []
    except Exception as error:  # noqa: BLE001 - a run whose messages are gone is still listed, with why
        return None, [f'its turn\'s messages are not readable: {error}']


async def list_runs(settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
    """`durcap.*` workflows, newest first; a PENDING or ENQUEUED one whose `durcap run` process is gone is
    `orphaned` (as `show_run` says), not `running`."""
    if _missing_sqlite_file(settings) is not None:
        return []  # nothing has run there (and reading does not create the file)
    client = _client(settings)
    try:
        engine_statuses = ('PENDING', 'ENQUEUED') if status == 'orphaned' else [k for k, v in _DBOS_STATUS.items() if v == status]
        try:
            found = await client.list_workflows_async(status=list(engine_statuses) if status else None, sort_desc=True,
                                                      limit=limit * 4, load_output=True)
        except Exception as exc:
            if _no_dbos_tables(exc):
                return []  # a database DBOS never launched on: no runs
            raise
        found = [w for w in found if (w.name or '').startswith(WORKFLOW_NAME_PREFIX)]
        infos = []
        for workflow in found:
            info = await _info(client, workflow, settings=settings)
            if status is None or info.status == status:
                infos.append(info)
            if len(infos) == limit:
                break
        return infos
    finally:
        client.destroy()


async def show_run(run_id: str, settings: Mapping[str, Any]) -> RunInfo:
    missing = _missing_sqlite_file(settings)
    if missing is not None:
        raise RunNotFoundError(f'no DBOS workflow {run_id!r}: no system database at {missing} (nothing has run there; '
                               'pass the --db the run used)')
    client = _client(settings)
    try:
        try:
            found = await client.list_workflows_async(workflow_ids=[run_id])
        except Exception as exc:
            if not _no_dbos_tables(exc):
                raise
            found = []
        if not found:
            raise RunNotFoundError(f'no DBOS workflow {run_id!r} in {redact_database_url(system_database_url(settings.get("db")))}')
        return await _info(client, found[0], with_units=True, settings=settings)
    finally:
        client.destroy()


async def cancel(run_id: str, settings: Mapping[str, Any]) -> RunInfo:
    await show_run(run_id, settings)
    client = _client(settings)
    try:
        await client.cancel_workflow_async(run_id)
    finally:
        client.destroy()
    return await show_run(run_id, settings)


async def delete_run(run_id: str, settings: Mapping[str, Any]) -> None:
    """Delete the workflow's status, inputs and step outputs from the system database (`DBOSClient.delete_workflows`),
    and its decision slots (`_decisions`)."""
    await show_run(run_id, settings)
    client = _client(settings)
    try:
        await client.delete_workflows_async([run_id])
    finally:
        client.destroy()
    await asyncio.to_thread(_decisions.forget, system_database_url(settings.get('db')), [run_id])


async def resume(run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
    """Resume the workflow on this process's own DBOS queue (a fresh executor id, no other queue served) and
    wait for its result: recorded steps return their recorded results, the rest run once."""
    info = await show_run(run_id, options.settings)
    if not agents:
        raise RuntimeError(f'pass --target TARGET (the definition of agent {info.agent!r}): DBOS runs the rest of '
                           f'workflow {run_id} with its code')
    if info.status == 'completed':
        options.notify(f'dbos workflow {run_id} had already completed')
    elif info.status in ('running', 'queued') and not info.detail.get('orphaned') and info.detail.get(
            'executor_id', '').startswith(RUN_EXECUTOR_PREFIX):
        options.notify(f'dbos workflow {run_id} belongs to executor {info.detail["executor_id"]}, which may still '
                       'run it; resuming hands it to this process')
    for agent in agents:
        agent_workflow(agent, store=options.setting('store'))
    if info.agent is not None and info.agent not in {a.name for a in agents} | {
            p for a in agents for p in a.previous_names}:
        raise RuntimeError(f'workflow {run_id} runs agent {info.agent!r}, which the target does not define')
    queue = f'durcap-resume-{uuid.uuid4().hex[:8]}'
    # As the version the run recorded: DBOS hands a resumed workflow only to a process of its version (a worker's
    # names its agents, `_server.application_version`).
    version = info.detail.get('app_version') if not os.environ.get('DBOS__APPVERSION') else None
    launch(APP_NAME, system_database_url_=options.setting('db'), one_shot=True, listen=[queue],
           executor_id=options.setting('executor_id'), **({'application_version': version} if version else {}))
    try:
        if info.status != 'completed':
            await DBOS.register_queue_async(queue)
            options.notify(f'resuming dbos workflow {run_id} as executor {DBOS.executor_id}')
            handle = await DBOS.resume_workflow_async(run_id, queue_name=queue)
        else:
            handle = await DBOS.retrieve_workflow_async(run_id)
        payload = await handle.get_result()
        steps = await DBOS.list_workflow_steps_async(run_id)
        # Before `DBOS.destroy`, which shuts the loop's default executor down (the store reads run in it).
        named = next((a for a in agents if info.agent in (a.name, *a.previous_names)), agents[0])
        payload = await resolve_payload(payload, store=store_url(named, options.setting('store')))
    finally:
        DBOS.destroy()
    return RunReport.from_payload(ENGINE, run_id, payload, [step['function_name'] for step in steps])


def _error_line(error: Any) -> str | None:
    """A failed workflow's error as one line (`Type: message`), or `None`. A step that ran out of retries
    (`DBOSMaxStepRetriesExceeded`, which keeps each attempt's error in `errors`) is named by its last attempt's
    error, the step's own failure following: `RuntimeError: card declined; after DBOSMaxStepRetriesExceeded: ...`."""
    if error is None:
        return None
    if not isinstance(error, BaseException):
        text = str(error).strip().splitlines()
        return text[0] if text else None

    def line(exc: BaseException) -> str:
        text = str(exc).strip().splitlines()
        return f'{type(exc).__name__}: {text[0] if text else ""}'

    attempts = getattr(error, 'errors', None)
    if isinstance(attempts, (list, tuple)) and attempts and isinstance(attempts[-1], BaseException):
        return f'{line(attempts[-1])}; after {line(error)}'
    return line(error)


_DBOS_STATUS = {
    'PENDING': 'running', 'ENQUEUED': 'queued', 'DELAYED': 'queued', 'SUCCESS': 'completed', 'ERROR': 'failed',
    'CANCELLED': 'cancelled', 'MAX_RECOVERY_ATTEMPTS_EXCEEDED': 'failed',
}


def _unit(step: Any) -> RunUnit:
    """A recorded DBOS step (`list_workflow_steps` entry) as a `RunUnit`."""
    started = step.get('started_at_epoch_ms')
    status = 'failed' if step.get('error') is not None else ('done' if step.get('completed_at_epoch_ms') or
                                                              step.get('output') is not None else 'started')
    name = step.get('function_name') or ''
    return RunUnit(name, unit_kind(name), status, datetime.fromtimestamp(started / 1000, UTC) if started else None,
                   loaded_capabilities_in([step.get('output')]))


# ---- approvals (`durcap approvals`) -------------------------------------------------------------------


async def pending_approvals(settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
    """Pending calls of waiting `durcap.*` workflows (or of `run_id`), read with a `DBOSClient` on `settings['db']`."""
    if _missing_sqlite_file(settings) is not None:
        return []  # nothing has run there (and reading does not create the file)
    client = _client(settings)
    try:
        if run_id is not None:
            ids = [run_id]
        else:
            workflows = await client.list_workflows_async(status='PENDING', load_input=False, load_output=False)
            ids = [w.workflow_id for w in workflows if (w.name or '').startswith(WORKFLOW_NAME_PREFIX)]
        calls: list[PendingCall] = []
        for workflow_id in ids:
            with quiet_dbos_log(FALLBACK_POLL_LOG):  # a database error is raised below, in one line
                published = await client.get_event_async(workflow_id, PENDING_EVENT, timeout_seconds=0)
            waiting = [PendingCall.from_json({**data, 'engine': ENGINE}) for data in published or []]
            if not waiting:
                continue
            # A decision sent but not read yet (the run's process is down): the call is still published as pending;
            # say so, rather than list it as waiting for a decision. (The status is read only when calls wait: a
            # caller polling one run, in a process whose DBOS has just been destroyed, never waits on it.)
            [status] = await client.list_workflows_async(workflow_ids=[workflow_id], load_input=False,
                                                         load_output=False) or [None]
            for call in waiting:
                earlier, _ = _recorded_decision(status, call.call_id, waiting) if status is not None else (None, None)
                call.decided = describe_decision(earlier) if earlier is not None else None
            calls += waiting
        return calls
    except Exception as exc:
        if _no_dbos_tables(exc):
            return []  # no DBOS tables yet: nothing has run, nothing waits
        raise _unreachable(exc, settings) from exc  # an unreachable database is not "nothing waits"
    finally:
        client.destroy()


async def decide(run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
    """Check `decision` against the run's published pending calls and against the decision already made on the call,
    then send it on `DECISION_TOPIC` and record it on the workflow (`DECISION_ATTRIBUTE`).

    The record is what refuses a second decision while the first one waits, unread, for the workflow (its process is
    down, or it has not reached `recv` yet): DBOS keeps the first message with the call's idempotency key and drops
    the second one, so without it a second `durcap approve|deny` exited 0 and changed nothing. Two decisions made at
    the same moment both pass that check; the message is sent in one transaction with the call's decision slot
    (`_decisions.claim_and_send`: a row whose key only one can insert), so exactly one is sent and the others are
    refused naming it (before, all were told yes and the first message stored won). The record is written after the
    transaction: a process killed between the two leaves a decision sent and its slot taken, which refuses a second
    decision as the record would.

    Raises:
        ApprovalError: unknown run (no such workflow, or it waits for nothing), unknown call, stale fingerprint, or
            a call already decided (`approvals.already_decided`: names the earlier decision).
    """
    if (missing := _missing_sqlite_file(settings)) is not None:
        raise ApprovalError('unknown-run', f'no DBOS workflow {run_id!r}: no system database at {missing} (nothing '
                                           'has run there; pass the --db the run used)')
    client = _client(settings)
    try:
        try:
            status = await client.list_workflows_async(workflow_ids=[run_id], load_input=False, load_output=False)
        except Exception as exc:
            if not _no_dbos_tables(exc):
                raise _unreachable(exc, settings) from exc
            status = []  # no DBOS tables yet
        if not status:
            raise ApprovalError('unknown-run', f'no DBOS workflow {run_id!r} in {_db_label(settings)}')
        with quiet_dbos_log(FALLBACK_POLL_LOG):
            published = await client.get_event_async(run_id, PENDING_EVENT, timeout_seconds=0)
        pending = [PendingCall.from_json(d) for d in published or []]
        earlier, received = _recorded_decision(status[0], decision.call_id, pending)
        if earlier is not None:
            raise already_decided(run_id, decision.call_id, earlier, received=received)
        if status[0].status not in ('PENDING', 'ENQUEUED') or not pending:  # ENQUEUED: recovered, not yet running
            raise ApprovalError('unknown-run', f'DBOS workflow {run_id!r} is not waiting for approval '
                                               f'(status {status[0].status})')
        call = check_decision(pending, decision, run_id)
        # The slot and the message in one transaction: of deciders at the same moment, one sends (`_decisions`).
        held = await asyncio.to_thread(
            _decisions.claim_and_send, system_database_url(settings.get('db')), client, run_id, call.call_id,
            call.requested_at, decision.to_json(), DECISION_TOPIC, f'{decision.call_id}:{decision.fingerprint}')
        if held is not None:
            raise already_decided(run_id, decision.call_id, Decision.from_json(held), received=False)
        if hasattr(client, 'update_workflow_attributes_async'):  # DBOS 3.x; older ones keep first-message-wins
            record = {**decision.to_json(), 'requested_at': call.requested_at}
            await client.update_workflow_attributes_async(run_id, {DECISION_ATTRIBUTE + call.call_id: record}, merge=True)
        return call
    finally:
        client.destroy()


FALLBACK_POLL_LOG = 'Fallback workflow event poll failed'
"""The start of the warning (with a traceback) DBOS logs when its direct read of a workflow event fails (dbos
`SystemDatabase.get_event_check`); the readers here drop it and raise the error in one line instead."""


DECISION_ATTRIBUTE = 'durcap.decision.'
"""Prefix of the workflow attribute (DBOS's custom attributes, merged per key) recording the decision sent on a call:
`durcap.decision.{call id}` -> the `Decision` JSON plus the pending call's `requested_at`."""


def _recorded_decision(status: Any, call_id: str, pending: list[PendingCall]) -> tuple[Decision | None, bool | None]:
    """`(decision, received)`: the decision recorded on the workflow for `call_id`, if one applies, and whether the
    workflow has taken it (`False` while the call is still published as pending). A record of an earlier pause whose
    call had the same id (its `requested_at` differs from the waiting call's) does not apply."""
    record = (getattr(status, 'attributes', None) or {}).get(DECISION_ATTRIBUTE + call_id)
    if not isinstance(record, dict):
        return None, None
    record = dict(record)
    requested_at = record.pop('requested_at', None)
    waiting = next((c for c in pending if c.call_id == call_id), None)
    if waiting is not None and waiting.requested_at != requested_at:
        return None, None
    return Decision.from_json(record), (False if waiting is not None else None)


def _missing_sqlite_file(settings: Mapping[str, Any]) -> str | None:
    """The path of the SQLite system database `settings` name (`system_database_file`) when that file does not exist:
    nothing has run there. Reading commands ask this first, so that they neither create an empty file at a mistyped
    path (as opening it would) nor report DBOS's missing tables as an error."""
    path = system_database_file(settings.get('db'))
    return str(path) if path is not None and not path.exists() else None


def _no_dbos_tables(exc: BaseException) -> bool:
    """Whether `exc` says the system database has no DBOS tables (DBOS never launched on it): SQLite's `no such
    table`, PostgreSQL's undefined table (`ProgrammingError`). A database that cannot be reached is not this."""
    return isinstance(exc, ProgrammingError) or (isinstance(exc, OperationalError) and 'no such table' in str(exc))


def _unreachable(exc: BaseException, settings: Mapping[str, Any]) -> BaseException:
    """`exc` as the `RuntimeError` the CLI reports in one line (`cannot reach dbos: ...`) when it is a database error
    (SQLAlchemy's: the system database is down or refuses the connection); any other error unchanged."""
    if not isinstance(exc, SQLAlchemyError):
        return exc
    return RuntimeError(f'the system database {_db_label(settings)} cannot be read: {database_error_line(exc)}')


def _db_label(settings: Mapping[str, Any]) -> str:
    return redact_database_url(settings.get('db') or 'sqlite:///.durcap/dbos.sqlite')
