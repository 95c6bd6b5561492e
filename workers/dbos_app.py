"""DBOS application serving the agents named by `DURCAP_TARGET` (default: the support example).

    python workers/dbos_app.py             # run from the folder TARGET is importable from

The environment-configured form of `durcap worker dbos`, and served by the same code
(`durable_capabilities.engines.dbos` `serve_worker`): each agent is registered as the DBOS workflow
`durcap.{agent name}` (arguments `prompt`, `deps`, `message_history`; see
`durable_capabilities.engines.dbos.agent_workflow`) before `DBOS.launch()`, so this process recovers
the unfinished workflows of its executor id when it starts, and it serves a queue that other processes
enqueue runs onto (`durcap run --engine dbos --queue durcap`, or `dbos.DBOSClient`):

    client = DBOSClient(system_database_url=URL)
    handle = client.enqueue({'workflow_name': 'durcap.support', 'queue_name': 'durcap'}, prompt, deps, None)
    handle.get_result()    # {'output': ..., 'new_messages': [...], 'usage': {...}}

Several of these processes share one system database and queue: each takes at most
`DURCAP_DBOS_CONCURRENCY` runs at once (so the rest go to the others), beats in the system database,
and recovers the pending workflows of a peer silent for `DURCAP_DBOS_PEER_TIMEOUT` seconds. Give each
its own `DURCAP_DBOS_EXECUTOR_ID` (the pod name, the compose service name): two live processes with one
id cannot notice each other's death.

Environment:
    DURCAP_TARGET: `pkg.module:attr`, `path/to/file.py:attr` or a whole module (default `examples.support.agent:support`).
    DBOS_SYSTEM_DATABASE_URL: the system database (default: SQLite at `.durcap/dbos.sqlite`; use
        PostgreSQL in production, and always with several processes).
    DURCAP_DBOS_QUEUE: the queue this app serves (default `durcap`).
    DURCAP_DBOS_EXECUTOR_ID: this process's DBOS executor id (default `local`, DBOS's own default).
    DURCAP_DBOS_CONCURRENCY: runs this process takes from the queue at once (DBOS `worker_concurrency`, default 8).
    DURCAP_DBOS_PEER_TIMEOUT: seconds without a peer's heartbeat before its pending workflows are recovered
        here (default 15; 0 turns peer recovery off).
    DURCAP_GRACEFUL_SHUTDOWN: seconds running workflows get to finish after SIGTERM (default 30).
    DURCAP_READY_FILE: optional; a file written once the app serves and removed when it stops.

Invalid definitions exit 1 before launch, an unusable target or setting exits 2, a system database
that cannot be served exits 3; SIGTERM or SIGINT drains (up to DURCAP_GRACEFUL_SHUTDOWN seconds; what
is still running then is named in one line and recovered later, by this executor id's next launch or a peer) and
exits 0 (unlike `durcap worker dbos`, which exits 1 then: a pod stopped by a rolling update is not a failure).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

if __name__ == '__main__':
    # Until this worker installs its own handler, SIGTERM ends it at once with status 0: nothing is
    # connected or written yet, and a SystemExit raised inside an import would be reported as a broken target.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

from _common import DEFAULT_GRACEFUL_SHUTDOWN, DEFAULT_TARGET, env_number
from _common import load_agents as _load_agents

from durable_capabilities.engines import DrainCutShortError, RunOptions
from durable_capabilities.engines.dbos import ADAPTER

DEFAULT_EXECUTOR_ID = 'local'
DEFAULT_CONCURRENCY = 8
DEFAULT_PEER_TIMEOUT = 15.0


def log(message: str) -> None:
    print(f'dbos_app: {message}', file=sys.stderr, flush=True)


def load_agents(target: str) -> list[Any]:
    return _load_agents(target, log, 'dbos')


def main() -> None:
    target = os.environ.get('DURCAP_TARGET') or DEFAULT_TARGET
    url = os.environ.get('DBOS_SYSTEM_DATABASE_URL') or None
    queue_name = os.environ.get('DURCAP_DBOS_QUEUE') or 'durcap'
    executor_id = (os.environ.get('DURCAP_DBOS_EXECUTOR_ID') or '').strip() or DEFAULT_EXECUTOR_ID
    concurrency = env_number('DURCAP_DBOS_CONCURRENCY', os.environ.get('DURCAP_DBOS_CONCURRENCY'),
                             DEFAULT_CONCURRENCY, log, minimum=1, integer=True)
    peer_timeout = env_number('DURCAP_DBOS_PEER_TIMEOUT', os.environ.get('DURCAP_DBOS_PEER_TIMEOUT'),
                              DEFAULT_PEER_TIMEOUT, log)
    graceful = env_number('DURCAP_GRACEFUL_SHUTDOWN', os.environ.get('DURCAP_GRACEFUL_SHUTDOWN'),
                          DEFAULT_GRACEFUL_SHUTDOWN, log)
    ready = os.environ.get('DURCAP_READY_FILE')
    ready_file = Path(ready) if ready else None

    def mark_ready() -> None:
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.write_text(f'{os.getpid()}\n')

    agents = load_agents(target)
    settings = {'db': url, 'executor_id': executor_id, 'task_queue': queue_name, 'concurrency': int(concurrency),
                'peer_timeout': peer_timeout, 'graceful_shutdown': graceful, 'ready': mark_ready}
    code = 0
    try:
        # Installs its own SIGTERM / SIGINT handlers before DBOS launches; returns once drained.
        ADAPTER.serve_worker(agents, RunOptions(settings=settings, notify=log))
    except (OSError, RuntimeError) as exc:
        log(f'error: cannot serve the system database: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}')
        code = 3
    except DrainCutShortError as exc:  # a rolling update's normal case: a peer recovers them (still exit 0)
        log(str(exc))
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    if code == 0:
        log('stopped')
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalization: it would wait for the thread of a workflow the drain gave up on, while this
    # executor no longer beats (a peer recovers that workflow once the heartbeat is stale).
    os._exit(code)


if __name__ == '__main__':
    main()
