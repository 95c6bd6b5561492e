"""What an agent without MCP or a conversation store imports (issue 14, item 5).

Each check runs in a fresh interpreter (a subprocess), because this test process has imported everything
already. The agent uses pydantic-ai's built-in `'test'` model (no provider, no key).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests._helpers import ROOT, subprocess_env

_PROBE = textwrap.dedent(
    """
    import json, sys
    import durable_capabilities
    from durable_capabilities import DurableAgent
    from pydantic_ai.capabilities import Capability

    def lookup(order_id: str) -> str:
        return order_id

    agent = DurableAgent('lazy', 'test', instructions='hi',
                         capabilities=[Capability(id='orders', defer_loading=True, tools=[lookup])], engines=())
    agent.build('local')
    EXTRA
    print(json.dumps({name: name in sys.modules for name in sys.argv[1:]}))
    """
)


def _imported(*modules: str, extra: str = '') -> dict[str, bool]:
    out = subprocess.run(
        [sys.executable, '-c', _PROBE.replace('EXTRA', extra or 'pass'), *modules], capture_output=True, text=True, timeout=120, check=True,
        env=subprocess_env(),
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_local_build_without_mcp_or_store_imports_neither() -> None:
    found = _imported('mcp', 'pydantic_ai.mcp', 'fastmcp', 'sqlalchemy', 'temporalio', 'dbos', 'prefect')
    assert found == dict.fromkeys(found, False), found


def test_store_names_still_import_on_first_use() -> None:
    found = _imported('sqlalchemy', extra='durable_capabilities.SQLConversationStore("sqlite:///:memory:")')
    assert found == {'sqlalchemy': True}
    with pytest.raises(AttributeError, match='no_such_name'):
        import durable_capabilities

        durable_capabilities.no_such_name  # noqa: B018


def test_mcp_leaf_still_recognised_when_mcp_is_imported() -> None:
    """The lazy check must not hide a real MCP leaf: with `pydantic_ai.mcp` imported, an `MCPToolset` is one."""
    from pydantic_ai.mcp import MCPToolset

    from durable_capabilities import _upstream

    server = MCPToolset('http://127.0.0.1:9/mcp', id='docs')
    assert _upstream.is_mcp_toolset(server)
    assert not _upstream.is_mcp_toolset(object())


def test_a_run_on_one_engine_imports_no_other_engines_sdk() -> None:
    """`durcap run/demo/worker/runs resume --engine dbos` compare the DBOS names of the durable.lock beside TARGET
    (the support example's lock has every engine's): `load_checked(..., engines=('dbos',))` imports DBOS's SDK to
    compute them and neither Temporal's nor Prefect's (~1-1.5 s of CPU each, per `durcap` process)."""
    found = _imported('temporalio', 'prefect', 'dbos', extra=(
        'from durable_capabilities.targets import load_checked\n'
        f"assert load_checked({str(ROOT / 'examples' / 'support' / 'agent.py')!r} + ':support', engines=('dbos',)).report.ok"))
    assert found == {'temporalio': False, 'prefect': False, 'dbos': True}, found
