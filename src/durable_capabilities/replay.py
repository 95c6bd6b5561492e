"""Replay recorded Temporal histories against the current code, and say what changed when one fails.

Temporal reports a renamed activity as a `NondeterminismError` about activity types; it never names
the capability. `replay_histories` replays with temporalio's `Replayer` and turns such a failure into
a `ReplayFailure` naming the capability, leaf toolset or agent whose name changed, and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .agent import DurableAgent

_ACTIVITY_RE = re.compile(r'agent__(?P<agent>.+?)__(?:toolset__(?P<toolset>.+?)__(?:call_tool|validate_args|get_tools)|model_\w+)')


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


def _explain(error: str, agents: Sequence[DurableAgent[Any, Any]]) -> str:
    names = [m for m in _ACTIVITY_RE.finditer(error)]
    current_leaves = {leaf: cap for agent in agents for cap, leaves in agent.leaf_ids().items() for leaf in leaves}
    current_agents = {agent.durable_name for agent in agents}
    for match in names:
        agent_name, toolset = match.group('agent'), match.group('toolset')
        if agent_name not in current_agents:
            return (
                f'the history was recorded by agent {agent_name!r}, whose durable name changed; '
                f"declare it: `DurableAgent(..., previous_names=['{agent_name}'])`."
            )
        if toolset and toolset not in current_leaves and toolset != '<agent>':
            return (
                f'the history used leaf toolset {toolset!r} (capability {toolset!r} or a toolset under it), which the '
                f"current definition no longer has; if the capability was renamed, declare it: "
                f"`DurableAgent(..., aliases={{'<new id>': '{toolset}'}})`."
            )
    return 'the workflow code no longer matches the recorded history (nondeterminism); see the temporal message.'


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
    from pydantic_ai.durable_exec.temporal import PydanticAIPlugin
    from temporalio.client import WorkflowHistory
    from temporalio.converter import DataConverter
    from temporalio.worker import Replayer

    from ._claim_check import default_codec
    from .engines.temporal import sandbox_runner, workflow_classes

    replayer = Replayer(
        workflows=[cls for agent in agents for cls in workflow_classes(agent)],
        plugins=[PydanticAIPlugin()],
        workflow_runner=sandbox_runner(),
        data_converter=DataConverter(payload_codec=default_codec(store)),  # decodes claim checks
    )
    failures: list[ReplayFailure] = []
    for path in paths:
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding='utf-8'))
            if not isinstance(raw, dict) or not (raw.get('history') or raw).get('events'):
                raise ValueError('no `events`')
            workflow_id = raw.get('workflowId') or raw.get('workflow_id') or path.stem
            history = WorkflowHistory.from_json(workflow_id, raw.get('history', raw))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f'{path}: not a Temporal history JSON ({exc})') from None
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if result.replay_failure is not None:
            error = str(result.replay_failure)
            failures.append(ReplayFailure(str(path), workflow_id, error, _explain(error, agents)))
    return failures


async def export_history(client: Any, workflow_id: str, output: str | Path) -> Path:
    """Write a workflow's history as JSON (`{"workflowId": ..., "history": {...}}`) to `output`.

    Payloads are written as Temporal holds them: a large one is a claim-check reference (encoding
    `binary/durcap-claim-check`), which `replay_histories` decodes from the store.
    """
    handle = client.get_workflow_handle(workflow_id)
    history = await handle.fetch_history()
    output = Path(output)
    output.write_text(
        json.dumps({'workflowId': workflow_id, 'history': json.loads(history.to_json())}, indent=1), encoding='utf-8'
    )
    return output
