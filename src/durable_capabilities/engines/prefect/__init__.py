"""Prefect: a flow per `DurableAgent`, deterministic task cache keys, schedules and deployments.

The private modules, one concern each, `_spec` at the bottom:
- `_spec`: flow, task and input names, retry numbers;
- `_durability`: the options of upstream's `PrefectDurability` (deterministic cache keys, retries, tool run names);
- `_conversation`, `_approvals`: the conversation load and append in flow code (and the tasks of earlier versions) and
  the approval wait (pause / suspend);
- `_flow`: `agent_flow`; `_entry`: the deployments' importable entrypoints;
- `_server`: `start_prefect_server`, which Prefect API a process uses; `_client`: running a flow run here and reading its task runs;
- `_worker`: `durcap schedule prefect` (`serve`); `_runs`: the operator side; `_adapter`: `PrefectAdapter`.
"""

from ._adapter import ADAPTER, PrefectAdapter
from ._approvals import PrefectApprovalGate, resume_expired, watch_deadlines
from ._conversation import conversation_tasks
from ._durability import (
    DeterministicInputs,
    durability_parts,
    mcp_task_config,
    normalized_inputs,
    retry_model_request,
    tool_run_namer,
)
from ._entry import entrypoint
from ._flow import agent_flow
from ._server import configured_api, ensure_api, server_line, start_prefect_server
from ._spec import (
    AGENT_TOOLSET_ID,
    APPROVAL_CLOCK_TASK,
    CONVERSATION_TASKS,
    DECISION_INPUT_PREFIX,
    DEFAULT_MODEL_RETRIES,
    DEFAULT_MODEL_RETRY_DELAYS,
    DEFAULT_TOOL_RETRIES,
    FLOW_NAME_PREFIX,
    PENDING_INPUT,
    SUSPEND_GRACE_SECONDS,
    TARGET_ENV,
    flow_name,
)
from ._worker import DEFAULT_SERVE_LIMIT, serve, watch_crashed

__all__ = [
    'ADAPTER',
    'AGENT_TOOLSET_ID',
    'APPROVAL_CLOCK_TASK',
    'CONVERSATION_TASKS',
    'DECISION_INPUT_PREFIX',
    'DEFAULT_MODEL_RETRIES',
    'DEFAULT_MODEL_RETRY_DELAYS',
    'DEFAULT_SERVE_LIMIT',
    'DEFAULT_TOOL_RETRIES',
    'FLOW_NAME_PREFIX',
    'PENDING_INPUT',
    'SUSPEND_GRACE_SECONDS',
    'TARGET_ENV',
    'DeterministicInputs',
    'PrefectAdapter',
    'PrefectApprovalGate',
    'agent_flow',
    'configured_api',
    'conversation_tasks',
    'durability_parts',
    'ensure_api',
    'entrypoint',
    'flow_name',
    'mcp_task_config',
    'normalized_inputs',
    'resume_expired',
    'retry_model_request',
    'serve',
    'server_line',
    'start_prefect_server',
    'tool_run_namer',
    'watch_crashed',
    'watch_deadlines',
]
