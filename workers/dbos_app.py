"""DBOS application serving the agents named by `DURCAP_TARGET` (default: the support example).

    python workers/dbos_app.py             # run from the folder TARGET is importable from

Each agent is registered as the DBOS workflow `durcap.{agent name}` (arguments `prompt`, `deps`,
`message_history`; see `durable_capabilities.engines.dbos.agent_workflow`) before `DBOS.launch()`,
so this process recovers that agent's unfinished workflows when it starts, and it listens on a
queue that other processes enqueue runs onto with `dbos.DBOSClient`:

    client = DBOSClient(system_database_url=URL)
    handle = client.enqueue({'workflow_name': 'durcap.support', 'queue_name': 'durcap'}, prompt, deps, None)
    handle.get_result()    # {'output': ..., 'new_messages': [...], 'usage': {...}}

Environment:
    DURCAP_TARGET: `pkg.module:attr`, `path/to/file.py:attr` or a whole module (default `examples.support.agent:support`).
    DBOS_SYSTEM_DATABASE_URL: the system database (default: SQLite at `.durcap/dbos.sqlite`; use
        PostgreSQL in production).
    DURCAP_DBOS_QUEUE: the queue this app serves (default `durcap`).
    DURCAP_READY_FILE: optional; a file written once the app is launched and removed when it stops.

Invalid definitions exit 1 before launch, an unusable target exits 2; SIGTERM or SIGINT shuts DBOS
down (running workflows are recovered by the next launch) and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

if __name__ == '__main__':
    # Until this worker installs its own handler, SIGTERM ends it at once with status 0: nothing is
    # connected or written yet, and a SystemExit raised inside an import would be reported as a broken target.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

from _common import DEFAULT_TARGET
from _common import load_agents as _load_agents
from dbos import DBOS

from durable_capabilities.engines.dbos import agent_workflow, launch

APP_NAME = 'durcap'
"""The DBOS application name `durcap run --engine dbos` and `durcap demo` use too: one application."""


def log(message: str) -> None:
    print(f'dbos_app: {message}', file=sys.stderr, flush=True)


def load_agents(target: str) -> list[Any]:
    return _load_agents(target, log, 'dbos')


def main() -> None:
    target = os.environ.get('DURCAP_TARGET') or DEFAULT_TARGET
    url = os.environ.get('DBOS_SYSTEM_DATABASE_URL') or None
    queue_name = os.environ.get('DURCAP_DBOS_QUEUE') or 'durcap'
    ready = os.environ.get('DURCAP_READY_FILE')
    ready_file = Path(ready) if ready else None

    agents = load_agents(target)
    for agent in agents:
        agent_workflow(agent)  # registered before launch, as DBOS requires
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    launch(APP_NAME, system_database_url_=url)
    try:
        DBOS.register_queue(queue_name)
        log(f'ready: workflows {", ".join(f"durcap.{a.name}" for a in agents)} on queue {queue_name!r} '
            f'({"PostgreSQL" if url and url.startswith("postgres") else "SQLite"} system database, pid {os.getpid()})')
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.write_text(f'{os.getpid()}\n')
        while not stop.wait(0.5):
            pass
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        DBOS.destroy()
    log('stopped')


if __name__ == '__main__':
    main()
