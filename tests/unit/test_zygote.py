"""The test suite's fork server (tests/_zygote.py) behaves as a fresh interpreter would, for what the suite relies on:
a real pid that SIGKILL and SIGTERM reach, exit codes, pipes that reach EOF, the child's environment, working directory,
`sys.argv` and `sys.path`, and the real `Popen` for anything it does not handle. No server, no model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import _zygote

pytestmark = pytest.mark.skipif(subprocess.Popen is not _zygote.ZygotePopen, reason='DURCAP_TEST_ZYGOTE=0')

_PROBE = ('import json, os, sys; print(json.dumps({"ppid": os.getppid(), "cwd": os.getcwd(), "argv": sys.argv, '
          '"env": os.environ.get("PROBE"), "preloaded": "pydantic_ai" in sys.modules, "path0": sys.path[0]}))')


def test_a_forked_child_sees_its_own_cwd_env_and_argv(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, '-c', _PROBE, 'a', 'b'], cwd=tmp_path, env={**os.environ, 'PROBE': 'x'},
                         capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout)
    assert seen['ppid'] != os.getpid() and seen['preloaded'] is True  # forked from the server, imports done there
    assert (seen['cwd'], seen['argv'], seen['env'], seen['path0']) == (str(tmp_path), ['-c', 'a', 'b'], 'x', '')


def test_turned_off_it_is_the_real_popen(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, '-c', _PROBE], env={**os.environ, 'DURCAP_TEST_ZYGOTE': '0'},
                         capture_output=True, text=True, timeout=60, check=True)
    seen = json.loads(out.stdout)
    assert seen['ppid'] == os.getpid() and seen['preloaded'] is False


@pytest.mark.parametrize(('code', 'expected'), [('raise SystemExit(7)', 7), ('import sys; sys.exit("bye")', 1),
                                                ('raise ValueError("boom")', 1), ('pass', 0)])
def test_exit_codes_are_the_interpreters(code: str, expected: int) -> None:
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == expected, out.stderr
    if 'boom' in code:
        assert 'ValueError: boom' in out.stderr


@pytest.mark.parametrize('sig', [signal.SIGKILL, signal.SIGTERM])
def test_signals_reach_the_child_by_its_pid(sig: signal.Signals) -> None:
    proc = subprocess.Popen([sys.executable, '-u', '-c', 'import time; print("up", flush=True); time.sleep(120)'],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == 'up\n'
        assert os.getpgid(proc.pid) == proc.pid  # its own session, as start_new_session asks
        assert proc.poll() is None
        os.kill(proc.pid, sig)
        assert proc.wait(timeout=30) == -sig
    finally:
        proc.kill()
        proc.wait(timeout=30)


def test_a_module_runs_as_main_with_its_arguments(tmp_path: Path) -> None:
    (tmp_path / 'probe_mod.py').write_text('import sys\nif __name__ == "__main__":\n    print(sys.argv[1:])\n',
                                           encoding='utf-8')
    env = {**os.environ, 'PYTHONPATH': f'{tmp_path}{os.pathsep}{os.environ.get("PYTHONPATH", "")}'}
    # `-m` of a module outside durable_capabilities/tests is not forked (the real Popen runs it): both give the same.
    out = subprocess.run([sys.executable, '-m', 'probe_mod', 'x'], env=env, capture_output=True, text=True, timeout=60,
                         check=True)
    assert out.stdout == "['x']\n"
