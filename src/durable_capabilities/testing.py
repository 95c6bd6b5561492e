"""Helpers for our users' own test suites (and ours).

- `temporal_dev_server()` / `prefect_server()`: start a real local server for a test, stopped by pid.
- `assert_histories_replay(folder, agents)`: replay every recorded Temporal history in a folder against
  the current code; fails naming the capability, toolset or agent whose durable name changed.
- `assert_lock_matches(lockfile, agents)`: fail when a definition no longer produces a locked name.

```python
def test_recorded_histories_replay():
    assert_histories_replay('tests/histories/support', [support])
```
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._servers import ServerProcess
from .agent import DurableAgent
from .lockfile import diff_lock, read_lock
from .replay import replay_histories

__all__ = ['assert_histories_replay', 'assert_lock_matches', 'prefect_server', 'temporal_dev_server']


@contextmanager
def temporal_dev_server(state_dir: str | Path = '.durcap/test-temporal') -> Iterator[ServerProcess]:
    """A Temporal dev server (in-memory) on a free port; `.address` is `127.0.0.1:PORT`.

    Raises:
        ImportError: the `temporal` extra is not installed. FileNotFoundError / RuntimeError / TimeoutError: as
            `engines.temporal.start_temporal_dev_server`.
    """
    from .engines.temporal import start_temporal_dev_server  # lazily: temporalio is an optional extra

    server = start_temporal_dev_server(state_dir=state_dir, persistent=False)
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def prefect_server(home: str | Path = '.durcap/test-prefect') -> Iterator[ServerProcess]:
    """A Prefect server on a free port; `.address` is its API URL (set `PREFECT_API_URL` to it).

    Raises:
        ImportError: the `prefect` extra is not installed. RuntimeError / TimeoutError: as
            `engines.prefect.start_prefect_server`.
    """
    from .engines.prefect import start_prefect_server  # lazily: prefect is an optional extra

    server = start_prefect_server(home=home)
    try:
        yield server
    finally:
        server.stop()


def assert_histories_replay(folder: str | Path, agents: Sequence[DurableAgent[Any, Any]], pattern: str = '*.json') -> int:
    """Replay every history file in `folder`; returns how many replayed.

    Raises:
        AssertionError: a history does not replay (the message names what changed) or the folder is empty.
    """
    files = sorted(Path(folder).glob(pattern))
    if not files:
        raise AssertionError(f'no recorded histories matching {pattern} in {folder}')
    failures = asyncio.run(replay_histories(files, agents))
    if failures:
        raise AssertionError('\n'.join(f.format() for f in failures))
    return len(files)


def assert_lock_matches(lockfile: str | Path, agents: Sequence[DurableAgent[Any, Any]]) -> None:
    """Raise `AssertionError` listing every DC020 / DC021 problem when `agents` drifted from `lockfile`."""
    report = diff_lock(read_lock(lockfile), agents)
    if not report.ok:
        raise AssertionError(report.to_text())
