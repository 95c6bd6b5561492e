"""Imported once by the fork server of `durcap schedule prefect` (`_prefork`), before it forks any flow-run process:
importing this module is its purpose. It loads what a flow run's process needs before its flow starts: Prefect's
flow engine and the `prefect.engine` main's imports, pydantic-ai, durable_capabilities, `$DURCAP_TARGET`'s module and
its agents' flows (`_entry.preload`).

A failure to load TARGET is left to the flow runs: each forked process then loads it itself and reports the error in
its flow run, as a new process would. Threads do not survive a fork: if anything imported here started one (a
target module that starts a thread at import), the forked processes would run without it, so that is logged as a
warning, with the way back (`--spawn`).
"""

from __future__ import annotations

import logging
import threading

import prefect.engine  # what `python -m prefect.engine` imports before it loads the flow
import prefect.flow_engine  # noqa: F401

from . import _entry

logger = logging.getLogger(__name__)

PRELOADED: list[str] = []
"""The flow attributes of `_entry` built here (empty when TARGET did not load)."""

THREADS_AFTER_PRELOAD: list[str] = []
"""Names of the threads other than the main one running once the preload was done (expected: none)."""


def _preload() -> None:
    try:
        PRELOADED.extend(_entry.preload())
    except (Exception, SystemExit):  # every forked flow run loads TARGET again and reports it in its flow run
        logger.debug('fork server: TARGET not preloaded', exc_info=True)
    THREADS_AFTER_PRELOAD.extend(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if THREADS_AFTER_PRELOAD:
        logger.warning('fork server: loading TARGET started threads (%s): the flow-run processes forked from it run '
                       'without them; `durcap schedule prefect --spawn` starts each in a new process',
                       ', '.join(THREADS_AFTER_PRELOAD))


_preload()
