"""TARGET: the agents a command, a worker or an entrypoint serves, loaded, validated together and
checked against their `durable.lock`.

A TARGET is one of:

- `pkg.module:attr` or `path/to/file.py:attr`: a `DurableAgent`, or a list / tuple of them (`attr` may
  be dotted);
- `pkg.module` or `path/to/module.py`: the whole module, i.e. every `DurableAgent` bound at its top level
  (directly or inside a top-level list / tuple), in definition order.

While the module imports, construction collects instead of raising (`_registry.collecting`), so one
broken definition does not hide the others: every problem of every agent is reported.

Where `durable.lock` lives (one rule, for `durcap check`, `lock`, `run`, the workers and the Prefect
entrypoint): beside the file of TARGET's module (`pkg/mod.py` for `pkg.mod:attr`); an explicit lock path
(`--lock`, `durcap lock -o`, `$DURCAP_LOCK`) overrides it.

Errors: `UnusableTarget` (the target gives no agents: exit code 2 in the CLI) and `DurableConfigError`
(definitions or the lock have errors: exit code 1), each with a message whose first line stands alone.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from . import _registry
from ._limits import INPUT_CODE, printable
from .agent import DurableAgent, validate_together
from .errors import DurcapError, with_code
from .lockfile import DEFAULT_LOCK_NAME, LockfileError, apply_lock_decisions, diff_lock, read_lock
from .validation import DurableConfigError, Problem, Report

TARGET_HELP = (
    '`pkg.module:attr` or `path/to/file.py:attr` (a DurableAgent or a list of them), or a whole module '
    '`pkg.module` / `path/to/module.py` (every DurableAgent in it). durable.lock is read and written beside '
    "the module's file."
)


MAX_TARGET_CHARS = 1024
"""Longest TARGET accepted (Linux paths are at most 4,096 bytes; a module path and attribute fit in far less)."""


class UnusableTarget(DurcapError, code='target'):
    """TARGET cannot give agents (malformed, missing file or module, import failure, wrong attribute type).

    The message is one line, printed as is (exit code 2 in the CLI), led by `DC040` (an unusable input; added here
    when the raise site did not write it).
    """

    def __init__(self, message: str) -> None:
        super().__init__(with_code(INPUT_CODE, message))


@dataclass
class Target:
    """A loaded TARGET.

    Attributes:
        spec: TARGET as given.
        agents: The agents it names (constructed ones only; a definition whose construction failed is
            still here, its errors in `report`).
        kind: `'agent'` (attr naming one agent), `'list'` (attr naming a list) or `'module'` (the whole module).
        file: The file of TARGET's module, or None (a module without a file).
        report: Every problem of every agent, validated together (DC011 across them); `check_lock` adds
            the lock diff.
        broken: Every definition with errors constructed while the module imported (named or not).
        module_agents: Every agent TARGET's module defines (the module's own `DurableAgent` attributes): the agents
            `durable.lock` beside it may hold besides those TARGET names.
    """

    spec: str
    agents: list[DurableAgent[Any, Any]]
    kind: Literal['agent', 'list', 'module']
    file: Path | None
    report: Report = field(default_factory=Report)
    broken: list[DurableAgent[Any, Any]] = field(default_factory=list)
    module_agents: list[DurableAgent[Any, Any]] = field(default_factory=list)

    @property
    def subject(self) -> str:
        """`'support', 'billing'`: the names of the agents and of every definition in error, for summaries."""
        members = {id(a): a for a in [*self.agents, *self.broken]}.values()
        return ', '.join(repr(a.name) for a in members) or self.spec

    @property
    def lock_path(self) -> Path:
        """Where `durable.lock` lives for this target: beside its module's file (the current folder when
        the module has no file)."""
        return lock_path_for(self.file)

    def raise_for_errors(self) -> None:
        """Raises `DurableConfigError` (with `report`) when the report has an error."""
        if not self.report.ok:
            raise DurableConfigError(self.report, self.subject)


def lock_path_for(target_file: str | Path | None) -> Path:
    """`durable.lock` beside `target_file` (absolute), or in the current folder when it is None."""
    folder = Path(target_file).resolve().parent if target_file is not None else Path.cwd()
    return folder / DEFAULT_LOCK_NAME


# ---- loading ------------------------------------------------------------------------------------


def _package_root(path: Path) -> tuple[Path, str]:
    """`(sys.path entry, dotted module name)` for a file: climb while the folder is a package."""
    root, parts = path.parent, [path.stem]
    while (root / '__init__.py').is_file():
        parts.insert(0, root.name)
        root = root.parent
    return root, '.'.join(parts)


def _is_path(module_part: str) -> bool:
    return module_part.endswith('.py') or '/' in module_part or os.sep in module_part


def _one_line(exc: BaseException) -> str:
    detail = str(exc).strip().splitlines()
    return f'{type(exc).__name__}' + (f': {detail[0]}' if detail else '')


def _import(module_name: str, expected_file: Path | None, collected: list[Any]) -> Any:
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as exc:
        where = f'{exc.filename}:{exc.lineno}' if exc.filename else module_name
        raise UnusableTarget(f'syntax error in {where}: {exc.msg}') from None
    except ModuleNotFoundError as exc:
        if exc.name == module_name or module_name.startswith(f'{exc.name}.'):
            raise UnusableTarget(f'no module named {module_name!r} (run from the folder it is importable from)') from None
        raise UnusableTarget(f'module {module_name!r} does not import: {exc}') from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - any failure of user code at import time
        broken = [a for a in collected if not a.report().ok]
        if not broken and not isinstance(exc, DurableConfigError):
            raise UnusableTarget(f'importing {module_name!r} raised {_one_line(exc)}') from None
        # A definition failed, or code using a broken one failed after it: the definitions' problems are the news.
        report = _report([], broken)
        if isinstance(exc, DurableConfigError):
            report.extend(p for p in exc.report if p not in report.problems)
        raise DurableConfigError(report, f'module {module_name!r}') from None
    found = getattr(module, '__file__', None)
    if expected_file is not None and (found is None or Path(found).resolve() != expected_file):
        raise UnusableTarget(f'module name {module_name!r} resolves to {found}, not {expected_file} (name clash)')
    return module


def _module_agents(module: Any) -> list[DurableAgent[Any, Any]]:
    """Every DurableAgent bound at the module's top level, directly or in a list / tuple, deduplicated."""
    seen: dict[int, DurableAgent[Any, Any]] = {}
    for value in vars(module).values():
        members = value if isinstance(value, (list, tuple)) else [value]
        for member in members:
            if isinstance(member, DurableAgent):
                seen.setdefault(id(member), member)
    return list(seen.values())


def _no_attribute(module: Any, module_name: str, given: str, attr: str) -> str:
    """The DC040 line for a TARGET whose `attr` the module lacks, with the fix: the names it binds to DurableAgents
    (or lists of them) at its top level, each as `given:name` (`given`: TARGET's module part, a dotted name or a
    path), else a word that it binds none."""
    names = sorted(n for n, v in vars(module).items() if not n.startswith('_') and (
        isinstance(v, DurableAgent) or (isinstance(v, (list, tuple)) and v and all(isinstance(m, DurableAgent) for m in v))))
    if names:
        fix = f"name one of its DurableAgents: {', '.join(f'{given}:{n}' for n in names[:10])}" + (
            f' (and {len(names) - 10} more)' if len(names) > 10 else '')
    else:
        fix = 'it binds no DurableAgent at its top level: name the module that defines your agent'
    return f'DC040 {module_name!r} has no attribute {attr!r}: {fix}'


def _with_agent(problem: Problem, name: str) -> Problem:
    """`problem` with its `where` prefixed by the agent (several agents' problems in one report)."""
    if problem.where.startswith(f'agent {name!r}'):
        return problem
    return Problem(problem.code, problem.severity, f'agent {name!r} {problem.where}', problem.message, problem.fix,
                   problem.engines)


def _report(agents: list[DurableAgent[Any, Any]], broken: list[DurableAgent[Any, Any]]) -> Report:
    """`validate_together(agents)` plus the problems of `broken` definitions of the module not among
    them; each problem names its agent when more than one agent is involved."""
    members = list({id(a): a for a in [*agents, *broken]}.values())
    if len(members) == 1:
        return validate_together(members)
    report = Report()
    for agent in members:
        report.extend(_with_agent(p, agent.name) for p in agent.report())
    together = validate_together(agents)
    report.extend(p for p in together if p.code == 'DC011')
    return report


def load(target: str) -> Target:
    """Import TARGET and validate its agents together.

    Args:
        target: `pkg.module:attr`, `path/to/file.py:attr` (`attr` may be dotted), `pkg.module` or
            `path/to/module.py`. A dotted module is imported with the current folder on `sys.path`; a file
            under its package name (its folder, climbed while it holds `__init__.py`, gives the `sys.path` entry).

    Returns:
        The `Target`; `.report` holds every problem of its agents and of every definition that failed
        construction while the module imported (check `.report.ok`, or call `.raise_for_errors()`).

    Raises:
        UnusableTarget: malformed TARGET, missing file or module, syntax error, import failure, missing
            attribute, wrong type, an empty list, or a module without any DurableAgent.
        DurableConfigError: the import itself failed because of a definition error (code using a broken
            definition at import time); `.report` has every problem collected.
    """
    if len(target) > MAX_TARGET_CHARS or printable(target) != target:
        raise UnusableTarget(f"DC040 TARGET '{printable(target[:80])}{'...' if len(target) > 80 else ''}' is not a "
                             f'module or file name: at most {MAX_TARGET_CHARS} characters, no control characters')
    module_part, sep, attr = target.rpartition(':')
    if not sep:
        module_part, attr = target, ''
    if not module_part or (sep and not attr):
        raise UnusableTarget(
            f'TARGET {target!r} must be `pkg.module:attr`, `path/to/file.py:attr`, `pkg.module` or `path/to/module.py`'
        )
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    expected: Path | None = None
    if _is_path(module_part):
        path = Path(module_part).resolve()
        if not path.is_file():
            raise UnusableTarget(_not_a_module_file(module_part, path))
        root, module_name = _package_root(path)
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        expected = path
    else:
        module_name = module_part
    with _registry.collecting() as collected:
        module = _import(module_name, expected, collected)
    file = Path(module.__file__).resolve() if getattr(module, '__file__', None) else None
    broken = [a for a in collected if not a.report().ok]
    if not attr:
        agents = _module_agents(module)
        if not agents and not broken:
            raise UnusableTarget(f'module {module_name!r} defines no DurableAgent')
        return Target(target, agents, 'module', file, _report(agents, broken), broken, agents)
    value: Any = module
    for name in attr.split('.'):
        if not hasattr(value, name):
            raise UnusableTarget(_no_attribute(module, module_name, module_part, attr))
        value = getattr(value, name)
    if isinstance(value, DurableAgent):
        return Target(target, [value], 'agent', file, _report([value], broken), broken, _module_agents(module))
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, DurableAgent) for v in value):
        return Target(target, list(value), 'list', file, _report(list(value), broken), broken, _module_agents(module))
    type_name = type(value).__name__
    kind = 'an empty list' if isinstance(value, (list, tuple)) and not value else (
        f'{"an" if type_name[0] in "aeiouAEIOU" else "a"} {type_name}')
    raise UnusableTarget(f'{target} is {kind}, not a DurableAgent or a list of DurableAgents')


# ---- the lock -------------------------------------------------------------------------------------


def lock_diff(agents: list[DurableAgent[Any, Any]], lock: str | Path, *, allow_drift: bool = False,
              engines: Collection[str] | None = None) -> Report:
    """The diff of `agents` against the lockfile `lock` (DC020 / DC021 errors, DC022 info).

    With `allow_drift`, errors become warnings; `engines`: compare only these engines' sections (see
    `lockfile.diff_lock`). Raises `UnusableTarget` when `lock` cannot be read.
    """
    try:
        report = diff_lock(read_lock(lock), agents, engines)
    except LockfileError as exc:
        raise UnusableTarget(str(exc)) from None
    if allow_drift:
        return Report([
            Problem(p.code, 'warning', p.where, p.message, p.fix, p.engines) if p.severity == 'error' else p
            for p in report
        ])
    return report


def _not_a_module_file(name: str, path: Path) -> str:
    """Why `path` (TARGET's file part, `name` as given) cannot be imported: missing, a folder, or not a regular file."""
    if path.is_dir():
        return (f'{printable(name)} is a folder, not a module file: name a file (`{printable(name.rstrip("/"))}/agents.py:attr`)'
                ' or a package by its dotted name (`pkg.module:attr`)')
    if path.exists():
        return f'{printable(name)} is not a regular file (a FIFO, socket or device): TARGET names a Python module file'
    return f'no such file: {printable(name)}'


def check_lock(loaded: Target, lock: str | Path | None = None, *, allow_drift: bool = False,
               engines: Collection[str] | None = None) -> Path | None:
    """Add the lock diff to `loaded.report`: against `lock` if given (it must exist), else against the
    `durable.lock` beside TARGET's file if there is one; `engines`: only these engines' sections (None: all).

    Returns:
        The lockfile compared with, or None when there was none.

    Raises:
        UnusableTarget: the lockfile cannot be read (missing when given, not YAML, newer format).
    """
    path = Path(lock) if lock is not None else loaded.lock_path
    if lock is None and not path.is_file():
        return None
    # An agent the lock holds that TARGET does not name but its module defines (`module.py:one` of a module locked
    # whole) is not gone: no DC021 for it. A renamed one is in neither, and still refused.
    elsewhere = {f'agent {a.name!r}' for a in loaded.module_agents} - {f'agent {a.name!r}' for a in loaded.agents}
    loaded.report.extend(p for p in lock_diff(loaded.agents, path, allow_drift=allow_drift, engines=engines)
                         if not (p.code == 'DC021' and p.where in elsewhere))
    apply_lock_decisions(loaded.agents, read_lock(path))  # readable: lock_diff read it
    return path


def apply_lock(loaded: Target, lock: str | Path | None = None) -> Path | None:
    """Apply the decisions recorded in the lock (`lockfile.apply_lock_decisions`: the tools `durcap lock --measure`
    made Temporal local activities) to `loaded`'s agents without comparing names: what `durcap replay` needs so a
    replay schedules what the worker did. `lock`: that file (it must exist), else the `durable.lock` beside TARGET.

    Returns:
        The lockfile applied, or None when there was none.

    Raises:
        UnusableTarget: the lockfile cannot be read.
    """
    path = Path(lock) if lock is not None else loaded.lock_path
    if lock is None and not path.is_file():
        return None
    try:
        apply_lock_decisions(loaded.agents, read_lock(path))
    except LockfileError as exc:
        raise UnusableTarget(str(exc)) from None
    return path


def load_checked(
    target: str, *, lock: str | Path | None = None, allow_drift: bool = False, use_lock: bool = True,
    engines: Collection[str] | None = None,
) -> Target:
    """`load` then `check_lock` (unless `use_lock` is False), raising on any error: what a worker, an
    entrypoint or a durable run needs before it registers anything. `engines`: the engines whose lock sections
    are compared (a run or worker passes its own: the other engines' SDKs stay unimported); None: every engine.

    Raises:
        UnusableTarget: see `load` and `check_lock`.
        DurableConfigError: a definition or the lock diff has an error; `.report` has every problem.
    """
    loaded = load(target)
    if loaded.report.ok and use_lock:
        check_lock(loaded, lock, allow_drift=allow_drift, engines=engines)
    loaded.raise_for_errors()
    return loaded
