"""`durcap`: check and lock definitions, run them on any engine, resume conversations, replay histories.

Exit codes (every command): 0 clean, 1 the definition has errors, 2 the target is unusable (malformed
TARGET, the module does not import, the attribute is missing or of the wrong type). An unusable target
prints one line on stderr, never a traceback.
"""

from __future__ import annotations

import gc

# The command's process keeps what is imported so far (pydantic-ai: ~900 modules, a few hundred thousand objects)
# until it exits: moved to the permanent generation, the cyclic collector stops scanning it again. Measured: one
# full collection during the CLI's own imports cost ~0.06 s of the ~0.18 s they take (issue 14, item 5).
gc.freeze()

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from .. import _upstream, telemetry
from .._limits import (
    INPUT_CODE,
    is_digits,
    one_line,
    postgres_connect_fix,
    postgres_database_missing,
    printable,
    redact_database_url,
)
from ..agent import DurableAgent
from ..engines import ALL_ENGINES, DURABLE_ENGINES, specs
from ..errors import DurcapError, one_code
from ..lockfile import LockfileError
from ..savings import UNKNOWN_TOOLS, SavingsReport, measure_savings
from ..store import on_create as on_store_create
from ..targets import TARGET_HELP, UnusableTarget, apply_lock, check_lock, load, load_checked
from ..validation import DurableConfigError, Report


class _OneLineUsageGroup(TyperGroup):
    """The `durcap` command group: a flag or argument typer refuses (an unknown option or command, a value of the wrong
    type or out of range, a missing argument or option) is one `durcap: error: DC040 ...` line and exit 2, as every
    other unusable input, instead of the usage text and a boxed message (a fresh-user trial: `durcap serve
    --keepalive -3` printed five lines and no code). `durcap` or a command group given nothing still prints its help."""

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        """The context for `args`; a usage error while parsing them is one coded line, exit 2."""
        usage, no_args = _upstream.typer_usage_errors()
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except usage as exc:
            if isinstance(exc, no_args):
                raise
            _usage_error(exc)

    def invoke(self, ctx: Any) -> Any:
        """Run the subcommand; a usage error in its arguments (parsed here) is one coded line, exit 2."""
        usage, no_args = _upstream.typer_usage_errors()
        try:
            return super().invoke(ctx)
        except usage as exc:
            if isinstance(exc, no_args):
                raise
            _usage_error(exc)


def _usage_error(exc: Exception) -> NoReturn:
    """Print typer's refusal as `durcap: error: DC040 <message> (see `COMMAND --help`)` and exit 2; a code the message
    carries (a DC040 an option's parser wrote) leads instead of a second one."""
    ctx = getattr(exc, 'ctx', None)
    where = f' (see `{ctx.command_path} --help`)' if ctx is not None else ''
    message = exc.format_message() if hasattr(exc, 'format_message') else str(exc)  # pyright: ignore[reportAttributeAccessIssue]
    _unusable(f'{message}{where}')


app = typer.Typer(
    name='durcap',
    cls=_OneLineUsageGroup,
    help='Durable on-demand capabilities: check and lock definitions, run them on Temporal, DBOS and Prefect, '
    'resume conversations, replay histories.',
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Piped output is not wrapped at 80 columns: a table keeps its rows on one line each.
_out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _store_created(path: str) -> None:
    """Say where a new conversation store went (once: when this process creates its file), so a run from an
    unexpected folder does not fill a `.durcap/` there unnoticed."""
    _err.print(Text(f'durcap: created the conversation store {one_line(path)} (--store or $DURCAP_STORE choose '
                    'another)'))


on_store_create(_store_created)


def engine_name(durable_only: bool = True) -> Any:
    """A `parser=` for `--engine`: the value must name a registered engine, read when the command runs
    (`engines.register` can add one after this module was imported).

    Raises:
        typer.BadParameter: the value names no registered engine (DC040, exit 2, the engines it can name).
    """

    def parse(value: str) -> str:
        names = tuple(DURABLE_ENGINES if durable_only else ALL_ENGINES)
        if value not in names:
            raise typer.BadParameter(f'{INPUT_CODE} {printable(repr(value))} is not one of {", ".join(map(repr, names))}.')
        return value

    return parse


def engine_metavar(durable_only: bool = True) -> str:
    """`<a|b|c>`: the engines registered when the CLI was imported, for `--help`."""
    return '<' + '|'.join(DURABLE_ENGINES if durable_only else ALL_ENGINES) + '>'


class CheckFormat(str, Enum):
    text = 'text'
    json = 'json'
    github = 'github'


class SavingsFormat(str, Enum):
    text = 'text'
    json = 'json'


def _unusable(message: str) -> NoReturn:
    """Print `durcap: error: <CODE> <message>` (one line, control and bidi characters escaped) and exit 2.

    The line leads with one code (`errors.one_code`): the message's own (`DC044 ...` for an id that names nothing),
    else `DC040` (unusable input)."""
    _err.print(Text(f'durcap: error: {one_code(one_line(message), INPUT_CODE)}'))
    raise typer.Exit(2)


_MEMORY = (None, '', ':memory:')


def _option_env(option: str) -> str | None:
    """The environment variable a database option falls back to (checked the same way when the option is absent):
    `$DURCAP_STORE` for `--store`, else the first variable of the engine setting named `option` (`engines.EngineSpec`)."""
    if option == '--store':
        return 'DURCAP_STORE'
    return next((s.env[0] for spec in specs() for s in spec.settings if s.option == option and s.env), None)


def temporal_address(value: str | None, option: str = '--address') -> str | None:
    """A Temporal frontend address checked before anything connects: `HOST:PORT` with a port in 1-65535 and no
    scheme (temporalio's `Client.connect` takes `host:port`; a URL only gets a warning there). `None` stays `None`.

    Exits 2 (code DC040) naming the option and the fix otherwise.
    """
    if value is None or value == '':
        return value or None
    shown = printable(repr(value))[:200]
    fix = 'give HOST:PORT, e.g. 127.0.0.1:7233'
    if '://' in value:
        _unusable(f'{INPUT_CODE} {option} {shown} has a scheme: {fix}')
    host, sep, port = value.rpartition(':')
    if not sep or not host.strip('[]') or not is_digits(port) or not 1 <= int(port) <= 65535:
        _unusable(f'{INPUT_CODE} {option} {shown} is not HOST:PORT with a port in 1-65535: {fix}')
    return value


def database_url(value: str | None, option: str, *, probe: bool = False, missing_ok: bool = False) -> str | None:
    """A `--store` / `--db` value checked before anything uses it: None stays None (the default applies).

    Args:
        value: The option's value.
        option: Its name, for the message.
        probe: Connect to a PostgreSQL URL once (5 s timeout), so an unreachable server is one line here
            instead of an engine's traceback later; a server that answers without the URL's database is one line
            naming it and `createdb` (`postgres_connect_fix`).
        missing_ok: With `probe`, a server that answers without the URL's database passes (`durcap worker dbos`:
            DBOS creates its system database at launch). Nothing here ever creates it.

    Without the option, the environment variable it falls back to (`$DURCAP_STORE`, `$DURCAP_DBOS_DB`) is checked
    the same way, and `None` is returned (the variable applies).

    Exits 2 (code DC040) when the value is empty, not a `sqlite:///` or `postgresql://` URL, an in-memory SQLite
    database (gone when the command exits: a run's conversation or workflow would be lost), a SQLite file that is a
    folder or cannot be created (`_sqlite_file_problem`: `sqlite:////proc/x.db`, a read-only folder), or (with
    `probe`) a PostgreSQL server that cannot be reached.
    """
    if value is None:
        env = _option_env(option)
        if env is not None and os.environ.get(env):  # empty: unset, the built-in default applies
            database_url(os.environ[env], f'${env} (the default of {option})', probe=probe, missing_ok=missing_ok)
        return None
    import sqlalchemy as sa

    shown = printable(repr(redact_database_url(value)))[:200]  # a password, in user info or query, as ***
    fix = 'give sqlite:///path/to/file.db or postgresql://user@host:5432/database, or leave the option out'
    if not value.strip():
        _unusable(f'{INPUT_CODE} {option} is empty: {fix}')
    try:
        url = sa.make_url(value.replace('postgres://', 'postgresql://', 1))
    except Exception:  # noqa: BLE001 - sqlalchemy raises ArgumentError and ValueError for malformed URLs
        _unusable(f'{INPUT_CODE} {option} {shown} is not a database URL: {fix}')
    backend = url.get_backend_name()
    example = 'sqlite:///.durcap/dbos.sqlite' if option.endswith('--db') or option.endswith('--db)') else \
        'sqlite:///.durcap/conversations.db'
    if backend == 'sqlite' and url.database in _MEMORY:
        # `sqlite://name.db` (two slashes) names a host, not a file: SQLAlchemy then opens an in-memory database.
        meant = f' (did you mean sqlite:///{url.host}?)' if url.host else ''
        _unusable(f'{INPUT_CODE} {option} {shown} is an in-memory SQLite database, gone when this command exits{meant}: '
                  f'give a file, e.g. {example}')
    if backend not in ('sqlite', 'postgresql'):
        _unusable(f'{INPUT_CODE} {option} {shown}: scheme {printable(url.drivername)!r} is not supported: {fix}')
    if backend == 'sqlite' and (problem := _sqlite_file_problem(str(url.database))):
        where = 'a new or SQLite file' if problem.endswith(_NOT_SQLITE) else 'a file in a folder you can write'
        _unusable(f'{INPUT_CODE} {option} {shown}: {problem}: give {where}, e.g. {example}')
    if probe and backend == 'postgresql':
        try:
            engine = sa.create_engine(url.set(drivername='postgresql+psycopg'), connect_args={'connect_timeout': 5})
            with engine.connect():
                pass
            engine.dispose()
        except Exception as exc:  # noqa: BLE001 - the driver's reason, one line
            cause = getattr(exc, 'orig', None) or exc
            if missing_ok and postgres_database_missing(url, str(cause)) is not None:
                return value  # the server answers without the database: the engine's worker creates it
            _unusable(f'{INPUT_CODE} {option} {printable(redact_database_url(value))}: cannot connect '
                      f'({type(cause).__name__}: {one_line(str(cause))}); {postgres_connect_fix(url, str(cause))}')
    return value


def _sqlite_file_problem(database: str) -> str | None:
    """Why a SQLite database file cannot be used, or `None`: an existing path that is not a regular file, or a new
    file whose nearest existing folder takes no new file (`/proc`, a read-only mount, no permission); checked by
    creating and removing a temporary file there. An existing file must be empty or begin with SQLite's 16-byte
    header (`SQLite format 3\\0`, https://www.sqlite.org/fileformat.html): `--db sqlite:////etc/passwd` is one line
    here, not the engine's traceback after it started."""
    import tempfile

    path = Path(database)
    if path.exists():
        if not path.is_file():
            return f'{printable(str(path))} is {"a folder" if path.is_dir() else "not a regular file"}'
        return _sqlite_header_problem(path)
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        return f'{printable(str(folder))} is not a folder'
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        return f'cannot create a file in {printable(str(folder))} ({type(exc).__name__}: {one_line(exc.strerror or str(exc))})'
    return None


_SQLITE_HEADER = b'SQLite format 3\x00'
_NOT_SQLITE = "is not a SQLite database (it does not begin with SQLite's header)"


def _sqlite_header_problem(path: Path) -> str | None:
    """Why the existing file `path` is not a SQLite database, or `None` (empty, or SQLite's header)."""
    try:
        with path.open('rb') as file:
            head = file.read(len(_SQLITE_HEADER))
    except OSError as exc:
        return f'cannot read {printable(str(path))} ({type(exc).__name__}: {one_line(exc.strerror or str(exc))})'
    if head and head != _SQLITE_HEADER:
        return f'{printable(str(path))} {_NOT_SQLITE}'
    return None


# ---- check ------------------------------------------------------------------------------------

_STYLE = {'error': 'bold red', 'warning': 'yellow', 'info': 'cyan'}


def _print_text(report: Report, subject: str) -> None:
    for p in report:
        line = Text()
        line.append(f'{p.severity:<7}', style=_STYLE.get(p.severity, ''))
        line.append(f' {p.code} ', style='bold')
        line.append(printable(p.where), style='bold')
        if p.engines:
            line.append(f' [{", ".join(p.engines)}]', style='dim')
        line.append(f': {printable(p.message)} ')
        line.append(f'Fix: {printable(p.fix)}', style='green')
        _out.print(line)
    errors, warnings = len(report.errors), len(report.warnings)
    subject = printable(subject)
    summary = f'{subject}: {errors} error(s), {warnings} warning(s)' if len(report) else f'{subject}: no problems found'
    _out.print(Text(summary, style='bold red' if errors else 'bold green'))


@app.command()
def check(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    engine: Annotated[
        list[str] | None,
        typer.Option('--engine', '-e', parser=engine_name(), metavar=engine_metavar(),
                     help='Only problems affecting these engines (repeatable).'),
    ] = None,
    format: Annotated[CheckFormat, typer.Option('--format', '-f', help='Output format.')] = CheckFormat.text,
    lock: Annotated[Path | None, typer.Option('--lock', help='Compare durable unit names with this lockfile.')] = None,
) -> None:
    """Print every problem of TARGET's definitions; exit 1 on errors, 2 when TARGET is unusable."""
    subject = target
    try:
        loaded = load(target)
        report, subject = loaded.report, loaded.subject
        # The lockfile given, or the one beside TARGET: what a worker and a durable run check at start (with
        # --engine, those engines' names only: no other engine's SDK is imported).
        check_lock(loaded, lock, engines=engine or None)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        report = exc.report
        subject = exc.subject
    except RecursionError:
        _unusable(f'{INPUT_CODE} {printable(target)}: nested too deeply to check (RecursionError)')
    if engine:
        wanted = set(engine)
        report = Report([p for p in report if not p.engines or wanted.intersection(p.engines)])
    if format is CheckFormat.json:
        payload = json.loads(report.to_json())
        payload = {'target': target, 'engines': list(engine or DURABLE_ENGINES), **payload}
        print(json.dumps(payload, indent=2))
    elif format is CheckFormat.github:
        if len(report):
            print(report.to_github())
    else:
        _print_text(report, subject)
    raise typer.Exit(0 if report.ok else 1)


# ---- savings ----------------------------------------------------------------------------------


def _print_savings(result: SavingsReport) -> None:
    unit = 'tokens, estimated' if result.estimated else 'tokens, counted by the model'
    table = Table(title=f'agent {result.agent!r}: what deferral saves per request ({unit})', title_justify='left')
    table.add_column('capability', no_wrap=True)
    for column in ('tools', 'instructions', 'tool schemas', 'always on', 'catalog entry', 'saved'):
        table.add_column(column, justify='right')
    unknown = '?'
    for c in result.capabilities:
        table.add_row(
            Text(c.id),
            str(c.tool_count) if c.tool_count is not None else unknown,
            str(c.instruction_tokens),
            str(c.tool_schema_tokens) if c.tool_schema_tokens is not None else unknown,
            str(c.always_on_tokens),
            str(c.catalog_tokens),
            str(c.saved_tokens),
        )
    t = result.totals()
    table.add_row(
        'TOTAL', str(t['tool_count']), str(t['instruction_tokens']), str(t['tool_schema_tokens']),
        str(t['always_on_tokens']), str(t['catalog_tokens']), str(t['saved_tokens']), style='bold',
    )
    _out.print(table)
    if not result.capabilities:
        _out.print('No deferred capabilities: nothing is saved.')
    for c in result.capabilities:
        if c.not_counted:
            _out.print(Text(f'  {c.id}: not counted: {"; ".join(c.not_counted)}'))
    if not result.complete:
        _out.print(Text(f'? = {UNKNOWN_TOOLS}. Totals leave out what was not counted: they are lower bounds.'))
    if result.estimated:
        note = f'Counts are estimated ({result.method})'
        _out.print(Text(note + (f'; the model was not used: {result.fallback_reason}.' if result.fallback_reason else '.')))
    else:
        _out.print(Text(f'Counted by the model: {result.method}.'))
    first = result.first_request
    if first is None:
        _out.print(Text('The table leaves out the catalog header and the load_capability tool, sent with every request; '
                        f'the first request was not measured: {result.first_request_error}.'))
        return
    _out.print(Text(
        f'Per request: deferral saves {first.saved_tokens} tokens ({first.deferred_tokens} with deferred capabilities '
        f'vs {first.always_on_tokens} with every capability always on, counted on the first request; '
        f'`durcap demo` prints the same figure). The table\'s total ({result.totals()["saved_tokens"]}) is before '
        f'the fixed cost of deferring: the catalog header and the load_capability tool, {result.fixed_cost_tokens} '
        'tokens sent with every request.'
    ))


@app.command()
def savings(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    format: Annotated[SavingsFormat, typer.Option('--format', '-f', help='Output format.')] = SavingsFormat.text,
    estimate: Annotated[
        bool, typer.Option('--estimate', help="Skip the model's token counter (no network); always estimate.")
    ] = False,
) -> None:
    """Per deferred capability: tokens of its instructions and tool schemas against its catalog line."""
    try:
        agents = load_checked(target, use_lock=False).agents
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        _err.print(Text(f'durcap: {str(exc).splitlines()[0]} Run `durcap check {target}` for the list.'))
        raise typer.Exit(1) from None
    results = [measure_savings(agent, use_model=not estimate) for agent in agents]
    if format is SavingsFormat.json:
        print(json.dumps({'target': target, 'agents': [r.to_dict() for r in results]}, indent=2))
    else:
        for result in results:
            _print_savings(result)


# ---- lock -------------------------------------------------------------------------------------


@app.command()
def lock(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    output: Annotated[Path | None, typer.Option(
        '--output', '-o', help="Lockfile to write (default: durable.lock beside TARGET's module file, where "
        'check, run and the workers read it).')] = None,
    measure: Annotated[bool, typer.Option(
        '--measure', help='Also decide, from the tool calls of recorded Temporal runs, which leaf toolsets run as local '
        'activities (every timed call within --threshold); without it the decisions of the lock replaced are kept.')] = False,
    address: Annotated[str | None, typer.Option(help='With --measure: Temporal frontend HOST:PORT (default: '
                                                '$DURCAP_TEMPORAL_ADDRESS or 127.0.0.1:7233).')] = None,
    namespace: Annotated[str, typer.Option(help='With --measure: Temporal namespace.')] = 'default',
    threshold: Annotated[float, typer.Option(help='With --measure: seconds the slowest timed call of a leaf may take '
                                             'for the leaf to run as local activities.', min=0.001, max=60)] = 1.0,
    min_calls: Annotated[int, typer.Option('--min-calls', help='With --measure: timed calls a leaf needs before it is '
                                           'decided (fewer keep the previous decision).', min=1)] = 5,
    recent: Annotated[int, typer.Option('--runs', help='With --measure: most recent closed runs read per agent.',
                                      min=1, max=10_000)] = 50,
) -> None:
    """Write every durable unit name of TARGET (per engine), capability and leaf ids, tool names and versions."""
    from ..lockfile import carry_lock_decisions, dump_lock, lock_data, read_lock

    try:
        loaded = load_checked(target, use_lock=False)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        _print_text(exc.report, exc.subject)
        raise typer.Exit(1) from None
    output = output or loaded.lock_path
    # The lock beside the module holds every agent the module defines, whichever TARGET names (`module.py:one`
    # rewrote it with `one` alone, and `durcap check module.py:two` then failed DC021).
    agents = loaded.module_agents if output == loaded.lock_path and loaded.module_agents else loaded.agents
    data = lock_data(agents)
    if output.is_file():
        try:
            carry_lock_decisions(data, read_lock(output))
        except LockfileError:
            pass  # an unreadable lock is replaced whole, as before
    if measure:
        _measure_into(data, agents, address=address, namespace=namespace, threshold=threshold,
                      min_calls=min_calls, recent=recent)
    try:
        output.write_text(dump_lock(data), encoding='utf-8')
    except OSError as exc:
        _unusable(f'cannot write {output}: {exc.strerror or type(exc).__name__}')
    _err.print(f'wrote {output} ({", ".join(a.name for a in agents)})')


def _measure_into(data: dict[str, Any], agents: list[DurableAgent[Any, Any]], *, address: str | None, namespace: str,
                  threshold: float, min_calls: int, recent: int) -> None:
    """`durcap lock --measure`: time the tool calls of recorded Temporal runs and record the decisions in `data`."""
    import asyncio

    from ..engines import ENGINES
    from ..lockfile import LOCAL_SECTION, MEASURED_SECTION, decide_local_tools

    adapter = ENGINES.get('temporal')
    if adapter is None or not adapter.available():
        _unusable('--measure reads recorded Temporal runs: pip install "durable-capabilities[temporal]"')
    setting = adapter.spec.setting('address')
    from ._options import checked

    settings = {'address': checked(setting, address) if setting is not None else address, 'namespace': namespace}
    measured = [a for a in agents if isinstance(data['agents'][a.name].get('temporal'), dict)]
    try:
        timings = asyncio.run(adapter.measure_tool_calls(measured, settings, recent))
    except DurcapError as exc:
        _unusable(str(exc))
    except Exception as exc:  # noqa: BLE001 - one line for the user, whatever the client raised
        _unusable(f'cannot read recorded runs: {type(exc).__name__}: {one_line(str(exc))}')
    for agent in measured:
        entry = data['agents'][agent.name]['temporal']
        before = set(entry.get(LOCAL_SECTION, []))
        found = timings.get(agent.name, {})
        if not found:
            _err.print(Text(f'{agent.name}: no tool call in its recorded runs on the server (none closed yet, or none '
                            'called a tool): nothing measured'))
        local, notes = decide_local_tools(agent, found, previous=sorted(before), threshold=threshold,
                                          min_calls=min_calls)
        entry[LOCAL_SECTION], entry[MEASURED_SECTION] = local, notes
        for note in notes:
            leaf = note.split(':', 1)[0]
            changed = ' [changed: was local]' if leaf in before and leaf not in local else (
                ' [changed: was not local]' if leaf in local and leaf not in before else '')
            _err.print(Text(f'{agent.name}: {note}{changed}'))


def _valid_agents(
    target: str, *, use_lock: bool = False, lock: Path | None = None, allow_drift: bool = False, refused: str = '',
    engine: str | None = None, decisions: bool = False,
) -> list[DurableAgent[Any, Any]]:
    """Load TARGET's definitions (and, with `use_lock`, compare them with `lock` or the durable.lock beside
    TARGET: with `engine`, that engine's sections only, so no other engine's SDK is imported); print the problems
    and exit 1 on an error (adding the line `refused` on stderr), 2 when TARGET or the lock is unusable. `decisions`
    without `use_lock`: apply the lock's decisions (`targets.apply_lock`) without comparing names."""
    try:
        loaded = load_checked(target, lock=lock, allow_drift=allow_drift, use_lock=use_lock,
                              engines=None if engine is None else (engine,))
        if decisions and not use_lock:
            apply_lock(loaded, lock)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        _print_text(exc.report, exc.subject)
        if refused:
            _err.print(refused)
        raise typer.Exit(1) from None
    if any(p.severity == 'warning' and p.code in ('DC020', 'DC021') for p in loaded.report):
        _print_text(loaded.report, loaded.subject)  # drift allowed: still shown
    return loaded.agents


def _telemetry_from_env() -> None:
    """Export traces and metrics when the `OTEL_*` variables ask for it (`telemetry.configure_from_env`); an unusable
    value is one line on stderr (DC040) and exit code 2."""
    from .._limits import InputError

    try:
        telemetry.configure_from_env()
    except InputError as error:
        _err.print(Text(f'durcap: {error}'))
        raise SystemExit(2) from None


def main() -> None:
    """Console-script entry point (`durcap`).

    Once a Temporal client ran in this process, every command leaves with its exit code but without interpreter
    finalization (output flushed, `os._exit`): temporalio's core runtime can abort the interpreter while it shuts
    down ("Fatal Python error: PyGILState_Release", exit -6; temporalio/sdk-python#300), which turned a finished
    `durcap demo --engine temporal --deny` into a failure about one time in fifty.
    """
    code: int | str | None = 0
    try:
        _telemetry_from_env()
        app()
    except SystemExit as exc:
        code = exc.code
        if 'temporalio.client' not in sys.modules:
            telemetry.shutdown()
            raise
    telemetry.shutdown()  # spans and metrics flushed before the exit (below: without interpreter finalization)
    if 'temporalio.client' in sys.modules:
        sys.stdout.flush()
        sys.stderr.flush()
        if isinstance(code, str):  # SystemExit('message'): printed and status 1, as the interpreter does
            print(code, file=sys.stderr, flush=True)
            code = 1
        os._exit(code or 0)


# The engine commands (`run`, `demo`, `replay`, `worker`, `dev`, `schedule`, `history`) register on `app`
# when imported; they import the helpers above, so this comes last.
from . import (
    approvals,  # noqa: F401  (`durcap approvals list`, `durcap approve`, `durcap deny`)
    budgets,  # noqa: F401  (`durcap budgets list|show|reset`)
    engine_commands,  # noqa: F401
    runs,  # noqa: F401
    serve,  # noqa: F401  (`durcap serve`)
    store,  # noqa: F401  (`durcap store stats`)
    ui,  # noqa: F401  (`durcap ui`)
    wire,  # noqa: F401  (`durcap wire`)
)
