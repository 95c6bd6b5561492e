"""DBOS from outside a run: a `DBOSClient` on the system database, and one-line database errors (the operator
commands: `durcap runs`, `durcap approvals`, `durcap worker dbos`)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from dbos import DBOSClient
from sqlalchemy.exc import SQLAlchemyError

from ... import _upstream
from ..._limits import postgres_connect_fix, redact_database_url
from ._server import system_database_url


def client(settings: Mapping[str, Any]) -> Any:
    """A `DBOSClient` on `settings['db']` (default system database): runs and approvals read and send through it.

    Raises:
        RuntimeError: the system database cannot be reached (DBOSClient checks the connection when it is made) or
            DBOS refuses its URL (no database name): one line naming the database (password shown as ***) and the
            driver's reason, instead of SQLAlchemy's traceback and DBOS's own log line saying the same.
    """
    url = system_database_url(settings.get('db'))
    try:
        with quiet_dbos_log('Error connecting to the DBOS system database'):  # raised below, in one line
            return DBOSClient(system_database_url=url)
    except Exception as exc:
        if not isinstance(exc, (SQLAlchemyError, _upstream.dbos_error_classes()[0])):  # DBOS's own: a URL it refuses
            raise
        reason = database_error_line(exc)
        fix = f'; {postgres_connect_fix(url, reason)}' if url.startswith('postgres') else ''
        raise RuntimeError(f'cannot connect to the DBOS system database {redact_database_url(url)}: {reason}{fix}') from None


@contextmanager
def quiet_dbos_log(*prefixes: str) -> Iterator[None]:
    """Drop the `dbos` logger's records whose message starts with one of `prefixes` while the block runs: for a
    database error the caller raises itself, in one line, which DBOS would also log with its traceback. The filter is
    the block's own (added and removed), so concurrent blocks never undo each other's, and the logger's level is
    never changed."""
    dbos_logger = logging.getLogger('dbos')
    quiet = _DropRecords(prefixes)
    dbos_logger.addFilter(quiet)
    try:
        yield
    finally:
        dbos_logger.removeFilter(quiet)


def database_error_line(exc: BaseException) -> str:
    """The first line of the database driver's own message (SQLAlchemy's `orig`), else of `exc`, else its type name:
    what the operator commands print after naming the system database."""
    detail = str(getattr(exc, 'orig', None) or exc).strip().splitlines()
    return detail[0] if detail else type(exc).__name__


class _DropRecords:
    """A `logging` filter dropping the records whose message starts with one of `prefixes`."""

    def __init__(self, prefixes: tuple[str, ...]):
        self.prefixes = prefixes

    def filter(self, record: Any) -> bool:
        return not record.getMessage().startswith(self.prefixes)
