"""`durcap history`: look at a stored conversation.

Registered by `cli/engine_commands.py` as `app.add_typer(history_app, name='history')`, beside `history export`.

Exit codes: 0 shown; 2 unusable input (bad store URL, no store there, unknown conversation, a row that
does not decode, a schema newer than this code), with one line on stderr and no traceback.

`durcap history delete ID`: a user's right to be forgotten (`forgetting.delete_conversation`).
`durcap history fork ID --at-turn N --to NEW_ID`: a new conversation from the first N turns (`forks.fork_at_turn`).
`durcap history evals ID... --out FILE`: the recorded turns as a pydantic-evals dataset (`evals.export_evals`).
"""

from __future__ import annotations

import asyncio
import json
import sys
from enum import Enum
from typing import Annotated, Any, NoReturn

import typer
from pydantic_ai.messages import ModelMessage

from .._limits import INPUT_CODE, printable
from ..engines._specs import TEMPORAL
from ..errors import DurcapError, one_code
from ..reading import approval_audit, read_conversation, summarize
from ..store import DEFAULT_URL, StoreError, resolve_url
from ._options import StoreOption, checked, connection_options, connection_settings

_TEMPORAL_ADDRESS = next(s for s in TEMPORAL.settings if s.field == 'address')
"""`durcap history repair`'s `--address`: the Temporal spec's connection setting (flag, environment, default)."""

__all__ = ['approval_audit', 'history_app', 'summarize']

history_app = typer.Typer(
    name='history',
    help='Look at conversations in the conversation store.',
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

_TEXT_WIDTH = 100


class HistoryFormat(str, Enum):
    text = 'text'
    json = 'json'


@history_app.callback()
def _history() -> None:
    """Look at conversations in the conversation store."""


@history_app.command('show')
def show(
    conversation_id: Annotated[str, typer.Argument(metavar='ID', help='The conversation id.')],
    store: Annotated[
        str,
        typer.Option(
            '--store', envvar='DURCAP_STORE', help=f'Store URL: sqlite:///path.db or postgresql://... (default {DEFAULT_URL}).'
        ),
    ] = DEFAULT_URL,
    format: Annotated[HistoryFormat, typer.Option('--format', help='text or json.')] = HistoryFormat.text,
) -> None:
    """Show a conversation: its messages, the capabilities its history loaded, the tools called, the usage and the writes."""
    try:
        stored, writes = asyncio.run(read_conversation(store, conversation_id))
    except StoreError as exc:
        _unusable(str(exc))
    summary = summarize(stored, writes)
    if format is HistoryFormat.json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        typer.echo(_text(summary, stored.messages))


def _text(summary: dict[str, Any], messages: list[ModelMessage]) -> str:
    usage = ', '.join(f'{k.replace("_", " ")} {v}' for k, v in summary['usage'].items())
    tools = ', '.join(f'{name} x{count}' for name, count in summary['tools_called'].items()) or 'none'
    lines = [
        f'conversation {summary["conversation_id"]}: revision {summary["revision"]}, {summary["message_count"]} messages, '
        f'updated {summary["updated_at"]}' + (f', scope {summary["scope"]}' if summary['scope'] else ''),
        f'loaded capabilities: {", ".join(summary["loaded_capabilities"]) or "none"}',
        f'tools called: {tools}',
        f'usage (summed over responses): {usage}',
        'writes:',
    ]
    for w in summary['writes']:
        span = (
            f'messages {w["first_position"]}-{w["first_position"] + w["messages"] - 1}' if w['messages'] else 'no messages'
        )
        key = f' append_id {w["append_id"]}' if w['append_id'] else ''
        lines.append(f'  r{w["revision"]} {w["operation"]}{key}: {span} at {w["written_at"]}')
    if summary['approvals']:
        lines.append('approvals:')
        for a in summary['approvals']:
            who = f' by {a["by"]}' if a['by'] else ''
            why = f' ({a["reason"]})' if a['reason'] else ''
            lines.append(f'  {a["tool"]}({json.dumps(a["args"], sort_keys=True)}) call {a["call_id"]} fingerprint '
                         f'{a["fingerprint"][:12]}: requested {a["requested_at"]}, {a["decision"]}{who} at {a["at"]}{why}')
    lines.append('messages:')
    first = summary['message_count'] - len(messages) + 1
    for position, message in enumerate(messages, start=first):
        for index, part in enumerate(message.parts):
            head = f'{position:>5} {message.kind:<8}' if index == 0 else ' ' * 14
            lines.append(f'{head} {_clip(_describe(part))}')
    # Ids, tool names, arguments and contents come from the store: escape control and bidi characters.
    return '\n'.join(printable(line) for line in lines)


def _describe(part: Any) -> str:
    kind = getattr(part, 'part_kind', type(part).__name__)
    tool = getattr(part, 'tool_name', None)
    if kind == 'tool-call':
        return f'tool-call {tool}({json.dumps(part.args_as_dict(), default=str)})'
    if kind == 'tool-return':
        return f'tool-return {tool}: {_flat(part.model_response_str())}'
    content = getattr(part, 'content', None)
    if isinstance(content, str):
        return f'{kind}: {_flat(content)}'
    if kind == 'tool-availability-delta':
        return f'{kind}: +{", +".join(part.tools_added)}'
    return kind


def _flat(text: str) -> str:
    return ' '.join(text.split())


def _clip(text: str) -> str:
    return text if len(text) <= _TEXT_WIDTH else text[: _TEXT_WIDTH - 3] + '...'


def _unusable(message: str) -> NoReturn:
    """Print `durcap: error: <CODE> <message>` (one line, led by one code: `errors.one_code`, `DC040` by default)
    and exit 2."""
    typer.echo(f'durcap: error: {one_code(printable(_flat(message)), INPUT_CODE)}', err=True)
    raise typer.Exit(2)


# ---- `durcap history repair` (Temporal): a turn whose append never completed ---------------------------


@history_app.command('repair')
def repair(
    workflow_id: Annotated[str, typer.Argument(metavar='WORKFLOW_ID', help='The Temporal workflow id of the turn.')],
    store: Annotated[
        str | None,
        typer.Option('--store', envvar='DURCAP_STORE', help=f'Store URL (default {DEFAULT_URL}): the workers\' store.'),
    ] = None,
    address: Annotated[str | None, typer.Option(help=_TEMPORAL_ADDRESS.help)] = None,
    namespace: Annotated[str, typer.Option(help='Temporal namespace.')] = 'default',
) -> None:
    """Store a turn whose conversation append never completed, from the Temporal workflow's own record, and print its answer.

    Idempotent: an append the store already has is not written again. Exit 2 when the conversation moved on
    since the turn loaded it (nothing is written), or the workflow or the store cannot be read.
    """
    from ..engines.temporal import connect, repair_temporal  # lazily: Temporal-only, temporalio is an optional extra

    # As `history export` and the operator commands: the flag, else the setting's environment variables, else its
    # default; a malformed HOST:PORT exits 2 before anything connects.
    target = checked(_TEMPORAL_ADDRESS, address) or _TEMPORAL_ADDRESS.default

    async def go() -> Any:
        client = await connect(target, namespace, store=store)
        return await repair_temporal(client, workflow_id, store=store)

    try:
        repaired = asyncio.run(go())
    except Exception as exc:  # noqa: BLE001 - one line for the user, whatever the client or the store raised
        _unusable(f'cannot repair {workflow_id!r}: {type(exc).__name__}: {exc}')
    if not repaired:
        typer.echo(f'{workflow_id}: no conversation append is pending; nothing to repair')
    for item in repaired:
        done = 'already stored' if item.already_stored else 'stored'
        typer.echo(f'conversation {item.conversation_id!r}: {done} {item.messages} message(s) at revision {item.revision}')
        if item.answer is not None:
            typer.echo(f'answer: {item.answer}')


# ---- `durcap history fork`: start again from an earlier turn ----------------------------------------------


@history_app.command('fork')
def fork(
    conversation_id: Annotated[str, typer.Argument(metavar='ID', help='The conversation to fork (left unchanged).')],
    at_turn: Annotated[int, typer.Option('--at-turn', help='How many of its turns the fork keeps (1 = the first).')],
    to: Annotated[str, typer.Option('--to', help='The new conversation id (must not exist).')],
    store: StoreOption = None,
    format: Annotated[HistoryFormat, typer.Option('--format', help='text or json.')] = HistoryFormat.text,
) -> None:
    """Start a new conversation from the first N turns of a stored one: its messages are shared, not copied (the new
    one costs a row until its next turn), and its next run, on any engine, loads the capabilities they loaded.

    Exit 2, nothing written, for an unknown conversation, a turn outside 1..its turns, or a NEW_ID already stored.
    """
    from ..forks import fork_at_turn
    from ..store import SQLConversationStore

    url = resolve_url(store)

    async def go() -> Any:
        async with SQLConversationStore(url, create=False) as opened:
            return await fork_at_turn(opened, conversation_id, at_turn, to)

    try:
        done = asyncio.run(go())
    except DurcapError as exc:
        _unusable(str(exc))
    if format is HistoryFormat.json:
        typer.echo(json.dumps({'conversation_id': done.new_id, 'forked_from': done.source_id, 'turns': done.turns,
                               'source_turns': done.source_turns, 'messages': done.messages,
                               'capabilities': done.capabilities, 'budget': done.budget}, indent=2))
        return
    caps = ', '.join(done.capabilities) or 'none'
    typer.echo(printable(f'forked {done.source_id!r} at turn {done.turns} of {done.source_turns} into {done.new_id!r}: '
                         f'{done.messages} messages (shared), capabilities loaded: {caps}; continue it with '
                         f'`durcap run TARGET PROMPT --conversation {done.new_id}` on any engine'))
    if done.budget is not None:
        spent = done.budget['spent']
        raised = ''.join(f', {name} raised by {by:g}' for name, by in done.budget['raised'].items())
        typer.echo(printable(f"budget {done.budget['key']} carries the kept turns' spend: {spent['total_tokens']:,} "
                             f"tokens, {spent['cost']:g} USD, {spent['requests']} request(s){raised}"))


# ---- `durcap history evals`: recorded turns as eval cases ------------------------------------------------------


@history_app.command('evals')
def evals(
    conversation_ids: Annotated[list[str], typer.Argument(metavar='ID...', help='The conversations whose turns become '
                                                          'cases.')],
    out: Annotated[str, typer.Option('--out', help='The dataset file: .yaml / .yml or .json (pydantic-evals writes '
                                     'its JSON schema beside it).')],
    store: StoreOption = None,
    name: Annotated[str | None, typer.Option('--name', help="The dataset's name (default: the file's stem).")] = None,
) -> None:
    """Write every stored turn of the conversations as a case of a pydantic-evals Dataset: inputs the prompt, the
    message history before it and the capabilities it had loaded; expected output the stored answer and tool calls.

    Load it with `Dataset[TurnInputs, TurnOutcome, dict].from_file(FILE)` and evaluate a changed agent with
    `durable_capabilities.evals.turn_task(agent)` (docs/evals.md). Needs pydantic-evals (DC070 names the install
    command). Exit 2, nothing written, for an unknown conversation, a FILE of another type, or no pydantic-evals.
    """
    from ..evals import export_evals
    from ..store import SQLConversationStore

    url = resolve_url(store)

    async def go() -> Any:
        async with SQLConversationStore(url, create=False) as opened:
            return await export_evals(opened, conversation_ids, out, name=name)

    try:
        done = asyncio.run(go())
    except DurcapError as exc:
        _unusable(str(exc))
    per = ', '.join(f'{cid} {count}' for cid, count in done.per_conversation.items())
    schema = f' (schema {done.schema_path})' if done.schema_path else ''
    typer.echo(printable(f'wrote {done.cases} case(s) to {done.path}{schema}: turns per conversation: {per}'))


# ---- `durcap history delete`: a user's right to be forgotten --------------------------------------------


@history_app.command('delete')
@connection_options('read')
def delete(
    conversation_id: Annotated[str, typer.Argument(metavar='ID', help='The conversation id.')],
    store: StoreOption = None,
    yes: Annotated[bool, typer.Option('--yes', '-y', help='Do not ask for confirmation.')] = False,
    dry_run: Annotated[bool, typer.Option('--dry-run', help='List what would be deleted; change nothing.')] = False,
    engines: Annotated[bool, typer.Option(
        '--engines', help="Also check the engines for a run of it in flight (refused if one is) and delete the "
                          "engines' own records of its runs (Temporal history, DBOS step outputs, Prefect flow "
                          'runs).')] = False,
    skip_engine: Annotated[list[str] | None, typer.Option(
        '--skip-engine', metavar='ENGINE', help="With --engines: leave this engine out (not asked, its records listed "
                                                'with how to remove them, not deleted). Repeatable.')] = None,
    format: Annotated[HistoryFormat, typer.Option('--format', help='text or json.')] = HistoryFormat.text,
    conn: dict[str, Any] | None = None,
) -> None:
    """Delete a conversation for good: its messages, header, write log, and the claim checks no other conversation
    shares; say what each engine still holds of its runs and how to remove it.

    Exit 2 (nothing deleted) for an unknown conversation, a conversation others were forked from, or, with
    --engines, a run of it still in flight, or an engine holding its runs that is not configured (Prefect without
    PREFECT_API_URL) or cannot be asked (pass --skip-engine ENGINE to leave it out); without --engines the store
    cannot tell whether a run is in flight and a warning says so. Asks for confirmation unless --yes.
    """
    from ..forgetting import check_engines_configured, delete_conversation, engine_records, plan_delete

    url = resolve_url(store)
    skip = _skipped(skip_engine or [], engines)
    settings = connection_settings(conn or {}, store)
    try:
        plan = asyncio.run(plan_delete(url, conversation_id))
        if engines:  # before asking: a refusal needs no confirmation
            check_engines_configured(plan, settings, skip)
    except DurcapError as exc:
        _unusable(str(exc))
    if not dry_run and not yes:
        if format is HistoryFormat.text:
            typer.echo(_plan_text(plan, engine_records(plan), planned=True))
        if not sys.stdin.isatty():
            _unusable(f'deleting conversation {conversation_id!r} needs confirmation: pass --yes (or --dry-run to list)')
        if not typer.confirm(f'Delete conversation {conversation_id!r} for good?', err=True):
            typer.echo('nothing deleted', err=True)
            raise typer.Exit(1)
    try:
        done = asyncio.run(delete_conversation(url, conversation_id, settings=settings, engines=engines,
                                               dry_run=dry_run, skip=skip))
    except DurcapError as exc:
        _unusable(str(exc))
    for note in done.notes:
        typer.echo(printable(f'durcap: warning: {note}'), err=True)
    if format is HistoryFormat.json:
        typer.echo(json.dumps({'conversation_id': conversation_id, 'dry_run': dry_run,
                               'store': {'rows': done.purge.rows, 'message_bytes': done.purge.message_bytes,
                                         'payload_bytes': done.purge.payload_bytes,
                                         'shared_payloads_kept': done.purge.shared_payloads,
                                         'shared_payload_bytes_kept': done.purge.shared_payload_bytes},
                               'engines': [r.to_json() for r in done.engines]}, indent=2))
    else:
        typer.echo(_plan_text(done.purge, done.engines, planned=dry_run))
    if any(r.deleted is False for r in done.engines):
        raise typer.Exit(1)


def _skipped(names: list[str], engines: bool) -> set[str]:
    """The engines of `--skip-engine` (exit 2, DC040, for one that is not a durable engine, or without --engines)."""
    from ..engines import DURABLE_ENGINES

    if names and not engines:
        _unusable(f'{INPUT_CODE} --skip-engine: only with --engines (without it no engine is asked or changed)')
    for name in names:
        if name not in DURABLE_ENGINES:
            _unusable(f'{INPUT_CODE} --skip-engine {name}: not a durable engine; one of {", ".join(DURABLE_ENGINES)}')
    return set(names)


def _plan_text(purge: Any, records: list[Any], *, planned: bool) -> str:
    verb = 'would delete' if planned else 'deleted'
    rows = ', '.join(f'{table} {count}' for table, count in purge.rows.items())
    lines = [
        f'conversation {purge.conversation_id}: {verb} {rows} (rows); messages {purge.message_bytes:,} bytes, own claim '
        f'checks {purge.payload_bytes:,} bytes',
    ]
    if purge.shared_payloads:
        lines.append(f'  kept: {purge.shared_payloads} claim check(s) shared with another conversation '
                     f'({purge.shared_payload_bytes:,} bytes)')
    if records:
        lines.append('what the engines still hold of its runs:' if not any(r.deleted for r in records) else 'engines:')
        for r in records:
            state = {True: 'deleted', False: f'NOT deleted ({r.error})', None: f'remove with: {r.remove}'}[r.deleted]
            lines.append(f'  {r.engine} {r.run_id}: {r.retains}; {state}')
    else:
        lines.append('no durable run appended to it (nothing of it on an engine that the store knows of)')
    return '\n'.join(printable(line) for line in lines)


# ---- `durcap history release`: free a conversation held by a run that is gone ---------------------------------


@history_app.command('release')
def release(
    conversation_id: Annotated[str, typer.Argument(metavar='ID', help='The conversation id.')],
    store: StoreOption = None,
    run_id: Annotated[str | None, typer.Option('--run', help='Release only if this run holds it.')] = None,
) -> None:
    """Release the turn claim on a conversation (one turn at a time per conversation): what a run that is gone left
    behind, so a new turn is not refused (DC050). Says which run held it; exit 0 also when none did (releasing twice
    is harmless), exit 2 (DC044) when the store has no such conversation and no turn holds that id."""
    from ..store import ConversationNotFoundError, SQLConversationStore

    async def go() -> tuple[tuple[str, str] | None, bool, bool]:
        async with SQLConversationStore(resolve_url(store), create=False) as opened:
            holder = await opened.turn_claim(conversation_id)
            released = await opened.release_turn(conversation_id, run_id)
            known = holder is not None or await opened.read_record(conversation_id) is not None
            return holder, released, known

    try:
        holder, released, known = asyncio.run(go())
    except StoreError as exc:
        _unusable(str(exc).splitlines()[0])
    if not known:
        _unusable(str(ConversationNotFoundError(
            conversation_id, '; nothing was released. Fix: pass the id of a stored conversation, or of one a turn is '
            'running on (`durcap runs list` shows them), and the --store its runs use')))
    if released and holder is not None:
        typer.echo(printable(f'conversation {conversation_id}: released the turn of run {holder[0]} (claimed at {holder[1]})'))
    elif holder is not None:
        typer.echo(printable(f'conversation {conversation_id}: held by run {holder[0]}, not {run_id}: nothing released'))
    else:
        typer.echo(printable(f'conversation {conversation_id}: no turn holds it'))
