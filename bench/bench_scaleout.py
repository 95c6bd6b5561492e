"""Benchmark: runs spread over 1, 2 and 3 workers, on DBOS (one PostgreSQL system database) and on Temporal.

    .venv/bin/python bench/bench_scaleout.py                              # both engines, 40 runs, workers 1 2 3
    .venv/bin/python bench/bench_scaleout.py --engines dbos --runs 40 --workers 1 2 3 --concurrency 4 \
        --tool-seconds 1 --postgres postgresql://postgres@127.0.0.1:5432
    .venv/bin/python bench/bench_scaleout.py --engines temporal --address 127.0.0.1:7233   # a running server

For each worker count, in one run of this script: a new PostgreSQL database (dropped at the end), that many
`durcap worker dbos bench/scaleout_agent.py:agent` processes (own executor ids, `--concurrency`, one queue; started
here, stopped by pid), then `--runs` runs of the agent (model: a scripted `FunctionModel`; its one tool waits
`--tool-seconds` on I/O) enqueued at once with `DBOSClient.enqueue` (what `durcap run --engine dbos --queue` does).
Throughput = runs / seconds from the first enqueue to the last run's SUCCESS; which executor ran each run is DBOS's
own record (`workflow_status.executor_id`).

Temporal: that many `durcap worker temporal` processes on one task queue (`--concurrency`: activities at once per
worker), on an in-memory dev server started here (or `--address`); the runs are started at once with
`engines.temporal.start_run` and awaited; which worker ran each tool is the pid the tool appends to a ledger file.

Targets (issue 29): 2 workers >= 1.8x one worker, 3 >= 2.5x, every worker doing >= 20% of the runs.
Prefect is not measured here yet.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 'bench/scaleout_agent.py:agent'


def _database(base: str, name: str) -> str:
    import psycopg
    from psycopg import sql

    with psycopg.connect(f'{base}/postgres', autocommit=True) as conn:
        conn.execute(sql.SQL('CREATE DATABASE {}').format(sql.Identifier(name)))
    return f'{base}/{name}'


def _drop(base: str, name: str) -> None:
    import psycopg
    from psycopg import sql

    with psycopg.connect(f'{base}/postgres', autocommit=True) as conn:
        conn.execute(sql.SQL('DROP DATABASE IF EXISTS {} WITH (FORCE)').format(sql.Identifier(name)))


def _wait_line(log: Path, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and needle in log.read_text(errors='replace'):
            return
        if proc.poll() is not None:
            raise RuntimeError(f'worker exited: {log.read_text(errors="replace")[-2000:]}')
        time.sleep(0.1)
    raise TimeoutError(f'no {needle!r} in {log} within {timeout} s')


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each worker's process group (they drain), SIGKILL what is still alive after 40 s."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(workers: int, args: argparse.Namespace, scratch: Path) -> dict[str, object]:
    """One configuration: start the workers, enqueue the runs, wait; returns runs/s and runs per executor."""
    from dbos import DBOSClient

    name = f'durcap_scaleout_{uuid.uuid4().hex[:8]}'
    url = _database(args.postgres, name)
    env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{ROOT / "src"}', BENCH_SCALEOUT_TOOL_SECONDS=str(args.tool_seconds))
    procs: list[subprocess.Popen[bytes]] = []
    client = None
    try:
        for i in range(workers):
            log = scratch / f'{name}-w{i}.log'
            with open(log, 'wb') as out:
                procs.append(subprocess.Popen(
                    [sys.executable, '-m', 'durable_capabilities.cli', 'worker', 'dbos', TARGET, '--db', url,
                     '--task-queue', 'bench', '--executor-id', f'w{i}', '--concurrency', str(args.concurrency)],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        for i, proc in enumerate(procs):
            _wait_line(scratch / f'{name}-w{i}.log', 'dbos worker ready', proc, 180)
        client = DBOSClient(system_database_url=url)
        start = time.monotonic()
        ids = [client.enqueue({'queue_name': 'bench', 'workflow_name': 'durcap.scaleout', 'workflow_id': f'r{n}'},
                              'go', None, None, None).workflow_id for n in range(args.runs)]
        deadline = start + 600
        while True:
            done = client.list_workflows(workflow_ids=ids, load_input=False, load_output=False)
            if all(w.status == 'SUCCESS' for w in done) and len(done) == len(ids):
                break
            if time.monotonic() > deadline:
                raise TimeoutError('runs not done within 600 s')
            time.sleep(0.05)
        seconds = time.monotonic() - start
        per: dict[str, int] = {}
        for w in done:
            per[str(w.executor_id)] = per.get(str(w.executor_id), 0) + 1
        return {'workers': workers, 'seconds': seconds, 'runs_per_s': args.runs / seconds, 'per_executor': per}
    finally:
        if client is not None:
            client.destroy()
        _stop(procs)
        _drop(args.postgres, name)


def measure_temporal(workers: int, args: argparse.Namespace, scratch: Path, address: str) -> dict[str, object]:
    """One Temporal configuration: `workers` worker processes on a new task queue, `--runs` runs started at once."""
    import asyncio

    sys.path[:0] = [str(ROOT), str(ROOT / 'src')]
    from bench.scaleout_agent import agent
    from durable_capabilities.engines.temporal import connect, start_run

    queue = f'scaleout-{uuid.uuid4().hex[:8]}'
    ledger = scratch / f'{queue}.ledger'
    env = dict(os.environ, PYTHONPATH=f'{ROOT}{os.pathsep}{ROOT / "src"}', BENCH_SCALEOUT_TOOL_SECONDS=str(args.tool_seconds),
               BENCH_SCALEOUT_LEDGER=str(ledger))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i in range(workers):
            log = scratch / f'{queue}-w{i}.log'
            with open(log, 'wb') as out:
                procs.append(subprocess.Popen(
                    [sys.executable, '-m', 'durable_capabilities.cli', 'worker', 'temporal', TARGET, '--address', address,
                     '--task-queue', queue, '--concurrency', str(args.concurrency), '--no-versioning'],
                    cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        for i, proc in enumerate(procs):
            _wait_line(scratch / f'{queue}-w{i}.log', 'worker ready', proc, 180)

        async def batch() -> float:
            client = await connect(address)
            start = time.monotonic()
            handles = await asyncio.gather(*(start_run(client, agent, 'go', task_queue=queue,
                                                       workflow_id=f'{queue}-{n}') for n in range(args.runs)))
            await asyncio.gather(*(h.result() for h in handles))
            return time.monotonic() - start

        seconds = asyncio.run(batch())
        pids = {str(p.pid): f'w{i}' for i, p in enumerate(procs)}
        per: dict[str, int] = {}
        for line in ledger.read_text().split():
            per[pids.get(line, line)] = per.get(pids.get(line, line), 0) + 1
        return {'workers': workers, 'seconds': seconds, 'runs_per_s': args.runs / seconds, 'per_executor': per}
    finally:
        _stop(procs)


def report(title: str, results: list[dict[str, object]]) -> None:
    base = results[0]['runs_per_s']
    print(title)
    print(f'{"workers":>7} {"seconds":>8} {"runs/s":>7} {"x one":>6}  runs per worker (share)')
    for r in results:
        total = sum(r['per_executor'].values())  # type: ignore[union-attr]
        shares = ', '.join(f'{k}: {v} ({v / total:.0%})' for k, v in sorted(r['per_executor'].items()))  # type: ignore[union-attr]
        print(f'{r["workers"]:>7} {r["seconds"]:>8.2f} {r["runs_per_s"]:>7.2f} {r["runs_per_s"] / base:>6.2f}  {shares}')  # type: ignore[operator]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--runs', type=int, default=40)
    parser.add_argument('--workers', type=int, nargs='+', default=[1, 2, 3])
    parser.add_argument('--concurrency', type=int, default=4)
    parser.add_argument('--tool-seconds', type=float, default=1.0)
    parser.add_argument('--postgres', default='postgresql://postgres@127.0.0.1:5432')
    parser.add_argument('--engines', nargs='+', choices=['dbos', 'temporal'], default=['dbos', 'temporal'])
    parser.add_argument('--address', default=None, help='a running Temporal server (default: start an in-memory one)')
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix='durcap-scaleout-') as scratch:
        if 'dbos' in args.engines:
            report(f'DBOS on PostgreSQL, {args.runs} runs, tool {args.tool_seconds:g} s, --concurrency {args.concurrency}',
                   [measure(n, args, Path(scratch)) for n in args.workers])
        if 'temporal' in args.engines:
            server = None
            address = args.address
            if address is None:
                sys.path[:0] = [str(ROOT / 'src')]
                from durable_capabilities.engines.temporal import start_temporal_dev_server

                server = start_temporal_dev_server(state_dir=Path(scratch) / 'temporal', persistent=False)
                address = server.address
            try:
                report(f'Temporal ({"in-memory dev server" if server else address}), {args.runs} runs, tool '
                       f'{args.tool_seconds:g} s, --concurrency {args.concurrency} (activities)',
                       [measure_temporal(n, args, Path(scratch), address) for n in args.workers])
            finally:
                if server is not None:
                    server.stop()

if __name__ == '__main__':
    main()
