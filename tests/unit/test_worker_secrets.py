"""`WorkerSecret`: deps values that name a secret and are resolved where the tool runs (no engine needed)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from durable_capabilities import SecretNotFoundError, WorkerSecret, set_secret_resolver


@dataclass
class Deps:
    account: str
    api_key: WorkerSecret


def test_only_the_name_is_serialized_and_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('DURCAP_UNIT_KEY', 'sk-value-1')
    deps = Deps('acct', WorkerSecret('DURCAP_UNIT_KEY'))
    assert deps.api_key.get_secret_value() == 'sk-value-1'  # resolving caches nothing on the object
    data = to_jsonable_python(deps)
    assert data == {'account': 'acct', 'api_key': {'secret': 'DURCAP_UNIT_KEY'}}
    assert 'sk-value-1' not in f'{deps!r} {deps.api_key} {deps.api_key.model_dump_json()}'
    again = TypeAdapter(Deps).validate_python(data)  # what a worker rebuilds from an engine record
    assert again == deps and again.api_key.get_secret_value() == 'sk-value-1'
    assert WorkerSecret.model_validate({'secret': 'DURCAP_UNIT_KEY'}) == deps.api_key


def test_a_missing_secret_names_itself_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv('DURCAP_UNIT_MISSING', raising=False)
    with pytest.raises(SecretNotFoundError, match=r"worker secret 'DURCAP_UNIT_MISSING' is not set") as info:
        WorkerSecret('DURCAP_UNIT_MISSING').get_secret_value()
    assert 'environment variable DURCAP_UNIT_MISSING' in str(info.value) and info.value.name == 'DURCAP_UNIT_MISSING'
    assert isinstance(info.value, LookupError)


def test_a_resolver_is_tried_before_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('DURCAP_UNIT_BOTH', 'from-env')
    vault = {'DURCAP_UNIT_BOTH': 'from-vault', 'ONLY_IN_VAULT': 'v'}
    set_secret_resolver(vault.get)
    try:
        assert WorkerSecret('DURCAP_UNIT_BOTH').get_secret_value() == 'from-vault'
        assert WorkerSecret('ONLY_IN_VAULT').get_secret_value() == 'v'
        monkeypatch.setenv('DURCAP_UNIT_ENV_ONLY', 'e')
        assert WorkerSecret('DURCAP_UNIT_ENV_ONLY').get_secret_value() == 'e'  # unknown to the resolver
    finally:
        set_secret_resolver(None)
    assert WorkerSecret('DURCAP_UNIT_BOTH').get_secret_value() == 'from-env'
