"""`durcap history delete` and `durcap store stats` as a user runs them: subprocesses of the CLI in a fresh folder, a
real DBOS SQLite system database (the engine's own deletion with `--engines`), a real local run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def durcap(*args: str, cwd: Path) -> Any:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ('DURCAP_STORE', 'DURCAP_DBOS_DB')}
    return subprocess.run([sys.executable, '-m', 'durable_capabilities.cli', *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_the_commands(tmp_path: Path) -> None:
    """`durcap run` says where it created the store (once); `store stats` lists it; `history delete` lists with
    --dry-run, refuses without --yes when it cannot ask, deletes with --yes (and the DBOS run with --engines)."""
    import json
    import socket

    target = str(ROOT / 'tests/fixtures/counting_agent.py') + ':counted'
    first = durcap('run', target, 'hi', '--engine', 'dbos', '--conversation', 'gone', cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    where = str((tmp_path / '.durcap' / 'conversations.db').resolve())
    assert f'durcap: created the conversation store {where}' in first.stderr
    second = durcap('run', target, 'hi', '--engine', 'local', '--conversation', 'kept', cwd=tmp_path)
    assert second.returncode == 0 and 'created the conversation store' not in second.stderr, second.stderr

    stats = json.loads(durcap('store', 'stats', '--format', 'json', cwd=tmp_path).stdout)
    assert stats['location'] == where and stats['database_bytes'] > 0
    assert {c['conversation_id']: c['message_count'] for c in stats['conversations']} == {'gone': 2, 'kept': 2}
    text = durcap('store', 'stats', cwd=tmp_path).stdout
    assert f'store: {where}' in text and 'gone' in text

    listed = durcap('history', 'delete', 'gone', '--dry-run', cwd=tmp_path)
    assert listed.returncode == 0 and 'would delete durcap_conversations 1, durcap_entries 2' in listed.stdout, listed.stdout
    assert 'dbos counted-' in listed.stdout and 'delete_workflows' in listed.stdout
    assert 'cannot tell whether a run of it is in flight' in listed.stderr
    unasked = durcap('history', 'delete', 'gone', cwd=tmp_path)
    assert unasked.returncode == 2 and 'pass --yes' in unasked.stderr
    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        closed = s.getsockname()[1]
    # The engine holding the conversation's run cannot be asked: refused before anything is deleted (one line, exit 2).
    unreachable = durcap('history', 'delete', 'gone', '--yes', '--engines', '--db',
                         f'postgresql://nobody@127.0.0.1:{closed}/none', cwd=tmp_path)
    said = unreachable.stderr.replace('\n', ' ')
    assert unreachable.returncode == 2 and said.startswith("durcap: error: DC040 --engines: conversation 'gone' has "
                                                           'dbos runs (counted-'), said
    assert 'and it could not be asked (dbos: cannot read runs' in said and 'nothing was deleted' in said, said
    assert 'Fix: check --db, or pass --skip-engine dbos' in said, said
    # A DBOS --db where the run is not (another folder's default, a typo): refused before anything is deleted. It
    # deleted the store's rows, then said `NOT deleted (RunNotFoundError ...)` with exit 1, the workflow's inputs kept.
    elsewhere = tmp_path / 'elsewhere' / 'dbos.sqlite'
    wrong = durcap('history', 'delete', 'gone', '--yes', '--engines', '--db', f'sqlite:///{elsewhere}', cwd=tmp_path)
    said = wrong.stderr.replace('\n', ' ')
    assert wrong.returncode == 2 and wrong.stdout == '', wrong.stdout + wrong.stderr
    assert "DC040 --engines: conversation 'gone' has dbos runs (counted-" in said, said
    assert 'none of them is where it was asked' in said and 'Fix: pass the --db the runs used' in said, said
    assert not elsewhere.exists()
    with socket.socket() as s:  # a Temporal address nothing listens on: that engine is reported as not checked
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    done = durcap('history', 'delete', 'gone', '--yes', '--engines', '--address', f'127.0.0.1:{port}', '--format', 'json',
                  cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report['store']['rows']['durcap_entries'] == 2
    assert [(r['engine'], r['deleted']) for r in report['engines']] == [('dbos', True)]
    assert 'not checked for runs in flight: temporal' in done.stderr
    runs = durcap('runs', 'list', '--engine', 'dbos', '--format', 'json', cwd=tmp_path)
    assert 'gone' not in runs.stdout, runs.stdout
    assert durcap('history', 'show', 'gone', cwd=tmp_path).returncode == 2
    assert durcap('history', 'show', 'kept', cwd=tmp_path).returncode == 0
    missing = durcap('history', 'delete', 'gone', '--yes', cwd=tmp_path)
    assert missing.returncode == 2 and "conversation 'gone' is not in the store" in missing.stderr


def test_engines_delete_refuses_prefect_runs_without_its_api_url(prefect_api_url: str, tmp_path: Path) -> None:
    """A conversation with a Prefect run (real Prefect server; the counting agent's scripted `FunctionModel`):
    `history delete --engines` without PREFECT_API_URL is one DC040 line, exit 2, nothing deleted and no temporary
    Prefect server started (it started one, which never holds the run, and failed to delete it after the store's rows
    were gone); `--skip-engine prefect` deletes the store's rows and lists the flow run with how to remove it."""
    import json

    from tests._helpers import durcap as run

    target = str(ROOT / 'tests/fixtures/counting_agent.py') + ':counted'
    store = f'sqlite:///{tmp_path / "conv.db"}'
    with_api = {'PREFECT_API_URL': prefect_api_url}
    first = run('run', target, 'hi', '--engine', 'prefect', '--conversation', 'p-gone', '--store', store, cwd=tmp_path,
                env=with_api, unset=['DURCAP_STORE'])
    assert first.returncode == 0, first.stdout + first.stderr
    refused = run('history', 'delete', 'p-gone', '--yes', '--engines', '--store', store, cwd=tmp_path,
                  unset=['PREFECT_API_URL', 'DURCAP_STORE'], timeout=60)
    said = refused.stderr.replace('\n', ' ')
    assert refused.returncode == 2 and refused.stdout == '', refused.stdout + refused.stderr
    assert said.startswith("durcap: error: DC040 --engines: conversation 'p-gone' has prefect runs (") and (
        'PREFECT_API_URL is not set: nothing was deleted. Fix: set PREFECT_API_URL to the prefect server that holds '
        'them, or pass --skip-engine prefect') in said, said
    assert 'temporary' not in refused.stdout + refused.stderr
    shown = run('history', 'show', 'p-gone', '--store', store, cwd=tmp_path, unset=['DURCAP_STORE'], timeout=60)
    assert shown.returncode == 0, shown.stderr  # nothing deleted
    skipped = run('history', 'delete', 'p-gone', '--yes', '--engines', '--skip-engine', 'prefect', '--store', store,
                  '--format', 'json', cwd=tmp_path, unset=['PREFECT_API_URL', 'DURCAP_STORE'], timeout=60)
    assert skipped.returncode == 0, skipped.stdout + skipped.stderr
    report = json.loads(skipped.stdout)
    assert report['store']['rows']['durcap_entries'] == 2
    [record] = report['engines']
    assert record['engine'] == 'prefect' and record['deleted'] is None and record['remove'], record
    assert 'temporary' not in skipped.stderr, skipped.stderr
