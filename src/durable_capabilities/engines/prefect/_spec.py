"""Prefect's names, keys and numbers: the constants every other module of `engines.prefect` imports.

At the bottom of the package: imports nothing of it (nor prefect), so any module may use these.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from .._conversation_unit import UnitRetry

if TYPE_CHECKING:
    from ...agent import DurableAgent

ENGINE = 'prefect'

FLOW_NAME_PREFIX = 'durcap-'
"""Flow name: `durcap-{agent name}`."""

CONVERSATION_TASKS = ('Load Conversation', 'Append Conversation')
"""Task names of the conversation load and append of flow runs recorded by earlier durcap versions, when these units
were tasks. A flow run now loads and appends in its own code (`_conversation`: no task run, no persisted
result: Prefect's records of two task runs per turn were ~1x the conversation's bytes); these names are only read,
to finish such a flow run when it is resumed (`durable.lock` lists them under `recovered_tasks`)."""

LOADED_INPUT = 'durcap-loaded'
"""Flow run input key holding what the turn's conversation load read (`_conversation.recorded_load`: the revision and
head entry id, a few hundred bytes): a flow run run again after a crash starts from the same history."""

MODEL_REQUEST_TASK = 'Model Request'
"""Task name of a model request (`durable.lock`; upstream appends the model name to the run's name)."""

AGENT_TOOLSET_ID = '<agent>'
"""pydantic-ai's id of the agent's own function toolset (`Agent(tools=[...])`); its tools' task runs are named
`{agent name}.{tool}`."""

APPROVAL_CLOCK_TASK = 'Approval Clock'
"""Task that reads the clock when a run starts waiting (cached per flow run: a re-run keeps the deadline)."""

PENDING_INPUT = 'durcap-pending'
"""Flow run input key holding the pending calls (JSON list of `PendingCall`)."""

DECISION_INPUT_PREFIX = 'durcap-decision-'
"""Flow run input key prefix of a decision: `durcap-decision-{call id}` (written by `decide`)."""

SUSPEND_GRACE_SECONDS = 3600
"""Seconds past an approval deadline before Prefect fails a Suspended flow run nobody resumed (see `watch_deadlines`)."""

FLOW_ATTR_PREFIX = 'flow__'
"""Attributes of `engines.prefect._entry` naming a flow: `flow__<agent name>` (the deployments' entrypoints)."""

TARGET_ENV = 'DURCAP_TARGET'
"""Where a deployment's flow-run process loads its agents from (any TARGET form, `durable_capabilities.targets`)."""

DEFAULT_TOOL_RETRIES = 2
"""Retries for a function-tool task (3 attempts in all), `TOOL_RETRY_DELAY_SECONDS` apart."""
TOOL_RETRY_DELAY_SECONDS = 1.0

DEFAULT_MODEL_RETRIES = 2
"""Retries for a model request task (3 attempts in all, 2 s then 4 s apart, or the provider's `retry-after` up to
`MAX_RETRY_AFTER_SECONDS`); Prefect's own default is none (`@task(retries=0)`), so a stream the provider cut half way
would fail the flow. Errors another attempt cannot fix (401, 404 model, quota) are not retried
(`retry_model_request`). Each attempt carries the provider SDK's own retries (2, honouring `retry-after` on
429/503)."""

DEFAULT_MODEL_RETRY_DELAYS = (2.0, 4.0)
"""Seconds before the model request task's first and second retry when the error carried no `retry-after`."""

APPEND_RETRY = UnitRetry(attempts=13, initial_seconds=1.0, backoff=2.0, maximum_seconds=240.0)
"""Retries of the append task: side effects happened, so retry while the store is down (12 retries, 1 s doubling
to 4 min, about 20 min in all), never on an error of `_conversation_unit.PERMANENT_APPEND_ERRORS`."""


def flow_name(agent: DurableAgent[Any, Any]) -> str:
    """The agent's flow name, `durcap-{agent name}`."""
    return f'{FLOW_NAME_PREFIX}{agent.name}'


def flow_attr(agent_name: str) -> str:
    """The attribute naming an agent's flow: `flow__` + the name, other characters as `_xx` hex."""
    return FLOW_ATTR_PREFIX + re.sub(r'[^A-Za-z0-9]', lambda m: f'_{ord(m.group()):02x}', agent_name)
