"""What every local server an engine starts shares: free ports, readiness waits, stopping by process id.

Each engine starts its own server in its subpackage (`engines/temporal/_server.py`: Temporal's dev server,
`engines/prefect/_server.py`: Prefect's server) with these helpers: a child process in its own process group
(`bind_to_parent` in the child), waited for with `wait_until_ready`, stopped by process id (`ServerProcess.stop`:
SIGTERM, then SIGKILL after a grace period), so a test or `durcap dev` leaves nothing behind. Core: imports no engine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self


def bind_to_parent() -> None:
    """`preexec_fn` of a server's `subprocess.Popen`: in the child before exec, a new session (its own process group)
    and (Linux) SIGKILL when the *thread* that started it dies, however it dies (`prctl(PR_SET_PDEATHSIG)`), so no
    server outlives `durcap dev`, `durcap run` or a test killed with -9."""
    if sys.platform.startswith('linux'):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    os.setsid()


def command_path(name: str) -> str | None:
    """Path of the executable `name` installed next to this Python (the venv's `bin/`), else found on PATH, else `None`."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    return shutil.which(name)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on `host:port` now (half a second to answer)."""
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


@dataclass
class ServerProcess:
    """A server child process; `stop()` ends it and its process group by process id."""

    name: str
    process: subprocess.Popen[bytes]
    address: str
    log_path: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, grace_seconds: float = 10.0) -> None:
        """SIGTERM the process group, wait up to `grace_seconds`, then SIGKILL it."""
        if self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout=grace_seconds)
        except subprocess.TimeoutExpired:
            with_suppressed_lookup(lambda: os.killpg(self.process.pid, signal.SIGKILL))
            self.process.wait(timeout=grace_seconds)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def with_suppressed_lookup(fn: object) -> None:
    """Call `fn()`, ignoring `ProcessLookupError` (the process is already gone)."""
    try:
        fn()  # type: ignore[operator]
    except ProcessLookupError:
        pass


def wait_until_ready(check: object, process: subprocess.Popen[bytes], timeout: float, what: str,
                     log_path: Path | None) -> None:
    """Poll `check()` every 0.2 s until it returns true.

    Raises:
        RuntimeError: `process` exited first (the message ends with the last 2000 characters of `log_path`).
        TimeoutError: not ready within `timeout` seconds; the process group is SIGKILLed first.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = log_path.read_text(errors='replace')[-2000:] if log_path and log_path.exists() else ''
            raise RuntimeError(f'{what} exited with code {process.returncode} before it was ready.\n{log}')
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    raise TimeoutError(f'{what} was not ready within {timeout:.0f} s')
