"""One source of durable names: the lock lists what each engine registers, on the support example.

Real parts: the Temporal dev server (`temporal_address`), DBOS on SQLite, the Prefect server
(`prefect_api_url`); each engine in its own process (`names_driver.py`). The model is the example's
scripted `FunctionModel`.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities.engines import DURABLE_ENGINES
from tests._helpers import ROOT, subprocess_env


def probe(engine: str, out: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `names_driver ENGINE` to completion (killed at the timeout) and return its report."""
    result = subprocess.run(
        [sys.executable, '-m', 'tests.engines.names_driver', engine, '--out', str(out), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
        env=subprocess_env({'PYTHONHASHSEED': '0', **(env or {})}),
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith('REPORT ')]
    assert result.returncode == 0 and lines, f'exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}'
    return json.loads(lines[-1].removeprefix('REPORT '))


def test_every_durable_engine_has_a_names_probe() -> None:
    """`names_driver` (and one test below) covers each durable engine: a new engine's lock cannot go unchecked."""
    from tests.engines.names_driver import DRIVERS

    assert set(DRIVERS) == set(DURABLE_ENGINES)


def test_temporal_lock_is_exactly_what_the_worker_registers(temporal_address: str, tmp_path: Path) -> None:
    report = probe('temporal', tmp_path, '--address', temporal_address)
    assert report['lock'] == report['registered']
    assert 'agent__support__conversation_load' in report['lock']['activities']
    assert report['lock']['workflows'] == ['durcap.support']


def test_dbos_lock_is_exactly_the_registered_and_wrapped_steps(tmp_path: Path) -> None:
    report = probe('dbos', tmp_path)
    lock, registered = report['lock'], report['registered']
    assert lock['workflows'] == registered['workflows'] == ['durcap.support']
    conversation = ['durcap__support__conversation.append', 'durcap__support__conversation.load',
                    'durcap__support__approval.clock']
    # Upstream's registered steps, the function-tool steps `ToolStepDurability` names, the two conversation steps and
    # the approval clock step (a run waiting for a person): nothing more, nothing less.
    assert sorted({*registered['steps'], *report['tool_steps'], *conversation}) == lock['steps']
    assert registered['steps'] and report['tool_steps']
    # The tool steps and the model request's durable retry-after wait (issue 15) come from the durability capability
    # itself: no capability is added to the hook chain for them, and each leaf's step wrapper is built once, not per
    # run.
    assert report['hook_chain']['dbos'] == [*report['hook_chain']['local'], 'ToolStepDurability']
    assert report['steps_kept']
    # And a real run only records steps the lock lists.
    assert report['recorded'], 'the run recorded no steps'
    assert set(report['recorded']) <= set(lock['steps']), set(report['recorded']) - set(lock['steps'])
    assert 'support__function_toolset__orders.call_tool' in report['recorded']


def test_prefect_lock_names_the_flow_and_every_task_a_run_creates(prefect_api_url: str, tmp_path: Path) -> None:
    report = probe('prefect', tmp_path, env={'PREFECT_API_URL': prefect_api_url})
    lock = report['lock']
    assert lock['flows'] == report['registered']['flows'] == ['durcap-support']
    # A task run is named `{task name}-{3 hex digits}` (Prefect's default run name), except a tool call's, which
    # names its capability and tool (`engines.prefect.tool_run_namer`): map it back to its task, `Call Tool: {tool}`.
    tools = {f'{cap}.{tool}': f'Call Tool: {tool}' for cap in ('orders', 'account-security', 'refund-policy', 'support')
             for tool in ('order_status', 'revoke_sessions', 'issue_refund')}
    assert 'orders.order_status' in report['recorded'], report['recorded']
    recorded = [tools.get(name) or re.sub(r'-[0-9a-f]{3}$', '', name) for name in report['recorded']]
    assert recorded, 'the run recorded no task runs'
    # Model requests carry the model's name after the locked prefix (upstream's `Model Request: {model}`).
    model_request = f'Model Request: {report["model"]}'
    unlocked = [name for name in recorded if name not in lock['tasks'] and name != model_request]
    assert unlocked == []
    assert model_request in recorded and 'Model Request' in lock['tasks']
    assert 'Call Tool: order_status' in recorded
    # The conversation's load and append run in the flow's code (no task run); their tasks of earlier versions are
    # locked as recovered tasks (resumed runs recorded before read them), never run by a new run.
    assert not {'Load Conversation', 'Append Conversation'} & set(recorded), recorded
    assert lock['recovered_tasks'] == ['Append Conversation', 'Load Conversation']


@pytest.mark.parametrize('engine', DURABLE_ENGINES)
def test_lockfile_sections_come_from_the_adapter(engine: str) -> None:
    """`durable.lock`'s entry per engine is the adapter's `durable_names`, in the adapter's sections."""
    from durable_capabilities.engines import get
    from durable_capabilities.lockfile import lock_data
    from examples.support.agent import support

    entry = lock_data([support])['agents']['support'][engine]
    adapter = get(engine)
    assert list(entry) == list(adapter.lock_sections)
    assert entry == adapter.durable_names(support)


RETRY_AFTER_CHAINS = '''
import json
from pydantic_ai import Agent
from pydantic_ai.capabilities import Capability, ModelFallback
from pydantic_ai.models.function import FunctionModel, AgentInfo
from pydantic_ai.messages import ModelResponse, TextPart
from durable_capabilities import DurableAgent
from durable_capabilities.engines import dbos as engine

def answer(messages, info: AgentInfo) -> ModelResponse:
    return ModelResponse(parts=[TextPart('ok')])

def stamp(order_id: str) -> str:
    """Stamp an order."""
    return order_id

def chain(agent):
    found = []
    agent.build('dbos').root_capability.apply(found.append)
    durability = next(c for c in found if isinstance(c, engine.ToolStepDurability))
    names = [type(c.wrapped if type(c).__name__ == 'StableIdCapability' else c).__name__ for c in found]
    return {'chain': names, 'folded': isinstance(durability.retry_after, engine.RetryAfterSleep),
            'attempts': durability.retry_after.max_attempts if durability.retry_after else None}

tools = Capability(id='orders', tools=[stamp])
plain = DurableAgent('retry-after-plain', FunctionModel(answer), capabilities=[tools])
fallback = DurableAgent('retry-after-fallback', FunctionModel(answer),
                        capabilities=[tools, ModelFallback([FunctionModel(answer)])])
print(json.dumps({'plain': chain(plain), 'fallback': chain(fallback)}))
'''


def test_dbos_retry_after_wait_adds_no_capability_unless_one_handles_model_request_errors() -> None:
    """The DBOS `retry-after` wait (`RetryAfterSleep`) runs from the durability capability's own
    `on_model_request_error`: one capability fewer on every hook of every run (a `RunContext` copy and a pass-through
    call each). With a capability that handles model request errors itself (`ModelFallback`), it stays a capability of
    its own, where it was before: pydantic-ai calls error handlers innermost first, and run from the (innermost)
    durability capability the wait would come before the fallback's move to its next model. The wait itself is exercised against a real provider 429 in
    `test_providers.py::test_429_then_success_and_a_cut_stream[dbos]`. Run in a subprocess: building a DBOS agent
    registers its steps in DBOS's process-wide registry."""
    done = subprocess.run([sys.executable, '-c', RETRY_AFTER_CHAINS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    plain, fallback = report['plain'], report['fallback']
    assert 'RetryAfterSleep' not in plain['chain'] and plain['folded'] and plain['attempts'] == 3, plain
    assert plain['chain'][-1] == 'ToolStepDurability', plain
    assert not fallback['folded'], fallback
    assert 'ModelFallback' in fallback['chain'], fallback
    assert fallback['chain'][-2:] == ['RetryAfterSleep', 'ToolStepDurability'], fallback  # as before the fold
