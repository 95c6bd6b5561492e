"""What the three worker entrypoints share: loading and validating `DURCAP_TARGET`, numbers from the environment."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from durable_capabilities.targets import UnusableTarget, load_checked
from durable_capabilities.validation import DurableConfigError

DEFAULT_TARGET = 'examples.support.agent:support'

DEFAULT_GRACEFUL_SHUTDOWN = 30.0
"""Seconds a worker drains after SIGTERM (`DURCAP_GRACEFUL_SHUTDOWN`), as `durcap worker --graceful-shutdown`. The
manifests' termination grace periods are longer (drain + margin), so a container is never killed mid-drain."""


def load_agents(target: str, log: Callable[[str], None], engine: str) -> list[Any]:
    """The valid agents of `target`, checked against `engine`'s names in `$DURCAP_LOCK` or the durable.lock beside
    TARGET's module file (drift allowed with `DURCAP_ALLOW_DRIFT=1`; no other engine's SDK is imported); exits 2
    (unusable target or lockfile) or 1 (definition errors, lockfile drift) otherwise. Telemetry is configured from
    the `OTEL_*` variables first (`telemetry.configure_from_env`; an unusable value exits 2)."""
    from durable_capabilities import telemetry
    from durable_capabilities._limits import InputError

    try:  # OTEL_* variables: spans and metrics exported (docs/tracing.md), flushed at exit; before any agent is built
        telemetry.configure_from_env(f'durcap-{engine}-worker')
    except InputError as exc:
        log(f'error: {exc}')
        raise SystemExit(2) from None
    try:
        loaded = load_checked(target, lock=os.environ.get('DURCAP_LOCK') or None,
                              allow_drift=os.environ.get('DURCAP_ALLOW_DRIFT') == '1', engines=(engine,))
    except UnusableTarget as exc:
        log(f'error: {exc}')
        raise SystemExit(2) from None
    except DurableConfigError as exc:
        log(f'not started, {target} has errors:\n' + '\n'.join(f'  {p.code} {p.where}: {p.message}' for p in exc.report.errors))
        raise SystemExit(1) from None
    return loaded.agents


def env_number(name: str, raw: str | None, default: float, log: Callable[[str], None], *, minimum: float = 0,
               integer: bool = False) -> float:
    """`raw` (the value of environment variable `name`) as a number `>= minimum`, `default` when unset or empty.

    Args:
        name: The variable's name (named in the error).
        raw: Its value, `os.environ.get(name)`.
        default: The value when unset.
        log: Where the error goes.
        minimum: The smallest accepted value.
        integer: Whether only whole numbers are accepted.

    Returns:
        The number (an `int` value when `integer`).

    Raises:
        SystemExit: 2, after logging one line naming the variable and what it accepts.
    """
    if raw is None or not raw.strip():
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or value != value or value < minimum:
        kind = 'a whole number' if integer else 'a number'
        log(f'error: {name}={raw!r} is not {kind} >= {minimum:g}; set it to one (or unset it for {default:g})')
        raise SystemExit(2)
    return value
