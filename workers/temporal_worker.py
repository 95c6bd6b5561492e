"""Temporal worker for the agents named by `DURCAP_TARGET` (default: the support example).

    python workers/temporal_worker.py      # run from the folder TARGET is importable from

Environment:
    DURCAP_TARGET: `pkg.module:attr` or `path/to/file.py:attr` (a `DurableAgent` or a list of them), or a whole module
        (default `examples.support.agent:support`).
    DURCAP_TEMPORAL_ADDRESS: Temporal frontend `HOST:PORT` (default `127.0.0.1:7233`).
    DURCAP_TASK_QUEUE: task queue to poll (default `durcap`).
    DURCAP_GRACEFUL_SHUTDOWN: seconds in-flight activities get to finish after SIGTERM (default 30, as
        `durcap worker temporal --graceful-shutdown`).
    DURCAP_READY_FILE: optional; a file written once the worker polls and removed when it stops
        (readiness probes, `deploy/local/up`).

The definitions are validated first (every engine's checks); the worker refuses to start on an error
(exit 1). An unusable target exits 2. While the Temporal server is not reachable yet (containers
starting together) the worker retries for 120 s. SIGTERM or SIGINT drains in-flight activities and
exits 0. Run as many as you like on one task queue: Temporal spreads the tasks over them, and a lost
worker's tasks are retried on the others.
"""

from __future__ import annotations

import asyncio
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

from durable_capabilities.engines.temporal import run_worker

CONNECT_RETRY_SECONDS = 120.0


def log(message: str) -> None:
    print(f'temporal_worker: {message}', file=sys.stderr, flush=True)


def load_agents(target: str) -> list[Any]:
    return _load_agents(target, log, 'temporal')


async def serve(agents: list, *, address: str, task_queue: str, ready_file: Path | None,
                graceful_shutdown: float = DEFAULT_GRACEFUL_SHUTDOWN) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + CONNECT_RETRY_SECONDS
    attempt = 0
    while True:
        attempt += 1
        # `run_worker` installs its own SIGTERM/SIGINT handlers once connected; until then, ours.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        ready = asyncio.Event()
        worker = asyncio.create_task(run_worker(agents, task_queue=task_queue, address=address, ready=ready,
                                                graceful_shutdown_seconds=graceful_shutdown))
        waiter = asyncio.create_task(ready.wait())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({worker, waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        stopper.cancel()
        if ready.is_set():
            break
        if stop.is_set():
            worker.cancel()
            log('stopped before connecting')
            return
        exc = worker.exception()
        if not isinstance(exc, (RuntimeError, OSError)) or loop.time() > deadline:
            raise exc  # type: ignore[misc]
        if attempt == 1:
            log(f'cannot reach {address} yet ({str(exc).splitlines()[0]}); retrying for {CONNECT_RETRY_SECONDS:.0f} s')
        await asyncio.sleep(1.0)
    names = ', '.join(a.name for a in agents)
    log(f'ready: {names} on task queue {task_queue!r} at {address} (pid {os.getpid()}; drains up to '
        f'{graceful_shutdown:g} s on SIGTERM)')
    if ready_file is not None:
        ready_file.parent.mkdir(parents=True, exist_ok=True)
        ready_file.write_text(f'{os.getpid()}\n')
    try:
        await worker
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    log('stopped')


def main() -> None:
    target = os.environ.get('DURCAP_TARGET') or DEFAULT_TARGET
    address = os.environ.get('DURCAP_TEMPORAL_ADDRESS') or '127.0.0.1:7233'
    task_queue = os.environ.get('DURCAP_TASK_QUEUE') or 'durcap'
    ready_file = os.environ.get('DURCAP_READY_FILE')
    graceful = env_number('DURCAP_GRACEFUL_SHUTDOWN', os.environ.get('DURCAP_GRACEFUL_SHUTDOWN'),
                          DEFAULT_GRACEFUL_SHUTDOWN, log)
    agents = load_agents(target)
    try:
        asyncio.run(serve(agents, address=address, task_queue=task_queue,
                          ready_file=Path(ready_file) if ready_file else None, graceful_shutdown=graceful))
        code = 0
    except (RuntimeError, OSError) as exc:
        log(f'error: cannot serve {address}: {exc}')
        code = 3
    # Skip interpreter finalization: the Temporal client's Rust threads can still call into Python
    # while it tears down, which aborts the process ("Fatal Python error: PyGILState_Release", SIGABRT;
    # temporalio/sdk-python#300). The worker has drained and stopped by now.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == '__main__':
    main()
