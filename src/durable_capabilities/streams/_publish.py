"""Publishing a run's events: the run's context (`publishing`), the container's own events (`publish_run`), and the
model request wrapper that publishes from inside the durable unit (`StreamingModel`).

What runs where:
- `publishing(run_id, engine, store_url)` is entered by the engine's container code around the turn (the local run,
  the DBOS workflow, the Prefect flow); it puts the run's `StreamContext` in a context variable, which the durable
  units the container awaits in the same process see.
- The container's events (run started, approvals, turn stored, run completed) are unit `run`, attempt 0, numbered in
  the order the container publishes them: a replayed container (DBOS recovery, a retried Prefect flow) publishes the
  same keys, which the log skips.
- `StreamingModel` wraps the agent's model *inside* the engine's model request unit (a DBOS step, a Prefect task),
  so the unit keeps its name (`...__model.request`): it sends the request streamed (`request_stream`) and publishes
  each event as it arrives. A model without streaming (a `FunctionModel` without `stream_function`) is sent the
  plain request, and the response's events are published at its end. Each execution of the unit is a new attempt;
  when an earlier attempt published events, a `retry` event comes first, naming the attempts to discard.
On Temporal, `engines.temporal._streams` enters `publishing` around each model request activity (with the
activity's attempt), and the workflow's own events go through a local activity (`attached`).
Without a `StreamContext` (a run outside `publishing`) the wrapper is a plain pass-through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import (
    FunctionToolCallEvent,
    FunctionToolResultEvent,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    PartEndEvent,
    PartStartEvent,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings
from pydantic_core import to_jsonable_python

from ._events import dump_event, kind_of

if TYPE_CHECKING:
    from ._log import EventLog

TOOL_RESULT_SUMMARY_CHARS = 4_000
"""A tool result longer than this (as JSON text) is published cut to it, with `data['truncated']` holding its full
size and the conversation it is stored in (the whole result is the `ToolReturnPart` of that conversation)."""

FLUSH_SECONDS = 0.05
"""A unit's events are written at most this long after they arrive (and at the unit's end)."""

RUN_UNIT = 'run'


@dataclass
class StreamContext:
    """The stream of the run running in this context.

    Attributes:
        run_id: The run's id (the stream's key).
        engine: The engine it runs on.
        log: The event log it publishes to.
        conversation_id: The conversation the turn appends to, if any.
        seq: The next sequence number of the container's own events (unit `run`).
        attempt: The engine's own attempt number of the unit running in this context (a Temporal activity's
            `activity.info().attempt`), or `None` (DBOS, Prefect: the store numbers each execution). A unit's first
            write claims at least this attempt, one more than any attempt of it already stored.
    """

    run_id: str
    engine: str
    log: EventLog
    conversation_id: str | None = None
    seq: int = 0
    attempt: int | None = None
    closed: bool = field(default=False)
    failed: bool = field(default=False)

    async def write(self, items: list[Any], *, close: bool = False) -> None:
        """Store `items`; a store that cannot be written stops this run's publishing (one warning) and never fails
        the run itself."""
        if self.failed:
            return
        try:
            await self.log.append(self.run_id, self.engine, items, close=close)
        except Exception as error:  # noqa: BLE001 - the run goes on without its stream
            self.fail(error)

    def fail(self, error: BaseException) -> None:
        """Stop publishing this run's events, saying why once."""
        self.failed = True
        _logger.warning('run %s: its event stream stops here (the store could not be written: %s: %s); the run goes on',
                        self.run_id, type(error).__name__, str(error).splitlines()[0] if str(error) else '')


_logger = logging.getLogger('durable_capabilities.streams')

_current: ContextVar[StreamContext | None] = ContextVar('durcap_stream', default=None)


def current_stream() -> StreamContext | None:
    """The `StreamContext` of the run publishing in this context, `None` outside `publishing`."""
    return _current.get()


STREAMS_ENV = 'DURCAP_STREAMS'
"""`DURCAP_STREAMS=0` (or `off`, `false`, `no`) in the process running a run's units: the run publishes no events."""


def enabled() -> bool:
    """Whether runs in this process publish their events (`$DURCAP_STREAMS`, default on)."""
    return os.environ.get(STREAMS_ENV, '').strip().lower() not in ('0', 'off', 'false', 'no')


@contextmanager
def publishing(run_id: str, engine: str, store_url: str, *, conversation_id: str | None = None,
               attempt: int | None = None) -> Iterator[StreamContext | None]:
    """Publish the events of the run in this context to the stream of `run_id` in the store at `store_url`.

    Args:
        run_id: The run's id (workflow id, flow run id, `local-{uuid}`).
        engine: The engine's name.
        store_url: The conversation store holding the stream.
        conversation_id: The conversation of the turn, shown in `run_started`.
        attempt: The engine's attempt of the unit running in this context (`StreamContext.attempt`).

    Yields:
        The `StreamContext`, or `None` when `$DURCAP_STREAMS` turns publishing off.
    """
    if not enabled():
        yield None
        return
    from ._log import EventLog  # the store and SQLAlchemy: only once a run publishes

    with attached(StreamContext(run_id, engine, EventLog(store_url), conversation_id, attempt=attempt)) as context:
        yield context


@contextmanager
def attached(context: StreamContext | None) -> Iterator[StreamContext | None]:
    """Make `context` the current stream in this context (`None`: no stream), for an engine whose container
    publishes its own way (a Temporal workflow writes through a local activity: a `StreamContext` subclass whose
    `write` schedules it).

    Yields:
        `context`.
    """
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


async def publish_run(kind: str, data: dict[str, Any], *more: tuple[str, dict[str, Any]], close: bool = False) -> None:
    """Publish the container's own events (unit `run`, attempt 0) to the current stream, if any, in one write:
    `kind` with `data`, then each `(kind, data)` of `more`; `close` marks the stream finished (`run_completed`,
    `run_failed`)."""
    context = _current.get()
    if context is None or context.closed:
        return
    from ._log import Item

    items = []
    for event_kind, event_data in ((kind, data), *more):
        items.append(Item(RUN_UNIT, 0, context.seq, event_kind, {'data': event_data}))
        context.seq += 1
    await context.write(items, close=close)
    context.closed = close


class _UnitPublisher:
    """The events of one execution (attempt) of one durable unit, written in batches by a chain of background
    writes (in order), so the model's stream is read on while a batch is stored; `close` waits for the last one. The
    first batch claims the attempt (`EventLog.append_unit_sync`)."""

    def __init__(self, context: StreamContext, unit: str):
        self.context, self.unit = context, unit
        self.attempt: int | None = None
        self.seq = 0
        self.pending: list[tuple[int, str, dict[str, Any]]] = []
        self.last_flush = time.monotonic()
        self.writing: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Claim the execution's attempt now (its `retry` event, if any, goes first)."""
        self.flush()

    def _add(self, kind: str, body: dict[str, Any]) -> None:
        self.pending.append((self.seq, kind, body))
        self.seq += 1

    async def event(self, event: Any, data: dict[str, Any] | None = None) -> None:
        self._add(kind_of(event), {'event': dump_event(event), **({'data': data} if data else {})})
        if time.monotonic() - self.last_flush >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        """Hand the pending events to the next background write."""
        if self.context.failed:
            return
        entries, self.pending = self.pending, []
        self.writing = asyncio.ensure_future(self._write(self.writing, entries))
        self.last_flush = time.monotonic()

    async def _write(self, previous: asyncio.Future[None] | None, entries: list[tuple[int, str, dict[str, Any]]]) -> None:
        from ._log import in_thread

        if previous is not None:
            await previous
        if self.context.failed or (not entries and self.attempt is not None):
            return
        try:
            self.attempt = await in_thread(self.context.log.append_unit_sync, self.context.run_id, self.context.engine,
                                           self.unit, entries, self.attempt, at_least=self.context.attempt)
        except Exception as error:  # noqa: BLE001 - the run goes on without its stream
            self.context.fail(error)

    async def close(self) -> None:
        """Write what is pending and wait for every write."""
        self.flush()
        if self.writing is not None:
            await self.writing

    async def tool_results(self, messages: list[ModelMessage]) -> None:
        """The results of the tool calls the previous response made (the last request's tool returns)."""
        calls = {p.tool_call_id: p for m in messages if isinstance(m, ModelResponse) for p in m.parts
                 if isinstance(p, ToolCallPart)}
        last = messages[-1] if messages else None
        if not isinstance(last, ModelRequest):
            return
        for part in last.parts:
            if not isinstance(part, ToolReturnPart):
                continue
            data, shown = None, part
            text = part.model_response_str()
            if len(text) > TOOL_RESULT_SUMMARY_CHARS:
                data = {'truncated': {'size': len(text), 'conversation_id': self.context.conversation_id,
                                      'tool_call_id': part.tool_call_id}}
                shown = ToolReturnPart(part.tool_name, text[:TOOL_RESULT_SUMMARY_CHARS] + '...',
                                       tool_call_id=part.tool_call_id, timestamp=part.timestamp)
            await self.event(FunctionToolResultEvent(shown), data)
            call = calls.get(part.tool_call_id)
            if part.tool_name == 'load_capability' and call is not None:
                self._add('capability_loaded', {'data': {'capability': call.args_as_dict().get('id'),
                                                         'tool_call_id': part.tool_call_id}})

    async def tool_calls(self, response: ModelResponse) -> None:
        for part in response.parts:
            if isinstance(part, ToolCallPart):
                await self.event(FunctionToolCallEvent(part))


def _streams(model: Model) -> bool:
    """Whether `model` can send a streamed request (a `FunctionModel` needs a `stream_function`)."""
    return getattr(model, 'stream_function', True) is not None


def _response_events(response: ModelResponse) -> Iterator[Any]:
    """A finished response as the events a stream of it would have produced (start and end of each part)."""
    for index, part in enumerate(response.parts):
        yield PartStartEvent(index=index, part=part)
        yield PartEndEvent(index=index, part=part)


class StreamingModel(WrapperModel):
    """The agent's model as seen inside the engine's model request unit: publishes the request's events to the run's
    stream (see the module docstring). Outside a `publishing` context it only forwards.

    Args:
        wrapped: The agent's model (a `Model`, or a name: resolved by `infer_model` on first use, not here, so an
            agent naming a provider's model is built where its API key is not set, e.g. by `durcap check` or a
            Temporal client).
    """

    _name: str | None = None
    _model: Model | None = None

    def __init__(self, wrapped: Model | str):
        if isinstance(wrapped, str):
            Model.__init__(self)
            self._name = wrapped
        else:
            super().__init__(wrapped)

    @property  # type: ignore[override]
    def wrapped(self) -> Model:  # pyright: ignore[reportIncompatibleVariableOverride]
        """The agent's model (a name is resolved now, once)."""
        if self._model is None:
            from pydantic_ai.models import infer_model

            self._model = infer_model(self._name)  # type: ignore[arg-type]
        return self._model

    @wrapped.setter
    def wrapped(self, model: Model) -> None:
        self._model = model

    @property
    def model_id(self) -> str:
        """The wrapped model's id; a name not resolved yet is its own id (what upstream's durability
        capabilities name an agent's model given by name)."""
        if self._model is None and self._name is not None:
            return self._name
        return self.wrapped.model_id

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        context = _current.get()
        if context is None:
            return await self.wrapped.request(messages, model_settings, model_request_parameters)
        unit = _UnitPublisher(context, f'model_request:{len(messages)}')
        await unit.start()
        try:
            await unit.tool_results(messages)
            if _streams(self.wrapped):
                async with self.wrapped.request_stream(messages, model_settings, model_request_parameters) as stream:
                    async for event in stream:
                        await unit.event(event)
                response = stream.get()
            else:
                response = await self.wrapped.request(messages, model_settings, model_request_parameters)
                for event in _response_events(response):
                    await unit.event(event)
            await unit.tool_calls(response)
        finally:
            # Also when the request failed: its partial events are stored before a retry claims the next attempt.
            await unit.close()
        return response

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: Any = None) -> AsyncIterator[Any]:
        """The wrapped model's stream; in a `publishing` context its events are published as the caller reads them
        (an agent with an `event_stream_handler` streams its requests through here: the engine's streamed model
        request unit reads the whole stream), the unit's attempt claimed before the request is sent, as `request`
        does."""
        context = _current.get()
        if context is None:
            async with self.wrapped.request_stream(messages, model_settings, model_request_parameters,
                                                   run_context) as stream:
                yield stream
            return
        unit = _UnitPublisher(context, f'model_request:{len(messages)}')
        await unit.start()
        try:
            await unit.tool_results(messages)
            async with self.wrapped.request_stream(messages, model_settings, model_request_parameters,
                                                   run_context) as stream:
                yield _PublishedStream(stream, unit)
        finally:
            # Also when the request failed: its partial events are stored before a retry claims the next attempt.
            await unit.close()


class _PublishedStream:
    """A model's `StreamedResponse` whose events are published (`_UnitPublisher`) as the caller iterates it, then the
    response's tool calls; every other attribute is the wrapped stream's (read and written through)."""

    def __init__(self, stream: Any, unit: _UnitPublisher):
        object.__setattr__(self, '_durcap_stream', stream)
        object.__setattr__(self, '_durcap_unit', unit)
        object.__setattr__(self, '_durcap_events', None)

    def __aiter__(self) -> AsyncIterator[Any]:
        if self._durcap_events is None:  # one iterator, as StreamedResponse: a second `async for` goes on with it
            object.__setattr__(self, '_durcap_events', self._events())
        return self._durcap_events

    async def _events(self) -> AsyncIterator[Any]:
        unit: _UnitPublisher = self._durcap_unit
        async for event in self._durcap_stream:
            await unit.event(event)
            yield event
        await unit.tool_calls(self._durcap_stream.get())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._durcap_stream, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._durcap_stream, name, value)


def wrap_model(model: Any) -> Any:
    """`model` wrapped in `StreamingModel` (`None` and an already wrapped model as given)."""
    if model is None or isinstance(model, StreamingModel):
        return model
    return StreamingModel(model)


def jsonable(value: Any) -> Any:
    """`value` as JSON-compatible data (pydantic-ai's serialization), `repr` when it has none."""
    try:
        return to_jsonable_python(value)
    except Exception:  # noqa: BLE001 - an output type pydantic cannot dump is shown by its repr
        return repr(value)
