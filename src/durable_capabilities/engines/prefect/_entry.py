"""Importable flow entrypoints for Prefect deployments: `durable_capabilities.engines.prefect_entry:flow__<agent>`.

Prefect runs each deployment's flow run in a new process that imports the flow from the deployment's
entrypoint (a served in-memory flow would be pickled instead, and a built pydantic-ai agent does not
pickle). This module builds the flow on first attribute access from `$DURCAP_TARGET`
(any TARGET form, see `durable_capabilities.targets`), so every flow run builds its agent in its own process.
"""

from __future__ import annotations

import os
import re
from typing import Any

FLOW_ATTR_PREFIX = 'flow__'
TARGET_ENV = 'DURCAP_TARGET'


def flow_attr(agent_name: str) -> str:
    """The attribute naming an agent's flow: `flow__` + the name, other characters as `_xx` hex."""
    return FLOW_ATTR_PREFIX + re.sub(r'[^A-Za-z0-9]', lambda m: f'_{ord(m.group()):02x}', agent_name)


def entrypoint(agent_name: str) -> str:
    """The deployment entrypoint for an agent's flow."""
    return f'{__name__}:{flow_attr(agent_name)}'


def __getattr__(name: str) -> Any:
    if not name.startswith(FLOW_ATTR_PREFIX):
        raise AttributeError(name)
    from ..targets import load_checked
    from .prefect import agent_flow

    target = os.environ.get(TARGET_ENV)
    if not target:
        raise AttributeError(f'{name}: ${TARGET_ENV} is not set')
    # Like the serving process: every definition valid, and no drift from the durable.lock beside TARGET.
    agents = load_checked(target, lock=os.environ.get('DURCAP_LOCK') or None,
                          allow_drift=os.environ.get('DURCAP_ALLOW_DRIFT') == '1').agents
    for agent in agents:
        if flow_attr(agent.name) == name:
            return agent_flow(agent)
    raise AttributeError(f'{name}: no agent of this name in {target}')
