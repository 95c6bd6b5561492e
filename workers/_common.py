"""What the three worker entrypoints share: loading and validating `DURCAP_TARGET`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from durable_capabilities import validate_together
from durable_capabilities.cli import UnusableTarget, load_target, target_file
from durable_capabilities.lockfile import enforce_lock
from durable_capabilities.validation import DurableConfigError

DEFAULT_TARGET = 'examples.support.agent:support'


def load_agents(target: str, log: Callable[[str], None]) -> list[Any]:
    """The valid agents of `target`; exits 2 (unusable target) or 1 (definition errors) otherwise."""
    try:
        agents, _ = load_target(target)
    except UnusableTarget as exc:
        log(f'error: {exc}')
        raise SystemExit(2) from None
    except DurableConfigError as exc:
        log(f'not started, {target} has errors:\n{exc}')
        raise SystemExit(1) from None
    report = validate_together(agents)
    try:
        # Like `durcap worker temporal`: refuse to serve on drift from the lockfile beside the target.
        report.extend(enforce_lock(agents, os.environ.get('DURCAP_LOCK') or None, target_file=target_file(target),
                                   allow_drift=os.environ.get('DURCAP_ALLOW_DRIFT') == '1'))
    except DurableConfigError as exc:
        report.extend(exc.report)
    if not report.ok:
        log(f'not started, {target} has errors:\n' + '\n'.join(f'  {p.code} {p.where}: {p.message}' for p in report.errors))
        raise SystemExit(1)
    return agents
