"""DBOS: capability function tools as DBOS steps, a workflow per agent, and a decorator for the user's own workflows.

Upstream `DBOSDurability` checkpoints model requests and MCP / dynamic toolsets as steps but runs function tools
inline in workflow code; `ToolStepDurability` runs each of those calls as a step too (see `_durability`).

The private modules, one concern each, `_spec` at the bottom:
- `_spec`: names (workflows, steps, events, topics), the default system database, executor and queue names, retry
  numbers;
- `_durability`: `ToolStepDurability`, its tool steps, the model step's retries and `RetryAfterSleep`, MCP;
- `_conversation`, `_approvals`: the conversation steps and the approval wait;
- `_workflow`: `agent_workflow`, the `workflow` decorator, `BoundAgent`;
- `_server`: the system database, executor ids, `launch`, `application_version`; `_client`: a `DBOSClient`;
- `_worker`: `durcap worker dbos`; `_runs`: the operator side; `_adapter`: `DBOSAdapter`.
"""

from ._adapter import ADAPTER, DBOSAdapter
from ._approvals import DBOSApprovalGate
from ._client import client, database_error_line, quiet_dbos_log
from ._conversation import APPEND_STEP_RETRIES, PERMANENT_STORE_ERRORS, Raised
from ._durability import (
    DEFAULT_MODEL_STEP_CONFIG,
    RetryAfterSleep,
    StepToolset,
    ToolStepConfig,
    ToolStepDurability,
    ToolSteps,
    durability_parts,
    mcp_step_config,
    retry_model_step,
)
from ._server import (
    application_version,
    executor_process_gone,
    launch,
    one_shot_executor_id,
    system_database_file,
    system_database_url,
)
from ._spec import (
    DECISION_TOPIC,
    DEFAULT_SQLITE_PATH,
    PENDING_EVENT,
    RUN_EXECUTOR_PREFIX,
    WORKER_QUEUE,
    WORKFLOW_NAME_PREFIX,
    approval_step_name,
    conversation_step_names,
    workflow_names,
)
from ._workflow import BoundAgent, agent_workflow, workflow

_Raised = Raised  # the name pickled step results recorded before the package split refer to

__all__ = [
    'ADAPTER',
    'APPEND_STEP_RETRIES',
    'DECISION_TOPIC',
    'DEFAULT_MODEL_STEP_CONFIG',
    'DEFAULT_SQLITE_PATH',
    'PENDING_EVENT',
    'PERMANENT_STORE_ERRORS',
    'RUN_EXECUTOR_PREFIX',
    'WORKER_QUEUE',
    'WORKFLOW_NAME_PREFIX',
    'BoundAgent',
    'DBOSAdapter',
    'DBOSApprovalGate',
    'Raised',
    'RetryAfterSleep',
    'StepToolset',
    'ToolStepConfig',
    'ToolStepDurability',
    'ToolSteps',
    'agent_workflow',
    'application_version',
    'approval_step_name',
    'client',
    'conversation_step_names',
    'database_error_line',
    'durability_parts',
    'executor_process_gone',
    'launch',
    'mcp_step_config',
    'one_shot_executor_id',
    'quiet_dbos_log',
    'retry_model_step',
    'system_database_file',
    'system_database_url',
    'workflow',
    'workflow_names',
]
