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
activity's attempt), and the workflow's own events (`attached`) ride with its next activity where one follows
(`StreamContext.carried`: `run_started` with the first model request, `run_completed` with the append), else go
through a local activity.
Without a `StreamContext` (a run outside `publishing`) the wrapper is a plain pass-through.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager, contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import (
    FunctionToolCallEvent,
    FunctionToolResultEvent,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    PartDeltaEvent,
    PartEndEvent,
    PartStartEvent,
    TextPartDelta,
    ThinkingPartDelta,
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

WRITE_INTERVAL_SECONDS = 0.02
"""A unit's events are written at most this often (a unit's first event, and those pending when it ends, at once):
at most 50 transactions a second per streaming request, each event stored at most this long after it arrived plus
the write's own time."""

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
        durable: The engine records its units' completion (not `local`): a unit's events are stored before it
            returns, each write flushed to disk. A local run's units hand theirs over and go on; its last event
            (awaited) is stored after them; its writes are not flushed each (`EventLog.submit`'s `flush`): durable
            against a crash of any process, as the local run itself is, not against a power loss.
    """

    run_id: str
    engine: str
    log: EventLog
    conversation_id: str | None = None
    seq: int = 0
    attempt: int | None = None
    closed: bool = field(default=False)
    failed: bool = field(default=False)
    durable: bool = True
    carried: list[Any] = field(default_factory=list)
    """The container's events (`_log.Item`, unit `run`) handed to this unit to store first, with its first batch
    (a Temporal workflow's `run_started`, carried by its first model request activity: `engines.temporal._streams`);
    a key already stored is skipped, so a retried unit stores them once. Emptied when handed to a write."""

    defers: bool = False
    """Whether `write(carry=...)` may hand the events to the run's next durable unit instead of writing them at once
    (a Temporal workflow's stream: `engines.temporal._streams.WorkflowStream`); `run_turn` then publishes the turn's
    closing events before its append unit, with `carry='after'`."""

    async def write(self, items: list[Any], *, close: bool = False, carry: str | None = None) -> None:
        """Store `items`: handed to the store's writer thread (`EventLog.submit`, in order with every other write of
        this process), awaited only with `close` (the stream's last write: every write before it is then stored
        too). The container's other events are not waited for: a container that is replayed (DBOS recovery, a retried
        Prefect flow) publishes them again under the same keys. A store that cannot be written stops this run's
        publishing (one warning) and never fails the run itself. `carry` (`'next'`: may be stored by the run's next
        durable unit, before its own events; `'after'`: stored once the next unit succeeded) is for a stream that
        `defers`; this one writes at once."""
        if self.failed:
            return
        log, run_id, engine = self.log, self.run_id, self.engine
        future = log.submit(run_id, lambda cur: log.append_in(cur, run_id, engine, items, close=close), close=close,
                            flush=self.durable)
        if not close:
            future.add_done_callback(self._written)
            return
        try:
            await asyncio.wrap_future(future)
        except Exception as error:  # noqa: BLE001 - the run goes on without its stream
            self.fail(error)

    def settle(self) -> None:
        """Before the container publishes: a stream that `defers` reopens when the unit that carried its closing
        events failed (they were not stored, e.g. the conversation append failed for good), so `run_failed` can
        still close it. This one writes at once: nothing to settle."""

    def _written(self, future: Any) -> None:
        error = future.exception()
        if error is not None and not self.failed:
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
               attempt: int | None = None, durable: bool = True) -> Iterator[StreamContext | None]:
    """Publish the events of the run in this context to the stream of `run_id` in the store at `store_url`.

    Args:
        run_id: The run's id (workflow id, flow run id, `local-{uuid}`).
        engine: The engine's name.
        store_url: The conversation store holding the stream.
        conversation_id: The conversation of the turn, shown in `run_started`.
        attempt: The engine's attempt of the unit running in this context (`StreamContext.attempt`).
        durable: Whether the engine records its units' completion (`StreamContext.durable`; `False` for `local`).

    Yields:
        The `StreamContext`, or `None` when `$DURCAP_STREAMS` turns publishing off.
    """
    if not enabled():
        yield None
        return
    from ._log import EventLog  # the store and SQLAlchemy: only once a run publishes

    with attached(StreamContext(run_id, engine, EventLog(store_url), conversation_id, attempt=attempt,
                                durable=durable)) as context:
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


async def publish_run(kind: str, data: dict[str, Any], *more: tuple[str, dict[str, Any]], close: bool = False,
                      carry: str | None = None) -> None:
    """Publish the container's own events (unit `run`, attempt 0) to the current stream, if any, in one write:
    `kind` with `data`, then each `(kind, data)` of `more`; `close` marks the stream finished (`run_completed`,
    `run_failed`); `carry`: see `StreamContext.write` (only a stream that `defers` uses it)."""
    context = _current.get()
    if context is not None:
        context.settle()
    if context is None or context.closed:
        return
    from ._log import Item

    items = []
    for event_kind, event_data in ((kind, data), *more):
        items.append(Item(RUN_UNIT, 0, context.seq, event_kind, {'data': event_data}))
        context.seq += 1
    if carry is None:
        await context.write(items, close=close)
    else:
        await context.write(items, close=close, carry=carry)
    context.closed = close


def _stored(future: Future[Any]) -> asyncio.Future[None]:
    """An awaitable that is done once a write handed to the writer thread is (stored or failed: its error is the
    stream's, `_UnitPublisher._written`); cancelling the wait leaves the write queued (a later batch of the unit reads
    the attempt it claims). One loop future, woken from the writer thread (not `wrap_future` + `shield`: two futures
    and their chained callbacks per batch, on the run's loop, a few hundred a streamed request)."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    if future.done():  # an inline write (`EventLog.submit`, a local run's)
        waiter.set_result(None)
    else:
        def done(_: Future[Any]) -> None:
            with suppress(RuntimeError):  # the loop closed meanwhile (a local run's unit not waited for): no waiter
                loop.call_soon_threadsafe(_wake, waiter)

        future.add_done_callback(done)
    return waiter


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


_Pending = tuple[Any, str | None, dict[str, Any] | None]
"""An event waiting for its write: `(stream event, None, data)`, or `(None, kind, body)` for one of the unit's own."""


def _joinable(first: Any, second: Any) -> bool:
    """Whether two consecutive events are text (or thinking text) deltas of the same part that carry nothing else,
    so one delta with both texts says the same (not: another kind of event or delta, a signature, provider details,
    citations, different parts or providers)."""
    if not (isinstance(first, PartDeltaEvent) and isinstance(second, PartDeltaEvent) and first.index == second.index):
        return False
    a, b = first.delta, second.delta
    if isinstance(a, TextPartDelta) and isinstance(b, TextPartDelta):
        if a.provider_details or b.provider_details or a.citations_delta or b.citations_delta:
            return False
    elif isinstance(a, ThinkingPartDelta) and isinstance(b, ThinkingPartDelta):
        if (a.content_delta is None or b.content_delta is None or a.signature_delta is not None
                or b.signature_delta is not None or a.provider_details or b.provider_details):
            return False
    else:
        return False
    return a.provider_name == b.provider_name


class _UnitPublisher:
    """The events of one execution (attempt) of one durable unit, handed to the store's writer thread in batches
    (group commit, `EventLog.submit`): the unit's first event at once, and an event that arrives while no write is in
    flight as soon as `WRITE_INTERVAL_SECONDS` have passed since the last write began; those that arrive meanwhile go
    together in the next batch, consecutive text deltas of one part joined into one delta (the text is the same, in
    fewer events). So the first event is never held back, no event waits for a later one, a burst costs a few
    transactions and rows instead of one per delta, and a steady stream at most one transaction per interval; the
    model's stream is read on while a batch is stored. The first write claims the attempt
    (`EventLog.append_unit_sync`, run in the writer thread, which runs a unit's batches in the order they were
    handed over: each later one reads the attempt the first claimed), its `retry` event first when earlier attempts
    published: an execution that publishes nothing writes nothing (and claims no attempt).
    `close` hands over what is left at once; in a durable run it waits until every batch is stored (the unit's
    events are stored before the engine records the unit done, so a recovered run never lacks them), in a local run
    (`StreamContext.durable` false) it does not: the run's last event, which its container awaits, is stored after
    them."""

    def __init__(self, context: StreamContext, unit: str):
        self.context, self.unit = context, unit
        self.attempt: int | None = None  # set by the first write, in the writer thread
        self.seq = 0
        self.pending: list[_Pending] = []
        self.writing: asyncio.Future[None] | None = None  # the pacing task (`_drain`)
        self.last: Future[None] | None = None  # the last batch handed to the writer thread
        self.last_write: float | None = None
        self.closing = False
        self.pause: asyncio.Future[None] | None = None  # `_drain`'s wait for the interval, ended early by `close`

    def _add(self, kind: str, body: dict[str, Any]) -> None:
        self.pending.append((None, kind, body))

    async def event(self, event: Any, data: dict[str, Any] | None = None) -> None:
        self.add(event, data)

    def add(self, event: Any, data: dict[str, Any] | None = None) -> None:
        """`event` (with `data`) to publish: pending, the pacing task started unless it runs (`event` without the
        await: the model stream's loop calls this once per delta)."""
        self.pending.append((event, None, data))
        if self.writing is None or self.writing.done():
            self.flush()

    def _take(self) -> list[tuple[int, str, dict[str, Any]]]:
        """The pending events as `(seq, kind, body)` entries, numbered in order, consecutive text deltas joined (each
        run of joinable deltas into one, its text joined once)."""
        joined: list[_Pending] = []
        run: list[Any] = []  # the joinable deltas ending `joined`, not joined yet

        def close_run() -> None:
            if len(run) > 1:
                first = run[0]
                joined[-1] = (PartDeltaEvent(index=first.index, delta=replace(
                    first.delta, content_delta=''.join(e.delta.content_delta or '' for e in run))), None, None)
            run.clear()

        for item in self.pending:
            event = item[0]
            if run and event is not None and not item[2] and _joinable(run[-1], event):
                run.append(event)
                continue
            close_run()
            joined.append(item)
            if event is not None and not item[2] and isinstance(event, PartDeltaEvent):
                run.append(event)
        close_run()
        self.pending = []
        entries = []
        for event, kind, extra in joined:
            if event is None:
                entries.append((self.seq, kind or 'model_event', extra or {}))
            else:
                entries.append((self.seq, kind_of(event), {'event': dump_event(event), **({'data': extra} if extra else {})}))
            self.seq += 1
        return entries

    def flush(self) -> None:
        """Start the pacing task unless it is running (it hands over every pending event before it stops)."""
        if self.context.failed or (self.writing is not None and not self.writing.done()):
            return
        self.writing = asyncio.ensure_future(self._drain())

    def _submit(self) -> Future[None] | None:
        """Hand the pending events to the writer thread as one batch (`None`: none pending, or the stream failed)."""
        if self.context.failed:
            return None
        entries = self._take()
        if not entries:
            return None
        carried, self.context.carried = self.context.carried, []
        self.last_write = time.monotonic()
        self.last = self.context.log.submit(self.context.run_id, lambda cur: self._write_in(cur, entries, carried),
                                            flush=self.context.durable)
        self.last.add_done_callback(self._written)
        return self.last

    def _write_in(self, cur: Any, entries: list[tuple[int, str, dict[str, Any]]], carried: Sequence[Any] = ()) -> None:
        """In the writer thread's transaction, after this unit's earlier batches: store the container's `carried`
        events not stored yet (`StreamContext.carried`), then `entries` (the first claims the attempt)."""
        if self.context.failed:
            return
        context = self.context
        if carried:
            context.log.append_in(cur, context.run_id, context.engine, carried)
        self.attempt = context.log.append_unit_in(cur, context.run_id, context.engine, self.unit, entries, self.attempt,
                                                  at_least=context.attempt)

    def _written(self, future: Future[None]) -> None:
        error = None if future.cancelled() else future.exception()
        if error is not None and not self.context.failed:
            self.context.fail(error)

    async def _drain(self) -> None:
        """Hand over the pending events, a batch once the last one is stored and at most every
        `WRITE_INTERVAL_SECONDS` until `close`, until none are left (events added meanwhile go in the next batch, in
        order: offsets follow `seq`)."""
        while not self.context.failed:
            if self.last_write is not None and not self.closing:
                wait = self.last_write + WRITE_INTERVAL_SECONDS - time.monotonic()
                if wait > 0:  # one future and one timer (not `wait_for`'s task, timeout and cancellation)
                    loop = asyncio.get_running_loop()
                    self.pause = loop.create_future()
                    timer = loop.call_later(wait, _wake, self.pause)
                    try:
                        await self.pause
                    finally:
                        timer.cancel()
                        self.pause = None
            written = self._submit()
            if written is None:
                return  # in the step that marks this task done: an event added after it starts a new one
            await _stored(written)

    async def close(self) -> None:
        """Hand over what is pending at once; in a durable run, wait until every batch is stored."""
        self.closing = True
        if self.pause is not None:
            _wake(self.pause)
        self._submit()
        if self.last is not None and self.context.durable:
            await _stored(self.last)

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
        try:
            await unit.tool_results(messages)
            if _streams(self.wrapped):
                add = unit.add
                async with self.wrapped.request_stream(messages, model_settings, model_request_parameters) as stream:
                    async for event in stream:
                        add(event)
                response = stream.get()
            else:
                response = await self.wrapped.request(messages, model_settings, model_request_parameters)
                for event in _response_events(response):
                    unit.add(event)
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
        request unit reads the whole stream), as `request` does."""
        context = _current.get()
        if context is None:
            async with self.wrapped.request_stream(messages, model_settings, model_request_parameters,
                                                   run_context) as stream:
                yield stream
            return
        unit = _UnitPublisher(context, f'model_request:{len(messages)}')
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
        events = self._durcap_events
        if events is None:  # one iterator, as StreamedResponse: a second `async for` goes on with it
            events = self._events()
            object.__setattr__(self, '_durcap_events', events)
        return events

    async def _events(self) -> AsyncIterator[Any]:
        unit: _UnitPublisher = self._durcap_unit
        add = unit.add
        async for event in self._durcap_stream:
            add(event)
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
