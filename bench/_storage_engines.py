"""Bytes stored per byte of conversation on DBOS (SQLite and PostgreSQL system databases) and Prefect (issue 24): the
engines' half of `bench_storage.py` (which measures Temporal), hooked in by its `--engine` option.

    .venv/bin/python bench/_storage_engines.py --engine dbos-sqlite dbos-postgres prefect --turns 50 100 200

One conversation, one `runner.run(..., engine=..., conversation_id=...)` per turn, with `bench_storage.py`'s agent
(`storage_agent.py`: the prompt, a tool call returning ~50 KB of text that differs every turn, the answer; 2 model
requests a turn). Each measurement gets a fresh store (SQLite) and a fresh engine database. At each checkpoint:

- `message_bytes`: the JSON bytes of the conversation's messages (`ModelMessagesTypeAdapter.dump_json` of what the
  store holds), the denominator;
- `store_bytes`: the store's SQLite files (database + WAL after a `wal_checkpoint(TRUNCATE)`): the conversation rows,
  and the run event log (`durcap_run_events`: runs publish their events by default);
- `engine_bytes`: DBOS: the system database's growth (SQLite: its files after a checkpoint; PostgreSQL: a fresh
  database with a unique name, the sum of its relations' sizes with indexes and TOAST, dropped at the end), less the
  size it had once DBOS created its tables. Prefect: the growth of the database of a Prefect server started for the
  measurement (`start_prefect_server`, its own `PREFECT_HOME`), plus the bytes of the result storage folder;
- `ratio`: (store + engine) / message bytes. Target (issue 24): <= 3x at every size, not growing with the turns.

`breakdown` (printed at the last checkpoint) says where the bytes are: per table of each SQLite database (`dbstat`),
per relation on PostgreSQL, and the result storage folder's files by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sqlite3
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 3.0
POSTGRES_ADMIN_URL = os.environ.get('BENCH_POSTGRES_URL', 'postgresql://postgres@127.0.0.1:5432/postgres')
"""Where `measure_dbos(backend='postgres')` creates (and drops) its database (`$BENCH_POSTGRES_URL`)."""


def sqlite_files(path: Path) -> int:
    """Bytes of a SQLite database's files (`path`, `-wal`, `-shm`...)."""
    return sum(p.stat().st_size for p in path.parent.glob(path.name + '*') if p.is_file())


def sqlite_checkpoint(path: Path) -> None:
    """Move the write-ahead log into the database and truncate it, so the file holds the data, not a log."""
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        conn.execute('PRAGMA wal_checkpoint(TRUNCATE)')


def sqlite_tables(path: Path) -> dict[str, int]:
    """Bytes of each table of a SQLite database, its indexes counted with it (`dbstat` pages)."""
    with contextlib.closing(sqlite3.connect(path, timeout=30)) as conn:
        owner = dict(conn.execute("SELECT name, tbl_name FROM sqlite_schema WHERE type IN ('table', 'index')").fetchall())
        sizes: dict[str, int] = {}
        for name, size in conn.execute('SELECT name, SUM(pgsize) FROM dbstat GROUP BY name').fetchall():
            table = owner.get(name, name)
            sizes[table] = sizes.get(table, 0) + int(size)
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))


def result_kinds(folder: Path) -> dict[str, int]:
    """Bytes of Prefect's persisted results under `folder` by what they hold (the result's class; `flow result` for
    a flow's return value): a task's file is a JSON record with the pickled result in base64, a flow's the base64
    alone."""
    import base64
    import pickle

    sizes: dict[str, int] = {}
    for path in (p for p in folder.rglob('*') if p.is_file()) if folder.exists() else ():
        data = path.read_bytes()
        try:
            # A task's result: a JSON record with the pickle in base64; a flow's: the base64 pickle alone.
            encoded = json.loads(data)['result'] if data.startswith(b'{') else data
            value = pickle.loads(base64.b64decode(encoded))  # noqa: S301 - our own files
            kind = 'flow result' if isinstance(value, dict) and 'output' in value else type(value).__name__
        except Exception:  # noqa: BLE001 - a record of another form: counted as such
            kind = 'other'
        sizes[kind] = sizes.get(kind, 0) + path.stat().st_size
    return dict(sorted(sizes.items(), key=lambda item: -item[1]))


def folder_files(folder: Path) -> tuple[int, int]:
    """`(bytes, files)` of every file under `folder`."""
    files = [p for p in folder.rglob('*') if p.is_file()] if folder.exists() else []
    return sum(p.stat().st_size for p in files), len(files)


async def conversation_bytes(url: str, cid: str) -> tuple[int, int]:
    """`(messages, JSON bytes of the messages)` of the stored conversation."""
    from pydantic_ai.messages import ModelMessagesTypeAdapter

    from durable_capabilities.store import SQLConversationStore

    with SQLConversationStore(url) as store:
        stored = await store.read(cid)
    return len(stored.messages), len(ModelMessagesTypeAdapter.dump_json(stored.messages))


def _top(sizes: dict[str, int], limit: int = 6) -> str:
    return ', '.join(f'{name} {size / 1e6:.2f} MB' for name, size in list(sizes.items())[:limit] if size >= 10_000)


def _conversation(engine: str, checkpoints: list[int], folder: Path, settings: dict[str, Any],
                  engine_size: Callable[[], int], breakdown: Callable[[], dict[str, Any]]) -> list[dict[str, Any]]:
    """Run max(checkpoints) turns of one conversation on `engine` with `settings`; one row per checkpoint."""
    from bench.storage_agent import agent
    from durable_capabilities import runner

    db = folder / 'conversations.db'
    url = f'sqlite:///{db}'
    os.environ['DURCAP_STORE'] = url
    cid = f'bench-{engine}-{uuid.uuid4().hex[:6]}'
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for n in range(1, max(checkpoints) + 1):
        report = asyncio.run(runner.run(agent, f'turn {n}: fetch the report', engine=settings['engine'],
                                        conversation_id=cid, store=url, notify=lambda line: None,
                                        **{k: v for k, v in settings.items() if k != 'engine'}))
        assert 'read a report' in str(report.output), report.output
        if n in checkpoints:
            count, size = asyncio.run(conversation_bytes(url, cid))
            sqlite_checkpoint(db)
            store, grown = sqlite_files(db), engine_size()
            row: dict[str, Any] = {
                'engine': engine, 'turns': n, 'messages': count, 'message_bytes': size, 'store_bytes': store,
                'engine_bytes': grown, 'ratio': (store + grown) / size, 'store_ratio': store / size,
                'engine_ratio': grown / size, 'seconds': time.monotonic() - started,
                'load': os.getloadavg()[0],
            }
            if n == max(checkpoints):
                row['breakdown'] = {'store': sqlite_tables(db), **breakdown()}
            rows.append(row)
            print(f'  {engine:13} {n:4} turns {count:5} msgs {size / 1e6:7.2f} MB | {row["ratio"]:5.2f}x '
                  f'(store {row["store_ratio"]:5.2f}x, engine {row["engine_ratio"]:5.2f}x) target <= {TARGET}x '
                  f'| {row["seconds"]:.0f} s, load {row["load"]:.1f}', flush=True)
            if 'breakdown' in row:
                for part, sizes in row['breakdown'].items():
                    print(f'    {part}: {_top(sizes) if isinstance(sizes, dict) else sizes}', flush=True)
    return rows


# ---- DBOS ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _postgres_database(name: str) -> Iterator[str]:
    """A fresh PostgreSQL database `name` (URL yielded), dropped at the end."""
    import psycopg
    from psycopg import sql

    with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
        conn.execute(sql.SQL('CREATE DATABASE {}').format(sql.Identifier(name)))
    base = POSTGRES_ADMIN_URL.rsplit('/', 1)[0]
    try:
        yield f'{base}/{name}'
    finally:
        with psycopg.connect(POSTGRES_ADMIN_URL, autocommit=True) as conn:
            conn.execute(sql.SQL('DROP DATABASE IF EXISTS {} WITH (FORCE)').format(sql.Identifier(name)))


def _postgres_relations(url: str) -> dict[str, int]:
    """Bytes of each table of the database's non-system schemas, with its indexes and TOAST."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(
            "SELECT n.nspname || '.' || c.relname, pg_total_relation_size(c.oid) FROM pg_class c "
            "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.relkind = 'r' "
            "AND n.nspname NOT IN ('pg_catalog', 'information_schema') AND n.nspname NOT LIKE 'pg_toast%' "
            'ORDER BY 2 DESC').fetchall()
    return {name: int(size) for name, size in found}


def measure_dbos(checkpoints: list[int], folder: Path, backend: str = 'sqlite') -> list[dict[str, Any]]:
    """Run max(checkpoints) turns of one conversation on DBOS with a fresh system database (`backend`: `'sqlite'`, a
    file under `folder`; `'postgres'`, a new database at `$BENCH_POSTGRES_URL`'s server, dropped at the end) and a
    fresh store under `folder` (created). Returns one row per checkpoint (see the module docstring)."""
    from dbos import DBOS

    from bench.storage_agent import agent
    from durable_capabilities.engines.dbos import agent_workflow
    from durable_capabilities.engines.dbos._server import launch

    folder.mkdir(parents=True)
    engine = f'dbos-{backend}'
    with contextlib.ExitStack() as stack:
        if backend == 'sqlite':
            system = folder / 'dbos.sqlite'
            url = f'sqlite:///{system}'
        else:
            url = stack.enter_context(_postgres_database(f'bench_dbos_{uuid.uuid4().hex[:10]}'))

        def size() -> int:
            if backend == 'sqlite':
                sqlite_checkpoint(system)
                return sqlite_files(system)
            return sum(_postgres_relations(url).values())

        def breakdown() -> dict[str, Any]:
            return {'dbos': sqlite_tables(system) if backend == 'sqlite' else _postgres_relations(url)}

        agent_workflow(agent, store=f'sqlite:///{folder / "conversations.db"}')
        launch(system_database_url_=url, one_shot=True)  # DBOS creates its tables: the empty database's size
        DBOS.destroy()
        base = size()
        return _conversation(engine, checkpoints, folder, {'engine': 'dbos', 'db': url}, lambda: size() - base, breakdown)


# ---- Prefect ------------------------------------------------------------------------------------------------------


def measure_prefect(checkpoints: list[int], folder: Path) -> list[dict[str, Any]]:
    """Run max(checkpoints) turns of one conversation on a Prefect server started for it (its own `PREFECT_HOME`
    under `folder`, stopped at the end) with its own result storage folder and a fresh store. Returns one row per
    checkpoint (see the module docstring)."""
    from durable_capabilities.engines.prefect import start_prefect_server

    folder.mkdir(parents=True)
    results = folder / 'prefect-results'
    server = start_prefect_server(home=folder / 'prefect')
    home = Path(server.extra['PREFECT_HOME'])
    database = home / 'prefect.db'
    saved = {key: os.environ.get(key) for key in ('PREFECT_API_URL', 'PREFECT_LOCAL_STORAGE_PATH')}
    os.environ.update(PREFECT_API_URL=server.address, PREFECT_LOCAL_STORAGE_PATH=str(results))
    try:
        from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings

        with temporary_settings({PREFECT_API_URL: server.address, PREFECT_LOCAL_STORAGE_PATH: str(results)}):
            sqlite_checkpoint(database)
            base = sqlite_files(database)

            def size() -> int:
                sqlite_checkpoint(database)
                return sqlite_files(database) - base + folder_files(results)[0]

            def breakdown() -> dict[str, Any]:
                kept, files = folder_files(results)
                return {'prefect server': sqlite_tables(database),
                        f'result storage ({kept / 1e6:.2f} MB in {files} files)': result_kinds(results)}

            return _conversation('prefect', checkpoints, folder, {'engine': 'prefect'}, size, breakdown)
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


MEASURES: dict[str, Callable[[list[int], Path], list[dict[str, Any]]]] = {
    'dbos-sqlite': lambda checkpoints, folder: measure_dbos(checkpoints, folder, 'sqlite'),
    'dbos-postgres': lambda checkpoints, folder: measure_dbos(checkpoints, folder, 'postgres'),
    'prefect': measure_prefect,
}


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=(__doc__ or '').splitlines()[0])
    parser.add_argument('--engine', nargs='+', choices=list(MEASURES), default=list(MEASURES))
    parser.add_argument('--turns', type=int, nargs='+', default=[50, 100, 200])
    parser.add_argument('--json', action='store_true')
    args = parser.parse_args()
    load = os.getloadavg()
    print(f'load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs', flush=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix='bench-storage-engines-') as tmp:
        for engine in args.engine:
            rows += MEASURES[engine](sorted(args.turns), Path(tmp) / engine)
    load = os.getloadavg()
    print(f'load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}')
    print('\nengine        | ' + ' | '.join(f'{t:4} turns' for t in sorted(args.turns)))
    for engine in args.engine:
        ratios = [f'{r["ratio"]:9.2f}x' for r in rows if r['engine'] == engine]
        verdict = 'met' if all(r['ratio'] <= TARGET for r in rows if r['engine'] == engine) else 'MISSED'
        print(f'{engine:13} | ' + ' | '.join(ratios) + f'  ({verdict}, target <= {TARGET}x)')
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == '__main__':
    main()
