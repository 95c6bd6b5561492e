"""durcap's own tables in the DBOS system database (`_peers`' heartbeats, `_decisions`' slots): created by whichever
process asks first, safely when several ask at once."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.schema import CreateTable


def ensure_table(engine: sa.Engine, table: sa.Table) -> None:
    """Create `table` on `engine` unless it exists.

    Processes starting at the same moment all ask (three `durcap worker dbos` on one database, two deciders):
    `MetaData.create_all`'s check-then-create let two of them create it and the second failed (`relation ... already
    exists` on PostgreSQL, `table ... already exists` on SQLite). Here the statement is `CREATE TABLE IF NOT EXISTS`,
    and a create that still fails (PostgreSQL can refuse a concurrent one on its catalog's unique index) is fine once
    the table exists.

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the table could not be created and does not exist (the database refused or
            cannot be reached).
    """
    try:
        with engine.begin() as conn:
            conn.execute(CreateTable(table, if_not_exists=True))
    except SQLAlchemyError:
        if not sa.inspect(engine).has_table(table.name):
            raise
