"""`engines/_stall.py`: when a waiting client says its run waits for a worker without progress (the engines' probes
are exercised against real workers in tests/engines/test_waiting_client.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

from durable_capabilities.engines._stall import Progress, notice_stalls
from tests._helpers import durcap_here


def _said(looks: list[Progress], seconds: float = 0.8) -> list[str]:
    """The lines `notice_stalls` says over `looks` (one per poll of 0.2 s; the last one repeats until it ends)."""
    said: list[str] = []
    sequence: Iterator[Progress] = iter(looks)
    last = looks[-1]

    async def probe() -> Progress:
        return next(sequence, last)

    async def line(waiting: str, waited: float) -> str:
        return f'{waiting} for {waited:g} s'

    async def main() -> None:
        await asyncio.wait_for(notice_stalls(probe, line, said.append, seconds), 10)

    asyncio.run(main())
    return said


def test_said_once_per_stall_and_never_for_a_run_that_waits_for_no_worker() -> None:
    """Eight looks of 0.2 s with the same signature and a part waiting for a worker: said once (not at every look);
    the run then moves and stalls again: said again; a run that moves at every look, or waits for no worker (an
    approval, a timer: `waiting` None) however long, is never reported."""
    stalled = [Progress(1, 'activity x (attempt 2)')] * 8
    again = [Progress(2, 'activity x (attempt 3)')] * 8
    assert _said([*stalled, *again, Progress(None, None, done=True)]) == [
        'activity x (attempt 2) for 0.8 s', 'activity x (attempt 3) for 0.8 s']
    moving = [Progress(n, 'its workflow task (attempt 1)') for n in range(12)]
    assert _said([*moving, Progress(None, None, done=True)]) == []
    person = [Progress(1, None)] * 12
    assert _said([*person, Progress(None, None, done=True)]) == []


def test_a_bad_wait_notice_is_refused_before_the_run() -> None:
    result = durcap_here('run', 'tests/fixtures/counting_agent.py:counted', 'hi', '--engine', 'local',
                         env={'DURCAP_WAIT_NOTICE': '0'})
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stderr.strip() == ("durcap: error: DC040 $DURCAP_WAIT_NOTICE: must be a number of seconds above 0, "
                                     "got '0'. Fix: unset it (default 30 s) or give e.g. 60."), result.stderr
