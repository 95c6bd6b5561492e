"""Deferred MCP capabilities on Temporal, DBOS (SQLite) and Prefect, against real MCP servers.

Servers: `tests/engines/mcp_server.py` (FastMCP, streamable HTTP on 127.0.0.1, a free port it binds
itself), started per test as a subprocess and stopped by process id; the Temporal dev server and the
Prefect server come from the session fixtures in `conftest.py`. A server that is "down" is a port held
bound by the test but never listening, so connections are refused and no other process can take it.

Model: a scripted `FunctionModel` (`tests/engines/mcp_driver.py:script`), no provider.

Each engine run happens in its own process (`python -m tests.engines.mcp_driver ENGINE`), so DBOS's and
Prefect's global state never leaks between tests; every process a test starts is stopped by pid
(process group) when the test ends, whether it passed or not.

Upstream pydantic-ai-slim 2.68 (measured, and kept below as `test_upstream_*` with the guard switched
off): every run lists every MCP server's tools before its first model request, so a deferred MCP whose
server is down fails every run even when the model never loads it (DBOS and Prefect at once with
`RuntimeError: Client failed to connect`, naming neither capability nor server; Temporal retries the
`get_tools` activity forever). `durable_capabilities.engines._mcp.MCPGuard` skips discovery until the
capability is loaded and bounds retries (3 attempts), failing the run with `MCPCapabilityError`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities.engines import DURABLE_ENGINES
from tests._helpers import ROOT, subprocess_env

pytestmark = pytest.mark.slow


ENGINES = DURABLE_ENGINES

FAILURE_BOUND_SECONDS = 60
"""A run whose loaded MCP server is down must end (fail) within this many seconds: the driver stops
waiting after it and reports `timeout`, which fails the test. A guard against retrying forever, not a
speed target (measured: about 4-7 s with the default 3 attempts)."""

SECRET_USER, SECRET_PASSWORD, SECRET_TOKEN = 'mcp-user', 's3cr3t-pw', 'tok-9f8e7d'


# ---- processes ---------------------------------------------------------------------------------


def _stop(popen: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group by pid, then SIGKILL it if it has not exited within 10 s."""
    if popen.poll() is None:
        try:
            os.killpg(popen.pid, signal.SIGTERM)
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=10)
        except ProcessLookupError:
            pass


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(('127.0.0.1', port)) == 0


@dataclass
class McpServer:
    name: str
    url: str
    calls_file: Path
    popen: subprocess.Popen[bytes]

    @property
    def port(self) -> int:
        return int(self.url.split(':')[2].split('/')[0])

    def calls(self) -> list[str]:
        return self.calls_file.read_text().splitlines() if self.calls_file.exists() else []


@pytest.fixture
def mcp_server(tmp_path: Path) -> Iterator[Callable[[str], McpServer]]:
    """Start `tests/engines/mcp_server.py --name NAME` (several per test allowed); all stopped by pid after the test,
    and their ports checked closed."""
    servers: list[McpServer] = []

    def start(name: str) -> McpServer:
        log = tmp_path / f'mcp-{name}.log'
        with open(log, 'wb') as handle:
            popen = subprocess.Popen(
                [sys.executable, '-m', 'tests.engines.mcp_server', '--name', name, '--calls', str(tmp_path / f'{name}.calls')],
                cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                env=subprocess_env(),
            )
        server = McpServer(name, '', tmp_path / f'{name}.calls', popen)
        servers.append(server)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in log.read_text(errors='replace').splitlines():
                if line.startswith('MCP READY '):
                    server.url = line.split()[-1]
                    return server
            if popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f'MCP server {name} did not start:\n{log.read_text(errors="replace")}')

    try:
        yield start
    finally:
        for server in servers:
            _stop(server.popen)
        for server in servers:
            if server.url:
                assert not _port_open(server.port), f'MCP server {server.name} left port {server.port} open'


@pytest.fixture
def down_url() -> Iterator[str]:
    """The URL (with credentials) of an MCP server that is down: a port bound by this test but not listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(('127.0.0.1', 0))
    port = sock.getsockname()[1]
    try:
        yield f'http://{SECRET_USER}:{SECRET_PASSWORD}@127.0.0.1:{port}/mcp?token={SECRET_TOKEN}'
    finally:
        sock.close()


@dataclass
class DriverRun:
    report: dict[str, Any]
    line: str  # the raw REPORT line (what a user would see printed)
    model_requests: list[list[str]]
    log: str


@pytest.fixture
def drive(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., DriverRun]]:
    """Run `python -m tests.engines.mcp_driver ENGINE` once; returns its report. Processes stopped by pid after the test."""
    procs: list[subprocess.Popen[bytes]] = []

    def run(engine: str, servers: dict[str, str], plan: list[dict[str, Any]], *, wait: float = FAILURE_BOUND_SECONDS,
            upstream: bool = False, agent: str | None = None, extra_args: tuple[str, ...] = ()) -> DriverRun:
        index = len(procs)
        work = tmp_path / f'run-{index}'
        work.mkdir()
        env = subprocess_env({
            'DURCAP_MCP_AGENT': agent or f'agt-{uuid.uuid4().hex[:8]}',
            'DURCAP_MCP_SERVERS': json.dumps(servers),
            'DURCAP_MCP_PLAN': json.dumps(plan),
            'DURCAP_MCP_DIR': str(work),
            'DURCAP_MCP_SECRETS': json.dumps([SECRET_USER, SECRET_PASSWORD, SECRET_TOKEN]),
        })
        if upstream:
            env['DURCAP_MCP_UPSTREAM'] = '1'
        args = [sys.executable, '-m', 'tests.engines.mcp_driver', engine, '--wait', str(wait), *extra_args]
        if engine == 'temporal':
            args += ['--address', request.getfixturevalue('temporal_address')]
        elif engine == 'dbos':
            args += ['--db', f'sqlite:///{work / "dbos.sqlite"}']
        elif engine == 'prefect':
            env |= {
                'PREFECT_API_URL': request.getfixturevalue('prefect_api_url'),
                'PREFECT_HOME': str(work / 'prefect-home'),
                'PREFECT_LOCAL_STORAGE_PATH': str(work / 'prefect-results'),
            }
        log = work / 'driver.log'
        with open(log, 'wb') as handle:
            popen = subprocess.Popen(args, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append(popen)
        try:
            popen.wait(timeout=wait + 120)  # process start-up and engine imports on top of the run's bound
        except subprocess.TimeoutExpired:
            pass
        _stop(popen)
        text = log.read_text(errors='replace')
        lines = [line for line in text.splitlines() if line.startswith('REPORT ')]
        assert lines, f'driver printed no report (exit {popen.returncode}):\n{text[-5000:]}'
        requests_file = work / 'model-requests'
        requests = [json.loads(x) for x in requests_file.read_text().splitlines()] if requests_file.exists() else []
        return DriverRun(json.loads(lines[-1][len('REPORT '):]), lines[-1], requests, text)

    try:
        yield run
    finally:
        for popen in procs:
            _stop(popen)


# ---- expected durable unit names ---------------------------------------------------------------


def units(engine: str, agent: str, cap: str, tool: str) -> dict[str, str]:
    """The durable unit names each engine records for MCP capability `cap` (upstream's names)."""
    if engine == 'temporal':
        prefix = f'agent__{agent}__mcp_server__{cap}__'
        return {'get_tools': prefix + 'get_tools', 'call_tool': prefix + 'call_tool', 'model': f'agent__{agent}__model_request'}
    if engine == 'dbos':
        prefix = f'{agent}__mcp_server__{cap}.'
        return {'get_tools': prefix + 'get_tools', 'call_tool': prefix + 'call_tool', 'model': f'{agent}__model.request'}
    return {'get_tools': f'Get MCP Tools: {cap}', 'call_tool': f'Call MCP Tool: {tool}', 'model': 'Model Request: function:script:'}


def mcp_error(run: DriverRun) -> str:
    messages = [e['message'] for e in run.report.get('errors', [])]
    ours = [m for m in messages if 'MCP capability' in m]
    assert ours, f'no MCPCapabilityError in the failure: {json.dumps(run.report, indent=1)[:4000]}'
    return ours[0]


# ---- a deferred MCP, loaded and called ---------------------------------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_deferred_mcp_is_loaded_and_its_tool_called(engine: str, mcp_server, drive) -> None:
    server = mcp_server('alpha')
    plan = [{'load': 'calc'}, {'call': 'alpha_add', 'args': {'a': 2, 'b': 3}}]
    run = drive(engine, {'calc': server.url}, plan)
    report = run.report
    assert report['status'] == 'completed', json.dumps(report, indent=1)[:4000]
    assert report['output'] == 'done: 5'
    # The first request shows only `load_capability`; after the load, the server's tools.
    assert run.model_requests[0] == ['load_capability']
    assert run.model_requests[1] == ['alpha_add', 'alpha_whoami', 'load_capability']
    names = units(engine, report['agent'], 'calc', 'alpha_add')
    assert report['units'][0] == names['model'], 'discovery ran before the capability was loaded'
    assert names['get_tools'] in report['units']
    assert report['units'].count(names['call_tool']) == 1
    assert server.calls() == ['alpha_add {"a": 2, "b": 3}'], 'the tool call did not reach the server exactly once'
    if engine == 'temporal':
        assert report['replay'] == 'ok', report['replay']


@pytest.mark.parametrize('engine', ENGINES)
def test_two_mcp_servers_on_one_host_with_explicit_ids(engine: str, mcp_server, drive) -> None:
    alpha, beta = mcp_server('alpha'), mcp_server('beta')
    assert alpha.port != beta.port
    plan = [
        {'load': 'alpha-calc'},
        {'call': 'alpha_add', 'args': {'a': 2, 'b': 3}},
        {'load': 'beta-calc'},
        {'call': 'beta_whoami'},
    ]
    run = drive(engine, {'alpha-calc': alpha.url, 'beta-calc': beta.url}, plan)
    report = run.report
    assert report['status'] == 'completed', json.dumps(report, indent=1)[:4000]
    assert report['output'] == 'done: 5, beta'
    a = units(engine, report['agent'], 'alpha-calc', 'alpha_add')
    b = units(engine, report['agent'], 'beta-calc', 'beta_whoami')
    for name in (a['get_tools'], a['call_tool'], b['get_tools'], b['call_tool']):
        assert name in report['units'], f'{name} not recorded: {report["units"]}'
    # beta's server is not listed before beta is loaded (after alpha's tool call).
    assert report['units'].index(b['get_tools']) > report['units'].index(a['call_tool'])
    assert alpha.calls() == ['alpha_add {"a": 2, "b": 3}'] and beta.calls() == ['beta_whoami {}']
    if engine == 'temporal':
        assert report['replay'] == 'ok', report['replay']


def test_two_mcp_servers_on_one_host_without_ids_report_dc005(mcp_server) -> None:
    """No engine needed: the definition is rejected at construction, naming both (redacted) URLs."""
    from pydantic_ai import ModelResponse, TextPart
    from pydantic_ai.capabilities import MCP
    from pydantic_ai.models.function import FunctionModel

    from durable_capabilities import DurableAgent
    from durable_capabilities.validation import DurableConfigError

    alpha, beta = mcp_server('alpha'), mcp_server('beta')
    model = FunctionModel(lambda messages, info: ModelResponse(parts=[TextPart('x')]))
    with pytest.raises(DurableConfigError) as raised:
        DurableAgent(f'dc005-{uuid.uuid4().hex[:6]}', model, capabilities=[MCP(url=alpha.url), MCP(url=beta.url)])
    dc005 = [p for p in raised.value.report.problems if p.code == 'DC005']
    assert len(dc005) == 1, raised.value.report.problems
    assert alpha.url in dc005[0].message and beta.url in dc005[0].message
    # With explicit ids the same two servers are fine.
    DurableAgent(f'dc005-{uuid.uuid4().hex[:6]}', model, capabilities=[MCP(url=alpha.url, id='a'), MCP(url=beta.url, id='b')])


# ---- server down -------------------------------------------------------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_unloaded_deferred_mcp_with_server_down_does_not_block_the_run(engine: str, down_url: str, drive) -> None:
    run = drive(engine, {'calc': down_url}, plan=[])
    report = run.report
    assert report['status'] == 'completed', json.dumps(report, indent=1)[:4000]
    assert report['output'] == 'done: '
    assert run.model_requests == [['load_capability']]
    # One model request and nothing else: the server was never contacted.
    assert report['units'] == [units(engine, report['agent'], 'calc', '')['model']]


@pytest.mark.parametrize('engine', ENGINES)
def test_loaded_deferred_mcp_with_server_down_fails_clearly_within_bound(engine: str, down_url: str, drive) -> None:
    plan = [{'load': 'calc'}, {'call': 'alpha_add', 'args': {'a': 2, 'b': 3}}]
    run = drive(engine, {'calc': down_url}, plan)
    report = run.report
    assert report['status'] == 'failed', (
        f'expected a failure within {FAILURE_BOUND_SECONDS} s, got {report["status"]}: {json.dumps(report, indent=1)[:4000]}'
    )
    message = mcp_error(run)
    port = down_url.split(':')[3].split('/')[0]
    assert "MCP capability 'calc'" in message
    assert f'http://127.0.0.1:{port}/mcp' in message
    assert 'after 3 attempts' in message
    for secret in (SECRET_USER, SECRET_PASSWORD, SECRET_TOKEN):
        assert secret not in run.line, f'{secret!r} appears in the failure report'
    assert report['leaked'] == [], f'credentials recorded by {engine}: {report["leaked"]}'
    assert run.model_requests == [['load_capability']]
    names = units(engine, report['agent'], 'calc', 'alpha_add')
    assert names['get_tools'] in report['units']
    if engine == 'temporal':
        assert report['attempts'][names['get_tools']] == 3
        assert report['workflow_task_failures'] == []
        assert report['replay'] == 'ok', report['replay']
    elif engine == 'dbos':
        assert any('maximum of 3' in e for e in report['step_errors']), report['step_errors']
    else:
        counts = {k.rsplit('-', 1)[0]: v for k, v in report['task_run_count'].items()}
        assert counts[names['get_tools']] == 3


def test_temporal_history_recorded_without_the_guard_replays_with_it(mcp_server, drive, tmp_path: Path) -> None:
    """A workflow recorded before the guard existed (upstream's schedule: MCP discovery first) replays on a worker that
    has it, because the guard keeps upstream's schedule for histories without its `workflow.patched()` marker.
    (Without that marker check this replay fails with `[TMPRL1100] Nondeterminism error: Activity type of scheduled
    event '...__mcp_server__calc__get_tools' does not match ... '..._model_request'`, checked by hand.)"""
    server = mcp_server('alpha')
    plan = [{'load': 'calc'}, {'call': 'alpha_add', 'args': {'a': 2, 'b': 3}}]
    name, history = f'agt-{uuid.uuid4().hex[:8]}', tmp_path / 'history.json'
    old = drive('temporal', {'calc': server.url}, plan, upstream=True, agent=name, extra_args=('--dump-history', str(history)))
    assert old.report['status'] == 'completed', json.dumps(old.report, indent=1)[:4000]
    assert old.report['units'][0] == units('temporal', name, 'calc', '')['get_tools']  # recorded on upstream's schedule
    new = drive('temporal', {'calc': server.url}, plan, agent=name, extra_args=('--replay-history', str(history)))
    assert new.report == {**new.report, 'status': 'replayed', 'replay': 'ok'}, new.report


@pytest.mark.parametrize('engine', ENGINES)
def test_always_on_mcp_with_server_down_fails_clearly_within_bound(engine: str, down_url: str, drive) -> None:
    """Not deferred: its tools are listed before the first model request, so the run fails there, after 3 attempts."""
    run = drive(engine, {'+calc': down_url}, plan=[])
    assert run.report['status'] == 'failed', json.dumps(run.report, indent=1)[:4000]
    message = mcp_error(run)
    assert "MCP capability 'calc'" in message and 'after 3 attempts' in message and SECRET_PASSWORD not in run.line
    assert run.model_requests == []


# ---- upstream, measured: the gap the guard closes ----------------------------------------------


@pytest.mark.parametrize('engine', ENGINES)
def test_upstream_lists_an_unloaded_deferred_mcp_and_fails(engine: str, down_url: str, drive) -> None:
    """Guard off (`engine_options={engine: {'mcp_guard': False}}`): the model is never reached. Temporal retries
    discovery without end (we stop watching after 15 s); DBOS and Prefect fail at once with an error naming neither
    the capability nor the server."""
    run = drive(engine, {'calc': down_url}, plan=[], wait=15 if engine == 'temporal' else FAILURE_BOUND_SECONDS, upstream=True)
    report = run.report
    assert run.model_requests == []
    names = units(engine, report['agent'], 'calc', 'alpha_add')
    if engine == 'temporal':
        assert report['status'] == 'timeout', json.dumps(report, indent=1)[:4000]
        (pending,) = report['pending']
        assert pending['activity'] == names['get_tools'] and pending['attempt'] >= 3
    else:
        assert report['status'] == 'failed', json.dumps(report, indent=1)[:4000]
        assert 'Client failed to connect' in report['errors'][0]['message']
        assert not any("'calc'" in e['message'] for e in report['errors'])
        assert report['units'] == [names['get_tools']]


# ---- the guard without an engine (how `local` would use it) -------------------------------------


def test_guard_without_engine_skips_an_unloaded_server_and_names_a_loaded_one(down_url: str) -> None:
    """In-process, no engine: `engines._mcp.guard(agent, 'local', ...)` added to the agent's capabilities.
    The local engine does not add it yet (see the report), so this pins what that wiring would give."""
    import asyncio

    from pydantic_ai import Agent, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.capabilities import MCP
    from pydantic_ai.models.function import FunctionModel

    from durable_capabilities import DurableAgent
    from durable_capabilities.engines import _mcp

    def model(load: bool) -> FunctionModel:
        def respond(messages: list[Any], info: Any) -> ModelResponse:
            if load and not any(m.kind == 'response' for m in messages):
                return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'calc'})])
            return ModelResponse(parts=[TextPart('answered')])

        return FunctionModel(respond)

    definition = DurableAgent(
        f'local-{uuid.uuid4().hex[:6]}', model(False), engines=(),
        capabilities=[MCP(url=down_url, id='calc', defer_loading=True, description='adds')],
    )
    guard = _mcp.guard(definition, 'local', lambda leaf: None)
    assert guard is not None
    unguarded = Agent(model(False), capabilities=definition.capabilities)
    with pytest.raises(RuntimeError, match='Client failed to connect'):
        asyncio.run(unguarded.run('hi'))  # upstream: the unloaded server is contacted
    assert asyncio.run(Agent(model(False), capabilities=[*definition.capabilities, guard]).run('hi')).output == 'answered'
    with pytest.raises(_mcp.MCPCapabilityError) as raised:
        asyncio.run(Agent(model(True), capabilities=[*definition.capabilities, guard]).run('hi'))
    port = down_url.split(':')[3].split('/')[0]
    assert raised.value.capability_id == 'calc' and raised.value.url == f'http://127.0.0.1:{port}/mcp'
    assert SECRET_PASSWORD not in str(raised.value) and SECRET_TOKEN not in str(raised.value)
