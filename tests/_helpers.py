"""Helpers shared by every test module: subprocess environments, the `durcap` CLI in a subprocess, PostgreSQL
databases, waiting for a condition, and reading a store's rows.

Subprocesses import THIS checkout: `subprocess_env()` puts its `src/` and root first on `PYTHONPATH` and keeps the
caller's `PYTHONPATH` after them, so a venv whose editable install points at another tree cannot hand a test
subprocess that other tree's code (`tests/unit/test_helpers.py` checks it).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[1]
"""The checkout's root (the folder holding `src/`, `tests/`, `examples/`)."""
SRC = ROOT / 'src'
FIXTURES = ROOT / 'tests' / 'fixtures'
HISTORIES = ROOT / 'tests' / 'histories'
DURCAP = (sys.executable, '-m', 'durable_capabilities.cli')
"""The `durcap` command of this checkout, run by the interpreter running the tests."""

T = TypeVar('T')


# ---- subprocesses --------------------------------------------------------------------------------------------------


def pythonpath(*first: str | os.PathLike[str] | None) -> str:
    """`PYTHONPATH` for a subprocess: `first` (when given), this checkout's `src/` and root, then the caller's own.

    Args:
        first: entries to put before the checkout's (a test project folder, a page's tmp folder); `None` is skipped.

    Returns:
        The joined path string (`os.pathsep`), without empty entries.
    """
    entries = [*(str(p) for p in first if p), str(SRC), str(ROOT), *os.environ.get('PYTHONPATH', '').split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def subprocess_env(extra: Mapping[str, str] | None = None, *, unset: Iterable[str] = ()) -> dict[str, str]:
    """This process's environment for a subprocess that must import this checkout.

    Args:
        extra: variables to set on top; a `PYTHONPATH` in it goes before the checkout's entries (not instead).
        unset: variables to remove (after `extra` is applied), e.g. `DURCAP_STORE`.

    Returns:
        A new dict: `os.environ` + `extra`, `PYTHONPATH` from `pythonpath()`, `PYTHONDONTWRITEBYTECODE=1` unless
        `extra` says otherwise, minus `unset`.

    Subprocesses read the package's cached bytecode (`.ci/run` compiles it first) but write none: a test that
    rewrites a module in its `tmp_path` within a second, to the same size, would otherwise import the old bytecode.
    """
    extra = dict(extra or {})
    env = {**os.environ, 'PYTHONDONTWRITEBYTECODE': '1', **extra, 'PYTHONPATH': pythonpath(extra.get('PYTHONPATH'))}
    for key in unset:
        env.pop(key, None)
    return env


def durcap(*args: str, cwd: str | os.PathLike[str] = ROOT, env: Mapping[str, str] | None = None,
           unset: Iterable[str] = (), timeout: float = 180, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run `durcap *args` of this checkout in a subprocess (stdin closed unless `input` is given); never raises on exit code.

    Args:
        args: the command line after `durcap`.
        cwd: working directory (the checkout's root by default).
        env: variables on top of `subprocess_env()`.
        unset: variables to remove from the environment.
        timeout: seconds before `subprocess.TimeoutExpired` is raised (the process is killed).
        input: text written to its stdin.

    Returns:
        The completed process, `stdout`/`stderr` as text.
    """
    return subprocess.run([*DURCAP, *args], cwd=cwd, env=subprocess_env(env, unset=unset), capture_output=True, text=True,
                          timeout=timeout, check=False, input=input, stdin=None if input is not None else subprocess.DEVNULL)


def python(code: str, *args: str, cwd: str | os.PathLike[str] = ROOT, env: Mapping[str, str] | None = None,
           timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run `python -c code *args` with this checkout importable (as `durcap()`); never raises on exit code."""
    return subprocess.run([sys.executable, '-c', code, *args], cwd=cwd, env=subprocess_env(env), capture_output=True,
                          text=True, timeout=timeout, check=False, stdin=subprocess.DEVNULL)


# ---- waiting -------------------------------------------------------------------------------------------------------


def wait_for(condition: Callable[[], T], timeout: float, *, interval: float = 0.1,
             message: str | Callable[[], str] = 'condition') -> T:
    """Poll `condition()` until it returns a truthy value; returns that value.

    Raises:
        AssertionError: `timeout` seconds passed first; the text is `message` (called when it is a function).
    """
    deadline = time.monotonic() + timeout
    while True:
        if value := condition():
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f'not within {timeout} s: {message() if callable(message) else message}')
        time.sleep(interval)


def wait_for_line(path: Path, needle: str, timeout: float, *, alive: Callable[[], bool] = lambda: True) -> str:
    """The first line of file `path` that contains `needle`, waiting up to `timeout` s while `alive()` holds.

    Raises:
        AssertionError: not seen in time, or `alive()` turned false first (the writer exited); shows the file's tail.
    """
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors='replace') if path.exists() else ''
        for line in text.splitlines():
            if needle in line:
                return line
        if time.monotonic() >= deadline or not alive():
            raise AssertionError(f'{needle!r} not seen within {timeout} s in {path}:\n{text[-4000:]}')
        time.sleep(0.1)


def wait_for_file(path: Path, timeout: float) -> None:
    """Wait until `path` exists.

    Raises:
        AssertionError: it did not appear within `timeout` seconds.
    """
    wait_for(path.exists, timeout, interval=0.05, message=f'{path} did not appear')


# ---- PostgreSQL (127.0.0.1:5432, trust auth) ------------------------------------------------------------------------

PG_ADMIN_URL = 'postgresql://postgres@127.0.0.1:5432/postgres'


def pg_url(name: str) -> str:
    """The URL of database `name` on the test PostgreSQL server."""
    return f'postgresql://postgres@127.0.0.1:5432/{name}'


def create_database(prefix: str = 'durcap') -> str:
    """Create an empty database named `{prefix}_<12 random hex>` (unique across test processes); returns its name.

    Raises:
        psycopg.OperationalError: PostgreSQL is not reachable.
    """
    import psycopg

    name = f'{prefix}_{uuid.uuid4().hex[:12]}'
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name


def drop_database(name: str) -> None:
    """Drop database `name` (if it exists), closing its connections."""
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def postgres_database(prefix: str = 'durcap') -> Iterator[str]:
    """A fresh database for the `with` block; yields its URL and drops it afterwards."""
    name = create_database(prefix)
    try:
        yield pg_url(name)
    finally:
        drop_database(name)


# ---- stores --------------------------------------------------------------------------------------------------------


def sqlite_url(folder: Path, name: str = 'conversations.db') -> str:
    """A store URL for a SQLite file in `folder` (a test's `tmp_path`)."""
    return f'sqlite:///{folder / name}'


def sql(url: str, statement: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Run one statement on a store's database outside the store (to corrupt rows, read them raw); its rows."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url.replace('postgresql://', 'postgresql+psycopg://', 1))
    try:
        with engine.begin() as conn:
            result = conn.execute(sqlalchemy.text(statement), params or {})
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


STORE_TABLES = ('durcap_schema_version', 'durcap_conversations', 'durcap_entries', 'durcap_writes')


def snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every store table (sorted), to show that a failed read changed nothing."""
    return {table: sorted(sql(url, f'SELECT * FROM {table}'), key=repr) for table in STORE_TABLES}


# ---- the CLI in this process ---------------------------------------------------------------------------------------


def durcap_here(*args: str, env: Mapping[str, str | None] | None = None) -> Any:
    """Run `durcap *args` in this process (typer's `CliRunner`): for argument checks that start nothing, at a
    fraction of a subprocess's cost. `env`: variables set (or removed, `None`) for the call only.

    Returns:
        click's `Result`: `exit_code`, `stdout`, `stderr`, `exception` (`SystemExit` on a normal exit).
    """
    from typer.testing import CliRunner

    from durable_capabilities.cli import app

    return CliRunner().invoke(app, list(args), env=dict(env or {}), catch_exceptions=True)
