"""The dead-run watch of `durcap schedule prefect` (engines/prefect/_liveness.py, issue 29): when a silent flow run is
declared dead while the server refuses some beats.

Real parts: the Prefect server at `$DURCAP_TEST_PREFECT_API_URL` (else one started for the session), real flow runs
on it set RUNNING, their beat labels written through Prefect's client, `DeadRunWatch.round` marking them CRASHED
there. Not real: the watch's clock (a number moved 2 s a round, so no test waits out the stale time) and this
process's own beats (counted as landed or failed through `_liveness._count_beat`, as a beat thread counts them).
No model, no agent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

STALE = 10.0
"""`$DURCAP_PREFECT_STALE_SECONDS` here."""
ROUND = 2.0
"""Seconds of the watch's clock between two rounds (`_worker.watch_crashed`'s default)."""


def _watch_rounds(prefect_api_url: str, rounds: int, *, own: tuple[int, int], live_beats_land: bool) -> dict[str, Any]:
    """Two RUNNING flow runs, each with a beat label: `silent` never beats again, `live` beats once a round when
    `live_beats_land`. `rounds` rounds of a `DeadRunWatch`, `ROUND` s of its clock apart; between two rounds this
    process's own beats: `own` = (landed, failed). Returns the round (index) in which each run was marked CRASHED
    (absent: never), their states on the server after the rounds, and the lines the watch said."""
    from prefect import flow, get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect.states import Running

    from durable_capabilities.engines.prefect import _liveness

    @flow(name=f'durcap-liveness-test-{uuid.uuid4().hex[:8]}')
    def nothing() -> None:
        """Never run: the flow its flow runs belong to."""

    async def main() -> dict[str, Any]:
        async with get_client() as client:
            runs = {name: await client.create_flow_run(nothing, state=Running()) for name in ('silent', 'live')}
            try:
                for name, run in runs.items():
                    await client.update_flow_run_labels(run.id, {_liveness.BEAT_LABEL: f'{name}:0'})
                said: list[str] = []
                now = [time.monotonic()]
                watch = _liveness.DeadRunWatch(None, said.append, clock=lambda: now[0])
                marked: dict[str, int] = {}
                ids = {str(run.id): name for name, run in runs.items()}
                for n in range(rounds):
                    for landed in [True] * own[0] + [False] * own[1]:
                        _liveness._count_beat(landed)
                    read = await client.read_flow_runs(
                        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id for run in runs.values()])))
                    for flow_run_id in await watch.round(client, read):
                        marked.setdefault(ids[flow_run_id], n)
                    if live_beats_land:
                        await client.update_flow_run_labels(runs['live'].id, {_liveness.BEAT_LABEL: f'live:{n + 1}'})
                    now[0] += ROUND
                states = {name: (await client.read_flow_run(run.id)).state_type.value for name, run in runs.items()}
                return {'marked': marked, 'states': states, 'said': said}
            finally:
                for run in runs.values():
                    await client.delete_flow_run(run.id)

    with temporary_settings(updates={PREFECT_API_URL: prefect_api_url}):
        return asyncio.run(main())


@pytest.fixture
def liveness(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The stale time `STALE`, beats every 2 s, and this process's beat counts as they were afterwards."""
    from durable_capabilities.engines.prefect import _liveness

    monkeypatch.setenv('DURCAP_PREFECT_STALE_SECONDS', str(STALE))
    monkeypatch.setenv('DURCAP_PREFECT_BEAT_SECONDS', '2')
    kept = list(_liveness.BEATS)
    try:
        yield
    finally:
        _liveness.BEATS[:] = kept


def test_a_silent_flow_run_is_declared_dead_on_time_while_half_of_this_processs_beats_fail(
        prefect_api_url: str, liveness: None) -> None:
    """The kill bench's case (bench/README.md, "A killed worker"): on a busy server about half of all beats fail, so
    the surviving serving process had one of its own fail in every round, while others landed. The silent run is
    marked CRASHED once it has been silent for the stale time (the 5th look after the first: 10 s of the watch's
    clock), the live run is left RUNNING.

    Without the fix the silent run stayed RUNNING for all 15 rounds (30 s): no run was declared dead while any of
    this process's own beats had failed within the stale time (checked with main's rule; on main the survivors marked
    the dead runs 31-38 s after the kill, once their own runs were done and their beats stopped failing)."""
    seen = _watch_rounds(prefect_api_url, 15, own=(1, 1), live_beats_land=True)
    assert seen['marked'] == {'silent': int(STALE / ROUND)}, seen
    assert seen['states'] == {'silent': 'CRASHED', 'live': 'RUNNING'}, seen
    assert len(seen['said']) == 1 and 'stopped beating 10 s ago' in seen['said'][0], seen


def test_silence_counts_at_the_rate_this_processs_beats_land_below_half(prefect_api_url: str, liveness: None) -> None:
    """A quarter of this process's beats land (load 16-21 in the kill bench; at 23-26 only 6% did, and live runs'
    labels then stayed unchanged for 15-18 s): a stretch counts half, so the silent run is declared dead after twice
    the stale time (the 10th look: 20 s of the watch's clock), not before."""
    seen = _watch_rounds(prefect_api_url, 12, own=(1, 3), live_beats_land=True)
    assert seen['marked'] == {'silent': 2 * int(STALE / ROUND)}, seen
    assert seen['states'] == {'silent': 'CRASHED', 'live': 'RUNNING'}, seen


def test_no_flow_run_is_declared_dead_while_none_of_this_processs_beats_land(
        prefect_api_url: str, liveness: None) -> None:
    """The false death the guard is there for (bench/README.md, try 5: a server answering 503 to every write for
    seconds at a time): none of this process's beats land and no run's beat changes, for three stale times (30 s of
    the watch's clock). Silence proves nothing then: neither run is declared dead."""
    seen = _watch_rounds(prefect_api_url, 16, own=(0, 2), live_beats_land=False)
    assert seen['marked'] == {} and seen['states'] == {'silent': 'RUNNING', 'live': 'RUNNING'}, seen


def test_a_silent_flow_run_is_declared_dead_by_a_serving_process_that_beats_nothing(
        prefect_api_url: str, liveness: None) -> None:
    """A surviving serving process with no run of its own (no beat of its own sent) and nothing else beating: the
    silent runs are declared dead after the stale time (`test_a_prefect_flow_run_left_pending_by_a_killed_serving_
    process_is_finished_by_another` runs this end to end)."""
    seen = _watch_rounds(prefect_api_url, 7, own=(0, 0), live_beats_land=False)
    assert seen['marked'] == {'silent': int(STALE / ROUND), 'live': int(STALE / ROUND)}, seen
    assert seen['states'] == {'silent': 'CRASHED', 'live': 'CRASHED'}, seen
