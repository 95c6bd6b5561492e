"""Importable flow entrypoints for Prefect deployments: `durable_capabilities.engines.prefect._entry:flow__<agent>`.

Prefect runs each deployment's flow run in a new process that imports the flow from the deployment's
entrypoint (a served in-memory flow would be pickled instead, and a built pydantic-ai agent does not
pickle). This module builds the flow on first attribute access from `$DURCAP_TARGET`
(any TARGET form, see `durable_capabilities.targets`), so every flow run builds its agent in its own process.

The module `__getattr__` below is this module's purpose, not a way around an import cycle: Prefect resolves an
entrypoint `module:attribute` with `getattr` on the module, and the attributes (`flow__<agent name>`) exist only
once `$DURCAP_TARGET` is loaded in the flow-run process.
"""

from __future__ import annotations

import os
from typing import Any

from ...targets import load_checked
from ._flow import agent_flow
from ._spec import ENGINE, FLOW_ATTR_PREFIX, TARGET_ENV, flow_attr

__all__ = ['TARGET_ENV', 'entrypoint', 'flow_attr', 'preload', 'preloaded_agents']


def entrypoint(agent_name: str) -> str:
    """The deployment entrypoint for an agent's flow."""
    return f'{__name__}:{flow_attr(agent_name)}'


def __getattr__(name: str) -> Any:
    """`flow__<agent name>`: the agent's flow, its definition loaded from `$DURCAP_TARGET` (checked as the serving
    process checks it: every definition valid, no drift from Prefect's names in the durable.lock beside TARGET).

    Raises:
        AttributeError: not a flow attribute, `$DURCAP_TARGET` unset, or no agent of that name there.
    """
    if not name.startswith(FLOW_ATTR_PREFIX):
        raise AttributeError(name)
    target, agents = _agents(name)
    for agent in agents:
        if flow_attr(agent.name) == name:
            return agent_flow(agent)
    raise AttributeError(f'{name}: no agent of this name in {target}')


def _agents(name: str) -> tuple[str, list[Any]]:
    """`($DURCAP_TARGET, its agents)`, checked (see `__getattr__`); `name` is what the error names."""
    target = os.environ.get(TARGET_ENV)
    if not target:
        raise AttributeError(f'{name}: ${TARGET_ENV} is not set')
    return target, load_checked(target, lock=os.environ.get('DURCAP_LOCK') or None,
                                allow_drift=os.environ.get('DURCAP_ALLOW_DRIFT') == '1', engines=(ENGINE,)).agents


_PRELOADED_AGENTS: list[Any] = []


def preloaded_agents() -> list[Any]:
    """The agents `preload` built flows for in this process (empty before it ran, or when TARGET did not load)."""
    return list(_PRELOADED_AGENTS)


def preload() -> list[str]:
    """Build the flow of every agent of `$DURCAP_TARGET` now and keep each as this module's attribute, so a later
    `getattr` (Prefect loading a deployment's entrypoint) finds it without loading TARGET again: the fork server of
    `durcap schedule prefect` runs this once (`_preload`), and every flow-run process it forks inherits the flows.
    Returns the attribute names.

    Raises:
        AttributeError: `$DURCAP_TARGET` unset. UnusableTarget / DurableConfigError: as `targets.load_checked`.
    """
    names = []
    for agent in _agents('preload')[1]:
        name = flow_attr(agent.name)
        globals()[name] = agent_flow(agent)
        names.append(name)
        _PRELOADED_AGENTS.append(agent)
    return names
