"""Engine adapters: one declarative spec per engine; differences are data, not branches.

Each `EngineSpec` names the upstream durability capability and the words the engine uses for its
durable unit and container. `DurableAgent.build` is the one place a `pydantic_ai.Agent` is constructed.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

EngineName = Literal['local', 'temporal', 'dbos', 'prefect']
DURABLE_ENGINES: tuple[str, ...] = ('temporal', 'dbos', 'prefect')
ALL_ENGINES: tuple[str, ...] = ('local', *DURABLE_ENGINES)


@dataclass(frozen=True)
class EngineSpec:
    """What differs between engines, as data.

    Attributes:
        name: `'local' | 'temporal' | 'dbos' | 'prefect'`.
        module: Upstream module holding the durability capability (`None` for local).
        durability: Class name of upstream's durability capability in `module`.
        extra: The `durable-capabilities[...]` extra that installs the engine.
        unit: The engine's word for a durable unit (activity, step, task).
        container: The engine's word for the durable container (workflow, flow).
        adapter: Our module for the engine; its `durability_parts(agent, options)` returns the
            durability keyword arguments and the extra capabilities we add (None for local).
    """

    name: str
    module: str | None
    durability: str | None
    extra: str | None
    unit: str
    container: str
    adapter: str | None = None
    requires: str | None = None

    def durability_class(self) -> Callable[..., Any] | None:
        """Import upstream's durability capability class; raises ImportError when the extra is missing."""
        if self.module is None or self.durability is None:
            return None
        return getattr(importlib.import_module(self.module), self.durability)

    def parts(self, agent: Any, options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """Durability keyword arguments (our defaults merged with `options`) and extra capabilities."""
        if self.adapter is None:
            return dict(options), []
        return importlib.import_module(self.adapter).durability_parts(agent, options)

    def available(self) -> bool:
        """Whether the engine's SDK is installed, without importing it (importing Prefect alone takes ~1.4 s)."""
        if self.requires is None:
            return True
        return importlib.util.find_spec(self.requires) is not None


ENGINES: dict[str, EngineSpec] = {
    'local': EngineSpec('local', None, None, None, 'call', 'run'),
    'temporal': EngineSpec(
        'temporal', 'pydantic_ai.durable_exec.temporal', 'TemporalDurability', 'temporal', 'activity', 'workflow',
        'durable_capabilities.engines.temporal', 'temporalio',
    ),
    'dbos': EngineSpec(
        'dbos', 'pydantic_ai.durable_exec.dbos', 'DBOSDurability', 'dbos', 'step', 'workflow',
        'durable_capabilities.engines.dbos', 'dbos',
    ),
    'prefect': EngineSpec(
        'prefect', 'pydantic_ai.durable_exec.prefect', 'PrefectDurability', 'prefect', 'task', 'flow',
        'durable_capabilities.engines.prefect', 'prefect',
    ),
}
