"""Bytes stored per byte of conversation: the conversation store and the engine's own database together (issue 24),
on Temporal (a real dev server on a file database) and, with `--engine dbos-sqlite dbos-postgres prefect` (from
`bench/_storage_engines.py`), on DBOS and Prefect.

    .venv/bin/python bench/bench_storage.py                                       # 12, 24, 50 turns; 0.2's layout and today's
    .venv/bin/python bench/bench_storage.py --layout pieces --turns 50 100 200    # the figures in bench/README.md
    .venv/bin/python bench/bench_storage.py --layout pieces --turns 24 --breakdown   # where the bytes are
    .venv/bin/python bench/bench_storage.py --layout pieces --json

One conversation, one `runner.run(..., engine='temporal', conversation_id=...)` per turn (an inline worker in this
process, the client's and worker's claim-check codec on a SQLite store): the prompt, a tool call returning ~50 KB of
text that differs every turn (`storage_agent.py`), the answer; 2 model requests a turn. At each checkpoint:

- `messages`: the JSON bytes of the conversation's messages (`ModelMessagesTypeAdapter.dump_json` of what the store
  holds), the denominator;
- `store`: the store's SQLite files (database + WAL, after a `wal_checkpoint(TRUNCATE)`): the conversation rows, the
  run event log, and the claim checks (`durcap_payloads`);
- `claim checks`: `SUM(size)` of `durcap_payloads` (the bytes of the pieces and pages as stored);
- `temporal db`: the growth of the dev server's SQLite files (`--db-filename`, database + journal, less their size when
  the server came up): the histories, with payloads under the claim-check threshold inline and references for the rest;
- `sum`: (store + temporal db) / messages, the target's ratio: <= 3x at every size, not growing with the turns.

`--breakdown` adds, per checkpoint, the bytes of each table and index of both databases (SQLite's `dbstat`, and the
free pages) and the payload bytes in the histories by what carried them (event type, activity). `--dir` keeps the
files. Layouts: `whole` is 0.2's codec (every payload over 0.2's 256 KiB threshold stored whole under its sha256; run
here by making the cutter return one piece), `pieces` today's. Each layout gets its own server and store. `--engine`
names the engine whose database is measured (Temporal here; DBOS and Prefect measure in their own module).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic_ai.messages import ModelMessagesTypeAdapter

from bench.storage_agent import agent
from durable_capabilities import runner
from durable_capabilities.engines.temporal import _payloads, start_temporal_dev_server
from durable_capabilities.store import SQLConversationStore

TARGET = 3.0


def files_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + '*') if p.is_file())


def checkpoint(db: Path) -> None:
    """Move the store's write-ahead log into the database and truncate it, so the file holds the data, not a log."""
    import sqlite3

    with sqlite3.connect(db) as conn:
        conn.execute('PRAGMA wal_checkpoint(TRUNCATE)')


def payload_bytes(db: Path) -> int:
    import sqlite3

    with sqlite3.connect(db) as conn:
        return int(conn.execute('SELECT COALESCE(SUM(size), 0) FROM durcap_payloads').fetchone()[0])


def table_bytes(db: Path) -> dict[str, int]:
    """`{table or index: bytes of its pages}` of a SQLite file (`dbstat`), with `(free pages)` for the free list."""
    import sqlite3

    with sqlite3.connect(db) as conn:
        found = {name: int(size) for name, size in conn.execute('SELECT name, SUM(pgsize) FROM dbstat GROUP BY name')}
        free = conn.execute('PRAGMA freelist_count').fetchone()[0] * conn.execute('PRAGMA page_size').fetchone()[0]
    found['(free pages)'] = int(free)
    return found


async def history_bytes(address: str, task_queue: str) -> dict[str, int]:
    """`{what carried it: payload bytes}` over the histories of the bench's workflows, as Temporal stores them
    (references, not what they name): by event type, and for activities by the activity's name."""
    from temporalio.client import Client

    client = await Client.connect(address)
    totals: dict[str, int] = {}
    names: dict[int, str] = {}
    async for described in client.list_workflows(f'TaskQueue = "{task_queue}"'):
        history = await client.get_workflow_handle(described.id, run_id=described.run_id).fetch_history()
        for event in history.events:
            kind = event.WhichOneof('attributes') or '?'
            attributes = getattr(event, kind)
            name = kind.removesuffix('_event_attributes')
            if kind == 'activity_task_scheduled_event_attributes':
                names[event.event_id] = attributes.activity_type.name.rsplit('__', 1)[-1]
                name = f'activity input: {names[event.event_id]}'
            elif kind == 'activity_task_completed_event_attributes':
                name = f'activity result: {names.get(attributes.scheduled_event_id, "?")}'
            size = attributes.ByteSize()
            totals[name] = totals.get(name, 0) + size
            totals['(events)'] = totals.get('(events)', 0) + event.ByteSize()
    return totals


def print_breakdown(title: str, sizes: dict[str, int], base: int, top: int = 12) -> None:
    print(f'    {title}: ' + ', '.join(f'{name} {size / base:.2f}x' for name, size in
                                      sorted(sizes.items(), key=lambda kv: -kv[1])[:top] if size), flush=True)


async def conversation_bytes(url: str, cid: str) -> tuple[int, int]:
    stored = await SQLConversationStore(url).read(cid)
    assert stored is not None
    return len(stored.messages), len(ModelMessagesTypeAdapter.dump_json(stored.messages))


def measure(layout: str, checkpoints: list[int], folder: Path, breakdown: bool = False) -> list[dict[str, Any]]:
    """Run max(checkpoints) turns of one conversation in `layout` on a fresh server and store; a row per checkpoint."""
    original = _payloads.pieces
    threshold = os.environ.get(_payloads.THRESHOLD_ENV)
    if layout == 'whole':
        _payloads.pieces = lambda data, depth=0: [(0, data)]  # 0.2: the body in one piece, stored whole
        os.environ[_payloads.THRESHOLD_ENV] = str(256 * 1024)  # 0.2's threshold
    folder.mkdir(parents=True)
    db = folder / 'conversations.db'
    url = f'sqlite:///{db}'
    os.environ['DURCAP_STORE'] = url
    server = start_temporal_dev_server(state_dir=folder / 'temporal', persistent=True)
    temporal_base = files_size(folder / 'temporal' / 'temporal.db')  # an empty server's database
    rows: list[dict[str, Any]] = []
    cid = f'bench-{layout}'
    started = time.monotonic()
    try:
        settings = {'address': server.address, 'task_queue': f'storage-{uuid.uuid4().hex[:8]}', 'inline_worker': True}
        for n in range(1, max(checkpoints) + 1):
            report = asyncio.run(runner.run(agent, f'turn {n}: fetch the report', engine='temporal', conversation_id=cid, **settings))
            assert 'read a report' in str(report.output), report.output
            if n in checkpoints:
                count, size = asyncio.run(conversation_bytes(url, cid))
                checkpoint(db)
                store, pieces = files_size(db), payload_bytes(db)
                temporal = files_size(folder / 'temporal' / 'temporal.db') - temporal_base
                total = (store + temporal) / size
                row = {'engine': 'temporal', 'layout': layout, 'turns': n, 'messages': count, 'message_bytes': size,
                       'store_bytes': store, 'pieces_bytes': pieces, 'engine_bytes': temporal, 'store_ratio': store / size,
                       'pieces_ratio': pieces / size, 'engine_ratio': temporal / size, 'total_ratio': total,
                       'met': total <= TARGET, 'seconds': time.monotonic() - started}
                rows.append(row)
                print(f'  {layout:6} {n:4} turns {count:5} msgs {size / 1e6:6.2f} MB | store {store / 1e6:6.2f} MB '
                      f'({row["store_ratio"]:.2f}x; claim checks {row["pieces_ratio"]:.2f}x) | temporal db {temporal / 1e6:6.2f} MB '
                      f'({row["engine_ratio"]:.2f}x) | sum {total:5.2f}x {"met" if row["met"] else "MISSED"} (<= {TARGET}x) '
                      f'| {row["seconds"]:.0f} s', flush=True)
                if breakdown:
                    print_breakdown('store tables', table_bytes(db), size)
                    print_breakdown('temporal tables', table_bytes(folder / 'temporal' / 'temporal.db'), size)
                    print_breakdown('history payloads', asyncio.run(history_bytes(server.address, settings['task_queue'])), size)
    finally:
        server.stop()
        _payloads.pieces = original
        if threshold is None:
            os.environ.pop(_payloads.THRESHOLD_ENV, None)
        else:
            os.environ[_payloads.THRESHOLD_ENV] = threshold
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or '').splitlines()[0])
    parser.add_argument('--engine', nargs='+', default=['temporal'],
                        choices=['temporal', 'dbos-sqlite', 'dbos-postgres', 'prefect', 'all'],
                        help='the engines whose database is measured with the store (temporal: a dev server on a file, '
                             'both layouts; the others: bench/_storage_engines.py, a fresh engine database each)')
    parser.add_argument('--turns', type=int, nargs='+', default=[12, 24, 50])
    parser.add_argument('--layout', choices=['whole', 'pieces', 'both'], default='both')
    parser.add_argument('--json', action='store_true')
    parser.add_argument('--dir', type=Path, help='keep the servers\' and stores\' files in this folder (default: a temporary one)')
    parser.add_argument('--breakdown', action='store_true',
                        help='at each checkpoint, bytes per table of both databases and per payload kind in the histories')
    args = parser.parse_args()
    load = os.getloadavg()
    print(f'load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs', flush=True)
    engines = ['temporal', 'dbos-sqlite', 'dbos-postgres', 'prefect'] if 'all' in args.engine else args.engine
    layouts = (['whole', 'pieces'] if args.layout == 'both' else [args.layout]) if 'temporal' in engines else []
    rows: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix='bench-storage-') as tmp:
        for layout in layouts:
            rows += measure(layout, sorted(args.turns), (args.dir or Path(tmp)) / layout, args.breakdown)
        if any(engine != 'temporal' for engine in engines):
            from bench._storage_engines import MEASURES

            for engine in (e for e in engines if e != 'temporal'):
                others += MEASURES[engine](sorted(args.turns), (args.dir or Path(tmp)) / engine)
    load = os.getloadavg()
    print(f'load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}')
    if others:
        print('\nengine        | turns | (store + engine db) / message bytes')
        for row in others:
            verdict = 'met' if row['ratio'] <= TARGET else 'MISSED'
            print(f'{row["engine"]:13} | {row["turns"]:5} | {row["ratio"]:6.2f}x ({verdict}, target <= {TARGET}x)')
        rows += others
    if args.layout == 'both' and layouts:
        print('\nturns | store + temporal db, whole (0.2) | pieces | pieces/whole')
        for turns in sorted(args.turns):
            whole = next(r for r in rows if r['layout'] == 'whole' and r['turns'] == turns)
            pieces = next(r for r in rows if r['layout'] == 'pieces' and r['turns'] == turns)
            verdict = 'met' if pieces['met'] else 'MISSED'
            print(f'{turns:5} | {whole["total_ratio"]:9.2f}x | {pieces["total_ratio"]:6.2f}x ({verdict}, target <= {TARGET}x) | '
                  f'{(pieces["store_bytes"] + pieces["engine_bytes"]) / (whole["store_bytes"] + whole["engine_bytes"]):.3f}')
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == '__main__':
    main()
