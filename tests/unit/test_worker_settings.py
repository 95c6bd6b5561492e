"""workers/*.py refuse an unusable number in their environment (DURCAP_DBOS_CONCURRENCY, DURCAP_GRACEFUL_SHUTDOWN,
DURCAP_PREFECT_LIMIT, ...) before connecting to anything: exit 2, one line naming the variable and what it takes,
no traceback. Real subprocesses of the scripts (one per script; nothing to connect to is needed: they stop first),
and `workers/_common.py` `env_number` on a table of values."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests._helpers import ROOT, subprocess_env


def _common():
    """workers/_common.py, imported as the scripts import it (workers/ first on sys.path)."""
    spec = importlib.util.spec_from_file_location('_durcap_workers_common', ROOT / 'workers' / '_common.py')
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(('raw', 'integer', 'minimum', 'expected'), [
    (None, True, 1, 8), ('', True, 1, 8), ('  ', False, 0, 8), ('3', True, 1, 3), ('0', False, 0, 0.0),
    ('2.5', False, 0, 2.5), ('eight', True, 1, None), ('0', True, 1, None), ('2.5', True, 1, None),
    ('-1', False, 0, None), ('nan', False, 0, None), ('30s', False, 0, None),
])
def test_env_number(raw: str | None, integer: bool, minimum: float, expected: float | None) -> None:
    lines: list[str] = []
    if expected is None:
        with pytest.raises(SystemExit) as exc:
            _common().env_number('DURCAP_X', raw, 8, lines.append, minimum=minimum, integer=integer)
        assert exc.value.code == 2
        assert lines == [f'error: DURCAP_X={raw!r} is not {"a whole number" if integer else "a number"} >= '
                         f'{minimum:g}; set it to one (or unset it for 8)']
    else:
        assert _common().env_number('DURCAP_X', raw, 8, lines.append, minimum=minimum, integer=integer) == expected
        assert not lines


@pytest.mark.parametrize(('script', 'name', 'value', 'wants'), [
    ('dbos_app.py', 'DURCAP_DBOS_CONCURRENCY', 'eight', 'a whole number >= 1'),
    ('temporal_worker.py', 'DURCAP_GRACEFUL_SHUTDOWN', '30s', 'a number >= 0'),
    ('prefect_flows.py', 'DURCAP_PREFECT_LIMIT', '2.5', 'a whole number >= 1'),
])
def test_unusable_number_exits_2_naming_the_variable(script: str, name: str, value: str, wants: str) -> None:
    env = subprocess_env({name: value, 'PREFECT_API_URL': 'http://127.0.0.1:9/api',
                          'DBOS_SYSTEM_DATABASE_URL': 'postgresql://nobody@127.0.0.1:9/none'})
    result = subprocess.run([sys.executable, str(ROOT / 'workers' / script)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f'error: {name}={value!r} is not {wants}' in lines[0], lines[0]
    assert 'Traceback' not in result.stderr
