"""The suite's check for leaked servers (test infrastructure only): a Prefect or Temporal server process started
during this pytest session and still alive when it ends is stopped and fails the run.

Every process the session starts carries `DURCAP_TEST_SESSION=<id>` in its environment (set in the controlling
pytest process before any worker or subprocess starts; `subprocess_env()`, xdist's workers and Prefect's own
temporary server copy `os.environ`). At the end of the session (after xdist's workers have exited, so their exit
handlers have run), the check reads `/proc`: a process whose command line is a server's (`SERVER_KINDS`), whose
environment carries this session's id and which started after this pytest process is a leak. The shared servers a
developer or `.ci/run` started before the session (`$DURCAP_TEST_PREFECT_API_URL`, `$DURCAP_TEST_TEMPORAL_ADDRESS`)
and other sessions' servers are left alone: they lack the id or started earlier. Each leak is named with the test that
was running when its first ancestor in the session was spawned (`PYTEST_CURRENT_TEST` in its environment), its
`PREFECT_HOME` and working directory, then stopped by process id (SIGTERM, then SIGKILL after `STOP_TIMEOUT` s).

The hooks (`pytest_configure`, `pytest_sessionfinish`) are tests/conftest.py's; `pytest -p tests._leaks` loads them
elsewhere (tests/unit/test_leak_check.py). Linux only (`/proc`, `os.pidfd_open`); elsewhere the check does nothing.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

SESSION_VARIABLE = 'DURCAP_TEST_SESSION'
"""The environment variable naming the pytest session that started a process."""

SERVER_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ('prefect temporary server (uvicorn)', ('uvicorn', 'prefect.server.api.server:create_app')),
    ('prefect server start', ('prefect', 'server', 'start')),
    ('temporal dev server', ('temporal', 'server', 'start-dev')),
    ('durcap dev temporal', ('dev', 'temporal')),
)
"""`(kind, tokens)`: a process whose argv holds every token (exactly, or as a path's last part) is that kind of server."""

EXIT_GRACE = 2.0
"""Seconds a matching process gets to finish exiting (a server killed by its parent's death, being reaped) before it
counts as leaked."""

STOP_TIMEOUT = 10.0
"""Seconds between SIGTERM and SIGKILL when stopping a leaked server."""


@dataclass(frozen=True)
class Leak:
    """A server process this session started that outlived it."""

    pid: int
    kind: str
    args: str
    test: str
    prefect_home: str
    cwd: str

    def line(self) -> str:
        """One report line: pid, kind, the test that started it, its PREFECT_HOME and working directory."""
        return (f'pid {self.pid} {self.kind}: started during {self.test or "(no test: session set-up or tear-down)"}; '
                f'PREFECT_HOME={self.prefect_home or "-"}; cwd={self.cwd}; {self.args[:200]}')


def supported() -> bool:
    """Whether this platform has what the check reads (`/proc`, pidfd)."""
    return sys.platform == 'linux' and hasattr(os, 'pidfd_open') and Path('/proc/self/stat').exists()


def mark_session() -> str:
    """Give this process (and so everything it starts) a fresh session id in `DURCAP_TEST_SESSION`; returns it.
    Call once, in the controlling pytest process, before workers start."""
    os.environ[SESSION_VARIABLE] = session = uuid.uuid4().hex
    return session


def _start_ticks(pid: int) -> int:
    """A process's start time in clock ticks since boot (`/proc/PID/stat` field 22)."""
    stat = Path(f'/proc/{pid}/stat').read_text()
    return int(stat[stat.rindex(')') + 2:].split()[19])


def _state(pid: int) -> str:
    stat = Path(f'/proc/{pid}/stat').read_text()
    return stat[stat.rindex(')') + 2:].split()[0]


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f'/proc/{pid}/environ').read_bytes()
    return dict(item.split('=', 1) for item in raw.decode(errors='replace').split('\0') if '=' in item)


def _kind(argv: list[str]) -> str | None:
    names = {part for arg in argv for part in (arg, arg.rsplit('/', 1)[-1])}
    for kind, tokens in SERVER_KINDS:
        if all(token in names for token in tokens):
            return kind
    return None


def find_leaks(session: str) -> list[Leak]:
    """Server processes (`SERVER_KINDS`) alive now that carry session id `session` and started after this process.

    Args:
        session: the id `mark_session` returned.

    Returns:
        One `Leak` per such process (zombies and processes that vanish while being read are skipped).
    """
    me = os.getpid()
    since = _start_ticks(me)
    leaks: list[Leak] = []
    for entry in Path('/proc').iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        try:
            argv = [a for a in (entry / 'cmdline').read_bytes().decode(errors='replace').split('\0') if a]
            kind = _kind(argv)
            if kind is None or _start_ticks(pid) < since or _state(pid) == 'Z':
                continue
            env = _environ(pid)
            if env.get(SESSION_VARIABLE) != session:
                continue
            cwd = os.readlink(entry / 'cwd')
        except (OSError, ValueError, IndexError):
            continue  # gone, or not ours to read
        leaks.append(Leak(pid, kind, ' '.join(argv), env.get('PYTEST_CURRENT_TEST', ''), env.get('PREFECT_HOME', ''),
                          cwd))
    return leaks


def _wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` s for process `pid` (not necessarily our child) to exit; whether it did."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        if select.select([fd], [], [], timeout)[0]:
            return True
        try:
            return _state(pid) == 'Z'
        except OSError:
            return True
    finally:
        os.close(fd)


def stop(pid: int) -> None:
    """Stop process `pid`: SIGTERM, then SIGKILL when it is still alive after `STOP_TIMEOUT` s."""
    for sig, timeout in ((signal.SIGTERM, STOP_TIMEOUT), (signal.SIGKILL, STOP_TIMEOUT)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        if _wait_gone(pid, timeout):
            return


def collect_and_stop(session: str) -> list[Leak]:
    """The session's leaked servers (`find_leaks`, after each got `EXIT_GRACE` s to finish exiting), each stopped.

    Returns:
        The leaks found (empty when none); every one has been sent SIGTERM (and SIGKILL when needed).
    """
    leaks = [leak for leak in find_leaks(session) if not _wait_gone(leak.pid, EXIT_GRACE)]
    for leak in leaks:
        stop(leak.pid)
    return leaks


# ---- the hooks --------------------------------------------------------------------------------------------------

_SESSION = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """In the controlling pytest process (not an xdist worker): mark the session (`mark_session`)."""
    if not hasattr(config, 'workerinput') and supported():
        config.stash[_SESSION] = mark_session()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """After every test (under xdist, after the workers have exited): the servers this session started that are still
    alive are named, stopped by process id (`collect_and_stop`), and the run fails (exit status 1 instead of 0)."""
    marker = session.config.stash.get(_SESSION, None)
    if marker is None:
        return
    leaks = collect_and_stop(marker)
    if not leaks:
        return
    lines = [f'{len(leaks)} server process(es) started by this session outlived it (stopped now):',
             *(leak.line() for leak in leaks),
             '("started during": the test running when it was started; one started by a thread an earlier test left '
             'running, e.g. a Prefect client with no PREFECT_API_URL, which starts a temporary server, shows the test '
             'after it)']
    reporter = session.config.pluginmanager.get_plugin('terminalreporter')
    if reporter is not None:
        reporter.write_sep('=', 'leaked servers', red=True)
        for line in lines:
            reporter.write_line(line, red=True)
    else:
        print('\n'.join(lines), file=sys.stderr)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
