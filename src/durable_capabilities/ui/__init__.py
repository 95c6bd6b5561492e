"""`durcap ui`: a small server-rendered web app over the functions behind `durcap runs`, `durcap history` and
`durcap approvals` (`reading.py`, `runner.approvals`, `runner.decide`).

Pages: `/` runs across the configured engines (filter by engine, status, capability), `/runs/{engine}/{run id}`
one run (its durable units as a timeline, its conversation), `/conversations/{id}` one stored conversation,
`/approvals` the calls waiting for a person, each with an approve / deny form posting to `/decide`, `/budgets` what
each budget key spent of its limits (`durcap budgets list`).

Safety (see docs/ui.md): every value is rendered through jinja2 with autoescape on, and no page carries
JavaScript; a decision needs the server's token (typed into the form) and a CSRF token (double-submit cookie
`durcap_csrf`, `SameSite=Strict`, echoed in a hidden field); a refused decision is answered 403 and changes
nothing. The decider is recorded as `ui:<name>` in the run's approval audit.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from jinja2 import Environment, FileSystemLoader
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from .. import telemetry
from .._limits import printable
from ..approvals import ApprovalError, PendingCall, default_user
from ..engines import RUN_STATUSES, RunNotFoundError
from ..forgetting import conversation_bytes
from ..reading import durable_adapters, find_run, list_runs, problem_line, read_conversation, summarize
from ..settings import Settings
from ..store import StoreError

__all__ = ['CSRF_COOKIE', 'create_app', 'new_token']

CSRF_COOKIE = 'durcap_csrf'
"""The double-submit cookie: a decision's form field `csrf` must equal it."""

TEMPLATES = Path(__file__).with_name('templates')


def new_token() -> str:
    """A fresh decision token (24 random bytes, URL-safe base64): what `durcap ui` prints when `DURCAP_UI_TOKEN`
    is not set."""
    return secrets.token_urlsafe(24)


def create_app(settings: Settings, token: str, *, engines: Sequence[str] | None = None, limit: int = 50) -> Starlette:
    """The `durcap ui` application.

    Args:
        settings: Where the engines and the conversation store are (the CLI's `settings.Settings`).
        token: The secret a decision must carry (form field `token`); non-empty.
        engines: Engine names to read (each installed), default every installed durable engine.
        limit: Runs listed per engine, newest first (a page may ask for fewer or more with `?limit=`).

    Raises:
        ValueError: `token` is empty.
        reading.EngineNotInstalled: an engine of `engines` is not installed.
    """
    if not token:
        raise ValueError('the decision token must not be empty')
    names = [a.name for name in engines for a in durable_adapters(name)] if engines else [
        a.name for a in durable_adapters()]
    env = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=True, trim_blocks=True, lstrip_blocks=True)
    env.filters['tojson_text'] = _json_text
    ui = _UI(settings, token, names, limit, env)
    app = Starlette(routes=[
        Route('/', ui.runs), Route('/runs/{engine}/{run_id:path}', ui.run), Route('/approvals', ui.approvals),
        Route('/conversations/{conversation_id:path}', ui.conversation), Route('/decide', ui.decide, methods=['POST']),
        Route('/budgets', ui.budgets),
    ], exception_handlers={HTTPException: ui.http_error})
    app.state.engines = names  # the engines the pages read (`durcap ui` names only these at start)
    return app


class _UI:
    """The route handlers, sharing the settings, the token and the template environment."""

    def __init__(self, settings: Settings, token: str, engines: list[str], limit: int, env: Environment):
        self.settings, self.token, self.engines, self.limit, self.env = settings, token, engines, limit, env

    def page(self, request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
        """Render `template`; every page carries the CSRF cookie (a new one when the request had none)."""
        csrf = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(24)
        html = self.env.get_template(template).render(csrf=csrf, engines=self.engines, settings=self.settings,
                                                       **context)
        response = HTMLResponse(html, status_code=status)
        response.set_cookie(CSRF_COOKIE, csrf, httponly=True, samesite='strict', path='/')
        # frame-ancestors / X-Frame-Options: no other site frames the page's Approve and Deny buttons (clickjacking)
        response.headers['Content-Security-Policy'] = ("default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                                                       "frame-ancestors 'none'")
        response.headers['X-Frame-Options'] = 'DENY'
        response.headers['X-Content-Type-Options'] = 'nosniff'
        return response

    async def runs(self, request: Request) -> HTMLResponse:
        """`/`: runs, filterable by `engine`, `status`, `capability` (query parameters; an empty one is no filter) and
        `limit` (runs per engine). 400, naming each bad parameter, its value and the allowed values, when `engine`
        is not a served engine, `status` not one of `RUN_STATUSES`, or `limit` not a whole number in 1..`MAX_LIMIT`."""
        engine, status, capability = (request.query_params.get(k) or None for k in ('engine', 'status', 'capability'))
        raw_limit = request.query_params.get('limit') or ''
        limit = _limit(raw_limit) if raw_limit else self.limit
        bad = [_bad_parameter(name, value, allowed) for name, value, allowed in (
            ('engine', engine, None if engine is None or engine in self.engines else
             f'{", ".join(self.engines)} (the engines served here), or empty for all'),
            ('status', status, None if status is None or status in RUN_STATUSES else
             f'{", ".join(RUN_STATUSES)}, or empty for all'),
            ('limit', raw_limit, None if limit is not None else f'a whole number from 1 to {MAX_LIMIT}'),
        ) if allowed is not None]
        if bad:
            return self.page(request, 'error.html', 400, title='Bad query parameter', message=bad[0], details=bad[1:])
        assert limit is not None
        wanted = [engine] if engine is not None else self.engines
        listing = await list_runs(self.settings, engines=wanted, status=status, limit=limit)
        capabilities = sorted({c for run in listing.runs for c in run.capabilities})
        runs = sorted((r for r in listing.runs if capability is None or capability in r.capabilities),
                      key=lambda r: r.started_at.timestamp() if r.started_at else 0.0, reverse=True)  # newest first
        return self.page(request, 'runs.html', runs=runs, problems=listing.problems, statuses=RUN_STATUSES,
                         capabilities=capabilities, chosen={'engine': engine, 'status': status, 'capability': capability},
                         limit=limit)

    async def run(self, request: Request) -> HTMLResponse:
        """`/runs/{engine}/{run_id}`: one run, its durable units, its pending calls and its conversation."""
        engine, run_id = request.path_params['engine'], request.path_params['run_id']
        if engine not in self.engines:
            return self.page(request, 'error.html', 404, title='Unknown engine', message=f'engine {engine!r} is not served here')
        try:
            _, info = await find_run(run_id, self.settings, engine)
        except RunNotFoundError as exc:
            return self.page(request, 'error.html', 404, title='No such run', message=str(exc.args[0]) if exc.args else 'no such run',
                             details=exc.args[1] if len(exc.args) > 1 else [])
        pending, problems = await self.pending(engine, run_id)
        conversation, conversation_error = await self.read(info.conversation_id)
        link = telemetry.trace_link(run_id)
        return self.page(request, 'run.html', info=info, pending=pending, problems=problems, conversation=conversation,
                         conversation_error=conversation_error, trace_id=telemetry.trace_id(run_id),
                         trace_link=link if link and link.startswith(('http://', 'https://')) else None)

    async def conversation(self, request: Request) -> HTMLResponse:
        """`/conversations/{id}`: one stored conversation (messages, loaded capabilities, usage, approval audit)."""
        conversation, error = await self.read(request.path_params['conversation_id'])
        if conversation is None:
            return self.page(request, 'error.html', 404, title='No such conversation',
                             message=error or 'no conversation id in the address: /conversations/ID')
        return self.page(request, 'conversation.html', conversation=conversation)

    async def http_error(self, request: Request, exc: Exception) -> HTMLResponse:
        """Starlette's own errors (no route for the path, a method the route does not take) as an error page with
        one plain line, instead of Starlette's bare text."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status == 404:
            message = (f'no page at {printable(request.url.path)[:200]}: the pages are /, /runs/ENGINE/RUN_ID, '
                       '/conversations/ID, /approvals and /budgets')
        elif status == 405:
            message = f'{printable(request.url.path)[:200]} does not take {request.method} requests'
        else:
            message = str(getattr(exc, 'detail', '')) or 'the request failed'
        return self.page(request, 'error.html', status, title=HTTPStatus(status).phrase, message=message)

    async def budgets(self, request: Request) -> HTMLResponse:
        """`/budgets`: every budget key in the conversation store, what it spent of each limit (plus raises), its
        requests and requests in flight (what `durcap budgets list` prints); a store that cannot be read: one line."""
        from ..store import SQLConversationStore

        try:
            async with SQLConversationStore(self.settings.store, create=False) as store:
                records = await store.budgets()
        except StoreError as exc:
            return self.page(request, 'budgets.html', records=[], problem=str(exc).splitlines()[0])
        rows = [{'key': r.key, 'limits': {name: (r.spent.get(name, 0), r.limit(name), r.raised.get(name))
                                          for name in ('total_tokens', 'input_tokens', 'output_tokens', 'cost')},
                 'requests': int(r.spent.get('requests', 0)), 'in_flight': r.in_flight, 'updated_at': r.updated_at}
                for r in records]
        return self.page(request, 'budgets.html', records=rows, problem=None)

    async def approvals(self, request: Request) -> HTMLResponse:
        """`/approvals`: every pending call of the served engines, each with its decision form."""
        pending, problems = await self.pending(None, None)
        done = {k: request.query_params.get(k) for k in ('verb', 'call', 'run', 'by')}
        return self.page(request, 'approvals.html', pending=pending, problems=problems, done=done if done['verb'] else None)

    async def decide(self, request: Request) -> Response:
        """`POST /decide`: approve (optionally with edited arguments) or deny one call, bound to its fingerprint.

        403 (nothing delivered) without the right token or CSRF token; 400 on a malformed form; 409 when the engine
        refuses (unknown run or call, stale fingerprint); 303 to `/approvals` after a delivered decision.
        """
        form = await request.form()
        field = {k: str(form.get(k) or '') for k in ('engine', 'run_id', 'call_id', 'fingerprint', 'decision', 'args',
                                                      'reason', 'by', 'token', 'csrf')}
        cookie = request.cookies.get(CSRF_COOKIE) or ''
        if not (cookie and secrets.compare_digest(field['csrf'].encode(), cookie.encode())):
            return self.page(request, 'error.html', 403, title='Refused', message='the form\'s CSRF token does not match '
                             'its cookie: reload the page and decide again')
        if not secrets.compare_digest(field['token'].encode(), self.token.encode()):
            return self.page(request, 'error.html', 403, title='Refused', message='wrong or missing decision token (the '
                             'one `durcap ui` printed at start, or $DURCAP_UI_TOKEN)')
        if field['engine'] not in self.engines or field['decision'] not in ('approve', 'deny'):
            return self.page(request, 'error.html', 400, title='Bad form', message='unknown engine or decision')
        approve = field['decision'] == 'approve'
        override, problem = await self.override(field, approve)
        if problem:
            return self.page(request, 'error.html', 400, title='Bad form', message=problem)
        if not approve and not field['reason'].strip():
            return self.page(request, 'error.html', 400, title='Bad form', message='a denial needs a reason (the model '
                             'receives it as the call\'s result)')
        from .. import runner

        by = f'ui:{field["by"].strip() or default_user()}'
        try:
            await runner.decide(field['run_id'], field['call_id'], approve=approve, reason=field['reason'].strip() or None,
                                override_args=override, by=by, fingerprint_=field['fingerprint'], engine=field['engine'],
                                **self.settings.engine())
        except ApprovalError as exc:
            return self.page(request, 'error.html', 409, title=f'Not delivered ({exc.kind})', message=str(exc))
        query = urlencode({'verb': 'approved' if approve else 'denied', 'call': field['call_id'], 'run': field['run_id'],
                           'by': by})
        return RedirectResponse(f'/approvals?{query}', status_code=303)

    async def override(self, field: dict[str, str], approve: bool) -> tuple[dict[str, Any] | None, str | None]:
        """`(override_args, problem)`: the form's arguments when they differ from the pending call's."""
        if not approve or not field['args'].strip():
            return None, None
        try:
            args = json.loads(field['args'])
        except json.JSONDecodeError as exc:
            return None, f'the arguments are not JSON: {exc}'
        if not isinstance(args, dict):
            return None, 'the arguments must be a JSON object'
        pending, _ = await self.pending(field['engine'], field['run_id'])
        original = next((c.args for c in pending if c.call_id == field['call_id']), None)
        return (None if args == original else args), None

    async def pending(self, engine: str | None, run_id: str | None) -> tuple[list[PendingCall], list[str]]:
        """Pending calls of `engine` (default: every served engine), only `run_id`'s when given; and one line per
        engine that could not be read."""
        calls: list[PendingCall] = []
        problems: list[str] = []
        for adapter in durable_adapters(engine) if engine else [a for n in self.engines for a in durable_adapters(n)]:
            try:
                calls += [c if c.engine else PendingCall.from_json({**c.to_json(), 'engine': adapter.name})
                          for c in await adapter.pending_approvals(self.settings.engine(), run_id)]
            except ApprovalError:
                pass  # the run is not there (or no longer waits): nothing pending
            except Exception as exc:  # noqa: BLE001 - one engine down must not hide the others' calls
                problems.append(problem_line(adapter, exc, 'approvals'))
        return calls, problems

    async def read(self, conversation_id: str | None) -> tuple[dict[str, Any] | None, str | None]:
        """`(view, None)` of a stored conversation, or `(None, why not)`."""
        if not conversation_id:
            return None, None
        try:
            stored, writes = await read_conversation(self.settings.store, conversation_id)
        except StoreError as exc:
            return None, str(exc).splitlines()[0]
        summary = summarize(stored, writes)
        summary['rows'] = message_rows(summary['messages'], stored.message_count - len(summary['messages']) + 1)
        summary['bytes'] = await conversation_bytes(self.settings.store, conversation_id)
        return summary, None


def _json_text(value: Any, indent: int | None = None) -> str:
    """JSON as plain text (escaped by autoescape like any other value; jinja's `tojson` writes `\\u003c` instead)."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False, indent=indent, default=str)


MAX_LIMIT = 500
"""The most runs per engine a page lists (`?limit=`)."""


def _limit(value: str) -> int | None:
    """`?limit=` as runs per engine, `None` when it is not a whole number from 1 to `MAX_LIMIT`."""
    try:
        limit = int(value)
    except ValueError:
        return None
    return limit if 1 <= limit <= MAX_LIMIT else None


def _bad_parameter(name: str, value: Any, allowed: str) -> str:
    """One line for a bad query parameter: its name, its value (escaped) and what it takes."""
    return f'query parameter {name!r} is {printable(repr(value))[:200]}: it takes {allowed}'


def message_rows(messages: list[dict[str, Any]], first: int) -> list[dict[str, Any]]:
    """One row per message part of pydantic-ai message JSON: `{position, kind, when, part, tool, text}` (text: the
    part's content, a tool call's arguments as JSON, a tool return's result), for the conversation view."""
    rows = []
    for position, message in enumerate(messages, start=first):
        for index, part in enumerate(message.get('parts') or []):
            kind = part.get('part_kind', '')
            if kind == 'tool-call':
                args = part.get('args')
                text = args if isinstance(args, str) else json.dumps(args, sort_keys=True, ensure_ascii=False)
            elif part.get('content') is None and part.get('tools_added'):
                text = '+' + ', +'.join(map(str, part['tools_added']))  # the tools a capability load made available
            else:
                content = part.get('content')
                text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False, default=str)
            rows.append({'position': position if index == 0 else None, 'kind': message.get('kind', ''), 'part': kind,
                         'tool': part.get('tool_name'), 'text': text if text != 'null' else '',
                         'when': part.get('timestamp') or message.get('timestamp')})
    return rows
