"""Prefect approvals, flow side: the gate a `durcap-*` flow run waits in for decisions (`PrefectApprovalGate`: it
pauses or suspends the flow run), the flow run inputs that carry the pending calls and the decisions, and the
deadline watcher that resumes suspended runs whose calls timed out. The client side (list, decide) is `_runs`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import re
import threading
import time
import uuid as uuid_
from datetime import datetime
from typing import TYPE_CHECKING, Any

from prefect import get_client, pause_flow_run, task
from prefect.cache_policies import INPUTS, RUN_ID
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowFilter,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateName,
)
from prefect.context import FlowRunContext
from prefect.exceptions import FlowPauseTimeout, NotPausedError, ObjectNotFound, PrefectHTTPStatusError
from prefect.flow_runs import aresume_flow_run, asuspend_flow_run
from prefect.input import acreate_flow_run_input, adelete_flow_run_input, aread_flow_run_input
from prefect.runtime import flow_run
from prefect.states import Running

from ...approvals import ApprovalError, ApprovalGate, Decision, PendingCall, check_decision, utc_now
from ._spec import APPROVAL_CLOCK_TASK, DECISION_INPUT_PREFIX, PENDING_INPUT, SUSPEND_GRACE_SECONDS, flow_name

if TYPE_CHECKING:
    from ...agent import DurableAgent

def _clock_task() -> Any:

    async def clock(pause: int) -> str:

        return utc_now().isoformat()

    return task(name=APPROVAL_CLOCK_TASK, cache_policy=INPUTS + RUN_ID, persist_result=True)(clock)


class PrefectApprovalGate(ApprovalGate):
    """Waits for decisions on the Prefect server; `decide` stores each as flow run input
    `durcap-decision-{call id}` and resumes the flow run with `resume_flow_run`. The pending calls are flow
    run input `PENDING_INPUT`.

    - A flow run of a deployment (`flow.serve`, `durcap schedule prefect`, `run_deployment`) suspends
      (`suspend_flow_run`): state Suspended, its process exits, nothing is held. On resume Prefect schedules it
      again from its deployment; the flow function runs from the top, its completed tasks return their cached
      results (deterministic keys), and the gate finds the stored decision. No process waits for the
      deadline: the process serving the deployment (`serve`, `durcap schedule prefect`) runs
      `watch_deadlines`, which resumes a Suspended flow run once its calls' deadline has passed; the rerun
      gate finds no decision and denies the calls. The suspend's Prefect timeout is the deadline plus
      `SUSPEND_GRACE_SECONDS`: if nothing serving the deployment resumed the run by then, Prefect's
      pause-expiration service sets it Failed ("The flow was paused and never resumed").
    - Any other flow run (`durcap run`: no deployment to reschedule from) pauses (`pause_flow_run`): state
      Paused, the process waits; at the deadline the pause times out in the process and the call is denied.

    A flow run re-run after its process died (Prefect's retry, or `run_flow` on the same flow run) replays its
    cached tasks and finds the decisions already stored."""

    def __init__(self, agent: DurableAgent[Any, Any]):

        self.agent = agent
        self.run_id = str(flow_run.id)
        self.pauses = 0
        self.clock = _clock_task()

    async def now(self) -> Any:

        self.pauses += 1
        return datetime.fromisoformat(await self.clock(self.pauses))

    async def wait(self, pending: list[PendingCall], timeout: float) -> dict[str, Decision]:

        context = FlowRunContext.get()
        deployed = context is not None and context.flow_run is not None and context.flow_run.deployment_id is not None
        deadline = datetime.fromisoformat(pending[0].deadline)
        decisions: dict[str, Decision] = {}
        remaining = list(pending)
        attempt = 0
        while True:
            for call in list(remaining):
                data = await aread_flow_run_input(DECISION_INPUT_PREFIX + _input_key(call.call_id))
                if data is None:
                    continue
                try:
                    check_decision([call], Decision.from_json(data), self.run_id)
                except ApprovalError:
                    continue
                decisions[call.call_id] = Decision.from_json(data)
                remaining.remove(call)
            await _put_input(PENDING_INPUT, [c.to_json() for c in remaining])
            left = (deadline - utc_now()).total_seconds()
            if not remaining or left <= 0:
                break
            if deployed:
                # A deterministic key: a suspend that already fired (before the resume that reran this flow
                # function) is refused by the server and returns at once; the next attempt's key suspends.
                ids = hashlib.sha256('\n'.join(sorted(c.call_id for c in remaining)).encode()).hexdigest()[:16]
                attempt += 1
                # Raises Pause when it fires: the flow run ends Suspended and its process exits.
                await asuspend_flow_run(timeout=max(1, math.ceil(left)) + SUSPEND_GRACE_SECONDS,
                                        key=f'durcap-suspend-{ids}-{attempt}')
                continue
            try:
                # sync-compatible: a coroutine inside an async flow (typed as returning None)
                await pause_flow_run(timeout=max(1, math.ceil(left)), key=f'durcap-approval-{uuid_.uuid4().hex}')  # pyright: ignore[reportGeneralTypeIssues]
            except FlowPauseTimeout:
                async with get_client() as client:  # the timed-out pause left the run Paused
                    await client.set_flow_run_state(uuid_.UUID(self.run_id), Running(), force=True)
        await _put_input(PENDING_INPUT, [])
        return decisions


async def resume_expired(agent: DurableAgent[Any, Any], deployment_id: Any = None) -> list[str]:
    """Resume every Suspended flow run of `agent`'s flow (of deployment `deployment_id` if given) whose pending
    calls are all past their deadline: Prefect schedules it again from its deployment and the rerun gate denies
    the calls (`approvals.timeout_reason`). Returns the ids of the flow runs resumed.

    A run resumed meanwhile (by a decision) is skipped: the resume is refused and ignored.
    """

    async with get_client() as client:
        runs = await client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name(agent)])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(name=FlowRunFilterStateName(any_=['Suspended']))),
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])) if deployment_id else None)
    resumed = []
    for run in runs:
        calls = await aread_flow_run_input(PENDING_INPUT, flow_run_id=run.id) or []
        if calls and all(datetime.fromisoformat(c['deadline']) <= utc_now() for c in calls):
            with contextlib.suppress(NotPausedError, FlowPauseTimeout, RuntimeError):
                await aresume_flow_run(run.id)
                resumed.append(str(run.id))
    return resumed


def watch_deadlines(agent: DurableAgent[Any, Any], deployment_id: Any = None, every: float = 5.0) -> Any:
    """Start a daemon thread that calls `resume_expired(agent, deployment_id)` every `every` seconds (errors
    are logged and retried next round); returns the thread. Run by the process serving the deployment."""

    def loop() -> None:
        while True:
            try:
                asyncio.run(resume_expired(agent, deployment_id))
            except Exception:  # the server may be briefly unreachable: try again next round
                logging.getLogger(__name__).warning('approval deadline check failed', exc_info=True)
            time.sleep(every)

    thread = threading.Thread(target=loop, name=f'durcap-deadlines-{agent.name}', daemon=True)
    thread.start()
    return thread


async def _put_input(key: str, value: Any) -> None:
    """Set the current flow run's input `key` to `value` (inputs are write-once: delete, then create)."""

    with contextlib.suppress(ObjectNotFound, PrefectHTTPStatusError):  # not there yet
        await adelete_flow_run_input(key)
    await acreate_flow_run_input(key, value)


def _input_key(call_id: str) -> str:
    """A flow run input key from a call id (keys allow letters, digits and dashes)."""
    return re.sub(r'[^A-Za-z0-9-]', lambda m: f'-{ord(m.group()):02x}', call_id).lower()
