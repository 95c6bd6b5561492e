"""Instructions per turn (callgrind) of `durcap serve` on the local engine, and of `runner.run` directly: the
load-proof figure behind `bench_serve.py`'s serve/direct ratio.

    .venv/bin/python bench/callgrind_serve.py                  # both sides, this checkout
    .venv/bin/python bench/callgrind_serve.py --side serve --root /work/main --keep /tmp/cg   # another checkout

Each side runs under `valgrind --tool=callgrind --instr-atstart=no`: `--warm` turns first (imports, first
connections, caches), then instrumentation is switched on (`callgrind_control -i on`), `--turns` turns run
`--concurrency` at once, and the counters are dumped (`callgrind_control -d`). Serve: one `durcap serve` process
under valgrind, each turn a POST with an Idempotency-Key and its SSE events read to the body's end (`run_completed`
last) by httpx in this process (not counted); direct: a process under valgrind running `runner.run` the same way. Printed: M instructions
a turn per side (every thread of the process), and direct / serve (what `bench_serve.py`'s ratio comes to when the
serve process's CPU bounds it). `--keep DIR` keeps the callgrind files for `callgrind_annotate`. The agent is
`tests/engines/stream_agent.py` (a scripted `FunctionModel`, no delay). Valgrind runs the process ~50x slower.
`CALLGRIND_EXTRA='--separate-threads=yes'` adds valgrind options (here: one file per thread, summed for the total).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
TOKEN = 'callgrind-token'  # noqa: S105 - a throwaway token of the bench's own server
TARGET = 'tests.engines.stream_agent:agent'
EXTRA = os.environ.get('CALLGRIND_EXTRA', '').split()

DIRECT = r'''
import asyncio, sys, uuid
from durable_capabilities import runner
from tests.engines.stream_agent import agent

async def batch(turns, concurrency):
    gate = asyncio.Semaphore(concurrency)
    async def one():
        async with gate:
            report = await runner.run(agent, 'where is ABC-123?', engine='local', conversation_id=f'd-{uuid.uuid4().hex}',
                                      notify=lambda line: None, store=sys.argv[1])
            assert report.output.startswith('Order ABC-123')
    await asyncio.gather(*[one() for _ in range(turns)])

async def main():
    await batch(int(sys.argv[2]), int(sys.argv[4]))
    print('warm', flush=True)
    sys.stdin.readline()
    await batch(int(sys.argv[3]), int(sys.argv[4]))
    print('done', flush=True)
    sys.stdin.readline()

asyncio.run(main())
'''


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        return sock.getsockname()[1]


def _total(path: Path) -> int:
    text = path.read_text()
    found = re.search(r'^(?:totals|summary): (\d+)', text, re.M)
    if found is None:
        raise SystemExit(f'no totals in {path}')
    return int(found.group(1))


def _dump(pid: int, out: Path) -> int:
    """Dump the counters (the run's one dump: `OUT.1`, or `OUT.1-NN` per thread with `--separate-threads=yes`) and
    return the instructions of every thread."""
    subprocess.run(['callgrind_control', '-d', str(pid)], check=True, capture_output=True)
    deadline = time.monotonic() + 60
    while not (dumps := list(out.parent.glob(out.name + '.1*'))):
        if time.monotonic() > deadline:
            raise SystemExit(f'callgrind wrote no dump next to {out}')
        time.sleep(0.2)
    return sum(_total(path) for path in dumps)


def _valgrind(out: Path) -> list[str]:
    return ['valgrind', '--tool=callgrind', '--instr-atstart=no', *EXTRA, f'--callgrind-out-file={out}']


async def _turns(url: str, turns: int, concurrency: int) -> None:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    auth = {'Authorization': f'Bearer {TOKEN}'}

    async def one(client: httpx.AsyncClient) -> None:
        async with gate:
            posted = await client.post(f'/v1/conversations/s-{uuid.uuid4().hex}/turns', json={'prompt': 'where is ABC-123?'},
                                       headers={**auth, 'Idempotency-Key': uuid.uuid4().hex})
            assert posted.status_code == 202, posted.text
            completed = False
            async with client.stream('GET', posted.json()['events_url'], headers=auth) as response:
                async for line in response.aiter_lines():  # to the body's end, as bench_serve.py's client
                    completed = completed or line == 'event: run_completed'
            assert completed, 'the stream ended without run_completed'

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*[one(client) for _ in range(turns)])


def serve_side(root: Path, folder: Path, args: argparse.Namespace) -> int:
    port, out, log = _port(), folder / 'serve.callgrind', folder / 'serve.log'
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(root / 'src'), str(root)]),
           'DURCAP_STORE': f'sqlite:///{folder / "serve.db"}', 'DURCAP_STREAM_DELAY': '0', 'DURCAP_SERVE_TOKEN': TOKEN}
    with open(log, 'wb') as sink:
        proc = subprocess.Popen([*_valgrind(out), sys.executable, '-m', 'durable_capabilities.cli', 'serve', TARGET,
                                 '--port', str(port)], cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while 'durcap serve: http://' not in log.read_text(errors='replace'):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f'serve did not start:\n{log.read_text(errors="replace")}')
            time.sleep(0.2)
        url = f'http://127.0.0.1:{port}'
        while True:  # uvicorn binds right after its line
            try:
                socket.create_connection(('127.0.0.1', port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        asyncio.run(_turns(url, args.warm, args.concurrency))
        subprocess.run(['callgrind_control', '-i', 'on', str(proc.pid)], check=True, capture_output=True)
        asyncio.run(_turns(url, args.turns, args.concurrency))
        return _dump(proc.pid, out)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def direct_side(root: Path, folder: Path, args: argparse.Namespace) -> int:
    out = folder / 'direct.callgrind'
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(root / 'src'), str(root)]), 'DURCAP_STREAM_DELAY': '0'}
    proc = subprocess.Popen([*_valgrind(out), sys.executable, '-c', DIRECT, f'sqlite:///{folder / "direct.db"}',
                             str(args.warm), str(args.turns), str(args.concurrency)], cwd=root, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        if proc.stdout.readline().strip() != 'warm':
            raise SystemExit('the direct side failed before its warm-up ended')
        subprocess.run(['callgrind_control', '-i', 'on', str(proc.pid)], check=True, capture_output=True)
        proc.stdin.write('\n')
        proc.stdin.flush()
        if proc.stdout.readline().strip() != 'done':
            raise SystemExit('the direct side failed')
        total = _dump(proc.pid, out)
        proc.stdin.write('\n')
        proc.stdin.flush()
        proc.wait(timeout=120)
        return total
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or '').splitlines()[0])
    parser.add_argument('--side', choices=['serve', 'direct', 'both'], default='both')
    parser.add_argument('--root', type=Path, default=HERE, help='the checkout measured (default: this one)')
    parser.add_argument('--warm', type=int, default=8)
    parser.add_argument('--turns', type=int, default=20)
    parser.add_argument('--concurrency', type=int, default=4)
    parser.add_argument('--keep', type=Path, help='a folder to keep the callgrind files and logs in')
    args = parser.parse_args()
    folder = args.keep or Path(tempfile.mkdtemp(prefix='durcap-callgrind-serve-'))
    folder.mkdir(parents=True, exist_ok=True)
    sides = ['direct', 'serve'] if args.side == 'both' else [args.side]
    per_turn: dict[str, float] = {}
    for side in sides:
        total = (serve_side if side == 'serve' else direct_side)(args.root.resolve(), folder, args)
        per_turn[side] = total / args.turns / 1e6
        print(f'{side}: {per_turn[side]:.2f} M instructions a turn ({args.turns} turns, {args.concurrency} at once; '
              f'{args.root})', flush=True)
    if len(per_turn) == 2:
        print(f'direct / serve: {per_turn["direct"] / per_turn["serve"]:.3f}')
    if args.keep:
        print(f'callgrind files in {folder}')


if __name__ == '__main__':
    main()
