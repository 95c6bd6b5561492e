"""One turn everywhere: a DBOS user's own workflow keeps a conversation through `BoundAgent.run`, the same
`turn.run_turn` the engines' containers call (load and append as DBOS steps).

Real parts: DBOS on SQLite in a subprocess (DBOS's registry is process-global), the conversation store on
SQLite. The model is the support example's scripted `FunctionModel`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests._helpers import ROOT, subprocess_env


def test_dbos_users_workflow_keeps_a_conversation_through_the_turn(tmp_path: Path) -> None:
    env = subprocess_env({'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}'})
    result = subprocess.run(
        [sys.executable, '-m', 'tests.engines.dbos_user_conversation', f'sqlite:///{tmp_path / "app.sqlite"}'],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout.split('REPORT ', 1)[1].splitlines()[0])
    name = report['name']
    first, second = report['runs']
    assert 'ABC-123' in first['answer'] and 'DEF-456' in second['answer']
    for run in (first, second):
        assert run['steps'][0] == f'durcap__{name}__conversation.load'
        assert run['steps'][-1] == f'durcap__{name}__conversation.append'
        assert f'{name}__model.request' in run['steps']
    # The second turn started from the first one's messages: two appends, both turns stored.
    assert report['revision'] == 2
    assert report['messages'] > 4
