"""Live event streams out of durable runs: each run's events in the conversation store, watched from any process.

- `RunEvent`: one event (run id, offset, durable unit and attempt, kind, pydantic-ai's `AgentStreamEvent` inside).
- `watch(run_id, ...)`: an async iterator of a run's events, retained ones first, each once.
- `publishing(...)` / `StreamingModel`: what the engines' containers and model request units use to publish.
See docs/watching.md. The log and `watch` (the store, SQLAlchemy) are imported on first use.
"""

from typing import TYPE_CHECKING, Any

from ._events import TERMINAL_KINDS, EventKind, RunEvent, answer_text
from ._publish import (
    TOOL_RESULT_SUMMARY_CHARS,
    StreamContext,
    StreamingModel,
    attached,
    current_stream,
    jsonable,
    publish_run,
    publishing,
    wrap_model,
)

if TYPE_CHECKING:
    from ._log import EventLog, Limits
    from ._watch import STREAM_ENGINES, StreamNotFoundError, StreamUnsupportedError, watch

_LAZY = {'EventLog': '_log', 'Limits': '_log', 'STREAM_ENGINES': '_watch', 'StreamNotFoundError': '_watch',
         'StreamUnsupportedError': '_watch', 'watch': '_watch'}


def __getattr__(name: str) -> Any:
    """The names of `_LAZY`, imported on first use (PEP 562)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f'.{_LAZY[name]}', __name__), name)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = [
    'STREAM_ENGINES',
    'TERMINAL_KINDS',
    'TOOL_RESULT_SUMMARY_CHARS',
    'EventKind',
    'EventLog',
    'Limits',
    'RunEvent',
    'StreamContext',
    'StreamNotFoundError',
    'StreamUnsupportedError',
    'StreamingModel',
    'answer_text',
    'attached',
    'current_stream',
    'jsonable',
    'publish_run',
    'publishing',
    'watch',
    'wrap_model',
]
