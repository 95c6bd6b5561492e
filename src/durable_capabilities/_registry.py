"""Process-wide bookkeeping of agent definitions: where each was defined, durable names claimed, and
whether construction raises or collects.

Engines keep per-process registries keyed by agent name (Temporal workflow classes, DBOS workflows,
Prefect flows). Every one of them claims the name here first (`claim`), so two different definitions
sharing a name meet one check wherever they meet: `DurableConfigError` with problem DC011 naming the
module each was defined in. The same object claiming its name again is fine (registration is idempotent).

`collecting()` makes `DurableAgent(...)` keep an invalid definition instead of raising, so a whole
module can be imported and every problem of every agent in it reported (`targets.load`).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from .validation import DurableConfigError, Problem, Report

_lock = threading.Lock()
_claims: dict[tuple[str, str], tuple[Any, str]] = {}
_collected: ContextVar[list[Any] | None] = ContextVar('durcap_collected_agents', default=None)


def defined_in(skip_module: str) -> tuple[str, str]:
    """`(module name, 'file:line')` of the first caller frame outside module `skip_module`.

    Called by `DurableAgent.__init__` to record where a definition was written (a subclass's
    `__init__` in another module counts as the definition site). For code compiled from a string the
    location is `'line N'` within it; `('<unknown>', '<unknown>')` when the stack is not inspectable.
    """
    frame = inspect.currentframe()
    frame = frame.f_back if frame is not None else None
    while frame is not None and frame.f_globals.get('__name__') == skip_module:
        frame = frame.f_back
    if frame is None:
        return '<unknown>', '<unknown>'
    module = str(frame.f_globals.get('__name__', '<unknown>'))
    file = Path(frame.f_code.co_filename)
    if not file.is_file():  # code compiled from a string (`python -c`, exec): its line within that code
        return module, f'line {frame.f_lineno}'
    try:
        shown = str(file.resolve().relative_to(Path.cwd()))
    except ValueError:
        shown = str(file)
    return module, f'{shown}:{frame.f_lineno}'


def describe(agent: Any) -> str:
    """`"pkg.mod at pkg/mod.py:12"` for an agent (anything with `defined_in` / `defined_at`)."""
    return f"{getattr(agent, 'defined_in', '<unknown>')} at {getattr(agent, 'defined_at', '<unknown>')}"


def duplicate_name_problem(name: str, agents: list[Any], context: str) -> Problem:
    """Problem DC011 for `agents` (distinct objects) sharing `name`, naming where each was defined.

    Args:
        name: The shared agent name.
        agents: Two or more distinct definitions.
        context: Where they met, e.g. `'registered together'`, `'as DBOS workflows in this process'`.
    """
    where = ' and in '.join(describe(a) for a in agents)
    return Problem(
        'DC011',
        'error',
        f'agent {name!r}',
        f'{len(agents)} agent definitions {context} share the name {name!r}: defined in {where}. Their durable '
        'unit names would collide and one would answer for the other.',
        'Give each DurableAgent a distinct name.',
    )


def claim(kind: str, name: str, obj: Any, what: str) -> None:
    """Claim `name` in the per-process registry `kind` for the definition `obj`.

    Args:
        kind: The registry, e.g. `'temporal workflow'`, `'dbos workflow'`, `'prefect flow'`.
        name: The agent name (the key the engine registers under).
        obj: The `DurableAgent` registering.
        what: How the problem phrases the meeting place, e.g. `'as DBOS workflows in this process'`.

    Raises:
        DurableConfigError: another object already claimed `name` in `kind` (DC011, naming both modules).
            The same object claiming again is a no-op.
    """
    with _lock:
        held = _claims.get((kind, name))
        if held is None:
            _claims[(kind, name)] = (obj, what)
            return
        if held[0] is obj:
            return
    report = Report([duplicate_name_problem(name, [held[0], obj], what)])
    raise DurableConfigError(report, f'{kind} {name!r}')


@contextmanager
def collecting() -> Iterator[list[Any]]:
    """Inside, `DurableAgent(...)` with errors does not raise: it is appended to the yielded list (and
    constructed, its `.report()` holding the errors). Every definition constructed inside is appended."""
    found: list[Any] = []
    token = _collected.set(found)
    try:
        yield found
    finally:
        _collected.reset(token)


def collect(agent: Any) -> bool:
    """Record a newly constructed definition when `collecting()` is active; returns whether it is."""
    found = _collected.get()
    if found is None:
        return False
    found.append(agent)
    return True
