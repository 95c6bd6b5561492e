"""durable-capabilities: pydantic-ai agents built from on-demand capabilities, durable on Temporal, DBOS and Prefect.

The public API is re-exported here; every other name is private.
"""

from typing import TYPE_CHECKING, Any

from .agent import DurableAgent, validate_together
from .ids import MAX_ID_LENGTH, id_syntax_error, redact_url
from .runbook import RunbookRequired
from .skills import InvalidSkill, load_skill, load_skills
from .validation import CODES, DurableConfigError, Problem, Report
from .worker_secrets import SecretNotFoundError, WorkerSecret, set_secret_resolver

if TYPE_CHECKING:
    from .store import ConversationConflictError, ConversationNotFoundError, SQLConversationStore, StoreError, drift

_FROM_STORE = frozenset({'ConversationConflictError', 'ConversationNotFoundError', 'SQLConversationStore', 'StoreError', 'drift'})


def __getattr__(name: str) -> Any:
    """The conversation store's names, imported on first use: the store brings SQLAlchemy (about 0.4 s and
    300 modules), which an agent without a conversation never needs (issue 14, item 5; PEP 562)."""
    if name in _FROM_STORE:
        from . import store

        return getattr(store, name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')

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
