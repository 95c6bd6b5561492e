"""durcap's own tables in the DBOS system database are created safely by processes starting at once.

Seen in a test run (h/suite3): three `durcap worker dbos` started at the same moment on one PostgreSQL database, and
one crashed with `relation "durcap_dbos_executors" already exists` (`MetaData.create_all`'s check-then-create in
`_peers.Peers`); the decision slots' table had raced the same way on SQLite. Real PostgreSQL (a fresh database) and a
real SQLite file; no model.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from durable_capabilities.engines.dbos import _decisions, _peers
from tests._helpers import postgres_database

STARTERS = 8


def _at_once(url: str) -> list[BaseException]:
    """`STARTERS` threads, each with its own engine (as separate processes have), released together to construct a
    `Peers` watcher and create the decision slots' table; the errors they raised."""
    barrier, errors = threading.Barrier(STARTERS), []

    def start(i: int) -> None:
        engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://', 1))
        try:
            barrier.wait()
            _peers.Peers(url, f'executor-{i}', 'q', timeout=15, notify=lambda line: None, recover=lambda ids: [])
            _decisions.ensure_table(engine, _decisions._DECISIONS)
        except BaseException as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=start, args=(i,)) for i in range(STARTERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return errors


@pytest.mark.parametrize('backend', ['postgresql', 'sqlite'])
def test_workers_and_deciders_starting_at_once_create_durcaps_tables_once_without_error(backend: str,
                                                                                         tmp_path: Path) -> None:
    def check(url: str) -> None:
        errors = _at_once(url)
        assert errors == []
        engine = sa.create_engine(url.replace('postgresql://', 'postgresql+psycopg://', 1))
        try:
            names = set(sa.inspect(engine).get_table_names())
        finally:
            engine.dispose()
        assert {_peers.TABLE, _decisions.TABLE} <= names

    if backend == 'postgresql':
        with postgres_database('durcap_schema') as url:
            check(url)
    else:
        check(f'sqlite:///{tmp_path / "system.sqlite"}')
