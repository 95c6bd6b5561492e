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

import importlib
import logging
import threading

import prefect.engine  # what `python -m prefect.engine` imports before it loads the flow
import prefect.flow_engine  # noqa: F401
from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY

from ... import _upstream
from . import _entry

logger = logging.getLogger(__name__)

PRELOADED: list[str] = []
"""The flow attributes of `_entry` built here (empty when TARGET did not load)."""

THREADS_AFTER_PRELOAD: list[str] = []
"""Names of the threads other than the main one running once the preload was done (expected: none)."""

WARM_MODULES = (
    'prefect.task_engine',  # imported by a task's first call (`Task.__call__`), with the next one (graphviz)
    'prefect.utilities.visualization',
    'prefect.concurrency._asyncio',
    'prefect.concurrency._sync',
    'prefect.concurrency.services',
    'prefect._internal.observers',  # the flow engine's suspension observer
    'prefect._internal._observation_delivery',
    'prefect._internal.states',
    'prefect._vendor.croniter',
    'pytz',
    'anyio._backends._asyncio',  # the first event loop's anyio backend
    'anyio.streams.stapled',
    'encodings.idna',  # the first request's host name
    'encodings.ascii',
    'rich._emoji_codes',  # Prefect's console log handler's first markup
    'durable_capabilities.streams._log',  # the run's event stream (`streams.publishing`)
)
"""Modules that every flow-run process imported on its first use when forked from a fork server without them
(measured: a child's new `sys.modules`, h/prefectscale); one missing from this Prefect or pydantic-ai is skipped."""

WARMED: list[str] = []
"""What `_warm` loaded or built (modules, store dialects, `ModelMessagesTypeAdapter`)."""


def _warm() -> None:
    """Load here, once, what every flow run's process otherwise loads or builds on its first use (~0.2-0.3 CPU-s a
    flow run before this, measured with cProfile in the forked children, h/prefectscale): `WARM_MODULES`, the SQL
    dialect and driver of each preloaded agent's conversation store (its `$DURCAP_STORE` or own URL: the SQLite
    dialect package alone is ~0.15 CPU-s), and pydantic-ai's message adapter, whose schema is built on first use
    (`defer_build`; ~0.2 CPU-s). Nothing here connects, starts a thread or makes an event loop; each step that fails
    is left to the flow runs, which then do it themselves as before."""
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
            WARMED.append(name)
        except Exception:  # moved or gone in this version: the flow runs import what they use
            logger.debug('fork server: %s not preloaded', name, exc_info=True)
    try:  # every Prefect client of a flow run then shares the fork server's TLS context (~20 ms of CPU each)
        import certifi  # Prefect's default CA file

        shim = _upstream.prefect_share_tls_contexts()
        if not PREFECT_API_TLS_INSECURE_SKIP_VERIFY.value():  # Prefect's own choice of CA file
            shim.create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where())
        WARMED.append('TLS context')
    except Exception:  # each client builds its own
        logger.debug('fork server: TLS context not shared', exc_info=True)
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    from ...conversations import store_url
    from ...store._sql import _parse_url

    for agent in _entry.preloaded_agents():
        try:
            dialect = _parse_url(store_url(agent)).get_dialect()
            dialect.import_dbapi()  # the driver module (sqlite3, psycopg): imported, not connected
            WARMED.append(f'store dialect {dialect.name}')
        except Exception:  # a bad or driverless URL: each flow run reports it as before
            logger.debug('fork server: store dialect of %s not preloaded', agent.name, exc_info=True)
    try:
        ModelMessagesTypeAdapter.validate_python([])  # builds its deferred validator and serializer
        WARMED.append('ModelMessagesTypeAdapter')
    except Exception:  # built by the first flow run instead
        logger.debug('fork server: message adapter not built', exc_info=True)


def _preload() -> None:
    try:
        PRELOADED.extend(_entry.preload())
    except (Exception, SystemExit):  # every forked flow run loads TARGET again and reports it in its flow run
        logger.debug('fork server: TARGET not preloaded', exc_info=True)
    _warm()
    THREADS_AFTER_PRELOAD.extend(t.name for t in threading.enumerate() if t is not threading.main_thread())
    if THREADS_AFTER_PRELOAD:
        logger.warning('fork server: loading TARGET started threads (%s): the flow-run processes forked from it run '
                       'without them; `durcap schedule prefect --spawn` starts each in a new process',
                       ', '.join(THREADS_AFTER_PRELOAD))


_preload()
