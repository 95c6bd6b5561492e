"""`durcap runs show|list|resume --store` (issue 24): a run made with `durcap run --store A` (its result names its
append in store A) is read back from A when the command is given `--store A`, with `$DURCAP_STORE` pointing at
another store; without the flag, the command reads `$DURCAP_STORE` and says the turn's messages are not there.

One real `durcap run` on DBOS with a SQLite system database (no server), shared by the three tests; each command is a
real subprocess. Model: the scripted support `FunctionModel` (examples/support/scripted.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DURCAP = [sys.executable, '-m', 'durable_capabilities.cli']
TARGET = 'examples.support.agent:support'
DEPS = json.dumps({'orders': {'ABC-123': 'Blue jacket: shipped'}})


def _durcap(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*DURCAP, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope='module')
def stored_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One completed DBOS run whose turn is in store A while `$DURCAP_STORE` names store B (empty)."""
    folder = tmp_path_factory.mktemp('runs-store')
    env = {**os.environ, 'PYTHONPATH': f'{ROOT / "src"}{os.pathsep}{ROOT}', 'DURCAP_STORE': f'sqlite:///{folder / "elsewhere.db"}'}
    db = f'sqlite:///{folder / "dbos.sqlite"}'
    store = f'sqlite:///{folder / "flagged.db"}'
    ran = _durcap('run', TARGET, 'Where is my order ABC-123?', '--deps-json', DEPS, '--engine', 'dbos', '--db', db,
                  '--store', store, '--conversation', 'flagged', env=env, cwd=folder)
    assert ran.returncode == 0 and 'Order ABC-123: Blue jacket: shipped' in ran.stdout, ran.stdout + ran.stderr
    listed = _durcap('runs', 'list', '--engine', 'dbos', '--db', db, '--store', store, '--format', 'json', env=env,
                     cwd=folder)
    assert listed.returncode == 0, listed.stderr
    (run,) = [json.loads(line) for line in listed.stdout.splitlines() if line.strip()]  # JSON lines
    return {'env': env, 'db': db, 'store': store, 'cwd': folder, 'run_id': run['run_id'], 'listed': run}


def test_runs_show_reads_the_turn_from_the_store_flag(stored_run: dict[str, Any]) -> None:
    r = stored_run
    shown = _durcap('runs', 'show', r['run_id'], '--engine', 'dbos', '--db', r['db'], '--store', r['store'],
                    '--format', 'json', env=r['env'], cwd=r['cwd'])
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info['notes'] == [] and info['capabilities'] == ['orders'], info
    unflagged = _durcap('runs', 'show', r['run_id'], '--engine', 'dbos', '--db', r['db'], '--format', 'json',
                        env=r['env'], cwd=r['cwd'])
    assert unflagged.returncode == 0, unflagged.stderr
    assert any('not readable' in note for note in json.loads(unflagged.stdout)['notes']), unflagged.stdout


def test_runs_list_reads_the_turns_from_the_store_flag(stored_run: dict[str, Any]) -> None:
    r = stored_run
    assert r['listed']['notes'] == [] and r['listed']['capabilities'] == ['orders'], r['listed']
    unflagged = _durcap('runs', 'list', '--engine', 'dbos', '--db', r['db'], '--format', 'json', env=r['env'],
                        cwd=r['cwd'])
    assert unflagged.returncode == 0, unflagged.stderr
    (run,) = [json.loads(line) for line in unflagged.stdout.splitlines() if line.strip()]
    assert any('not readable' in note for note in run['notes']), run


def test_runs_resume_reads_the_answer_from_the_store_flag(stored_run: dict[str, Any]) -> None:
    r = stored_run
    resumed = _durcap('runs', 'resume', r['run_id'], '--target', TARGET, '--engine', 'dbos', '--db', r['db'],
                      '--store', r['store'], env=r['env'], cwd=r['cwd'])
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert 'had already completed' in resumed.stderr and 'Order ABC-123: Blue jacket: shipped' in resumed.stdout
    unflagged = _durcap('runs', 'resume', r['run_id'], '--target', TARGET, '--engine', 'dbos', '--db', r['db'],
                        env=r['env'], cwd=r['cwd'])
    assert unflagged.returncode != 0 and 'Blue jacket' not in unflagged.stdout, unflagged.stdout + unflagged.stderr
