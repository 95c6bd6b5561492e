"""`durcap approvals list`, `durcap approve`, `durcap deny`: decide on tool calls waiting for a person.

Exit codes: 0 done, 2 unknown run or call, a call already decided (DC054, kind `already-decided`), or a stale
fingerprint (nothing was delivered).
"""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import Annotated, Any, NoReturn

import typer
from rich.table import Table
from rich.text import Text

from .._limits import INPUT_CODE, InputError, load_json, printable
from ..approvals import ApprovalError, PendingCall, decision_wait
from ..engines import DEFAULT_ENGINE, get
from ..errors import one_code
from . import _err, _out, app, engine_metavar, engine_name
from ._options import connection_options, connection_settings

approvals_app = typer.Typer(help='Tool calls waiting for a person in durable runs.', no_args_is_help=True)
app.add_typer(approvals_app, name='approvals')


class _Format(str, Enum):
    text = 'text'
    json = 'json'


EngineOpt = Annotated[str, typer.Option('--engine', metavar=engine_metavar(), parser=engine_name(),
                                        help='The engine the run waits on.')]


def _settings(conn: dict[str, Any] | None) -> dict[str, Any]:
    """The engine settings (`settings.Settings.engine()`) of the flags given."""
    return connection_settings(conn or {}).engine()


@approvals_app.command('list')
@connection_options('read')
def list_approvals(
    engine: EngineOpt = DEFAULT_ENGINE,
    run_id: Annotated[str | None, typer.Option('--run', help='Only this run.')] = None,
    output_format: Annotated[_Format, typer.Option('--format', help='text (a table) or json.')] = _Format.text,
    conn: dict[str, Any] | None = None,
) -> None:
    """List the calls waiting for a decision: run, agent, conversation, tool, arguments, requested at, deadline.

    A table when it fits the terminal, else one block per call, a field per line."""
    from .. import runner

    settings = _settings(conn)  # exits 2 on a bad --db before any engine is asked
    if (note := get(engine).listing_note(settings)) is not None:
        _err.print(printable(f'note: {note}'), markup=False)
    try:
        calls: list[PendingCall] = asyncio.run(runner.approvals(run_id, engine=engine, **settings))
    except (OSError, RuntimeError) as exc:  # the engine's server or database cannot be reached
        _unreachable(engine, exc)
    if output_format is _Format.json:
        _out.print(json.dumps([c.to_json() for c in calls], indent=2), markup=False)
        _resume_note(calls)  # on stderr: stdout stays one JSON document
        return
    if not calls:
        _out.print('no calls waiting for approval')
        return
    decided = any(c.decided for c in calls)
    headers = ('run', 'call', 'agent', 'conversation', 'tool', 'arguments', 'fingerprint', 'requested at', 'deadline')
    headers += ('decided, not yet received',) if decided else ()
    rows = [[printable(cell) for cell in (
        c.run_id, c.call_id, c.agent, c.conversation_id or '-', c.tool_name, json.dumps(c.args, sort_keys=True),
        c.fingerprint[:12], c.requested_at, c.deadline) + ((c.decided or '-',) if decided else ())] for c in calls]
    # A table when every cell fits on one line (three characters of border and padding per column); else one block
    # per call, a field per line, which stays readable at any width (a table folded to 80 columns is not).
    fits = sum(max(len(h), *(len(r[i]) for r in rows)) + 3 for i, h in enumerate(headers)) + 1 <= _out.width
    if fits:
        table = Table()
        for header in headers:
            table.add_column(header, no_wrap=True)
        for row in rows:
            table.add_row(*(Text(cell) for cell in row))
        _out.print(table)
    else:
        label = max(len(h) for h in headers)
        for n, row in enumerate(rows):
            if n:
                _out.print('')
            for header, cell in zip(headers, row, strict=True):
                _out.print(Text(f'{header:<{label}}  {cell}'), overflow='fold')
    _resume_note(calls)


def _resume_note(calls: list[PendingCall]) -> None:
    """A note on stderr when a listed call is decided but not yet received (`PendingCall.decided`): its run waits for
    a process (DBOS: the one that ran it is gone) and `durcap runs resume` gives it one."""
    if any(c.decided for c in calls):
        _err.print('note: a call decided but not yet received waits for its run to run again (`durcap runs list '
                   '--status orphaned`, then `durcap runs resume RUN_ID`)', markup=False)


def _unreachable(engine: str, exc: BaseException) -> NoReturn:
    """One line naming the engine and the whole first line of its error (the driver's reason comes last in it, e.g.
    `database "x" does not exist`: never cut), no traceback, exit 2."""
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    where = get(engine).spec.where  # what says where the engine is (`EngineSpec.where`)
    hint = f' (check {where})' if where is not None and where not in detail else ''
    _err.print(printable(f'durcap: error: {one_code(f"cannot reach {engine}: {detail}{hint}", INPUT_CODE)}'),
               markup=False)
    raise typer.Exit(2)


def _decide(engine: str, run_id: str, call_id: str, settings: dict[str, Any], **kwargs: Any) -> None:
    from .. import runner

    try:
        decision_wait()  # refuse an unusable $DURCAP_DECISION_WAIT before anything is read or sent
        decision = asyncio.run(runner.decide(run_id, call_id, engine=engine, **kwargs, **settings))
    except ApprovalError as exc:
        code = exc.code if exc.code.startswith('DC') else INPUT_CODE  # DC044, DC051, DC052, DC054, DC055
        _err.print(printable(f'durcap: error: {one_code(f"{exc} ({exc.kind})", code)}'), markup=False)
        raise typer.Exit(2) from None
    except InputError as exc:  # an unusable setting ($DURCAP_DECISION_WAIT): nothing was sent
        _err.print(printable(f'durcap: error: {one_code(str(exc), exc.code)}'), markup=False)
        raise typer.Exit(2) from None
    except (OSError, RuntimeError) as exc:  # the engine's server or database cannot be reached
        _unreachable(engine, exc)
    verb = 'approved' if decision.approve else 'denied'
    _out.print(printable(f'{verb} call {call_id} of run {run_id} (fingerprint {decision.fingerprint[:12]}, '
                         f'by {decision.by})'), markup=False)


@app.command()
@connection_options('read')
def approve(
    run_id: Annotated[str, typer.Argument(help='The waiting run (workflow id, flow run id).')],
    call_id: Annotated[str, typer.Argument(help='The call (see `durcap approvals list`).')],
    engine: EngineOpt = DEFAULT_ENGINE,
    args: Annotated[str | None, typer.Option('--args', help='JSON object: run the call with these arguments.')] = None,
    fingerprint: Annotated[str | None, typer.Option(help='The fingerprint you reviewed (refused when the call '
                                                         'changed); default: the pending one.')] = None,
    by: Annotated[str | None, typer.Option(help='Who decides (default: the OS user).')] = None,
    reason: Annotated[str | None, typer.Option(help='Why (stored in the audit).')] = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Approve a waiting call: the run executes it (once) and continues."""
    override = None
    if args is not None:
        try:
            override = load_json(args, where='--args')
        except InputError as exc:
            _err.print(f'durcap: error: {one_code(str(exc), exc.code)}', markup=False)
            raise typer.Exit(2) from None
        if not isinstance(override, dict):
            _err.print(f'durcap: error: {INPUT_CODE} --args must be a JSON object of the tool\'s arguments, '
                       'e.g. \'{"user": "alice"}\'', markup=False)
            raise typer.Exit(2)
    _decide(engine, run_id, call_id, _settings(conn), approve=True, reason=reason,
            override_args=override, by=by, fingerprint_=fingerprint)


@app.command()
@connection_options('read')
def deny(
    run_id: Annotated[str, typer.Argument(help='The waiting run (workflow id, flow run id).')],
    call_id: Annotated[str, typer.Argument(help='The call (see `durcap approvals list`).')],
    reason: Annotated[str, typer.Option('--reason', help='Returned to the model as the call\'s result.')],
    engine: EngineOpt = DEFAULT_ENGINE,
    fingerprint: Annotated[str | None, typer.Option(help='The fingerprint you reviewed; default: the pending one.')] = None,
    by: Annotated[str | None, typer.Option(help='Who decides (default: the OS user).')] = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Deny a waiting call: it never runs; the model receives the reason."""
    _decide(engine, run_id, call_id, _settings(conn), approve=False, reason=reason, by=by,
            fingerprint_=fingerprint)
