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

from collections.abc import Collection, Mapping, Sequence
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


LOCAL_SECTION = 'local_activity_toolsets'
"""Key of an agent's `temporal` entry in `durable.lock`: the leaf toolsets whose tool calls run as Temporal local
activities, decided by `durcap lock --measure` (`decide_local_tools`). Every process that loads the target with the
lock (workers, `durcap run`, `durcap runs resume`, `durcap replay`) applies it (`apply_lock_decisions`), so a worker and
a replay of its histories agree, and the choice changes only when the lock does (a reviewed diff)."""

MEASURED_SECTION = 'local_activity_measured'
"""Key beside `LOCAL_SECTION`: one line per leaf measured, saying what was measured and what was decided."""

DEFAULT_LOCAL_THRESHOLD = 1.0
"""Seconds (`durcap lock --measure --threshold`): a leaf runs as local activities when every timed call of it finished
within this. Temporal's rule for local activities: well within the workflow task timeout (10 s by default), since a
local activity runs inside the workflow task of the worker holding the workflow."""

DEFAULT_LOCAL_MIN_CALLS = 5
"""Timed calls a leaf needs (`--min-calls`) before a decision is made about it; fewer keep the previous decision."""


def decide_local_tools(
    agent: DurableAgent[Any, Any], timings: Mapping[str, Any], *, previous: Collection[str] = (),
    threshold: float = DEFAULT_LOCAL_THRESHOLD, min_calls: int = DEFAULT_LOCAL_MIN_CALLS,
) -> tuple[list[str], list[str]]:
    """Which of `agent`'s leaf toolsets run their tool calls as Temporal local activities, from measured calls.

    A leaf is local when it has at least `min_calls` timed calls, none of them retried or failed, and the slowest
    finished within `threshold` seconds. A leaf with too few timed calls (also one whose calls already ran as local
    activities, which Temporal records without a start time) keeps its `previous` decision. MCP leaves are never
    local (network calls; `engines.temporal.local_tool_activities` refuses them).

    Args:
        agent: The definition (its leaf ids and MCP leaves).
        timings: `{leaf id: ToolTiming}` (`engines.temporal._measure.measure_tool_calls`; any object with `seconds`,
            `retried`, `failed`, `local_calls`, `runs`).
        previous: The leaves the lock marked local before.
        threshold: Seconds; see `DEFAULT_LOCAL_THRESHOLD`.
        min_calls: See `DEFAULT_LOCAL_MIN_CALLS`.

    Returns:
        `(local leaf ids sorted, one note per leaf of the agent)`; the notes go to `MEASURED_SECTION`.
    """
    from .engines import _mcp

    mcp = set(_mcp.mcp_leaves(agent))
    leaves = sorted({leaf for ids in agent.leaf_ids().values() for leaf in ids})
    local: list[str] = []
    notes: list[str] = []
    for leaf in leaves:
        timing = timings.get(leaf)
        if leaf in mcp:
            notes.append(f'{leaf}: not local (an MCP leaf: network calls are never short)')
            continue
        kept = leaf in previous
        if timing is None or len(timing.seconds) < min_calls:
            calls = 0 if timing is None else len(timing.seconds)
            local_calls = 0 if timing is None else timing.local_calls
            seen = f'{calls} timed call(s)' + (f', {local_calls} as local activities (not timed)' if local_calls else '')
            notes.append(f'{leaf}: {"local" if kept else "not local"} (kept: {seen}, fewer than {min_calls} to decide)')
            if kept:
                local.append(leaf)
            continue
        ordered = sorted(timing.seconds)
        median, slowest = ordered[len(ordered) // 2], ordered[-1]
        seen = (f'{len(ordered)} calls in {timing.runs} run(s), median {median * 1000:.0f} ms, '
                f'slowest {slowest * 1000:.0f} ms, threshold {threshold * 1000:.0f} ms')
        if timing.retried or timing.failed:
            notes.append(f'{leaf}: not local ({timing.retried} retried and {timing.failed} failed of {seen})')
        elif slowest > threshold:
            notes.append(f'{leaf}: not local ({seen})')
        else:
            local.append(leaf)
            notes.append(f'{leaf}: local ({seen})')
    return local, notes


def carry_lock_decisions(data: dict[str, Any], old: Mapping[str, Any]) -> dict[str, Any]:
    """Keep the measured decisions of the lock being replaced (`old`, as `read_lock` returns it) in new lock `data`
    (`lock_data`): a plain `durcap lock` never changes which tools run as local activities. Leaves no longer defined are
    dropped. Returns `data`, changed in place."""
    for name, entry in data['agents'].items():
        before = (old.get('agents', {}).get(name) or {}).get('temporal') or {}
        if not isinstance(entry.get('temporal'), dict) or not before.get(LOCAL_SECTION):
            continue
        leaves = {leaf for ids in entry['leaf_toolsets'].values() for leaf in ids}
        entry['temporal'][LOCAL_SECTION] = sorted(set(before[LOCAL_SECTION]) & leaves)
        entry['temporal'][MEASURED_SECTION] = [n for n in before.get(MEASURED_SECTION, [])
                                               if n.split(':', 1)[0] in leaves]
    return data


def apply_lock_decisions(agents: Sequence[DurableAgent[Any, Any]], locked: Mapping[str, Any]) -> None:
    """Mark the tool leaves the lock decided local (`LOCAL_SECTION`) on the definitions, as if each agent had been
    given `engine_options={'temporal': {'local_activity_toolsets': {leaf: {}}}}`; a leaf the agent already marks by
    hand keeps its own options. Leaves the agent no longer has are skipped (the lock diff reports the rename)."""
    for agent in agents:
        entry = (locked.get('agents', {}).get(agent.name) or {}).get('temporal') or {}
        decided = entry.get(LOCAL_SECTION) or []
        leaves = {leaf for ids in agent.leaf_ids().values() for leaf in ids}
        chosen = [leaf for leaf in decided if leaf in leaves]
        if not chosen:
            continue
        options = agent.engine_options.setdefault('temporal', {})
        marked = dict(options.get(LOCAL_SECTION) or {})
        for leaf in chosen:
            marked.setdefault(leaf, {})
        options[LOCAL_SECTION] = marked


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
    affected; a whole agent missing is DC021; a name added is info DC022. A name in another section of the same
    engine than the lock's (a unit new runs no longer run but whose records resumed runs still read, such as
    Prefect's `recovered_tasks`) is neither. The section of an engine whose extra is
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
            # A name that moved to another section of the engine is still produced (Prefect's conversation tasks,
            # now `recovered_tasks`: read to finish runs recorded before): no rename, no new name.
            now_anywhere = {name for section in words for name in new.get(engine, {}).get(section, [])}
            locked_anywhere = {name for section in words for name in old[engine].get(section, [])}
            for section in words:
                before = set(old[engine].get(section, []))
                after = set(new.get(engine, {}).get(section, []))
                for name in sorted(before - after - now_anywhere):
                    owner = _owner_hint(name, old, agent_name)
                    removed.setdefault(owner, {}).setdefault(engine, []).append(f'{words[section]} {name!r}')
                for name in sorted(after - before - locked_anywhere):
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
    locked = read_lock(path)
    report = diff_lock(locked, agents, engines)
    apply_lock_decisions(agents, locked)
    if allow_drift:
        return Report([
            Problem(p.code, 'warning', p.where, p.message, p.fix, p.engines) if p.severity == 'error' else p
            for p in report
        ])
    if not report.ok:
        raise DurableConfigError(report, f'lockfile {path}')
    return report
