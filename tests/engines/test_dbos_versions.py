"""Two `durcap worker dbos` processes serving different agents on one PostgreSQL system database and one queue: each
runs as its own application version, and each agent's runs go to its own worker (issue 29 loose end).

Model: scripted `FunctionModel`s (tests/engines/two_agents.py: `alpha` and `beta` answer `'<name> answered: ...'`).
Real parts: PostgreSQL on 127.0.0.1:5432 (a fresh database), the two workers as `durcap worker dbos` subprocesses,
runs handed to the queue by concurrent `durcap run --engine dbos --queue` subprocesses, DBOS's own workflow table read
for the executor that ran each.

Before the fix both workers reported one application version (DBOS hashes the registered workflows' sources, the same
function for every agent), so either took the other's runs: a run of `alpha` taken by `beta`'s worker stayed PENDING
there (reproduced by hand: one of four alpha runs), and its `durcap run` never answered.
"""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from tests._helpers import DURCAP, ROOT, sql, subprocess_env
from tests.engines._serve import start

pytestmark = [pytest.mark.slow]

TARGET = 'tests.engines.two_agents'


def test_workers_of_two_agents_run_as_their_own_versions_and_take_only_their_runs(postgres_url: str,
                                                                                  tmp_path: Path) -> None:
    """Their ready lines name different versions, each naming its agent; 4 runs of alpha and 2 of beta enqueued at once
    all answer, each run by its own agent's worker."""
    tag = uuid.uuid4().hex[:6]
    env = {'DURCAP_TWO_AGENTS_TAG': tag, 'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}'}
    queue = f'versions-{tag}'
    workers = {name: start(['worker', 'dbos', f'{TARGET}:{name}', '--db', postgres_url, '--queue', queue,
                            '--executor-id', f'ex-{name}'], tmp_path / f'{name}.log', env) for name in ('alpha', 'beta')}
    runs: list[tuple[str, subprocess.Popen[str]]] = []
    try:
        versions = {name: w.wait_for('dbos worker ready', 120).rsplit('application version ', 1)[1].split(';')[0]
                    for name, w in workers.items()}
        assert versions['alpha'] != versions['beta'], versions
        assert versions['alpha'].startswith(f'durcap:alpha{tag}:'), versions
        assert versions['beta'].startswith(f'durcap:beta{tag}:'), versions
        for name, count in (('alpha', 4), ('beta', 2)):
            for i in range(count):
                runs.append((name, subprocess.Popen(
                    [*DURCAP, 'run', f'{TARGET}:{name}', f'question {i}', '--engine', 'dbos', '--db', postgres_url,
                     '--queue', queue], cwd=ROOT, env=subprocess_env(env), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, start_new_session=True)))
        for name, proc in runs:
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err
            assert f'{name} answered: question' in out, out + err
        rows = sql(postgres_url, 'SELECT name, executor_id, application_version, status FROM dbos.workflow_status')
        ran = sorted((name, executor, version, status) for name, executor, version, status in rows)
        assert ran == sorted([(f'durcap.alpha{tag}', 'ex-alpha', versions['alpha'], 'SUCCESS')] * 4
                             + [(f'durcap.beta{tag}', 'ex-beta', versions['beta'], 'SUCCESS')] * 2), ran
    finally:
        for _, proc in runs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        for w in workers.values():
            w.kill9()


def test_version_serving_picks_the_newest_version_naming_the_agent() -> None:
    """`version_serving` reads the agent names out of `durcap:NAMES:DIGEST` versions (newest first) and skips DBOS's
    plain ones; no model runs."""
    from durable_capabilities import DurableAgent
    from durable_capabilities.engines.dbos._server import version_serving

    agent = DurableAgent('alpha', 'test')
    versions = ['0f' * 16, 'durcap:beta:1', 'durcap:alpha+beta:2', 'durcap:alpha:3']
    assert version_serving(versions, agent) == 'durcap:alpha+beta:2'
    assert version_serving(['durcap:alphabet:1', '0f' * 16], agent) is None
