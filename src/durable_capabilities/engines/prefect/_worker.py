"""`durcap schedule prefect`: the agent's flow served as a scheduled deployment (Prefect `serve`), with the
approval deadline watcher."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect import serve as prefect_serve
from prefect.client.schemas.schedules import CronSchedule
from prefect.settings import get_current_settings
from pydantic import ValidationError

from ..._limits import one_line, printable
from ._approvals import watch_deadlines
from ._entry import entrypoint
from ._flow import agent_flow
from ._spec import TARGET_ENV, flow_name

if TYPE_CHECKING:
    from ...agent import DurableAgent


def serve(
    agent: DurableAgent[Any, Any],
    *,
    target: str,
    prompt: str,
    cron: str | None = None,
    interval_seconds: float | None = None,
    deps: dict[str, Any] | None = None,
    deployment_name: str | None = None,
) -> None:
    """Serve the agent's flow as a scheduled deployment (Prefect `serve`); blocks until interrupted.

    Also runs `watch_deadlines`: a flow run of the deployment Suspended on an approval gate is resumed (and its
    calls denied) once their deadline has passed.

    Args:
        agent: The definition (already validated).
        target: Where flow-run processes load it from (`pkg.module:attr` or `path/to/file.py:attr`):
            Prefect starts each scheduled run in a new process from the deployment's entrypoint.
        prompt: The prompt of every run. cron / interval_seconds: the schedule (exactly one).
        deps: JSON deps of every run. deployment_name: default `<agent>-scheduled`.

    Raises:
        ValueError: neither or both of `cron` and `interval_seconds` given.
    """
    if (cron is None) == (interval_seconds is None):
        raise ValueError('give exactly one of cron or interval_seconds')
    os.environ[TARGET_ENV] = target  # inherited by the processes that run each flow run
    deployment = agent_flow(agent).to_deployment(
        name=deployment_name or f'{agent.name}-scheduled',
        cron=cron,
        interval=interval_seconds,
        parameters={'prompt': prompt, 'deps': deps},
    )
    deployment.entrypoint = entrypoint(agent.name)
    watch_deadlines(agent)  # resumes suspended runs whose approval deadline passed (see PrefectApprovalGate)
    prefect_serve(deployment, print_starting_message=False)


def serve_schedule(
    agent: DurableAgent[Any, Any], *, target: str, prompt: str, cron: str | None, interval_seconds: float | None,
    deps: Any, deployment_name: str | None, notify: Callable[[str], None],
) -> None:
    """A scheduled deployment of the agent's flow, served by `prefect.serve` (see `serve`).

    Raises:
        RuntimeError: no Prefect API is configured (`PREFECT_API_URL` in the environment or the Prefect
            profile): a schedule on Prefect's temporary local server would never run.
        ValueError: `cron` is not a cron expression Prefect accepts (code DC040), checked before anything starts.
    """
    if cron is not None:
        try:
            CronSchedule(cron=cron)
        except ValidationError as exc:
            reason = exc.errors()[0]['msg'].removeprefix('Value error, ')
            raise ValueError(f'DC040 --cron {printable(repr(cron))}: not a cron expression ({one_line(reason)}); '
                             'write five fields, e.g. "0 9 * * *" (09:00 every day)') from None

    if not get_current_settings().api.url:
        raise RuntimeError('no Prefect API configured: a schedule needs a Prefect server that outlives this command. '
                           'Start one (`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api')
    notify(f'serving deployment {deployment_name or agent.name + "-scheduled"!r} of flow {flow_name(agent)} '
           f'({"cron " + cron if cron else f"every {interval_seconds:g} s"}); Ctrl-C or SIGTERM to stop')
    serve(agent, target=target, prompt=prompt, cron=cron, interval_seconds=interval_seconds, deps=deps,
          deployment_name=deployment_name)
