"""durable-capabilities: pydantic-ai agents built from on-demand capabilities, durable on Temporal, DBOS and Prefect.

The public API is re-exported here; every other name is private.
"""

from typing import TYPE_CHECKING, Any

from . import _hooks, engines, runner
from ._limits import InputError
from .agent import DurableAgent, validate_together
from .approvals import ApprovalError
from .budget import Budget, BudgetExceededError
from .engines import EngineUnreachableError, RunNotFoundError
from .errors import DurcapError
from .ids import MAX_ID_LENGTH, id_syntax_error, redact_url
from .runbook import RunbookRequired
from .skills import InvalidSkill, load_skill, load_skills
from .validation import CODES, DurableConfigError, Problem, Report
from .worker_secrets import SecretNotFoundError, WorkerSecret, set_secret_resolver

# The composition root (issue 23, item 4): core (`agent`) imports nothing above it; the engine registry and the
# in-process turn are handed to it here, once, before any module of the package can construct an agent.
_hooks.install(engines=engines.ENGINES, run_in_process=runner.run_in_process, wrap_model=lambda model: _streams().wrap_model(model),
               wrap_budget=lambda model, agent: _budgets().wrap_budget(model, agent),
               budget_tools=lambda agent: _budgets().budget_tools(agent),
               wrap_interrupt=lambda model, agent: _interrupts().wrap_interrupt(model, agent))


def _interrupts() -> Any:
    """The `interrupts` module, imported on first use (it brings the store and SQLAlchemy)."""
    import importlib

    return importlib.import_module('.interrupts', __name__)


def _budgets() -> Any:
    """The `budgets` module, imported on first use (it brings the store and SQLAlchemy)."""
    import importlib

    return importlib.import_module('.budgets', __name__)


def _streams() -> Any:
    """The `streams` package, imported on first use (it brings the store and SQLAlchemy)."""
    import importlib

    return importlib.import_module('.streams', __name__)

if TYPE_CHECKING:
    from .lockfile import LockfileError
    from .store import (
        ConversationConflictError,
        ConversationNotFoundError,
        SQLConversationStore,
        StoreError,
        StoreUnavailableError,
        StoreURLError,
        drift,
    )
    from .streams import RunEvent, watch
    from .targets import UnusableTarget
    from .turn import TurnRequestLimitError

_LAZY = {
    **dict.fromkeys(('ConversationConflictError', 'ConversationNotFoundError', 'SQLConversationStore', 'StoreError',
                     'StoreURLError', 'StoreUnavailableError', 'drift'), 'store'),
    'LockfileError': 'lockfile',
    **dict.fromkeys(('watch', 'RunEvent'), 'streams'),
    'UnusableTarget': 'targets',
    'TurnRequestLimitError': 'turn',
}
"""Names imported on first use, with their module: the store brings SQLAlchemy (about 0.4 s and 300 modules), which an
agent without a conversation never needs (issue 14, item 5); the lockfile and TARGET loader are for tools."""


def __getattr__(name: str) -> Any:
    """The names of `_LAZY`, imported on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')

__all__ = [
    'CODES',
    'MAX_ID_LENGTH',
    'ApprovalError',
    'Budget',
    'BudgetExceededError',
    'ConversationConflictError',
    'ConversationNotFoundError',
    'DurableAgent',
    'DurableConfigError',
    'DurcapError',
    'EngineUnreachableError',
    'InputError',
    'InvalidSkill',
    'LockfileError',
    'Problem',
    'Report',
    'RunEvent',
    'RunNotFoundError',
    'RunbookRequired',
    'SQLConversationStore',
    'SecretNotFoundError',
    'StoreError',
    'StoreURLError',
    'StoreUnavailableError',
    'TurnRequestLimitError',
    'UnusableTarget',
    'WorkerSecret',
    'drift',
    'id_syntax_error',
    'load_skill',
    'load_skills',
    'redact_url',
    'set_secret_resolver',
    'validate_together',
    'watch',
]
__version__ = '0.1.0'
