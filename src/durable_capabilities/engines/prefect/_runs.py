"""Prefect, operator side: the runs (`durcap runs list|show|cancel|resume`) and the approvals (`durcap approvals`) of
`durcap-*` flow runs, read and driven through the Prefect API.

`PrefectAdapter` (its `operator`) delegates to these functions: the shared operator methods of `EngineAdapter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import uuid
import uuid as uuid_
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import httpx
from prefect import get_client
from prefect.client.schemas.filters import (
    FlowFilter,
    FlowFilterId,
    FlowFilterName,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterId,
    FlowRunFilterState,
    FlowRunFilterStateName,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import NotPausedError, ObjectNotFound, PrefectHTTPStatusError
from prefect.flow_runs import aresume_flow_run
from prefect.input import acreate_flow_run_input, aread_flow_run_input
from prefect.settings import (
    PREFECT_CLIENT_MAX_RETRIES,
    PREFECT_CLIENT_RETRY_EXTRA_CODES,
    get_current_settings,
    temporary_settings,
)
from prefect.states import Cancelled, Scheduled

from ..._limits import printable
from ...approvals import (
    DECISION_WAIT_ENV,
    ApprovalError,
    Decision,
    DecisionNotDeliveredError,
    PendingCall,
    already_decided,
    check_decision,
    decision_wait,
    describe_decision,
)
from ...conversations import resolve_payload, store_url
from ...report import RunReport
from .._adapter import (
    EngineUnreachableError,
    RunInfo,
    RunNotFoundError,
    RunOptions,
    RunState,
    RunStates,
    RunUnit,
    loaded_capabilities_in,
    unit_kind,
)
from ._approvals import _input_key
from ._client import run_flow_run
from ._flow import agent_flow, run_store
from ._liveness import last_sign_of_life, server_clock, silent_for, utc
from ._server import ensure_api, server_line
from ._spec import DECISION_INPUT_PREFIX, ENGINE, FLOW_NAME_PREFIX, PENDING_INPUT

if TYPE_CHECKING:
    from ...agent import DurableAgent

_PREFECT_STATUS = {
    'RUNNING': 'running', 'PENDING': 'running', 'PAUSED': 'running', 'SCHEDULED': 'queued', 'COMPLETED': 'completed',
    'FAILED': 'failed', 'CRASHED': 'failed', 'CANCELLED': 'cancelled', 'CANCELLING': 'cancelled',
}


async def _read_flow_run(client: Any, run_id: str) -> Any:
    try:
        return await client.read_flow_run(uuid.UUID(run_id))
    except (ObjectNotFound, ValueError):
        raise RunNotFoundError(f'no Prefect flow run {run_id!r} at {os.environ.get("PREFECT_API_URL") or "the local server"}') from None


# ---- runs (`durcap runs`) ------------------------------------------------------------------------------


async def _runs(client: Any, flow_runs: list[Any], with_units: bool = False, store: str | None = None) -> list[RunInfo]:
    flow_ids = list({r.flow_id for r in flow_runs})
    flows = {f.id: f.name for f in await client.read_flows(flow_filter=FlowFilter(id=FlowFilterId(any_=flow_ids)))} \
        if flow_ids else {}
    gate = asyncio.Semaphore(_READ_CONCURRENCY)

    async def info(run: Any) -> RunInfo:
        async with gate:
            return await _info(client, run, flows, with_units, store)

    return list(await asyncio.gather(*(info(run) for run in flow_runs)))


_READ_CONCURRENCY = 16
"""Flow runs `_runs` reads at once (each: its task runs, and a completed run's result): one after the other, `durcap
runs list --limit 500` took ~50 s on a Prefect server holding a test suite's runs."""


async def _info(client: Any, run: Any, flows: Mapping[Any, str], with_units: bool, store: str | None) -> RunInfo:
    """One flow run as a `RunInfo` (`flows`: flow id -> name)."""
    name = flows.get(run.flow_id, '')
    agent = name[len(FLOW_NAME_PREFIX):] if name.startswith(FLOW_NAME_PREFIX) else None
    tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    state = run.state_type.name if run.state_type is not None else 'UNKNOWN'
    caps: list[str] = []
    unread: list[str] = []
    if state == 'COMPLETED' and run.state is not None:
        try:
            payload = await run.state.result(raise_on_failure=False)
        except Exception:  # noqa: BLE001 - the result is not readable from here: nothing to show
            payload = None
        try:  # a result naming its append: the messages are read back from the store `--store` names
            payload = await resolve_payload(payload, store=store)
            caps = loaded_capabilities_in([payload.get('new_messages')]) if isinstance(payload, dict) else []
        except Exception as error:  # noqa: BLE001 - a run whose messages are gone is still listed, with why
            unread.append(f'its turn\'s messages are not readable: {error}')
    notes = list(unread)
    if state in ('RUNNING', 'CRASHED', 'PENDING', 'FAILED'):
        notes.append(f'finish it with `durcap runs resume {run.id} --engine prefect --target TARGET` '
                     '(completed tasks return their cached results)')
    return RunInfo(
        ENGINE, str(run.id), agent, _PREFECT_STATUS.get(state, 'running'), state,
        run.start_time or run.expected_start_time, caps, (run.parameters or {}).get('conversation_id'),
        sum(1 for t in tasks if t.state_type is not None and t.state_type.name == 'COMPLETED'), notes,
        {'flow': name, 'flow_run_name': run.name, 'deployment_id': str(run.deployment_id) if run.deployment_id else None},
        [_unit(t) for t in sorted(tasks, key=lambda t: (t.start_time or t.expected_start_time or t.created))]
        if with_units else [],
    )


async def list_runs(settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
    ensure_api()  # the configured server, or this process's temporary one
    async with get_client() as client:
        flows = [f for f in await client.read_flows(flow_filter=FlowFilter(name=FlowFilterName(like_=FLOW_NAME_PREFIX)))
                 if f.name.startswith(FLOW_NAME_PREFIX)]
        if not flows:
            return []
        # Runs due by now: a schedule's future runs are not runs yet (and would fill the list).
        run_filter = FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(before_=datetime.now(UTC)))  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType] - Prefect's pydantic model takes a datetime
        if status:
            types = [StateType[k] for k, v in _PREFECT_STATUS.items() if v == status]
            run_filter.state = FlowRunFilterState(type=FlowRunFilterStateType(any_=types))
        runs: list[Any] = []
        while len(runs) < limit:  # in pages: the server refuses a larger limit than its own (422)
            want = min(PREFECT_PAGE, limit - len(runs))
            page = await client.read_flow_runs(
                flow_filter=FlowFilter(id=FlowFilterId(any_=[f.id for f in flows])), flow_run_filter=run_filter,
                sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=want, offset=len(runs))
            runs += page
            if len(page) < want:
                break
        return await _runs(client, runs, store=settings.get('store'))


PREFECT_PAGE = 200
"""Flow runs read per request by `list_runs`: the Prefect server's own cap on a filter's `limit` (its setting
`PREFECT_API_DEFAULT_LIMIT`, 200 by default; a larger limit is refused with 422 `Invalid limit`)."""


async def show_run(run_id: str, settings: Mapping[str, Any]) -> RunInfo:
    ensure_api()  # the configured server, or this process's temporary one
    async with get_client() as client:
        run = await _read_flow_run(client, run_id)
        return (await _runs(client, [run], with_units=True, store=settings.get('store')))[0]


async def cancel(run_id: str, settings: Mapping[str, Any]) -> RunInfo:
    """Set the flow run Cancelled (forced: a flow run started by `durcap run` has no worker to hand a
    Cancelling state to); the process running it, if any, stops at its next task."""
    ensure_api()
    async with get_client() as client:
        run = await _read_flow_run(client, run_id)
        if run.state is None or not run.state.is_final():
            await client.set_flow_run_state(run.id, Cancelled(message='durcap runs cancel'), force=True)
    return await show_run(run_id, settings)


async def delete_run(run_id: str, settings: Mapping[str, Any]) -> None:
    """Delete the flow run and its task runs from the Prefect API (`delete_flow_run`). Result files the tasks
    persisted in result storage are not the API's to delete: `durcap history delete` names them."""
    ensure_api()
    async with get_client() as client:
        run = await _read_flow_run(client, run_id)
        await client.delete_flow_run(run.id)


async def resume(run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
    """Run the flow run again in this process: tasks completed before (model requests, tools, the store
    load) return their cached results, so none repeats; the conversation append is idempotent."""
    options.notify(server_line())
    info = await show_run(run_id, options.settings)
    by_name = {a.name: a for a in agents}
    agent = by_name.get(info.agent or '')
    if not agents:
        raise RuntimeError(f'pass --target TARGET (the definition of agent {info.agent!r}): Prefect runs flow run '
                           f'{run_id} again with its code')
    if agent is None:
        raise RuntimeError(f'flow run {run_id} runs agent {info.agent!r}, which the target does not define')
    flow_ = agent_flow(agent)
    async with get_client() as client:
        run = await _read_flow_run(client, run_id)
        if info.status != 'completed':
            await client.set_flow_run_state(run.id, Scheduled(message='durcap runs resume'), force=True)
    options.notify(f'resuming prefect flow run {run_id} ({info.engine_status}) in this process')
    with run_store(options.setting('store')):
        return await run_flow_run(flow_, run.id, dict(run.parameters or {}), store_url(agent, options.setting('store')))


# ---- claim checks (`durcap store gc`) -----------------------------------------------------------------

DEFAULT_ABANDONED_AFTER = timedelta(hours=1)
"""How long a RUNNING / PENDING / CANCELLING flow run must show no sign of life (no beat, state change or task run
update) before `durcap store gc` counts it as abandoned (`--abandoned-after`)."""

_MAY_BE_ABANDONED = ('RUNNING', 'PENDING', 'CANCELLING')
"""States a flow run's own process holds (it moves it out of them): left in one by a process killed without a word.
SCHEDULED and PAUSED runs wait for a worker or a person, not for a process, and are open however long they wait."""


def abandoned_after(settings: Mapping[str, Any]) -> timedelta:
    """`settings['abandoned_after']` (seconds; default `DEFAULT_ABANDONED_AFTER`), never under three beats of this
    process's `$DURCAP_PREFECT_BEAT_SECONDS` (a live run's beat can be that late)."""
    from ._liveness import beat_seconds

    given = settings.get('abandoned_after')
    wanted = DEFAULT_ABANDONED_AFTER if given is None else timedelta(seconds=float(given))
    return max(wanted, timedelta(seconds=3 * beat_seconds()))


async def _server_retention(client: Any) -> timedelta | None:
    """The server's flow run retention: `server.services.db_vacuum.retention_period` when its vacuum deletes flow runs
    (`enabled` holds `flow_runs`), else `None` (it keeps them until deleted, Prefect's default). `None` too when the
    server does not say (an older server, Prefect Cloud): safe, as gc then keeps the flow runs' pieces."""
    from pydantic import TypeAdapter

    from ..._upstream import prefect_server_settings

    try:  # no public client method reads the server's settings: the API's own route, through the client's session
        vacuum = (await prefect_server_settings(client))['server']['services']['db_vacuum']
        enabled = vacuum.get('enabled')
        if enabled is True or (isinstance(enabled, list) and 'flow_runs' in enabled):
            return TypeAdapter(timedelta).validate_python(vacuum['retention_period'])
    except Exception:  # noqa: BLE001 - not told: kept forever, the safe answer
        return None
    return None


async def run_states(run_ids: Sequence[str], settings: Mapping[str, Any]) -> RunStates:
    """What `durcap store gc` needs of the flow runs that own tool-result pieces (`_results`; owners `prefect:<flow run
    id>`, given with or without the prefix).

    - A flow run in a final state (COMPLETED, FAILED, CRASHED, CANCELLED) closed at its state's time. A FAILED or
      CRASHED one can still be run again (`durcap runs resume`; a deployment's CRASHED run is rescheduled, and is then
      SCHEDULED or RUNNING again, open): it reads its finished tool calls' results from the pieces, so they are kept
      for the retention after it ended.
    - A RUNNING, PENDING or CANCELLING flow run whose newest sign of life (the flow run's `updated`, which every beat of
      `_liveness.beating` moves, every running flow run beating every 2 s; its state's time; its task runs' `updated`)
      is older than `abandoned_after(settings)` is abandoned: its process died without a word (SIGKILL, a lost
      machine) and nobody marked it (a flow run outside a deployment is watched by no serving process). It counts as
      closed at that last sign of life (`RunState.abandoned` says why). A live run beats, however long its tool runs.
    - Any other (SCHEDULED, PAUSED, a live RUNNING one) is open. A flow run the server does not know is absent.

    Times of the server are read against its own clock (`Date` header), then given on this machine's clock, so a
    server whose clock is off does not make a live run look silent. Retention: `_server_retention`, `keeps_forever`
    when the server keeps flow runs until deleted.

    Raises:
        OSError / RuntimeError / PrefectHTTPStatusError: the Prefect API cannot be reached.
    """
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    url, _ = ensure_api()
    wanted: dict[uuid.UUID, str] = {}
    for run_id in run_ids:
        try:
            wanted[uuid.UUID(run_id.removeprefix(f'{ENGINE}:'))] = run_id
        except ValueError:
            continue  # not a flow run id: unknown here
    silent_after = abandoned_after(settings)
    states: dict[str, RunState] = {}
    async with get_client() as client:
        retention = await _server_retention(client)
        ids = list(wanted)
        runs: list[Any] = []
        for start in range(0, len(ids), PREFECT_PAGE):
            chunk = ids[start:start + PREFECT_PAGE]
            runs += await client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=chunk)),
                                                limit=len(chunk))
        try:
            server_now = await server_clock(client)
        except Exception:  # noqa: BLE001 - this machine's clock then
            server_now = None
        here = datetime.now(UTC)
        skew = (server_now - here) if server_now is not None else timedelta(0)
        now = server_now or here
        for run in runs:
            owner = wanted[run.id]
            state = run.state_type.name if run.state_type is not None else 'UNKNOWN'
            if run.state is not None and run.state.is_final():
                ended = run.end_time or run.state.timestamp or run.updated
                states[owner] = RunState(owner, False, utc(ended) - skew)
                continue
            if state not in _MAY_BE_ABANDONED:
                states[owner] = RunState(owner, True)
                continue
            last = last_sign_of_life(run)
            if silent_for(last, now, silent_after):  # only then: its task runs, one request
                tasks = await client.read_task_runs(task_run_filter=TaskRunFilter(
                    flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))
                last = last_sign_of_life(run, (t.updated for t in tasks))
            if last is None or not silent_for(last, now, silent_after):
                states[owner] = RunState(owner, True)
                continue
            states[owner] = RunState(owner, False, last - skew, abandoned=(
                f'{state}, no beat, state change or task run update for {_span(now - last)} (since '
                f'{last.isoformat(timespec="seconds")}, Prefect\'s clock; abandoned after '
                f'{_span(silent_after)}): its process is gone'))
    return RunStates(ENGINE, f'Prefect API at {url}', retention, states, keeps_forever=retention is None)




def _span(delta: timedelta) -> str:
    """`delta` for people: `42 s`, `17 min`, `3.5 h`, `2.0 d`."""
    seconds = delta.total_seconds()
    if seconds < 120:
        return f'{seconds:.0f} s'
    if seconds < 7200:
        return f'{seconds / 60:.0f} min'
    return f'{seconds / 3600:.1f} h' if seconds < 172800 else f'{seconds / 86400:.1f} d'


def _unit(task_run: Any) -> RunUnit:
    """A Prefect task run as a `RunUnit` (its name without the `-<suffix>` Prefect appends per run)."""
    name = re.sub(r'-[0-9a-f]{3,}$', '', task_run.name or '')
    state = task_run.state_type.name if task_run.state_type is not None else ''
    status = {'COMPLETED': 'done', 'FAILED': 'failed', 'CRASHED': 'failed', 'CANCELLED': 'failed'}.get(state, 'started')
    return RunUnit(name, unit_kind(name), status, task_run.start_time or task_run.expected_start_time)


# ---- approvals (`durcap approvals`) -------------------------------------------------------------------


async def pending_approvals(settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
    """The calls waiting for a decision (`_pending_approvals` says which).

    Raises:
        EngineUnreachableError: the Prefect API does not answer (a refused or dropped connection, a timeout): one line
            naming it (a fresh-user trial: `durcap approvals list --engine prefect` with PREFECT_API_URL on a port
            nobody listens at printed httpx's traceback, exit 1).
    """
    try:
        return await _pending_approvals(settings, run_id)
    except httpx.TransportError as exc:
        raise _api_unreachable(exc) from exc


async def decide(run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
    """Store `decision` and resume the run (`_decide` says how, and its errors).

    Raises:
        EngineUnreachableError: the Prefect API did not answer a read before the writes (nothing was stored) or a
            connection error escaped the writes' retries: one line naming the API, no traceback.
    """
    try:
        return await _decide(run_id, decision, settings)
    except httpx.TransportError as exc:
        raise _api_unreachable(exc) from exc


def _api_unreachable(exc: httpx.TransportError) -> EngineUnreachableError:
    """The one-line error for a Prefect API that does not answer: its URL, httpx's reason and the fix."""
    url = get_current_settings().api.url or "this command's temporary local server"
    return EngineUnreachableError(f'cannot reach the Prefect API at {printable(url)} ({_what(exc)}): start the server '
                                  '(`prefect server start`) or fix PREFECT_API_URL')


async def _pending_approvals(settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
    """Pending calls of Paused, Suspended or Crashed `durcap-*` flow runs (or of flow run `run_id`), from flow run input
    `PENDING_INPUT`. Flow runs of other flows are filtered out on the server (by flow name), never read.

    A Crashed flow run whose calls are still published waited for them when its process stopped (`durcap run` given
    SIGTERM while paused ends Paused or Crashed by timing; a serving process killed under its runs): its calls are
    listed, so the wait is not lost from view, and one already decided says so (`PendingCall.decided`: the decision
    waits for the run to run again, `durcap runs resume`, which finishes it from its cached tasks)."""
    ensure_api()  # the configured server, or this process's temporary one
    async with get_client() as client:
        if run_id is not None:
            flow_run_id = _flow_run_uuid(run_id)
            try:
                runs = [await client.read_flow_run(flow_run_id)]
            except ObjectNotFound:
                runs = []
            states = {flow_run_id: runs[0].state_type if runs else None}
        else:
            # Only durcap's flows (`durcap-{agent}`), filtered on the server: a busy server's other CRASHED flow runs
            # are neither fetched nor their inputs read (before, every Paused/Suspended/Crashed run's were).
            flows = [f for f in await client.read_flows(flow_filter=FlowFilter(name=FlowFilterName(like_=FLOW_NAME_PREFIX)))
                     if f.name.startswith(FLOW_NAME_PREFIX)]
            found: list[Any] = []
            while flows:  # in pages: the server refuses a larger limit than its own (422)
                page = await client.read_flow_runs(
                    flow_filter=FlowFilter(id=FlowFilterId(any_=[f.id for f in flows])),
                    flow_run_filter=FlowRunFilter(state=FlowRunFilterState(
                        name=FlowRunFilterStateName(any_=['Paused', 'Suspended', 'Crashed']))),
                    sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=PREFECT_PAGE, offset=len(found))
                found += page
                if len(page) < PREFECT_PAGE:
                    break
            states = {r.id: r.state_type for r in found}
    calls: list[PendingCall] = []
    for flow_run_id, state in states.items():
        waiting = [PendingCall.from_json({**data, 'engine': ENGINE})
                   for data in await aread_flow_run_input(PENDING_INPUT, flow_run_id=flow_run_id) or []]
        if state == StateType.CRASHED:  # nothing runs it: a decision already stored waits for `runs resume`
            for call in waiting:
                earlier = await aread_flow_run_input(DECISION_INPUT_PREFIX + _input_key(call.call_id),
                                                     flow_run_id=flow_run_id)
                call.decided = describe_decision(Decision.from_json(earlier)) if earlier is not None else None
        calls += waiting
    return calls


async def _decide(run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
    """Check `decision` against the flow run's pending calls and against a decision already stored for the call,
    store it as flow run input and resume the run.

    A call is decided once: its decision input (`DECISION_INPUT_PREFIX`) is write-once on the server, so a second
    decision, whether or not the run has read the first, is refused naming the first (before, the server's 409 came
    out as an HTTP error). A second decision refused while the run is still paused on the call resumes the run, so the
    first decision, stored, is taken.

    The two writes (the decision, the resume) are tried again while the server refuses them (a Prefect server on
    SQLite under load answers 503 for seconds; Prefect's client retries 408/429/502/503 and dropped connections, with
    a growing backoff), for at most `approvals.decision_wait()` seconds ($DURCAP_DECISION_WAIT, default 30) in all,
    counted from the first write.

    Raises:
        ApprovalError: unknown run (no such flow run, or not waiting), unknown call, stale fingerprint, or a call
            already decided (`approvals.already_decided`: names the earlier decision).
        DecisionNotDeliveredError: DC052, kind `'not-delivered'`: the server kept refusing the decision's write
            (nothing stored, the call is still pending), or kept refusing to resume the run (the decision is stored
            and stands; the run takes it when resumed: the same command again resumes it and says DC054).
    """
    wait = decision_wait()
    flow_run_id = _flow_run_uuid(run_id)
    ensure_api()
    async with get_client() as client:
        try:
            flow_run = await client.read_flow_run(flow_run_id)
        except ObjectNotFound:
            raise ApprovalError('unknown-run', f'no Prefect flow run {run_id!r}') from None
        try:
            flow_name = (await client.read_flow(flow_run.flow_id)).name
        except ObjectNotFound:
            flow_name = None
    pending = await _pending_approvals(settings, run_id)
    key = DECISION_INPUT_PREFIX + _input_key(decision.call_id)

    async def refuse_if_decided() -> None:
        earlier = await aread_flow_run_input(key, flow_run_id=flow_run_id)
        if earlier is not None:
            still_pending = any(c.call_id == decision.call_id for c in pending)
            if still_pending:  # the first decision is stored but not taken: a paused run takes it once resumed
                with contextlib.suppress(Exception):
                    await _resume_if_paused(flow_run_id)
            raise already_decided(run_id, decision.call_id, Decision.from_json(earlier),
                                  received=False if still_pending else None)

    await refuse_if_decided()
    if not pending:
        raise ApprovalError('unknown-run', _not_waiting(run_id, flow_run, flow_name))
    call = check_decision(pending, decision, run_id)
    deadline = asyncio.get_running_loop().time() + wait  # the bound on the writes (the checks above are reads)
    try:
        await _until(deadline, lambda: acreate_flow_run_input(key, decision.to_json(), flow_run_id=flow_run_id))
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code != 409:
            raise
        # another decision was stored since the check above, or this one, by a try whose answer was lost
        if await aread_flow_run_input(key, flow_run_id=flow_run_id) != decision.to_json():
            await refuse_if_decided()
    except _Refused as refused:
        stored = None
        with contextlib.suppress(Exception):  # a try the server answered late may have stored it after all
            stored = await asyncio.wait_for(aread_flow_run_input(key, flow_run_id=flow_run_id), timeout=5)
        if stored != decision.to_json():
            raise DecisionNotDeliveredError('not-delivered', (
                f'DC052 run {run_id!r}: the Prefect server refused to store the decision on call {decision.call_id!r} '
                f'for {wait:g} s ({refused}): nothing was stored, the call is still pending and nothing ran. Fix: '
                f'decide again once the server answers (${DECISION_WAIT_ENV} sets the wait)')) from None
    refused_resume: _Refused | None = None
    while asyncio.get_running_loop().time() < deadline:  # the run may be between two pauses: it reads it once paused
        try:
            async with get_client() as client:
                flow_run = await asyncio.wait_for(client.read_flow_run(flow_run_id),
                                                  timeout=max(0.1, deadline - asyncio.get_running_loop().time()))
            if flow_run.state is not None and flow_run.state.is_paused():
                try:
                    await _until(deadline, lambda: aresume_flow_run(flow_run_id))
                    break
                except (NotPausedError, RuntimeError):  # resumed meanwhile
                    pass
            elif flow_run.state is None or flow_run.state.is_final() or all(
                    c.call_id != call.call_id for c in await _pending_approvals(settings, run_id)):
                break  # the run read the decision without pausing again
            refused_resume = None
        except _Refused as refused:
            refused_resume = refused
            break
        except Exception as exc:  # a read refused as well: asked again until the deadline
            if not _retryable(exc):
                raise
            refused_resume = _Refused(_what(exc))
        await asyncio.sleep(0.2)
    if refused_resume is not None:
        raise DecisionNotDeliveredError('not-delivered', (
            f'DC052 run {run_id!r}: the decision on call {decision.call_id!r} is stored and stands, but the Prefect '
            f'server refused to resume the paused run for {wait:g} s ({refused_resume}); the run takes the decision '
            f'once resumed. Fix: run the same command again once the server answers (it says DC054 and resumes the '
            'run)'))
    return call


T = TypeVar('T')


class _Refused(Exception):
    """The Prefect server kept refusing a write (or not answering) until the decision's deadline: `str()` says how."""


def _what(exc: BaseException) -> str:
    if isinstance(exc, PrefectHTTPStatusError):
        return f'HTTP {exc.response.status_code}'
    return f'{type(exc).__name__}: {exc}' if str(exc) else type(exc).__name__


_TRANSIENT: tuple[type[BaseException], ...] = (httpx.TransportError,)
"""Errors a write is tried again on (besides the statuses of `_retryable`): a dropped or refused connection."""


def _retryable(exc: BaseException) -> bool:
    """A refusal the server may lift: the statuses Prefect's client itself retries (408, 429, 502, 503 and
    `PREFECT_CLIENT_RETRY_EXTRA_CODES`), a timeout or a dropped connection."""
    if isinstance(exc, PrefectHTTPStatusError):
        return exc.response.status_code in {408, 429, 502, 503, *PREFECT_CLIENT_RETRY_EXTRA_CODES.value()}
    return isinstance(exc, (TimeoutError, *_TRANSIENT))


async def _until(deadline: float, write: Callable[[], Awaitable[T]]) -> T:
    """`await write()` (a Prefect client call), tried again on a refusal (`_retryable`) every 0.25-2 s (growing) until
    the event-loop time `deadline`. Prefect's client's own retries are off inside (`PREFECT_CLIENT_MAX_RETRIES` 0):
    its backoff (2, 4, 8, 16, 32 s) would outlast the deadline and hide which refusal it saw.

    Raises:
        _Refused: the deadline passed with the write still refused (its last refusal as the text).
        Any other error of `write` at once.
    """
    loop = asyncio.get_running_loop()
    last, pause = 'no answer', 0.25
    while (left := deadline - loop.time()) > 0:
        try:
            with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}):
                return await asyncio.wait_for(write(), timeout=left)
        except Exception as exc:
            if not _retryable(exc):
                raise
            if not isinstance(exc, TimeoutError) or last == 'no answer':  # a cut try keeps the refusal seen before
                last = _what(exc) if not isinstance(exc, TimeoutError) else 'no answer'
        await asyncio.sleep(min(pause, max(0.0, deadline - loop.time())))
        pause = min(2.0, pause * 2)
    raise _Refused(last)


def _not_waiting(run_id: str, flow_run: Any, flow_name: str | None) -> str:
    """Why flow run `run_id` has no call to decide, naming what was found: a flow run of a flow durcap did not start
    (its flows are `durcap-AGENT`), paused by that flow's own code; a durcap flow run paused with no call published;
    or a flow run in another state."""
    state = flow_run.state.name if flow_run.state is not None else 'without a state'
    paused = flow_run.state is not None and flow_run.state.is_paused()
    shown = f'Prefect flow run {run_id!r} (flow {flow_name!r}, state {state})'
    if flow_name is None or not flow_name.startswith(FLOW_NAME_PREFIX):
        fix = ('resume it the way its own flow expects (the Prefect UI, or `prefect.flow_runs.resume_flow_run`)' if paused
               else 'durcap approves only the calls of its own runs')
        return (f'{shown} was not started by durcap (its flows are named {FLOW_NAME_PREFIX}AGENT): it has no durcap '
                f'call waiting for approval; {fix}')
    if paused:
        return (f'{shown} is paused but publishes no call waiting for approval (its {PENDING_INPUT!r} input is empty '
                'or missing): it was not paused by a durcap approval; `durcap runs show` tells its state')
    return (f'{shown} is not waiting for approval: nothing to decide (`durcap approvals list --engine prefect` lists '
            'the calls that wait)')


async def _resume_if_paused(flow_run_id: Any) -> None:
    async with get_client() as client:
        flow_run = await client.read_flow_run(flow_run_id)
    if flow_run.state is not None and flow_run.state.is_paused():
        await aresume_flow_run(flow_run_id)


def _flow_run_uuid(run_id: str) -> Any:
    try:
        return uuid_.UUID(run_id)
    except ValueError:
        raise ApprovalError('unknown-run', f'{run_id!r} is not a Prefect flow run id') from None
