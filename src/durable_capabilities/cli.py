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


def engine_name(durable_only: bool = True) -> Any:
    """A `parser=` for `--engine`: the value must name a registered engine, read when the command runs
    (`engines.register` can add one after this module was imported).

    Raises:
        typer.BadParameter: the value names no registered engine.
    """

    def parse(value: str) -> str:
        from .engines import ALL_ENGINES, DURABLE_ENGINES

        names = tuple(DURABLE_ENGINES if durable_only else ALL_ENGINES)
        if value not in names:
            raise typer.BadParameter(f'{value!r} is not one of {", ".join(map(repr, names))}.')
        return value

    return parse


def engine_metavar(durable_only: bool = True) -> str:
    """`<a|b|c>`: the engines registered when the CLI was imported, for `--help`."""
    from .engines import ALL_ENGINES, DURABLE_ENGINES

    return '<' + '|'.join(DURABLE_ENGINES if durable_only else ALL_ENGINES) + '>'


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
        agents, is_list = load_target(target)
        report = validate_together(agents) if is_list else agents[0].report()
        subject = ', '.join(repr(a.name) for a in agents)
    except UnusableTarget as exc:
        _unusable(str(exc))
    except DurableConfigError as exc:
        report = exc.report
        subject = exc.subject
    else:
        # The lockfile given, or the one beside TARGET: what `durcap worker temporal` will check at start.
        check_drift(target, agents, lock, False, report)
    if engine:
        wanted = set(engine)
        report = Report([p for p in report if not p.engines or wanted.intersection(p.engines)])
    if format is CheckFormat.json:
        payload = json.loads(report.to_json())
        payload = {'target': target, 'engines': list(engine or []), **payload}
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


# ---- lock -------------------------------------------------------------------------------------


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
    try:
        path = write_lock(agents, output)
    except OSError as exc:
        _unusable(f'cannot write {output}: {exc.strerror or type(exc).__name__}')
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


def main() -> None:
    """Console-script entry point (`durcap`)."""
    app()


# The engine commands (`run`, `demo`, `replay`, `worker`, `dev`, `schedule`, `history`) register on `app`
# when imported; they import the helpers above, so this comes last.
from . import cli_engines  # noqa: E402, F401

if __name__ == '__main__':
    # `python -m durable_capabilities.cli` runs this file as `__main__`, a second copy of the module;
    # cli_engines registered its commands on the app of `durable_capabilities.cli`, so run that one.
    from durable_capabilities.cli import main as _main

    _main()
