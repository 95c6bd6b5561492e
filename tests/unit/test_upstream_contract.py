"""The private pydantic-ai names `durable_capabilities._upstream` relies on, and the behaviour behind each.

Every assertion says what changed upstream when it fails. When one fails after a pydantic-ai upgrade, fix
`_upstream.py` (and only it), then this file.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib
import importlib.metadata
import inspect
import sys
import uuid
from pathlib import Path
from typing import Any

import pydantic_ai
import pytest
import temporalio.workflow
from pydantic_ai import Agent, RunContext
from pydantic_ai.capabilities import MCP, AbstractCapability, Capability
from pydantic_ai.exceptions import UserError
from pydantic_ai.mcp import MCPToolset
from pydantic_ai.messages import (
    ModelMessage,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.toolsets import AbstractToolset, FunctionToolset

from durable_capabilities import _upstream

UPGRADE_HINT = 'pydantic-ai {version}: {what} -- update durable_capabilities/_upstream.py'


def changed(what: str) -> str:
    return UPGRADE_HINT.format(version=pydantic_ai.__version__, what=what)


def temporal_activity_names(agent: Agent[Any, Any]) -> list[str]:
    from pydantic_ai.durable_exec.temporal import TemporalDurability

    durability = TemporalDurability.from_agent(agent)
    assert durability is not None
    return [_upstream.temporal_activity_name(fn) for fn in durability.temporal_activities]


def temporal() -> Any:
    from pydantic_ai.durable_exec.temporal import TemporalDurability

    return TemporalDurability()


def ping(x: int) -> str:
    """Ping."""
    return f'pong {x}'


def call_then_answer(tool: str, args: dict[str, Any], seen_tools: list[list[str]] | None = None) -> FunctionModel:
    def respond(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        if seen_tools is not None:
            seen_tools.append([t.name for t in info.function_tools])
        returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
        if not returns:
            return ModelResponse(parts=[ToolCallPart(tool, args)])
        return ModelResponse(parts=[TextPart(str(returns[-1].content))])

    return FunctionModel(respond)


# ---- pydantic_ai.toolsets._deferred_capability_loader.LOAD_CAPABILITY_TOOL_NAME ------------------------------------


def test_load_capability_tool_name_is_importable_and_unchanged() -> None:
    try:
        module = importlib.import_module('pydantic_ai.toolsets._deferred_capability_loader')
    except ImportError as exc:  # pragma: no cover - only on an upstream change
        pytest.fail(changed(f'module pydantic_ai.toolsets._deferred_capability_loader is gone ({exc})'))
    assert getattr(module, 'LOAD_CAPABILITY_TOOL_NAME', None) == 'load_capability', changed(
        'LOAD_CAPABILITY_TOOL_NAME was renamed or no longer names the tool `load_capability`'
    )
    assert _upstream.LOAD_CAPABILITY_TOOL_NAME == 'load_capability'


def test_load_capability_is_the_tool_upstream_adds_and_reserves() -> None:
    deferred = Capability(id='orders', description='Orders.', instructions='Quote ids.', defer_loading=True)
    seen_tools: list[list[str]] = []
    agent = Agent(call_then_answer(_upstream.LOAD_CAPABILITY_TOOL_NAME, {'id': 'orders'}, seen_tools), capabilities=[deferred])
    result = asyncio.run(agent.run('go'))
    assert _upstream.LOAD_CAPABILITY_TOOL_NAME in seen_tools[0], changed(
        f'the tool added for deferred capabilities is no longer {_upstream.LOAD_CAPABILITY_TOOL_NAME!r}: {seen_tools[0]}'
    )
    assert 'orders' in result.output

    def load_capability(name: str) -> str:
        """A user tool that takes the reserved name."""
        return name

    clashing = Agent(call_then_answer('load_capability', {'name': 'x'}), capabilities=[deferred], tools=[load_capability])
    with pytest.raises(UserError, match='reserved'):
        asyncio.run(clashing.run('go'))


# ---- pydantic_ai.toolsets._dynamic.DynamicToolset --------------------------------------------------------------------


def test_dynamic_toolset_private_path_and_constructor() -> None:
    try:
        from pydantic_ai.toolsets._dynamic import DynamicToolset
    except ImportError as exc:  # pragma: no cover
        pytest.fail(changed(f'pydantic_ai.toolsets._dynamic.DynamicToolset is gone ({exc})'))
    assert _upstream.DynamicToolset is DynamicToolset
    from pydantic_ai.toolsets import DynamicToolset as public

    assert public is DynamicToolset, changed('the public DynamicToolset is no longer the one in toolsets._dynamic')

    params = inspect.signature(DynamicToolset).parameters
    assert list(params)[:1] == ['toolset_func'], changed(f'DynamicToolset signature is now {list(params)}')
    assert params['per_run_step'].default is True, changed('DynamicToolset(per_run_step=...) default changed')
    assert params['id'].default is None, changed('DynamicToolset(id=...) default changed')

    def factory(ctx: RunContext[Any]) -> None:
        return None

    toolset = DynamicToolset(factory, per_run_step=False, id='dyn')
    assert (toolset.toolset_func, toolset.per_run_step, toolset.id) == (factory, False, 'dyn'), changed(
        'DynamicToolset no longer exposes toolset_func / per_run_step / id as given'
    )
    assert toolset._explicit_id == 'dyn'  # pyright: ignore[reportPrivateUsage]

    copy_ = _upstream.toolset_with_id(DynamicToolset(factory, per_run_step=False), 'new')
    assert isinstance(copy_, DynamicToolset)
    assert (copy_.toolset_func, copy_.per_run_step, copy_.id) == (factory, False, 'new')


def test_capability_toolset_function_is_re_evaluated_every_step() -> None:
    """`StableIdCapability` wraps a toolset *function* like upstream does: `DynamicToolset(func)`, per run step."""
    calls: list[int] = []

    def tools_for_step(ctx: RunContext[Any]) -> FunctionToolset[Any]:
        calls.append(ctx.run_step)
        return FunctionToolset([ping])

    class FunctionToolsetCapability(AbstractCapability[Any]):
        def get_toolset(self) -> Any:
            return tools_for_step

    agent = Agent(call_then_answer('ping', {'x': 1}), capabilities=[FunctionToolsetCapability()])
    result = asyncio.run(agent.run('go'))
    assert result.output == 'pong 1'
    assert len(set(calls)) >= 2, changed(
        f'a capability toolset function is no longer evaluated per run step (steps seen: {calls}); '
        'ids.StableIdCapability must wrap it with the same per_run_step'
    )


def test_interchangeable_leaves_match_what_upstream_rebuilds_per_call() -> None:
    """`Capability(toolsets=[func])` and `WebSearch(local=func)` build new leaves on every `get_toolset()` call;
    `StableIdCapability` hands out the first again only when `interchangeable_leaves` says they behave the same.
    If upstream starts caching them (the same object), the first assertions change and the interning can go."""
    from pydantic_ai.capabilities import WebSearch
    from pydantic_ai.toolsets import DynamicToolset

    def factory(ctx: RunContext[Any]) -> None:
        return None

    capability = Capability(id='x', toolsets=[factory])
    first, second = capability.get_toolset(), capability.get_toolset()
    assert isinstance(first, DynamicToolset) and first is not second, changed('Capability(toolsets=[func]) now caches')
    assert _upstream.interchangeable_leaves(first, second)
    assert not _upstream.interchangeable_leaves(first, DynamicToolset(factory, id='y'))
    assert not _upstream.interchangeable_leaves(first, DynamicToolset(factory, id='x_0', per_run_step=False))

    web = WebSearch(local=ping, native=False, id='web')
    one, two = web.get_toolset(), web.get_toolset()
    assert isinstance(one, FunctionToolset) and one is not two, changed('WebSearch(local=func) now caches its toolset')
    assert set(vars(one)) >= {'tools', '_id', 'max_retries'}, changed(f'FunctionToolset attributes are now {sorted(vars(one))}')
    assert _upstream.interchangeable_leaves(one, two)
    assert not _upstream.interchangeable_leaves(one, FunctionToolset([ping], id='web'))  # another Tool object
    other = FunctionToolset(list(one.tools.values()), id='web', max_retries=5)
    assert not _upstream.interchangeable_leaves(one, other)  # same Tool, another setting


# ---- AbstractToolset._explicit_id --------------------------------------------------------------------------------------


def test_explicit_id_property_semantics() -> None:
    assert isinstance(inspect.getattr_static(AbstractToolset, '_explicit_id', None), property), changed(
        'AbstractToolset._explicit_id is no longer a property'
    )
    assert _upstream.explicit_toolset_id(FunctionToolset(id='x')) == 'x'
    assert _upstream.explicit_toolset_id(FunctionToolset()) is None

    derived = MCPToolset('http://mcp.internal:8001/mcp')
    assert derived.id == 'mcp.internal', changed(f'MCPToolset derives id {derived.id!r}, not the hostname')
    assert _upstream.explicit_toolset_id(derived) is None, changed('a URL-derived MCPToolset id now counts as explicit')
    assert _upstream.explicit_toolset_id(MCPToolset('http://mcp.internal/mcp', id='kb')) == 'kb'


def test_durability_names_units_after_the_explicit_id_only() -> None:
    with pytest.raises(UserError, match='unique `id`'):
        Agent('test', name='contract-derived', toolsets=[MCPToolset('http://mcp.internal/mcp')], capabilities=[temporal()])
    agent = Agent(
        'test', name='contract-explicit', toolsets=[MCPToolset('http://mcp.internal/mcp', id='kb')], capabilities=[temporal()]
    )
    assert 'agent__contract-explicit__mcp_server__kb__call_tool' in temporal_activity_names(agent), changed(
        'Temporal activity names no longer follow agent__{name}__mcp_server__{explicit id}__call_tool'
    )


@temporalio.workflow.defn(name='contract.workflow-name')
class NamedWorkflow:
    @temporalio.workflow.run
    async def run(self) -> None:
        return None


def test_temporal_workflow_name_reads_the_registered_name() -> None:
    assert _upstream.temporal_workflow_name(NamedWorkflow) == 'contract.workflow-name', changed(
        'temporalio no longer keeps a workflow class its registered name in `_Definition`'
    )


def test_temporal_workflow_worker_keeps_its_deadlock_timeout_in_one_attribute() -> None:
    import inspect

    from temporalio.worker import _worker, _workflow

    assert 'self._deadlock_timeout_seconds = ' in inspect.getsource(_workflow._WorkflowWorker.__init__), changed(
        'temporalio no longer keeps its deadlock timeout in `_WorkflowWorker._deadlock_timeout_seconds`'
    )
    assert 'self._workflow_worker = _WorkflowWorker(' in inspect.getsource(_worker.Worker), changed(
        '`Worker` no longer keeps its workflow worker in `_workflow_worker`'
    )


# ---- FunctionToolset._id -----------------------------------------------------------------------------------------------


def test_function_toolset_id_lives_in_underscore_id_only() -> None:
    toolset = FunctionToolset([ping], id='zz-marker-id')
    holders = [name for name, value in vars(toolset).items() if value == 'zz-marker-id']
    assert holders == ['_id'], changed(f'FunctionToolset keeps its id in {holders}, not only `_id`')


def test_function_toolset_copy_with_new_id() -> None:
    original = FunctionToolset[Any]()
    clone = _upstream.toolset_with_id(original, 'copied')
    assert isinstance(clone, FunctionToolset)
    assert clone.id == 'copied' and _upstream.explicit_toolset_id(clone) == 'copied', changed(
        'setting FunctionToolset._id no longer sets its id'
    )
    assert original.id is None and _upstream.explicit_toolset_id(original) is None
    assert clone.tools is original.tools, changed('copy.copy(FunctionToolset) no longer shares the tools dict')

    @original.tool_plain
    def registered_later(x: int) -> str:
        """Registered on the original after copying."""
        return f'later {x}'

    agent = Agent(call_then_answer('registered_later', {'x': 2}), toolsets=[clone])
    assert asyncio.run(agent.run('go')).output == 'later 2'

    durable = Agent('test', name='contract-copy', toolsets=[clone], capabilities=[temporal()])
    assert 'agent__contract-copy__toolset__copied__call_tool' in temporal_activity_names(durable)


# ---- MCPToolset.id setter (public, but we rely on it marking the id explicit) --------------------------------------------


def test_mcp_toolset_copy_with_new_id() -> None:
    original = MCPToolset('http://mcp.internal/mcp')
    clone = _upstream.toolset_with_id(original, 'kb')
    assert isinstance(clone, MCPToolset)
    assert clone.id == 'kb' and _upstream.explicit_toolset_id(clone) == 'kb', changed(
        'assigning MCPToolset.id no longer marks the id explicit'
    )
    assert original.id == 'mcp.internal' and _upstream.explicit_toolset_id(original) is None, changed(
        'copy.copy(MCPToolset) shares id state with the original'
    )


# ---- AbstractCapability._derived_id_source() ----------------------------------------------------------------------------


def test_derived_id_source_semantics() -> None:
    assert callable(getattr(AbstractCapability, '_derived_id_source', None)), changed(
        'AbstractCapability._derived_id_source() is gone'
    )
    assert _upstream.derived_id_source(Capability(id='x')) is None

    port_1 = _upstream.derived_id_source(MCP(url='http://u:s3cret@mcp.internal:8001/mcp'))
    port_2 = _upstream.derived_id_source(MCP(url='http://mcp.internal:8002/mcp'))
    other_path = _upstream.derived_id_source(MCP(url='http://mcp.internal:8001/other'))
    rotated = _upstream.derived_id_source(MCP(url='http://u:n3w@mcp.internal:8001/mcp'))
    assert isinstance(port_1, str) and 'mcp.internal' in port_1, changed(f'derived source is {port_1!r}')
    assert 's3cret' not in port_1, changed('the derived source now keeps URL credentials')
    assert len({port_1, port_2, other_path}) == 3, changed('derived sources no longer tell ports/paths apart')
    assert port_1 == rotated, changed('derived sources now differ by credentials only')
    assert _upstream.derived_id_source(MCP(url='http://mcp.internal/mcp', id='kb')) is None
    assert _upstream.derived_id_source(MCP(url='http://mcp.internal/mcp', description='d', defer_loading=True)) is None


def test_upstream_rejects_derived_ids_from_different_sources() -> None:
    """What DC005 mirrors: one derived id from two sources is an error at `Agent(...)`."""
    with pytest.raises(UserError, match='derived it from their configuration'):
        Agent('test', capabilities=[MCP(url='http://mcp.internal:8001/mcp'), MCP(url='http://mcp.internal:8002/mcp')])
    Agent('test', capabilities=[MCP(url='http://alpha.internal/mcp'), MCP(url='http://beta.internal/mcp')])


# ---- temporalio.activity._Definition (not pydantic-ai, but private all the same) ------------------------------------------


def test_temporal_activity_name_reads_the_registered_name() -> None:
    from temporalio import activity

    assert hasattr(activity, '_Definition') and hasattr(activity._Definition, 'must_from_callable'), (  # pyright: ignore[reportPrivateUsage]
        'temporalio changed: activity._Definition.must_from_callable is gone -- update _upstream.temporal_activity_name'
    )

    @activity.defn(name='contract-named-activity')
    async def named() -> None:
        return None

    @activity.defn
    async def unnamed() -> None:
        return None

    assert _upstream.temporal_activity_name(named) == 'contract-named-activity'
    assert _upstream.temporal_activity_name(unnamed) == 'unnamed'
    with pytest.raises(TypeError):
        _upstream.temporal_activity_name(ping)  # not an activity

    agent = Agent('test', name='contract-names', toolsets=[FunctionToolset([ping], id='pings')], capabilities=[temporal()])
    names = temporal_activity_names(agent)
    assert 'agent__contract-names__toolset__pings__call_tool' in names
    assert 'agent__contract-names__model_request' in names


# ---- pydantic_ai.durable_exec.temporal.worker_registrations (importable, not exported) ---------------------------------


def test_temporal_worker_registrations_is_what_a_worker_registers() -> None:
    import pydantic_ai.durable_exec.temporal as upstream_temporal
    from pydantic_ai.durable_exec.temporal import TemporalDurability

    assert callable(getattr(upstream_temporal, 'worker_registrations', None)), changed(
        'pydantic_ai.durable_exec.temporal.worker_registrations is gone -- update _upstream.temporal_worker_registrations'
    )
    agent = Agent('test', name='contract-registrations', toolsets=[FunctionToolset([ping], id='pings')],
                  capabilities=[temporal()])
    durability = TemporalDurability.from_agent(agent)
    assert durability is not None
    activities, workflows = _upstream.temporal_worker_registrations(durability)
    names = sorted(_upstream.temporal_activity_name(fn) for fn in activities)
    assert names == sorted(temporal_activity_names(agent)), changed(
        'worker_registrations no longer returns the durability\'s activities first'
    )
    assert 'agent__contract-registrations__toolset__pings__call_tool' in names
    assert 'agent__contract-registrations__model_request' in names
    assert all(isinstance(cls, type) for cls in workflows), changed('worker_registrations no longer returns workflow classes second')


# ---- dbos._error (not pydantic-ai, but private all the same) ---------------------------------------------------------------


_DBOS_VERSION_SCRIPT = """
import json
from dbos import DBOS
from dbos._dbos import _get_or_create_dbos_registry
from durable_capabilities import _upstream

@DBOS.workflow(name='contract.first')
async def first() -> int:
    return 1

default_one = _get_or_create_dbos_registry().compute_app_version('contract')

@DBOS.workflow(name='contract.second')
async def second() -> int:
    return 2

print(json.dumps({
    'default_one': default_one,
    'default_two': _get_or_create_dbos_registry().compute_app_version('contract'),
    'ours_all': _upstream.dbos_application_version('contract', ()),
    'ours_without_second': _upstream.dbos_application_version('contract', {'contract.second'}),
    'other_app': _upstream.dbos_application_version('other', ()),
    'still_registered': sorted(_get_or_create_dbos_registry().workflow_info_map),
}))
"""


def test_dbos_application_version_is_dbos_own_computation_without_the_excluded_workflows(tmp_path: Path) -> None:
    """In a subprocess (DBOS's registry is global): with nothing excluded it is DBOS's default version; excluding a
    workflow gives the version DBOS computed before it was registered; the registry itself is left alone."""
    import json
    import subprocess
    import sys

    from tests._helpers import pythonpath, subprocess_env

    script = tmp_path / 'versions.py'  # a file: DBOS hashes the workflows' source code
    script.write_text(_DBOS_VERSION_SCRIPT)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=True,
                            env=subprocess_env({'PYTHONPATH': pythonpath(*sys.path)}))
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data['ours_all'] == data['default_two'], changed('DBOSRegistry.compute_app_version is no longer what we call')
    assert data['ours_without_second'] == data['default_one'] != data['default_two'], changed(
        'DBOS application versions no longer depend on the registered workflows alone'
    )
    assert data['other_app'] != data['ours_all']
    assert data['still_registered'] == ['contract.first', 'contract.second']


_DBOS_RECOVER_SCRIPT = """
import asyncio, json, os, sys, time
from pathlib import Path
from dbos import DBOS
from durable_capabilities import _upstream

phase, db, work = sys.argv[1], sys.argv[2], Path(sys.argv[3])

@DBOS.step(name='contract.mark')
async def mark() -> None:
    with open(work / 'marks', 'a') as f:
        f.write(phase + '\\n')

@DBOS.step(name='contract.hold')
async def hold() -> str:
    (work / 'holding').write_text(phase)
    while not (work / 'release').exists():
        await asyncio.sleep(0.05)
    return 'released in ' + phase

@DBOS.workflow(name='contract.recovered')
async def recovered() -> str:
    await mark()
    return await hold()

DBOS(config={'name': 'contract', 'system_database_url': db, 'executor_id': phase, 'application_version': 'v1',
             'log_level': 'WARNING'})
DBOS.launch()

async def main() -> None:
    if phase == 'dead':
        await DBOS.start_workflow_async(recovered)
        while True:
            await asyncio.sleep(1)
    (work / 'release').write_text('')
    ids = _upstream.dbos_recover_pending_workflows(['dead'])
    again = _upstream.dbos_recover_pending_workflows(['dead'])
    results = [await (await DBOS.retrieve_workflow_async(i)).get_result() for i in ids]
    print(json.dumps({'ids': ids, 'again': again, 'results': results}))

asyncio.run(main())
"""


def test_dbos_recover_pending_workflows_recovers_another_executors_workflow_once(tmp_path: Path) -> None:
    """`DBOS._recover_pending_workflows` (the private classmethod `_upstream.dbos_recover_pending_workflows` wraps):
    a workflow left PENDING by executor `dead` (a real subprocess SIGKILLed inside its second step) is recovered by
    a process launched as executor `alive`: the id comes back, the workflow completes there, its checkpointed first
    step is not run again, and asking again while it is recovered does not run it twice. DBOS on SQLite."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests._helpers import pythonpath, subprocess_env

    script, db = tmp_path / 'recover.py', f'sqlite:///{tmp_path / "dbos.sqlite"}'
    script.write_text(_DBOS_RECOVER_SCRIPT)
    env = subprocess_env({'PYTHONPATH': pythonpath(*sys.path)})
    dead = subprocess.Popen([sys.executable, str(script), 'dead', db, str(tmp_path)], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / 'holding').exists():
            assert dead.poll() is None and time.monotonic() < deadline, 'the first executor never reached its step'
            time.sleep(0.05)
    finally:
        os.killpg(dead.pid, signal.SIGKILL)
        dead.wait(timeout=30)
    result = subprocess.run([sys.executable, str(script), 'alive', db, str(tmp_path)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, changed(f'DBOS._recover_pending_workflows failed: {result.stderr[-2000:]}')
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(data['ids']) == 1 and data['results'] == ['released in alive'], data
    assert (tmp_path / 'marks').read_text().splitlines() == ['dead'], 'the checkpointed step ran again'
    assert data['again'] in ([], data['ids']), data


_DBOS_DRAIN_SCRIPT = """
import asyncio, json, sys
from pathlib import Path
from dbos import DBOS
from dbos._dbos import _get_dbos_instance
from durable_capabilities import _upstream

db, work = sys.argv[1], Path(sys.argv[2])

@DBOS.step(name='contract.hold')
async def hold() -> str:
    (work / 'holding').write_text('')
    while not (work / 'release').exists():
        await asyncio.sleep(0.05)
    return 'released'

@DBOS.workflow(name='contract.drained')
async def drained() -> str:
    return await hold()

DBOS(config={'name': 'contract-drain', 'system_database_url': db, 'executor_id': 'drain', 'log_level': 'WARNING'})
DBOS.launch()

async def main() -> None:
    before = _upstream.dbos_active_workflow_ids()
    handle = await DBOS.start_workflow_async(drained)
    while not (work / 'holding').exists():
        await asyncio.sleep(0.05)
    running = _upstream.dbos_active_workflow_ids()
    _upstream.dbos_stop_taking_work()
    stopped = all(event.is_set() for event in _get_dbos_instance().background_thread_stop_events)
    (work / 'release').write_text('')
    result = await handle.get_result()
    after = _upstream.dbos_active_workflow_ids()
    print(json.dumps({'before': before, 'running': running, 'id': handle.workflow_id, 'stopped': stopped,
                      'result': result, 'after': after}))

asyncio.run(main())
DBOS.destroy(workflow_completion_timeout_sec=0)
"""


def test_dbos_drain_hooks_list_the_running_workflows_and_stop_dbos_taking_work(tmp_path: Path) -> None:
    """`DBOS._active_workflows_set` and `DBOS.background_thread_stop_events` (read by
    `_upstream.dbos_active_workflow_ids` / `dbos_stop_taking_work`, which `durcap worker dbos`'s drain uses to wait only
    for running workflows, not runs parked on an approval): in a real DBOS process on SQLite, the running workflow's
    id is listed while its step runs and gone once it returned, and stopping sets every background thread's stop event
    without cutting the running workflow short."""
    import json
    import subprocess
    import sys

    from tests._helpers import pythonpath, subprocess_env

    script, db = tmp_path / 'drain.py', f'sqlite:///{tmp_path / "dbos.sqlite"}'
    script.write_text(_DBOS_DRAIN_SCRIPT)
    env = subprocess_env({'PYTHONPATH': pythonpath(*sys.path)})
    result = subprocess.run([sys.executable, str(script), db, str(tmp_path)], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, changed(f'the DBOS drain hooks failed: {result.stderr[-2000:]}')
    data = json.loads(result.stdout.strip().splitlines()[-1])
    assert data['before'] == [] and data['running'] == [data['id']], changed(f'active workflows: {data}')
    assert data['stopped'] and data['result'] == 'released' and data['after'] == [], changed(f'after the stop: {data}')


def test_dbos_error_classes_tell_control_flow_from_exhausted_retries() -> None:
    dbos_error, retries_exceeded = _upstream.dbos_error_classes()
    assert issubclass(dbos_error, Exception) and issubclass(retries_exceeded, dbos_error), (
        'dbos changed: DBOSMaxStepRetriesExceeded is no longer a DBOSException -- update _upstream.dbos_error_classes'
    )
    assert (dbos_error.__name__, retries_exceeded.__name__) == ('DBOSException', 'DBOSMaxStepRetriesExceeded')


# ---- MCP._telemetry_url_derived_id ----------------------------------------------------------------------------------------


def test_telemetry_url_derived_id_semantics() -> None:
    # `_upstream.capability_url_derived_id` reads it with a default, so a rename would silently return None: check presence.
    deferred = MCP(url='http://u:s3cret@mcp.internal:8001/mcp', description='d', defer_loading=True)
    assert '_telemetry_url_derived_id' in {f.name for f in dataclasses.fields(MCP)}, changed(
        'MCP._telemetry_url_derived_id is gone'
    )
    assert deferred.id is None, changed('a deferred MCP without id now derives one')
    assert _upstream.capability_url_derived_id(deferred) == 'mcp.internal', changed(
        'MCP._telemetry_url_derived_id no longer holds the hostname a deferred MCP would derive'
    )
    eager = MCP(url='http://mcp.internal/mcp')
    assert _upstream.capability_url_derived_id(eager) == eager.id == 'mcp.internal'
    assert _upstream.capability_url_derived_id(MCP(url='http://mcp.internal/mcp', id='kb')) is None
    assert _upstream.capability_url_derived_id(Capability(id='x')) is None


def test_typer_usage_errors_are_what_typer_raises_for_a_bad_command_line() -> None:
    """`typer._click.exceptions.UsageError` / `NoArgsIsHelpError` (`_upstream.typer_usage_errors`): what a typer
    command raises for a value it cannot parse and for a group given nothing, both exit code 2 and `TyperException`s
    (no model, no process)."""
    import typer
    from typer.core import TyperGroup

    usage, no_args = _upstream.typer_usage_errors()
    assert issubclass(no_args, usage) and issubclass(usage, typer.TyperException)
    group = typer.Typer(no_args_is_help=True)

    @group.command()
    def one(port: int) -> None: ...  # pragma: no cover - never runs

    @group.command()
    def two() -> None: ...  # pragma: no cover - never runs

    command = typer.main.get_command(group)
    assert isinstance(command, TyperGroup)
    with pytest.raises(usage) as bad:
        command.main(['one', 'abc'], standalone_mode=False)
    assert bad.value.exit_code == 2 and not isinstance(bad.value, no_args) and "Invalid value for 'port'" in (
        bad.value.format_message())  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(no_args):
        command.main([], standalone_mode=False)


def test_upstream_module_exports_are_all_covered() -> None:
    """A new private dependency in `_upstream.py` needs a contract test here."""
    covered = {
        'LOAD_CAPABILITY_TOOL_NAME',
        'DynamicToolset',
        'capability_url_derived_id',
        'dbos_application_version',
        'dbos_error_classes',
        'dbos_recover_pending_workflows',  # test_dbos_recover_pending_workflows_recovers_another_executors_workflow_once
        'dbos_active_workflow_ids',  # test_dbos_drain_hooks_list_the_running_workflows_and_stop_dbos_taking_work
        'dbos_stop_taking_work',  # the same
        'derived_id_source',
        'explicit_toolset_id',
        'is_mcp_toolset',  # tests/unit/test_lazy_imports.py
        'prefect_engine_run_process',  # test_prefect_runner_starts_flow_run_processes_through_the_engine_run_process
        'prefect_server_settings',  # test_prefect_client_reads_the_server_settings_through_its_own_session
        'prefect_share_tls_contexts',  # test_prefect_clients_share_one_verifying_tls_context_per_ca_file
        'runtime_rejected_kinds',  # test_runtime_rejected_kinds_are_read_from_upstreams_durability_classes
        'interchangeable_leaves',
        'temporal_activity_name',
        'temporal_set_deadlock_timeout',  # test_temporal_workflow_worker_keeps_its_deadlock_timeout_in_one_attribute
        'temporal_workflow_name',
        'temporal_worker_registrations',
        'toolset_with_id',
        'typer_usage_errors',  # test_typer_usage_errors_are_what_typer_raises_for_a_bad_command_line
    }
    assert set(_upstream.__all__) == covered
    tree = ast.parse(inspect.getsource(_upstream))
    private: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith('_') and not node.attr.startswith('__'):
            private.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module:
            private.update(part for part in node.module.split('.') if part.startswith('_') and not part.startswith('__'))
            private.update(a.name for a in node.names if a.name.startswith('_') and not a.name.startswith('__'))
        elif isinstance(node, ast.Call) and getattr(node.func, 'id', None) in ('getattr', 'hasattr', 'setattr'):
            private.update(
                a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith('_')
            )
    assert sorted(private) == [
        '_Definition',
        '_active_workflows_set',
        '_click',
        '_client',
        '_dbos',
        '_deadlock_timeout_seconds',
        '_deferred_capability_loader',
        '_derived_id_source',
        '_error',
        '_explicit_id',
        '_get_dbos_instance',
        '_get_or_create_dbos_registry',
        '_id',
        '_recover_pending_workflows',
        '_starter_engine',
        '_telemetry_url_derived_id',
        '_workflow_worker',
    ], f'_upstream.py now touches {sorted(private)}; add contract tests for the new ones'


def test_prefect_runner_starts_flow_run_processes_through_the_engine_run_process(tmp_path: Path) -> None:
    """`_upstream.prefect_engine_run_process`, the override point of `durcap schedule prefect`'s fork server
    (engines/prefect/_prefork.py): Prefect's `EngineCommandStarter` (what the runner uses for a deployment added with
    `add_deployment`, as `prefect.serve` does; tests/engines/test_cli_engines.py shows the flow runs forked) calls
    `prefect.runner._starter_engine.run_process` with `[python, '-m', 'prefect.engine']`, the run's whole
    environment (its id in `$PREFECT__FLOW_RUN_ID`) and nothing `ForkServer.forks` leaves to Prefect; the forked
    child runs `prefect.engine`'s main block, which takes the id from the environment, after
    `prefect.context.refresh_global_settings_context`."""
    import prefect.context
    import prefect.engine
    from prefect.client.schemas.objects import FlowRun
    from prefect.runner._starter_engine import EngineCommandStarter

    from durable_capabilities.engines.prefect._prefork import ForkServer

    prefect_version = importlib.metadata.version('prefect')
    calls: list[tuple[list[str], dict[str, Any]]] = []

    class Recorded(Exception):
        pass

    async def record(command: list[str], **kwargs: Any) -> None:
        calls.append((command, kwargs))
        raise Recorded

    previous = _upstream.prefect_engine_run_process(record)
    try:
        flow_run = FlowRun(flow_id=uuid.uuid4(), name='contract')
        with pytest.raises(Recorded):
            asyncio.run(EngineCommandStarter(deployment_name='d', heartbeat_seconds=5, tmp_dir=tmp_path).start(flow_run))
    finally:
        assert _upstream.prefect_engine_run_process(previous) is record, f'prefect {prefect_version}: override point moved'
    assert calls, f'prefect {prefect_version}: EngineCommandStarter.start no longer calls _starter_engine.run_process'
    command, kwargs = calls[0]
    assert command == [sys.executable, '-m', _upstream.PREFECT_ENGINE_MODULE], f'prefect {prefect_version}: {command}'
    assert kwargs['env']['PREFECT__FLOW_RUN_ID'] == str(flow_run.id)
    assert kwargs['env']['PREFECT_FLOWS_HEARTBEAT_FREQUENCY'] == '5'
    rest = {k: v for k, v in kwargs.items() if k not in ('stream_output', 'task_status', 'task_status_handler')}
    assert ForkServer().forks(command, kwargs['stream_output'], rest), f'prefect {prefect_version}: now also {set(rest)}'
    main = inspect.getsource(prefect.engine).split('if __name__ == "__main__":', 1)
    assert len(main) == 2 and 'os.environ.get("PREFECT__FLOW_RUN_ID")' in main[1], f'prefect {prefect_version}: engine main'
    assert callable(prefect.context.refresh_global_settings_context)


def test_runtime_rejected_kinds_are_read_from_upstreams_durability_classes() -> None:
    """`EngineSpec.rejected_at_run_time` (DC024) reads `engine_spec.unsupported_runtime_toolset_kinds` of upstream's
    durability classes through `_upstream.runtime_rejected_kinds`: the attribute exists and holds upstream's kinds."""
    from durable_capabilities.engines import ENGINES

    for adapter in ENGINES.values():
        spec = adapter.spec
        if spec.durability is None:
            continue
        module, _, name = spec.durability.partition(':')
        kinds = _upstream.runtime_rejected_kinds(getattr(importlib.import_module(module), name))
        assert kinds and kinds <= {'function', 'mcp', 'dynamic'}, changed(f'{name}.engine_spec.unsupported_runtime_toolset_kinds')
        assert spec.rejected_at_run_time() == kinds


def test_prefect_client_reads_the_server_settings_through_its_own_session() -> None:
    """`_upstream.prefect_server_settings` (`durcap store gc` reads the Prefect server's flow-run retention,
    engines/prefect/_runs.py `_server_retention`): `PrefectClient._client` is the client's httpx session, based at
    the API URL, whose `get` is a coroutine; the server serves `GET /admin/settings` (its route table says so)."""
    import asyncio

    import httpx
    from prefect.client.orchestration import PrefectClient
    from prefect.server.api.admin import router

    client = PrefectClient('http://127.0.0.1:9/api')
    session = client._client  # pyright: ignore[reportPrivateUsage]
    assert isinstance(session, httpx.AsyncClient)
    assert str(session.base_url).rstrip('/') == 'http://127.0.0.1:9/api'
    assert asyncio.iscoroutinefunction(session.get)
    assert any(getattr(route, 'path', '') == '/admin/settings' and 'GET' in getattr(route, 'methods', ())
               for route in router.routes)


def test_prefect_clients_share_one_verifying_tls_context_per_ca_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_upstream.prefect_share_tls_contexts` (the fork server and the serving process of `durcap schedule prefect`,
    engines/prefect/_prefork.py): Prefect's `PrefectClient` and `SyncPrefectClient` build their TLS context in
    `__init__` with `ssl.create_default_context(cafile=...)` through `prefect.client.orchestration`'s `ssl` name
    (counted here on the real `ssl`); once shared, clients of one CA file get one context (the one their httpx
    transport is given), a CA file changed on disk or another one gets a new one, and the insecure setting still
    gets a context of its own per client with verification off."""
    import ssl

    import certifi
    from prefect.client import orchestration
    from prefect.settings import PREFECT_API_SSL_CERT_FILE, PREFECT_API_TLS_INSECURE_SKIP_VERIFY, temporary_settings

    monkeypatch.setattr(orchestration, 'ssl', ssl)  # put back after the test
    built: list[ssl.SSLContext] = []
    real = ssl.create_default_context

    def counting(*args: Any, **kwargs: Any) -> ssl.SSLContext:
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(ssl, 'create_default_context', counting)
    orchestration.PrefectClient('http://127.0.0.1:9/api')
    assert len(built) == 1, 'PrefectClient no longer builds its TLS context with ssl.create_default_context'
    shim = _upstream.prefect_share_tls_contexts()
    assert _upstream.prefect_share_tls_contexts() is shim
    built.clear()

    clients = [orchestration.PrefectClient('https://127.0.0.1:9/api'),
               orchestration.SyncPrefectClient('https://127.0.0.1:9/api'),
               orchestration.PrefectClient('https://127.0.0.1:9/api')]
    assert len(built) == 1
    assert shim.create_default_context(cafile=PREFECT_API_SSL_CERT_FILE.value() or certifi.where()) is built[0]
    # What httpx connects with (read here only: its pool's attribute).
    assert all(c._client._transport._pool._ssl_context is built[0] for c in clients)  # pyright: ignore[reportPrivateUsage,reportAttributeAccessIssue]
    bundle = tmp_path / 'ca.pem'
    bundle.write_bytes(Path(certifi.where()).read_bytes())
    with temporary_settings({PREFECT_API_SSL_CERT_FILE: str(bundle)}):
        orchestration.PrefectClient('http://127.0.0.1:9/api')
        orchestration.PrefectClient('http://127.0.0.1:9/api')
        assert len(built) == 2, 'another CA file: one more context'
        bundle.write_bytes(bundle.read_bytes() + b'\n')
        orchestration.SyncPrefectClient('http://127.0.0.1:9/api')
        assert len(built) == 3, 'the CA file changed: a new context'
    with temporary_settings({PREFECT_API_TLS_INSECURE_SKIP_VERIFY: True}):
        orchestration.PrefectClient('http://127.0.0.1:9/api')
        orchestration.PrefectClient('http://127.0.0.1:9/api')
    assert len(built) == 5 and built[3] is not built[4], 'the insecure setting builds its own context per client'
    assert built[4].verify_mode == ssl.CERT_NONE and built[0].verify_mode == ssl.CERT_REQUIRED
