"""A provider's `retry-after` inside each engine's durable retry, with one bound for all three engines.

The provider SDK retries a 429 / 503 / 529 twice itself, inside one attempt of the durable unit (openai and anthropic
SDKs: `retry-after` honoured up to 60 s (anthropic) or 120 s (openai), else a 0.5-8 s backoff). When the error still
reaches the durable unit, pydantic-ai's `ModelAPIError.retry_after` holds the seconds the provider asked for, and:

- Temporal: pydantic-ai sets the activity attempt's `next_retry_delay` to it, capped at the retry policy's
  `maximum_interval` (ours: `MAX_RETRY_AFTER_SECONDS`); `engines.temporal.RetryAfterCap` fails the activity instead
  when the provider asked for more than that cap;
- DBOS: the model request step does not retry it (`retry_model_step`); the workflow sleeps it durably
  (`DBOS.sleep`, a row of the workflow's steps) and calls the step again (`engines.dbos.RetryAfterSleep`);
- Prefect: the model request task's retry waits it (`RetryAfterDelays`: the task run's `AwaitingRetry` state is
  scheduled `retry_after` seconds later).

A `retry-after` above `MAX_RETRY_AFTER_SECONDS` is not waited on any engine: the run fails with the provider's error.
"""

from __future__ import annotations

import contextvars
import math
from typing import Any

from pydantic_ai.exceptions import ModelAPIError, ModelQuotaExceededError, ModelRequestRejectedError

__all__ = ['MAX_RETRY_AFTER_SECONDS', 'RetryAfterDelays', 'over_cap_message', 'retry_after', 'unfixable']

MAX_RETRY_AFTER_SECONDS = 30.0
"""The longest a durable retry waits for a provider's `retry-after`, in seconds, on every engine: the
`maximum_interval` of Temporal's default model retry policy (`engines.temporal.DEFAULT_MODEL_RETRY_POLICY`; pydantic-ai
caps `next_retry_delay` at it), DBOS's durable sleep before the model request step runs again, and Prefect's delay
before the model request task's next attempt. A provider asking for longer (an exhausted quota window) fails the run
at once rather than being retried into the same refusal."""


def _model_error(error: BaseException | None) -> ModelAPIError | None:
    """The outermost pydantic-ai `ModelAPIError` in `error`'s `__cause__` chain, or None."""
    while error is not None:
        if isinstance(error, ModelAPIError):
            return error
        error = error.__cause__
    return None


def retry_after(error: BaseException | None) -> float | None:
    """Seconds the provider asked to wait before another attempt (`ModelAPIError.retry_after`, read by pydantic-ai
    from the `retry-after` / `retry-after-ms` header), or None: no model error, or no such header."""
    found = _model_error(error)
    value = getattr(found, 'retry_after', None) if found is not None else None
    return float(value) if isinstance(value, int | float) and math.isfinite(value) and value >= 0 else None


def unfixable(error: BaseException | None) -> bool:
    """Whether another attempt cannot fix `error`: the provider rejected the request (`ModelRequestRejectedError`:
    401, 403, 404 model, context window) or the quota is exhausted, the errors pydantic-ai's Temporal integration
    leaves unretried by default (`TemporalDurability(non_retryable_model_errors=...)`)."""
    return isinstance(_model_error(error), ModelRequestRejectedError | ModelQuotaExceededError)


def over_cap_message(error: BaseException, seconds: float, cap: float = MAX_RETRY_AFTER_SECONDS) -> str:
    """The one log line of a `retry-after` that is not waited: `{unit} failed: {Error}: ...; the provider asked to
    wait {seconds} s (retry-after), more than the {cap} s a durable retry waits: not retried`."""
    found = _model_error(error) or error
    detail = str(found).splitlines()[0] if str(found) else ''
    return (f'{type(found).__name__}: {detail}; the provider asked to wait {seconds:g} s (retry-after), more than the '
            f'{cap:g} s a durable retry waits (MAX_RETRY_AFTER_SECONDS): not retried')


_NEXT_DELAY: contextvars.ContextVar[float | None] = contextvars.ContextVar('durcap_retry_after_delay', default=None)


class RetryAfterDelays(list[float]):
    """Prefect `retry_delay_seconds` of a model request task: the delays given (`[2.0, 4.0]`), except that the retry
    of an attempt whose error carried a `retry-after` waits that instead.

    Prefect's task engine asks the task's `retry_condition_fn` whether to retry, then, in the same coroutine, reads
    `retry_delay_seconds[attempt]` and schedules the task run's `AwaitingRetry` state that many seconds later
    (prefect 3 `task_engine.AsyncTaskRunEngine.handle_retry`). The retry condition (`engines.prefect.
    retry_model_request`) calls `wait_next` with the error's `retry_after`; the next read returns it once.
    tests/engines/test_providers.py checks the task run's state history on a real Prefect server.
    """

    def __getitem__(self, index: Any) -> Any:
        wanted = _NEXT_DELAY.get()
        if wanted is not None and isinstance(index, int):
            _NEXT_DELAY.set(None)
            return wanted
        return super().__getitem__(index)

    @staticmethod
    def wait_next(seconds: float | None) -> None:
        """Make the next delay read in this context `seconds` (None: the configured delay)."""
        _NEXT_DELAY.set(seconds)
