"""Prefect: a flow run whose process died without a word (issue 29 item 3) is marked CRASHED, so `watch_crashed`
reschedules it.

Prefect marks a flow run CRASHED when its process reports the crash, or when the serving process that started it
sees it exit. When both die at once (a machine or container lost, a process group killed with SIGKILL), nobody
reports anything and the run stays PENDING or RUNNING for good; Prefect's own flow-run heartbeat events come at most
every 30 s and the open-source server acts on none of them. So:

- `beating(flow_run_id)`: every flow run of an agent's flow beats while it is held (a deployment's, what `durcap
  schedule prefect` serves, and since issue 24 one `durcap run --engine prefect` or `durcap runs resume` runs in its
  own process, which `durcap store gc` needs to tell a live run from an abandoned one: `_runs.run_states`): a daemon
  thread sets the flow run's label `BEAT_LABEL` to a new value every `beat_seconds()` seconds (one small
  PATCH to the Prefect API; at 2 s, 100 running flow runs make 50 requests a second). Who beats: the serving process
  that took the run, from the moment it starts the run's process (forked or spawned) until that process exits
  (`_prefork`); the run's own process only once that serving process is gone (`HELD_ENV`: it lives on after a
  serving process killed alone) or when no serving process holds it (`durcap runs resume` runs it in its own process).
- `DeadRunWatch`, in every serving process (`_worker.watch_crashed` runs a round every 2 s): a PENDING or RUNNING
  flow run of the deployment whose beat label this process has seen unchanged for `stale_seconds()` seconds of its
  own clock (no clock is compared across machines) is dead. The process that creates the write-once flow run input
  `DEAD_CLAIM_PREFIX` + the run's state id (the server refuses a second with 409) marks it CRASHED; the crash is
  then rescheduled once, like any other (`_worker.resume_crashed`), and runs again from its cached tasks.

A PENDING flow run of the deployment is one a serving process took: Prefect's runner proposes PENDING only for a run
it has a slot for, just before it starts the run's process (a run waiting for a slot stays SCHEDULED and is not
watched). So a PENDING run that does not beat is one whose serving process died between taking it and its process
beating (bench_scaleout.py --kill: the killed process's last run, its process forked 0.5 s before the kill, was left
PENDING for good), and is watched like a RUNNING one. A PENDING or RUNNING run with no beat label at all is watched
the same way (its "beat" is the missing label): a label written while the server moves the run to RUNNING can be
lost on a busy server. What this gives up: a flow run started by durcap before the beats (December 2026) and still
PENDING or RUNNING is declared dead after the stale time. Flow runs outside a deployment (`durcap run` waits for its
own run in its own process) beat but are not watched: nobody else would run them again; `durcap store gc` counts one
silent for its `--abandoned-after` time as abandoned. A process that stalls longer than the stale time (a debugger, a
swapped-out machine) is declared dead while alive: raise `$DURCAP_PREFECT_STALE_SECONDS` where that can happen.

A busy Prefect server on SQLite refuses writes (503 after ~2 s waiting for its lock) for seconds at a time, beats
included, so a run's silence is counted at the rate the server takes beats (`BeatSilence`): the stretch between two
watch rounds counts in full while at least half (`FULL_RATE`) of the beats this process sent in it landed, in part
below that (a quarter landed: half of it), not at all while none landed, and in full when this process sent none
(nothing seen refused). So a run is declared dead only after missing, at the rate beats landed meanwhile, about
`stale_seconds() * FULL_RATE / beat_seconds()` beats (~4) that a live run would have landed. Measured
(bench_scaleout.py --kill, a trace of every beat and watch round): at load 8-18 about half of all beats failed, every
serving process had one fail every few seconds, and no live run's label stayed unchanged for more than 8 s; with 75%
failing (load 18-21) one stayed unchanged for 12.3 s, and with 94% (load 23-26) several for 15-18 s. Hence half,
not less: at 0.25 the first of these would have counted in full, 12.3 of the 15 s. The rule before (no run declared dead while
any of this process's own beats had failed within the stale time) held the survivors back until their own runs were
done: dead runs were marked CRASHED 31-38 s after the kill instead of ~17 s; counting every stretch in which any beat
landed (this branch's first try) declared live runs dead at load 23-26.

Where no serving process watches (a flow run outside a deployment: `durcap run --engine prefect`), a run's silence is
judged on the Prefect server's clock instead, by whoever asks: `server_clock`, `last_sign_of_life` (its `updated`,
which every beat moves, its state's time, its task runs') and `silent_for` are the one rule that a conversation's turn
claim (`_conversation._flow_run_active`) and `durcap store gc` (`_runs.run_states`) both use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from email.utils import parsedate_to_datetime
from typing import Any

from prefect import get_client
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterState,
    FlowRunFilterStateType,
)
from prefect.client.schemas.objects import StateType
from prefect.exceptions import PrefectHTTPStatusError
from prefect.input import acreate_flow_run_input, aread_flow_run_input
from prefect.states import Crashed

from ..._limits import is_digits
from .._process import pid_alive

BEAT_LABEL = 'durcap.beat'
"""The flow run label a running flow run's process sets to a new value every beat (`<pid>:<count>`)."""

BEAT_SECONDS_ENV = 'DURCAP_PREFECT_BEAT_SECONDS'
STALE_SECONDS_ENV = 'DURCAP_PREFECT_STALE_SECONDS'
DEFAULT_BEAT_SECONDS = 2.0
"""Seconds between two beats of a running flow run (`$DURCAP_PREFECT_BEAT_SECONDS`)."""
DEFAULT_STALE_SECONDS = 15.0
"""Seconds a serving process must see a PENDING or RUNNING flow run's beat unchanged before it marks the run CRASHED
(`$DURCAP_PREFECT_STALE_SECONDS`; at least three beats)."""

DEAD_CLAIM_PREFIX = 'durcap-dead-'
"""Flow run input key prefix of a dead-run claim (+ the PENDING or RUNNING state's id): write-once, so one process
marks it."""

logger = logging.getLogger(__name__)


def _seconds(name: str, default: float) -> float:
    """`$name` as seconds above 0, else `default` (`_limits.env_seconds`; DC040 on anything else)."""
    from ..._limits import env_seconds

    return env_seconds(name, default)


def beat_seconds() -> float:
    """Seconds between two beats (`$DURCAP_PREFECT_BEAT_SECONDS`, default `DEFAULT_BEAT_SECONDS`).

    Raises:
        InputError: DC040, an unusable value.
    """
    return _seconds(BEAT_SECONDS_ENV, DEFAULT_BEAT_SECONDS)


def stale_seconds() -> float:
    """Seconds without a new beat after which a PENDING or RUNNING flow run is dead (`$DURCAP_PREFECT_STALE_SECONDS`, default
    `DEFAULT_STALE_SECONDS`, never under three beats).

    Raises:
        InputError: DC040, an unusable value.
    """
    return max(_seconds(STALE_SECONDS_ENV, DEFAULT_STALE_SECONDS), 3 * beat_seconds())


@contextmanager
def beating(flow_run_id: str) -> Iterator[None]:
    """While the block runs, flow run `flow_run_id` beats (`BEAT_LABEL` set anew every `beat_seconds()` from a daemon
    thread with its own event loop). A beat that fails (the API briefly unreachable) is logged and the next one tried
    0.5 s later: a missed beat or two never declares the run dead.

    In a flow-run process whose serving process beats it (`HELD_ENV` names that process in its environment,
    `_prefork`), the thread sends nothing while that process lives: one beat a run, not two. Once it is gone (the
    serving process died, the run's process lives on), the run beats itself, so a survivor does not declare a live
    run dead.

    Re-entrant: in a process that beats `flow_run_id` already (a forked flow-run process beats from its start, before
    its flow runs), the block adds no thread but has the next beat go out now."""
    if flow_run_id in _BEATING:
        _BEATING[flow_run_id].set()
        yield
        return
    every = beat_seconds()
    held = os.environ.get(HELD_ENV, '')
    held_by = int(held) if is_digits(held) else None
    stop = threading.Event()
    wake = threading.Event()  # set to beat now (a nested block), or with `stop`

    async def loop() -> None:
        count = 0
        # The client is made at the first beat this thread sends: a forked flow-run process whose serving process
        # beats it sends none, and making one costs a TLS context and the client's first requests (h/prefectscale).
        async with contextlib.AsyncExitStack() as stack:
            client: Any = None
            while not stop.is_set():
                wait = every
                if held_by is None or not pid_alive(held_by):
                    count += 1
                    try:
                        if client is None:
                            client = await stack.enter_async_context(get_client())
                        # One try at most `every` s: Prefect's client retries a 503 with a growing backoff (a write
                        # refused by a busy server on SQLite), which would hold the next beat back for tens of s.
                        await asyncio.wait_for(client.update_flow_run_labels(
                            uuid.UUID(flow_run_id), {BEAT_LABEL: f'{os.getpid()}:{count}'}), timeout=every)
                        _count_beat(landed=True)
                    except Exception as exc:  # next beat, sooner; the run goes on either way
                        _count_beat(landed=False)
                        logger.debug('flow run %s: beat %d failed', flow_run_id, count, exc_info=True)
                        if count == 1:
                            logger.warning('flow run %s: its first beat failed (%s: %s); trying again', flow_run_id,
                                           type(exc).__name__, str(exc)[:200])
                        wait = min(every, 0.5)
                await asyncio.to_thread(wake.wait, wait)
                wake.clear()

    thread = threading.Thread(target=lambda: asyncio.run(loop()), name=f'durcap-beat-{flow_run_id}', daemon=True)
    _BEATING[flow_run_id] = wake
    thread.start()
    try:
        yield
    finally:
        stop.set()
        wake.set()
        _BEATING.pop(flow_run_id, None)


BEATS = [0, 0]
"""How many beats sent from this process have landed ([0]) and failed ([1], refused or no answer within the beat
interval) so far: `DeadRunWatch` counts a run's silence at the rate this process's own beats land (`BeatSilence`)."""

_BEATS_LOCK = threading.Lock()


def _count_beat(landed: bool) -> None:
    with _BEATS_LOCK:
        BEATS[0 if landed else 1] += 1


FULL_RATE = 0.5
"""The share of this process's beats landing from which a stretch of silence counts in full (`BeatSilence`)."""

_BEATING: dict[str, threading.Event] = {}
"""The flow runs this process beats now (`beating`), each with the event that makes its next beat go out now."""

HELD_ENV = 'DURCAP_PREFECT_HELD_BY'
"""Set to its own process id in a flow-run process's environment by the serving process that starts it and beats it
(`_prefork`): the flow-run process's own `beating` stays quiet while that process lives (see `beating`). Not the
parent: a forked flow-run process's parent is the fork server, which lives as long as any process it forked."""


class BeatSilence:
    """How long each watched flow run's beat has been silent, on this process's clock, counted at the rate the server
    takes beats (the module docstring): the stretch between two looks counts in full when at least `FULL_RATE` of the
    beats this process sent in it landed (or it sent none), in proportion below that, not at all when none landed.

    A run first seen, or whose beat changed, starts at 0; a run not in a look is forgotten. Pure bookkeeping (no
    request, no clock of its own): `DeadRunWatch` feeds it each round's read and `BEATS`."""

    def __init__(self) -> None:
        self.looked: float | None = None
        """The time of the last look (`None`: none yet)."""
        self.beats_then = (0, 0)
        """This process's beats landed and failed so far, at the last look."""
        self.runs: dict[Hashable, tuple[str, float, float]] = {}
        """Key -> (its beat at the last look, seconds of silence counted, when this beat was first seen)."""

    def look(self, now: float, beats: Mapping[Hashable, str], landed: int = 0, failed: int = 0
             ) -> dict[Hashable, tuple[float, float]]:
        """Take one look at the watched runs' beats.

        Args:
            now: This process's clock, seconds (monotonic, not before the last look's).
            beats: Each watched run's key (flow run id and state id) -> its beat label's value now ('' for none).
            landed: How many beats sent from this process have landed so far (`BEATS[0]`; never decreasing).
            failed: How many have failed so far (`BEATS[1]`; never decreasing).

        Returns:
            Each key of `beats` -> (seconds of silence counted, seconds since its beat was first seen unchanged).
        """
        before, (landed_then, failed_then) = self.looked, self.beats_then
        step = 0.0
        if before is not None:
            new_landed, new_failed = max(0, landed - landed_then), max(0, failed - failed_then)
            sent = new_landed + new_failed
            rate = min(1.0, new_landed / sent / FULL_RATE) if sent else 1.0
            step = rate * max(0.0, now - before)
        current: dict[Hashable, tuple[str, float, float]] = {}
        for key, beat in beats.items():
            last = self.runs.get(key)
            current[key] = (beat, last[1] + step, last[2]) if last is not None and last[0] == beat else (beat, 0.0, now)
        self.runs, self.looked, self.beats_then = current, now, (landed, failed)
        return {key: (silent, now - since) for key, (_, silent, since) in current.items()}


class DeadRunWatch:
    """One serving process's view of the beats of its deployment's PENDING and RUNNING flow runs (see the module docstring).

    Args:
        deployment_id: The deployment whose flow runs are watched.
        notify: Called with one line per flow run this process marked CRASHED.
        clock: Seconds, monotonic (this process's own clock; never compared with another machine's).
    """

    def __init__(self, deployment_id: Any, notify: Callable[[str], None], clock: Callable[[], float] = time.monotonic):
        self.deployment_id = deployment_id
        self.notify = notify
        self.clock = clock
        self.silence = BeatSilence()
        """(flow run id, PENDING or RUNNING state id) -> its silence (`BeatSilence`)."""

    async def round(self, client: Any, runs: list[Any] | None = None) -> list[str]:
        """Look at the deployment's PENDING and RUNNING flow runs once; mark CRASHED those dead (and claimed here):
        silent for `stale_seconds()`, counted at the rate the server takes beats (`BeatSilence`).

        Args:
            client: A Prefect client (`get_client()`, open).
            runs: The deployment's flow runs as read just now (Prefect `FlowRun`s; those in other states are skipped),
                or `None` to read them here.

        Returns:
            The ids of the flow runs this process marked CRASHED in this round.
        """
        stale = stale_seconds()
        if runs is None:
            runs = await client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[self.deployment_id])),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                    any_=[StateType.PENDING, StateType.RUNNING]))))
        watched = {(str(run.id), str(run.state.id)): run for run in runs or []
                   if run.state is not None and run.state.type in (StateType.PENDING, StateType.RUNNING)}
        # '': no beat yet (watched as well, module docstring)
        silence = self.silence.look(self.clock(), {key: str((run.labels or {}).get(BEAT_LABEL, ''))
                                                   for key, run in watched.items()}, *BEATS)
        dead = []
        for key, run in watched.items():
            silent, unchanged = silence[key]
            if silent >= stale:
                dead.append((run, unchanged))
            elif unchanged >= stale:  # the server refused many of this process's beats meanwhile: proves less
                logger.info('flow run %s: no beat for %.0f s, counted %.0f s at the rate the server took beats: not '
                            'declared dead yet', run.id, unchanged, silent)
        # All at once: each is a claim and a state change, writes a busy server may take seconds to answer.
        done = await settle(self._mark(client, run, unchanged) for run, unchanged in dead)
        return [str(run.id) for (run, _), ok in zip(dead, done, strict=True) if ok]

    async def _mark(self, client: Any, run: Any, silent: float) -> bool:
        if not await claim(f'{DEAD_CLAIM_PREFIX}{run.state.id}', run.id):
            return False
        held = 'its process' if run.state.type == StateType.RUNNING else 'the serving process that took it'
        result = await client.set_flow_run_state(run.id, Crashed(
            message=f'durcap: no beat for {silent:.0f} s while {run.state.type.value}: {held} died without reporting it'))
        if result.status.value != 'ACCEPT':
            logger.warning('flow run %s: marking it CRASHED was refused (%s)', run.id, result.status.value)
            return False
        self.notify(f'prefect flow run {run.id} ({run.name}, {run.state.type.value}) stopped beating {silent:.0f} s ago '
                    f'({held} died with no word): marked CRASHED, to be rescheduled')
        return True


async def settle(steps: Iterable[Awaitable[bool]]) -> list[bool]:
    """Await `steps` all at once; each one's outcome, in order, False for one that raised (logged; the next watch
    round tries again: a claim is taken up again by the process that holds it)."""
    outcomes = await asyncio.gather(*steps, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            if not isinstance(outcome, Exception):
                raise outcome  # cancelled, interrupted: not an outcome
            logger.debug('a dead-run step failed; tried again next round', exc_info=outcome)
    return [outcome is True for outcome in outcomes]


async def claim(key: str, flow_run_id: Any) -> bool:
    """Claim flow run input `key` of flow run `flow_run_id` for this process: True when this process created it now or
    before (a claim whose next step failed, e.g. a write refused by a busy server, is taken up again by the process
    that holds it), False when another process holds it (write-once: the server answers 409 to a second).

    Raises:
        PrefectHTTPStatusError: the server refused the input for another reason.
    """
    mine = {'pid': os.getpid(), 'host': socket.gethostname()}
    try:
        await acreate_flow_run_input(key, mine, flow_run_id=flow_run_id)
        return True
    except PrefectHTTPStatusError as exc:
        if exc.response.status_code != 409:
            raise
    return await aread_flow_run_input(key, flow_run_id=flow_run_id) == mine


# ---- the server's clock: a flow run's last sign of life, judged where no serving process watches (`durcap run`'s
# own flow runs: `_conversation._flow_run_active` for a conversation's turn claim, `_runs.run_states` for gc) --------


async def server_clock(client: Any) -> datetime | None:
    """The Prefect server's clock now: the `Date` header of its `/hello` answer (to the second), aware UTC. Flow run
    times are the server's: compared with this, a server whose clock differs from this machine's does not make a live
    run look silent.

    Args:
        client: A Prefect client (`get_client()`, open).

    Returns:
        The server's time, or `None` when its answer carries no usable `Date` header.

    Raises:
        Whatever the client raises when the server cannot be asked (`httpx.HTTPError`, `PrefectHTTPStatusError`).
    """
    response = await client.hello()
    try:
        return parsedate_to_datetime(response.headers['date']).astimezone(UTC)
    except (KeyError, TypeError, ValueError):
        return None


def utc(moment: datetime) -> datetime:
    """A Prefect time (a pendulum or standard datetime; naive means UTC) as a standard aware UTC `datetime`."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return datetime.fromtimestamp(moment.timestamp(), UTC)


def last_sign_of_life(run: Any, more: Iterable[datetime | None] = ()) -> datetime | None:
    """The newest sign of life of Prefect flow run `run`, on the server's clock (aware UTC): its `updated` (which every
    beat moves, `beating`), its state's time, and `more` (e.g. its task runs' `updated`; `None`s skipped). `None` when
    it has none."""
    state_time = run.state.timestamp if run.state is not None else None
    return max((utc(t) for t in (run.updated, state_time, *more) if t is not None), default=None)


def silent_for(last: datetime | None, now: datetime, limit: timedelta | float) -> bool:
    """Whether a flow run whose last sign of life was `last` (`last_sign_of_life`) has been silent for `limit` (a
    `timedelta`, or seconds) or longer at `now`, both on the server's clock (`server_clock`). A run that has shown no
    sign (`last` `None`) is not silent: nothing to judge by."""
    if last is None:
        return False
    return now - last >= (limit if isinstance(limit, timedelta) else timedelta(seconds=limit))
