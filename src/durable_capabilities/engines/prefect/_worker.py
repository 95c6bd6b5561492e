"""`durcap schedule prefect`: the agent's flow served as a scheduled deployment (Prefect `serve`), with the
approval deadline watcher and the crashed-run watcher.

Several serving processes may serve one deployment (issue 29 item 3): each takes at most `limit` flow runs at once
(Prefect's runner limit; `durcap schedule prefect --limit`, default `DEFAULT_SERVE_LIMIT`), stopping one leaves the
deployment running for the others (`pause_on_shutdown=False`: Prefect's default pauses the deployment they share),
and each watches the deployment for flow runs left CRASHED by a process that died, or left PENDING or RUNNING by one
that died with no word (`watch_crashed`, `_liveness`): one of them claims the crash and reschedules the run, which a
serving process then runs again from its cached tasks."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefect import get_client
from prefect import serve as prefect_serve
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.schedules import CronSchedule
from prefect.settings import get_current_settings
from prefect.states import Scheduled
from pydantic import ValidationError

from ..._limits import one_line, printable
from ._approvals import watch_deadlines
from ._entry import entrypoint
from ._flow import agent_flow
from ._liveness import DeadRunWatch, claim, settle, stale_seconds
from ._prefork import FACTS, beat_spawned, share_tls_contexts, start_fork_server
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
    limit: int | None = None,
    notify: Callable[[str], None] | None = None,
    spawn: bool = False,
) -> None:
    """Serve the agent's flow as a scheduled deployment (Prefect `serve`); blocks until interrupted.

    Also runs `watch_deadlines` (a flow run of the deployment Suspended on an approval gate is resumed, and its
    calls denied, once their deadline has passed) and `watch_crashed` (a flow run left CRASHED by a dead process is
    rescheduled, by one serving process). Stopping this process does not pause the deployment.

    Args:
        agent: The definition (already validated).
        target: Where flow-run processes load it from (`pkg.module:attr` or `path/to/file.py:attr`):
            Prefect starts each scheduled run in a new process from the deployment's entrypoint.
        prompt: The prompt of every run. cron / interval_seconds: the schedule (exactly one).
        deps: JSON deps of every run. deployment_name: default `<agent>-scheduled`.
        limit: Flow runs this process runs at once (default `DEFAULT_SERVE_LIMIT`).
        notify: Where the crashed-run watcher reports a reschedule, and the fork server its start (default: the
            log).
        spawn: Start each flow run as Prefect does, a new Python process (`python -m prefect.engine`), instead of
            forking it from this process's preloaded fork server (`_prefork`, the default).

    Raises:
        ValueError: neither or both of `cron` and `interval_seconds` given.
    """
    if (cron is None) == (interval_seconds is None):
        raise ValueError('give exactly one of cron or interval_seconds')
    os.environ[TARGET_ENV] = target  # inherited by the processes that run each flow run (and the fork server)
    notify = notify or logging.getLogger(__name__).warning
    share_tls_contexts()
    FACTS.read_now()  # what each flow run's process need not ask the server (`_prefork.ServerFacts`)
    # The fork server preloads while nothing else runs; flow runs fork from it. Without one, the serving process
    # beats each run while its new Python process loads (a silent PENDING run is declared dead: `_liveness`).
    if spawn or start_fork_server(notify, target) is None:
        beat_spawned()
    deployment = agent_flow(agent).to_deployment(
        name=deployment_name or f'{agent.name}-scheduled',
        cron=cron,
        interval=interval_seconds,
        parameters={'prompt': prompt, 'deps': deps},
    )
    deployment.entrypoint = entrypoint(agent.name)
    watch_deadlines(agent)  # resumes suspended runs whose approval deadline passed (see PrefectApprovalGate)
    watch_crashed(deployment.name, flow_name(agent), notify)
    prefect_serve(deployment, print_starting_message=False, pause_on_shutdown=False,
                  limit=limit or DEFAULT_SERVE_LIMIT)


DEFAULT_SERVE_LIMIT = 5
"""Flow runs one `durcap schedule prefect` process runs at once (Prefect's runner limit; Prefect's own workers cap at
5 by default, where `serve` without a limit has none)."""

MAX_CRASH_RESUMES = 3
"""How many times `watch_crashed` reschedules one flow run (its `run_count` counts the tries): a run that crashes
every time (a tool that kills its process) is left CRASHED for an operator after that."""

CRASH_CLAIM_PREFIX = 'durcap-crash-resume-'
"""Flow run input key prefix of a crash claim (`CRASH_CLAIM_PREFIX` + the crashed state's id). Flow run inputs are
write-once on the server, so of several serving processes that see one crash, exactly one creates the key."""


async def resume_crashed(deployment_name: str, flow: str, notify: Callable[[str], None]) -> list[str]:
    """Reschedule each CRASHED flow run of the deployment that this process claims (`reschedule_crashed`); returns
    the ids rescheduled here."""
    async with get_client() as client:
        deployment = await client.read_deployment_by_name(f'{flow}/{deployment_name}')
        runs = await client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CRASHED]))))
        return await reschedule_crashed(client, runs, notify)


async def reschedule_crashed(client: Any, runs: list[Any], notify: Callable[[str], None]) -> list[str]:
    """Reschedule each CRASHED flow run of `runs` (Prefect `FlowRun`s; others are skipped) that this process claims.

    Returns the ids rescheduled here. A crash is claimed by creating flow run input `CRASH_CLAIM_PREFIX` + the
    crashed state's id (a 409 means another process claimed it); the claimed run is set SCHEDULED without force,
    which Prefect accepts from CRASHED for a run of a deployment, at its first scheduled time (`expected_start_time`:
    it keeps its place ahead of the runs queued after it; Prefect names a SCHEDULED run past its time 'Late'), and a
    serving process (this one or another) then runs it: its completed tasks return their cached results, so none
    repeats. A run that has run more than
    `MAX_CRASH_RESUMES` times is left CRASHED. The runs are taken all at once (on a busy server each write can take
    seconds); one whose claim or state change failed is logged (debug) and left to the next round.
    """

    async def one(run: Any) -> bool:
        if not await claim(f'{CRASH_CLAIM_PREFIX}{run.state.id}', run.id):  # claimed by another serving process
            return False
        # At its first scheduled time: a serving process takes runs in order of that time, so this one (taken before
        # the runs still queued) goes before them, not behind them (bench_scaleout --kill: 12 runs queued at the kill
        # held the rescheduled ones back 36-45 s).
        result = await client.set_flow_run_state(run.id, Scheduled(
            scheduled_time=run.expected_start_time,
            message=f'durcap: rescheduled after its process died (try {run.run_count + 1})'))
        if result.status.value != 'ACCEPT':
            return False
        notify(f'prefect flow run {run.id} ({run.name}) crashed (its process died): rescheduled; a serving '
               'process runs it again from its cached tasks')
        return True

    crashed = [run for run in runs
               if run.state is not None and run.state.type == StateType.CRASHED and run.run_count <= MAX_CRASH_RESUMES]
    # All at once: each is a claim and a state change, writes a busy server may take seconds to answer.
    done = await settle(one(run) for run in crashed)
    return [str(run.id) for run, ok in zip(crashed, done, strict=True) if ok]


async def watch_round(client: Any, watch: DeadRunWatch, notify: Callable[[str], None]) -> list[str]:
    """One round of `watch_crashed` with one read of the deployment's PENDING, RUNNING and CRASHED flow runs: mark
    CRASHED those that stopped beating (`DeadRunWatch.round`) and reschedule those CRASHED (`reschedule_crashed`),
    the ones marked just now included (read again: their CRASHED state's id is the claim). Returns the ids
    rescheduled here."""
    runs = await client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[watch.deployment_id])),
        flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
            any_=[StateType.PENDING, StateType.RUNNING, StateType.CRASHED]))))
    marked = await watch.round(client, runs)
    crashed = [run for run in runs if run.state is not None and run.state.type == StateType.CRASHED]
    if marked:
        crashed += await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(m) for m in marked])))
    return await reschedule_crashed(client, crashed, notify)


def watch_crashed(deployment_name: str, flow: str, notify: Callable[[str], None], every: float = 2.0) -> Any:
    """Start a daemon thread that, every `every` seconds, marks CRASHED the deployment's PENDING and RUNNING flow runs
    that stopped beating (`_liveness.DeadRunWatch`: their process, or the serving process that took them, died with no
    word, e.g. this deployment's other serving process) and reschedules its CRASHED ones (`watch_round`: one read of
    the deployment's runs a round, on one client kept open; errors logged, retried next round); returns the thread."""

    async def forever() -> None:
        watch: DeadRunWatch | None = None
        while True:
            try:
                async with get_client() as client:
                    while True:
                        if watch is None:
                            deployment = await client.read_deployment_by_name(f'{flow}/{deployment_name}')
                            watch = DeadRunWatch(deployment.id, notify)
                        await watch_round(client, watch, notify)
                        await asyncio.sleep(every)
            except Exception:  # the server may be briefly unreachable, the deployment not yet created: next round
                logging.getLogger(__name__).debug('crashed-run check failed', exc_info=True)
                await asyncio.sleep(every)

    thread = threading.Thread(target=lambda: asyncio.run(forever()), name=f'durcap-crashed-{deployment_name}',
                              daemon=True)
    thread.start()
    return thread


API_CHECK_SECONDS = 30.0
"""How long `serve_schedule` waits for the Prefect API's `/health` before refusing to start."""


async def _api_down() -> str | None:
    """Why the configured Prefect API does not answer its health check within `API_CHECK_SECONDS`; `None` when it does."""
    try:
        async with get_client() as client:
            error = await asyncio.wait_for(client.api_healthcheck(), API_CHECK_SECONDS)
    except TimeoutError:
        return f'no answer to its health check within {API_CHECK_SECONDS:g} s'
    except Exception as exc:  # noqa: BLE001 - any failure to open the client is the API being unusable
        error = exc
    return None if error is None else f'{type(error).__name__}: {error}'


def serve_schedule(
    agent: DurableAgent[Any, Any], *, target: str, prompt: str, cron: str | None, interval_seconds: float | None,
    deps: Any, deployment_name: str | None, notify: Callable[[str], None], limit: int | None = None,
    spawn: bool = False,
) -> None:
    """A scheduled deployment of the agent's flow, served by `prefect.serve` (see `serve`, `spawn` too).

    Raises:
        RuntimeError: no Prefect API is configured (`PREFECT_API_URL` in the environment or the Prefect
            profile): a schedule on Prefect's temporary local server would never run.
        RuntimeError: also (DC040) the configured API does not answer its health check (`API_CHECK_SECONDS`), checked
            before anything starts.
        ValueError: `cron` is not a cron expression Prefect accepts (code DC040), checked before anything starts;
            `InputError` (DC040): `$DURCAP_PREFECT_BEAT_SECONDS` or `$DURCAP_PREFECT_STALE_SECONDS` is unusable.
    """
    stale_seconds()  # both liveness settings, read again by every flow-run process and watch round: refused now
    if cron is not None:
        try:
            CronSchedule(cron=cron)
        except ValidationError as exc:
            reason = exc.errors()[0]['msg'].removeprefix('Value error, ')
            raise ValueError(f'DC040 --cron {printable(repr(cron))}: not a cron expression ({one_line(reason)}); '
                             'write five fields, e.g. "0 9 * * *" (09:00 every day)') from None

    url = get_current_settings().api.url
    if not url:
        raise RuntimeError('no Prefect API configured: a schedule needs a Prefect server that outlives this command. '
                           'Start one (`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api')
    if (down := asyncio.run(_api_down())) is not None:  # before the fork server and the deployment: one line, no traceback
        raise RuntimeError(f'DC040 cannot reach the Prefect API at {printable(url)} ({one_line(down)}): start the server '
                           '(`prefect server start`) or fix PREFECT_API_URL')
    notify(f'serving deployment {deployment_name or agent.name + "-scheduled"!r} of flow {flow_name(agent)} '
           f'({"cron " + cron if cron else f"every {interval_seconds:g} s"}); Ctrl-C or SIGTERM to stop')
    serve(agent, target=target, prompt=prompt, cron=cron, interval_seconds=interval_seconds, deps=deps,
          deployment_name=deployment_name, limit=limit, notify=notify, spawn=spawn)
