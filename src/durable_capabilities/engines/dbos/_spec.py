"""DBOS's names, prefixes, keys and numbers: the constants every other module of `engines.dbos` imports.

At the bottom of the package: imports nothing of it (nor dbos), so any module may use these.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._conversation_unit import UnitRetry

if TYPE_CHECKING:
    from ...agent import DurableAgent

ENGINE = 'dbos'

APP_NAME = 'durcap'
"""The DBOS application name `durcap run`, `durcap worker dbos` and `launch()` use by default."""

WORKFLOW_NAME_PREFIX = 'durcap.'
"""Workflow name of `agent_workflow`: `durcap.{agent name}`. Compatibility data, listed in `durable.lock`."""

DEFAULT_SQLITE_PATH = Path('.durcap') / 'dbos.sqlite'
"""System database used when no URL is given: `sqlite:///.durcap/dbos.sqlite` (DBOS supports SQLite
for development; use PostgreSQL in production)."""

DB_ENV = 'DURCAP_DBOS_DB'
"""The system database URL every command's `--db` defaults to (`settings.py`)."""

RUN_EXECUTOR_PREFIX = 'durcap-run'
"""Executor ids of one-shot `durcap run` processes: `durcap-run-{host}-{pid}-{random}`."""

WORKER_QUEUE = 'durcap'
"""The DBOS queue `durcap worker dbos` serves and `durcap runs resume` hands a run to (default)."""

DEFAULT_WORKER_CONCURRENCY = 8
"""Runs one `durcap worker dbos` takes from its queue at once (DBOS's `worker_concurrency`; `--concurrency`). DBOS's
own default is no limit, so 40 runs enqueued at once all went to the first worker that polled (issue 29); with a
limit, the rest stay on the queue for the other workers. One worker with more concurrent runs than this queues them."""

WORKER_EXECUTOR = 'local'
"""The executor id of `durcap worker dbos` by default (DBOS's own default: launch recovers its pending workflows)."""

PENDING_EVENT = 'durcap.approvals'
"""DBOS event key under which a waiting workflow publishes its pending calls (JSON list of `PendingCall`)."""

DECISION_TOPIC = 'durcap.decisions'
"""DBOS message topic a waiting workflow receives decisions on (one `Decision` JSON per message)."""

MODEL_STEP_ATTEMPTS = 3
MODEL_STEP_INTERVAL_SECONDS = 2.0
"""The model request step: 3 attempts, 2 s then 4 s apart (`_durability.DEFAULT_MODEL_STEP_CONFIG`)."""

TOOL_STEP_ATTEMPTS = 3
TOOL_STEP_INTERVAL_SECONDS = 1.0
"""Tool steps: 3 attempts, 1 s then 2 s apart (`_durability.ToolStepConfig`)."""

APPEND_RETRY = UnitRetry(attempts=40, initial_seconds=1.0, backoff=1.5, maximum_seconds=3600.0)
"""Retries of the conversation-append step: the run's side effects happened, so keep trying while the store is
down: 1 s, then x1.5 each time (DBOS caps a wait at 1 h), 40 attempts, about 22 hours in all."""


def workflow_names(agent: DurableAgent[Any, Any]) -> list[str]:
    """The DBOS workflow names `agent_workflow` registers: `durcap.{name}` and one per previous name."""
    return [f'{WORKFLOW_NAME_PREFIX}{n}' for n in (agent.name, *agent.previous_names)]


def conversation_step_names(agent: DurableAgent[Any, Any]) -> tuple[str, str]:
    """Step names of the conversation load and append: `durcap__{name}__conversation.load` / `.append`."""
    prefix = f'durcap__{agent.durable_name}__conversation'
    return f'{prefix}.load', f'{prefix}.append'


def approval_step_name(agent: DurableAgent[Any, Any]) -> str:
    """Name of the step that reads the clock while a run waits for approval: `durcap__{name}__approval.clock`."""
    return f'durcap__{agent.durable_name}__approval.clock'
