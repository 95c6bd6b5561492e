"""Replay recorded histories against the current code, and say what changed when one fails.

An engine reports a renamed durable unit as nondeterminism (Temporal: a `NondeterminismError` about
activity types); it never names the capability. `replay_histories` replays with the replayer of the
engine that records replayable histories (`EngineAdapter.replayer`: Temporal's `Replayer`) and turns
such a failure into a `ReplayFailure` naming the capability, leaf toolset or agent whose name changed,
and the fix (the replayer's `explain`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._limits import (
    MAX_HISTORY_BYTES,
    InputError,
    is_digits,
    load_json,
    one_line,
    printable,
    read_bytes,
    replay_timeout,
)
from .agent import DurableAgent
from .engines import ENGINES


class ReplayTimeout(InputError, code='DC040'):
    """A history did not replay within `_limits.replay_timeout()` seconds (the replayer may still hold a thread)."""


@dataclass
class ReplayFailure:
    """One history that does not replay.

    Attributes:
        source: The history file (or workflow id).
        workflow_id: The recorded workflow id.
        error: temporalio's own message.
        explanation: What changed, naming the capability / toolset / agent, and the fix.
    """

    source: str
    workflow_id: str
    error: str
    explanation: str

    def format(self) -> str:
        return f'{self.source} ({self.workflow_id}): {self.explanation}\n  temporal: {self.error}'


_STARTED = 'EVENT_TYPE_WORKFLOW_EXECUTION_STARTED'
_TASK_STARTED = 'EVENT_TYPE_WORKFLOW_TASK_STARTED'


def _event_id(event: Any, index: int, where: str) -> int:
    raw = event.get('eventId') if isinstance(event, dict) else None
    if isinstance(raw, bool) or not isinstance(raw, (int, str)) or not is_digits(str(raw)):
        raise InputError(where, f'event {index + 1} has eventId {printable(repr(raw))[:40]}, not a number. '
                         'Export the history again with `durcap history export`.')
    return int(raw)


def read_history(path: str | Path) -> tuple[str, dict[str, Any]]:
    """Read and check one exported history before any replayer sees it.

    A history the Temporal replayer would choke on is refused here: temporalio's core panics and then waits
    forever on a history without a workflow task, or whose first event is not the workflow's start.

    Returns:
        `(workflow id, the history's `{"events": [...]}` mapping)`.

    Raises:
        InputError: unreadable, not a regular file, over `_limits.MAX_HISTORY_BYTES`, not JSON, nested too deep,
            no events, an event that is not an object or whose eventId is not a number, ids out of order, the
            first event not `EVENT_TYPE_WORKFLOW_EXECUTION_STARTED` (with its run ids), or no workflow task started.
    """
    path = Path(path)
    where = str(path)
    try:
        raw = load_json(read_bytes(path, limit=MAX_HISTORY_BYTES, what='history'), where=where, limit=MAX_HISTORY_BYTES)
    except OSError as exc:
        raise InputError(where, f'cannot read the history: {exc.strerror or type(exc).__name__}.') from None
    history = raw.get('history', raw) if isinstance(raw, dict) else None
    events = history.get('events') if isinstance(history, dict) else None
    if not isinstance(raw, dict) or not isinstance(history, dict) or not isinstance(events, list) or not events:
        raise InputError(where, 'not a Temporal history JSON (no `events` list). Export one with `durcap history export`.')
    for index, event in enumerate(events):
        if not isinstance(event, dict):
            raise InputError(where, f'event {index + 1} is not a JSON object.')
        if _event_id(event, index, where) != index + 1:
            raise InputError(where, f'event {index + 1} has eventId {printable(event.get("eventId"))[:20]}; event ids must '
                             'count from 1 without gaps. Export the history again.')
    attributes = events[0].get('workflowExecutionStartedEventAttributes')
    if events[0].get('eventType') != _STARTED or not isinstance(attributes, dict) \
            or not attributes.get('originalExecutionRunId'):
        raise InputError(where, f'the first event is not {_STARTED} with its run ids: not a whole workflow history. '
                         'Export the history again with `durcap history export`.')
    if not any(event.get('eventType') == _TASK_STARTED for event in events):
        raise InputError(where, 'the history has no started workflow task: there is nothing to replay. Export it '
                         'again once the workflow has run.')
    workflow_id = raw.get('workflowId') or raw.get('workflow_id') or path.stem
    if not isinstance(workflow_id, str):
        raise InputError(where, 'workflowId is not a string.')
    return workflow_id, history


def _replay_in_thread(replayer: Any, history: dict[str, Any], workflow_id: str) -> concurrent.futures.Future[Any]:
    """Start the replay on its own event loop in a daemon thread; its future holds the replayer's answer.

    A thread, not a task: a replayer stuck in temporalio's native core never finishes a cancellation, and
    `asyncio.run` would wait for it when the caller's loop closes."""
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def work() -> None:
        try:
            outcome = asyncio.run(replayer.replay(history, workflow_id))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_exception(exc)
        else:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_result(outcome)

    threading.Thread(target=work, name=f'durcap-replay-{workflow_id[:40]}', daemon=True).start()
    return future


async def _replay_one(replayer: Any, history: dict[str, Any], workflow_id: str, where: str) -> str | None:
    """The replayer's failure text for one history, under `_limits.replay_timeout()` seconds."""
    timeout = replay_timeout()
    waiting = asyncio.wrap_future(_replay_in_thread(replayer, history, workflow_id))
    done, _ = await asyncio.wait({waiting}, timeout=timeout)
    if not done:
        waiting.cancel()
        raise ReplayTimeout(where, f'the history did not replay within {timeout:g} s (DURCAP_REPLAY_TIMEOUT); the '
                         'Temporal replayer is stuck on it. Export the history again.')
    try:
        return waiting.result()
    except Exception as exc:  # noqa: BLE001 - the replayer's parse or runtime failure, one line
        raise InputError(where, f'the Temporal replayer rejected the history: {type(exc).__name__}: '
                         f'{one_line(str(exc))}') from None


async def replay_histories(
    paths: Sequence[str | Path], agents: Sequence[DurableAgent[Any, Any]], *, store: str | None = None
) -> list[ReplayFailure]:
    """Replay each history file (temporalio's JSON export) against the agents' workflows.

    Payloads stored by reference (the claim-check codec) are read from `store` (default `$DURCAP_STORE`, else
    the default store): the database the workers that recorded the histories used. Every file is checked
    (`read_history`) before the first replay; each replay runs under `_limits.replay_timeout()` seconds.

    Returns:
        The failures, empty when every history replays.

    Raises:
        ValueError: no installed engine replays histories.
        InputError (a ValueError, code DC040): a file is not a whole Temporal history JSON, is over a bound,
            or did not replay in time.
    """
    histories = [(str(Path(path)), *read_history(path)) for path in paths]
    adapter = next((a for a in ENGINES.values() if 'history' in a.features and a.available()), None)
    replayer = adapter.replayer(agents, store=store) if adapter is not None else None
    if replayer is None:
        raise ValueError('no installed engine replays recorded histories (pip install "durable-capabilities[temporal]")')
    failures: list[ReplayFailure] = []
    for where, workflow_id, history in histories:
        error = await _replay_one(replayer, history, workflow_id, where)
        if error is not None:
            failures.append(ReplayFailure(where, workflow_id, error, replayer.explain(error)))
    return failures
