"""What the three worker entrypoints share: loading and validating `DURCAP_TARGET`."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from durable_capabilities.targets import UnusableTarget, load_checked
from durable_capabilities.validation import DurableConfigError

DEFAULT_TARGET = 'examples.support.agent:support'


def load_agents(target: str, log: Callable[[str], None], engine: str) -> list[Any]:
    """The valid agents of `target`, checked against `engine`'s names in `$DURCAP_LOCK` or the durable.lock beside
    TARGET's module file (drift allowed with `DURCAP_ALLOW_DRIFT=1`; no other engine's SDK is imported); exits 2
    (unusable target or lockfile) or 1 (definition errors, lockfile drift) otherwise."""
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
