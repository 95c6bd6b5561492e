"""Temporal: a workflow class per `DurableAgent`, a worker, and client helpers.

What runs where (Temporal's own split):
- workflow code: the agent graph, `load_capability` (pure), capability hooks, the workflow's `run` method and the
  approval wait. Deterministic; no I/O.
- activities (upstream `TemporalDurability`): model requests, one activity per leaf toolset for tool calls, MCP
  discovery and calls; ours: the conversation load and append.

The private modules, one concern each, `_spec` at the bottom:
- `_spec`: names, prefixes, memo keys, timeouts and retry numbers;
- `_payloads`: the claim-check codec and the payload guard (DC030, DC031);
- `_conversation`, `_approvals`: the conversation activities and the approval wait;
- `_workflow`: the workflow classes, their input and output, continue-as-new;
- `_durability`: the options of upstream's `TemporalDurability` (heartbeats, bounded retries, MCP);
- `_client`, `_server`: connecting, starting and awaiting runs; the dev server (`start_temporal_dev_server`), which
  server a run uses, `durcap dev temporal`;
- `_worker`, `_versioning`: `make_worker`, `run_worker`, its interceptors, Worker Versioning;
- `_history`: history export, replay and repair; `_runs`: the operator side; `_adapter`: `TemporalAdapter`.
"""

from ._adapter import ADAPTER, TemporalAdapter
from ._client import capabilities_attribute_registered, connect, run, start_run, task_queue_pollers
from ._conversation import AppendInput, conversation_activities, conversation_activity_names
from ._durability import (
    DEFAULT_LOCAL_TOOL_CONFIG,
    DEFAULT_MODEL_RETRY_POLICY,
    GuardedTemporalDurability,
    durability_parts,
    mcp_activity_config,
    sandbox_runner,
)
from ._history import HistoryReplayer, Repaired, export_history, repair_temporal, units_recorded
from ._payloads import ClaimCheckCodec, default_codec
from ._server import start_temporal_dev_server, temporal_cli
from ._spec import (
    CAPABILITIES_MEMO,
    CAPABILITIES_SEARCH_ATTRIBUTE,
    DEADLOCK_TIMEOUT_ENV,
    DECIDE_UPDATE,
    DEFAULT_DEADLOCK_TIMEOUT,
    DEFAULT_MODEL_HEARTBEAT_TIMEOUT,
    DEFAULT_STICKY_SCHEDULE_TO_START,
    DEFAULT_TOOL_HEARTBEAT_TIMEOUT,
    HEARTBEAT_THROTTLE,
    LOCAL_TOOLS_PATCH_ID,
    LOCAL_TOOLSETS_OPTION,
    PENDING_MEMO,
    PENDING_QUERY,
    TOOL_RETRY_INITIAL_INTERVAL,
    TOOL_RETRY_MAXIMUM_INTERVAL,
    WORKFLOW_NAME_PREFIX,
)
from ._versioning import WorkerVersion
from ._worker import (
    LocalToolActivities,
    RetryAfterCap,
    UnstickOnRetry,
    deadlock_timeout,
    local_tool_activities,
    make_worker,
    run_worker,
    warm_model,
    worker_version,
)
from ._workflow import AgentRunInput, AgentRunOutput, ContinuedRun, workflow_class, workflow_classes, workflow_name

__all__ = [
    'ADAPTER',
    'CAPABILITIES_MEMO',
    'CAPABILITIES_SEARCH_ATTRIBUTE',
    'DEADLOCK_TIMEOUT_ENV',
    'DECIDE_UPDATE',
    'DEFAULT_DEADLOCK_TIMEOUT',
    'DEFAULT_LOCAL_TOOL_CONFIG',
    'DEFAULT_MODEL_HEARTBEAT_TIMEOUT',
    'DEFAULT_MODEL_RETRY_POLICY',
    'DEFAULT_STICKY_SCHEDULE_TO_START',
    'DEFAULT_TOOL_HEARTBEAT_TIMEOUT',
    'HEARTBEAT_THROTTLE',
    'LOCAL_TOOLSETS_OPTION',
    'LOCAL_TOOLS_PATCH_ID',
    'PENDING_MEMO',
    'PENDING_QUERY',
    'TOOL_RETRY_INITIAL_INTERVAL',
    'TOOL_RETRY_MAXIMUM_INTERVAL',
    'WORKFLOW_NAME_PREFIX',
    'AgentRunInput',
    'AgentRunOutput',
    'AppendInput',
    'ClaimCheckCodec',
    'ContinuedRun',
    'GuardedTemporalDurability',
    'HistoryReplayer',
    'LocalToolActivities',
    'Repaired',
    'RetryAfterCap',
    'TemporalAdapter',
    'UnstickOnRetry',
    'WorkerVersion',
    'capabilities_attribute_registered',
    'connect',
    'conversation_activities',
    'conversation_activity_names',
    'deadlock_timeout',
    'default_codec',
    'durability_parts',
    'export_history',
    'local_tool_activities',
    'make_worker',
    'mcp_activity_config',
    'repair_temporal',
    'run',
    'run_worker',
    'sandbox_runner',
    'start_run',
    'start_temporal_dev_server',
    'task_queue_pollers',
    'temporal_cli',
    'units_recorded',
    'warm_model',
    'worker_version',
    'workflow_class',
    'workflow_classes',
    'workflow_name',
]
