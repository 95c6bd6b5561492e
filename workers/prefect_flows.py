"""Prefect: serve the flows of the agents named by `DURCAP_TARGET` (default: the support example).

    PREFECT_API_URL=http://127.0.0.1:4200/api python workers/prefect_flows.py

Each agent's flow (`durcap-{agent name}`, from `durable_capabilities.engines.prefect.agent_flow`) is
served as the deployment `durcap-{agent name}/{agent name}` by one Prefect runner (`prefect.serve`).
Start a run from anywhere that reaches the API:

    prefect deployment run 'durcap-support/support' --param prompt='Where is order ABC-123?' \
        --param deps='{"orders": {"ABC-123": "shipped"}}'

How a run executes: the runner starts `python -m prefect.engine`, which loads the flow from the
deployment's entrypoint, `durable_capabilities.engines.prefect._entry:flow__<agent name>`, built on
first access from `DURCAP_TARGET`, so every flow run builds its agent inside its own process. (`agent_flow(agent).serve()` would instead hand the in-memory flow to a spawned subprocess
through cloudpickle, and the built pydantic-ai agent does not pickle: every run would crash.)

Environment:
    DURCAP_TARGET: `pkg.module:attr`, `path/to/file.py:attr` or a whole module (default `examples.support.agent:support`).
    PREFECT_API_URL: the Prefect server's API (required: a deployment served on Prefect's ephemeral
        in-process server could not be reached by anyone).
    DURCAP_PREFECT_LIMIT: flow runs this process runs at once (Prefect's runner limit, default 5, as
        `durcap schedule prefect --limit`); other processes serving the deployment take the rest.
    DURCAP_READY_FILE: optional; a file written once every deployment is registered and removed when
        the runner stops.

Several of these processes may serve the same deployments (the manifests run 3): each runs at most
DURCAP_PREFECT_LIMIT flow runs at once, stopping one never pauses the deployments for the others, and
each watches them for flow runs left CRASHED by a process that died: one of the serving processes
reschedules such a run (at most 3 times), which then runs again from its cached tasks
(`durable_capabilities.engines.prefect.watch_crashed`, as `durcap schedule prefect`).

Run from the folder TARGET is importable from (flow runs inherit the working directory). Invalid
definitions exit 1, an unusable target or no PREFECT_API_URL exits 2, a server still unreachable after
120 s exits 3; SIGTERM or SIGINT stops the runner (Prefect's graceful shutdown) and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

if __name__ == '__main__':
    # Until this worker installs its own handler, SIGTERM ends it at once with status 0: nothing is
    # connected or written yet, and a SystemExit raised inside an import would be reported as a broken target.
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))

from _common import DEFAULT_TARGET, env_number
from _common import load_agents as _load_agents

from durable_capabilities.engines.prefect import DEFAULT_SERVE_LIMIT, TARGET_ENV, agent_flow, entrypoint, watch_crashed

CONNECT_RETRY_SECONDS = 120.0


def log(message: str) -> None:
    print(f'prefect_flows: {message}', file=sys.stderr, flush=True)


def load_agents(target: str) -> list[Any]:
    return _load_agents(target, log, 'prefect')


def _registrations(names: list[str]) -> dict[str, Any]:
    """`{deployment name: its 'updated' timestamp}` for those that exist on the server now."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    found: dict[str, Any] = {}
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                found[name] = client.read_deployment_by_name(name).updated
            except ObjectNotFound:
                pass
    return found


def _wait_for_server(api_url: str, names: list[str]) -> dict[str, Any]:
    """`_registrations(names)` once the server answers (containers starting together: up to 120 s)."""
    deadline = time.monotonic() + CONNECT_RETRY_SECONDS
    attempt = 0
    while True:
        attempt += 1
        try:
            return _registrations(names)
        except Exception as exc:  # noqa: BLE001 - any failure to reach the API
            if time.monotonic() > deadline:
                log(f'error: cannot reach {api_url}: {exc}')
                raise SystemExit(3) from None
            if attempt == 1:
                log(f'cannot reach {api_url} yet ({type(exc).__name__}); retrying for {CONNECT_RETRY_SECONDS:.0f} s')
            time.sleep(1.0)


def _mark_ready_when_registered(
    api_url: str, names: list[str], before: dict[str, Any], ready_file: Path | None, done: threading.Event,
    limit: int,
) -> None:
    """Poll the API until this process registered every deployment (each exists and its `updated`
    timestamp changed since `before`; no clock is compared), then log it and write `ready_file`."""
    while not done.is_set():
        try:
            now = _registrations(names)
        except Exception:  # noqa: BLE001 - the server is still starting
            now = {}
        if len(now) == len(names) and all(now[n] != before.get(n) for n in names):
            log(f'ready: deployments {", ".join(names)} served at {api_url} (pid {os.getpid()}, at most '
                f'{limit} flow runs at once here)')
            if ready_file is not None:
                ready_file.parent.mkdir(parents=True, exist_ok=True)
                ready_file.write_text(f'{os.getpid()}\n')
            return
        done.wait(0.5)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    target = os.environ.get('DURCAP_TARGET') or DEFAULT_TARGET
    api_url = os.environ.get('PREFECT_API_URL')
    ready = os.environ.get('DURCAP_READY_FILE')
    ready_file = Path(ready) if ready else None
    if not api_url:
        log('error: PREFECT_API_URL is not set; point it at a Prefect server (`prefect server start`)')
        raise SystemExit(2)
    limit = int(env_number('DURCAP_PREFECT_LIMIT', os.environ.get('DURCAP_PREFECT_LIMIT'), DEFAULT_SERVE_LIMIT, log,
                           minimum=1, integer=True))
    from prefect import serve

    os.environ[TARGET_ENV] = target  # flow-run processes build the agent from it (engines/prefect/_entry.py)
    agents = load_agents(target)
    deployments = []
    for agent in agents:
        deployment = agent_flow(agent).to_deployment(name=agent.name)
        deployment.entrypoint = entrypoint(agent.name)
        deployments.append(deployment)
    names = [f'{d.flow_name}/{d.name}' for d in deployments]
    before = _wait_for_server(api_url, names)
    done = threading.Event()
    watcher = threading.Thread(
        target=_mark_ready_when_registered, args=(api_url, names, before, ready_file, done, limit), daemon=True
    )
    # From here until Prefect's runner installs its own SIGTERM handler (when `Runner.start` begins, after
    # the deployments are registered and the ready file may already be written), SIGTERM unwinds through
    # the `finally` below instead of the import-time `os._exit(0)`, so the ready file is always removed.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        watcher.start()
        for deployment in deployments:
            watch_crashed(deployment.name, deployment.flow_name, log)
        # Shared with the other serving processes: at most `limit` flow runs here, and no pause on the way out
        # (Prefect's default pauses the deployments, for every process serving them).
        serve(*deployments, print_starting_message=False, pause_on_shutdown=False, limit=limit)
    except KeyboardInterrupt:
        pass
    finally:
        done.set()
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    log('stopped')


if __name__ == '__main__':
    main()
