"""Every seed example (docs "On-Demand Capabilities", MCP aside) on Temporal, DBOS (SQLite and
PostgreSQL) and Prefect, against real servers.

Model: the scripted `FunctionModel` of examples/support/scripted.py (`SupportScript`, model name
`scripted-support`), through `tests/engines/seed_driver.py`, which records what the model received
per request (tools offered, instructions, model settings, capability instructions delivered, message
parts) where the model request ran: in the Temporal worker (run inline in the driver's process), in
the DBOS or Prefect process. No provider is called.

One driver subprocess per engine runs all five examples (startup dominates: 2.5-5 s of imports per
process against 0.1-1 s per run) and also runs each example on the local engine as the baseline. The
driver's report is shared by the tests of this module (a module-scoped fixture), so each example x
engine is its own test without its own process.

Servers: the session fixtures `temporal_address` and `prefect_api_url` (tests/engines/conftest.py);
PostgreSQL on 127.0.0.1:5432, a fresh database for this module, dropped at its end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._helpers import ROOT, create_database, drop_database, subprocess_env
from tests.engines.seed_driver import ORDER_LINE

# One worker runs this module's tests (pytest-xdist `loadgroup`): they share a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('seed-examples')]


DRIVER_TIMEOUT = 300.0
ENGINES = ('temporal', 'dbos-sqlite', 'dbos-postgres', 'prefect')
EXAMPLES = ('capability', 'account-security', 'orders-security', 'runbook', 'skills')

CATALOG_HEADER = (
    "The following capabilities are deferred and can be loaded using the `load_capability` tool. "
    "A capability's tools stay hidden until it is loaded:"
)
CATALOG_TRAILER = (
    'A later <pyai:context> element with the same id replaces the earlier one and stays in effect until '
    'replaced again.'
)
SUPPORT_BASE = 'You are a customer-support agent for an e-commerce store.'
SEED_BASE = 'You are a customer support assistant.'
SUPPORT_CATALOG = [
    '- orders: Use for order tracking, delivery status, or questions involving an order ID.',
    '- account-security: Use for suspicious logins, account takeover, or session revocation.',
    '- refund-policy: Read before issuing refunds. Eligibility rules and approval limits.',
    '- returns: Use for returning or exchanging an item, return labels, or the return window.',
    '- shipping-delays: Use when a package is late, stuck in transit, or marked delivered but not received.',
    '- warranty: Use for defective or broken items and warranty claims within the first year.',
]
HIGH_EFFORT = {'extra_body': {'reasoning_effort': 'high'}}
SECURITY_INSTRUCTIONS = 'Confirm the customer identity before revoking sessions.'
ORDERS_INSTRUCTIONS = 'Quote the order ID and item name when discussing an order.'
REFUND_POLICY = (
    'Refunds over $500 require manager approval. Refunds outside the 30-day window require a documented exception.'
)
REVOKED = 'Revoked sessions for acct-42. Please change your password and turn on two-factor authentication.'
ESCALATED = (
    'I could not revoke the sessions for acct-42 myself; I have escalated your account to our security team, '
    'who will contact you within the hour.'
)

# Known upstream gap (pydantic-ai 2.68): Temporal's payload converter serializes an `InstructionId`
# without its field-level JSON serializer, and `CapabilityInstructionSource` comes back as the first
# member of the undiscriminated union, `ToolsetInstructionSource` (see test_temporal_model_sees_the_catalog_as_local).
UPSTREAM_TEMPORAL_ID = 'upstream bug (pydantic-ai 2.68): on Temporal, a CapabilityInstructionSource crosses the activity ' \
    'boundary as ToolsetInstructionSource, so the model sees <pyai:context id="toolset:deferred_capabilities">'


# ---- running the driver --------------------------------------------------------------------------


def _postgres_database() -> str:
    return create_database('durcap_seed')


def _drop_postgres_database(name: str) -> None:
    drop_database(name)


def _drive(args: list[str], env: dict[str, str], out_dir: Path) -> dict[str, Any]:
    """Run the seed driver in its own process group; stopped by pid if it outlives the timeout."""
    log = out_dir / 'driver.log'
    with open(log, 'wb') as handle:
        popen = subprocess.Popen(
            [sys.executable, '-m', 'tests.engines.seed_driver', *args, '--out-dir', str(out_dir)],
            cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            env=subprocess_env(env),
        )
    try:
        popen.wait(timeout=DRIVER_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=30)
    text = log.read_text(errors='replace')
    for line in text.splitlines():
        if line.startswith('REPORT '):
            return json.loads(line.removeprefix('REPORT '))
    raise AssertionError(f'seed driver {args} gave no report (exit {popen.returncode}):\n{text[-6000:]}')


@pytest.fixture(scope='module')
def seed_report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], dict[str, Any]]]:
    """`seed_report(variant)`: the driver's report for one engine variant, run once per module.

    Variants: the four of `ENGINES`, and `prefect-slow-events` (the `capability` example on Prefect with
    each client event emitted 0.2 s late).
    """
    reports: dict[str, dict[str, Any] | str] = {}
    databases: list[str] = []

    def get(variant: str) -> dict[str, Any]:
        if variant not in reports:
            out_dir = tmp_path_factory.mktemp(f'seed-{variant}')
            prefix = f'seed-{variant}-{uuid.uuid4().hex[:6]}'
            env: dict[str, str] = {}
            if variant == 'temporal':
                args = ['temporal', '--address', request.getfixturevalue('temporal_address')]
            elif variant == 'dbos-sqlite':
                args = ['dbos', '--db', f'sqlite:///{out_dir / "dbos.sqlite"}']
            elif variant == 'dbos-postgres':
                databases.append(_postgres_database())
                args = ['dbos', '--db', f'postgresql://postgres@127.0.0.1:5432/{databases[-1]}']
            elif variant.startswith('prefect'):
                args = ['prefect']
                if variant == 'prefect-slow-events':
                    args += ['--examples', 'capability', '--prefect-event-delay', '0.2']
                env = {
                    'PREFECT_API_URL': request.getfixturevalue('prefect_api_url'),
                    'PREFECT_HOME': str(out_dir / 'prefect-home'),
                    'PREFECT_LOCAL_STORAGE_PATH': str(out_dir / 'prefect-results'),
                }
            else:
                raise ValueError(variant)
            try:
                reports[variant] = _drive([*args, '--prefix', prefix], env, out_dir)
            except AssertionError as exc:
                reports[variant] = str(exc)
        report = reports[variant]
        if isinstance(report, str):
            pytest.fail(report, pytrace=False)
        return report

    try:
        yield get
    finally:
        for name in databases:
            _drop_postgres_database(name)


def example(seed_report: Callable[[str], dict[str, Any]], engine: str, name: str) -> dict[str, Any]:
    entry = seed_report(engine)['examples'][name]
    assert entry['error'] is None, entry['error']
    return entry


def runs(entry: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {run['label']: run for run in entry['engine']}


# ---- what the model saw --------------------------------------------------------------------------


def expected_instructions(base: str, catalog: list[str], context_id: str = 'capability:deferred_capabilities') -> str:
    return f'{base}\n\n<pyai:context id="{context_id}">\n{CATALOG_HEADER}\n' + '\n'.join(catalog) + f'\n</pyai:context>\n{CATALOG_TRAILER}'


def assert_catalog(instructions: str | None, base: str, catalog: list[str]) -> None:
    """The instructions are the base instructions plus the catalog block, whatever the block's context id."""
    assert instructions is not None
    match = re.fullmatch(r'(?s)(.*)\n\n<pyai:context id="([^"]+)">\n(.*)\n</pyai:context>\n(.*)', instructions)
    assert match is not None, instructions
    assert match.group(1) == base
    assert match.group(2).endswith(':deferred_capabilities')
    assert match.group(3) == '\n'.join([CATALOG_HEADER, *catalog])
    assert match.group(4) == CATALOG_TRAILER


def normalize_upstream_ids(value: Any) -> Any:
    """Undo the known upstream relabelling (`toolset:` for `capability:` on Temporal) in strings."""
    if isinstance(value, str):
        return value.replace('toolset:', 'capability:')
    if isinstance(value, list):
        return [normalize_upstream_ids(v) for v in value]
    if isinstance(value, dict):
        return {k: normalize_upstream_ids(v) for k, v in value.items()}
    return value


def model_view(run: dict[str, Any]) -> dict[str, Any]:
    return {k: run[k] for k in ('output', 'requests', 'loaded', 'ledger')}


def retries(run: dict[str, Any], tool: str) -> list[str]:
    """Contents of the calls of `tool` sent back to the model (hook or tool `ModelRetry`)."""
    found = []
    for message in run['new_messages']:
        for part in message['parts']:
            if part.get('tool_name') != tool:
                continue
            if part['part_kind'] == 'retry-prompt' or (part['part_kind'] == 'tool-return' and part.get('outcome') != 'success'):
                found.append(part['content'])
    return found


def instruction_parts(run: dict[str, Any]) -> list[str]:
    labels = []
    for message in run['new_messages']:
        for part in message['parts']:
            if part['part_kind'] == 'instruction-delta':
                labels.append(f'delta@{part["id"]}')
            elif part['part_kind'] == 'instruction-baseline':
                labels.extend(f'baseline@{i["id"]}' for i in part['instructions'])
    return labels


# ---- the durable units each engine recorded ------------------------------------------------------

M = ('model',)


def T(toolset: str, tool: str) -> tuple[str, str, str]:
    return ('tool', toolset, tool)


def unit_names(engine: str, agent: str, sequence: list[tuple[str, ...]]) -> list[str]:
    """Exact unit names: Temporal activity types, DBOS step names, Prefect task names (run name minus suffix)."""
    family = engine.split('-')[0]
    names = []
    for item in sequence:
        if family == 'temporal':
            names.append(f'agent__{agent}__model_request' if item == M else f'agent__{agent}__toolset__{item[1]}__call_tool')
        elif family == 'dbos':
            names.append(f'{agent}__model.request' if item == M else f'{agent}__function_toolset__{item[1]}.call_tool')
        else:
            # Tool task runs are named `{capability}.{tool}` (`engines.prefect.tool_run_namer`; each example's
            # capabilities have one leaf, named after the capability); agent-level tools after the agent.
            owner = agent if item != M and item[1] == '<agent>' else (item[1] if item != M else '')
            names.append('Model Request: scripted-support' if item == M else f'{owner}.{item[2]}')
    return names


def recorded_units(engine: str, run: dict[str, Any]) -> list[str]:
    """What the engine recorded. Prefect: every task run of the flow run once the server listed them all
    (`settled_units`); a task run with Prefect's default name (the task name, with spaces) is checked for Prefect's
    3-character run suffix and stripped of it; a tool call's run name (`{capability}.{tool}`) is kept."""
    if not engine.startswith('prefect'):
        assert run['settled_units'] == run['units']
        return run['units']
    names = []
    for name in run['settled_units']:
        if ' ' not in name:
            assert re.fullmatch(r'[\w<>-]+\.\w+', name), name
            names.append(name)
            continue
        assert re.fullmatch(r'.+-[0-9a-f]{3}', name), name
        names.append(name[:-4])
    return names


# ---- every example: the engine run shows the model what the local run shows ---------------------


def _view_params() -> list[Any]:
    params = []
    for engine in ENGINES:
        for name in EXAMPLES:
            params.append(pytest.param(engine, name, id=f'{engine}-{name}'))
    return params


@pytest.mark.parametrize(('engine', 'name'), _view_params())
def test_model_view_matches_the_local_run(seed_report, engine: str, name: str) -> None:
    """Request by request, the model got the same tools, instructions, settings, capability instructions and
    message parts as on the local engine, answered the same, and the tools ran as often (ledger)."""
    entry = example(seed_report, engine, name)
    assert [r['label'] for r in entry['engine']] == [r['label'] for r in entry['local']]
    for engine_run, local_run in zip(entry['engine'], entry['local'], strict=True):
        engine_view = model_view(engine_run)
        if engine == 'temporal':
            engine_view = normalize_upstream_ids(engine_view)
        assert engine_view == model_view(local_run), engine_run['label']


@pytest.mark.xfail(strict=True, reason=UPSTREAM_TEMPORAL_ID)
def test_temporal_model_sees_the_catalog_as_local(seed_report) -> None:
    """Byte for byte: on Temporal the catalog block is labelled `toolset:deferred_capabilities`."""
    entry = example(seed_report, 'temporal', 'skills')
    assert entry['engine'][0]['requests'][0]['instructions'] == entry['local'][0]['requests'][0]['instructions']


# ---- (1) a deferred `Capability` with `tool_plain` and `tool(ctx)` -------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_capability_with_plain_and_context_tools(seed_report, engine: str) -> None:
    entry = example(seed_report, engine, 'capability')
    run = runs(entry)['main']
    first, *after = run['requests']
    # Request 1: only the loader; the catalog (one line) in the instructions; no capability instructions.
    assert first['tools'] == ['load_capability']
    assert_catalog(first['instructions'], SEED_BASE, ['- refunds: Use for refund eligibility, refund status, or processing a refund.'])
    assert 'Always confirm the order ID' not in first['instructions']
    assert first['context'] == {}
    assert first['response'] == 'load_capability(refunds)'
    # After the load: both tools, the capability's instructions delivered in the messages.
    assert len(after) == 3
    for request in after:
        assert request['tools'] == ['load_capability', 'refund_status', 'refund_eligibility']
        assert request['context'] == {'refunds': 'Always confirm the order ID before issuing a refund.'}
        assert request['model_settings'] is None
    assert [r['response'] for r in after] == [
        "refund_status(order_id='ABC-123')",
        "refund_eligibility(order_id='ABC-123')",
        'text: Order ABC-123: refund issued on 2026-05-01. Order ABC-123 is eligible for a refund (step 3, loaded: refunds).',
    ]
    # Each tool ran once; the ctx tool saw the run step and the loaded capability inside its durable unit.
    assert run['ledger'] == [
        {'tool': 'refund_status', 'order_id': 'ABC-123'},
        {'tool': 'refund_eligibility', 'order_id': 'ABC-123', 'run_step': 3, 'loaded': ['refunds']},
    ]
    assert run['loaded'] == ['refunds']
    assert recorded_units(engine, run) == unit_names(
        engine, entry['name'], [M, M, T('refunds', 'refund_status'), M, T('refunds', 'refund_eligibility'), M]
    )


# ---- (2) the AccountSecurity subclass: model settings and the approval hook ----------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_account_security_settings_and_hook(seed_report, engine: str) -> None:
    entry = example(seed_report, engine, 'account-security')
    approved, denied = runs(entry)['approved'], runs(entry)['denied']
    for run in (approved, denied):
        first, *after = run['requests']
        assert sorted(first['tools']) == ['issue_refund', 'load_capability']
        assert_catalog(first['instructions'], SUPPORT_BASE, SUPPORT_CATALOG)
        assert SECURITY_INSTRUCTIONS not in first['instructions']
        assert first['context'] == {}
        # Reasoning effort only after the load, on every later request of the run.
        assert first['model_settings'] is None
        assert first['response'] == 'load_capability(account-security)'
        assert len(after) == 2
        for request in after:
            assert sorted(request['tools']) == ['issue_refund', 'load_capability', 'revoke_sessions']
            assert request['model_settings'] == HIGH_EFFORT
            assert request['context'] == {'account-security': SECURITY_INSTRUCTIONS}
        assert after[0]['response'] == "revoke_sessions(account_id='acct-42')"
        assert run['loaded'] == ['account-security']

    # Approved: the tool ran in its durable unit and the model got its result.
    assert approved['output'] == REVOKED
    assert retries(approved, 'revoke_sessions') == []
    assert recorded_units(engine, approved) == unit_names(
        engine, entry['name'], [M, M, T('account-security', 'revoke_sessions'), M]
    )
    # Denied by the deps: the hook ran (on Temporal in workflow code), bounced the call, and no tool unit ran.
    assert retries(denied, 'revoke_sessions') == [
        'An operator denied `revoke_sessions`; escalate to the security team instead.'
    ]
    assert denied['output'] == ESCALATED
    assert recorded_units(engine, denied) == unit_names(engine, entry['name'], [M, M, M])


# ---- (3) orders + account-security with `Store` deps, one conversation in two turns --------------


@pytest.mark.parametrize('engine', ENGINES)
def test_orders_and_account_security_with_store_deps(seed_report, engine: str) -> None:
    entry = example(seed_report, engine, 'orders-security')
    order, security = runs(entry)['order'], runs(entry)['security']

    # Turn 1: orders only. The deps' order book reached the tool (on Temporal serialized into the
    # activity); the deps also ask the approval hook to deny `order_status`, which it does not, since
    # `account-security` is not loaded: a deferred hook stays dormant.
    first, *after = order['requests']
    assert sorted(first['tools']) == ['issue_refund', 'load_capability']
    assert_catalog(first['instructions'], SUPPORT_BASE, SUPPORT_CATALOG)
    assert first['response'] == 'load_capability(orders)'
    for request in after:
        assert sorted(request['tools']) == ['issue_refund', 'load_capability', 'order_status']
        assert request['context'] == {'orders': ORDERS_INSTRUCTIONS}
    assert [r['model_settings'] for r in order['requests']] == [None, None, None]
    assert retries(order, 'order_status') == []
    assert order['output'] == f'Order XYZ-321: {ORDER_LINE}'
    assert order['loaded'] == ['orders']
    assert recorded_units(engine, order) == unit_names(engine, entry['name'], [M, M, T('orders', 'order_status'), M])

    # Turn 2, resumed from turn 1's messages: `orders` is still loaded (its tool offered from the first
    # request, no new load), `account-security` loads, and only then the reasoning effort.
    first, *after = security['requests']
    assert sorted(first['tools']) == ['issue_refund', 'load_capability', 'order_status']
    assert first['context'] == {'orders': ORDERS_INSTRUCTIONS}
    assert first['model_settings'] is None
    assert first['response'] == 'load_capability(account-security)'
    for request in after:
        assert sorted(request['tools']) == ['issue_refund', 'load_capability', 'order_status', 'revoke_sessions']
        assert request['context'] == {'orders': ORDERS_INSTRUCTIONS, 'account-security': SECURITY_INSTRUCTIONS}
        assert request['model_settings'] == HIGH_EFFORT
    assert security['output'] == REVOKED
    assert security['loaded'] == ['account-security']
    assert recorded_units(engine, security) == unit_names(
        engine, entry['name'], [M, M, T('account-security', 'revoke_sessions'), M]
    )


def _history_params() -> list[Any]:
    return [
        pytest.param(e)
        for e in ENGINES
    ]


@pytest.mark.parametrize('engine', _history_params())
def test_resumed_conversation_adds_only_the_new_capability_instructions(seed_report, engine: str) -> None:
    """The history an engine returns keeps pydantic-ai's instruction ids, so resuming it delivers only what
    the new turn loads, as on the local engine (not the catalog and `orders` again)."""
    entry = example(seed_report, engine, 'orders-security')
    order, security = runs(entry)['order'], runs(entry)['security']
    assert instruction_parts(order) == [
        'baseline@agent', 'baseline@capability:deferred_capabilities', 'delta@capability:orders'
    ]
    assert instruction_parts(security) == ['delta@capability:account-security']


# ---- (4) read-before-act: `RunbookRequired` with `refund-policy` and `issue_refund` ---------------


@pytest.mark.parametrize('engine', ENGINES)
def test_runbook_required_bounces_until_the_policy_is_loaded(seed_report, engine: str) -> None:
    entry = example(seed_report, engine, 'runbook')
    refund, over_limit = runs(entry)['refund'], runs(entry)['over-limit']
    bounce = (
        "Call the `load_capability` tool with `id='refund-policy'` and follow its guidance before calling `issue_refund`."
    )
    for run, amount in ((refund, 40.0), (over_limit, 900.0)):
        first, second, third, *_ = run['requests']
        # The always-on agent tool is offered from turn 1, next to the loader; the catalog has the runbook only.
        for request in run['requests']:
            assert sorted(request['tools']) == ['issue_refund', 'load_capability']
            assert request['model_settings'] is None
        assert_catalog(first['instructions'], SEED_BASE, ['- refund-policy: Read before issuing refunds. Eligibility rules and approval limits.'])
        assert first['context'] == {}
        assert first['response'] == f"issue_refund(order_id='ABC-123', amount={amount!r})"
        # The hook (on Temporal in workflow code) bounced the call with the load to make.
        assert second['response'] == 'load_capability(refund-policy)'
        assert third['context'] == {'refund-policy': REFUND_POLICY}
        assert retries(run, 'issue_refund') == [bounce]
        assert run['loaded'] == ['refund-policy']

    assert refund['requests'][2]['response'] == "issue_refund(order_id='ABC-123', amount=40.0)"
    assert refund['output'] == 'Refund of $40.0 issued for ABC-123. It will reach your original payment method in 5-7 business days.'
    assert refund['ledger'] == [{'tool': 'issue_refund', 'order_id': 'ABC-123', 'amount': 40.0}]
    # The agent's own tools form the toolset upstream names `<agent>`.
    assert recorded_units(engine, refund) == unit_names(engine, entry['name'], [M, M, M, T('<agent>', 'issue_refund'), M])

    # Over the policy's limit: the model read the policy and never issued the refund.
    assert over_limit['output'].startswith('A refund of $900.00 for ABC-123 needs manager approval')
    assert over_limit['ledger'] == []
    assert recorded_units(engine, over_limit) == unit_names(engine, entry['name'], [M, M, M])


# ---- (5) skills loaded from Markdown ------------------------------------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_skills_from_markdown(seed_report, engine: str) -> None:
    entry = example(seed_report, engine, 'skills')
    run = runs(entry)['warranty']
    first, second = run['requests']
    assert first['tools'] == ['load_capability']
    assert_catalog(first['instructions'], SEED_BASE, [
        '- refunds: Use for refund eligibility, refund status, or processing a refund.',
        '- returns: Use for returning or exchanging an item, return labels, or the return window.',
        '- shipping-delays: Use when a package is late, stuck in transit, or marked delivered but not received.',
        '- warranty: Use for defective or broken items and warranty claims within the first year.',
    ])
    assert 'Every item carries a 12-month warranty' not in first['instructions']
    assert first['context'] == {}
    assert first['response'] == 'load_capability(warranty)'
    # A skill has no tools: nothing new is offered, only its body is delivered.
    assert second['tools'] == ['load_capability']
    warranty = (ROOT / 'examples' / 'support' / 'skills' / 'warranty.md').read_text().split('---', 2)[2].strip()
    assert second['context'] == {'warranty': warranty}
    assert [r['model_settings'] for r in run['requests']] == [None, None]
    assert run['output'] == (
        'Thanks for reaching out about GHI-789. Every item carries a 12-month warranty against manufacturing '
        'defects, counted from the delivery date.'
    )
    assert run['loaded'] == ['warranty']
    # `load_capability` runs in workflow / flow code: only the two model requests are durable units.
    assert recorded_units(engine, run) == unit_names(engine, entry['name'], [M, M])


# ---- Prefect: the units the runner reports ------------------------------------------------------


def test_prefect_runner_reports_every_task_run_of_the_flow_run(seed_report) -> None:
    """With the client's events 0.2 s late (a loaded server), `runner.run(engine='prefect')` must still list every task run."""
    run = runs(example(seed_report, 'prefect-slow-events', 'capability'))['main']
    assert len(run['settled_units']) == 6
    assert run['units'] == run['settled_units']
