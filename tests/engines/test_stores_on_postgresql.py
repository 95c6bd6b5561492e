"""The store tests of tests/unit again, on a fresh PostgreSQL database each (127.0.0.1:5432, trust auth).

Every unit test that takes the `store_url` fixture is imported here; tests/conftest.py gives `store_url` the
PostgreSQL backend for tests collected under tests/engines and drops the imported tests that do not take it
(`REUSES_STORE_TESTS`), so the fast lane stays free of servers and the PostgreSQL coverage stays whole.
"""

from __future__ import annotations

import pytest

from durable_capabilities.store import SQLConversationStore, StoreReadOnlyError
from tests._helpers import create_database, drop_database, pg_url, sql
from tests.unit.test_claim_check import *  # noqa: F403
from tests.unit.test_claim_check_pieces import *  # noqa: F403
from tests.unit.test_history_delete import *  # noqa: F403
from tests.unit.test_store import *  # noqa: F403
from tests.unit.test_store import history, run  # noqa: F401 - module fixture and helper used below
from tests.unit.test_store_integrity import *  # noqa: F403

REUSES_STORE_TESTS = True


def test_writability_probe_refuses_a_read_only_postgresql_database() -> None:
    name = create_database('durcap_ro')
    try:
        url = pg_url(name)
        with SQLConversationStore(url) as made:
            made._sql.probe_writable()
        sql(url, f'ALTER DATABASE {name} SET default_transaction_read_only = on')
        with pytest.raises(StoreReadOnlyError, match='is read-only'):
            run(SQLConversationStore(url).check_writable())
    finally:
        drop_database(name)


