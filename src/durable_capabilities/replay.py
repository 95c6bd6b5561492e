"""Replay recorded histories against the current code, and say what changed when one fails.

An engine reports a renamed durable unit as nondeterminism (Temporal: a `NondeterminismError` about
activity types); it never names the capability. `replay_histories` replays with the replayer of the
engine that records replayable histories (`EngineAdapter.replayer`: Temporal's `Replayer`) and turns
such a failure into a `ReplayFailure` naming the capability, leaf toolset or agent whose name changed,
and the fix (the replayer's `explain`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .agent import DurableAgent
from .engines import ENGINES


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


async def replay_histories(
    paths: Sequence[str | Path], agents: Sequence[DurableAgent[Any, Any]], *, store: str | None = None
) -> list[ReplayFailure]:
    """Replay each history file (temporalio's JSON export) against the agents' workflows.

    Payloads stored by reference (the claim-check codec) are read from `store` (default `$DURCAP_STORE`, else
    the default store): the database the workers that recorded the histories used.

    Returns:
        The failures, empty when every history replays.

    Raises:
        ValueError: a file is not a Temporal history JSON.
    """
    adapter = next((a for a in ENGINES.values() if 'history' in a.features and a.available()), None)
    replayer = adapter.replayer(agents, store=store) if adapter is not None else None
    if replayer is None:
        raise ValueError('no installed engine replays recorded histories (pip install "durable-capabilities[temporal]")')
    failures: list[ReplayFailure] = []
    for path in paths:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding='utf-8'))
            if not isinstance(raw, dict) or not (raw.get('history') or raw).get('events'):
                raise ValueError('no `events`')
            workflow_id = raw.get('workflowId') or raw.get('workflow_id') or path.stem
            history = raw.get('history', raw)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f'{path}: not a Temporal history JSON ({exc})') from None
        try:
            error = await replayer.replay(history, workflow_id)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f'{path}: not a Temporal history JSON ({exc})') from None
        if error is not None:
            failures.append(ReplayFailure(str(path), workflow_id, error, replayer.explain(error)))
    return failures

