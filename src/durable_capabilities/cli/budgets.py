"""`durcap budgets list|show|reset`: what each budget key spent of its limits, in the conversation store's ledger.

Exit codes: 0 shown (a key the store has no ledger for has spent nothing) or reset; 2 `reset` of a key the store has
no ledger for (DC044, an id that names nothing; it was 1 without a code), or unusable input (a bad store URL, no store
there, a schema newer than this code).
"""

from __future__ import annotations

import asyncio
import json
from enum import Enum
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table
from rich.text import Text

from .._limits import printable, redact_database_url
from ..errors import NOT_FOUND_CODE, DurcapError
from ..store import resolve_url
from . import _out, _unusable, app
from ._options import StoreOption

if TYPE_CHECKING:
    from ..store._budgets import BudgetRecord

budgets_app = typer.Typer(help="Budgets: what each key (conversation, run, tenant) spent of its limits; reset a key.",
                          no_args_is_help=True)
app.add_typer(budgets_app, name='budgets')

FIELDS = ('total_tokens', 'input_tokens', 'output_tokens', 'cost')


class Format(str, Enum):
    text = 'text'
    json = 'json'


FormatOption = Annotated[Format, typer.Option('--format', help='text or json.')]


def _records(store: str | None, key: str | None = None) -> list[BudgetRecord]:
    from ..store import SQLConversationStore

    async def read() -> list[BudgetRecord]:
        async with SQLConversationStore(resolve_url(store), create=False) as opened:
            return await opened.budgets(key)

    try:
        return asyncio.run(read())
    except DurcapError as exc:
        _unusable(str(exc))


def _amount(name: str, value: float | None) -> str:
    if value is None:
        return '-'
    return f'${value:,.6f}'.rstrip('0').rstrip('.') if name == 'cost' else f'{int(value):,}'


def _spent_of(record: BudgetRecord, name: str) -> str:
    limit = record.limit(name)
    spent = _amount(name, record.spent.get(name, 0))
    return spent if limit is None else f'{spent} / {_amount(name, limit)}'


@budgets_app.command('list')
def list_budgets(store: StoreOption = None, format: FormatOption = Format.text) -> None:
    """Every budget key in the store: spent / limit (plus what operators raised it by) per limit, requests, in flight."""
    records = _records(store)
    if format is Format.json:
        typer.echo(json.dumps([r.to_json() for r in records], indent=2))
        return
    if not records:
        typer.echo('no budget has spent anything in this store')
        return
    table = Table('key', *FIELDS, 'requests', 'in flight', 'updated', box=None, pad_edge=False)
    for record in records:
        table.add_row(*map(Text, [printable(record.key), *(_spent_of(record, f) for f in FIELDS),
                                  str(int(record.spent.get('requests', 0))), str(record.in_flight), record.updated_at]))
    _out.print(table)


@budgets_app.command('show')
def show(key: Annotated[str, typer.Argument(help='The budget key (conversation:ID, run:ID, or a tenant key).')],
         store: StoreOption = None, format: FormatOption = Format.text) -> None:
    """One budget key: spent, limits, raises, requests and requests in flight. A key the store has no ledger for has
    spent nothing (a key's ledger starts with its first model request): said so, exit 0."""
    records = _records(store, key)
    if not records:
        if format is Format.json:
            from ..store._budgets import BudgetRecord

            nothing = BudgetRecord(key, spent={name: 0 for name in (*FIELDS, 'requests')})
            typer.echo(json.dumps({**nothing.to_json(), 'updated_at': None}, indent=2))
        else:
            typer.echo(f'budget key {printable(key)!r} has spent nothing in this store (no model request was charged to '
                       'it; `durcap budgets list` shows the keys that spent)')
        return
    record = records[0]
    if format is Format.json:
        typer.echo(json.dumps(record.to_json(), indent=2))
        return
    lines = [f'key: {record.key}']
    for name in FIELDS:
        raised = record.raised.get(name)
        lines.append(f'{name}: {_spent_of(record, name)}' + (f' (raised by {_amount(name, raised)})' if raised else ''))
    lines += [f'requests: {int(record.spent.get("requests", 0))}', f'in flight: {record.in_flight}',
              f'updated: {record.updated_at}']
    typer.echo('\n'.join(printable(line) for line in lines))


@budgets_app.command('reset')
def reset(key: Annotated[str, typer.Argument(help='The budget key to reset.')], store: StoreOption = None) -> None:
    """Forget what KEY spent, reserved and was raised by: its next model request starts from zero. Exit 2 (DC044) when
    the store has no such key."""
    from ..store import SQLConversationStore

    async def run() -> bool:
        async with SQLConversationStore(resolve_url(store), create=False) as opened:
            return await opened.budget_reset(key)

    try:
        found = asyncio.run(run())
    except DurcapError as exc:
        _unusable(str(exc))
    if not found:
        _unusable(f'{NOT_FOUND_CODE} budget key {printable(key)!r} is not in the store {redact_database_url(resolve_url(store))}'
                  ': nothing was reset. Fix: `durcap budgets list` shows the keys that spent something (a key that has '
                  'spent nothing has nothing to reset); pass the --store its runs use')
    typer.echo(f'budget {printable(key)} reset')
