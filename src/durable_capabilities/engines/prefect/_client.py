"""Running a flow run in this process and reading what Prefect recorded of it (its task runs)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

from ...conversations import resolve_payload
from ...report import RunReport
from ._spec import ENGINE, MODEL_REQUEST_TASK


async def read_task_runs(flow_run_id: Any) -> list[Any]:
    async with get_client() as client:
        return list(await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))))


async def settled_task_runs(flow_run_id: Any, model_requests: int, timeout: float = 30.0,
                             orphans: frozenset[str] = frozenset()) -> list[Any]:
    """The flow run's task runs once Prefect has recorded them all.

    Prefect 3 records task runs from events, asynchronously: listed right after the flow returns, the
    last ones can be missing. Poll (up to `timeout` seconds) until every task run is final, there is a
    `Model Request` task per model response, and the list has not changed for a second.

    `orphans`: ids of task runs a dead process left unfinished (Running forever) before this process ran the flow
    run again (`durcap runs resume`); they are left out (waiting for them to finish cost the whole `timeout`).
    """
    deadline = time.monotonic() + timeout
    previous: list[tuple[str, str]] = []
    stable_since = time.monotonic()
    async with get_client() as client:
        while True:
            runs = [r for r in await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
                    if str(r.id) not in orphans]
            snapshot = sorted((str(r.id), str(r.state_type)) for r in runs)
            if snapshot != previous:
                previous, stable_since = snapshot, time.monotonic()
            done = all(r.state is not None and r.state.is_final() for r in runs)
            enough = sum(1 for r in runs if r.name.startswith(MODEL_REQUEST_TASK)) >= model_requests
            if (done and enough and time.monotonic() - stable_since >= 1.0) or time.monotonic() > deadline:
                return list(runs)
            await asyncio.sleep(0.2)


async def run_flow_run(flow_: Any, flow_run_id: Any, parameters: dict[str, Any], store: str | None = None) -> RunReport:
    """Run an existing flow run of `flow_` in this process and report it (task runs settled); a result naming its
    append is read back from the store `store` (a URL; `None`: `$DURCAP_STORE`, else the default store).

    Raises:
        ConversationNotFoundError: the result names an append that is no longer in the store."""
    from prefect.flow_engine import run_flow_async  # lazily: the flow engine loads only where a flow runs here

    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
    # A flow run run again (resume) may hold task runs its dead process left Running: not this run's to wait for.
    orphans = frozenset(str(t.id) for t in await read_task_runs(flow_run_id) if t.state is None or not t.state.is_final())
    state: Any = await run_flow_async(flow_, flow_run=flow_run, parameters=parameters, return_type='state')
    payload = await resolve_payload(await state.result(), store=store)
    report = RunReport.from_payload(ENGINE, str(flow_run_id), payload)
    model_requests = sum(1 for m in report.new_messages if m.kind == 'response')
    task_runs = await settled_task_runs(flow_run_id, model_requests, orphans=orphans)
    report.durable_units = [t.name for t in sorted(task_runs, key=lambda t: (t.expected_start_time or t.created, t.name))]
    return report
