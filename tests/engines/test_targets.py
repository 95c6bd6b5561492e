"""TARGET loading (`durable_capabilities.targets`), one rule for durable.lock, and DC011 wherever two definitions
named alike meet: `validate_together`, DBOS (real launch on SQLite), one Temporal worker (the dev server of
$DURCAP_TEST_TEMPORAL_ADDRESS) and Prefect flows (the server of $DURCAP_TEST_PREFECT_API_URL).

Each engine case runs in a real subprocess (engine registries are per process). The agents of
tests/fixtures/same_name_a.py and same_name_b.py both are named 'support'; their model is pydantic-ai's
`TestModel`, answering 'answer from module A' / 'answer from module B'.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._helpers import ROOT, durcap, subprocess_env

FIXTURES = ROOT / 'tests' / 'fixtures'
BOTH_MODULES = ('tests.fixtures.same_name_a at tests/fixtures/same_name_a.py', 'tests.fixtures.same_name_b at tests/fixtures/same_name_b.py')


def python(code: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, '-c', textwrap.dedent(code)], cwd=ROOT, env=subprocess_env(env),
                          capture_output=True, text=True, timeout=timeout, check=False)


# ---- a whole module, every problem of every agent --------------------------------------------------------------


def test_check_a_module_reports_every_broken_agent() -> None:
    result = durcap('check', 'tests/fixtures/mixed_agents.py')
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith('error') and 'DC001' in line and "agent 'missing-id'" in line for line in lines), result.stdout
    assert any(line.startswith('error') and 'DC002' in line and "agent 'bad-id'" in line for line in lines), result.stdout
    assert "'fine', 'missing-id', 'bad-id': 2 error(s)" in result.stdout
    payload = json.loads(durcap('check', 'tests/fixtures/mixed_agents.py', '-f', 'json').stdout)
    assert sorted(p['code'] for p in payload['problems']) == ['DC001', 'DC002']


def test_check_an_attribute_of_a_module_with_broken_agents_reports_them_all() -> None:
    """Before, the first agent raising at import hid the others; now `MODULE:attr` shows every one."""
    result = durcap('check', 'tests/fixtures/mixed_agents.py:fine')
    assert result.returncode == 1
    assert 'DC001' in result.stdout and 'DC002' in result.stdout


def test_dotted_module_target_and_unusable_targets(tmp_path: Path) -> None:
    assert durcap('check', 'examples.support.agent').returncode == 0
    empty = tmp_path / 'empty.py'
    empty.write_text('x = 1\n')
    result = durcap('check', str(empty))
    assert result.returncode == 2 and result.stderr.strip() == "durcap: error: DC040 module 'empty' defines no DurableAgent"
    assert 'Traceback' not in result.stderr
    broken = tmp_path / 'raises.py'
    broken.write_text('raise RuntimeError("boom")\n')
    result = durcap('check', str(broken))
    assert result.returncode == 2 and "importing 'raises' raised RuntimeError: boom" in result.stderr


def test_library_modules_do_not_import_the_cli() -> None:
    package = ROOT / 'src' / 'durable_capabilities'
    for path in [*package.rglob('*.py'), *(ROOT / 'workers').glob('*.py')]:
        if path.is_relative_to(package / 'cli'):  # the cli/ package itself (its __main__ imports cli)
            continue
        text = path.read_text()
        assert 'from .cli ' not in text and 'from ..cli ' not in text and 'durable_capabilities.cli import' not in text, path


# ---- DC011 wherever agents meet --------------------------------------------------------------------------------


def test_validate_together_names_both_modules_and_accepts_one_object_twice() -> None:
    result = durcap('check', 'tests/fixtures/same_name_pair.py', '-f', 'json')
    problems = json.loads(result.stdout)['problems']
    assert [p['code'] for p in problems] == ['DC011'] and result.returncode == 1
    assert 'same_name_a at tests/fixtures/same_name_a.py:11' in problems[0]['message']
    assert 'same_name_b at tests/fixtures/same_name_b.py:11' in problems[0]['message']
    same = python("""
        from durable_capabilities import validate_together
        from tests.fixtures.same_name_a import support
        print(validate_together([support, support]).to_text())
    """)
    assert same.stdout.strip() == 'no problems found', same.stderr


@pytest.mark.slow
def test_dbos_two_modules_named_alike_dc011_and_the_right_agent_answers(tmp_path: Path) -> None:
    result = python(f"""
        import asyncio
        from dbos import DBOS
        from durable_capabilities.engines import dbos as engine
        from durable_capabilities.validation import DurableConfigError
        from tests.fixtures.same_name_a import support as a
        from tests.fixtures.same_name_b import support as b

        workflow = engine.agent_workflow(a)
        assert engine.agent_workflow(a) is workflow  # the same object again: fine
        for register in (lambda: engine.agent_workflow(b), lambda: engine.workflow(b)(lambda agent: None),
                         lambda: engine.launch('durcap-dc011', system_database_url_='sqlite:///{tmp_path}/x.sqlite', agents=[a, b])):
            try:
                register()
            except DurableConfigError as exc:
                print('REFUSED', exc.report.codes(), exc.report.problems[0].message)
            else:
                print('ACCEPTED')
        engine.launch('durcap-dc011', system_database_url_='sqlite:///{tmp_path}/dbos.sqlite', agents=[a])
        try:
            print('ANSWER', asyncio.run(workflow('hello'))['output'])
        finally:
            DBOS.destroy()
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    refused = [line for line in result.stdout.splitlines() if line.startswith('REFUSED')]
    assert len(refused) == 3 and 'ACCEPTED' not in result.stdout, result.stdout
    for line in refused:
        assert "['DC011']" in line and all(m in line for m in BOTH_MODULES), line
    assert 'ANSWER answer from module A' in result.stdout


@pytest.mark.slow
def test_temporal_one_worker_with_two_modules_named_alike_dc011(temporal_address: str) -> None:
    result = python(f"""
        import asyncio, os, sys, uuid
        from durable_capabilities.engines import temporal
        from durable_capabilities.validation import DurableConfigError
        from tests.fixtures.same_name_a import support as a
        from tests.fixtures.same_name_b import support as b

        async def main():
            client = await temporal.connect({temporal_address!r})
            try:
                temporal.make_worker(client, [a, b], 'dc011-queue')
            except DurableConfigError as exc:
                print('REFUSED', exc.report.codes(), exc.report.problems[0].message)
            else:
                print('ACCEPTED')
            queue = f'dc011-{{uuid.uuid4().hex[:8]}}'
            async with temporal.make_worker(client, [a, a], queue):  # one object twice: fine
                output = await temporal.run(client, a, 'hello', task_queue=queue, workflow_id=queue)
            print('ANSWER', output.output, flush=True)

        asyncio.run(main())
        sys.stdout.flush()
        os._exit(0)  # temporalio's runtime can abort at interpreter exit (sdk-python#300)
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith(('REFUSED', 'ACCEPTED')))
    assert line.startswith('REFUSED') and "['DC011']" in line and all(m in line for m in BOTH_MODULES), line
    assert 'ANSWER answer from module A' in result.stdout, result.stdout + result.stderr
    # The worker command refuses the pair before connecting (validated together).
    refused = durcap('worker', 'temporal', 'tests/fixtures/same_name_pair.py', '--address', temporal_address)
    assert refused.returncode == 1 and 'DC011' in refused.stdout and 'worker not started' in refused.stderr
    assert 'same_name_a at tests/fixtures/same_name_a.py:11' in refused.stdout
    assert 'same_name_b at tests/fixtures/same_name_b.py:11' in refused.stdout


@pytest.mark.slow
def test_prefect_flows_of_two_modules_named_alike_dc011(prefect_api_url: str) -> None:
    result = python("""
        import asyncio
        from durable_capabilities.engines import prefect as engine
        from durable_capabilities.validation import DurableConfigError
        from tests.fixtures.same_name_a import support as a
        from tests.fixtures.same_name_b import support as b

        flow = engine.agent_flow(a)
        assert engine.agent_flow(a) is flow  # the same object again: fine
        try:
            engine.agent_flow(b)
        except DurableConfigError as exc:
            print('REFUSED', exc.report.codes(), exc.report.problems[0].message)
        else:
            print('ACCEPTED')
        print('ANSWER', asyncio.run(flow('hello'))['output'])
    """, env={'PREFECT_API_URL': prefect_api_url})
    assert result.returncode == 0, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith(('REFUSED', 'ACCEPTED')))
    assert line.startswith('REFUSED') and "['DC011']" in line and all(m in line for m in BOTH_MODULES), line
    assert 'ANSWER answer from module A' in result.stdout


# ---- one rule for durable.lock ---------------------------------------------------------------------------------


def _copy_rename_fixture(folder: Path) -> Path:
    package = folder / 'pkg'
    package.mkdir()
    (package / '__init__.py').write_text('')
    (package / 'agents.py').write_text(
        'import os\n'
        'from pydantic_ai.capabilities import Capability\n'
        'from pydantic_ai.models.test import TestModel\n'
        'from durable_capabilities import DurableAgent\n'
        "cap_id = os.environ.get('LOCK_TEST_CAP', 'orders')\n"
        "agent = DurableAgent('lock-rule', TestModel(call_tools=[]), capabilities=[Capability(id=cap_id, instructions='x', defer_loading=True)])\n"
    )
    return package / 'agents.py'


@pytest.mark.slow
def test_lock_lives_beside_the_target_module_for_lock_check_and_run(tmp_path: Path) -> None:
    project, elsewhere = tmp_path / 'project', tmp_path / 'elsewhere'
    project.mkdir()
    elsewhere.mkdir()
    module = _copy_rename_fixture(project)
    env = {'PYTHONPATH': str(project)}  # before this checkout's entries (tests/_helpers.py)
    # A dotted target, run from another folder: the lock goes beside pkg/agents.py, not into the current folder.
    made = durcap('lock', 'pkg.agents:agent', cwd=elsewhere, env=env)
    assert made.returncode == 0, made.stderr
    assert (module.parent / 'durable.lock').is_file() and not (elsewhere / 'durable.lock').exists()
    # check (a path target this time) and run read that same lock: a rename is drift.
    drifted = {**env, 'LOCK_TEST_CAP': 'orders-v2'}
    checked = durcap('check', str(module) + ':agent', cwd=elsewhere, env=drifted)
    assert checked.returncode == 1 and 'DC020' in checked.stdout, checked.stdout
    ran = durcap('run', 'pkg.agents:agent', 'hi', '--engine', 'dbos', '--db', f'sqlite:///{tmp_path}/dbos.sqlite',
                 cwd=elsewhere, env=drifted)
    assert ran.returncode == 1 and 'DC020' in ran.stdout and 'not run' in ran.stderr, ran.stdout + ran.stderr
    # Without --db, `durcap run` takes $DURCAP_DBOS_DB, as `durcap runs` does (not the SQLite default in cwd).
    ok = durcap('run', 'pkg.agents:agent', 'hi', '--engine', 'dbos', cwd=elsewhere,
                env={**env, 'DURCAP_DBOS_DB': f'sqlite:///{tmp_path}/from-env.sqlite'})
    assert ok.returncode == 0 and 'answer (dbos)' in ok.stdout, ok.stdout + ok.stderr
    assert (tmp_path / 'from-env.sqlite').is_file() and not (elsewhere / '.durcap' / 'dbos.sqlite').exists()
    # -o still overrides.
    override = elsewhere / 'custom.lock'
    assert durcap('lock', 'pkg.agents:agent', '-o', str(override), cwd=elsewhere, env=env).returncode == 0
    assert override.is_file()


# ---- the demo ships with the package -----------------------------------------------------------------------------


WHEEL = pytest.mark.xdist_group('wheel')
"""The wheel tests share one worker (`--dist loadgroup`), so the module-scoped `wheel` is built once per run."""


@pytest.fixture(scope='module')
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package's wheel, built once for this module's wheel tests (both are in `xdist_group('wheel')`)."""
    dist = tmp_path_factory.mktemp('dist')
    built = subprocess.run([sys.executable, '-m', 'build', '--wheel', '--outdir', str(dist), str(ROOT)],
                           capture_output=True, text=True, timeout=600, check=False)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return next(dist.glob('*.whl'))


def _venv_with(wheel: Path, extras: str, venv: Path) -> dict[str, str]:
    """A fresh venv (no system site-packages: a file missing from the wheel cannot hide) with `wheel[extras]`
    installed; returns the environment that runs its `durcap` (the caller's PYTHONPATH and engine settings dropped).

    Nothing in the venv needs pip: it is made `--without-pip` and this process's pip installs into it (`--python`),
    `--no-compile` (what the tests import is compiled when imported), which skips ensurepip and compiling every
    installed module (Prefect's, for a start): both wheel tests took 113 s of CPU before, 102 s after (load ~11)."""
    subprocess.run([sys.executable, '-m', 'venv', '--without-pip', str(venv)], check=True, timeout=300)
    pip = subprocess.run([sys.executable, '-m', 'pip', '--python', str(venv / 'bin' / 'python'), 'install', '--quiet',
                          '--no-compile', f'{wheel}[{extras}]'],
                         capture_output=True, text=True, timeout=900, check=False)
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    # PYTHONDONTWRITEBYTECODE dropped too (this machine and CI set it): the venv is fresh, so without bytecode every
    # `durcap` run in it compiled every module it imported again (~5 s of CPU each for Prefect, DBOS, Temporal and
    # pydantic-ai); now the first import writes it into the venv and the later runs read it
    env = {k: v for k, v in os.environ.items()
           if k not in ('PYTHONPATH', 'VIRTUAL_ENV', 'DURCAP_TEMPORAL_ADDRESS', 'DURCAP_STORE', 'DURCAP_DBOS_DB',
                        'PYTHONDONTWRITEBYTECODE')}
    env['PATH'] = f'{venv / "bin"}{os.pathsep}{env.get("PATH", "")}'
    return env


@pytest.mark.slow
@WHEEL
def test_wheel_with_only_the_dbos_extra_runs_the_demo_and_names_the_missing_extra(tmp_path: Path, wheel: Path) -> None:
    """Issue 23, item 6: `pip install '<wheel>[dbos]'` then `durcap demo` in an empty folder exits 0 (it was exit 1,
    DC017 "engine 'temporal' is listed but its packages are not installed"); `--engine temporal` exits 2 naming the
    extra to install, without a traceback."""
    venv = tmp_path / 'venv'
    env = _venv_with(wheel, 'dbos', venv)
    probe = subprocess.run([str(venv / 'bin' / 'python'), '-c', 'import importlib.util as u; print(u.find_spec("temporalio"), u.find_spec("prefect"))'],
                           env=env, capture_output=True, text=True, timeout=120, check=False)
    assert probe.stdout.strip() == 'None None', probe.stdout + probe.stderr  # really without the other engines
    durcap_bin = shutil.which('durcap', path=str(venv / 'bin'))
    assert durcap_bin is not None
    empty = tmp_path / 'empty'
    empty.mkdir()
    demo = subprocess.run([durcap_bin, 'demo'], cwd=empty, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert 'answer (dbos):' in demo.stdout and 'ABC-123' in demo.stdout, demo.stdout
    temporal = subprocess.run([durcap_bin, 'demo', '--engine', 'temporal'], cwd=empty, env=env, capture_output=True,
                              text=True, timeout=300, check=False)
    assert temporal.returncode == 2, temporal.stdout + temporal.stderr
    assert "pip install 'durable-capabilities[temporal]'" in temporal.stderr, temporal.stderr
    assert 'Traceback' not in temporal.stdout + temporal.stderr
    assert not (empty / 'durable.lock').exists()


@pytest.mark.slow
@WHEEL
def test_wheel_ships_the_demo_and_durcap_demo_runs_from_an_installed_wheel(
    tmp_path: Path, wheel: Path, temporal_address: str, prefect_api_url: str
) -> None:
    """Build the wheel, install it with every engine's extra into a fresh venv (no system site-packages: a file
    missing from the wheel cannot hide), and run `durcap demo` on every engine from an empty folder outside the
    checkout. Temporal: the test dev server, with the demo's inline worker; Prefect: the test server."""
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for shipped in ('agent.py', 'scripted.py', 'durable.lock', '__init__.py', 'skills/returns.md'):
        assert f'durable_capabilities/_examples/support/{shipped}' in names, names
    assert 'durable_capabilities/_examples/__init__.py' in names
    for template in ('base.html', 'runs.html', 'run.html', 'approvals.html'):  # `durcap ui`'s pages
        assert f'durable_capabilities/ui/templates/{template}' in names, names
    stray = [n for n in names if n.endswith(('.pyc', '.pyo', '.sqlite', '.db')) or '__pycache__' in n or '.durcap' in n]
    assert stray == []
    assert not [n for n in names if n.startswith(('tests/', 'examples/', 'docs/', 'bench/'))]
    venv = tmp_path / 'venv'
    env = _venv_with(wheel, 'temporal,dbos,prefect', venv)
    empty = tmp_path / 'empty'
    empty.mkdir()
    where = subprocess.run([str(venv / 'bin' / 'python'), '-c', 'import durable_capabilities; print(durable_capabilities.__file__)'],
                           cwd=empty, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert where.stdout.startswith(str(venv)), where.stdout + where.stderr
    durcap_bin = shutil.which('durcap', path=str(venv / 'bin'))
    assert durcap_bin is not None
    for engine, extra in (('dbos', []), ('temporal', ['--address', temporal_address, '--task-queue', f'wheel-{os.getpid()}']),
                          ('prefect', [])):
        demo = subprocess.run([durcap_bin, 'demo', '--engine', engine, *extra], cwd=empty,
                              env={**env, 'PREFECT_API_URL': prefect_api_url}, capture_output=True, text=True, timeout=600, check=False)
        assert demo.returncode == 0, f'{engine}: ' + demo.stdout[-3000:] + demo.stderr[-3000:]
        assert f'answer ({engine}):' in demo.stdout and 'ABC-123' in demo.stdout, demo.stdout
    assert not (empty / 'durable.lock').exists()  # the lock is read beside the shipped example, never written here
