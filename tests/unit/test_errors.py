"""`DurcapError` (issue 23, item 5): the one base of every error a user can catch, each with a stable code.

The classes are found by walking the package's modules, so a new public exception class without `DurcapError` or
without a code of its own fails here; docs/errors.md ("Exception types") must list each with that code.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest
from pydantic_ai.capabilities import Capability

import durable_capabilities
from durable_capabilities import DurableAgent, DurcapError

ROOT = Path(__file__).resolve().parents[2]
PRIVATE = {'_ProbeDone', '_Cut'}
"""Private control-flow exceptions: they never leave the package (`store._sql`, `wire`)."""


def modules() -> list[object]:
    """Every module of the package (`__main__` aside: importing it runs the CLI)."""
    return [importlib.import_module(info.name)
            for info in pkgutil.walk_packages(durable_capabilities.__path__, 'durable_capabilities.')
            if not info.name.endswith('.__main__')]


def public_exception_classes() -> dict[str, type[BaseException]]:
    """`{name: class}` of every exception class defined in a module of the package (private names aside)."""
    found: dict[str, type[BaseException]] = {}
    for module in modules():
        for name, value in vars(module).items():
            if (isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == module.__name__
                    and not name.startswith('_')):
                found[name] = value
    return found


def test_every_public_exception_is_a_durcap_error_with_a_code_of_its_own() -> None:
    classes = public_exception_classes()
    assert len(classes) >= 22, sorted(classes)  # the 21 of issue 23 plus DurcapError itself
    for name, cls in classes.items():
        assert issubclass(cls, DurcapError), f'{name} is not a DurcapError'
        assert 'code' in vars(cls), f'{name} has no code of its own (class {name}(..., code=...))'
        assert isinstance(cls.code, str) and cls.code, name
    private = {name for module in modules() for name, value in vars(module).items()
               if name in PRIVATE and isinstance(value, type)}
    assert private == PRIVATE  # the two stay plain control flow
    assert not any(issubclass(getattr(importlib.import_module(m), n), DurcapError)
                   for m, n in (('durable_capabilities.store._sql', '_ProbeDone'), ('durable_capabilities.wire', '_Cut')))


def test_existing_bases_are_kept() -> None:
    from durable_capabilities import ApprovalError, DurableConfigError, InputError, LockfileError, StoreURLError
    from durable_capabilities.engines import EngineUnreachableError, RunNotFoundError
    from durable_capabilities.engines._mcp import MCPCapabilityError
    from durable_capabilities.store import ConversationConflictError, ConversationNotFoundError

    for cls, base in [(DurableConfigError, ValueError), (InputError, ValueError), (LockfileError, ValueError),
                      (StoreURLError, ValueError), (ApprovalError, LookupError), (RunNotFoundError, LookupError),
                      (ConversationNotFoundError, LookupError), (EngineUnreachableError, RuntimeError)]:
        assert issubclass(cls, base), (cls, base)
    from pydantic_ai.conversation_store import ConversationConflict
    from pydantic_ai.exceptions import AgentRunError
    assert issubclass(MCPCapabilityError, AgentRunError)
    assert issubclass(ConversationConflictError, ConversationConflict)


def test_every_class_is_documented_with_its_code() -> None:
    text = (ROOT / 'docs' / 'errors.md').read_text(encoding='utf-8')
    section = text.split('\n## Exception types\n', 1)[1].split('\n## ', 1)[0]
    rows = dict(re.findall(r'^\| `(\w+)`[^|]*\|[^|]*\| (.+) \|$', section, flags=re.M))
    classes = public_exception_classes()
    assert set(rows) == set(classes), set(rows) ^ set(classes)
    for name, cls in classes.items():
        assert f'`{cls.code}`' in rows[name], f'{name}: docs say {rows[name]!r}, code is {cls.code!r}'


def test_except_durcap_error_catches_a_failure_from_each_area(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from durable_capabilities import SQLConversationStore, targets
    from durable_capabilities.lockfile import read_lock

    caught: dict[str, str] = {}
    with pytest.raises(DurcapError) as store:
        SQLConversationStore('nosuchdb://somewhere/x')
    caught['store'] = store.value.code
    with pytest.raises(DurcapError) as target:
        targets.load('no_such_module_here:agent')
    caught['target'] = target.value.code
    with pytest.raises(DurcapError) as config:
        DurableAgent('shop', 'test', capabilities=[Capability(defer_loading=True, description='d')])
    caught['config'] = config.value.code
    (tmp_path / 'durable.lock').write_text('agents: [not, a, mapping]\n', encoding='utf-8')
    with pytest.raises(DurcapError) as lock:
        read_lock(tmp_path / 'durable.lock')
    caught['lock'] = lock.value.code
    with pytest.raises(DurcapError) as missing_lock:
        read_lock(tmp_path / 'missing.lock')
    caught['missing lock'] = missing_lock.value.code
    assert caught == {'store': 'store-url', 'target': 'target', 'config': 'DC001', 'lock': 'lockfile',
                      'missing lock': 'lockfile'}


def test_code_must_be_a_non_empty_string() -> None:
    with pytest.raises(TypeError, match='code must be a non-empty string'):
        type('Bad', (DurcapError,), {}, code='')
