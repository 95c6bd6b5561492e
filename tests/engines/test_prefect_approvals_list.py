"""`durcap approvals list --engine prefect` reads durcap's flow runs only (issue 26/29 loose end).

Real parts: the Prefect server at `$DURCAP_TEST_PREFECT_API_URL` (else one started for the session) and `durcap
approvals list` as a subprocess. No model runs: the two flow runs are made on the server with Prefect's own client,
each left CRASHED with a flow run input under durcap's pending-calls key, as a durcap run killed while it waited
leaves it: one of a `durcap-*` flow, one of an unrelated user flow beside it.

Before the fix the listing asked the server for every Paused/Suspended/Crashed flow run, of any flow, and read each
one's inputs: the unrelated run's call was listed as waiting (and on a busy server every crashed run was read).
"""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from durable_capabilities.approvals import PendingCall
from durable_capabilities.engines.prefect._spec import FLOW_NAME_PREFIX, PENDING_INPUT
from tests._helpers import durcap

pytestmark = [pytest.mark.slow]


async def _crashed_run_waiting(api: str, flow_name: str, call_id: str) -> str:
    """A CRASHED flow run of flow `flow_name` whose `PENDING_INPUT` names one call `call_id`; returns its id."""
    from prefect import flow
    from prefect.client.orchestration import PrefectClient
    from prefect.states import Crashed

    @flow(name=flow_name)
    def user_flow() -> None:  # never run: only its name is registered
        return None

    async with PrefectClient(api) as client:
        run = await client.create_flow_run(user_flow, name=f'lo5-{call_id}')
        call = PendingCall(str(run.id), call_id, 'revoke_sessions', {'account_id': 'acct-1'}, 'fp', '2026-01-01T00:00:00+00:00',
                           '2099-01-01T00:00:00+00:00', 'agent', None)
        await client.create_flow_run_input(run.id, PENDING_INPUT, json.dumps([call.to_json()]))
        await client.set_flow_run_state(run.id, Crashed(message='killed'), force=True)
        return str(run.id)


def test_approvals_list_reads_only_durcap_flow_runs(prefect_api_url: str) -> None:
    """An unrelated CRASHED flow run beside a durcap one: only the durcap run's call is listed."""
    tag = uuid.uuid4().hex[:8]
    ours = asyncio.run(_crashed_run_waiting(prefect_api_url, f'{FLOW_NAME_PREFIX}lo5-{tag}', f'ours-{tag}'))
    theirs = asyncio.run(_crashed_run_waiting(prefect_api_url, f'user-flow-lo5-{tag}', f'theirs-{tag}'))
    done = durcap('approvals', 'list', '--engine', 'prefect', env={'PREFECT_API_URL': prefect_api_url})
    assert done.returncode == 0, done.stderr
    assert ours in done.stdout and f'ours-{tag}' in done.stdout, done.stdout
    assert theirs not in done.stdout and f'theirs-{tag}' not in done.stdout, done.stdout
    assert 'Traceback' not in done.stderr


async def _flow_run(api: str, flow_name: str, state: str) -> str:
    """A flow run of flow `flow_name` left in `state` (`Paused` or `Running`), made with Prefect's own client as a
    user's own flow would be, with no durcap input; returns its id."""
    from prefect import flow
    from prefect.client.orchestration import PrefectClient
    from prefect.states import Paused, Running

    @flow(name=flow_name)
    def user_flow() -> None:  # never run: only its name is registered
        return None

    async with PrefectClient(api) as client:
        run = await client.create_flow_run(user_flow, state=Paused() if state == 'Paused' else Running())
        return str(run.id)


@pytest.mark.parametrize('verb', [('approve',), ('deny', '--reason', 'no')])
def test_deciding_a_flow_run_durcap_did_not_start_names_what_it_found(prefect_api_url: str, verb: tuple[str, ...]) -> None:
    """`durcap approve|deny` of a flow run that durcap did not start, or that waits for no durcap call: one DC044 line
    naming the flow, its state and what to do (before: "is not waiting for approval" for all three, exit 2)."""
    tag = uuid.uuid4().hex[:8]
    user_flow = f'user-flow-lo6-{tag}'
    paused = asyncio.run(_flow_run(prefect_api_url, user_flow, 'Paused'))
    running = asyncio.run(_flow_run(prefect_api_url, user_flow, 'Running'))
    ours_paused = asyncio.run(_flow_run(prefect_api_url, f'{FLOW_NAME_PREFIX}lo6-{tag}', 'Paused'))
    expected = {
        paused: f"Prefect flow run {paused!r} (flow {user_flow!r}, state Paused) was not started by durcap (its flows are "
                f'named {FLOW_NAME_PREFIX}AGENT): it has no durcap call waiting for approval; resume it the way its own '
                'flow expects',
        running: f"Prefect flow run {running!r} (flow {user_flow!r}, state Running) was not started by durcap",
        ours_paused: f"Prefect flow run {ours_paused!r} (flow '{FLOW_NAME_PREFIX}lo6-{tag}', state Paused) is paused but "
                     f'publishes no call waiting for approval (its {PENDING_INPUT!r} input is empty or missing)',
    }
    for run_id, said in expected.items():
        done = durcap(verb[0], run_id, 'call-1', *verb[1:], '--engine', 'prefect', env={'PREFECT_API_URL': prefect_api_url})
        assert done.returncode == 2, done.stdout + done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(f'durcap: error: DC044 {said}'), line
