"""`durcap store stats`: what the conversation store holds, per conversation and in total, and where it is;
`durcap store gc`: delete the claim checks no open run, and no closed run within its engine's retention, refers to.

Exit codes: 0 shown (gc: done or planned); 2 unusable input (bad store URL, no store there, a schema newer than this
code, a bad duration, an engine that cannot be asked).
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from enum import Enum
from typing import Annotated, Any

import typer

from .._limits import INPUT_CODE, printable
from ..errors import DurcapError
from ..store import resolve_url
from . import _unusable, app
from ._options import StoreOption, connection_options, connection_settings

store_app = typer.Typer(help='Look at the conversation store: its size per conversation; collect claim checks no run needs.',
                        no_args_is_help=True)
app.add_typer(store_app, name='store')


class StatsFormat(str, Enum):
    text = 'text'
    json = 'json'


@store_app.command('stats')
def stats(
    store: StoreOption = None,
    format: Annotated[StatsFormat, typer.Option('--format', help='text or json.')] = StatsFormat.text,
) -> None:
    """Bytes per conversation (messages, claim checks of its own and shared with others), totals, and the store's
    location (a SQLite file's absolute path, or the URL with its password hidden)."""
    from ..forgetting import store_stats

    try:
        found = asyncio.run(store_stats(resolve_url(store)))
    except DurcapError as exc:
        _unusable(str(exc))
    if format is StatsFormat.json:
        data = {
            'location': found.location, 'database_bytes': found.database_bytes, 'message_bytes': found.message_bytes,
            'payload_bytes': found.payload_bytes, 'payloads': found.payloads,
            'unattributed_payload_bytes': found.unattributed_payload_bytes,
            'conversations': [dict(c.__dict__) for c in found.conversations],
        }
        typer.echo(json.dumps(data, indent=2))
        return
    size = 'in memory' if found.database_bytes is None else f'{found.database_bytes:,} bytes on disk'
    lines = [f'store: {found.location} ({size})',
             f'{len(found.conversations)} conversation(s): messages {found.message_bytes:,} bytes; {found.payloads} claim '
             f'check(s) {found.payload_bytes:,} bytes ({found.unattributed_payload_bytes:,} of them not attributed to a '
             'conversation)']
    if found.conversations:
        width = max(len('conversation'), *(len(c.conversation_id) + 10 * c.deleted for c in found.conversations))
        lines.append(f'{"conversation":<{width}}  {"messages":>8}  {"message bytes":>14}  {"own claim checks":>16}  '
                     f'{"shared claim checks":>19}')
        for c in found.conversations:
            name = c.conversation_id + (' (deleted)' if c.deleted else '')
            lines.append(f'{name:<{width}}  {c.message_count:>8}  {c.message_bytes:>14,}  {c.payload_bytes:>16,}  '
                         f'{c.shared_payload_bytes:>19,}')
    typer.echo('\n'.join(printable(line) for line in lines))


@store_app.command('gc')
@connection_options('read')
def gc(
    store: StoreOption = None,
    apply: Annotated[bool, typer.Option('--apply', help='Delete (default: a dry run that prints what would be freed).')] = False,
    dry_run: Annotated[bool, typer.Option(
        '--dry-run', help='Print what would be freed and delete nothing (the default; as `history delete --dry-run`).')] = False,
    retention: Annotated[str | None, typer.Option(
        '--retention', metavar='DURATION',
        help="Keep a closed workflow's claim checks this long after it closed, instead of the engine's retention "
             '(Temporal: the namespace retention period; Prefect: its flow run vacuum retention, else it keeps runs '
             'until deleted and nothing of a closed flow run is freed without this). E.g. 7d, 36h.')] = None,
    abandoned_after: Annotated[str | None, typer.Option(
        '--abandoned-after', metavar='DURATION',
        help='Prefect: a RUNNING, PENDING or CANCELLING flow run with no beat, state change or task run update for '
             'this long counts as abandoned (its process was killed without a word), closed at its last sign of '
             'life (default 1h; a live flow run beats every 2s, however long its tool runs).')] = None,
    grace: Annotated[str, typer.Option(
        '--grace', metavar='DURATION',
        help='Never delete anything written in this last while (a run in flight may have stored a piece its engine '
             'does not show yet).')] = '15m',
    format: Annotated[StatsFormat, typer.Option('--format', help='text or json.')] = StatsFormat.text,
    conn: dict[str, Any] | None = None,
) -> None:
    """Delete the claim-check data (Temporal payload pieces, Prefect tool-result pieces) that no open run, and no run
    closed within its engine's retention period, refers to; pieces a live run shares are kept. A Prefect flow run left
    RUNNING by a killed process counts as closed at its last sign of life once silent for --abandoned-after (listed as
    abandoned, with why). A dry run unless --apply."""
    from ..collecting import collect_garbage, parse_duration

    if apply and dry_run:
        _unusable(f'{INPUT_CODE} --apply and --dry-run contradict each other: pass --apply to delete, or neither (or '
                  '--dry-run) to list what would be freed')
    try:
        kept_for = None if retention is None else parse_duration(retention, '--retention')
        window = parse_duration(grace, '--grace')
        silent = None if abandoned_after is None else parse_duration(abandoned_after, '--abandoned-after')
        if silent is not None and silent <= timedelta(0):
            raise ValueError(f'--abandoned-after {abandoned_after!r} must be longer than 0s')
    except ValueError as exc:
        _unusable(f'{INPUT_CODE} {exc}')
    settings = connection_settings(conn or {}, store)
    try:
        found = asyncio.run(collect_garbage(resolve_url(store), settings=settings, retention=kept_for, grace=window,
                                            apply=apply, abandoned_after=silent))
    except DurcapError as exc:
        _unusable(str(exc))
    if format is StatsFormat.json:
        typer.echo(json.dumps(found.to_json(), indent=2))
        return
    typer.echo('\n'.join(printable(line) for line in found.lines()))
