"""Helpers of the `durcap serve` tests: real `durcap serve` / `durcap worker dbos` subprocesses (each its own process
group, stopped by pid), and a Server-Sent Events reader over httpx."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests._helpers import DURCAP, ROOT, subprocess_env

TARGET = 'tests.engines.serve_agents:agents'
TOKENS = 'alice=token-alice,bob=token-bob'
ALICE = {'Authorization': 'Bearer token-alice'}
BOB = {'Authorization': 'Bearer token-bob'}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


@dataclass
class Proc:
    """A subprocess in its own process group, its output in `log`."""

    popen: subprocess.Popen[bytes]
    log: Path

    def wait_for(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log.read_text(errors='replace')
            found = next((line for line in text.splitlines() if needle in line), None)
            if found is not None:
                return found
            assert self.popen.poll() is None, f'exited {self.popen.returncode} before {needle!r}:\n{text}'
            time.sleep(0.05)
        raise AssertionError(f'no {needle!r} within {timeout} s:\n{self.log.read_text(errors="replace")}')

    def kill9(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)


def start(args: list[str], log: Path, env: dict[str, str], cwd: Path = ROOT) -> Proc:
    with open(log, 'wb') as out:
        popen = subprocess.Popen([*DURCAP, *args], cwd=cwd, env=subprocess_env(env), stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    return Proc(popen, log)


def start_server(tmp_path: Path, name: str, env: dict[str, str], *args: str, target: str = TARGET) -> tuple[Proc, str]:
    """`durcap serve TARGET --port P *args`; returns it and its base URL once it listens."""
    port = free_port()
    proc = start(['serve', target, '--port', str(port), *args], tmp_path / f'{name}.log',
                 {**env, 'DURCAP_SERVE_TOKEN': TOKENS})
    proc.wait_for('durcap serve: http://', 90)
    url = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + 30
    while True:  # uvicorn binds right after the line
        try:
            httpx.get(f'{url}/v1/runs/none', headers=ALICE, timeout=2)
            return proc, url
        except httpx.TransportError:
            assert time.monotonic() < deadline and proc.popen.poll() is None, proc.log.read_text()
            time.sleep(0.05)


@dataclass(frozen=True)
class Sse:
    """One Server-Sent Event: `id:` (the offset), `event:` (the kind), `data:` (the `RunEvent` JSON)."""

    id: int
    kind: str
    data: dict[str, Any]


def read_sse(url: str, headers: dict[str, str], *, last_event_id: int | None = None, stop_after: int | None = None,
             timeout: float = 120) -> list[Sse]:
    """The events of `GET url` until the stream ends (or `stop_after` events were read)."""
    sent = {**headers, **({'Last-Event-ID': str(last_event_id)} if last_event_id is not None else {})}
    events: list[Sse] = []
    fields: dict[str, str] = {}
    with httpx.stream('GET', url, headers=sent, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers['content-type'].startswith('text/event-stream')
        for line in response.iter_lines():
            if line:
                name, _, value = line.partition(': ')
                fields[name] = value
                continue
            if 'id' in fields:
                events.append(Sse(int(fields['id']), fields['event'], json.loads(fields['data'])))
                if stop_after is not None and len(events) >= stop_after:
                    break
            fields = {}
    return events
