"""Benchmark: turns per second through `durcap serve` against `runner.run` directly, on the same engine, side by side
(issue 26), and the time to the first event over Server-Sent Events.

    python bench/bench_serve.py                      # local engine, 9 rounds of 16 turns per side, 4 at once
    python bench/bench_serve.py --engine dbos        # DBOS on SQLite: both sides hand turns to one `durcap worker dbos`
    python bench/bench_serve.py --rounds 5 --turns 40 --concurrency 8 --json

Sides, interleaved round by round (their order alternating) so that they share the machine's load:

- `direct`: `runner.run(agent, prompt, engine=..., conversation_id=...)` in this process (DBOS: with `queue=`, handed
  to the worker as `durcap run --queue` does);
- `serve`: one `durcap serve` subprocess; each turn is `POST /v1/conversations/{id}/turns` (an Idempotency-Key) and
  `GET /v1/runs/{id}/events` read to its `run_completed` (httpx, this process): what an application pays.

Each turn is a new conversation of the scripted `streamer` agent (tests/engines/stream_agent.py: a tool call, then
the answer streamed in 31 deltas, `DURCAP_STREAM_DELAY=0`). Printed: turns per second per side (median over rounds),
their ratio (target: serve >= 0.9x direct), the median of the rounds' own ratios (each round's two sides ran back
to back, so it is the steadier figure on a shared machine), the load average before and after, over the serve
side's turns the time from sending the POST to the first SSE event (`run_started`) and to the first text delta
(median, p95), and the CPU time per turn (median of rounds; Linux): the direct side's in this process, the serve
side's in the `durcap serve` process (`/proc/PID/stat`, every thread) and in this process (the httpx client). Many
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
            async with client.stream('GET', posted.json()['events_url'], headers=auth) as response:
                async for line in response.aiter_lines():
                    if line.startswith('id: ') and first is None:
                        first = time.perf_counter() - sent
                    if line == 'event: text_delta' and delta is None:
                        delta = time.perf_counter() - sent
                    if line == 'event: run_completed':
                        break
            assert first is not None and delta is not None
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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or '').splitlines()[0])
    parser.add_argument('--engine', choices=('local', 'dbos'), default='local')
    parser.add_argument('--rounds', type=int, default=9)
    parser.add_argument('--turns', type=int, default=16, help='turns per side per round')
    parser.add_argument('--concurrency', type=int, default=4, help='turns in flight at once per side')
    parser.add_argument('--json', action='store_true')
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix='durcap-bench-serve-'))
    store = f'sqlite:///{folder / "conversations.db"}'
    path = os.pathsep.join([str(ROOT / 'src'), str(ROOT), *filter(None, [os.environ.get('PYTHONPATH')])])
    env = {**os.environ, 'PYTHONPATH': path, 'DURCAP_STORE': store, 'DURCAP_STREAM_DELAY': '0',
           'DURCAP_SERVE_TOKEN': TOKEN}
    os.environ.update({'DURCAP_STORE': store, 'DURCAP_STREAM_DELAY': '0'})
    procs: list[subprocess.Popen[bytes]] = []
    settings: dict[str, Any] = {'store': store}
    serve_args = ['--engine', args.engine]
    try:
        if args.engine == 'dbos':
            db = f'sqlite:///{folder / "dbos.sqlite"}'
            env['DURCAP_DBOS_DB'] = db
            procs.append(_start(['worker', 'dbos', TARGET, '--db', db, '--concurrency', str(2 * args.concurrency)],
                                folder / 'worker.log', env, 'dbos worker ready'))
            settings |= {'db': db, 'queue': 'durcap'}
            serve_args += ['--db', db]
        port = _port()
        procs.append(_start(['serve', TARGET, '--port', str(port), *serve_args], folder / 'serve.log', env,
                            'durcap serve: http://'))
        url = f'http://127.0.0.1:{port}'
        time.sleep(0.5)  # uvicorn binds right after its line
        asyncio.run(_serve(url, 2, 2, [], []))  # warm both sides (imports, first connections)
        asyncio.run(_direct(2, 2, args.engine, settings))
        load_before = _load()
        rates: dict[str, list[float]] = {'direct': [], 'serve': []}
        cpu: dict[str, list[float]] = {'direct': [], 'serve': [], 'client': []}  # ms per turn, per round
        server = procs[-1].pid
        firsts: list[float] = []
        deltas: list[float] = []
        for index in range(args.rounds):
            order = ['direct', 'serve'] if index % 2 == 0 else ['serve', 'direct']
            for side in order:
                mine, theirs = time.process_time(), _cpu_of(server)
                if side == 'direct':
                    rates[side].append(asyncio.run(_direct(args.turns, args.concurrency, args.engine, settings)))
                    cpu['direct'].append((time.process_time() - mine) * 1000 / args.turns)
                else:
                    rates[side].append(asyncio.run(_serve(url, args.turns, args.concurrency, firsts, deltas)))
                    cpu['client'].append((time.process_time() - mine) * 1000 / args.turns)
                    cpu['serve'].append((_cpu_of(server) - theirs) * 1000 / args.turns)
    finally:
        for proc in reversed(procs):
            _stop(proc)
    load_after = _load()
    direct, serve = statistics.median(rates['direct']), statistics.median(rates['serve'])
    paired = statistics.median(s / d for s, d in zip(rates['serve'], rates['direct'], strict=True))
    result = {
        'engine': args.engine, 'rounds': args.rounds, 'turns_per_round': args.turns, 'concurrency': args.concurrency,
        'direct_turns_per_s': round(direct, 2), 'serve_turns_per_s': round(serve, 2),
        'ratio': round(serve / direct, 3), 'paired_ratio': round(paired, 3), 'target_ratio': TARGET_RATIO,
        'meets_target': serve / direct >= TARGET_RATIO, 'load_average': {'before': load_before, 'after': load_after},
        'first_event_s': {'median': round(statistics.median(firsts), 4), 'p95': round(_p95(firsts), 4)},
        'first_text_delta_s': {'median': round(statistics.median(deltas), 4), 'p95': round(_p95(deltas), 4)},
        'rates': {k: [round(v, 2) for v in vs] for k, vs in rates.items()},
        'cpu_ms_per_turn': {k: round(statistics.median(vs), 2) for k, vs in cpu.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"engine {args.engine}: {args.rounds} rounds x {args.turns} turns per side, {args.concurrency} at once")
    print(f'  direct runner.run : {direct:8.2f} turns/s  (rounds: {rates["direct"]})')
    print(f'  via durcap serve  : {serve:8.2f} turns/s  (rounds: {rates["serve"]})')
    print(f'  ratio serve/direct: {serve / direct:.3f} (target >= {TARGET_RATIO}); median of the rounds\' ratios '
          f'{paired:.3f}')
    print(f'  load average      : {load_before} before, {load_after} after')
    print(f'  first SSE event   : median {statistics.median(firsts) * 1000:.1f} ms, p95 {_p95(firsts) * 1000:.1f} ms')
    print(f'  first text delta  : median {statistics.median(deltas) * 1000:.1f} ms, p95 {_p95(deltas) * 1000:.1f} ms')
    spent = result['cpu_ms_per_turn']
    print(f"  CPU per turn      : direct {spent['direct']:.2f} ms (this process); serve {spent['serve']:.2f} ms (the serve "
          f"process) + {spent['client']:.2f} ms (the client, this process)")


if __name__ == '__main__':
    main()
