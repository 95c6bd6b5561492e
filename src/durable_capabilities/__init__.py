"""durable-capabilities: pydantic-ai agents built from on-demand capabilities, durable on Temporal, DBOS and Prefect.

The public API is re-exported here; every other name is private.
"""

from .agent import DurableAgent, validate_together
from .ids import MAX_ID_LENGTH, id_syntax_error, redact_url
from .runbook import RunbookRequired
from .skills import InvalidSkill, load_skill, load_skills
from .store import (
    ConversationConflictError,
    ConversationNotFoundError,
    SQLConversationStore,
    StoreError,
    drift,
)
from .validation import CODES, DurableConfigError, Problem, Report
from .worker_secrets import SecretNotFoundError, WorkerSecret, set_secret_resolver

__all__ = [
    'CODES',
    'MAX_ID_LENGTH',
    'ConversationConflictError',
    'ConversationNotFoundError',
    'DurableAgent',
    'DurableConfigError',
    'InvalidSkill',
    'Problem',
    'Report',
    'RunbookRequired',
    'SQLConversationStore',
    'SecretNotFoundError',
    'StoreError',
    'WorkerSecret',
    'drift',
    'id_syntax_error',
    'load_skill',
    'load_skills',
    'redact_url',
    'set_secret_resolver',
    'validate_together',
]
__version__ = '0.1.0'
