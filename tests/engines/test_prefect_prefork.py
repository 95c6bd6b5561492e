"""The fork server of `durcap schedule prefect` (engines/prefect/_prefork.py): what it preloads starts no thread and
no event loop, and a process it forks for Prefect's flow-run command takes the run's environment and folder, exits
with Prefect's engine's exit code, and is killed by its pid. No Prefect server (the flow runs are refused before any
request), no model: tests/engines/test_cli_engines.py runs real flow runs through it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests._helpers import ROOT, subprocess_env

_PROBE = """
import asyncio, gc, json, sys, threading
import durable_capabilities.engines.prefect._preload as preload
print(json.dumps({'threads': [t.name for t in threading.enumerate()], 'flows': preload.PRELOADED,
                  'warmed': preload.WARMED, 'warm_modules': list(preload.WARM_MODULES),
                  'loops': [repr(o) for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)],
                  'loaded': sorted(m for m in ('prefect.flow_engine', 'pydantic_ai', 'examples.support.agent') if m in sys.modules)}))
"""


@contextlib.contextmanager
def prefect_api_here(url: str) -> Iterator[None]:
    """Every Prefect client of this (pytest) process talks to `url` within the block, the beat threads' included.

    `temporary_settings` would not do: it is context-local, and a beat thread (`_liveness.beating`, a new thread) reads
    Prefect's global settings, where this process has no API URL: its client then started Prefect's own temporary
    server (`uvicorn prefect.server.api.server:create_app`, up to three tries under load), which outlived the xdist
    worker. So the global settings are pointed at `url` (`PREFECT_API_URL`, `refresh_global_settings_context`), the
    beat threads started within the block are waited for when it ends (none makes a client afterwards), and the
    environment and settings are put back.

    Raises:
        AssertionError: a beat thread was still running 60 s after the block.
    """
    from prefect.context import refresh_global_settings_context

    before = os.environ.get('PREFECT_API_URL')
    threads = set(threading.enumerate())
    os.environ['PREFECT_API_URL'] = url
    refresh_global_settings_context()
    try:
        yield
    finally:
        beats = [t for t in threading.enumerate() if t not in threads and t.name.startswith('durcap-beat-')]
        for thread in beats:
            thread.join(timeout=60)
        if before is None:
            os.environ.pop('PREFECT_API_URL', None)
        else:
            os.environ['PREFECT_API_URL'] = before
        refresh_global_settings_context()
        assert not [t.name for t in beats if t.is_alive()], 'a beat thread outlived its block'


def test_the_preload_starts_no_thread_and_no_event_loop(tmp_path: Path) -> None:
    """What the fork server imports (`_preload`), in a fresh interpreter (not the suite's own fork server): Prefect's
    flow engine, pydantic-ai and the target's flows are loaded, and so is what every flow run used to load or build on
    its own (`_warm`: Prefect's task engine and the rest of `WARM_MODULES`, the SQL dialect of the agent's store,
    pydantic-ai's message adapter, the TLS context its Prefect clients share); the main thread is the only thread, with no event loop made: forking it is
    safe."""
    env = {**subprocess_env(), 'DURCAP_TEST_ZYGOTE': '0', 'DURCAP_TARGET': 'examples.support.agent:support',
           'PREFECT_HOME': str(tmp_path / 'prefect-home')}
    out = subprocess.run([sys.executable, '-c', _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen['threads'] == ['MainThread'] and seen['loops'] == [], seen
    assert seen['flows'] == ['flow__support'], seen
    assert seen['warmed'] == [*seen['warm_modules'], 'TLS context', 'store dialect sqlite', 'ModelMessagesTypeAdapter'], seen
    assert seen['loaded'] == ['examples.support.agent', 'prefect.flow_engine', 'pydantic_ai'], seen


def test_a_forked_flow_run_process_takes_its_env_and_folder_exits_with_the_engines_code_and_dies_by_pid(
        prefect_api_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real fork server (preloaded with the support example) and Prefect's flow-run command, through
    `ForkServer.run_process` (not installed in this process). (1) A flow run id that is no UUID: Prefect's engine
    exits 1; the process ran in the folder given with the environment given (Prefect's settings, refreshed from it,
    made its relative `PREFECT_HOME` there). (2) A flow run on a server that does not answer: the process is a child
    of the fork server, not of this process; SIGKILL by its pid ends it with -9, as `subprocess` reports it."""
    from durable_capabilities.engines.prefect._prefork import ForkServer

    monkeypatch.setenv('DURCAP_TARGET', 'examples.support.agent:support')
    server = ForkServer()
    server.start()
    command = [sys.executable, '-m', 'prefect.engine']
    base = {k: v for k, v in os.environ.items() if not k.startswith('PREFECT_')}
    folder = tmp_path / 'run'
    folder.mkdir()

    async def refused() -> Any:
        return await server.run_process(command, stream_output=False, cwd=folder,
                                        env={**base, 'PREFECT__FLOW_RUN_ID': 'not-a-uuid', 'PREFECT_HOME': 'home-x'})

    with prefect_api_here(prefect_api_url):  # where the serving side's beats go (from their thread)
        first = asyncio.run(refused())
    assert first.returncode == 1
    assert (folder / 'home-x').is_dir(), 'the forked process did not take its folder and environment'

    async def killed() -> tuple[Any, int]:
        async with anyio.create_task_group() as group:
            env = {**base, 'PREFECT__FLOW_RUN_ID': str(uuid.uuid4()), 'PREFECT_API_URL': 'http://127.0.0.1:9/api',
                   'PREFECT_HOME': str(tmp_path / 'home-y')}
            forked = await group.start(lambda task_status: server.run_process(
                command, stream_output=False, env=env, task_status=task_status, task_status_handler=lambda p: p))
            parent = int(Path(f'/proc/{forked.pid}/stat').read_text().rsplit(')', 1)[1].split()[1])
            os.kill(forked.pid, signal.SIGKILL)
        return forked, parent

    with prefect_api_here(prefect_api_url):
        second, parent = asyncio.run(killed())
    assert parent != os.getpid()
    assert second.returncode == -signal.SIGKILL
    assert subprocess.run(['ps', '-o', 'args=', '-p', str(parent)], capture_output=True, text=True,
                          check=False).stdout.count('multiprocessing.forkserver') == 1


def test_beating_is_reentrant_so_a_forked_flow_run_beats_once() -> None:
    """A forked flow-run process beats from its start (`_prefork.flow_run_main`), and its flow's own `beating` block
    adds no second beat thread. No server (an API URL nobody listens on: the beats fail quietly, logged at debug,
    which is what is tested around; with no URL at all the beat thread's client would start Prefect's temporary
    server)."""
    from durable_capabilities.engines.prefect import _liveness

    run_id = str(uuid.uuid4())

    def beats() -> int:
        return len([t for t in threading.enumerate() if t.name == f'durcap-beat-{run_id}' and t.is_alive()])

    with prefect_api_here('http://127.0.0.1:9/api'):
        with _liveness.beating(run_id):
            assert beats() == 1
            with _liveness.beating(run_id):
                assert beats() == 1
            assert run_id in _liveness._BEATING  # the inner block leaves the outer beat running
        assert run_id not in _liveness._BEATING


def test_the_serving_process_tells_its_flow_runs_what_the_server_answered(prefect_api_url: str) -> None:
    """`_prefork.ServerFacts` against the real Prefect server (this client's version, CSRF protection off, as
    `start_prefect_server` and the shared test server run): a flow run's environment gets
    `PREFECT_CLIENT_SERVER_VERSION_CHECK_ENABLED=false` and `PREFECT_CLIENT_CSRF_SUPPORT_ENABLED=false` (its clients
    then skip the version check and the CSRF token fetch), a setting the environment has already wins, an environment
    naming another API gets nothing, and an API that does not answer gives nothing (the flow runs ask themselves)."""
    from durable_capabilities.engines.prefect._prefork import (
        CSRF_SUPPORT_ENV,
        VERSION_CHECK_ENV,
        ServerFacts,
        read_server_facts,
    )

    with prefect_api_here(prefect_api_url):
        facts = ServerFacts()
        facts.read_now()
        env = asyncio.run(facts.env_for({'PREFECT_API_URL': prefect_api_url, 'PREFECT__FLOW_RUN_ID': 'x'}))
        assert env == {'PREFECT_API_URL': prefect_api_url, 'PREFECT__FLOW_RUN_ID': 'x', VERSION_CHECK_ENV: 'false',
                       CSRF_SUPPORT_ENV: 'false'}
        own = asyncio.run(facts.env_for({'PREFECT_API_URL': prefect_api_url, CSRF_SUPPORT_ENV: 'true'}))
        assert own == {'PREFECT_API_URL': prefect_api_url, CSRF_SUPPORT_ENV: 'true', VERSION_CHECK_ENV: 'false'}
        other = {'PREFECT_API_URL': 'http://127.0.0.1:9/api'}
        assert asyncio.run(facts.env_for(dict(other))) == other
    with prefect_api_here('http://127.0.0.1:9/api'):
        assert asyncio.run(read_server_facts()) == {}
