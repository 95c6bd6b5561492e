"""Local servers die with their parent, and refuse what they cannot do.

Real processes: `durcap dev temporal` and `durcap run --engine temporal` (which starts an embedded Temporal dev
server) killed with SIGKILL / SIGTERM; the check reads /proc for the server's listening ports. Model for the run:
the scripted `FunctionModel` of `tests/engines/ledger_agent.py`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from durable_capabilities._servers import free_port, port_open
from tests.engines.test_runs import (
    DURCAP,
    LEDGER,
    ROOT,
    env_with,
    kill9,
    start,
    wait_text,
)

# One worker runs these and the other tests of group `port-7233`, one at a time (pytest-xdist `loadgroup`): they
# hold or need 127.0.0.1:7233, the port `durcap` uses when no Temporal address is configured.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('port-7233')]


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir('/proc'):
        if entry.isdigit():
            try:
                stat = Path(f'/proc/{entry}/stat').read_text()
            except OSError:
                continue
            if int(stat.rsplit(')', 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def listening_ports(pid: int) -> set[int]:
    """TCP ports process `pid` listens on (/proc/PID/fd sockets matched against /proc/net/tcp*)."""
    inodes = set()
    for fd in Path(f'/proc/{pid}/fd').iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith('socket:['):
            inodes.add(target[8:-1])
    ports = set()
    for table in ('/proc/net/tcp', '/proc/net/tcp6'):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == '0A' and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(':', 1)[1], 16))
    return ports


def alive(pid: int) -> bool:
    try:
        stat = Path(f'/proc/{pid}/stat').read_text()
    except OSError:
        return False
    return stat.rsplit(')', 1)[1].split()[0] != 'Z'


def server_of(parent: subprocess.Popen[bytes], timeout: float = 60) -> tuple[int, set[int]]:
    """The temporal server child of `parent` and the ports it listens on (once it listens on at least 3)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in children(parent.pid):
            try:
                if 'temporal' in Path(f'/proc/{child}/cmdline').read_text() and len(ports := listening_ports(child)) >= 3:
                    return child, ports
            except OSError:
                continue
        time.sleep(0.2)
    raise AssertionError('no temporal server child listening')


def assert_gone_within(pid: int, ports: set[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not alive(pid) and not any(port_open('127.0.0.1', p) for p in ports):
            return
        time.sleep(0.1)
    left = [p for p in ports if port_open('127.0.0.1', p)]
    raise AssertionError(f'server pid {pid} alive={alive(pid)}, ports still listening: {left}')


def test_kill9_of_durcap_dev_temporal_leaves_no_server(tmp_path: Path) -> None:
    port = free_port()
    dev = start(['dev', 'temporal', '--port', str(port), '--state-dir', str(tmp_path / 'state')], tmp_path / 'dev.log',
                env_with())
    pid = None
    try:
        wait_text(tmp_path / 'dev.log', 'temporal dev server at', dev, 90)
        pid, ports = server_of(dev)
        assert port in ports
        os.kill(dev.pid, signal.SIGKILL)  # the command only, not its process group
        dev.wait(timeout=10)
        assert_gone_within(pid, ports, 5)
    finally:
        kill9(dev)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_durcap_dev_temporal_serves_the_web_ui(tmp_path: Path) -> None:
    """`durcap dev temporal --ui --ui-port U` serves Temporal's Web UI on U (an HTML page) and says where; SIGTERM of
    the command stops both ports."""
    import urllib.request

    port, ui_port = free_port(), free_port()
    dev = start(['dev', 'temporal', '--port', str(port), '--ui', '--ui-port', str(ui_port), '--state-dir',
                 str(tmp_path / 'state')], tmp_path / 'dev.log', env_with())
    pid = None
    try:
        line = wait_text(tmp_path / 'dev.log', 'temporal dev server at', dev, 90)
        assert f'Web UI at http://127.0.0.1:{ui_port}' in line, line
        pid, ports = server_of(dev)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f'http://127.0.0.1:{ui_port}/', timeout=5) as page:
                    assert page.status == 200 and b'<html' in page.read(4096).lower()
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        os.killpg(dev.pid, signal.SIGTERM)
        dev.wait(timeout=30)
        assert_gone_within(pid, {*ports, ui_port}, 5)
    finally:
        kill9(dev)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_durcap_dev_temporal_refuses_a_port_another_process_holds(tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(('127.0.0.1', 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = subprocess.run([*DURCAP, 'dev', 'temporal', '--port', str(port), '--state-dir', str(tmp_path)],
                                cwd=ROOT, env=env_with(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f'port {port} on 127.0.0.1 is already in use by another process' in result.stderr


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_stopping_durcap_run_leaves_no_embedded_temporal_server(sig: signal.Signals, tmp_path: Path) -> None:
    """`durcap run --engine temporal` with no server configured starts an embedded one; SIGTERM or SIGKILL of the
    command mid-run (its tool sleeps 300 s in the in-process worker) leaves no process listening on its ports within
    5 s. Ctrl-C (SIGINT), and SIGTERM (exit 143 at once, no graceful stop of the worker), say the run is gone with the
    in-memory server (no `runs resume` advice that would point at a server that no longer exists)."""
    assert not port_open('127.0.0.1', 7233), 'a server on 7233 would be used instead of an embedded one'
    ledger = tmp_path / 'ledger'
    env = env_with(DURCAP_TEMPORAL_ADDRESS='', TEMPORAL_ADDRESS='', DURCAP_LEDGER_DIR=str(ledger),
                   DURCAP_LEDGER_AGENT=f'ledger-{uuid.uuid4().hex[:6]}', DURCAP_LEDGER_CHARGE_SECONDS='300')
    run = start(['run', LEDGER, 'charge order F-6', '--engine', 'temporal'], tmp_path / 'run.log', env)
    pid = None
    try:
        pid, ports = server_of(run, 90)
        line = wait_text(tmp_path / 'run.log', 'temporal workflow id: ', run, 90)
        assert 'at 127.0.0.1:' in line  # the run says which server it used
        said = wait_text(tmp_path / 'run.log', 'temporal server: starting an embedded in-memory dev server at ', run, 1)
        ports |= listening_ports(pid)  # the server binds its ports one by one: read them again now that it serves
        assert int(said.split('dev server at 127.0.0.1:')[1].split()[0]) in ports, (said, ports)
        deadline = time.monotonic() + 90
        while not (ledger / 'charge-started-F-6').exists():
            assert time.monotonic() < deadline and run.poll() is None, (tmp_path / 'run.log').read_text()
            time.sleep(0.1)
        os.kill(run.pid, sig)
        # Ctrl-C stops the run's worker and its embedded server gracefully before the line is printed: longer on a
        # loaded machine than a signal that ends the process at once (SIGTERM prints the line and exits).
        code = run.wait(timeout=60 if sig == signal.SIGINT else 10)
        assert_gone_within(pid, ports, 5)
        if sig != signal.SIGKILL:
            text = (tmp_path / 'run.log').read_text()
            assert code == (130 if sig == signal.SIGINT else 143), (code, text)
            assert 'was on the embedded in-memory Temporal dev server' in text, text
            assert 'runs resume' not in text, text
    finally:
        kill9(run)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_demo_on_temporal_says_it_uses_the_server_on_7233(tmp_path: Path) -> None:
    """`durcap demo --engine temporal` with no address configured and something listening on 127.0.0.1:7233 says it
    uses that existing server (not started by durcap) before it runs. The listener is a plain socket when the port
    is free (the run then fails to talk to it: only the line is checked) or whatever server already holds it."""
    import socket

    holder = socket.socket()
    try:
        try:
            holder.bind(('127.0.0.1', 7233))
            holder.listen()
        except OSError:
            assert port_open('127.0.0.1', 7233), 'port 7233 is neither free nor listening'
        env = env_with(DURCAP_TEMPORAL_ADDRESS='', TEMPORAL_ADDRESS='')
        demo = start(['demo', '--engine', 'temporal'], tmp_path / 'demo.log', env)
        try:
            line = wait_text(tmp_path / 'demo.log', 'temporal server: ', demo, 90)
        finally:
            kill9(demo)
    finally:
        holder.close()
    assert "temporal server: using the existing server at 127.0.0.1:7233, namespace 'default'" in line, line
    assert 'not started by durcap' in line, line


def test_kill9_of_durcap_run_on_prefect_leaves_no_temporary_server(tmp_path: Path) -> None:
    """`durcap run --engine prefect` without PREFECT_API_URL starts a temporary local Prefect server and says where;
    `kill -9` of the command mid-tool leaves no process listening on that port within 5 s (Prefect's own temporary
    server, a uvicorn child, outlived its parent). The server is launched early (`warm_up`) and a line says so
    before the wait."""
    ledger = tmp_path / 'ledger'
    env = {k: v for k, v in env_with(
        PREFECT_HOME=str(tmp_path / 'prefect-home'), PREFECT_LOCAL_STORAGE_PATH=str(tmp_path / 'results'),
        DURCAP_LEDGER_DIR=str(ledger), DURCAP_LEDGER_AGENT=f'ledger-{uuid.uuid4().hex[:6]}',
        DURCAP_LEDGER_CHARGE_SECONDS='300').items() if k != 'PREFECT_API_URL'}
    run = start(['run', LEDGER, 'charge order G-7', '--engine', 'prefect'], tmp_path / 'run.log', env)
    pid = None
    try:
        line = wait_text(tmp_path / 'run.log', 'prefect server: temporary local server at http://127.0.0.1:', run, 120)
        port = int(line.split('http://127.0.0.1:')[1].split('/')[0])
        log = (tmp_path / 'run.log').read_text()  # the wait is said before it starts (issue 29 item 6), once
        assert log.count('prefect server: starting a temporary local server, as PREFECT_API_URL is not set') == 1, log
        assert log.index('starting a temporary local server') < log.index('temporary local server at'), log
        assert port_open('127.0.0.1', port)
        pid = next(c for c in children(run.pid) if port in listening_ports(c))
        wait_text(tmp_path / 'run.log', 'prefect flow run id: ', run, 120)
        deadline = time.monotonic() + 120
        while not (ledger / 'charge-started-G-7').exists():
            assert time.monotonic() < deadline and run.poll() is None, (tmp_path / 'run.log').read_text()
            time.sleep(0.1)
        os.kill(run.pid, signal.SIGKILL)  # the command only, not its process group
        run.wait(timeout=10)
        assert_gone_within(pid, {port}, 5)
    finally:
        kill9(run)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_runs_list_of_every_engine_skips_an_unconfigured_prefect(tmp_path: Path) -> None:
    """`durcap runs list` without --engine and without PREFECT_API_URL: one note that Prefect is skipped; no
    temporary Prefect server is started (it would create its database in PREFECT_HOME)."""
    home = tmp_path / 'prefect-home'
    env = {k: v for k, v in env_with(PREFECT_HOME=str(home)).items() if k != 'PREFECT_API_URL'}
    result = subprocess.run([*DURCAP, 'runs', 'list', '--db', f'sqlite:///{tmp_path / "dbos.sqlite"}', '--address',
                             os.environ.get('DURCAP_TEST_TEMPORAL_ADDRESS', '127.0.0.1:7233')], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    notes = [line for line in result.stderr.splitlines() if 'prefect' in line]
    assert notes == ['note: prefect: skipped, no PREFECT_API_URL configured (`--engine prefect` reads the database of '
                     "Prefect's temporary local server)"], result.stderr
    assert not (home / 'prefect.db').exists()


def test_schedule_prefect_without_an_api_refuses(tmp_path: Path) -> None:
    env = {k: v for k, v in env_with(PREFECT_HOME=str(tmp_path / 'prefect-home')).items() if k != 'PREFECT_API_URL'}
    result = subprocess.run([*DURCAP, 'schedule', 'prefect', 'examples.support.agent:support', '--interval', '60',
                             '--prompt', 'hi', '--deps-json', '{"orders": {}}'], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    assert 'no Prefect API configured' in result.stderr and 'prefect server start' in result.stderr
