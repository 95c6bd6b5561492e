"""One log line per failed model request attempt instead of a traceback (Temporal activity retries, DBOS step
retries, Prefect task retries): the engines log a retried attempt with `exc_info`, which for a provider error is
25-30 lines of the SDK's and httpx's exception chain per attempt. `ModelRetryLogLine` is the one filter; each engine
gives it the function that recognises its own retry records."""

from __future__ import annotations

import logging
from collections.abc import Callable


def model_error(error: BaseException | None) -> BaseException | None:
    """The outermost pydantic-ai model error (`pydantic_ai.exceptions.*`) in `error`'s `__cause__` chain, or None."""
    while error is not None:
        if type(error).__module__ == 'pydantic_ai.exceptions':
            return error
        error = error.__cause__
    return None


def _rewrite(record: logging.LogRecord, prefix: str, error: BaseException | None) -> bool:
    """Rewrite `record` as `{prefix} failed: {ErrorClass}: {first line}` of `error`, without its traceback; return
    whether there was an error to name."""
    if error is None:
        return False
    detail = str(error).splitlines()[0] if str(error) else ''
    record.msg = f'{prefix} failed: {type(error).__name__}: {detail}'
    record.args, record.exc_info, record.exc_text = (), None, None
    return True


def shorten(record: logging.LogRecord, prefix: str) -> bool:
    """Rewrite `record` as `{prefix} failed: {ErrorClass}: {first line}` and drop its traceback when it carries a
    model error; return whether it did."""
    return _rewrite(record, prefix, model_error(record.exc_info[1] if record.exc_info else None))


def shorten_any(record: logging.LogRecord, prefix: str) -> bool:
    """`shorten`, and for any other error too: `{prefix} failed: {ErrorClass}: {first line}` of the error itself (a
    tool step's error); return whether `record` carried an error."""
    return shorten(record, prefix) or _rewrite(record, prefix, record.exc_info[1] if record.exc_info else None)


def drop_traceback(record: logging.LogRecord) -> bool:
    """Drop `record`'s traceback when it carries a model error (its message already names the error, as Prefect's
    "Task run failed with exception: ModelConnectionError(...)" does); return whether it did."""
    if model_error(record.exc_info[1] if record.exc_info else None) is None:
        return False
    record.exc_info, record.exc_text = None, None
    return True


AttemptNames = Callable[[logging.LogRecord], tuple[str, str | None] | None]
"""What an engine's retry record is: `(prefix for a model error, prefix for any other error or None)`, or `None` for a
record that reports no failed attempt."""


class ModelRetryLogLine(logging.Filter):
    """The one model-retry log filter of every engine: a failed attempt's record becomes one line,
    `{prefix} failed: {ErrorClass}: {first line}`, without the 25-30 lines of the provider SDK's and httpx's traceback.

    Args:
        attempt: Names the attempt a record reports (`AttemptNames`): Temporal's activity-failure warning of a model
            request activity, DBOS's "Step being automatically retried" warning. `None`: the engine's own message
            already names the error (Prefect's "Task run failed with exception: ..."), and only the traceback of a
            model error is dropped.
    """

    def __init__(self, attempt: AttemptNames | None = None):
        super().__init__()
        self.attempt = attempt

    def filter(self, record: logging.LogRecord) -> bool:
        if self.attempt is None:
            drop_traceback(record)
        elif (names := self.attempt(record)) is not None:
            model, other = names
            if not shorten(record, model) and other is not None:
                shorten_any(record, other)
        return True
