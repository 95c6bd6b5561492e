"""OpenTelemetry traces and metrics of durable runs that stay true across replay, retries, restarts and resumes.

One trace per run, whatever the engine and however many processes touch it: the trace id is derived from the run's
id (`trace_id`), so the client that starts the run, every worker that executes one of its units (after a SIGKILL, on
another machine, after continue-as-new) and `durcap runs resume` all put their spans in the same trace without
carrying anything through the engine, and `durcap runs show` prints the trace id of any run, even one started
before telemetry was turned on. The client's root span `durcap.run` gets the run's own span id (`run_span_id`), and
every unit span is its child.

Spans are emitted only where work executes, never where an engine replays it:
- `durcap.model_request`: inside the model request unit (the agent's model is wrapped by `TelemetryModel`, which the
  unit calls: a Temporal activity, a DBOS step, a Prefect task); a replayed workflow task, a recovered DBOS workflow
  or a cached Prefect task returns the recorded response without calling it, so no span.
- `durcap.tool_call`: inside the tool's unit (the function toolset leaf's `call_tool`, which the activity, step or
  task calls, traced once when the agent is built: `trace_agent_tools`; Temporal: the activity interceptor), with
  `durcap.capability` when a capability holds the tool.
- `durcap.capability_load`: `load_capability` runs in container code (no unit, it replays), so its span comes from
  the model request unit that next executes, from the call to its return.
- `durcap.store.load` / `durcap.store.append`: inside the conversation units.
- `durcap.attempt`: in a durable engine, one short span per execution of a unit (its parent), exported at once, so
  that an attempt killed with SIGKILL still shows (its unit span is lost with the process) beside its retry.
- `durcap.approval_wait`: emitted when a person's decision is delivered (`runner.decide`), from the call's request
  time to the decision, with the decision: the wait itself happens in workflow code, which replays.
- `durcap.turn`: a turn that runs in this process (the local engine, `DurableAgent.run`).

Nothing is emitted or imported (no OpenTelemetry SDK) unless a tracer provider is configured: `configure()` by a
library user, `configure_from_env()` by every `durcap` command when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_TRACES_EXPORTER`) is set, or a global SDK provider that someone else installed (`logfire.configure()`).

Core: imports nothing of the package but `_limits` (its error); the OpenTelemetry API is already imported by
pydantic-ai, the SDK only by `configure_from_env`.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from pydantic_ai.models.wrapper import WrapperModel

from ._limits import InputError

__all__ = [
    'TelemetryModel',
    'configure',
    'configure_from_env',
    'enabled',
    'run_span_id',
    'shutdown',
    'trace_id',
    'trace_link',
]

TRACER_NAME = 'durable_capabilities'
TRACE_URL_ENV = 'DURCAP_TRACE_URL'
"""A trace viewer's URL with `{trace_id}` where the trace id goes (`durcap runs show` prints the link), e.g.
`http://localhost:16686/trace/{trace_id}` (Jaeger)."""
PYDANTIC_AI_ENV = 'DURCAP_OTEL_PYDANTIC_AI'
"""`DURCAP_OTEL_PYDANTIC_AI=1` with the environment configuration: pydantic-ai's own instrumentation (GenAI spans,
`InstrumentationSettings`) runs inside each model request unit, nested in `durcap.model_request`."""

ATTEMPT_UNITS = frozenset({'tool_call', 'model_request'})
"""Units whose every execution in a durable engine gets a `durcap.attempt` span exported at its start."""


@dataclass
class _State:
    tracer_provider: Any = None
    meter_provider: Any = None
    owned: bool = False
    flush_attempts: bool = False
    instrument: Any = None
    tracer: Any = None
    tracer_of: Any = None
    instruments: Any = None
    meter_of: Any = None
    flusher: Any = None
    processors: Any = ()
    watch: Any = None


_state = _State()

DEFAULT_EXPORT_TIMEOUT = 10.0
"""Seconds the exit waits for the last spans and metrics when neither `OTEL_BSP_EXPORT_TIMEOUT` (ms) nor
`OTEL_EXPORTER_OTLP_TIMEOUT` (s, as the Python OTLP exporter reads it) says otherwise: the exporter's own
default time for one export, retries included."""

FAILING_EXPORT_TIMEOUT = 2.0
"""Seconds the exit waits instead when the last export already failed (a collector that refuses connections or
does not answer: waiting out the exporter's retries would only delay the exit), unless a variable sets the bound."""


def configure(tracer_provider: Any = None, meter_provider: Any = None, *, instrument_pydantic_ai: Any = None,
              flush_attempts: bool = False) -> None:
    """Emit this package's spans (and metrics) through the given providers from now on.

    Call before the agents are built (a built agent keeps the model wrapper it was built with).

    Args:
        tracer_provider: An OpenTelemetry `TracerProvider` (the SDK's, or any other); `None`: none of ours (the
            global provider is still used when an SDK one was installed, e.g. by `logfire.configure()`).
        meter_provider: A `MeterProvider` for the metrics (`None`: the global one when set).
        instrument_pydantic_ai: pydantic-ai's own instrumentation inside each model request unit: `True` or an
            `InstrumentationSettings` (its `tracer_provider` defaults to `tracer_provider`). Leave the agent's own
            `instrument=` off then, or its spans come twice (and, on Temporal, again on every replay).
        flush_attempts: Flush the provider after each `durcap.attempt` span (a worker that may be killed: the
            attempt is exported before the unit runs). `configure_from_env` sets it.
    """
    if meter_provider is not _state.meter_provider:
        _state.instruments = _state.meter_of = None
    _state.tracer_provider, _state.meter_provider = tracer_provider, meter_provider
    _state.instrument, _state.flush_attempts = instrument_pydantic_ai, flush_attempts
    _state.flusher = _Flusher(tracer_provider) if flush_attempts else None
    _state.owned, _state.processors, _state.watch = False, (), None


def _env_on(name: str) -> bool:
    return os.environ.get(name, '').strip().lower() in ('1', 'true', 'yes', 'on')


def configure_from_env(service_name: str = 'durcap') -> bool:
    """Configure exporters from the standard `OTEL_*` variables (what every `durcap` command and worker calls).

    On when `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_TRACES_EXPORTER` is set (and
    `OTEL_SDK_DISABLED` is not true). `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER`: a comma list of `otlp`
    (default; OTLP over HTTP/protobuf, configured by the exporter's own `OTEL_EXPORTER_OTLP_*` variables), `console`,
    `none`. The resource reads `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES` (default service name
    `service_name`). Spans are batched (`OTEL_BSP_*`) and flushed at exit (`shutdown`, also registered with
    `atexit`), within `export_timeout()` seconds; `durcap.attempt` spans are flushed at once. The exporters' own
    log lines (one per retry) are not printed: `shutdown` prints one line on stderr when something could not be
    exported.

    Returns:
        Whether telemetry is now on.

    Raises:
        InputError: DC040, an exporter name, OTLP protocol, endpoint (not an http(s) URL) or timeout (not a number
            above 0) this package cannot use, or the SDK is not installed (`pip install
            'durable-capabilities[telemetry]'`).
    """
    if _env_on('OTEL_SDK_DISABLED'):
        return False
    names = _exporters('OTEL_TRACES_EXPORTER')
    for variable in ('OTEL_EXPORTER_OTLP_ENDPOINT', 'OTEL_EXPORTER_OTLP_TRACES_ENDPOINT',
                     'OTEL_EXPORTER_OTLP_METRICS_ENDPOINT'):
        _check_endpoint(variable)
    endpoint = os.environ.get('OTEL_EXPORTER_OTLP_ENDPOINT') or os.environ.get('OTEL_EXPORTER_OTLP_TRACES_ENDPOINT')
    if not endpoint and 'OTEL_TRACES_EXPORTER' not in os.environ:
        return False
    export_timeout()  # an unusable timeout is refused before anything is built
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError as error:
        raise InputError('OTEL_EXPORTER_OTLP_ENDPOINT', f"telemetry needs the OpenTelemetry SDK ({error}): pip install "
                         "'durable-capabilities[telemetry]', or unset the OTEL_* variables") from None
    attributes: dict[str, Any] = {'process.pid': os.getpid()}
    if not os.environ.get('OTEL_SERVICE_NAME'):
        attributes['service.name'] = service_name
    resource = Resource.create(attributes)
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)  # `shutdown` (atexit) bounds the exit
    watch = _ExportWatch()
    processors = []
    for name in names:
        exporter = ConsoleSpanExporter() if name == 'console' else _otlp('traces')
        processors.append(BatchSpanProcessor(watch.wrap(exporter)))  # type: ignore[arg-type]
        provider.add_span_processor(processors[-1])
    meter_provider = _meter_provider_from_env(resource, bool(endpoint))
    instrument = True if _env_on(PYDANTIC_AI_ENV) else None
    configure(provider, meter_provider, instrument_pydantic_ai=instrument, flush_attempts=True)
    _state.owned, _state.processors, _state.watch = True, tuple(processors), watch
    watch.listen()
    atexit.register(shutdown)
    return True


def _check_endpoint(variable: str) -> None:
    """DC040 when `variable` is set to something the OTLP/HTTP exporter cannot post to (not an http(s) URL with a
    host): the SDK would accept it and fail on every export."""
    from urllib.parse import urlsplit

    raw = os.environ.get(variable)
    if raw is None or raw == '':
        return
    try:
        parts = urlsplit(raw.strip())
        ok = parts.scheme.lower() in ('http', 'https') and bool(parts.hostname)
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in 0-65535
    except ValueError:
        ok = False
    if not ok:
        raise InputError(variable, f'{raw[:200]!r} is not an http(s) URL: set it to the OTLP/HTTP address of your '
                         'collector, e.g. http://127.0.0.1:4318, or unset it')


def export_timeout() -> float:
    """Seconds `shutdown` waits for the last spans and metrics to be exported before the process exits:
    `OTEL_BSP_EXPORT_TIMEOUT` (milliseconds) when set, else `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` or
    `OTEL_EXPORTER_OTLP_TIMEOUT` (seconds, as the Python OTLP exporter reads them), else `DEFAULT_EXPORT_TIMEOUT`.

    Raises:
        InputError: DC040, a set value that is not a number above 0 (naming the variable).
    """
    return _export_timeout()[0]


def _export_timeout() -> tuple[float, bool]:
    """`export_timeout()` and whether a variable set it."""
    for variable, scale in (('OTEL_BSP_EXPORT_TIMEOUT', 1000.0), ('OTEL_EXPORTER_OTLP_TRACES_TIMEOUT', 1.0),
                            ('OTEL_EXPORTER_OTLP_TIMEOUT', 1.0)):
        raw = os.environ.get(variable, '').strip()
        if not raw:
            continue
        try:
            value = float(raw) / scale
        except ValueError:
            value = -1.0
        if not value > 0 or value == float('inf'):
            unit = 'milliseconds' if scale > 1 else 'seconds'
            raise InputError(variable, f'{raw[:40]!r} is not a number of {unit} above 0: set one (e.g. '
                             f'{"5000" if scale > 1 else "5"}) or unset it')
        return value, True
    return DEFAULT_EXPORT_TIMEOUT, False


class _ExportWatch:
    """What the exporters of `configure_from_env` could not deliver: the span exporters are wrapped (`wrap`: spans in
    failed exports counted, `failing` from a failed or retried export until one succeeds), and the OTLP exporters' log records (one per
    retry, on stderr by default) are taken instead of printed (`listen`), keeping the last reason per signal."""

    LOGGER = 'opentelemetry.exporter.otlp'

    def __init__(self) -> None:
        self.failed_spans = 0
        self.failing = False
        self.reasons: dict[str, str] = {}
        self.lock = threading.Lock()

    def wrap(self, exporter: Any) -> Any:
        watch = self

        class Watched:
            def export(self, spans: Any) -> Any:
                result = exporter.export(spans)
                ok = getattr(result, 'name', 'SUCCESS') == 'SUCCESS'
                with watch.lock:
                    watch.failing = not ok
                    if not ok:
                        watch.failed_spans += len(spans)
                        watch.reasons.setdefault('spans', 'the exporter gave up')
                return result

            def shutdown(self) -> None:
                exporter.shutdown()

            def force_flush(self, timeout_millis: int = 30_000) -> bool:
                return exporter.force_flush(timeout_millis)

        return Watched()

    def listen(self) -> None:
        watch = self

        class Taken(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                watch.took(record)

        logger = logging.getLogger(self.LOGGER)
        if not any(type(h).__name__ == 'Taken' for h in logger.handlers):
            logger.addHandler(Taken(logging.WARNING))
        logger.propagate = False

    def took(self, record: logging.LogRecord) -> None:
        """Keep the reason of one exporter log record (`Transient error %s ... exporting %s batch`, `Failed to
        export %s batch code: %s, reason: %s`, `Failed to export %s batch due to timeout, ...`)."""
        args = record.args if isinstance(record.args, tuple) else ()
        message = str(record.msg)
        if message.startswith('Transient error') and len(args) >= 2:
            kind, reason = str(args[1]), _short_reason(args[0])
        elif message.startswith('Failed to export') and args:
            kind = str(args[0])
            reason = (f'HTTP {args[1]}: {_short_reason(args[2])}' if args[1] else _short_reason(args[2])) \
                if len(args) >= 3 else None
        else:
            return
        with self.lock:
            self.failing = True  # a retry under way: the collector does not take exports now
            if reason is not None:
                self.reasons[kind] = reason
            else:
                self.reasons.setdefault(kind, 'timed out')

    def line(self, stuck: bool, timeout: float) -> str | None:
        """The one line `shutdown` prints when spans or metrics could not be exported, else `None`."""
        with self.lock:
            reasons, lost = dict(self.reasons), self.failed_spans
        if not reasons and not stuck:
            return None
        what = []
        if 'spans' in reasons or lost or stuck:
            what.append(f'traces ({lost} spans)' if lost and not stuck else 'traces')
        if 'metrics' in reasons:
            what.append('metrics')
        reason = reasons.get('spans') or reasons.get('metrics') or f'not done within {timeout:g} s'
        if stuck and reason != f'not done within {timeout:g} s':
            reason += f' (gave up at exit after {timeout:g} s)'
        return (f'durcap: {" and ".join(what)} could not be exported to {_endpoint_shown()}: {reason} (is the collector '
                'running? OTEL_EXPORTER_OTLP_ENDPOINT; OTEL_BSP_EXPORT_TIMEOUT bounds the wait at exit)')


def _short_reason(error: Any) -> str:
    """The cause of an export failure in a few words: `Connection refused` from requests' nested wording."""
    text = str(error)
    errno = re.search(r'\[Errno -?\d+\] ([^"\')]+)', text)
    if errno:
        return errno.group(1).strip()
    for marker in ('Read timed out', 'timed out', 'Name or service not known', 'certificate verify failed'):
        if marker in text:
            return marker
    return text.splitlines()[0][:160] if text else type(error).__name__


def _endpoint_shown() -> str:
    traces = os.environ.get('OTEL_EXPORTER_OTLP_TRACES_ENDPOINT')
    if traces:
        return traces
    base = os.environ.get('OTEL_EXPORTER_OTLP_ENDPOINT')
    return f'{base.rstrip("/")}/v1/traces' if base else 'http://localhost:4318/v1/traces'


class _Flusher:
    """Flushes a tracer provider in a thread of its own when a unit asks (`flush`), so that a `durcap.attempt` span
    is exported before its unit runs, while the unit waits at most its `timeout`: the SDK's `force_flush` ignores
    its timeout and exports in the caller, where a collector that refuses connections would hold the unit for the
    exporter's whole retry time (~7 s per batch). After a wait that timed out, or while the last export failed,
    units do not wait at all until a flush completes again."""

    def __init__(self, provider: Any):
        self.provider = provider  # `None`: the global one (`_provider`)
        self.cond = threading.Condition()
        self.asked = self.done = 0
        self.stuck = False
        self.pid: int | None = None

    def flush(self, timeout: float) -> None:
        """Ask for a flush and wait until it is done, at most `timeout` seconds (not at all while stuck)."""
        watch = _state.watch
        if self.stuck or (watch is not None and watch.failing):
            return
        with self.cond:
            if self.pid != os.getpid():  # first use, or a forked child (the thread stayed in the parent)
                self.pid, self.asked, self.done = os.getpid(), 0, 0
                threading.Thread(target=self._run, name='durcap-otel-flush', daemon=True).start()
            self.asked += 1
            asked = self.asked
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.done >= asked, timeout):
                self.stuck = True

    def _run(self) -> None:
        pid = os.getpid()
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.asked > self.done or self.pid != pid)
                if self.pid != pid:
                    return
                asked = self.asked
            try:
                provider = self.provider or _provider()
                if hasattr(provider, 'force_flush'):
                    provider.force_flush()
            except Exception:  # noqa: BLE001, S110 - an exporter's failure must not end the flushing thread
                pass
            with self.cond:
                self.done, self.stuck = asked, False
                self.cond.notify_all()


def _exporters(variable: str) -> list[str]:
    raw = os.environ.get(variable, 'otlp')
    names = [n.strip().lower() for n in raw.split(',') if n.strip()] or ['otlp']
    for name in names:
        if name not in ('otlp', 'console', 'none'):
            raise InputError(variable, f'{name!r} is not an exporter durcap can use: otlp (HTTP/protobuf), console '
                             'or none')
    return [n for n in names if n != 'none']


def _otlp(signal: str) -> Any:
    for variable in (f'OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL', 'OTEL_EXPORTER_OTLP_PROTOCOL'):
        protocol = os.environ.get(variable)
        if protocol and protocol.strip() != 'http/protobuf':
            raise InputError(variable, f'{protocol!r}: durcap exports OTLP over http/protobuf only (set it to '
                             'http/protobuf, or point OTEL_EXPORTER_OTLP_ENDPOINT at a collector that takes it)')
    try:
        if signal == 'traces':
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter()
    except ImportError as error:
        raise InputError('OTEL_EXPORTER_OTLP_ENDPOINT', f"the OTLP exporter is not installed ({error}): pip install "
                         "'durable-capabilities[telemetry]'") from None


def _meter_provider_from_env(resource: Any, endpoint: bool) -> Any:
    if 'OTEL_METRICS_EXPORTER' not in os.environ and not endpoint:
        return None
    names = _exporters('OTEL_METRICS_EXPORTER')
    if not names:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, PeriodicExportingMetricReader

    readers = [PeriodicExportingMetricReader(ConsoleMetricExporter() if n == 'console' else _otlp('metrics'))
               for n in names]
    return MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)  # `shutdown` bounds the exit


def shutdown() -> None:
    """Flush what is pending and, for providers `configure_from_env` made, shut them down (idempotent). Every
    `durcap` command calls it before it exits.

    For the providers of `configure_from_env`, the wait is bounded by `export_timeout()` seconds (traces and
    metrics exported at once, an exporter's pending retries abandoned at the bound), and one line goes to stderr
    when something could not be exported (where, why); the process's exit code is not changed.
    """
    if not _state.owned:
        for provider in (_state.tracer_provider, _state.meter_provider):
            try:
                if provider is not None and hasattr(provider, 'force_flush'):
                    provider.force_flush()
            except Exception:  # noqa: BLE001, S110 - an exporter that cannot reach its collector must not fail the exit
                pass
        return
    try:
        timeout, explicit = _export_timeout()
    except InputError:  # pragma: no cover - refused by configure_from_env already
        timeout, explicit = DEFAULT_EXPORT_TIMEOUT, False
    if not explicit and _state.watch is not None and _state.watch.failing:
        timeout = min(timeout, FAILING_EXPORT_TIMEOUT)
    millis = int(timeout * 1000)
    calls: list[Callable[[], Any]] = [functools.partial(p.shutdown, timeout_millis=millis) for p in _state.processors]
    if _state.tracer_provider is not None:
        calls.append(_state.tracer_provider.shutdown)  # the processors are done by then: the provider's own state
    if _state.meter_provider is not None:
        calls.insert(0, functools.partial(_state.meter_provider.shutdown, timeout_millis=millis))
    stuck = not _within(calls, timeout + 0.5)
    line = _state.watch.line(stuck, timeout) if _state.watch is not None else None
    _state.tracer_provider = _state.meter_provider = _state.tracer = _state.tracer_of = None
    _state.instruments = _state.meter_of = _state.flusher = _state.watch = None
    _state.processors, _state.owned = (), False
    if line:
        try:
            print(line, file=sys.stderr, flush=True)
        except (OSError, ValueError):  # pragma: no cover - stderr closed
            pass


def _within(calls: list[Callable[[], Any]], seconds: float) -> bool:
    """Run the meter provider's shutdown in one daemon thread and the tracer's parts in order in another; whether
    both ended within `seconds` (a thread still exporting is left behind: the process exits without it)."""
    def run(part: list[Callable[[], Any]]) -> None:
        for call in part:
            try:
                call()
            except Exception:  # noqa: BLE001, S110 - an exporter that cannot reach its collector must not fail the exit
                pass

    parts = [calls[:1], calls[1:]] if _state.meter_provider is not None else [calls]
    threads = [threading.Thread(target=run, args=(part,), name='durcap-otel-exit', daemon=True) for part in parts if part]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0))
    return not any(thread.is_alive() for thread in threads)


def _provider() -> Any:
    """The tracer provider in use, or `None` (telemetry off)."""
    provider = _state.tracer_provider
    if provider is not None:
        return provider
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


def enabled() -> bool:
    """Whether this process emits spans: a provider was configured (`configure`, `configure_from_env`) or an SDK one
    is installed globally (`logfire.configure()`, `trace.set_tracer_provider`)."""
    return _provider() is not None


# ---- ids: one trace per run --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _digest(run_id: str) -> bytes:
    return hashlib.sha256(b'durcap-run\0' + run_id.encode()).digest()


def trace_id(run_id: str) -> str:
    """The trace id (32 hex digits) of run `run_id` (workflow id, flow run id): the same in every process."""
    return f'{_trace_int(run_id):032x}'


def _trace_int(run_id: str) -> int:
    return int.from_bytes(_digest(run_id)[:16], 'big') or 1


def run_span_id(run_id: str) -> str:
    """The span id (16 hex digits) of the run's root span `durcap.run`, the parent of its unit spans."""
    return f'{_span_int(run_id):016x}'


def _span_int(run_id: str) -> int:
    return int.from_bytes(_digest(run_id)[16:24], 'big') or 1


def trace_link(run_id: str) -> str | None:
    """The run's trace in the viewer of `$DURCAP_TRACE_URL` (`{trace_id}` replaced), or `None` when unset."""
    template = os.environ.get(TRACE_URL_ENV)
    return template.replace('{trace_id}', trace_id(run_id)) if template else None


def _run_parent(run_id: str) -> Any:
    """An OpenTelemetry context whose span is the run's root (remote: it may live in another process). Cached per
    run id: a context is immutable, and a worker starts every unit span of a run in it."""
    ctx = SpanContext(_trace_int(run_id), _span_int(run_id), is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    return trace.set_span_in_context(NonRecordingSpan(ctx), otel_context.Context())


_forced: ContextVar[tuple[int, int] | None] = ContextVar('durcap_forced_ids', default=None)


class _RunIds:
    """The SDK tracer's id generator, except for the run's root span, which gets the run's own ids."""

    def __init__(self, wrapped: Any):
        self.wrapped = wrapped

    def generate_span_id(self) -> int:
        forced = _forced.get()
        return forced[1] if forced is not None else self.wrapped.generate_span_id()

    def generate_trace_id(self) -> int:
        forced = _forced.get()
        return forced[0] if forced is not None else self.wrapped.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        return False


def _tracer() -> Any:
    provider = _provider()
    if provider is None:
        return None
    if _state.tracer is None or _state.tracer_of is not provider:
        tracer = provider.get_tracer(TRACER_NAME, _version())
        # The SDK's Tracer (which a provider may hand out again): the root span gets the run's ids (see `_RunIds`).
        if hasattr(tracer, 'id_generator') and not isinstance(tracer.id_generator, _RunIds):
            tracer.id_generator = _RunIds(tracer.id_generator)
        _state.tracer, _state.tracer_of = tracer, provider
    return _state.tracer


@functools.lru_cache(maxsize=1)
def _version() -> str | None:
    """This package's version (the instrumentation scope's), read from its metadata once."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version('durable-capabilities')
    except PackageNotFoundError:  # pragma: no cover - a checkout on sys.path without the metadata
        return None


# ---- where a unit runs ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Where:
    """The run a unit executes for, as its engine says (`where`).

    Attributes:
        engine: The engine's name.
        run_id: The run's id (workflow id, flow run id).
        attempt: The execution's attempt as the engine numbers it (1 first; `None`: not numbered).
        durable: Whether the engine retries the unit after a crash (the attempt span is exported at once).
        agent: The agent's name when the engine knows it here.
    """

    engine: str
    run_id: str
    attempt: int | None = None
    durable: bool = True
    agent: str | None = None


_local: ContextVar[Where | None] = ContextVar('durcap_telemetry_run', default=None)


@contextmanager
def in_run(run_id: str, engine: str = 'local', agent: str | None = None) -> Iterator[None]:
    """Mark the code in this context as part of run `run_id` executing in this process (the local engine)."""
    token = _local.set(Where(engine, run_id, None, False, agent))
    try:
        yield
    finally:
        _local.reset(token)


def where() -> Where | None:
    """The run whose unit this code executes in: a Temporal activity, a DBOS step or workflow, a Prefect task or flow,
    or a local run (`in_run`); `None` outside any. Asks only the engine SDKs this process already imported."""
    activity = sys.modules.get('temporalio.activity')
    if activity is not None and activity.in_activity():
        info = activity.info()
        agent = info.workflow_type[len('durcap.'):] if (info.workflow_type or '').startswith('durcap.') else None
        return Where('temporal', info.workflow_id or '', info.attempt, True, agent)
    dbos = sys.modules.get('dbos')
    if dbos is not None:
        workflow_id = dbos.DBOS.workflow_id
        if workflow_id is not None:
            status = dbos.DBOS.step_status
            attempt = status.current_attempt + 1 if status is not None and status.current_attempt is not None else None
            return Where('dbos', workflow_id, attempt, True)
    prefect = sys.modules.get('prefect.context')
    if prefect is not None:
        flow = prefect.FlowRunContext.get()
        if flow is not None and flow.flow_run is not None:
            task = prefect.TaskRunContext.get()
            attempt = task.task_run.run_count if task is not None else None
            return Where('prefect', str(flow.flow_run.id), attempt or None, True)
    return _local.get()


def replaying() -> bool:
    """Whether this is Temporal workflow code replaying its history (no span for what it replays)."""
    workflow = sys.modules.get('temporalio.workflow')
    if workflow is None:
        return False
    try:
        return workflow.in_workflow() and workflow.unsafe.is_replaying()
    except Exception:  # noqa: BLE001 - not in a workflow's event loop
        return False


# ---- spans ----------------------------------------------------------------------------------------------------


def _attributes(attributes: dict[str, Any]) -> dict[str, Any]:
    return {k if '.' in k else f'durcap.{k}': v for k, v in attributes.items() if v is not None}


def run_started() -> int:
    """The client's clock at the start of a run (`time.time_ns()`), for `record_run`."""
    return time.time_ns()


def record_run(run_id: str, *, agent: str, engine: str, conversation_id: str | None, start_ns: int,
               error: BaseException | None = None, name: str = 'durcap.run', resumed: bool = False) -> None:
    """Emit the run's root span (the client's call to the final `RunReport`), now that the run ended.

    Args:
        run_id: The run's id (its ids: `trace_id`, `run_span_id`).
        agent / engine / conversation_id: Its attributes.
        start_ns: When the client's call started (`run_started`).
        error: The error the run failed with, if any (status ERROR, recorded as an exception event).
        name: `durcap.run`, or `durcap.resume` for `durcap runs resume` (a child of the root, another span id).
        resumed: Emit it as a child of the run's root (a resume) instead of as the root itself.
    """
    tracer = _tracer()
    if tracer is None:
        return
    caller = trace.get_current_span().get_span_context()
    links = [Link(caller)] if caller.is_valid and caller.trace_id != _trace_int(run_id) else None
    attributes = _attributes({'agent': agent, 'engine': engine, 'run_id': run_id, 'conversation_id': conversation_id,
                              'unit': 'run'})
    if resumed or not hasattr(tracer, 'id_generator'):
        span = tracer.start_span(name, context=_run_parent(run_id), start_time=start_ns, attributes=attributes,
                                 links=links, kind=SpanKind.CLIENT)
    else:
        token = _forced.set((_trace_int(run_id), _span_int(run_id)))
        try:
            span = tracer.start_span(name, context=otel_context.Context(), start_time=start_ns, attributes=attributes,
                                     links=links, kind=SpanKind.CLIENT)
        finally:
            _forced.reset(token)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f'{type(error).__name__}: {error}'.splitlines()[0][:200]))
    span.end()
    if not resumed:
        _metrics().run_ended(agent, engine, error, (time.time_ns() - start_ns) / 1e9)


def _parent(at: Where | None) -> Any:
    """The context a unit span starts in: the current span when it belongs to the run's trace (units nested in a
    local turn), else the run's root."""
    current = trace.get_current_span().get_span_context()
    if at is None:
        return None
    if current.is_valid and current.trace_id == _trace_int(at.run_id):
        return otel_context.get_current()
    return _run_parent(at.run_id)


_open_unit: ContextVar[str | None] = ContextVar('durcap_open_unit', default=None)


@contextmanager
def unit_span(unit: str, name: str | None = None, *, agent: str | None = None, at: Where | None = None,
              extra: dict[str, Any] | None = None, **attributes: Any) -> Iterator[Any]:
    """A span around one execution of a unit, in the run's trace; a no-op (yields `None`) when telemetry is off,
    outside a run, or inside a unit span of the same kind (a wrapped call inside the unit that already has one).

    Args:
        unit: `model_request`, `tool_call`, `capability_load`, `store.load`, `store.append`, ...: the span is
            `durcap.{unit}`, attribute `durcap.unit`.
        name: Attribute `durcap.unit_name` (the engine's unit name, the tool's name).
        agent: The agent's name (attribute `durcap.agent`; default: what the engine says).
        at: Where it runs (default: `where()`).
        extra: Attributes with dotted names, as given (`gen_ai.request.model`).
        attributes: More attributes (`capability=`, `tool=`, ... become `durcap.*`).

    Yields:
        The span (record more attributes on it), or `None`.
    """
    tracer = _tracer()
    if tracer is None or _open_unit.get() == unit:
        yield None
        return
    at = at or where()
    parent = _parent(at)
    if at is None or parent is None:  # not in a run: nothing to attribute the span to
        yield None
        return
    extra = extra or {}
    if name is not None and name in (attributes.get('tool'), extra.get('gen_ai.request.model')):
        name = None  # said already (`durcap.tool`, `gen_ai.request.model`): every attribute costs the SDK a check
    attrs = _attributes({'agent': agent or at.agent, 'engine': at.engine, 'run_id': at.run_id, 'unit': unit,
                         'unit_name': name, 'attempt': at.attempt, **attributes, **extra})
    if at.durable and unit in ATTEMPT_UNITS:
        marker = tracer.start_span('durcap.attempt', context=parent, attributes=attrs)
        marker.end()
        parent = trace.set_span_in_context(marker, parent)
        if _state.flusher is not None:
            _state.flusher.flush(2.0)
    token = _open_unit.set(unit)
    start = time.perf_counter()
    span = tracer.start_span(f'durcap.{unit}', context=parent, attributes=attrs)
    ctx_token = otel_context.attach(trace.set_span_in_context(span, parent))
    failed: BaseException | None = None
    try:
        yield span
    except BaseException as error:
        failed = error
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, f'{type(error).__name__}: {error}'.splitlines()[0][:200]))
        raise
    finally:
        otel_context.detach(ctx_token)
        _open_unit.reset(token)
        span.end()
        _metrics().unit_ended(attrs, time.perf_counter() - start, failed)


def tool_unit(tool_name: str, tool_args: dict[str, Any] | None, *, agent: str | None = None,
              at: Where | None = None, capability: str | None = None) -> Any:
    """`unit_span` of one tool execution: `durcap.tool_call`, attributes `durcap.tool` and `durcap.capability` (the
    capability whose toolset holds the tool, when it is one)."""
    return unit_span('tool_call', tool_name, agent=agent, at=at, tool=tool_name, capability=capability)


def _capability_loads(messages: Any, at: Where | None, agent: str | None) -> None:
    """`durcap.capability_load` spans for the `load_capability` calls whose results the request about to be sent
    carries (its last message), from the call's response to its return.

    `load_capability` runs in the engine's container code (it changes the run's state, no durable unit), which
    replays; the model request unit that follows it executes once, so the load is reported from there (its first
    attempt only).
    """
    tracer = _tracer()
    if tracer is None or at is None or (at.attempt or 1) > 1 or not messages:
        return
    last = messages[-1]
    returns = [p for p in getattr(last, 'parts', ()) if getattr(p, 'part_kind', '') == 'tool-return'
               and p.tool_name == 'load_capability']
    if not returns:
        return
    calls: dict[str, tuple[Any, Any]] = {}
    for message in messages:
        if getattr(message, 'kind', '') == 'response':
            for part in message.parts:
                if getattr(part, 'part_kind', '') == 'tool-call' and part.tool_name == 'load_capability':
                    calls[part.tool_call_id] = (part, message.timestamp)
    parent = _parent(at)
    for returned in returns:
        call, called_at = calls.get(returned.tool_call_id, (None, None))
        args = call.args_as_dict() if call is not None else {}
        end = int(returned.timestamp.timestamp() * 1e9) if returned.timestamp else time.time_ns()
        start = int(called_at.timestamp() * 1e9) if called_at else end
        capability = args.get('id')
        span = tracer.start_span('durcap.capability_load', context=parent, start_time=min(start, end),
                                 attributes=_attributes({'agent': agent or at.agent, 'engine': at.engine,
                                                         'run_id': at.run_id, 'unit': 'capability_load',
                                                         'capability': capability if isinstance(capability, str) else None,
                                                         'tool_call_id': returned.tool_call_id}))
        span.end(end_time=end)


@contextmanager
def turn_span(agent: str, conversation_id: str | None) -> Iterator[None]:
    """`durcap.turn` around a turn executing in this process for a local run (`in_run`); nothing elsewhere (a durable
    engine's container code replays: its turn is the run's root span)."""
    at = _local.get()
    tracer = _tracer() if at is not None else None
    if tracer is None or at is None:
        yield
        return
    with tracer.start_as_current_span('durcap.turn', context=_parent(at), attributes=_attributes(
            {'agent': agent, 'engine': at.engine, 'run_id': at.run_id, 'conversation_id': conversation_id,
             'unit': 'turn'})):
        yield


def record_approval(run_id: str, *, engine: str, agent: str | None, tool: str | None, call_id: str,
                    requested_at: Any, approved: bool, by: str | None, reason: str | None) -> None:
    """Emit `durcap.approval_wait` for one decided call: from `requested_at` (an ISO 8601 time or a datetime; `None`
    or unreadable: now) to now, with the decision (`durcap.decision`: approved | denied, `durcap.decided_by`)."""
    tracer = _tracer()
    if tracer is None:
        return
    now = time.time_ns()
    start = now
    try:
        if isinstance(requested_at, str):
            from datetime import datetime

            requested_at = datetime.fromisoformat(requested_at.replace('Z', '+00:00'))
        if requested_at is not None:
            start = int(requested_at.timestamp() * 1e9)
    except (ValueError, AttributeError):
        pass
    attributes = _attributes({'agent': agent, 'engine': engine, 'run_id': run_id, 'unit': 'approval_wait',
                              'tool': tool, 'tool_call_id': call_id, 'decision': 'approved' if approved else 'denied',
                              'decided_by': by, 'decision_reason': reason})
    span = tracer.start_span('durcap.approval_wait', context=_run_parent(run_id), start_time=min(start, now),
                             attributes=attributes)
    span.end(end_time=now)
    _metrics().approval_decided(agent, engine, approved, max(now - start, 0) / 1e9)


# ---- the model request unit ---------------------------------------------------------------------------------


class TelemetryModel(WrapperModel):
    """The agent's model as the model request unit calls it: one `durcap.model_request` span per request that
    executes (with its tokens), and, when configured, pydantic-ai's own instrumentation nested inside it.

    Args:
        wrapped: The model (a `Model`, or a name `infer_model` resolves).
        agent: The agent's name (attribute `durcap.agent`).
    """

    def __init__(self, wrapped: Any, agent: str | None = None):
        super().__init__(wrapped)
        self.agent = agent
        self._instrumented: Any = None

    def _inner(self) -> Any:
        settings = _state.instrument
        if not settings:
            return self.wrapped
        if self._instrumented is None or self._instrumented[0] is not settings:
            from pydantic_ai.models.instrumented import InstrumentationSettings, InstrumentedModel

            if settings is True:
                settings = InstrumentationSettings(tracer_provider=_provider())
            self._instrumented = (_state.instrument, InstrumentedModel(self.wrapped, settings))
        return self._instrumented[1]

    async def request(self, messages: Any, model_settings: Any, model_request_parameters: Any) -> Any:
        at, model_name = where(), self.model_name
        _capability_loads(messages, at, self.agent)
        with unit_span('model_request', model_name, agent=self.agent, at=at,
                       extra={'gen_ai.request.model': model_name}) as span:
            response = await self._inner().request(messages, model_settings, model_request_parameters)
            _record_usage(span, response, self.agent)
            return response

    @asynccontextmanager
    async def request_stream(self, messages: Any, model_settings: Any, model_request_parameters: Any,
                             run_context: Any = None) -> AsyncIterator[Any]:
        at, model_name = where(), self.model_name
        _capability_loads(messages, at, self.agent)
        with unit_span('model_request', model_name, agent=self.agent, at=at, streamed=True,
                       extra={'gen_ai.request.model': model_name}) as span:
            async with self._inner().request_stream(messages, model_settings, model_request_parameters,
                                                    run_context) as stream:
                yield stream
            _record_usage(span, stream.get(), self.agent)


def _record_usage(span: Any, response: Any, agent: str | None) -> None:
    usage = getattr(response, 'usage', None)
    if span is None or usage is None:
        return
    capability = acted_on(response, agent)
    span.set_attributes({'gen_ai.usage.input_tokens': usage.input_tokens,
                         'gen_ai.usage.output_tokens': usage.output_tokens,
                         **({'durcap.capability': capability} if capability is not None else {})})
    _metrics().tokens(agent, usage.input_tokens, usage.output_tokens, capability)


_TOOL_CAPABILITY: dict[tuple[str | None, str], str] = {}
"""(agent name, tool name) -> the id of the capability leaf that has the tool (function toolsets of capabilities, filled
by `trace_agent_tools` when the agent is built): how a model request's tokens are put under a capability."""


def acted_on(response: Any, agent: str | None) -> str | None:
    """The capability a model response acts on, under which its request's tokens are counted (`durcap.tokens`,
    attribute `durcap.capability`): the capability its first tool call loads (`load_capability`) or belongs to
    (a function tool of a capability's toolset). `None` for an answer, the agent's own tools and tools no capability
    of the definition has (an MCP server's, known only at run time). Each request is counted once, so the counts
    still add up to the agent's total."""
    for part in getattr(response, 'parts', ()):
        if getattr(part, 'part_kind', '') != 'tool-call':
            continue
        if part.tool_name == 'load_capability':
            try:
                loaded = part.args_as_dict().get('id')
            except Exception:  # noqa: BLE001 - arguments the model got wrong: nothing to attribute
                return None
            return loaded if isinstance(loaded, str) else None
        return _TOOL_CAPABILITY.get((agent, part.tool_name))
    return None


def wrap_model(model: Any, agent: str | None) -> Any:
    """`model` in `TelemetryModel` when telemetry is on (`None` and an already wrapped model as given)."""
    if model is None or isinstance(model, TelemetryModel) or not enabled():
        return model
    return TelemetryModel(model, agent)


def _traced_call_tool(leaf: Any, agent: str | None) -> Callable[..., Any]:
    call = type(leaf).call_tool.__get__(leaf)
    capability = leaf.id

    async def call_tool(name: str, tool_args: dict[str, Any], ctx: Any, tool: Any) -> Any:
        with tool_unit(name, tool_args, agent=agent, capability=capability):
            return await call(name, tool_args, ctx, tool)

    call_tool.__durcap_traced__ = True  # type: ignore[attr-defined]
    return call_tool


def trace_agent_tools(built: Any, capabilities: Any, agent: str | None) -> None:
    """Give the function toolset leaves of a just built agent their traced `call_tool` (`trace_tools`): the agent's
    own tools (`built.toolsets`) and every capability's toolset (groups walked). Done once, when the agent is built:
    the leaves a run uses are these very objects (durable engines refuse others, `ids.StableIdCapability` keeps
    them), so no capability is added to the run's hook chain for it. A toolset built anew on each run step (a
    `DynamicToolset`) is not reached: its tools get no span, except on Temporal (the activity interceptor).

    Args:
        built: The `pydantic_ai.Agent`.
        capabilities: The capabilities it was built with.
        agent: The agent's name (attribute `durcap.agent`).
    """
    for toolset in built.toolsets:
        trace_tools(toolset, agent)
    flat: list[Any] = []
    for capability in capabilities:
        capability.apply(flat.append)
    for capability in flat:
        toolset = capability.get_toolset()
        if toolset is not None and hasattr(toolset, 'apply'):
            trace_tools(toolset, agent)
            toolset.apply(lambda leaf: _TOOL_CAPABILITY.update(
                {(agent, name): leaf.id for name in getattr(leaf, 'tools', {}) if getattr(leaf, 'id', None)}))


def trace_tools(toolset: Any, agent: str | None) -> None:
    """Give every function toolset leaf of `toolset` a `call_tool` that emits the tool's unit span where it executes
    (the engine's tool unit calls the leaf's `call_tool`: a DBOS step, a Prefect task, the local run). Idempotent."""
    from pydantic_ai.toolsets import FunctionToolset

    def visit(leaf: Any) -> None:
        if isinstance(leaf, FunctionToolset) and not getattr(leaf.__dict__.get('call_tool'), '__durcap_traced__', False):
            leaf.call_tool = _traced_call_tool(leaf, agent)

    toolset.apply(visit)


# ---- metrics --------------------------------------------------------------------------------------------------


class _Instruments:
    """The package's OpenTelemetry instruments (`durcap.*`), on the configured or global meter provider."""

    def __init__(self, meter: Any):
        self.on = meter is not None
        if meter is None:
            return
        self.started = meter.create_counter('durcap.runs.started', unit='{run}', description='Runs started')
        self.completed = meter.create_counter('durcap.runs.completed', unit='{run}', description='Runs completed')
        self.failed = meter.create_counter('durcap.runs.failed', unit='{run}', description='Runs failed')
        self.run_duration = meter.create_histogram('durcap.run.duration', unit='s', description='Run duration')
        self.unit_duration = meter.create_histogram('durcap.unit.duration', unit='s',
                                                    description='Duration of each executed durable unit')
        self.retries = meter.create_counter('durcap.unit.retries', unit='{attempt}',
                                            description='Unit executions after the first (retries)')
        self.token_count = meter.create_counter('durcap.tokens', unit='{token}', description='Model tokens')
        self.wait = meter.create_histogram('durcap.approval.wait', unit='s', description='Approval wait time')
        self.waiting = meter.create_up_down_counter(
            'durcap.approvals.waiting', unit='{call}', description='Tool calls waiting for a decision in this process')
        self.claim_check = meter.create_counter(
            'durcap.claim_check.bytes', unit='By',
            description='Bytes of payloads carried by reference (written to / read from the store)')

    def run_started(self, agent: str, engine: str) -> None:
        if self.on:
            self.started.add(1, {'durcap.agent': agent, 'durcap.engine': engine})

    def run_ended(self, agent: str, engine: str, error: BaseException | None, seconds: float) -> None:
        if not self.on:
            return
        attrs = {'durcap.agent': agent, 'durcap.engine': engine}
        (self.failed if error is not None else self.completed).add(1, attrs)
        self.run_duration.record(seconds, attrs)

    def unit_ended(self, attrs: dict[str, Any], seconds: float, error: BaseException | None) -> None:
        if not self.on:
            return
        keep = {k: attrs[k] for k in ('durcap.agent', 'durcap.engine', 'durcap.unit', 'durcap.capability') if k in attrs}
        self.unit_duration.record(seconds, {**keep, 'durcap.failed': error is not None})
        if (attrs.get('durcap.attempt') or 1) > 1:
            self.retries.add(1, keep)

    def tokens(self, agent: str | None, tokens_in: int, tokens_out: int, capability: str | None = None) -> None:
        if not self.on:
            return
        base = {'durcap.agent': agent} if agent else {}
        if capability is not None:
            base['durcap.capability'] = capability
        self.token_count.add(tokens_in, {**base, 'durcap.direction': 'in'})
        self.token_count.add(tokens_out, {**base, 'durcap.direction': 'out'})

    def approval_decided(self, agent: str | None, engine: str, approved: bool, seconds: float) -> None:
        if not self.on:
            return
        attrs = {'durcap.engine': engine, 'durcap.decision': 'approved' if approved else 'denied',
                 **({'durcap.agent': agent} if agent else {})}
        self.wait.record(seconds, attrs)

    def waiting_changed(self, agent: str | None, engine: str, delta: int) -> None:
        if self.on and delta:
            self.waiting.add(delta, {'durcap.engine': engine, **({'durcap.agent': agent} if agent else {})})

    def claim_checked(self, direction: str, size: int) -> None:
        if self.on:
            self.claim_check.add(size, {'durcap.engine': 'temporal', 'durcap.direction': direction})


def _metrics() -> _Instruments:
    """The instruments, made on first use after `configure` (a global meter provider installed later is not seen)."""
    if _state.instruments is not None:
        return _state.instruments
    provider = _state.meter_provider
    if provider is None:
        provider = otel_metrics.get_meter_provider()
        if type(provider).__name__ in ('_ProxyMeterProvider', 'NoOpMeterProvider'):
            provider = None
    _state.instruments = _Instruments(provider.get_meter(TRACER_NAME, _version()) if provider is not None else None)
    _state.meter_of = provider
    return _state.instruments


def run_started_metric(agent: str, engine: str) -> None:
    """Count a run started by this client (`durcap.runs.started`)."""
    _metrics().run_started(agent, engine)


_waiting: dict[tuple[str, str, str], str | None] = {}
"""The calls waiting for a decision in this process's runs: (engine, run id, call id) -> agent."""
_waiting_lock = threading.Lock()


@contextmanager
def approvals_waiting(run_id: str, call_ids: list[str], agent: str | None) -> Iterator[None]:
    """Count the calls of `call_ids` as waiting in this process (`durcap.approvals.waiting`, an up-down counter by
    `durcap.agent` and `durcap.engine`) while the gate waits for their decisions.

    The wait runs in workflow code, which an engine re-enters (a Temporal workflow task replayed, a DBOS workflow
    recovered, a Prefect flow run resumed): a call is counted once per process however often its wait is entered
    (keyed by engine, run id and call id), and uncounted when the wait it was counted in ends (decided, timed out,
    cancelled, or its workflow evicted from a worker's cache). Summed over processes (each one's `process.pid`),
    the gauge is the number of calls waiting in workflows that some process holds; a Temporal workflow evicted
    from every cache while it waits is not counted until a worker holds it again.
    """
    if not call_ids or not _metrics().on:
        yield
        return
    engine = _engine_here()
    keys = [(engine, run_id, call_id) for call_id in call_ids]
    with _waiting_lock:
        added = [k for k in keys if k not in _waiting]
        for key in added:
            _waiting[key] = agent
    _metrics().waiting_changed(agent, engine, len(added))
    try:
        yield
    finally:
        with _waiting_lock:
            removed = [k for k in added if k in _waiting]
            for key in removed:
                del _waiting[key]
        _metrics().waiting_changed(agent, engine, -len(removed))


def _engine_here() -> str:
    """The engine whose workflow code runs here (Temporal's workflow sandbox included), `local` outside any."""
    workflow = sys.modules.get('temporalio.workflow')
    try:
        if workflow is not None and workflow.in_workflow():
            return 'temporal'
    except Exception:  # noqa: BLE001, S110 - not in a workflow's event loop
        pass
    at = where()
    return at.engine if at is not None else 'local'


def claim_check_bytes(direction: str, size: int) -> None:
    """Count `size` bytes of a payload carried by reference (`durcap.claim_check.bytes`, attribute
    `durcap.direction`: `written` when the claim-check codec stored it, `read` when it fetched it back; every read
    counts, a replayed workflow's decoding included: it is the store's traffic)."""
    _metrics().claim_checked(direction, size)

