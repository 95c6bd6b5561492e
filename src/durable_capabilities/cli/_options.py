"""The connection flags of `durcap runs`, `durcap approvals`, `durcap approve|deny` and `durcap ui`, and the one
`settings.Settings` they resolve to (flag, else environment, else default: see `settings.py`)."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from ..settings import Settings
from ..store import DEFAULT_URL

DbOption = Annotated[str | None, typer.Option(help='DBOS system database URL (default: $DURCAP_DBOS_DB or SQLite '
                                                   '.durcap/dbos.sqlite).')]
AddressOption = Annotated[str | None, typer.Option(help='Temporal frontend HOST:PORT (default: $DURCAP_TEMPORAL_ADDRESS '
                                                        'or 127.0.0.1:7233).')]
NamespaceOption = Annotated[str, typer.Option(help='Temporal namespace.')]
StoreOption = Annotated[str | None, typer.Option('--store', help=f'Conversation store URL (default: $DURCAP_STORE or '
                                                                 f'{DEFAULT_URL}).')]


def connection_settings(db: str | None, address: str | None, namespace: str, store: str | None = None) -> Settings:
    """`Settings.resolve` of the flags given (`None`: not given), after `--db` and `--store` are checked as
    `durcap run` checks them (exit 2, DC040, for an empty, in-memory or unsupported database URL)."""
    from . import database_url, temporal_address

    if not address:
        for env in ('DURCAP_TEMPORAL_ADDRESS', 'TEMPORAL_ADDRESS'):  # the first one set is the one used
            if os.environ.get(env):
                temporal_address(os.environ[env], f'${env}')
                break
    return Settings.resolve(address=temporal_address(address), namespace=namespace, db=database_url(db, '--db'),
                            store=database_url(store, '--store'))
