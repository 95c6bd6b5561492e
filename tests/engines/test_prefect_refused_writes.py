"""`durcap approve` on Prefect while the server refuses writes with 503 (a Prefect server on SQLite under load does, for
seconds at a time: issue 26/29 loose end).

Model: the scripted `FunctionModel` of tests/engines/approval_agent.py (it calls the gated `revoke_sessions`, whose
executions go to `$DURCAP_CRASH_DIR/revocations`). Real parts: the Prefect server at `$DURCAP_TEST_PREFECT_API_URL`
(else one started for the session), each run a `durcap run --engine prefect` driver subprocess paused on the approval
(talking to the server directly), and `durcap approve` subprocesses sent through `tests/engines/refusing_proxy.py`,
a reverse proxy in its own process that answers 503 to the chosen writes and forwards everything else.

Before the fix, a resume the server kept refusing printed Prefect's `PrefectHTTPStatusError` traceback (exit 1) after
Prefect's own retries (~1 min of backoff), past `$DURCAP_DECISION_WAIT`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests._helpers import ROOT, durcap, subprocess_env, wait_for
from tests.engines.test_approvals import TARGET, _prefect_flow_run_id, env_for, pending_prefect, revocations

pytestmark = [pytest.mark.slow]

WAIT = '8'
"""`$DURCAP_DECISION_WAIT` of the `durcap approve` commands here: the bound on the refused writes, in seconds."""


@contextmanager
def refusing_proxy(api: str, tmp_path: Path, name: str, pattern: str, seconds: float) -> Iterator[tuple[str, Path]]:
    """The proxy in its own process group: yields (its API URL, the file of the requests it refused); stopped after."""
    port_file, log = tmp_path / f'{name}.port', tmp_path / f'{name}.refused'
    log.touch()
    proc = subprocess.Popen([sys.executable, '-m', 'tests.engines.refusing_proxy', api, str(port_file), str(log), pattern,
                             str(seconds)], cwd=ROOT, env=subprocess_env(), start_new_session=True)
    try:
        wait_for(lambda: port_file.exists() and port_file.read_text(), 30, message='the proxy to listen')
        yield f'http://127.0.0.1:{port_file.read_text()}/api', log
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_approve_while_the_server_refuses_the_writes(prefect_api_url: str, spawn, tmp_path: Path) -> None:
    """Run A: the resume is refused for good: `durcap approve` ends within its bound with one DC052 line (the decision
    stored, standing), no traceback; the same command through the server then says DC054 naming the first decision
    and resumes the run, which revokes once. Run B: the decision's write is refused for 2 s: `durcap approve` gets
    through within its bound and the run revokes once."""
    env, crash_dir = env_for(tmp_path)
    env['PREFECT_API_URL'] = prefect_api_url
    a = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke hana', env=env)
    b = spawn('prefect', 'run', '--target', TARGET, '--prompt', 'revoke ivan', env=env)
    run_a, run_b = _prefect_flow_run_id(a), _prefect_flow_run_id(b)
    [call_a] = pending_prefect(['--engine', 'prefect'], run_a, env)
    [call_b] = pending_prefect(['--engine', 'prefect'], run_b, env)

    with refusing_proxy(prefect_api_url, tmp_path, 'resume', rf'^/flow_runs/{run_a}/resume$', -1) as (url, refused):
        started = time.monotonic()
        out = durcap('approve', run_a, call_a['call_id'], '--by', 'ops', '--engine', 'prefect',
                     env=env | {'PREFECT_API_URL': url, 'DURCAP_DECISION_WAIT': WAIT}, timeout=50)
        took = time.monotonic() - started
    assert out.returncode == 2, out.stdout + out.stderr
    [line] = out.stderr.strip().splitlines()
    assert line.startswith('durcap: error: DC052') and 'stored and stands' in line and 'HTTP 503' in line, line
    assert 'Traceback' not in out.stderr and took < 40, (took, out.stderr)
    assert refused.read_text().splitlines()[0] == f'503 POST /flow_runs/{run_a}/resume'
    again = durcap('approve', run_a, call_a['call_id'], '--by', 'ops2', '--engine', 'prefect', env=env)
    assert again.returncode == 2 and 'DC054' in again.stderr and 'approved by ops' in again.stderr, again.stderr
    assert a.report(timeout=180)['output'] == 'result: revoked sessions of hana'

    with refusing_proxy(prefect_api_url, tmp_path, 'input', rf'^/flow_runs/{run_b}/input$', 2) as (url, refused):
        out = durcap('approve', run_b, call_b['call_id'], '--by', 'ops', '--engine', 'prefect',
                     env=env | {'PREFECT_API_URL': url, 'DURCAP_DECISION_WAIT': WAIT}, timeout=50)
        assert out.returncode == 0, out.stdout + out.stderr
        assert refused.read_text().startswith(f'503 POST /flow_runs/{run_b}/input')
    assert b.report(timeout=180)['output'] == 'result: revoked sessions of ivan'
    assert sorted(revocations(crash_dir)) == ['hana', 'ivan']  # each once
