"""The `/v1` routes of `durcap serve` (see the package docstring and docs/serving.md)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import pydantic
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .._limits import MAX_DEPTH, InputError, is_digits, load_json, one_line, printable
from ..agent import DurableAgent
from ..approvals import (
    AlreadyDecidedError,
    ApprovalArgsError,
    ApprovalError,
    Decision,
    DecisionNotDeliveredError,
    already_decided,
    check_args,
    stale_fingerprint,
)
from ..conversations import check_busy
from ..engines._stall import WaitingForWorker
from ..store import ConversationBusyError, ConversationNotFoundError, StoreError
from ..store._sql import _WouldWait
from ..streams import StreamNotFoundError
from ..streams._events import TERMINAL_KINDS
from ..streams._log import StoredEvent
from ..streams._watch import POLL_SECONDS, event_json, watch_rows
from ._errors import (
    BadRequestError,
    NotFoundError,
    RequestTooLargeError,
    ServeError,
    UnauthenticatedError,
    lead_with_code,
)
from ._rows import RunRow, ServeRows

logger = logging.getLogger('durable_capabilities.serve')

Auth = Callable[[Request], 'str | Awaitable[str | None] | None']
"""`auth(request) -> principal | None` (sync or async): who sends the request (`None`: refused, 401)."""

DepsFactory = Callable[[str, Request], Any]
"""`deps_factory(principal, request) -> deps` (sync or async): a run's deps when the request carries none."""

DEFAULT_MAX_BODY_BYTES = 1024 * 1024
"""The largest request body read (`create_app(max_body_bytes=...)`); a larger one is refused with DC041 (413)."""

DEFAULT_KEEPALIVE_SECONDS = 15.0
"""An event stream that wrote nothing for this long gets an SSE comment line (`: keepalive`), so that a proxy or load
balancer with an idle timeout (often 30-60 s) does not cut the stream of a run that waits for an approval, a queue or
a worker (`create_app(keepalive_seconds=...)`, `durcap serve --keepalive`; 0: none). EventSource and the SSE parsers of
the AG-UI and ai SDK clients skip comment lines (the SSE standard: a line starting with a colon)."""

SSE_RETRY = 'retry: 1000\n\n'
"""The SSE `retry:` field of every event stream (1 s: an EventSource that lost the stream reconnects after 1 s,
with `Last-Event-ID`, not the browser's default 3-5 s), in the stream's first write (`_EventStream`)."""

ID_PATTERN = re.compile(r'[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}')
"""Conversation ids (and Idempotency-Keys) the API accepts: 1-200 characters of letters, digits and `._:@-`."""

FINGERPRINT = re.compile(r'[0-9a-f]{64}')

OWN_RUN_POLL_SECONDS = 5.0
"""How often the SSE stream of a local run this process runs reads the store when no commit woke it: every commit of
such a run is made in this process and handed to the stream (`streams._log.Inbox`), so this read is only a safety net
(a run elsewhere is read every `streams.POLL_SECONDS`, 50 ms)."""


_ORIGIN = re.compile(r'https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?')


def check_cors_origin(origin: str) -> str:
    """`origin` when it is a CORS origin a browser sends (`scheme://host[:port]`, http or https, no path, no trailing
    slash) or `*` (any origin); returns it unchanged.

    Raises:
        ValueError: anything else (a URL with a path, a bare host, a typo): such an origin never matches a browser's
            `Origin` header, so CORS would silently stay off for the app it was meant for. The message leads with
            DC040 and names the fix.
    """
    if origin == '*' or _ORIGIN.fullmatch(origin):
        return origin
    raise ValueError(f'DC040 CORS origin {printable(origin[:200])!r} is not an origin: expected scheme://host[:port] '
                     "(http or https, no path, no trailing slash), e.g. 'https://app.example.com' or "
                     "'http://localhost:5173', or '*' for any origin")


def bearer_auth(tokens: str | Mapping[str, str]) -> Auth:
    """The default `auth`: `Authorization: Bearer TOKEN`, compared in constant time.

    Args:
        tokens: One token (its principal is `default`), or `{token: principal}` (several users, one token each).

    Returns:
        An `Auth` yielding the token's principal, `None` for a missing or wrong token.

    Raises:
        ValueError: no token, or an empty one.
    """
    table = {tokens: 'default'} if isinstance(tokens, str) else dict(tokens)
    if not table or any(not t for t in table):
        raise ValueError('bearer_auth needs at least one non-empty token (set $DURCAP_SERVE_TOKEN)')
    encoded = [(t.encode(), p) for t, p in table.items()]

    def auth(request: Request) -> str | None:
        header = request.headers.get('authorization', '')
        scheme, _, given = header.partition(' ')
        if scheme.lower() != 'bearer' or not given:
            return None
        found = None
        for token, principal in encoded:  # every token compared: the time does not tell which one matched
            if secrets.compare_digest(given.strip().encode(), token):
                found = principal
        return found

    return auth


def parse_tokens(value: str) -> str | dict[str, str]:
    """`$DURCAP_SERVE_TOKEN`: one token, or `alice=TOKEN1,bob=TOKEN2` (a principal per token).

    Raises:
        ValueError: an empty token or principal in the list, or one token given to two principals (the requests of
            one would be served as the other's).
    """
    if '=' not in value:
        return value
    table: dict[str, str] = {}
    for item in value.split(','):
        principal, _, token = item.strip().partition('=')
        if not principal or not token:
            raise ValueError('DURCAP_SERVE_TOKEN: expected one token, or principal=token pairs separated by commas')
        if table.get(token, principal) != principal:
            raise ValueError(f'DURCAP_SERVE_TOKEN: principals {table[token]!r} and {principal!r} have the same token: '
                             'give each principal a token of its own')
        table[token] = principal
    return table


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _Body(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra='forbid', strict=True)


class TurnRequest(_Body):
    """`POST /v1/conversations/{id}/turns`: `{"agent", "prompt", "deps"?, "busy"?}` (`agent` may be left out when the
    app serves one agent; `busy`: `"reject"`, `"enqueue"` or `"interrupt"` when another run's turn holds the
    conversation, default the agent's `DurableAgent(busy=...)`; `"interrupt"` for an agent whose output is not text:
    400 DC053)."""

    agent: str | None = None
    prompt: str = pydantic.Field(min_length=1)
    deps: Any = None
    busy: str | None = pydantic.Field(default=None, pattern='^(reject|enqueue|interrupt)$')


class DecisionRequest(_Body):
    """`POST /v1/runs/{run}/approvals/{call}`: `{"decision", "fingerprint", "args"?, "reason"?}`."""

    decision: str = pydantic.Field(pattern='^(approve|deny)$')
    fingerprint: str = pydantic.Field(pattern='^[0-9a-f]{64}$')
    args: dict[str, Any] | None = None
    reason: str | None = pydantic.Field(default=None, max_length=4000)


_EXPECTED = {
    'decision': 'expected "approve" or "deny"',
    'busy': 'expected "reject", "enqueue" or "interrupt"',
    'fingerprint': "expected the pending call's fingerprint, 64 lowercase hex characters (GET /v1/runs/{run_id}/approvals)",
}
"""What a field that must match a pattern takes, said instead of pydantic's `String should match pattern '...'`."""


def _shape_error(exc: pydantic.ValidationError, what: str) -> BadRequestError:
    """DC042 for a body of the wrong shape: `{what} body: field `{field}`: {reason}` (the first error), or `{what}
    body: {reason}` when the body itself is wrong (not an object)."""
    first = exc.errors()[0]
    where = '.'.join(map(str, first['loc']))
    reason = one_line(first['msg'])
    if first['type'] == 'string_pattern_mismatch' and where in _EXPECTED:
        reason = _EXPECTED[where]
    if not where:  # the body itself: a list, a string, a number (pydantic says "instance of TurnRequest")
        return BadRequestError(f'{what} body: expected a JSON object, not {type(first.get("input")).__name__}',
                               field='(the body)')
    return BadRequestError(f'{what} body: field `{printable(where)}`: {reason}', field=where)


def _error_response(error: ServeError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def _coded(status: int, code: str, message: str, **detail: Any) -> JSONResponse:
    return JSONResponse({'error': {'code': code, 'status': status, 'message': lead_with_code(code, message), **detail}},
                        status_code=status)


_SSE_HEADERS = [(b'content-type', b'text/event-stream; charset=utf-8'), (b'cache-control', b'no-store'),
                (b'x-accel-buffering', b'no')]


class _EventStream(Response):
    """`GET /v1/runs/{run}/events`: the run's events as Server-Sent Events (`id:` offset, `event:` kind, `data:` the
    `RunEvent` JSON), the events of each read of the store (or each commit handed over) in one write, until the run's
    last event; a stream that was never published ends with an `error` event (DC044).

    A plain ASGI response rather than Starlette's `StreamingResponse`: no anyio task group and no generator between
    the store's rows and the writes, and the client's disconnect is watched by one task that cancels the stream (the
    subscription is dropped at once, as `StreamingResponse`'s listener does on ASGI 2.3 servers, e.g. uvicorn)."""

    def __init__(self, run_id: str, rows: AsyncIterator[list[StoredEvent]],
                 keepalive: float = DEFAULT_KEEPALIVE_SECONDS):
        self.run_id, self.rows, self.keepalive = run_id, rows, keepalive
        self.status_code, self.background = 200, None
        self.raw_headers = list(_SSE_HEADERS)
        self.writes = 0  # the stream's writes so far: the keepalive timer comments when it saw none since its last look
        # The reconnect delay EventSource uses after a drop (its default is the browser's, ~3-5 s), sent with the
        # stream's first write, events or keepalive comment, whichever comes first: no write of its own (a run waiting
        # for a worker or a queue sends no event for a while, and used to get its first `retry:` only then).
        self.prefix = SSE_RETRY

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {'done': False, 'gone': False}

        async def listen() -> None:  # the client left: stop streaming (and drop the subscription) now
            while (await receive())['type'] != 'http.disconnect':
                pass
            if not state['done']:
                state['gone'] = True
                task.cancel()

        loop = asyncio.get_running_loop()
        listener = loop.create_task(listen())
        timer: list[asyncio.TimerHandle] = []
        comments: set[asyncio.Task[None]] = set()  # held until done (the loop keeps only weak references to tasks)

        async def comment() -> None:
            if not state['done']:
                # the response may end (or the client leave) while this write waits for the socket to drain: uvicorn
                # then refuses it, and there is nothing left to keep alive
                body, self.prefix = (self.prefix + ': keepalive\n\n').encode(), ''
                with contextlib.suppress(RuntimeError, OSError):
                    await send({'type': 'http.response.body', 'body': body, 'more_body': True})

        def look(seen: int) -> None:  # every `keepalive` seconds: a comment when the stream wrote nothing meanwhile
            if state['done']:
                return
            if self.writes == seen:
                self.writes += 1
                comments.add(task_ := loop.create_task(comment()))
                task_.add_done_callback(comments.discard)
            timer[:] = [loop.call_later(self.keepalive, look, self.writes)]

        try:
            await send({'type': 'http.response.start', 'status': 200, 'headers': self.raw_headers})
            if self.keepalive > 0:
                timer.append(loop.call_later(self.keepalive, look, 0))
            ended = await self._stream(send)
            state['done'] = True
            if not ended:
                await send({'type': 'http.response.body', 'body': b'', 'more_body': False})
        except asyncio.CancelledError:
            if not state['gone'] or task.uncancel() > 0:  # not (only) the client's leaving: the server stops
                raise
        finally:
            state['done'] = True
            listener.cancel()
            for handle in timer:
                handle.cancel()
            close = getattr(self.rows, 'aclose', None)  # `watch_rows`'s generator: its subscription dropped now
            if close is not None:
                await close()

    async def _stream(self, send: Send) -> bool:
        """Send the events; whether the response was ended with them (the run's last event, or the error event, in
        the response's last write: the chunk and the end of the body in one write, one write less a turn)."""
        run_id = self.run_id
        try:
            async for batch in self.rows:
                text = self.prefix + ''.join([f'id: {event.offset}\nevent: {event.kind}\ndata: '
                                              f'{event_json(run_id, event)}\n\n' for event in batch])
                self.prefix = ''
                self.writes += 1
                last = batch[-1].kind in TERMINAL_KINDS  # `watch_rows` ends with it: nothing follows
                await send({'type': 'http.response.body', 'body': text.encode(), 'more_body': not last})
                if last:
                    return True
        except StreamNotFoundError as exc:
            text = self.prefix + f'event: error\ndata: {json.dumps({"code": exc.code, "message": str(exc)})}\n\n'
            await send({'type': 'http.response.body', 'body': text.encode(), 'more_body': False})
            return True
        if self.prefix:
            await send({'type': 'http.response.body', 'body': self.prefix.encode(), 'more_body': True})
        return False


def failure_data(error: BaseException) -> dict[str, Any]:
    """The `run_failed` data of a turn that failed in the serve process before its engine ran it: `{'error', 'code'?}`.
    An error with a DC code (a system database no worker has created: DC040; a busy conversation: DC050) is its own
    one line, led by the code and naming the fix; any other is `Type: message` (what failed is then part of what to
    know)."""
    from ..turn import coded_failure_data

    code = getattr(error, 'code', None)
    return coded_failure_data(error) or {'error': f'{type(error).__name__}: {one_line(str(error))}',
                                         **({'code': code} if code else {})}


class _Refused(Exception):
    """A refusal answered with its own coded response (a decision's 409 / 422)."""

    def __init__(self, response: Response):
        super().__init__(response.status_code)
        self.response = response


class ServeApp:
    """The route handlers of one app (`create_app`)."""

    def __init__(self, agents: Mapping[str, DurableAgent[Any, Any]], engine: str, settings: Mapping[str, Any],
                 auth: Auth, deps_factory: DepsFactory | None, max_body_bytes: int,
                 keepalive_seconds: float = DEFAULT_KEEPALIVE_SECONDS):
        self.agents, self.engine, self.auth = dict(agents), engine, auth
        self.settings = {k: v for k, v in settings.items() if v is not None}
        from ..store import resolve_url

        self.store = resolve_url(self.settings.get('store'))
        self.settings['store'] = self.store
        if engine == 'temporal':  # a named server, never the embedded one a bare `runner.run` would start per turn
            from ..engines.temporal._spec import DEFAULT_ADDRESS

            self.settings.setdefault('address', DEFAULT_ADDRESS)
        self.deps_factory, self.max_body_bytes = deps_factory, max_body_bytes
        self.keepalive_seconds = keepalive_seconds
        self.rows = ServeRows(self.store)
        self.tasks: set[asyncio.Task[Any]] = set()
        self.known_runs: dict[str, RunRow] = {}
        self.waiting_notices: dict[str, int] = {}  # run id -> `run_waiting` events this process published for it
        self.notices: set[asyncio.Task[None]] = set()

    # ---- the request's parts ------------------------------------------------------------------------

    async def principal(self, request: Request) -> str:
        principal = await _maybe_await(self.auth(request))
        if not principal:
            raise UnauthenticatedError('missing or wrong credentials: send `Authorization: Bearer TOKEN` (the '
                                       "server's $DURCAP_SERVE_TOKEN)")
        return str(principal)

    async def body(self, request: Request, what: str) -> Any:
        """The request's JSON body, at most `max_body_bytes`, nested at most `MAX_DEPTH` levels."""
        return (await self.json_body(request, what))[0]

    async def json_body(self, request: Request, what: str) -> tuple[Any, bytes]:
        """`(JSON value, raw bytes)` of the request's body (see `body`)."""
        declared = request.headers.get('content-length')
        limit = self.max_body_bytes
        if declared is not None and is_digits(declared) and int(declared) > limit:
            raise RequestTooLargeError.over(what, limit, int(declared))
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError.over(what, limit)
            chunks.append(chunk)
        raw = b''.join(chunks)
        if not raw.strip():
            raise BadRequestError(f'{what}: the body is empty: send a JSON object')
        try:
            return load_json(raw, where=what, limit=limit, max_depth=MAX_DEPTH), raw
        except InputError as exc:
            raise BadRequestError(f'{what}: {exc.reason}') from None

    @staticmethod
    def checked_id(value: str, what: str) -> str:
        if not ID_PATTERN.fullmatch(value):
            raise BadRequestError(f'{what} {printable(value[:80])!r}: expected 1-200 characters of letters, digits and '
                                  '`._:@-`, starting with a letter or digit', field=what)
        return value

    def agent(self, name: str | None) -> DurableAgent[Any, Any]:
        if name is None:
            if len(self.agents) == 1:
                return next(iter(self.agents.values()))
            raise BadRequestError(f'agent: this server serves {len(self.agents)} agents ({", ".join(sorted(self.agents))}):'
                                  ' name one in the body', field='agent')
        agent = self.agents.get(name)
        if agent is None:
            raise NotFoundError(f'no agent {printable(name[:80])!r} here (serving {", ".join(sorted(self.agents))})',
                                field='agent')
        return agent

    async def deps(self, agent: DurableAgent[Any, Any], given: Any, principal: str, request: Request) -> Any:
        from ..turn import deps_from_json

        if given is None:
            if self.deps_factory is None:
                return None
            return await _maybe_await(self.deps_factory(principal, request))
        if agent.deps_type is type(None):
            raise BadRequestError(f'deps: agent {agent.name!r} takes no deps: leave `deps` out', field='deps')
        try:
            return deps_from_json(agent, given)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = '.'.join(['deps', *map(str, first['loc'])])
            raise BadRequestError(f'{where}: {one_line(first["msg"])} (agent {agent.name!r} takes '
                                  f'{getattr(agent.deps_type, "__name__", agent.deps_type)})', field=where) from None

    async def own_run(self, run_id: str, principal: str) -> RunRow:
        row = self.known_runs.get(run_id)  # a turn this process runs: its row as recorded, not read again
        if row is None:
            row = await self.rows.call(self.rows.run_sync, run_id)
        if row is None or row.principal != principal:
            raise NotFoundError(f'no run {printable(run_id[:120])!r}', field='run_id')
        return row

    # ---- turns ------------------------------------------------------------------------------------

    async def start_turn(self, principal: str, conversation_id: str, agent: DurableAgent[Any, Any], prompt: str,
                         deps: Any, key: str | None, digest_of: Any, busy: str | None = None,
                         key_name: str | None = None) -> tuple[RunRow, bool]:
        """Record and start one turn (or find the run an earlier request with `key` started); with the `reject`
        strategy, a conversation another run's turn holds is refused (DC050) before anything is recorded. `key_name`:
        how a DC045 refusal names `key` (a protocol request's own id), default the `Idempotency-Key` header."""
        strategy = busy or agent.busy
        digest = hashlib.sha256(json.dumps(digest_of, sort_keys=True, default=str).encode()).hexdigest()
        run_id = f'local-{uuid.uuid4().hex}' if self.engine == 'local' else f'{agent.name}-{uuid.uuid4()}'
        record = {'principal': principal, 'key': key, 'digest': digest, 'conversation_id': conversation_id,
                  'agent': agent.name, 'engine': self.engine, 'run_id': run_id, 'reject_busy': strategy == 'reject',
                  'key_name': key_name}
        started = None
        if self.engine == 'local':  # the turn runs here: recorded on the loop's thread when that never waits (SQLite),
            with contextlib.suppress(_WouldWait):  # committed relaxed as its own writes are (`start_turn_sync`)
                started = self.rows.start_turn_sync(**record, quick=True)
        if started is None:
            started = await self.rows.call(self.rows.start_turn_sync, **record, flush=self.engine != 'local')
        if started.created:
            task = asyncio.get_running_loop().create_task(self._run(started.run, agent, prompt, deps, strategy,
                                                                    claimed=started.claimed))
            self.tasks.add(task)
            # While its task runs, the run's row is known here (`own_run`: the client's stream request, which
            # follows at once, reads no row); a conversation is never deleted while a turn runs on it.
            self.known_runs[started.run.run_id] = started.run
            task.add_done_callback(lambda done, run_id=started.run.run_id: self._finished(done, run_id))
        return started.run, started.created

    def _finished(self, task: asyncio.Task[Any], run_id: str) -> None:
        self.tasks.discard(task)
        self.known_runs.pop(run_id, None)
        self.waiting_notices.pop(run_id, None)

    async def _run(self, row: RunRow, agent: DurableAgent[Any, Any], prompt: str, deps: Any, busy: str,
                   claimed: bool = False) -> None:
        """Run the turn `start_turn` recorded; `claimed`: that transaction also took the conversation's claim for it,
        so a local run's load does not claim it again (`turn.claimed_by_caller`)."""
        from .. import runner
        from ..turn import claimed_by_caller

        settings = {**self.settings, 'busy': busy}
        if self.engine == 'dbos':
            from ..engines.dbos._spec import WORKER_QUEUE

            settings.setdefault('queue', WORKER_QUEUE)
        elif self.engine == 'temporal':  # started on the task queue `durcap worker temporal` serves, never inline
            from ..engines.temporal._spec import DEFAULT_TASK_QUEUE

            settings.setdefault('task_queue', DEFAULT_TASK_QUEUE)
            settings['inline_worker'] = False
        started: list[str] = []
        loop = asyncio.get_running_loop()

        def notify(line: str) -> None:
            logger.info('%s', line)
            if isinstance(line, WaitingForWorker):  # the application sees it too: a `run_waiting` event
                loop.call_soon_threadsafe(self._publish_waiting, row, line.api)

        try:
            with claimed_by_caller(row.run_id) if claimed and self.engine == 'local' else contextlib.nullcontext():
                await runner.run(agent, prompt, engine=self.engine, deps=deps, conversation_id=row.conversation_id,
                                 run_id=row.run_id, notify=notify, on_start=started.append, **settings)
        except asyncio.CancelledError:
            await self._release_claim(row, started)
            if self.engine == 'local':  # the app stops while its in-process turn runs: the turn is gone, say so
                await self._close_failed(row, RuntimeError('the serve process stopped while the local run ran'))
            raise
        except Exception as error:  # noqa: BLE001 - the run's failure is its stream's last event, and logged
            logger.warning('run %s failed: %s: %s', row.run_id, type(error).__name__, one_line(str(error)))
            await self._release_claim(row, started)
            await self._close_failed(row, error)

    def _publish_waiting(self, row: RunRow, notice: str) -> None:
        """Publish `notice` (the run waits for a worker) in the run's stream as a `run_waiting` event, in a task of
        its own (a notice never holds the run up; the set keeps the task referenced until it is done)."""
        seq = self.waiting_notices[row.run_id] = self.waiting_notices.get(row.run_id, 0) + 1
        task = asyncio.get_running_loop().create_task(self._append_waiting(row, notice, seq))
        self.notices.add(task)
        task.add_done_callback(self.notices.discard)

    async def _append_waiting(self, row: RunRow, notice: str, seq: int) -> None:
        from ..streams._log import EventLog, Item

        try:  # unit `serve`, attempt 0; seq 1, 2, ...: the serve process's `run_failed` is seq 0
            await EventLog(self.store).append(row.run_id, self.engine, [Item('serve', 0, seq, 'run_waiting', {
                'data': {'notice': one_line(notice)}})])
        except Exception:  # the store is down: the run's status says what the engine knows
            logger.exception('run %s: could not publish that it waits for a worker', row.run_id)

    async def _release_claim(self, row: RunRow, started: list[str]) -> None:
        """Give back the turn claim `start_turn` took for `row`'s run when the run ended here without its engine running
        it (a local run is over once `runner.run` returns; a durable one not handed over: no `on_start`). A durable run
        the engine has releases its own claim (its append, its failure), or another turn's load takes it over once
        the engine says the run is gone."""
        if self.engine != 'local' and started:
            return
        try:
            await self.rows.call(self.rows.release_claim_sync, row.conversation_id, row.run_id)
        except Exception:  # the store is down: `durcap history release` frees the conversation
            logger.exception('run %s: could not release its claim on conversation %r', row.run_id, row.conversation_id)

    async def _close_failed(self, row: RunRow, error: BaseException) -> None:
        """End the run's stream with `run_failed` when the run failed before publishing its own (a turn refused at
        its load: DC050), so a subscriber is told instead of waiting."""
        from ..streams._log import EventLog, Item

        log = EventLog(self.store)
        try:
            info = await self.rows.call(log.info_sync, row.run_id)
            if info is not None and info.closed_at is not None:
                return
            await log.append(row.run_id, self.engine, [Item('serve', 0, 0, 'run_failed', {'data': failure_data(error)})],
                             close=True)
        except Exception:  # the store is down: the run's status says what the engine knows
            logger.exception('run %s: could not record its failure in the stream', row.run_id)

    async def post_turn(self, request: Request) -> Response:
        principal = await self.principal(request)
        conversation_id = self.checked_id(request.path_params['conversation_id'], 'conversation_id')
        key = request.headers.get('idempotency-key')
        if key is not None:
            self.checked_id(key, 'Idempotency-Key')
        try:
            body = TurnRequest.model_validate(await self.body(request, 'turn'))
        except pydantic.ValidationError as exc:
            raise _shape_error(exc, 'turn') from None
        agent = self.agent(body.agent)
        try:
            check_busy(body.busy, 'busy', agent)  # DC053: 'interrupt' for an agent whose output is not text
        except InputError as exc:
            raise _Refused(_coded(400, exc.code, str(exc), field='busy')) from None
        deps = await self.deps(agent, body.deps, principal, request)
        row, created = await self.start_turn(principal, conversation_id, agent, body.prompt, deps, key,
                                             [conversation_id, agent.name, body.prompt, body.deps], body.busy)
        root = request.scope.get('root_path', '')
        return JSONResponse({'run_id': row.run_id, 'events_url': f'{root}/v1/runs/{row.run_id}/events',
                             'status_url': f'{root}/v1/runs/{row.run_id}', 'conversation_id': conversation_id,
                             'agent': agent.name, 'engine': self.engine, 'created': created}, status_code=202)

    # ---- runs -------------------------------------------------------------------------------------

    async def events(self, request: Request) -> Response:
        principal = await self.principal(request)
        row = await self.own_run(request.path_params['run_id'], principal)
        header = request.headers.get('last-event-id')
        source = 'Last-Event-ID' if header else '?after'  # the header wins; `?after=N` for clients that set no headers
        raw = header or request.query_params.get('after') or '0'
        if not is_digits(raw) or len(raw) > 18:
            raise BadRequestError(f'{source} {printable(raw[:40])!r}: expected the offset of the last event seen '
                                  '(an integer, 0 or more)', field=source)
        after = int(raw)
        run_id = row.run_id
        # A local run this process runs commits every event here and hands it over: no timed reads (under load, or
        # under a profiler, a 50 ms poll read a turn's stream tens of times for nothing).
        poll = OWN_RUN_POLL_SECONDS if self.engine == 'local' and run_id in self.known_runs else POLL_SECONDS

        return _EventStream(run_id, watch_rows(run_id, engine=row.engine, from_offset=after, store=self.store, poll=poll),
                            self.keepalive_seconds)

    async def run_status(self, request: Request) -> Response:
        principal = await self.principal(request)
        row = await self.own_run(request.path_params['run_id'], principal)
        milestones = await self.rows.call(self.rows.milestones_sync, row.run_id)
        started = any(kind != 'run_waiting' for _offset, kind, _body in milestones)
        status, report, error, waiting, notice = ('running' if started else 'queued'), None, None, False, None
        for _offset, kind, body in milestones:
            data = json.loads(body).get('data') or {}
            notice = data.get('notice') if kind == 'run_waiting' else None  # said until the run moves on
            if kind == 'approval_waiting':
                waiting = True
            elif kind == 'approval_decided':
                waiting = False
            elif kind == 'run_completed':
                status, report = 'completed', data
            elif kind == 'run_failed':
                status, error = 'failed', data.get('error')
        if status == 'running' and waiting:
            status = 'waiting'
        return JSONResponse({'run_id': row.run_id, 'conversation_id': row.conversation_id, 'agent': row.agent,
                             'engine': row.engine, 'created_at': row.created_at, 'status': status,
                             'events': milestones[-1][0] if milestones else 0, 'report': report, 'error': error,
                             'notice': notice if status in ('queued', 'running') else None})

    async def conversation(self, request: Request) -> Response:
        from ..reading import read_conversation, summarize

        principal = await self.principal(request)
        conversation_id = self.checked_id(request.path_params['conversation_id'], 'conversation_id')
        owner = await self.rows.call(self.rows.owner_sync, conversation_id)
        if owner != principal:
            raise NotFoundError(f'no conversation {conversation_id!r}', field='conversation_id')
        try:
            stored, writes = await read_conversation(self.store, conversation_id)
        except ConversationNotFoundError:
            raise NotFoundError(f'conversation {conversation_id!r} has no stored turn yet',
                                field='conversation_id') from None
        return JSONResponse(summarize(stored, writes))

    # ---- approvals --------------------------------------------------------------------------------

    async def _pending(self, row: RunRow) -> list[Any]:
        from .. import runner

        if row.engine == 'local':
            return []  # a local run never waits: its calls needing approval are denied at once
        return await runner.approvals(row.run_id, engine=row.engine, **self._engine_settings())

    def _engine_settings(self) -> dict[str, Any]:
        return {k: v for k, v in self.settings.items() if k not in ('queue', 'task_queue', 'inline_worker', 'busy')}

    async def approvals(self, request: Request) -> Response:
        principal = await self.principal(request)
        row = await self.own_run(request.path_params['run_id'], principal)
        try:
            pending = await self._pending(row)
        except ApprovalError as exc:
            if exc.kind != 'unknown-run':
                raise
            # Recorded here (its 202 was sent) but not on the engine yet: the turn is handed over after the 202 (a
            # fresh-clone CI saw a 500 for this on a loaded Temporal server). Nothing waits yet.
            pending = []
        return JSONResponse({'run_id': row.run_id, 'pending': [call.to_json() for call in pending]})

    async def decide(self, request: Request) -> Response:
        principal = await self.principal(request)
        row = await self.own_run(request.path_params['run_id'], principal)
        call_id = request.path_params['call_id']
        try:
            body = DecisionRequest.model_validate(await self.body(request, 'decision'))
        except pydantic.ValidationError as exc:
            raise _shape_error(exc, 'decision') from None
        approve = body.decision == 'approve'
        if body.args is not None and not approve:
            raise BadRequestError('decision: `args` (edited arguments) only go with "approve"', field='args')
        decision = await self.apply_decision(row, principal, call_id, approve=approve, reason=body.reason,
                                             args=body.args, fingerprint=body.fingerprint)
        return JSONResponse({'run_id': row.run_id, 'decision': decision.to_json()})

    async def apply_decision(self, row: RunRow, principal: str, call_id: str, *, approve: bool, reason: str | None,
                             args: dict[str, Any] | None, fingerprint: str | None) -> Any:
        """Deliver a decision on `call_id` of `row`'s run (`fingerprint`: the one the person reviewed; `None`: the pending
        call's, for the protocols, whose approvals name the call only).

        Returns:
            The `Decision` delivered.

        Raises:
            _Refused: 409 (DC054 already decided; other arguments), 422 (edited arguments outside the tool's schema), 503
                (DC052: no worker took the decision; nothing ran, decide again).
            NotFoundError: DC044, no such pending call.
        """
        from .. import runner

        pending = {call.call_id: call for call in await self._pending(row)}
        if call_id not in pending:
            earlier = await self._decided(row, call_id)
            if earlier is not None:  # as the engines' own refusal (`approvals.already_decided`): DC054
                refused = already_decided(row.run_id, printable(call_id[:120]), earlier)
                raise _Refused(_coded(409, refused.code, str(refused), kind=refused.kind))
            raise NotFoundError(f'run {row.run_id!r} has no pending call {printable(call_id[:120])!r} (pending: '
                                f'{", ".join(pending) or "none"})', field='call_id')
        call = pending[call_id]
        # Checked here first for the API's wording (the decision's fields, its endpoints); `runner.decide` checks again.
        if fingerprint is not None and fingerprint != call.fingerprint:
            stale = stale_fingerprint(call, fingerprint, row.run_id, review=f'GET /v1/runs/{row.run_id}/approvals')
            raise _Refused(_coded(409, stale.code, str(stale), kind=stale.kind, field='fingerprint'))
        if args is not None:
            try:
                check_args(call, args, row.run_id, edited='the decision\'s `args` field')
            except ApprovalArgsError as exc:
                raise _Refused(_coded(422, exc.code, str(exc), kind=exc.kind, field='args')) from None
        # One decision per call across every serve process of the store: two sent at the same moment (a double
        # click, two reviewers) cannot both be told yes; the engines' own check reads, then sends. The claim's time is
        # the decision's (`at=` below): the run's audit, the API's answers and every DC054 name one value.
        mine = Decision(call_id, fingerprint or call.fingerprint, approve, by=f'serve:{principal}')
        held = await self.rows.call(self.rows.claim_decision_sync, row.run_id, call_id, json.dumps(mine.to_json()))
        if held is not None:
            refused = already_decided(row.run_id, printable(call_id[:120]), Decision.from_json(json.loads(held)),
                                      received=False)
            raise _Refused(_coded(409, refused.code, str(refused), kind=refused.kind))
        delivered = False
        try:
            result = await runner.decide(row.run_id, call_id, approve=approve, reason=reason, override_args=args,
                                         by=f'serve:{principal}', fingerprint_=fingerprint or pending[call_id].fingerprint,
                                         engine=row.engine, at=mine.at, **self._engine_settings())
            delivered = True
            return result
        except ApprovalArgsError as exc:
            raise _Refused(_coded(422, exc.code, str(exc), kind=exc.kind, field='args')) from None
        except AlreadyDecidedError as exc:  # decided outside the API (`durcap approve`): it stays decided
            delivered = True
            raise _Refused(_coded(409, exc.code, str(exc), kind=exc.kind)) from None
        except DecisionNotDeliveredError as exc:  # no worker took it: nothing ran, the call is still pending
            raise _Refused(_coded(503, exc.code, str(exc), kind=exc.kind)) from None
        except ApprovalError as exc:
            if exc.kind == 'stale-fingerprint':
                raise _Refused(_coded(409, exc.code, str(exc), kind=exc.kind, field='fingerprint')) from None
            raise NotFoundError(str(exc), kind=exc.kind) from None
        finally:
            if not delivered:  # refused or failed: nothing was sent, the call is still pending for the next decision
                await self.rows.call(self.rows.release_decision_sync, row.run_id, call_id)

    async def _decided(self, row: RunRow, call_id: str) -> Decision | None:
        """The decision on `call_id` the run received (its `approval_decided` event), else the one delivered through
        the API (its decision slot: the run may have taken it and not yet published the event), else `None`."""
        for _offset, kind, body in await self.rows.call(self.rows.milestones_sync, row.run_id):
            if kind != 'approval_decided':
                continue
            for decision in (json.loads(body).get('data') or {}).get('decisions') or []:
                if decision.get('call_id') == call_id:
                    return Decision.from_json(decision)
        held = await self.rows.call(self.rows.decision_slot_sync, row.run_id, call_id)
        return None if held is None else Decision.from_json(json.loads(held))


def _handler(app: ServeApp, method: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """`method` with every refusal as a coded JSON body and any other failure as a 500 without its traceback."""

    async def handle(request: Request) -> Response:
        try:
            return await method(request)
        except ServeError as error:
            return _error_response(error)
        except _Refused as refused:
            return refused.response
        except ConversationBusyError as error:
            return _coded(409, error.code, str(error), holder=error.holder)
        except StoreError as error:
            logger.warning('%s %s: %s', request.method, request.url.path, error)
            return _coded(503, error.code, f'the conversation store failed: {one_line(str(error))}')
        except Exception:
            logger.exception('%s %s failed', request.method, request.url.path)
            return _coded(500, 'internal', 'the server failed on this request (its log has the details)')

    return handle


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return _coded(404, NotFoundError.code, f'no route {printable(request.url.path[:200])} (the API is under /v1)')
    if exc.status_code == 405:  # a refused request as any other (DC042), with the methods the path takes
        allowed = ', '.join(sorted(m.strip() for m in (exc.headers or {}).get('Allow', '').split(',') if m.strip()))
        response = _coded(405, BadRequestError.code, f'{request.method} is not allowed on '
                          f'{printable(request.url.path[:200])}' + (f': it takes {allowed}' if allowed else ''))
        if allowed:
            response.headers['Allow'] = allowed
        return response
    return _coded(exc.status_code, 'http', str(exc.detail))
