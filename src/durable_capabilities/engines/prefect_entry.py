"""The deployment entrypoint module of durable-capabilities 0.2: `durable_capabilities.engines.prefect_entry:flow__<agent>`.

Deployments registered by 0.2 point here; the flows now live in `engines.prefect._entry`. This module forwards
every attribute there, so those deployments keep running (new deployments name `engines.prefect._entry`).
The module `__getattr__` is the forwarding itself (Prefect resolves `module:attribute` with `getattr`), not a way
around an import cycle.
"""

from __future__ import annotations

from typing import Any

from .prefect import _entry


def __getattr__(name: str) -> Any:
    """`flow__<agent name>` (and any other name of `engines.prefect._entry`), from there.

    Raises:
        AttributeError: as `engines.prefect._entry` raises it (not a flow attribute, `$DURCAP_TARGET` unset, no
            agent of that name).
    """
    return getattr(_entry, name)
