"""`durcap runs list|show|resume|cancel`: the durable runs each engine recorded.

Every operation is the engine adapter's (`EngineAdapter.list_runs / show_run / resume / cancel`); this module
looks adapters up by name and never names an engine.
"""

from __future__ import annotations

import asyncio
import json
import sys
from enum import Enum
from typing import Annotated, Any

import typer
from rich.table import Column, Table
from rich.text import Text

from .. import telemetry
from .._limits import INPUT_CODE, one_line, printable, redact_database_url
from ..errors import NOT_FOUND_CODE, DurcapError, one_code
from ..settings import Settings
from ..store import resolve_url
from ..targets import TARGET_HELP
from . import _err, _out, _unusable, _valid_agents, app, engine_metavar, engine_name
from ._options import StoreOption, connection_options, connection_settings
from .engine_commands import BaseUrlOption

runs_app = typer.Typer(help='Find, resume and cancel durable runs on every engine.', no_args_is_help=True)
app.add_typer(runs_app, name='runs')


class RunsFormat(str, Enum):
    text = 'text'
    json = 'json'


def _engine_option() -> Any:
    return typer.Option('--engine', '-e', parser=engine_name(durable_only=True), metavar=engine_metavar(True),
                        help='The engine (default: every installed durable engine).')


FormatOption = Annotated[RunsFormat, typer.Option('--format', help='text, or json (one object per run).')]


def _engine_list(engine: str | None) -> list[str] | None:
    """`[engine]` after checking it is installed (exit 2 otherwise), or `None` for every installed engine."""
    from ..reading import EngineNotInstalled, durable_adapters

    if engine is not None:
        try:
            durable_adapters(engine)
        except EngineNotInstalled as exc:
            _unusable(str(exc))
        return [engine]
    return None


_COLUMN_OPTIONS: dict[str, dict[str, Any]] = {
    'id': {'no_wrap': True}, 'engine': {'no_wrap': True}, 'agent': {'no_wrap': True}, 'status': {'no_wrap': True},
    'started (UTC)': {'min_width': 10}, 'capabilities loaded': {'min_width': 6}, 'conversation': {'min_width': 5},
    'units done': {'min_width': 5}, 'held by': {'min_width': 5},
}
"""The columns of `runs list` (in display order) and the labels of `runs show`, one per value of `_row`."""

_LABELS = tuple(_COLUMN_OPTIONS)


def _row(info: Any) -> list[str]:
    started = info.started_at.strftime('%Y-%m-%d %H:%M:%S') if info.started_at else '-'
    units = '-' if info.units_done is None else str(info.units_done)
    return [printable(cell) for cell in (info.run_id, info.engine, info.agent or '-', info.status, started,
                                         ', '.join(info.capabilities) or '-', info.conversation_id or '-', units,
                                         _held_by(info))]


def _held_by(info: Any) -> str:
    """Where the run is held: the DBOS executor running it (its queue while it waits), the Temporal task queue, or
    `-` (Prefect: the serving process is not recorded on the run)."""
    detail = info.detail or {}
    if detail.get('executor_id'):
        return f'executor {detail["executor_id"]}'
    if detail.get('queue'):
        return f'queue {detail["queue"]}'
    if detail.get('task_queue'):
        return f'task queue {detail["task_queue"]}'
    return '-'


def _print_runs(infos: list[Any], fmt: RunsFormat) -> None:
    if fmt is RunsFormat.json:
        for info in infos:
            _out.print(json.dumps(info.to_json(), default=str), markup=False)
        return
    # The run id is what `runs show/resume/cancel` take: never cut it, whatever the terminal width. On a narrow
    # terminal (80 columns) the long headers and values wrap onto more lines; the short columns keep their width.
    # (Built in display order: rich pads a column by its place when it was added, so moving one afterwards cut cells.)
    id_width = max((len(str(i.run_id)) for i in infos), default=2)
    table = Table(*(Column(label, **({'min_width': id_width} if label == 'id' else {}), **_COLUMN_OPTIONS[label])
                    for label in _LABELS), box=None, pad_edge=False)
    for info in infos:
        table.add_row(*map(Text, _row(info)))
    if _out.is_terminal:
        _out.print(table)
        return
    # Piped (grep, awk, a file): one row a line, no cell cut or folded, at the table's own width (at the console's
    # 160 columns a long conversation id or executor name was cut to `conversation-w…` and the row folded in two).
    from rich.measure import Measurement

    natural = Measurement.get(_out, _out.options.update_width(1 << 20), table).maximum
    saved = _out.width
    _out.width = max(saved, natural)
    try:
        with _out.capture() as captured:
            _out.print(table)
    finally:
        _out.width = saved
    # each line without the padding rich puts after its last cell (spaces a `cut` or `awk '{print $NF}'` would see)
    _out.out('\n'.join(line.rstrip() for line in captured.get().splitlines()), highlight=False)


@runs_app.command('list')
@connection_options('read')
def list_runs(
    engine: Annotated[str | None, _engine_option()] = None,
    status: Annotated[str | None, typer.Option(help='running, queued, orphaned (its process is gone: `runs resume` it), completed, failed or cancelled.')] = None,
    limit: Annotated[int, typer.Option(help='At most this many runs per engine, newest first.', min=1)] = 20,
    fmt: FormatOption = RunsFormat.text,
    store: StoreOption = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """List durcap runs: id, agent, status, start time, capabilities loaded, conversation, durable units done,
    and where each is held (DBOS executor, Temporal task queue)."""
    from ..engines import RUN_STATUSES

    if status is not None and status not in RUN_STATUSES:
        _unusable(f'--status must be one of {", ".join(RUN_STATUSES)}, not {status!r}')
    from ..reading import list_runs as read_runs

    listing = asyncio.run(read_runs(connection_settings(conn or {}, store), engines=_engine_list(engine),
                                    status=status, limit=limit))
    for note in listing.notes:
        _err.print(printable(f'note: {note}'), markup=False)
    # An engine that could not be read: an error when it was the one asked for (exit 2), else a warning (the other
    # engines' runs are listed, exit 0).
    level = 'error' if engine is not None else 'warning'
    for problem in listing.problems:  # an error leads with its code (DC040 when it has none of its own)
        _err.print(printable(f'durcap: {level}: {one_code(problem, INPUT_CODE) if engine is not None else problem}'),
                   markup=False)
    if listing.runs or not listing.problems:  # no empty table under an engine that could not be read
        _print_runs(listing.runs, fmt)
    if listing.problems and engine is not None:
        raise typer.Exit(2)


def _find(run_id: str, engine: str | None, settings: Settings) -> tuple[Any, Any]:
    """(adapter, RunInfo) of the run; every installed engine is asked when `engine` is None (exit 2 when none has it)."""
    from ..engines import RunNotFoundError
    from ..reading import find_run

    try:
        _engine_list(engine)  # exit 2 when the engine is not installed
        return asyncio.run(find_run(run_id, settings, engine))
    except RunNotFoundError as exc:
        problems = exc.args[1] if len(exc.args) > 1 else []
        if engine is not None and len(problems) == 1:
            _unusable(problems[0])  # the one engine asked says why, in one line
        for problem in problems:
            _err.print(printable(problem), markup=False)
    _unusable(f'{NOT_FOUND_CODE} no run {run_id!r} found'
              + ('' if engine else ' on any engine (pass --engine and its connection options)'))


@runs_app.command('show')
@connection_options('read')
def show(
    run_id: Annotated[str, typer.Argument(help='The run id (workflow id, flow run id).')],
    engine: Annotated[str | None, _engine_option()] = None,
    fmt: FormatOption = RunsFormat.text,
    store: StoreOption = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Show one run: status, start time, capabilities loaded, conversation, durable units done, and what to do."""
    _, info = _find(run_id, engine, connection_settings(conn or {}, store))
    if fmt is RunsFormat.json:
        _out.print(json.dumps({**info.to_json(), 'trace_id': telemetry.trace_id(info.run_id)}, default=str),
                   markup=False)
        return
    for label, value in zip(_LABELS, _row(info), strict=True):
        _out.print(f'{label}: {value}', markup=False)
    _out.print(printable(f'engine status: {info.engine_status}'), markup=False)
    link = telemetry.trace_link(info.run_id)
    _out.print(printable(f'trace id: {telemetry.trace_id(info.run_id)}' + (f' ({link})' if link else '')), markup=False)
    for key, value in info.detail.items():
        if value not in (None, '', False):
            _out.print(printable(f'{key}: {value}'), markup=False)
    for note in info.notes:
        _out.print(printable(f'note: {note}'), markup=False)


@runs_app.command('cancel')
@connection_options('read')
def cancel(
    run_id: Annotated[str, typer.Argument(help='The run id.')],
    engine: Annotated[str | None, _engine_option()] = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Cancel a run on its engine and print its status afterwards."""
    settings = connection_settings(conn or {})
    adapter, _ = _find(run_id, engine, settings)
    info = asyncio.run(adapter.cancel(run_id, settings.engine()))
    _out.print(printable(f'{info.run_id}: {info.status} ({info.engine_status})'), markup=False)


@runs_app.command('resume')
@connection_options('read')
def resume(
    run_id: Annotated[str, typer.Argument(help='The run id.')],
    target: Annotated[str | None, typer.Option('--target', help=TARGET_HELP + ' The definition the run was started '
                                               'from: its code runs the rest of the run.')] = None,
    engine: Annotated[str | None, _engine_option()] = None,
    build_id: Annotated[str | None, typer.Option('--build-id', help='Temporal: the build id a run is pinned to, when '
                                                 'its worker was given one by hand (--build-id); TARGET is served as '
                                                 'that version. Derived build ids need no flag.')] = None,
    store: StoreOption = None,
    model: Annotated[str | None, typer.Option(help="The pydantic-ai model name the run was started with by `durcap run "
                                                   "--model`, replacing TARGET's model for the rest of the run "
                                                   '(needs --target; a run is not given a second model silently).')] = None,
    base_url: BaseUrlOption = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Finish a run whose process died, without repeating a completed durable unit, and print its answer."""
    from ..engines import RunOptions
    from ..store import StoreError
    from .engine_commands import _approvals_settings, _print_run, _watch_approvals, check_model, point_model

    if (model or base_url) and not target:
        _unusable(f'{INPUT_CODE} --model and --base-url apply to the agent of --target: give --target too')
    settings = connection_settings(conn or {}, store)
    adapter, info = _find(run_id, engine, settings)
    agents = _valid_agents(target, use_lock=True, refused='not resumed: fix the errors above',
                           engine=adapter.name) if target else []
    for agent in agents:
        if model:
            agent.replace_model(model)
        point_model(agent.model, base_url)
    check_model(model)
    start, error = telemetry.run_started(), None
    try:
        engine_settings = {**settings.engine(), 'store': settings.store, **({'build_id': build_id} if build_id else {})}
        # A run that waits (or comes to wait) for a person says so in one line, with the commands that decide it, as
        # `durcap run` does (a resumed run parked on an approval used to wait in silence).
        report = asyncio.run(_watch_approvals(
            lambda _started: adapter.resume(run_id, agents, RunOptions(settings=engine_settings, notify=_err.print)),
            adapter.name, _approvals_settings(adapter.name, engine_settings), started=[run_id]))
    except (RuntimeError, NotImplementedError) as exc:
        error = exc
        _unusable(str(exc).splitlines()[0])
    except StoreError as exc:  # e.g. DC044: the run's turn is in another --store (it printed a traceback, exit 1)
        error = exc
        _unusable(str(exc).splitlines()[0])
    finally:  # this process's part of the run: a child of the run's root, in the run's trace
        telemetry.record_run(run_id, agent=info.agent or '', engine=adapter.name, conversation_id=info.conversation_id,
                             start_ns=start, error=error, name='durcap.resume', resumed=True)
    _print_run(report)


class WatchFormat(str, Enum):
    text = 'text'
    jsonl = 'jsonl'


def _summary(event: Any) -> str:
    """One line saying what a non-text event is (`durcap runs watch --format text`)."""
    inner = event.event
    if event.kind == 'tool_call' and inner is not None:
        return f'{inner.part.tool_name}({inner.part.args_as_json_str()})'
    if event.kind == 'tool_result' and inner is not None:
        return f'{inner.part.tool_name} -> {one_line(str(inner.part.content))[:200]}'
    if event.kind == 'retry':
        return f'{event.unit} attempt {event.attempt}: discard attempts {event.data.get("discard_attempts")}'
    if event.kind == 'model_event' and inner is not None:
        return type(inner).__name__
    return one_line(json.dumps(event.data, default=str))[:300]


WATCH_NOTICE_SECONDS = 2.0
"""`durcap runs watch` says it is waiting when a run has published nothing within this many seconds (a wrong run id or
--store otherwise waited the whole --wait, 30 s by default, in silence)."""


@runs_app.command('watch')
def watch_run(
    run_id: Annotated[str, typer.Argument(help='The run id (workflow id, flow run id, local-...).')],
    from_offset: Annotated[int, typer.Option('--from', min=0, help='The offset of the last event already seen: only '
                                             'later events are printed (0: from the first).')] = 0,
    fmt: Annotated[WatchFormat, typer.Option('--format', help='text (the answer as it streams, one line per other '
                                             'event), or jsonl (one RunEvent JSON object per line).')] = WatchFormat.text,
    engine: Annotated[str | None, typer.Option('--engine', '-e', parser=engine_name(durable_only=False),
                                               metavar=engine_metavar(False),
                                               help='The engine the run is on (default: any); a run of another engine is '
                                               'refused, exit 2.')] = None,
    store: StoreOption = None,
    follow: Annotated[bool, typer.Option('--follow/--no-follow', help='Wait for new events until the run ends '
                                         '(default), or print what the store retains now.')] = True,
    wait: Annotated[float, typer.Option('--wait', min=0, help='Seconds to wait for a run that has published nothing '
                                        'yet.')] = 30.0,
) -> None:
    """Print a run's events as it publishes them: those the store retains first, then each new one once, until the
    run completes or fails (docs/watching.md)."""
    from .. import streams
    from ..store import StoreError

    url = connection_settings({}, store).store
    seen: list[bool] = []

    async def say_waiting() -> None:
        await asyncio.sleep(WATCH_NOTICE_SECONDS)
        if not seen:
            _err.print(printable(f'durcap: run {run_id!r} has published no event to {redact_database_url(url)} yet; waiting up to '
                                 f'{wait:g} s in all (--wait) ...'), markup=False)

    async def follow_run() -> None:
        notice = asyncio.create_task(say_waiting()) if wait > WATCH_NOTICE_SECONDS else None
        try:
            await print_events()
        finally:
            if notice is not None:
                notice.cancel()

    async def print_events() -> None:
        mid_line = False  # text deltas printed since the last newline: the next event's line starts on a new one
        async for event in streams.watch(run_id, engine=engine, from_offset=from_offset, store=url, follow=follow,
                                         wait_for_start=wait):
            seen.append(True)
            if fmt is WatchFormat.jsonl:
                sys.stdout.write(event.model_dump_json() + '\n')
            elif event.kind == 'text_delta':
                text = printable(event.text, keep_newlines=True)
                sys.stdout.write(text)
                mid_line = (mid_line or bool(text)) and not text.endswith('\n')
            else:  # one line per event, no blank line between two (each was preceded by an empty line)
                newline = '\n' if mid_line else ''
                sys.stdout.write(f'{newline}[{event.offset}] {event.kind} {printable(_summary(event))}\n')
                mid_line = False
            sys.stdout.flush()

    try:
        asyncio.run(follow_run())
    except (streams.StreamNotFoundError, streams.StreamUnsupportedError, StoreError, ValueError) as exc:
        _unusable(str(exc))  # StoreError: a store that is down or missing (it printed its traceback, exit 1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if not seen and from_offset > 0:  # nothing after --from: say so (it printed nothing and exited 0, as if lost)
        _err.print(printable(f'durcap: run {run_id!r} has no event after offset {from_offset}'
                             + (' (the run has ended; --from 0 prints all its events)' if follow else
                                ' retained now (--follow waits for more)')), markup=False)


@runs_app.command('fork')
@connection_options('run')
def fork(
    run_id: Annotated[str, typer.Argument(help='A finished or failed run that kept a conversation.')],
    target: Annotated[str, typer.Option('--target', help=TARGET_HELP + ' The definition the new run runs.')],
    engine: Annotated[str | None, _engine_option()] = None,
    on: Annotated[str | None, typer.Option('--on', help="The engine of the new run (default: the run's own).")] = None,
    to: Annotated[str | None, typer.Option('--to', help='The new conversation id (default: {conversation}-fork-{n}).')] = None,
    prompt: Annotated[str | None, typer.Option('--prompt', help="The new run's prompt (default: the prompt of the "
                                               "run's stored turn; a failed run's turn was not stored: give one).")] = None,
    deps_json: Annotated[str | None, typer.Option('--deps-json', help="The new run's deps as JSON.")] = None,
    store: StoreOption = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Start a new run from the conversation of a finished or failed run as it was before that run's turn: the
    conversation is forked there (`durcap history fork`, messages shared) and the new run continues the fork.

    Exit 2, nothing written, for a run still in flight, a run without a conversation, or a failed run without --prompt.
    """
    from ..forks import ForkError, fork_at_turn, run_turn_of
    from ..store import SQLConversationStore
    from . import engine_commands

    settings = connection_settings(conn or {}, store)
    _, info = _find(run_id, engine, settings)
    # The target first: a definition that cannot continue the run refuses before the fork is written.
    agents = _valid_agents(target, use_lock=True, refused='not forked: fix the errors above')
    if info.agent is not None and info.agent not in {a.name for a in agents} | {
            n for a in agents for n in a.previous_names}:
        _unusable(f'run {run_id!r} is a run of agent {info.agent!r}, which --target {target!r} does not define '
                  f'(it defines {", ".join(sorted(a.name for a in agents))}): give the target of that agent')
    if info.status not in ('completed', 'failed', 'cancelled'):
        _unusable(f'run {run_id!r} is {info.status}: fork a finished or failed run (`durcap runs show {run_id}`)')
    if not info.conversation_id:
        _unusable(f'run {run_id!r} kept no conversation (it ran without --conversation): there is nothing to fork')
    url = resolve_url(store)

    async def do_fork() -> tuple[Any, str, str | None]:
        async with SQLConversationStore(url, create=False) as opened:
            place = await run_turn_of(opened, info.conversation_id, run_id, info.started_at)
            if place.before < 1:
                raise ForkError(f'run {run_id!r} ran the first turn of {info.conversation_id!r}: start a new '
                                'conversation instead (`durcap run --conversation NEW`)')
            new_id = to
            if new_id is None:  # `{conversation}-fork-{n}`: the first n whose conversation is not stored yet
                n = 1
                while await opened.read_record(f'{info.conversation_id}-fork-{n}') is not None:
                    n += 1
                new_id = f'{info.conversation_id}-fork-{n}'
            return await fork_at_turn(opened, info.conversation_id, place.before, new_id), new_id, place.prompt

    if prompt is None and info.status != 'completed':
        _unusable(f"run {run_id!r} {info.status}: its turn was not stored, so its prompt is unknown: give --prompt")
    try:
        forked, new_id, stored_prompt = asyncio.run(do_fork())
    except DurcapError as exc:
        _unusable(str(exc))
    _err.print(printable(f'forked {forked.source_id} at turn {forked.turns} of {forked.source_turns} into {new_id} '
                         f'({forked.messages} messages shared)'), markup=False)
    the_prompt = prompt if prompt is not None else stored_prompt
    if the_prompt is None:
        _unusable(f"run {run_id!r}: its stored turn has no text prompt: give --prompt (the fork {new_id} is stored)")
    engine_commands.run(target=target, prompt=the_prompt, engine=on or info.engine, deps_json=deps_json,
                        conversation=new_id, store=store, model=None, base_url=None, stream=False, busy=None,
                        **(conn or {}))
