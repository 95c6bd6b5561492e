"""DBOS in this process: the system database (`system_database_url`), executor ids, `launch` (after the durable.lock
check) and the application version a launch runs as."""

from __future__ import annotations

import hashlib
import os
import socket
import sqlite3
import uuid
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dbos import DBOS

from ... import _upstream
from ..._limits import is_digits, private_file
from ...lockfile import enforce_lock
from ._spec import APP_NAME, DB_ENV, DEFAULT_SQLITE_PATH, ENGINE, RUN_EXECUTOR_PREFIX
from ._workflow import _PREVIOUS_NAME_WORKFLOWS, BoundAgent

if TYPE_CHECKING:
    from ...agent import DurableAgent


def system_database_file(url: str | None = None) -> Path | None:
    """The SQLite file the system database of `url` lives in, without creating anything: `url`, else
    `$DURCAP_DBOS_DB`, else `DEFAULT_SQLITE_PATH` (as `system_database_url` resolves them); `None` for a database
    that is not a SQLite file (PostgreSQL, `sqlite:///:memory:`)."""
    url = url or os.environ.get(DB_ENV) or None
    if url is None:
        return DEFAULT_SQLITE_PATH
    parsed = url.split('?', 1)[0]
    if parsed.startswith('sqlite:///') and parsed[len('sqlite:///'):] not in ('', ':memory:'):
        return Path(parsed[len('sqlite:///'):])
    return None


def system_database_url(url: str | None = None, *, create: bool = True) -> str:
    """`url`, else `$DURCAP_DBOS_DB` (the default of every command's `--db`, `settings.py`), else SQLite at
    `.durcap/dbos.sqlite` (folder created 0700, file 0600, WAL journal mode). A SQLite URL naming a file that does
    not exist yet gets the same private folder and file; with `create=False` nothing is created (a client that only
    hands runs to a queue: the workers create the system database)."""
    url = url or os.environ.get(DB_ENV) or None
    if not create:
        return url or f'sqlite:///{DEFAULT_SQLITE_PATH.resolve()}'
    if url:
        if (path := system_database_file(url)) is not None:
            private_file(path)
        return url
    private_file(DEFAULT_SQLITE_PATH)
    # WAL journal mode (persistent in the file): each step commit no longer syncs the whole journal,
    # measured 1.5-2.1 ms per step against 2-16 ms under other I/O in the default mode.
    with closing(sqlite3.connect(DEFAULT_SQLITE_PATH)) as conn:
        conn.execute('PRAGMA journal_mode=WAL')
    return f'sqlite:///{DEFAULT_SQLITE_PATH.resolve()}'



def one_shot_executor_id() -> str:
    """A fresh executor id for one process that runs one workflow and exits: DBOS recovers, at launch, only
    the pending workflows of the launching executor id, so a one-shot run recovers nothing it will not
    finish, and its own run (if the process dies) is left to `durcap runs resume` / a worker."""
    return f'{RUN_EXECUTOR_PREFIX}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}'


def executor_process_gone(executor_id: str | None) -> bool:
    """Whether `executor_id` is a one-shot `durcap run` executor of this host whose process no longer exists."""
    prefix = f'{RUN_EXECUTOR_PREFIX}-{socket.gethostname()}-'
    if not executor_id or not executor_id.startswith(prefix):
        return False
    pid_text = executor_id[len(prefix):].split('-', 1)[0]
    if not is_digits(pid_text):
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def launch(
    name: str = APP_NAME,
    *,
    system_database_url_: str | None = None,
    agents: Sequence[DurableAgent[Any, Any]] = (),
    lock: str | Path | None = None,
    allow_drift: bool = False,
    one_shot: bool = False,
    listen: Sequence[str] = (),
    serving: Sequence[DurableAgent[Any, Any]] = (),
    **config: Any,
) -> DBOS:
    """Configure and launch DBOS (call after every agent was built and every workflow decorated).

    Args:
        name: DBOS application name.
        system_database_url_: PostgreSQL or SQLite URL; default SQLite at `.durcap/dbos.sqlite`.
        agents: The definitions this app serves; checked against `lock` (or `./durable.lock`) first, so a
            rename cannot strand workflows DBOS would recover at launch (the lock's DBOS names: no other engine's SDK
            is imported).
        lock / allow_drift: See `lockfile.enforce_lock`.
        one_shot: This process runs its own workflow and exits: a fresh executor id (`one_shot_executor_id`, unless
            `config['executor_id']` is given) so launch recovers no one else's pending workflows, and no user queue
            is served but those named in `listen` (`DBOS.listen_queues`), so work handed to a worker's queue stays there.
        config: Other `DBOSConfig` keys (`log_level` defaults to `'WARNING'`; `executor_id` defaults to DBOS's
            `local`, whose pending workflows launch recovers; `application_version` defaults to
            `application_version(name, serving)`, which stays the same when an agent is renamed with `previous_names`).
        serving: The agents this process serves from a shared queue (`durcap worker dbos`): its application version
            names them (`application_version`), so DBOS hands it only their runs.

    Returns:
        The `DBOS` instance.
    """
    for agent in agents:
        BoundAgent(agent)  # claims its names (DC011 against another definition of the same name)
    if agents:
        enforce_lock(agents, lock, allow_drift=allow_drift, engines=(ENGINE,))  # DBOS's names only
    config.setdefault('log_level', 'WARNING')
    if config.get('application_version') is None and not os.environ.get('DBOS__APPVERSION') and not config.get('enable_patching'):
        config['application_version'] = application_version(name, serving)
    if one_shot and not config.get('executor_id'):
        config['executor_id'] = one_shot_executor_id()
    dbos = DBOS(config={'name': name, 'system_database_url': system_database_url(system_database_url_), **config})  # type: ignore[typeddict-item]
    if one_shot:
        DBOS.listen_queues(list(listen))
    DBOS.launch()
    return dbos


VERSION_PREFIX = 'durcap:'
"""How the application version of a process serving named agents begins: `durcap:{names}:{digest}`."""


def application_version(name: str = APP_NAME, serving: Sequence[DurableAgent[Any, Any]] = ()) -> str:
    """The DBOS application version `launch(name)` runs as unless one is configured.

    DBOS recovers a pending workflow only in a process of the version that recorded it, and by default computes
    the version from the sources of every registered workflow. Registering an agent's previous names
    (`DurableAgent(previous_names=[...])`) adds a workflow per name, which changed the version, so a workflow in
    flight when the agent was renamed was never recovered. This is DBOS's own computation over the registered
    workflows except those registered only for previous names: the same as DBOS's default when no agent was
    renamed, and unchanged by a rename that keeps the old name in `previous_names`. A change to any other workflow
    (your own `@DBOS.workflow` functions included) still changes it, as DBOS intends.

    Every agent's workflow has the same source (one function of this package), so that computation alone gave two
    workers serving different agents on one system database one version, and DBOS let either take the other's runs
    (a run of agent A taken by agent B's worker stayed PENDING there). A process serving agents (`serving`) runs as
    `durcap:{their durable names, +-joined}:{digest}`: the digest covers DBOS's computation, those names and each
    agent's DBOS step names (what `durable.lock` records for it, checked at worker start), so it identifies the
    agents and their lock, and stays the same across a rename with `previous_names` (durable names are the oldest
    kept). `durcap run --queue` enqueues a run with the latest version naming its agent (`version_serving`).

    Args:
        name: The DBOS application name.
        serving: The agents the process serves (none: DBOS's computation alone, as before).

    Returns:
        A 32-character hex string (DBOS's MD5 form), or `durcap:NAMES:DIGEST` when `serving` names agents.
        `DBOSConfig['application_version']` or `$DBOS__APPVERSION` override it, as they override DBOS's default.
    """
    base = _upstream.dbos_application_version(name, _PREVIOUS_NAME_WORKFLOWS)
    if not serving:
        return base
    from ._durability import durable_names

    names = sorted({agent.durable_name for agent in serving})
    digest = hashlib.md5(base.encode(), usedforsecurity=False)
    for agent in sorted(serving, key=lambda a: a.durable_name):
        digest.update(f'\n{agent.durable_name}\n'.encode())
        digest.update('\n'.join(sorted(durable_names(agent).get('steps', []))).encode())
    return f'{VERSION_PREFIX}{"+".join(names)}:{digest.hexdigest()}'


def version_serving(versions: Sequence[str], agent: DurableAgent[Any, Any]) -> str | None:
    """The first of `versions` (DBOS application versions, newest first) whose process serves `agent`
    (`application_version` with `serving`), else `None`."""
    for version in versions:
        if version.startswith(VERSION_PREFIX):
            names = version[len(VERSION_PREFIX):].rsplit(':', 1)[0].split('+')
            if agent.durable_name in names:
                return version
    return None

