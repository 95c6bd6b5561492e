"""The waiting client's notice that a run it waits for has stopped moving because no worker takes it.

`durcap run --engine temporal` (waiting on a remote worker) and `durcap run --engine dbos --queue Q` hand the run to
workers and wait for its answer. When the only worker dies mid-run the run is safe (it is durable: a worker started
later finishes it), but the client used to wait in silence, forever. Each engine gives `notice_stalls` a probe that
says, on each look, what the run's progress is (`Progress.signature`: anything that changes when the run moves on)
and whether some part of it waits for a worker right now (`Progress.waiting`); after `wait_notice()` seconds in which
something waited for a worker and nothing moved, one line goes to the client's stderr, and the client keeps waiting.
A run waiting for a person (an approval) or a timer waits for no worker, so it is never reported.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Self

from .._limits import env_seconds

WAIT_NOTICE_ENV = 'DURCAP_WAIT_NOTICE'
DEFAULT_WAIT_NOTICE = 30.0
"""Seconds a waiting `durcap run` lets a run wait for a worker without progress before it says so
(`$DURCAP_WAIT_NOTICE` overrides it). Longer than a worker's pick-up (milliseconds) and than the engines' own
recovery of a killed worker's task (Temporal: the activity's heartbeat timeout, 1-5 s; DBOS: a peer's timeout, 15 s),
short enough that a client is not left guessing for minutes."""


def wait_notice() -> float:
    """Seconds without progress before the waiting client's notice: `$DURCAP_WAIT_NOTICE`, else `DEFAULT_WAIT_NOTICE`.

    Raises:
        InputError: DC040, the variable is not a number of seconds above 0 (checked before the run starts).
    """
    return env_seconds(WAIT_NOTICE_ENV, DEFAULT_WAIT_NOTICE, 60)


class WaitingForWorker(str):
    """A `notify` line saying that a run waits for a worker: none serves its queue, or none has taken it for a while.
    `durcap run` prints it as any line; `durcap serve` also publishes it in the run's stream (a `run_waiting` event,
    `data['notice']`: `api`), where an application sees it (the run is not refused: a worker may come later).

    Attributes:
        api: The line for an API client, when the printed one names a flag of `durcap run` (default: the same text).
    """

    api: str

    def __new__(cls, line: str, api: str | None = None) -> Self:
        made = super().__new__(cls, line)
        made.api = api or line
        return made


@dataclass(frozen=True)
class Progress:
    """One look at a run, for `notice_stalls`.

    Attributes:
        signature: Changes whenever the run moves on (a new history event, a step recorded, a task taken).
        waiting: What waits for a worker right now, in words (`'activity model_request (attempt 2)'`); `None` when
            nothing does (a worker holds the run's task, or the run waits for a person or a timer).
        done: The run has ended: stop looking.
    """

    signature: Hashable
    waiting: str | None
    done: bool = False


async def notice_stalls(probe: Callable[[], Awaitable[Progress]], line: Callable[[str, float], Awaitable[str]],
                        notify: Callable[[str], None], seconds: float) -> None:
    """Look at the run every `seconds / 4` (0.2-2 s) until it ends or this task is cancelled; say `await line(waiting,
    seconds)` on `notify` once `seconds` have passed in which `probe()` kept reporting the same `waiting` part and the
    same signature. Said once per stall: again only after the run moved and stalled anew.

    A probe that raises (the engine's server or database briefly unreachable) is skipped: the client's own wait
    reports outages.

    Args:
        probe: One look at the run (`Progress`); `done` ends the watch.
        line: `(waiting, seconds) -> the line to say` (it may ask the engine more, e.g. the queue's pollers).
        notify: Where the line goes (the client's stderr).
        seconds: How long a part must wait for a worker with no progress before it is said (`wait_notice()`).
    """
    poll = max(0.2, min(2.0, seconds / 4))
    loop = asyncio.get_running_loop()
    last: tuple[Hashable, str] | None = None
    since, said = loop.time(), False
    while True:
        with contextlib.suppress(Exception):
            progress = await probe()
            if progress.done:
                return
            now = (progress.signature, progress.waiting) if progress.waiting is not None else None
            if now != last:
                last, since, said = now, loop.time(), False
            elif now is not None and not said and loop.time() - since >= seconds:
                notify(WaitingForWorker(await line(now[1], seconds)))
                said = True
        await asyncio.sleep(poll)
