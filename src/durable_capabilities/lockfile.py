"""The operation-name lockfile (`durable.lock`): durable unit names are compatibility data.

A renamed capability id, agent name or MCP host changes activity / step / task names, and runs in
flight then fail to recover (Temporal: `NondeterminismError` on replay; DBOS:
`DBOSUnexpectedStepError` on recovery; Prefect: every task misses its cache and runs again).
`durcap lock` writes every name per engine; `durcap check --lock` and worker start compare the
current definition against it, so such a change is seen before it ships.

The file is YAML with sorted keys and sorted lists: one name per line, so `git diff` shows exactly
what changed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from ._limits import MAX_LOCK_BYTES, InputError, load_yaml, one_line, printable, read_bytes
from .agent import DurableAgent
from .engines import ENGINES, specs
from .errors import DurcapError
from .validation import DurableConfigError, Problem, Report

LOCK_VERSION = 1
DEFAULT_LOCK_NAME = 'durable.lock'


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def lock_data(agents: Sequence[DurableAgent[Any, Any]], engines: Collection[str] | None = None) -> dict[str, Any]:
    """The lockfile content for `agents` as plain data (see `write_lock`).

    Per agent: capability ids, leaf toolset ids per capability, static tool names and, per durable engine the
    definition lists, every durable name its adapter registers (`EngineAdapter.durable_names`); plus the
    versions of pydantic-ai and the engines.

    Args:
        agents: The definitions.
        engines: Compute the durable names of these engines only (None: every engine each definition lists).
            Computing an engine's names imports its SDK (~1-1.5 s of CPU each for Temporal, DBOS and Prefect).
    """
    data: dict[str, Any] = {
        'lock_version': LOCK_VERSION,
        'generated_by': {
            name: _package_version(name)
            for name in ('durable-capabilities', 'pydantic-ai-slim', *(p for spec in specs() for p in spec.packages))
            if _package_version(name) is not None
        },
        'agents': {},
    }
    for agent in agents:
        entry: dict[str, Any] = {
            'capabilities': sorted(agent.capability_ids()),
            'leaf_toolsets': {cap: sorted(ids) for cap, ids in sorted(agent.leaf_ids().items())},
            'tools': sorted(agent.static_tool_names()),
        }
        if agent.previous_names:
            entry['previous_names'] = sorted(agent.previous_names)
        if agent.aliases:
            entry['aliases'] = dict(sorted(agent.aliases.items()))
        for engine in sorted(agent.engines):
            if engine in ENGINES and ENGINES[engine].durable and (engines is None or engine in engines):
                entry[engine] = ENGINES[engine].durable_names(agent)
        data['agents'][agent.name] = entry
    return data


class _NoAliasDumper(yaml.SafeDumper):
    """Never writes anchors and aliases (`read_lock` refuses them), even for a list shared by two entries."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def dump_lock(data: dict[str, Any]) -> str:
    return '# durable.lock: durable unit names are compatibility data. Regenerate with `durcap lock`.\n' + yaml.dump(
        data, Dumper=_NoAliasDumper, sort_keys=True, default_flow_style=False, width=200
    )


def write_lock(agents: Sequence[DurableAgent[Any, Any]], path: str | Path = DEFAULT_LOCK_NAME) -> Path:
    """Write the lockfile for `agents` to `path`; returns the path."""
    path = Path(path)
    path.write_text(dump_lock(lock_data(agents)), encoding='utf-8')
    return path


class LockfileError(ValueError, DurcapError, code='lockfile'):
    """The lockfile cannot be read (missing, not YAML, over a bound, wrong shape, or a newer lock format).

    The message is one line; for a bound or a wrong shape it starts with code DC040 (`validation.CODES`).
    """


Names = list[StrictStr]


class LockedAgent(BaseModel):
    """One agent of a lockfile (`lock_data`): its ids and tool names, and per engine `{section: [names]}`."""

    model_config = ConfigDict(extra='allow')
    __pydantic_extra__: dict[str, dict[StrictStr, Names]] = Field(init=False)  # engine -> section -> names

    capabilities: Names = []
    leaf_toolsets: dict[StrictStr, Names] = {}
    tools: Names = []
    previous_names: Names = []
    aliases: dict[StrictStr, StrictStr] = {}


class Lockfile(BaseModel):
    """The shape of `durable.lock`; `read_lock` validates a file against it before anything reads it."""

    model_config = ConfigDict(extra='allow')

    lock_version: StrictInt = Field(ge=1)
    generated_by: dict[StrictStr, StrictStr | None] = {}
    agents: dict[StrictStr, LockedAgent]


def _shape_error(path: Path, exc: ValidationError) -> LockfileError:
    """One line naming the first wrong field of the lockfile (`agents.support.temporal.activities.0`)."""
    first = exc.errors()[0]
    where = '.'.join(str(part) for part in first['loc']) or '(top level)'
    return LockfileError(
        f'DC040 {printable(path)}: not a durable.lock file: `{printable(where)}` {one_line(first["msg"])} '
        f'({exc.error_count()} problem(s)); regenerate it with `durcap lock`'
    )


def read_lock(path: str | Path) -> dict[str, Any]:
    """Parse and validate a lockfile (at most `_limits.MAX_LOCK_BYTES`, no YAML aliases, nested at most
    `_limits.MAX_DEPTH` deep, the shape of `Lockfile`).

    Returns:
        The lockfile as plain data (`Lockfile.model_dump()`: every agent has every list, possibly empty).

    Raises:
        LockfileError: missing or unreadable file, not a regular file, too large, invalid YAML, an alias, too
            deep, wrong shape, or `lock_version` newer than this package (or not a positive integer).
    """
    path = Path(path)
    try:
        text = read_bytes(path, limit=MAX_LOCK_BYTES, what='lockfile').decode('utf-8')
        data = load_yaml(text, where=str(path))
    except FileNotFoundError:
        raise LockfileError(f'{printable(path)}: no such lockfile; create it with `durcap lock`') from None
    except InputError as exc:
        raise LockfileError(str(exc)) from None
    except (IsADirectoryError, UnicodeDecodeError, PermissionError) as exc:
        raise LockfileError(f'{printable(path)}: cannot read it as a lockfile ({type(exc).__name__})') from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, 'problem_mark', None)
        line = f' line {mark.line + 1}' if mark is not None else ''
        reason = getattr(exc, 'problem', None) or str(exc)
        raise LockfileError(f'DC040 {printable(path)}:{line}: not valid YAML ({one_line(reason)})') from None
    except (ValueError, TypeError) as exc:  # a value PyYAML parses but cannot build (`!!int abc`)
        raise LockfileError(f'DC040 {printable(path)}: not valid YAML ({one_line(str(exc))})') from None
    if not isinstance(data, dict) or not isinstance(data.get('agents'), dict):
        raise LockfileError(f'{printable(path)}: not a durable.lock file (no `agents` mapping)')
    version = data.get('lock_version')
    if type(version) is not int or version < 1 or version > LOCK_VERSION:
        raise LockfileError(
            f'DC040 {printable(path)}: lock_version {printable(repr(version))[:40]} is not supported by this version '
            f'(it reads lock_version 1 to {LOCK_VERSION}); regenerate it with `durcap lock`'
        )
    try:
        return Lockfile.model_validate(data).model_dump()
    except ValidationError as exc:
        raise _shape_error(path, exc) from None


def _owner_hint(name: str, old_agent: dict[str, Any], agent_name: str) -> str:
    """Which capability, toolset or agent a durable unit name belongs to."""
    for cap, leaves in sorted(old_agent.get('leaf_toolsets', {}).items()):
        for leaf in leaves:
            if f'__{leaf}__' in name or f'__{leaf}.' in name or name.endswith(f': {leaf}') or name == leaf:
                return f"capability {cap!r} (leaf toolset {leaf!r})"
    return f'agent {agent_name!r}'


def diff_lock(
    locked: dict[str, Any], agents: Sequence[DurableAgent[Any, Any]], engines: Collection[str] | None = None
) -> Report:
    """Compare the definitions with a lockfile.

    A durable unit name (or workflow / flow name, or Prefect cache toolset id) in the lock but no longer
    produced is an error DC020 naming the capability, toolset or agent it belonged to and the engines
    affected; a whole agent missing is DC021; a name added is info DC022. The section of an engine whose extra is
    not installed in this process, and which the definition does not list (`DurableAgent(engines=...)` defaults to
    the installed engines), is not compared: `pip install 'durable-capabilities[dbos]'` alone can check the DBOS
    names of a lock written with every engine.

    `engines` (None: every engine) limits the comparison to those engines' sections (the agents, ids and tool
    names are compared whatever it is): a command that runs on one engine needs that engine's names only, and the
    other engines' SDKs are then not imported.
    """
    report = Report()
    current = lock_data(agents, engines)['agents']
    for agent_name, old in sorted(locked['agents'].items()):
        new = current.get(agent_name)
        if new is None:
            renamed_to = [n for n, e in current.items() if agent_name in e.get('previous_names', [])]
            if renamed_to:
                continue  # declared as previous name of a current agent: its names are still produced
            report.add(Problem(
                'DC021', 'error', f'agent {agent_name!r}',
                f'the lockfile has agent {agent_name!r} but the target defines no agent of that name; runs in '
                'flight under it can no longer recover.',
                f"If it was renamed, declare it: `DurableAgent('<new name>', ..., previous_names=['{agent_name}'])`; "
                'if it is gone for good and nothing is in flight, regenerate the lock with `durcap lock`.',
            ))
            continue
        removed: dict[str, dict[str, list[str]]] = {}  # owner -> engine -> names
        for engine in ENGINES:  # registry order: messages list engines the same way every time
            if not isinstance(old.get(engine), dict) or not ENGINES[engine].durable:
                continue
            if engines is not None and engine not in engines:
                continue  # not asked for: its names were not computed
            if engine not in new and not ENGINES[engine].available():
                continue  # its extra is not installed here: its names cannot be computed, which is no rename
            words = ENGINES[engine].lock_sections
            for section in words:
                before = set(old[engine].get(section, []))
                after = set(new.get(engine, {}).get(section, []))
                for name in sorted(before - after):
                    owner = _owner_hint(name, old, agent_name)
                    removed.setdefault(owner, {}).setdefault(engine, []).append(f'{words[section]} {name!r}')
                for name in sorted(after - before):
                    report.add(Problem(
                        'DC022', 'info', f'agent {agent_name!r}',
                        f'{engine} {words[section]} {name!r} is new since the lockfile.',
                        'Run `durcap lock` to record it.', (engine,),
                    ))
        for owner, by_engine in removed.items():
            listed = '; '.join(f'{engine}: {", ".join(names)}' for engine, names in by_engine.items())
            report.add(Problem(
                'DC020', 'error', owner,
                f'durable unit names in the lockfile are no longer produced (renamed or removed) - {listed}. '
                'Runs in flight that used them will not recover.',
                'Keep the old names with an alias (`DurableAgent(..., aliases={new_id: old_id})` for a capability or '
                'MCP id, `previous_names=[...]` for the agent), or regenerate the lock with `durcap lock` once no run '
                'is in flight.',
                tuple(by_engine),
            ))
    for agent_name in sorted(set(current) - set(locked['agents'])):
        report.add(Problem('DC022', 'info', f'agent {agent_name!r}', f'agent {agent_name!r} is not in the lockfile.',
                           'Run `durcap lock` to record it.'))
    return report


def find_lock(target_file: str | Path | None) -> Path | None:
    """The `durable.lock` beside a target file (or in the current directory), if one exists."""
    candidates = []
    if target_file is not None:
        candidates.append(Path(target_file).resolve().parent / DEFAULT_LOCK_NAME)
    candidates.append(Path.cwd() / DEFAULT_LOCK_NAME)
    return next((c for c in candidates if c.is_file()), None)


def enforce_lock(
    agents: Sequence[DurableAgent[Any, Any]],
    lock: str | Path | None = None,
    *,
    target_file: str | Path | None = None,
    allow_drift: bool = False,
    engines: Collection[str] | None = None,
) -> Report:
    """What worker start runs: compare `agents` with `lock` (or the `durable.lock` beside `target_file`,
    or in the current directory) and refuse on drift; `engines`: the sections compared (see `diff_lock`).

    Returns:
        The lock diff (errors downgraded to warnings when `allow_drift`); empty when there is no lockfile.

    Raises:
        DurableConfigError: a locked name is no longer produced (DC020 / DC021) and not `allow_drift`.
        LockfileError: `lock` was given but cannot be read.
    """
    path = Path(lock) if lock is not None else find_lock(target_file)
    if path is None:
        return Report()
    report = diff_lock(read_lock(path), agents, engines)
    if allow_drift:
        return Report([
            Problem(p.code, 'warning', p.where, p.message, p.fix, p.engines) if p.severity == 'error' else p
            for p in report
        ])
    if not report.ok:
        raise DurableConfigError(report, f'lockfile {path}')
    return report
