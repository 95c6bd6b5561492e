"""Adding a durable engine is one subpackage and one registry line (issue 23, item 2).

The package source is copied to a temporary folder; the journal test engine (`tests/engines/journal_engine`, a
SQLite journal as its durable container) is added there as `engines/journal/` with one line in the copy's
`engines/__init__.py`, and nothing else changes. The copy's CLI (first on `PYTHONPATH`) then shows the engine in
`durcap check`, `lock`, `run --engine journal`, `runs list`, `runs resume` (a second run of the run id replays its
journaled steps: the tool's side effect happens once), `approvals list` and `--help`. No server is needed.
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import durable_capabilities

HERE = Path(__file__).parent
PACKAGE = Path(durable_capabilities.__file__).parent
REGISTRY_LINE = 'from .journal import SPEC as JOURNAL_SPEC; register(LazyAdapter(JOURNAL_SPEC))  # noqa: E702, I001\n'

AGENT = '''
import os

from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import FunctionModel

from durable_capabilities import DurableAgent


def respond(messages, info):
    returns = [p for m in messages for p in m.parts if isinstance(p, ToolReturnPart)]
    if not returns:
        return ModelResponse(parts=[ToolCallPart('refund', {'order': 'ABC-123'})])
    return ModelResponse(parts=[TextPart(f'done: {returns[-1].content}')])


def refund(order: str) -> str:
    """Refund an order (a side effect: one line per call)."""
    with open(os.environ['SIDE_EFFECTS'], 'a') as effects:
        effects.write(order + '\\n')
    return f'refunded {order}'


journaled = DurableAgent('journaled', FunctionModel(respond), engines=('journal',),
                         capabilities=[Capability(id='refunds', tools=[refund])])
'''


def _copy_with_engine(root: Path) -> Path:
    """The package copied under `root/src`, plus the journal engine and its one registry line."""
    copy = root / 'src' / 'durable_capabilities'
    ignore = shutil.ignore_patterns('__pycache__', '*.pyc')
    shutil.copytree(PACKAGE, copy, ignore=ignore)
    shutil.copytree(HERE / 'journal_engine', copy / 'engines' / 'journal', ignore=ignore)
    with (copy / 'engines' / '__init__.py').open('a') as registry:
        registry.write(REGISTRY_LINE)
    return copy


def _differences(original: Path, copy: Path, at: str = '') -> list[str]:
    """Paths (relative) that differ between the two trees: added, removed or changed files and folders."""
    compared = filecmp.dircmp(original, copy, ignore=['__pycache__'])
    found = [f'{at}{name}' for name in compared.left_only + compared.right_only + compared.diff_files]
    for name in compared.common_dirs:
        found += _differences(original / name, copy / name, f'{at}{name}/')
    return sorted(found)


def test_a_durable_engine_is_one_subpackage_and_one_registry_line(tmp_path: Path) -> None:
    copy = _copy_with_engine(tmp_path)
    assert _differences(PACKAGE, copy) == ['engines/__init__.py', 'engines/journal']
    before = (PACKAGE / 'engines' / '__init__.py').read_text().splitlines(keepends=True)
    after = (copy / 'engines' / '__init__.py').read_text().splitlines(keepends=True)
    assert after == [*before, REGISTRY_LINE]

    work = tmp_path / 'work'
    work.mkdir()
    (work / 'agent.py').write_text(textwrap.dedent(AGENT))
    effects = work / 'effects.txt'
    env = {**os.environ, 'PYTHONPATH': str(copy.parent), 'SIDE_EFFECTS': str(effects), 'COLUMNS': '200',
           'DURCAP_STORE': f'sqlite:///{work / "conversations.db"}'}
    env.pop('DURCAP_JOURNAL', None)

    def durcap(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, '-m', 'durable_capabilities.cli', *args], cwd=work, env=env,
                              capture_output=True, text=True, timeout=120)

    where = durcap('--help')
    assert where.returncode == 0, where.stderr
    imported = subprocess.run([sys.executable, '-c', 'import durable_capabilities; print(durable_capabilities.__file__)'],
                              env=env, capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == str(copy / '__init__.py')  # the copy runs, not this tree

    run_help = durcap('run', '--help').stdout
    assert 'journal' in run_help and '--journal' in run_help and 'Journal engine SQLite file' in run_help

    check = durcap('check', 'agent.py:journaled', '--format', 'json')
    assert check.returncode == 0, check.stdout + check.stderr
    assert 'journal' in check.stdout

    lock = durcap('lock', 'agent.py:journaled')
    assert lock.returncode == 0, lock.stderr
    locked = (work / 'durable.lock').read_text()
    assert 'journal.journaled.model_request' in locked and 'journal.journaled.tool.refund' in locked

    journal = ['--journal', str(work / 'journal.sqlite')]
    first = durcap('run', 'agent.py:journaled', 'Refund ABC-123', '--engine', 'journal', *journal)
    assert first.returncode == 0, first.stdout + first.stderr
    assert 'done: refunded ABC-123' in first.stdout
    assert effects.read_text().splitlines() == ['ABC-123']
    run_id = re.search(r'journal run id: (\S+)', first.stderr).group(1)  # type: ignore[union-attr]

    listed = durcap('runs', 'list', '--engine', 'journal', *journal)
    assert listed.returncode == 0 and run_id in listed.stdout, listed.stdout + listed.stderr

    again = durcap('runs', 'resume', run_id, '--engine', 'journal', *journal, '--target', 'agent.py:journaled')
    assert again.returncode == 0, again.stdout + again.stderr
    assert 'done: refunded ABC-123' in again.stdout
    assert effects.read_text().splitlines() == ['ABC-123']  # replayed from the journal: the refund ran once

    approvals = durcap('approvals', 'list', '--engine', 'journal', *journal)
    assert approvals.returncode == 0, approvals.stderr
    assert 'no calls waiting for approval' in approvals.stdout
