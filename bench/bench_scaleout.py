"""Benchmark: runs spread over 1, 2 and 3 workers, on DBOS (one PostgreSQL system database), Temporal and Prefect; and
with `--kill`, the runs of a worker killed with SIGKILL finished by the others (issue 29).

    .venv/bin/python bench/bench_scaleout.py                              # all engines, 40 runs, workers 1 2 3
    .venv/bin/python bench/bench_scaleout.py --engines dbos --runs 40 --workers 1 2 3 --concurrency 4 \
        --tool-seconds 1 --postgres postgresql://postgres@127.0.0.1:5432
    .venv/bin/python bench/bench_scaleout.py --engines temporal --address 127.0.0.1:7233   # a running server
    .venv/bin/python bench/bench_scaleout.py --engines prefect --prefect-api-url http://127.0.0.1:4200/api
    .venv/bin/python bench/bench_scaleout.py --kill                       # 3 workers, 20 runs, SIGKILL of one

Every run is a run of `bench/scaleout_agent.py:agent` (model: a scripted `FunctionModel`; its one tool waits
`--tool-seconds` on I/O and writes `start`/`done` lines, with its run's key and its process id, to a ledger file).
Workers are real processes started here and stopped by process id; each is capped at `--concurrency` runs at once:

- DBOS: a new PostgreSQL database per configuration (dropped at the end), `durcap worker dbos` processes (own
  executor ids, one queue, `--concurrency`: DBOS's `worker_concurrency`); the runs are enqueued at once with
  `DBOSClient.enqueue` (what `durcap run --engine dbos --queue` does). Which executor ran each run is also DBOS's own
  record (`workflow_status.executor_id`).
- Temporal: `durcap worker temporal --no-versioning` processes on a new task queue (`--concurrency`: activities at
  once per worker), on an in-memory dev server started here (or `--address`); runs started at once with
  `engines.temporal.start_run`.
- Prefect: `durcap schedule prefect --limit N` processes serving one new deployment (a yearly cron that never fires
  during the bench) on the Prefect server of `--prefect-api-url` (default `$DURCAP_TEST_PREFECT_API_URL`, else
  `$PREFECT_API_URL`); the runs are flow runs created at once through the REST API (`create_flow_run`). Every flow
  run is its own process, forked by the fork server of the serving process that takes it (the ledger's parent pid
  says which); `--prefect-spawn` serves with `--spawn` (Prefect's new Python process per flow run, as before).
  `PREFECT_RUNNER_POLL_FREQUENCY` is `--prefect-poll` (default 1 s; Prefect's default is 10 s). Also printed: where a
  flow run's time goes, from its state history (created -> PENDING: waiting for a serving process with a free slot;
  PENDING -> RUNNING: its process starting and loading the flow; RUNNING -> COMPLETED: the flow).

Throughput = runs / seconds from the first submission to the last run's completion. `cpu/run`: CPU seconds of the
worker processes (Prefect: serving processes and their flow-run processes) per run, from /proc. `server/run`: DBOS,
PostgreSQL transactions in the run's database per run (workers' queue polls and heartbeats included); Temporal, CPU
seconds of the dev server started here per run; Prefect: CPU seconds of the Prefect server per run with
`--prefect-server-pid` (a server of the bench's own: its background services count too), else not told apart.

Targets (issue 29): 2 workers >= 1.8x one worker, 3 >= 2.5x, every worker doing >= 20% of the runs. Figures, and
what limits a 20-worker, 3-machine deployment per engine on paper: bench/README.md.

`--kill` (per engine in `--engines`): 3 workers (`--kill-workers`), 20 runs (`--kill-runs`) submitted at once, tool
`--kill-tool-seconds` (default 2 s); once a worker has tools in flight, it is SIGKILLed (on Prefect with its flow-run
processes: a lost machine), and nothing else is done. Measured: that every run completes, that each tool side effect
happened once (a run whose tool was started by the killed worker may run it once more: the one in flight), and the
seconds from the kill to the last run's completion (targets: <= 10 s Temporal, <= 30 s DBOS and Prefect). Exits 1
when a run is lost or a side effect repeats more than that. Engine settings are the defaults (DBOS `--peer-timeout`
15 s; Prefect `$DURCAP_PREFECT_STALE_SECONDS` 15 s, beats every 2 s: set them in the environment to try others).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = 'bench/scaleout_agent.py:agent'
DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']
ENGINES = ('dbos', 'temporal', 'prefect')
KILL_TARGETS = {'temporal': 10.0, 'dbos': 30.0, 'prefect': 30.0}
"""Seconds from the SIGKILL to the last run's completion (issue 29)."""
TICK = os.sysconf('SC_CLK_TCK')


# --- processes ---------------------------------------------------------------------------------------------------


def _wait_line(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and needle in log.read_text(errors='replace'):
            return
        if proc.poll() is not None:
            raise RuntimeError(f'worker exited: {log.read_text(errors="replace")[-2000:]}')
        time.sleep(0.1)
    raise TimeoutError(f'no {needle!r} in {log} within {timeout} s')


def _children(pid: int) -> list[int]:
    """The process ids of `pid`'s descendants (from /proc; empty once it is gone)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f'/proc/{pid}/task'):
            with contextlib.suppress(OSError):
                for child in Path(f'/proc/{pid}/task/{task}/children').read_text().split():
                    found += [int(child), *_children(int(child))]
    return found


def _cpu(pid: int) -> float:
    """CPU seconds of process `pid`, its live descendants and the children each of them reaped (0 once it is gone):
    a reaped process's time is in its parent's `cutime` only, and a live one's in its own `utime` only, so nothing
    counts twice (a Prefect serving process's flow-run processes are children of its fork server)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f'/proc/{p}/stat').read_text().rsplit(')', 1)[1].split()
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / TICK
    return total


def _sigkill_tree(pid: int) -> list[int]:
    """SIGKILL process `pid` first (so it sees none of its children end), then its descendants; returns them."""
    children = _children(pid)
    for p in [pid, *children]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    return children


def _stop(procs: list[subprocess.Popen[bytes]], grace: float = 40) -> None:
    """SIGTERM each worker's process group (they drain), SIGKILL what is still alive after `grace` s."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            for child in _sigkill_tree(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            proc.wait()


def _start(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with open(log, 'wb') as out:
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def load() -> str:
    """The 1-minute load average now."""
    return Path('/proc/loadavg').read_text().split()[0]


# --- the ledger --------------------------------------------------------------------------------------------------


@dataclass
class Entry:
    event: str
    key: str
    pid: int
    ppid: int
    at: float


def read_ledger(path: Path) -> list[Entry]:
    """The tool's ledger lines (`scaleout_agent`: `EVENT KEY PID PPID UNIX_TIME`); a torn last line is skipped."""
    entries = []
    if path.exists():
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                entries.append(Entry(parts[0], parts[1], int(parts[2]), int(parts[3]), float(parts[4])))
    return entries


# --- one engine's workers ------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    """Workers of one engine serving `scaleout_agent`, started here; `submit` hands runs to them, `done` says which
    finished (key -> monotonic seconds when seen done), `failed` which ended otherwise."""

    engine: str
    workers: int
    concurrency: int
    tool_seconds: float
    scratch: Path
    args: argparse.Namespace
    name: str = field(default_factory=lambda: f'scaleout-{uuid.uuid4().hex[:8]}')
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    done: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def ledger(self) -> Path:
        return self.scratch / f'{self.name}.ledger'

    def env(self, **extra: str) -> dict[str, str]:
        # $BENCH_SCALEOUT_PYTHONPATH: more import folders for the workers (e.g. one with a request-counting
        # sitecustomize.py, as bench/README.md's Prefect requests-per-run figures were taken).
        path = os.pathsep.join([str(ROOT), str(ROOT / 'src'), *filter(None, [os.environ.get('BENCH_SCALEOUT_PYTHONPATH')])])
        return dict(os.environ, PYTHONPATH=path, BENCH_SCALEOUT_LEDGER=str(self.ledger),
                    BENCH_SCALEOUT_TOOL_SECONDS=str(self.tool_seconds), **extra)

    def log(self, i: int) -> Path:
        return self.scratch / f'{self.name}-w{i}.log'

    def worker_of(self, entry: Entry) -> int | None:
        """Which worker (index) ran the tool of a ledger entry: its process, or (Prefect) its parent."""
        for i, proc in enumerate(self.procs):
            if proc.pid in (entry.pid, entry.ppid):
                return i
        return None

    def start(self) -> None:
        """Start the workers and wait until each is ready."""
        raise NotImplementedError

    def submit(self, keys: list[str]) -> None:
        """Hand one run per key (its prompt) to the workers, all at once."""
        raise NotImplementedError

    def poll(self) -> None:
        """Look once at which runs finished (`done`, `failed`)."""
        raise NotImplementedError

    def held(self, i: int) -> int:
        """Runs worker `i` holds now (engine's own view); -1 where the engine has no such view."""
        return -1

    def close(self) -> None:
        _stop(self.procs)

    def cpu(self) -> float:
        """CPU seconds of the workers so far (their child processes included)."""
        return sum(_cpu(p.pid) for p in self.procs)

    def server_mark(self) -> float | None:
        """A counter of the server's work (DBOS: transactions in the run's database; Temporal: CPU seconds of the dev
        server started here), to divide its growth by the runs; `None` where it cannot be told apart."""
        return None

    def details(self, keys: list[str]) -> list[str]:
        """Extra lines for the report (Prefect: where a flow run's time goes)."""
        return []


class DbosCluster(Cluster):
    def start(self) -> None:
        import psycopg
        from dbos import DBOSClient
        from psycopg import sql

        self.db = self.name.replace('-', '_')
        with psycopg.connect(f'{self.args.postgres}/postgres', autocommit=True) as conn:
            conn.execute(sql.SQL('CREATE DATABASE {}').format(sql.Identifier(self.db)))
        self.url = f'{self.args.postgres}/{self.db}'
        env = self.env()
        for i in range(self.workers):
            self.procs.append(_start([*DURCAP, 'worker', 'dbos', TARGET, '--db', self.url, '--task-queue', 'bench',
                                      '--executor-id', f'w{i}', '--concurrency', str(self.concurrency)], self.log(i), env))
        for i, proc in enumerate(self.procs):
            _wait_line(self.log(i), 'dbos worker ready', proc, 180)
        self.client = DBOSClient(system_database_url=self.url)

    def submit(self, keys: list[str]) -> None:
        self.ids = [self.client.enqueue({'queue_name': 'bench', 'workflow_name': 'durcap.scaleout', 'workflow_id': k},
                                        k, None, None, None).workflow_id for k in keys]

    def poll(self) -> None:
        now = time.monotonic()
        self.statuses = self.client.list_workflows(workflow_ids=self.ids, load_input=False, load_output=False)
        for w in self.statuses:
            if w.status == 'SUCCESS':
                self.done.setdefault(w.workflow_id, now)
            elif w.status in ('ERROR', 'CANCELLED', 'MAX_RECOVERY_ATTEMPTS_EXCEEDED'):
                self.failed[w.workflow_id] = w.status

    def server_mark(self) -> float | None:
        import psycopg

        time.sleep(1.5)  # PostgreSQL's statistics reach pg_stat_database within a second of a transaction
        with psycopg.connect(f'{self.args.postgres}/postgres', autocommit=True) as conn:
            row = conn.execute('SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s',
                               (self.db,)).fetchone()
        return float(row[0]) if row else None

    def held(self, i: int) -> int:
        return sum(1 for w in self.client.list_workflows(workflow_ids=self.ids, load_input=False, load_output=False)
                   if w.status == 'PENDING' and w.executor_id == f'w{i}')

    def per_executor(self) -> dict[str, int]:
        per: dict[str, int] = {}
        for w in self.statuses:
            per[str(w.executor_id)] = per.get(str(w.executor_id), 0) + 1
        return per

    def close(self) -> None:
        import psycopg
        from psycopg import sql

        try:
            if getattr(self, 'client', None) is not None:
                self.client.destroy()
            super().close()
        finally:
            if getattr(self, 'db', None):
                with psycopg.connect(f'{self.args.postgres}/postgres', autocommit=True) as conn:
                    conn.execute(sql.SQL('DROP DATABASE IF EXISTS {} WITH (FORCE)').format(sql.Identifier(self.db)))


class TemporalCluster(Cluster):
    """The client lives on an event loop in a thread of its own, so each run's result is awaited as it comes."""

    tasks: list[Any]

    def start(self) -> None:
        sys.path[:0] = [str(ROOT), str(ROOT / 'src')]
        from durable_capabilities.engines.temporal import connect

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        env = self.env()
        for i in range(self.workers):
            self.procs.append(_start([*DURCAP, 'worker', 'temporal', TARGET, '--address', self.args.address,
                                      '--task-queue', self.name, '--concurrency', str(self.concurrency),
                                      '--no-versioning'], self.log(i), env))
        for i, proc in enumerate(self.procs):
            _wait_line(self.log(i), 'worker ready', proc, 180)
        self.client = self._call(connect(self.args.address))

    def server_mark(self) -> float | None:
        pid = getattr(self.args, 'server_pid', None)
        return _cpu(pid) if pid else None

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def submit(self, keys: list[str]) -> None:
        from bench.scaleout_agent import agent
        from durable_capabilities.engines.temporal import start_run

        async def one(key: str) -> None:
            handle = await start_run(self.client, agent, key, task_queue=self.name, workflow_id=f'{self.name}-{key}')
            try:
                await handle.result()
                self.done[key] = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the run failed: reported, never retried here
                self.failed[key] = type(exc).__name__

        async def all_() -> None:
            self.tasks = [asyncio.ensure_future(one(k)) for k in keys]

        self._call(all_())

    def poll(self) -> None:
        """Nothing to do: each run's result is awaited on the client's loop, which fills `done` as they come."""

    def close(self) -> None:
        try:
            super().close()
        finally:
            if getattr(self, 'loop', None) is not None:
                for task in getattr(self, 'tasks', []):
                    self.loop.call_soon_threadsafe(task.cancel)
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(timeout=10)


class PrefectCluster(Cluster):
    def start(self) -> None:
        import httpx

        self.api = self.args.prefect_api_url.rstrip('/')
        self.http = httpx.Client(base_url=self.api, timeout=30)
        env = self.env(PREFECT_API_URL=self.api, PREFECT_HOME=str(self.scratch / f'{self.name}-home'),
                       PREFECT_LOCAL_STORAGE_PATH=str(self.scratch / f'{self.name}-results'),
                       PREFECT_RUNNER_POLL_FREQUENCY=str(self.args.prefect_poll))
        for i in range(self.workers):
            self.procs.append(_start([*DURCAP, 'schedule', 'prefect', TARGET, '--prompt', 'never (yearly cron)',
                                      '--cron', '0 0 1 1 *', '--name', self.name, '--limit', str(self.concurrency),
                                      *(['--spawn'] if self.args.prefect_spawn else [])],
                                     self.log(i), env))
        for i, proc in enumerate(self.procs):
            _wait_line(self.log(i), 'serving deployment', proc, 180)
        deadline = time.monotonic() + 120
        url = f'/deployments/name/durcap-scaleout/{self.name}'
        while (found := self.http.get(url)).status_code == 404:  # `serve` creates it after the line above
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f'no deployment {self.name}: {self.log(0).read_text()[-2000:]}')
            time.sleep(0.2)
        self.deployment = found.json()['id']
        # No serving process says when its runner polls: give each a few polls after the deployment appeared.
        time.sleep(3 * self.args.prefect_poll + 1)
        # Each serving process's helpers (its fork server, multiprocessing's resource tracker), before any flow run:
        # a flow-run process whose parent is one of them belongs to that serving process.
        self.helpers = [set(_children(proc.pid)) for proc in self.procs]

    def server_mark(self) -> float | None:
        pid = self.args.prefect_server_pid
        return _cpu(pid) if pid else None

    def serving_cpu(self) -> float:
        """CPU seconds of the serving processes themselves (their runner, beats and watch rounds, all threads), without
        their flow-run processes and fork servers (`cpu` minus this: the flow-run processes' share)."""
        total = 0.0
        for proc in self.procs:
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f'/proc/{proc.pid}/stat').read_text().rsplit(')', 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / TICK
        return total

    def worker_of(self, entry: Entry) -> int | None:
        for i, proc in enumerate(self.procs):
            if proc.pid in (entry.pid, entry.ppid) or entry.ppid in self.helpers[i]:
                return i
        return None

    def _request(self, method: str, url: str, **kwargs: Any) -> Any:
        """One API request, retried for 60 s while the server answers 5xx (a busy shared server's SQLite database
        answers 503 for a moment); the JSON answer."""
        deadline = time.monotonic() + 60
        while True:
            response = self.http.request(method, url, **kwargs)
            if response.status_code < 500 or time.monotonic() > deadline:
                response.raise_for_status()
                return response.json()
            time.sleep(0.2)

    def submit(self, keys: list[str]) -> None:
        self.ids: dict[str, str] = {}
        for key in keys:
            created = self._request('POST', f'/deployments/{self.deployment}/create_flow_run',
                                    json={'parameters': {'prompt': key, 'deps': None}})
            self.ids[created['id']] = key

    def poll(self) -> None:
        now = time.monotonic()
        runs = self._request('POST', '/flow_runs/filter', json={'flow_runs': {'id': {'any_': list(self.ids)}},
                                                                'limit': 200})
        for run in runs:
            key = self.ids[run['id']]
            if run['state_type'] == 'COMPLETED':
                self.done.setdefault(key, now)
            elif run['state_type'] in ('FAILED', 'CANCELLED'):
                self.failed[key] = run['state_type']

    def held(self, i: int) -> int:
        parents = {self.procs[i].pid, *self.helpers[i]}
        return len([c for c in _children(self.procs[i].pid) if c not in self.helpers[i] and _parent(c) in parents])

    def details(self, keys: list[str]) -> list[str]:
        """Where a flow run's time goes, from each run's state history (server timestamps)."""
        from datetime import datetime

        def at(text: str) -> float:
            return datetime.fromisoformat(text.replace('Z', '+00:00')).timestamp()

        waits: list[float] = []
        starts: list[float] = []
        flows: list[float] = []
        for flow_run_id in self.ids:
            states = self._request('GET', '/flow_run_states/', params={'flow_run_id': flow_run_id})
            times = sorted((at(s['timestamp']), s['type']) for s in states)
            first = {kind: t for t, kind in reversed(times)}  # the first time of each state type
            if {'PENDING', 'RUNNING', 'COMPLETED'} <= first.keys():
                waits.append(first['PENDING'] - times[0][0])
                starts.append(first['RUNNING'] - first['PENDING'])
                flows.append(first['COMPLETED'] - first['RUNNING'])

        def stat(values: list[float]) -> str:
            return f'median {statistics.median(values):5.2f} s, max {max(values):5.2f} s' if values else 'none'

        tasks = self._request('POST', '/task_runs/count', json={'flow_runs': {'id': {'any_': list(self.ids)}}})
        return [f'  task runs/flow run: {tasks / len(self.ids):.1f} (each a few API requests: created, RUNNING, '
                'COMPLETED with its result)',
                f'  where a flow run\'s time goes ({len(starts)} runs):',
                f'    created -> PENDING (a serving process with a free slot takes it): {stat(waits)}',
                f'    PENDING -> RUNNING (its process starts and loads the flow):          {stat(starts)}',
                f'    RUNNING -> COMPLETED (the flow: 3 model tasks, the tool, results):  {stat(flows)}']

    def recovery(self, kill_wall: float) -> list[str]:
        """Each flow run the killed serving process left behind and the survivors found dead: its state at the kill
        (PENDING or RUNNING), then seconds from the kill (server timestamps against this machine's clock) to its
        CRASHED mark, its rescheduling, its PENDING again (a serving process took it), RUNNING and its completion; and
        when the last of the runs still queued at the kill was taken."""
        from datetime import datetime

        lines = []
        queued: list[float] = []  # when each run still waiting for a slot at the kill was taken (first PENDING)
        for flow_run_id, key in self.ids.items():
            states = self._request('GET', '/flow_run_states/', params={'flow_run_id': flow_run_id})
            times = sorted((datetime.fromisoformat(s['timestamp'].replace('Z', '+00:00')).timestamp(), s['type'],
                            s.get('message') or '') for s in states)
            crashed = [n for n, (_, kind, message) in enumerate(times) if kind == 'CRASHED' and 'no beat' in message]
            if not crashed:
                taken = next((t for t, kind, _ in times if kind == 'PENDING'), None)
                if taken is not None and taken > kill_wall:
                    queued.append(taken - kill_wall)
                continue
            n = crashed[0]
            after = {kind: t for t, kind, _ in reversed(times[n + 1:])}
            steps = [f'CRASHED +{times[n][0] - kill_wall:.1f}'] + [
                f'{kind} +{after[kind] - kill_wall:.1f}' for kind in ('SCHEDULED', 'PENDING', 'RUNNING', 'COMPLETED') if kind in after]
            lines.append(f'  {key}: {times[n - 1][1] if n else "?"} at the kill; {", ".join(steps)} s after the kill')
        if queued:
            lines.append(f'  the queue: {len(queued)} other runs were still waiting for a slot at the kill; the last '
                         f'of them taken (PENDING) +{max(queued):.1f} s after the kill')
        return lines

    def close(self) -> None:
        try:
            super().close()
        finally:
            if getattr(self, 'http', None) is not None:
                with contextlib.suppress(Exception):  # leave the shared server as it was
                    for flow_run_id in getattr(self, 'ids', {}):
                        self.http.delete(f'/flow_runs/{flow_run_id}')
                    if getattr(self, 'deployment', None):
                        self.http.delete(f'/deployments/{self.deployment}')
                self.http.close()


def _parent(pid: int) -> int:
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()[1])
    return 0


CLUSTERS: dict[str, type[Cluster]] = {'dbos': DbosCluster, 'temporal': TemporalCluster, 'prefect': PrefectCluster}


def wait_all(cluster: Cluster, keys: list[str], timeout: float, every: float = 0.1,
             each: Callable[[], None] | None = None) -> bool:
    """Poll until every run is done or failed, or `timeout` s passed (False then); `each` runs after every poll."""
    deadline = time.monotonic() + timeout
    while True:
        cluster.poll()
        if each is not None:
            each()
        if all(k in cluster.done or k in cluster.failed for k in keys):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(every)


# --- scale-out ---------------------------------------------------------------------------------------------------


def measure(engine: str, workers: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """One configuration: start the workers, submit the runs at once, wait; runs/s and runs per worker."""
    cluster = CLUSTERS[engine](engine, workers, args.concurrency, args.tool_seconds, scratch, args)
    keys = [f'r{n}' for n in range(args.runs)]
    try:
        cluster.start()
        if args.warm:  # warm-up runs, before the clock: each worker's first runs (imports, caches, connections)
            warm = [f'warm{n}' for n in range(args.warm * workers)]
            cluster.submit(warm)
            if not wait_all(cluster, warm, args.timeout, every=0.1 if engine != 'prefect' else 0.25) or cluster.failed:
                raise RuntimeError(f'{engine}, {workers} workers: warm-up runs not done, failed {cluster.failed}')
            cluster.done.clear()
        mark0 = cluster.server_mark()
        serving0 = cluster.serving_cpu() if isinstance(cluster, PrefectCluster) else None
        cpu0, load0 = cluster.cpu(), load()
        start, wall_start = time.monotonic(), time.time()
        cluster.submit(keys)
        finished = wait_all(cluster, keys, args.timeout, every=0.1 if engine != 'prefect' else 0.25)
        if not finished or cluster.failed:
            raise RuntimeError(f'{engine}, {workers} workers: not done {sorted(set(keys) - cluster.done.keys())}, '
                               f'failed {cluster.failed}')
        seconds = max(cluster.done.values()) - start
        cpu = cluster.cpu() - cpu0
        serving = None if serving0 is None else cluster.serving_cpu() - serving0  # type: ignore[attr-defined]
        load1, mark1 = load(), cluster.server_mark()
        server = None if mark0 is None or mark1 is None else (mark1 - mark0) / args.runs
        per: dict[str, int] = {f'w{i}': 0 for i in range(workers)}
        measured = set(keys)
        entries = [entry for entry in read_ledger(cluster.ledger) if entry.key in measured]
        for entry in entries:
            if entry.event == 'done':
                index = cluster.worker_of(entry)
                name = f'w{index}' if index is not None else f'pid {entry.pid}'
                per[name] = per.get(name, 0) + 1
        result = {'workers': workers, 'seconds': seconds, 'runs_per_s': args.runs / seconds, 'per_worker': per,
                  'cpu_per_run': cpu / args.runs, 'load': f'{load0}-{load1}', 'server': server,
                  'serving_per_run': None if serving is None else serving / args.runs,
                  'timeline': timeline(entries, wall_start, wall_start + seconds, workers, args)}
        try:
            result['details'] = cluster.details(keys)
        except Exception as exc:  # noqa: BLE001 - extra figures only: the measurement stands without them
            result['details'] = [f'  (no details: {type(exc).__name__}: {exc})']
        if isinstance(cluster, DbosCluster):
            result['dbos_record'] = cluster.per_executor()
        return result
    finally:
        cluster.close()


def timeline(entries: list[Entry], began: float, ended: float, workers: int, args: argparse.Namespace) -> str:
    """Where a configuration's time went, from the tools' ledger (unix times): `head`, from handing the runs over to
    the first tool starting; `tail`, from the last tool's side effect to the last result; the most tools running at
    once (the slots they got: on Temporal `--concurrency` caps every activity, so model requests take slots too); and
    `ideal`, the tool time alone with every slot busy (`ceil(runs / (workers x concurrency))` rounds of
    `--tool-seconds`), against the measured seconds."""
    starts = sorted(e.at for e in entries if e.event == 'start')
    dones = sorted(e.at for e in entries if e.event == 'done')
    if not starts or not dones:
        return '  (no timeline: empty ledger)'
    points = sorted([(t, 1) for t in starts] + [(t, -1) for t in dones])
    running = most = 0
    for _, step in points:
        running += step
        most = max(most, running)
    rounds = math.ceil(args.runs / (workers * args.concurrency))
    ideal = rounds * args.tool_seconds
    return (f'  timeline: head {starts[0] - began:.2f} s (runs handed over -> first tool starts), tools '
            f'{dones[-1] - starts[0]:.2f} s, tail {ended - dones[-1]:.2f} s (last tool done -> last result); at most '
            f'{most} tools at once of {workers * args.concurrency} slots; ideal {rounds} rounds x '
            f'{args.tool_seconds:g} s = {ideal:.1f} s, measured {ended - began:.2f} s (overhead {ended - began - ideal:.2f} s)')


def report(engine: str, title: str, results: list[dict[str, Any]]) -> None:
    base = results[0]['runs_per_s']
    print(title)
    unit = {'dbos': 'xact', 'temporal': 'cpu-s', 'prefect': 'cpu-s'}.get(engine, '')
    print(f'{"workers":>7} {"seconds":>8} {"runs/s":>7} {"x one":>6} {"cpu/run":>8} {"server/run":>10} {"load":>11}  '
          'runs per worker (share)')
    for r in results:
        total = sum(r['per_worker'].values())
        shares = ', '.join(f'{k}: {v} ({v / total:.0%})' for k, v in sorted(r['per_worker'].items()))
        server = '-' if r['server'] is None else f'{r["server"]:.2f} {unit}'
        print(f'{r["workers"]:>7} {r["seconds"]:>8.2f} {r["runs_per_s"]:>7.2f} {r["runs_per_s"] / base:>6.2f} '
              f'{r["cpu_per_run"]:>7.2f}s {server:>10} {r["load"]:>11}  {shares}')
        if 'dbos_record' in r:
            print(f'{"":>52}DBOS executor_id: {r["dbos_record"]}')
        if r.get('serving_per_run') is not None:
            print(f'  cpu/run: flow-run processes {r["cpu_per_run"] - r["serving_per_run"]:.3f} s, serving processes '
                  f'{r["serving_per_run"]:.3f} s' + ('' if r['server'] is None else f', Prefect server {r["server"]:.3f} s'))
        print(r['timeline'])
        for line in r['details']:
            print(line)
    print(flush=True)


# --- the kill ----------------------------------------------------------------------------------------------------


@dataclass
class KillResult:
    engine: str
    workers: int
    runs: int
    killed: str = ''
    held: int = -1
    in_flight: int = 0
    completed: int = 0
    lost: list[str] = field(default_factory=list)
    reran: int = 0
    repeats: list[str] = field(default_factory=list)
    """Keys whose side effect ran more often than allowed (with how often)."""
    seconds: float = math.nan
    recovered: float = math.nan
    """Seconds from the kill to the last completion among the runs whose tool the killed worker had started (the rest
    of `seconds` is the queue of runs no worker had taken yet)."""
    load: str = ''
    error: str = ''
    notes: list[str] = field(default_factory=list)
    """Engine-specific lines under the row (Prefect: each run found dead, `PrefectCluster.recovery`)."""

    @property
    def ok(self) -> bool:
        return not self.error and not self.lost and not self.repeats and self.completed == self.runs


def check_ledger(entries: list[Entry], keys: list[str], killed: Callable[[Entry], bool]) -> tuple[int, list[str]]:
    """Each tool side effect once: a key whose tool the killed worker started may start and finish it at most twice
    (the one in flight runs again), any other exactly once, and every key at least once.

    Returns:
        (how many keys' tools ran again, the keys beyond that allowance as `key: started N, done M`).
    """
    started: dict[str, int] = {k: 0 for k in keys}
    finished: dict[str, int] = {k: 0 for k in keys}
    touched: set[str] = set()
    for entry in entries:
        if entry.key not in started:
            continue
        if entry.event == 'start':
            started[entry.key] += 1
            if killed(entry):
                touched.add(entry.key)
        elif entry.event == 'done':
            finished[entry.key] += 1
    allowed = {k: 2 if k in touched else 1 for k in keys}
    bad = [f'{k}: started {started[k]}, done {finished[k]}' for k in keys
           if finished[k] < 1 or started[k] > allowed[k] or finished[k] > allowed[k]]
    return sum(1 for k in keys if started[k] > 1), bad


def kill_bench(engine: str, args: argparse.Namespace, scratch: Path) -> KillResult:
    """`--kill-workers` workers, `--kill-runs` runs at once; SIGKILL of the worker with the most tools in flight (once
    one has at least half its slots' worth), then wait for every run with no other action."""
    result = KillResult(engine, args.kill_workers, args.kill_runs)
    cluster = CLUSTERS[engine](engine, args.kill_workers, args.concurrency, args.kill_tool_seconds, scratch, args)
    keys = [f'k{n}' for n in range(args.kill_runs)]
    try:
        cluster.start()
        cluster.submit(keys)
        threshold = max(1, min(args.concurrency, math.ceil(args.kill_runs / args.kill_workers)) // 2)
        deadline = time.monotonic() + 300
        while True:
            running: dict[int, set[str]] = {}
            for entry in read_ledger(cluster.ledger):
                index = cluster.worker_of(entry)
                if index is None:
                    continue
                if entry.event == 'start':
                    running.setdefault(index, set()).add(entry.key)
                else:
                    running.get(index, set()).discard(entry.key)
            busiest = max(running, key=lambda i: len(running[i]), default=None)
            if busiest is not None and len(running[busiest]) >= threshold:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f'no worker had {threshold} tools in flight within 300 s')
            time.sleep(0.05)
        victim = cluster.procs[busiest]
        result.held = cluster.held(busiest)
        result.killed = f'w{busiest}'
        killed_pids = {victim.pid, *_sigkill_tree(victim.pid)}
        kill_at, kill_wall = time.monotonic(), time.time()
        result.load = load()
        victim.wait(timeout=30)
        finished = wait_all(cluster, keys, args.kill_timeout, every=0.1 if engine != 'prefect' else 0.25)
        result.load += f'-{load()}'
        result.completed = len([k for k in keys if k in cluster.done])
        result.lost = [k for k in keys if k not in cluster.done]
        if finished and not result.lost:
            result.seconds = max(cluster.done.values()) - kill_at
        entries = read_ledger(cluster.ledger)
        on_victim = [e for e in entries if e.pid in killed_pids or e.ppid == victim.pid]
        result.in_flight = len({e.key for e in on_victim if e.event == 'start'}
                               - {e.key for e in on_victim if e.event == 'done'})  # at the kill: it wrote no more
        result.reran, result.repeats = check_ledger(entries, keys, lambda e: e in on_victim)
        if isinstance(cluster, PrefectCluster):
            result.notes = cluster.recovery(kill_wall)
        its = [cluster.done[e.key] for e in on_victim if e.key in cluster.done]
        if its and not result.lost:
            result.recovered = max(its) - kill_at
    except Exception as exc:  # noqa: BLE001 - reported in the table; the exit code says it
        result.error = f'{type(exc).__name__}: {exc}'[:300]
    finally:
        cluster.close()
    return result


def kill_report(results: list[KillResult], args: argparse.Namespace) -> None:
    print(f'SIGKILL of one of {args.kill_workers} workers, {args.kill_runs} runs at once, tool '
          f'{args.kill_tool_seconds:g} s, --concurrency {args.concurrency}, no operator action')
    print(f'{"engine":<9} {"killed":>6} {"held":>5} {"tools in flight":>15} {"completed":>9} {"tools re-run":>12} '
          f'{"kill->its runs done":>19} {"kill->last done":>15} {"target":>7} {"load":>11}  verdict')
    for r in results:
        target = KILL_TARGETS[r.engine]
        timing = f'{r.seconds:.1f} s' if not math.isnan(r.seconds) else '-'
        recovered = f'{r.recovered:.1f} s' if not math.isnan(r.recovered) else '-'
        verdict = ('OK' if r.ok else 'FAIL') + ('' if math.isnan(r.seconds) or r.seconds <= target else
                                                ', over the time target')
        held = str(r.held) if r.held >= 0 else '-'
        print(f'{r.engine:<9} {r.killed:>6} {held:>5} {r.in_flight:>15} {r.completed:>6}/{r.runs:<2} {r.reran:>12} '
              f'{recovered:>19} {timing:>15} {f"<= {target:g} s":>7} {r.load:>11}  {verdict}')
        if r.lost:
            print(f'  lost (not completed within {args.kill_timeout:g} s): {", ".join(r.lost)}')
        if r.repeats:
            print(f'  side effects repeated beyond the allowance: {"; ".join(r.repeats)}')
        if r.error:
            print(f'  error: {r.error}')
        for note in r.notes:
            print(note)
    print('held: runs the killed worker held by the engine\'s record (DBOS: PENDING under its executor id; Prefect: '
          'its flow-run processes; Temporal keeps runs on the server: -); its runs: those whose tool the killed worker '
          'had started', flush=True)


# --- main --------------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--engines', nargs='+', choices=ENGINES, default=list(ENGINES))
    p.add_argument('--runs', type=int, default=40)
    p.add_argument('--workers', type=int, nargs='+', default=[1, 2, 3])
    p.add_argument('--concurrency', type=int, default=4, help='runs (Temporal: activities) at once per worker')
    p.add_argument('--tool-seconds', type=float, default=1.0)
    p.add_argument('--postgres', default='postgresql://postgres@127.0.0.1:5432')
    p.add_argument('--address', default=None, help='a running Temporal server (default: start an in-memory one)')
    p.add_argument('--prefect-api-url', default=os.environ.get('DURCAP_TEST_PREFECT_API_URL')
                   or os.environ.get('PREFECT_API_URL'), help='a running Prefect server\'s API')
    p.add_argument('--prefect-server-pid', type=int, default=None,
                   help='pid of the Prefect server of --prefect-api-url (a server of the bench\'s own, nothing else '
                        'using it): its CPU seconds per run are reported as server/run')
    p.add_argument('--prefect-poll', type=float, default=1.0, help='PREFECT_RUNNER_POLL_FREQUENCY of serving processes')
    p.add_argument('--prefect-spawn', action='store_true',
                   help='serve with `durcap schedule prefect --spawn`: a new Python process per flow run, no fork server')
    p.add_argument('--warm', type=int, default=0, help='warm-up runs per worker, submitted and awaited before the '
                   'clock starts (default 0: the workers\' first runs are measured too)')
    p.add_argument('--timeout', type=float, default=3600.0, help='seconds a configuration may take before it fails')
    p.add_argument('--kill', action='store_true', help='the kill bench instead of the scale-out one')
    p.add_argument('--kill-workers', type=int, default=3)
    p.add_argument('--kill-runs', type=int, default=20)
    p.add_argument('--kill-tool-seconds', type=float, default=2.0)
    p.add_argument('--kill-timeout', type=float, default=300.0, help='seconds after the kill before a run is lost')
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if 'prefect' in args.engines and not args.prefect_api_url:
        parser().error('--engines prefect needs --prefect-api-url (or $DURCAP_TEST_PREFECT_API_URL / $PREFECT_API_URL)')
    sys.path[:0] = [str(ROOT), str(ROOT / 'src')]
    with tempfile.TemporaryDirectory(prefix='durcap-scaleout-') as scratch:
        server = None
        if 'temporal' in args.engines and args.address is None:
            from durable_capabilities.engines.temporal import start_temporal_dev_server

            server = start_temporal_dev_server(state_dir=Path(scratch) / 'temporal', persistent=False)
            args.address = server.address
            args.server_pid = server.pid
        try:
            if args.kill:
                results = [kill_bench(engine, args, Path(scratch)) for engine in args.engines]
                kill_report(results, args)
                return 0 if all(r.ok for r in results) else 1
            for engine in args.engines:
                where = {'dbos': 'on PostgreSQL', 'prefect': f'({args.prefect_api_url}, poll {args.prefect_poll:g} s)',
                         'temporal': f'({"in-memory dev server" if server else args.address})'}[engine]
                unit = {'dbos': 'runs', 'prefect': 'flow runs, --limit', 'temporal': 'activities'}[engine]
                report(engine, f'{engine} {where}, {args.runs} runs, tool {args.tool_seconds:g} s, --concurrency '
                       f'{args.concurrency} ({unit})', [measure(engine, n, args, Path(scratch)) for n in args.workers])
        finally:
            if server is not None:
                server.stop()
    return 0


if __name__ == '__main__':
    sys.exit(main())
