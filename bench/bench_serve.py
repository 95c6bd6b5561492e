"""Benchmark: turns per second through `durcap serve` against `runner.run` directly, on the same engine, side by side
(issue 26), and the time to the first event over Server-Sent Events.

    python bench/bench_serve.py                      # local engine, 9 rounds of 16 turns per side, 4 at once
    python bench/bench_serve.py --engine dbos        # DBOS on SQLite: both sides hand turns to one `durcap worker dbos`
    python bench/bench_serve.py --engine local,dbos,dbos-postgresql,temporal --rounds 5   # side by side, one run
    python bench/bench_serve.py --rounds 5 --turns 40 --concurrency 8 --json

Engines (`ENGINES`): `local`; `dbos` (SQLite); `dbos-postgresql` (DBOS's system database and the conversation store
on PostgreSQL: fresh databases on `--postgres`, dropped after); `temporal` (the server at `--temporal-address`,
default `$DURCAP_TEST_TEMPORAL_ADDRESS`, a `durcap worker temporal` on a task queue of the bench's own; both sides
start workflows there, `inline_worker=False`). Several, comma-separated, are measured one after another and printed
as one table.

Sides, interleaved round by round (their order alternating) so that they share the machine's load:

- `direct`: `runner.run(agent, prompt, engine=..., conversation_id=...)` in this process (DBOS: with `queue=`, handed
  to the worker as `durcap run --queue` does; Temporal: a workflow on the worker's task queue);
- `serve`: one `durcap serve` subprocess; each turn is `POST /v1/conversations/{id}/turns` (an Idempotency-Key) and
  `GET /v1/runs/{id}/events` read to the body's end, which the server sends with `run_completed` (httpx, this
  process, one client keeping its connections alive): what an application pays. The API's own clients read a stream
  to its end too (the `--chat` page, the docs' example); a client that stopped at `run_completed` would leave its
  connection unreusable (httpx drops it), opening a new one every turn (measured 2026-12-06, bench/README
  "h/localserve3").

Each turn is a new conversation of the scripted `streamer` agent (tests/engines/stream_agent.py: a tool call, then
the answer streamed in 31 deltas, `DURCAP_STREAM_DELAY=0`). Printed: turns per second per side (median over rounds),
their ratio (target: serve >= 0.9x direct), the median of the rounds' own ratios (each round's two sides ran back
to back, so it is the steadier figure on a shared machine), the load average before and after, over the serve
side's turns the time from sending the POST to the first SSE event (`run_started`) and to the first text delta
(median, p95), and the CPU time per turn (median of rounds; Linux): the direct side's in this process, the serve
side's in the `durcap serve` process (`/proc/PID/stat`, every thread) and in this process (the httpx client), and
on the durable engines the worker's during each side's rounds. Many
short rounds (default 9 of 16 turns) rather than a few long ones: a burst of load from other processes then moves one
round's pair, not a whole side. A `$PYTHONPATH` set for the bench goes after the checkout's own (e.g. a scratch
folder with a package to try in the serve process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / 'src'), str(ROOT)]
DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']
TARGET = 'tests.engines.stream_agent:agent'
TOKEN = 'bench-token'  # noqa: S105 - a throwaway token of the bench's own server
TARGET_RATIO = 0.9


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _start(args: list[str], log: Path, env: dict[str, str], ready: str, timeout: float = 120) -> subprocess.Popen[bytes]:
    with open(log, 'wb') as out:
        proc = subprocess.Popen([*DURCAP, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.monotonic() + timeout
    while ready not in log.read_text(errors='replace'):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f'{args[0]} did not start:\n{log.read_text(errors="replace")}')
        time.sleep(0.05)
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


async def _direct(turns: int, concurrency: int, engine: str, settings: dict[str, Any]) -> float:
    from durable_capabilities import runner
    from tests.engines.stream_agent import agent

    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            report = await runner.run(agent, 'where is ABC-123?', engine=engine, conversation_id=f'd-{uuid.uuid4().hex}',
                                      notify=lambda line: None, **settings)
            assert report.output.startswith('Order ABC-123')

    started = time.perf_counter()
    await asyncio.gather(*[one() for _ in range(turns)])
    return turns / (time.perf_counter() - started)


async def _serve(url: str, turns: int, concurrency: int, firsts: list[float], deltas: list[float]) -> float:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    auth = {'Authorization': f'Bearer {TOKEN}'}

    async def one(client: httpx.AsyncClient) -> None:
        async with gate:
            sent = time.perf_counter()
            posted = await client.post(f'/v1/conversations/s-{uuid.uuid4().hex}/turns', json={'prompt': 'where is ABC-123?'},
                                       headers={**auth, 'Idempotency-Key': uuid.uuid4().hex})
            assert posted.status_code == 202, posted.text
            first = delta = None
            completed = False
            # Read to the body's end, as the API's own clients do (the chat page's fetch reader, the docs' example,
            # the ai SDK's and @ag-ui/client's readers of the protocol endpoints): the server ends the body in the
            # write carrying `run_completed`, so this waits for nothing more, and the connection goes back to the pool
            # (a client that stops reading there leaves it unreusable: one new connection a turn).
            async with client.stream('GET', posted.json()['events_url'], headers=auth) as response:
                async for line in response.aiter_lines():
                    if line.startswith('id: ') and first is None:
                        first = time.perf_counter() - sent
                    if line == 'event: text_delta' and delta is None:
                        delta = time.perf_counter() - sent
                    completed = completed or line == 'event: run_completed'
            assert first is not None and delta is not None and completed
            firsts.append(first)
            deltas.append(delta)

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        started = time.perf_counter()
        await asyncio.gather(*[one(client) for _ in range(turns)])
        return turns / (time.perf_counter() - started)


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process `pid` so far; 0 where /proc is missing."""
    try:
        fields = Path(f'/proc/{pid}/stat').read_text().rsplit(')', 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


def _load() -> str:
    try:
        return ' '.join(Path('/proc/loadavg').read_text().split()[:3])
    except OSError:  # not Linux
        return 'n/a'


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]


ENGINES = ('local', 'dbos', 'dbos-postgresql', 'temporal')
"""What `--engine` takes (a comma-separated list: measured one after another in one run, printed side by side):
`dbos` on SQLite, `dbos-postgresql` with DBOS's system database and the conversation store on PostgreSQL (fresh
databases at `--postgres`, dropped after), `temporal` at the server `--temporal-address` with a worker on a task
queue of the bench's own."""


def _create_database(admin: str, name: str) -> str:
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin.rsplit('/', 1)[0] + '/' + name


def _drop_database(admin: str, name: str) -> None:
    import psycopg

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def measure(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """One engine's two sides, `args.rounds` interleaved rounds; the result dict printed by `main`."""
    folder = Path(tempfile.mkdtemp(prefix=f'durcap-bench-serve-{engine}-'))
    store = f'sqlite:///{folder / "conversations.db"}'
    databases: list[str] = []
    if engine == 'dbos-postgresql':
        tag = uuid.uuid4().hex[:8]
        databases = [f'bench_serve_store_{tag}', f'bench_serve_dbos_{tag}']
        store = _create_database(args.postgres, databases[0])
    path = os.pathsep.join([str(ROOT / 'src'), str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])])
    env = {**os.environ, 'PYTHONPATH': path, 'DURCAP_STORE': store, 'DURCAP_STREAM_DELAY': '0',
           'DURCAP_SERVE_TOKEN': TOKEN}
    os.environ.update({'DURCAP_STORE': store, 'DURCAP_STREAM_DELAY': '0'})
    procs: list[subprocess.Popen[bytes]] = []
    settings: dict[str, Any] = {'store': store}
    kind = 'dbos' if engine.startswith('dbos') else engine
    serve_args = ['--engine', kind]
    worker: int | None = None
    try:
        if kind == 'dbos':
            db = (_create_database(args.postgres, databases[1]) if engine == 'dbos-postgresql'
                  else f'sqlite:///{folder / "dbos.sqlite"}')
            env['DURCAP_DBOS_DB'] = db
            procs.append(_start(['worker', 'dbos', TARGET, '--db', db, '--concurrency', str(2 * args.concurrency)],
                                folder / 'worker.log', env, 'dbos worker ready'))
            settings |= {'db': db, 'queue': 'durcap'}
            serve_args += ['--db', db]
            worker = procs[-1].pid
        elif kind == 'temporal':
            queue = f'bench-serve-{uuid.uuid4().hex[:8]}'
            procs.append(_start(['worker', 'temporal', TARGET, '--address', args.temporal_address, '--task-queue', queue],
                                folder / 'worker.log', env, 'worker ready'))
            settings |= {'address': args.temporal_address, 'task_queue': queue, 'inline_worker': False}
            serve_args += ['--address', args.temporal_address, '--task-queue', queue]
            worker = procs[-1].pid
        port = _port()
        procs.append(_start(['serve', TARGET, '--port', str(port), *serve_args], folder / 'serve.log', env,
                            'durcap serve: http://'))
        url = f'http://127.0.0.1:{port}'
        time.sleep(0.5)  # uvicorn binds right after its line
        asyncio.run(_serve(url, 2, 2, [], []))  # warm both sides (imports, first connections)
        asyncio.run(_direct(2, 2, kind, settings))
        load_before = _load()
        rates: dict[str, list[float]] = {'direct': [], 'serve': []}
        # CPU ms per turn, per round: the bench process (direct: the client running runner.run; serve: httpx), the
        # serve process, the worker (durable engines) during each side's rounds
        cpu: dict[str, list[float]] = {'direct': [], 'serve': [], 'client': [], 'worker_direct': [], 'worker_serve': []}
        server = procs[-1].pid
        firsts: list[float] = []
        deltas: list[float] = []
        for index in range(args.rounds):
            order = ['direct', 'serve'] if index % 2 == 0 else ['serve', 'direct']
            for side in order:
                mine, theirs = time.process_time(), _cpu_of(server)
                works = _cpu_of(worker) if worker is not None else 0.0
                if side == 'direct':
                    rates[side].append(asyncio.run(_direct(args.turns, args.concurrency, kind, settings)))
                    cpu['direct'].append((time.process_time() - mine) * 1000 / args.turns)
                else:
                    rates[side].append(asyncio.run(_serve(url, args.turns, args.concurrency, firsts, deltas)))
                    cpu['client'].append((time.process_time() - mine) * 1000 / args.turns)
                    cpu['serve'].append((_cpu_of(server) - theirs) * 1000 / args.turns)
                if worker is not None:
                    cpu[f'worker_{side}'].append((_cpu_of(worker) - works) * 1000 / args.turns)
    finally:
        for proc in reversed(procs):
            _stop(proc)
        for name in databases:
            _drop_database(args.postgres, name)
    load_after = _load()
    direct, serve = statistics.median(rates['direct']), statistics.median(rates['serve'])
    paired = statistics.median(s / d for s, d in zip(rates['serve'], rates['direct'], strict=True))
    return {
        'engine': engine, 'rounds': args.rounds, 'turns_per_round': args.turns, 'concurrency': args.concurrency,
        'direct_turns_per_s': round(direct, 2), 'serve_turns_per_s': round(serve, 2),
        'ratio': round(serve / direct, 3), 'paired_ratio': round(paired, 3), 'target_ratio': TARGET_RATIO,
        'meets_target': serve / direct >= TARGET_RATIO, 'load_average': {'before': load_before, 'after': load_after},
        'first_event_s': {'median': round(statistics.median(firsts), 4), 'p95': round(_p95(firsts), 4)},
        'first_text_delta_s': {'median': round(statistics.median(deltas), 4), 'p95': round(_p95(deltas), 4)},
        'rates': {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
        'cpu_ms_per_turn': {k: round(statistics.median(vs), 2) for k, vs in cpu.items() if vs},
    }


def _print(result: dict[str, Any]) -> None:
    direct, serve = result['direct_turns_per_s'], result['serve_turns_per_s']
    print(f"engine {result['engine']}: {result['rounds']} rounds x {result['turns_per_round']} turns per side, "
          f"{result['concurrency']} at once")
    print(f'  direct runner.run : {direct:8.2f} turns/s  (rounds: {result["rates"]["direct"]})')
    print(f'  via durcap serve  : {serve:8.2f} turns/s  (rounds: {result["rates"]["serve"]})')
    print(f"  ratio serve/direct: {result['ratio']:.3f} (target >= {TARGET_RATIO}); median of the rounds' ratios "
          f"{result['paired_ratio']:.3f}")
    print(f"  load average      : {result['load_average']['before']} before, {result['load_average']['after']} after")
    first, delta = result['first_event_s'], result['first_text_delta_s']
    print(f"  first SSE event   : median {first['median'] * 1000:.1f} ms, p95 {first['p95'] * 1000:.1f} ms")
    print(f"  first text delta  : median {delta['median'] * 1000:.1f} ms, p95 {delta['p95'] * 1000:.1f} ms")
    spent = result['cpu_ms_per_turn']
    line = (f"  CPU per turn      : direct {spent['direct']:.2f} ms (this process); serve {spent['serve']:.2f} ms (the "
            f"serve process) + {spent['client']:.2f} ms (the client, this process)")
    if 'worker_direct' in spent:
        line += f"; worker {spent['worker_direct']:.2f} ms (direct) / {spent['worker_serve']:.2f} ms (serve)"
    print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or '').splitlines()[0])
    parser.add_argument('--engine', default='local', help=f'one of {", ".join(ENGINES)}, or several, comma-separated')
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--turns', type=int, default=16, help='turns per side per round')
    parser.add_argument('--concurrency', type=int, default=4, help='turns in flight at once per side')
    parser.add_argument('--temporal-address', default=os.environ.get('DURCAP_TEST_TEMPORAL_ADDRESS', '127.0.0.1:7233'))
    parser.add_argument('--postgres', default='postgresql://postgres@127.0.0.1:5432/postgres',
                        help='an admin URL of the PostgreSQL server `dbos-postgresql` creates its databases on')
    parser.add_argument('--json', action='store_true')
    args = parser.parse_args()
    engines = [e.strip() for e in args.engine.split(',') if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        parser.error(f'--engine: {", ".join(unknown) or "none"}: expected {", ".join(ENGINES)} (comma-separated)')
    results = [measure(engine, args) for engine in engines]
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results, indent=2))
        return
    for result in results:
        _print(result)
    if len(results) > 1:
        print('\n| engine | direct turns/s | serve turns/s | ratio (paired) | first SSE event / text delta, median ms | '
              'CPU ms a turn: direct + worker / serve + client + worker | load |')
        print('|---|---|---|---|---|---|---|')
        for r in results:
            c = r['cpu_ms_per_turn']
            print(f"| {r['engine']} | {r['direct_turns_per_s']} | {r['serve_turns_per_s']} | {r['ratio']} "
                  f"({r['paired_ratio']}) | {r['first_event_s']['median'] * 1000:.0f} / "
                  f"{r['first_text_delta_s']['median'] * 1000:.0f} | {c['direct']} + {c.get('worker_direct', 0)} / "
                  f"{c['serve']} + {c['client']} + {c.get('worker_serve', 0)} | {r['load_average']['before']} -> "
                  f"{r['load_average']['after']} |")


if __name__ == '__main__':
    main()
