"""The engine registry: one line per engine, one adapter module each (see `_adapter.EngineAdapter`).

Built-in engines are registered from their spec (`LazyAdapter(spec)`, see `_protocol.EngineSpec`): their module,
and the engine's SDK, is imported only when something beyond what the spec declares is asked. `register` adds an engine
(a test module can add its own); the CLI, runner, lockfile, replay and the MCP guard look engines up here.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from . import _specs
from ._adapter import (
    RUN_STATUSES,
    DrainCutShortError,
    EngineAdapter,
    EngineUnreachableError,
    LazyAdapter,
    RunInfo,
    RunNotFoundError,
    RunOptions,
    RunState,
    RunStates,
    RunUnit,
    unit_kind,
)
from ._protocol import ConnectionSetting, EngineSpec, run_of
from ._specs import DEFAULT_ENGINE

__all__ = [
    'ALL_ENGINES',
    'DEFAULT_ENGINE',
    'DURABLE_ENGINES',
    'ENGINES',
    'RUN_STATUSES',
    'ConnectionSetting',
    'DrainCutShortError',
    'EngineAdapter',
    'EngineSpec',
    'EngineUnreachableError',
    'LazyAdapter',
    'RunInfo',
    'RunNotFoundError',
    'RunOptions',
    'RunState',
    'RunStates',
    'RunUnit',
    'get',
    'register',
    'run_of',
    'specs',
    'unit_kind',
]

ENGINES: dict[str, EngineAdapter] = {}
"""Every registered engine by name, in registration order (live: `register` adds to it)."""


def register(adapter: EngineAdapter) -> EngineAdapter:
    """Add an engine (or replace the one of the same name); returns `adapter`.

    Args:
        adapter: The engine's `EngineAdapter` (or a `LazyAdapter` pointing at its module). A durable one
            (`adapter.durable`) is listed by `DurableAgent(engines=...)` by default and offered by
            `durcap check --engine`.
    """
    ENGINES[adapter.name] = adapter
    return adapter


def specs() -> list[EngineSpec]:
    """The spec of every registered engine, in registration order (what settings, flags and hints are built from)."""
    return [adapter.spec for adapter in ENGINES.values()]


def get(name: str) -> EngineAdapter:
    """The adapter registered as `name`.

    Raises:
        ValueError: no engine of that name is registered.
    """
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f'unknown engine {name!r}; expected one of {", ".join(ENGINES)}') from None


class _Names(Sequence[str]):
    """A live, read-only view of registered engine names (a tuple in every use: `in`, iteration, `*`)."""

    def __init__(self, durable_only: bool):
        self._durable_only = durable_only

    def _names(self) -> tuple[str, ...]:
        return tuple(n for n, a in ENGINES.items() if a.durable or not self._durable_only)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(self._names())


DURABLE_ENGINES: Sequence[str] = _Names(durable_only=True)
"""Names of the registered durable engines (every engine but `local`)."""
ALL_ENGINES: Sequence[str] = _Names(durable_only=False)
"""Names of every registered engine."""

register(LazyAdapter(_specs.LOCAL))
register(LazyAdapter(_specs.TEMPORAL))
register(LazyAdapter(_specs.DBOS))
register(LazyAdapter(_specs.PREFECT))
