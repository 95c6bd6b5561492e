"""`settings.Settings`: the one place `durcap runs`, `durcap approvals` and `durcap ui` resolve where the engines and
the conversation store are (flag, else environment, else default). Pure: no server needed."""

from __future__ import annotations

import pytest

from durable_capabilities.settings import DEFAULT_TEMPORAL_ADDRESS, Settings
from durable_capabilities.store import DEFAULT_URL

ENV = ('DURCAP_TEMPORAL_ADDRESS', 'TEMPORAL_ADDRESS', 'DURCAP_DBOS_DB', 'DURCAP_STORE')


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_defaults() -> None:
    settings = Settings.resolve()
    assert settings == Settings(DEFAULT_TEMPORAL_ADDRESS, 'default', None, DEFAULT_URL)
    assert settings.engine() == {'address': '127.0.0.1:7233', 'namespace': 'default', 'db': None}


def test_environment_then_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('TEMPORAL_ADDRESS', 'tmp:1')
    assert Settings.resolve().address == 'tmp:1'
    monkeypatch.setenv('DURCAP_TEMPORAL_ADDRESS', 'durcap:2')
    monkeypatch.setenv('DURCAP_DBOS_DB', 'postgresql://u@h/dbos')
    monkeypatch.setenv('DURCAP_STORE', 'sqlite:///env.db')
    from_env = Settings.resolve()
    assert (from_env.address, from_env.db, from_env.store) == ('durcap:2', 'postgresql://u@h/dbos', 'sqlite:///env.db')
    flags = Settings.resolve(address='flag:3', namespace='ns', db='sqlite:///flag.sqlite', store='sqlite:///flag.db')
    assert flags == Settings('flag:3', 'ns', 'sqlite:///flag.sqlite', 'sqlite:///flag.db')


def test_describe_hides_passwords() -> None:
    shown = Settings.resolve(db='postgresql://durcap:s3cret@db:5432/dbos', store='postgresql://a:pw@db/conv').describe()
    assert 's3cret' not in str(shown) and 'pw@' not in str(shown)
    assert shown['DBOS system database'] == 'postgresql://durcap:***@db:5432/dbos'


def test_describe_names_only_the_engines_asked_for() -> None:
    """`durcap ui --engine dbos` names DBOS and the store at start, not Temporal's 127.0.0.1:7233 (issue 29, item 6)."""
    settings = Settings.resolve(db='sqlite:///x.db')
    every = settings.describe()
    dbos_only = settings.describe(['dbos'])
    assert any('Temporal' in label for label in every)
    assert [label for label in dbos_only] == ['DBOS system database', 'conversation store'], dbos_only
    assert settings.describe([]) == {'conversation store': every['conversation store']}


def test_ui_app_records_the_engines_it_reads() -> None:
    """The pages' app says which engines it reads: `durcap ui` describes exactly those."""
    from durable_capabilities.ui import create_app

    app = create_app(Settings.resolve(), 'token', engines=['dbos'])
    assert app.state.engines == ['dbos']
