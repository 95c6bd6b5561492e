"""The suite's leaked-server check (tests/_leaks.py): a pytest session whose test leaves a server process running
fails, names the test, and stops the process; a server that was running before the session is left alone.

Real pytest sessions in subprocesses (`python -m pytest -p tests._leaks` on a test file in `tmp_path`); the "servers"
are real processes whose command lines read as a Temporal dev server (`python -c ... temporal server start-dev`),
so no real server is started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _leaks
from tests._helpers import ROOT, subprocess_env

pytestmark = pytest.mark.skipif(not _leaks.supported(), reason='the check reads /proc (Linux)')

FAKE_SERVER = ('import time; print("up", flush=True); time.sleep(300)', 'temporal', 'server', 'start-dev')
"""`python -c CODE temporal server start-dev`: sleeps, with a Temporal dev server's command line."""

LEAKY_TEST = f'''
import pathlib, subprocess, sys

def test_leaves_a_server_running():
    server = subprocess.Popen([sys.executable, '-c', *{FAKE_SERVER!r}], start_new_session=True, stdout=subprocess.PIPE)
    assert server.stdout.readline() == b'up\\n'
    pathlib.Path('server.pid').write_text(str(server.pid))
'''


def _session(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    # Only the plugins the session needs (the installed ones, hypothesis's above all, take seconds to import).
    return subprocess.run([sys.executable, '-m', 'pytest', '-p', 'tests._leaks', '-p', 'xdist.plugin', '-p', 'no:cacheprovider',
                           '-q', *args], cwd=tmp_path,
                          env=subprocess_env({'PYTHONPATH': str(ROOT), 'PYTEST_DISABLE_PLUGIN_AUTOLOAD': '1', **(env or {})}),
                          capture_output=True, text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)


def _alive(pid: int) -> bool:
    try:
        return Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


@pytest.mark.parametrize('workers', [[], ['-n', '1']], ids=['one-process', 'xdist'])
def test_a_session_that_leaves_a_server_running_fails_names_the_test_and_stops_it(tmp_path: Path,
                                                                                   workers: list[str]) -> None:
    (tmp_path / 'test_leaky.py').write_text(LEAKY_TEST)
    done = _session(tmp_path, *workers, 'test_leaky.py')
    output = done.stdout + done.stderr
    pid = int((tmp_path / 'server.pid').read_text())
    try:
        assert done.returncode == 1, output
        assert '1 passed' in output and 'leaked servers' in output, output
        line = next(line for line in output.splitlines() if line.startswith(f'pid {pid} '))
        assert 'temporal dev server: started during test_leaky.py::test_leaves_a_server_running (call)' in line, line
        assert not _alive(pid), f'the leaked process {pid} was not stopped'
    finally:
        if _alive(pid):
            os.kill(pid, 9)


def test_a_server_started_before_the_session_is_not_a_leak(tmp_path: Path) -> None:
    """A server already running when the session starts (as the shared servers of `.ci/run` are), even one a test
    talks to, is not the session's: the run passes and the server keeps running."""
    server = subprocess.Popen([sys.executable, '-c', *FAKE_SERVER], start_new_session=True, stdout=subprocess.PIPE,
                              env=subprocess_env(unset=[_leaks.SESSION_VARIABLE]))
    try:
        assert server.stdout is not None and server.stdout.readline() == b'up\n'
        (tmp_path / 'test_quiet.py').write_text('def test_nothing():\n    pass\n')
        done = _session(tmp_path, 'test_quiet.py')
        assert done.returncode == 0, done.stdout + done.stderr
        assert 'leaked servers' not in done.stdout
        assert server.poll() is None
    finally:
        server.kill()
        server.wait(timeout=30)
