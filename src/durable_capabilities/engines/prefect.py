"""Prefect: a flow per `DurableAgent`, schedules and deployments. (Filled in below.)"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..agent import DurableAgent


def durability_parts(agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """`PrefectDurability(...)` keyword arguments; no extra capability yet."""
    return dict(options), []
