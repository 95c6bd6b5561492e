"""Prefect deployment driver for the suspend tests (run as `python -m tests.engines.prefect_deploy_driver CMD ...`).

- `serve TARGET NAME DEPLOYMENT`: serve agent NAME's flow (from TARGET) as deployment DEPLOYMENT without a
  schedule (`prefect.serve`, flow runs in processes forked from the preloaded fork server, `_prefork`, that load the
  flow from the deployment's entrypoint, and `watch_deadlines` every second, as `durcap schedule prefect`); prints
  `SERVING` once the deployment is registered. Blocks until killed.
- `start DEPLOYMENT PROMPT [PROMPT ...]`: `run_deployment(..., timeout=0)` for each prompt, in order; prints
  `FLOW RUN <id>` for each (one process, one Prefect import, however many runs).
- `state RUN_ID`: prints `STATE <state name>`, and `OUTPUT <json>` once Completed.

Every command talks to `$PREFECT_API_URL`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid


def serve(target: str, agent_name: str, deployment_name: str) -> None:
    from prefect import serve as prefect_serve

    from durable_capabilities.engines.prefect import TARGET_ENV, agent_flow, entrypoint, watch_deadlines
    from durable_capabilities.engines.prefect._prefork import start_fork_server
    from durable_capabilities.targets import load_checked

    os.environ[TARGET_ENV] = target  # inherited by each flow run's process
    start_fork_server(lambda line: print(line, file=sys.stderr, flush=True), target)
    [agent] = [a for a in load_checked(target).agents if a.name == agent_name]
    deployment = agent_flow(agent).to_deployment(name=deployment_name)
    deployment.entrypoint = entrypoint(agent.name)
    watch_deadlines(agent, deployment.apply(), every=1.0)
    print('SERVING', flush=True)
    prefect_serve(deployment, print_starting_message=False)


async def start(deployment: str, *prompts: str) -> None:
    from prefect.deployments import run_deployment

    for prompt in prompts:
        flow_run = await run_deployment(deployment, parameters={'prompt': prompt}, timeout=0)  # pyright: ignore[reportGeneralTypeIssues]
        print('FLOW RUN', flow_run.id, flush=True)


async def state(run_id: str) -> None:
    from prefect import get_client

    async with get_client() as client:
        run = await client.read_flow_run(uuid.UUID(run_id))
    print('STATE', run.state.name if run.state else '-', flush=True)
    if run.state is not None and run.state.is_completed():
        print('OUTPUT', json.dumps((await run.state.result())['output']), flush=True)  # pyright: ignore[reportGeneralTypeIssues]


if __name__ == '__main__':
    command, *args = sys.argv[1:]
    if command == 'serve':
        serve(*args)
    elif command == 'start':
        asyncio.run(start(*args))
    else:
        asyncio.run(state(*args))
