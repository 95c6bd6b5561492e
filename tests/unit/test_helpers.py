"""tests/_helpers.py: every subprocess a test starts imports THIS checkout, whatever the caller's PYTHONPATH or the
venv's editable install points at."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import ROOT, SRC, durcap, python, pythonpath, subprocess_env


def _other_tree(tmp_path: Path) -> Path:
    """A fake `durable_capabilities` package elsewhere, as another checkout's src/ would be."""
    other = tmp_path / 'other' / 'src' / 'durable_capabilities'
    other.mkdir(parents=True)
    (other / '__init__.py').write_text('__version__ = "0.0.0-other-tree"\n')
    return other.parent


def test_a_subprocess_imports_this_checkout_even_with_another_tree_on_the_callers_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('PYTHONPATH', str(_other_tree(tmp_path)))
    env = subprocess_env()
    entries = env['PYTHONPATH'].split(os.pathsep)
    assert entries[:2] == [str(SRC), str(ROOT)] and entries[-1] == str(tmp_path / 'other' / 'src')  # caller's kept, after
    code = 'import durable_capabilities; print(durable_capabilities.__file__)'
    # Without the helper, the caller's PYTHONPATH wins: the other tree is imported (what the old fixtures allowed).
    plain = subprocess.run([sys.executable, '-c', code], env={**os.environ, 'PYTHONPATH': os.environ['PYTHONPATH']},
                           capture_output=True, text=True, timeout=60, check=False)
    assert plain.stdout.strip() == str(tmp_path / 'other' / 'src' / 'durable_capabilities' / '__init__.py'), plain.stdout
    done = python(code)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).resolve().is_relative_to(SRC.resolve()), done.stdout
    helped = durcap('--help')  # the other tree has no CLI: this only works on this checkout's package
    assert helped.returncode == 0 and 'Usage' in helped.stdout, helped.stdout + helped.stderr


def test_extra_entries_go_first_and_unset_removes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv('DURCAP_STORE', 'sqlite:///x.db')
    monkeypatch.delenv('PYTHONPATH', raising=False)
    env = subprocess_env({'PYTHONPATH': '/project', 'X_TEST': '1'}, unset=['DURCAP_STORE'])
    assert env['PYTHONPATH'] == os.pathsep.join(['/project', str(SRC), str(ROOT)])
    assert env['X_TEST'] == '1' and 'DURCAP_STORE' not in env
    assert pythonpath() == os.pathsep.join([str(SRC), str(ROOT)])
