"""`durcap check` and `durcap savings`, run as real subprocesses against fixtures in tests/fixtures/."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests._helpers import ROOT, durcap, durcap_here, subprocess_env

FIXTURES = 'tests/fixtures'
GOOD = f'{FIXTURES}/good_agent.py'
BAD = f'{FIXTURES}/bad_agent.py:bad'
COUNTING = f'{FIXTURES}/counting_agent.py'

# The five mistakes built into bad_agent.py, plus what they imply (DC015: the id-less capability's
# toolset; DC004: the two 'orders' capabilities' toolsets share an id).
BAD_CODES = {'DC001', 'DC002', 'DC003', 'DC008', 'DC009'}


# ---- check ------------------------------------------------------------------------------------


def test_clean_target_exits_0() -> None:
    result = durcap('check', f'{GOOD}:good')
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'no problems found' in result.stdout
    assert result.stderr == ''


def test_installed_script_and_module_target() -> None:
    """The `durcap` console script, with a dotted module target importable from the working directory."""
    script = Path(sys.executable).with_name('durcap')
    result = subprocess.run(
        [str(script), 'check', 'good_agent:agents'], cwd=ROOT / FIXTURES, capture_output=True, text=True, timeout=120,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "'good', 'second'" in result.stdout


def test_bad_fixture_prints_every_problem_and_exits_1() -> None:
    result = durcap('check', BAD)
    assert result.returncode == 1
    lines = [line for line in result.stdout.splitlines() if line.startswith('error')]
    assert {line.split()[1] for line in lines} == BAD_CODES
    assert len(lines) == 5  # one problem per mistake
    for line in lines:
        assert 'Fix:' in line
    assert "'refund policy'" in result.stdout and "'refund-runbook'" in result.stdout
    assert '5 error(s)' in result.stdout
    assert 'Traceback' not in result.stderr


def test_bad_fixture_json_lists_every_code() -> None:
    result = durcap('check', BAD, '--format', 'json')
    assert result.returncode == 1
    payload = json.loads(result.stdout)
    assert payload['ok'] is False
    assert payload['errors'] == 5
    assert {p['code'] for p in payload['problems']} == BAD_CODES
    for problem in payload['problems']:
        assert set(problem) >= {'code', 'severity', 'where', 'message', 'fix', 'engines'}


def test_bad_fixture_github_annotations() -> None:
    result = durcap('check', BAD, '--format', 'github')
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 5
    assert all(line.startswith('::error title=DC') for line in lines)
    assert {line.split('title=')[1].split('::')[0] for line in lines} == BAD_CODES


def test_clean_target_json_and_github() -> None:
    result = durcap('check', f'{GOOD}:good', '--format', 'json')
    assert result.returncode == 0
    assert json.loads(result.stdout)['problems'] == []
    result = durcap('check', f'{GOOD}:good', '--format', 'github')
    assert result.returncode == 0
    assert '::error' not in result.stdout


def test_list_target_reports_duplicate_agent_names() -> None:
    result = durcap('check', f'{GOOD}:same_name', '--format', 'json')
    assert result.returncode == 1
    assert [p['code'] for p in json.loads(result.stdout)['problems']] == ['DC011']
    assert durcap('check', f'{GOOD}:agents').returncode == 0


def test_engine_filter_keeps_engine_neutral_problems(tmp_path: Path) -> None:
    """Problems scoped to other engines are dropped; problems with no engines (DC011) always stay."""
    (tmp_path / 'scoped.py').write_text(
        'from pydantic_ai.capabilities import Capability\n'
        'from pydantic_ai.models.test import TestModel\n'
        'from pydantic_ai.toolsets import FunctionToolset\n'
        'from durable_capabilities import DurableAgent\n'
        '# two anonymous toolsets: positional leaf ids, warning DC013 (tagged with the agent engines)\n'
        "cap = Capability(id='x', toolsets=[FunctionToolset(), FunctionToolset()])\n"
        "a = DurableAgent('a', TestModel(), engines=['temporal'], capabilities=[cap])\n"
        "b = DurableAgent('a', TestModel(), engines=['temporal'])\n"
        'both = [a, b]\n'
    )
    target = f'{tmp_path}/scoped.py:both'
    unfiltered = json.loads(durcap('check', target, '--format', 'json').stdout)['problems']
    assert {p['code'] for p in unfiltered} == {'DC013', 'DC011'}
    assert all(p['engines'] == ['temporal'] for p in unfiltered if p['code'] == 'DC013')
    result = durcap('check', target, '--engine', 'dbos', '--format', 'json')
    assert result.returncode == 1, result.stdout + result.stderr
    assert [p['code'] for p in json.loads(result.stdout)['problems']] == ['DC011']
    both = json.loads(durcap('check', target, '-e', 'dbos', '-e', 'temporal', '--format', 'json').stdout)
    assert {p['code'] for p in both['problems']} == {'DC013', 'DC011'}
    # The bad fixture's problems are tagged with all three engines: a filter on one keeps them all.
    result = durcap('check', BAD, '--engine', 'prefect', '--format', 'json')
    assert json.loads(result.stdout)['errors'] == 5
    assert durcap('check', BAD, '--engine', 'nonsense').returncode == 2


@pytest.mark.parametrize(
    ('target', 'expected'),
    [
        ('no_such_package.agents:support', 'no module named'),
        (f'{GOOD}:missing', "no attribute 'missing'"),
        (f'{GOOD}:not_an_agent', 'not a DurableAgent'),
        (f'{GOOD}:no_agents', 'empty list'),
        # A TARGET without `:attr` is now a whole module (tests/engines/test_targets.py); an empty attr is malformed.
        (f'{GOOD}:', 'must be `pkg.module:attr`'),
        (':support', 'must be `pkg.module:attr`'),
        ('tests/fixtures/no_such_file.py', 'no such file'),
        ('tests/fixtures/no_such_file.py:agent', 'no such file'),
    ],
)
def test_unusable_targets_exit_2_with_one_line(target: str, expected: str) -> None:
    result = durcap('check', target)
    assert result.returncode == 2
    assert result.stdout == ''
    assert 'Traceback' not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert expected in result.stderr


@pytest.mark.parametrize(
    ('source', 'expected'),
    [
        ('agent = (\n', 'syntax error in'),
        ('import not_installed_dependency_xyz\n', "No module named 'not_installed_dependency_xyz'"),
        ('raise RuntimeError("boom\\nmore")\n', 'raised RuntimeError: boom'),
    ],
)
def test_modules_that_do_not_import_exit_2(tmp_path: Path, source: str, expected: str) -> None:
    (tmp_path / 'target_module.py').write_text(source)
    for command in ('check', 'savings'):
        result = durcap(command, f'{tmp_path}/target_module.py:agent')
        assert result.returncode == 2
        assert 'Traceback' not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert expected in result.stderr


def test_file_inside_a_package_is_imported_under_its_package_name(tmp_path: Path) -> None:
    """`pkg/sub/agent.py` with `__init__.py` files is imported as `pkg.sub.agent`, so relative imports work."""
    sub = tmp_path / 'pkg' / 'sub'
    sub.mkdir(parents=True)
    (tmp_path / 'pkg' / '__init__.py').write_text('')
    (sub / '__init__.py').write_text('')
    (sub / 'models.py').write_text('from pydantic_ai.models.test import TestModel\nMODEL = TestModel()\n')
    (sub / 'agent.py').write_text(
        'from durable_capabilities import DurableAgent\nfrom .models import MODEL\nsupport = DurableAgent("pkg-agent", MODEL)\n'
    )
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    result = durcap('check', str(sub / 'agent.py') + ':support', cwd=elsewhere)
    assert result.returncode == 0, result.stderr
    assert "'pkg-agent'" in result.stdout


def test_support_example() -> None:
    result = durcap('check', 'examples/support/agent.py:support')
    assert result.returncode == 0, result.stdout + result.stderr


# ---- savings ----------------------------------------------------------------------------------


def test_savings_text_rows_totals_and_estimated_label() -> None:
    result = durcap('savings', f'{GOOD}:good')
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert '(tokens, estimated)' in out
    assert 'ceil(UTF-8 bytes / 4)' in out
    rows = {line.split('│')[1].strip(): line for line in out.splitlines() if line.startswith('│')}
    assert list(rows) == ['orders', 'refunds', 'refund-policy', 'search', 'TOTAL']  # 'greeting' is always on
    assert 'unknown (dynamic)' in out
    assert 'dynamic instructions (refund_rules)' in out


def test_savings_json_estimate_matches_documented_formula() -> None:
    result = durcap('savings', f'{GOOD}:good', '--format', 'json')
    assert result.returncode == 0, result.stderr
    [agent] = json.loads(result.stdout)['agents']
    assert agent['estimated'] is True and agent['unit'] == 'tokens'
    assert agent['complete'] is False
    rows = {row['id']: row for row in agent['capabilities']}
    policy = rows['refund-policy']
    text = 'Refunds are allowed within 30 days of delivery, to the original payment method only.'
    assert policy['instruction_tokens'] == -(-len(text.encode()) // 4)
    assert policy['catalog_entry'] == '- refund-policy: The refund policy: read before any refund.'
    assert policy['tool_count'] == 0 and policy['tool_schema_tokens'] == 0
    assert rows['orders']['tool_count'] == 2 and rows['orders']['tool_schema_tokens'] > 0
    assert rows['search']['tool_schema_tokens'] is None and rows['search']['tools'] == 'unknown (dynamic)'
    totals = agent['totals']
    for key in ('instruction_tokens', 'catalog_tokens', 'saved_tokens', 'always_on_tokens'):
        assert totals[key] == sum(row[key] for row in agent['capabilities'])
    assert totals['saved_tokens'] == totals['always_on_tokens'] - totals['catalog_tokens']


def test_demo_and_savings_print_one_saving_per_request(tmp_path: Path) -> None:
    """Issue 14 item 6: `durcap demo` (local engine, scripted FunctionModel) and `durcap savings` count the
    support example's first request the same way and print the same saving; the table's total differs from
    it by the fixed cost of deferring, which both the text and the JSON state."""
    import re

    demo = durcap('demo', '--engine', 'local', env={'DURCAP_STORE': f'sqlite:///{tmp_path}/c.db'})
    assert demo.returncode == 0, demo.stderr
    [(deferred, always, saved)] = re.findall(
        r'(\d+) with deferred capabilities vs (\d+) with every capability always on \(\S+\): deferral saves (\d+) tokens',
        demo.stdout)
    assert int(always) - int(deferred) == int(saved) > 0
    report = durcap('savings', 'examples/support/agent.py:support', '--format', 'json')
    assert report.returncode == 0, report.stderr
    [agent] = json.loads(report.stdout)['agents']
    assert agent['first_request']['saved_tokens'] == int(saved)
    assert agent['fixed_cost_tokens'] == agent['totals']['saved_tokens'] - int(saved) > 0
    text = durcap('savings', 'examples/support/agent.py:support').stdout
    assert f'deferral saves {saved} tokens' in ' '.join(text.split())


def test_savings_uses_the_models_own_counter() -> None:
    result = durcap('savings', f'{COUNTING}:counted', '--format', 'json')
    assert result.returncode == 0, result.stderr
    [agent] = json.loads(result.stdout)['agents']
    assert agent['estimated'] is False
    assert agent['method'] == 'WordCountModel.count_tokens'
    [notes] = agent['capabilities']
    assert notes['instruction_tokens'] == 7  # 'Write one short note per customer request.'
    assert notes['catalog_tokens'] == 6  # '- notes: Take and read notes.'
    text = durcap('savings', f'{COUNTING}:counted').stdout
    assert 'estimated' not in text and 'counted by the model' in text
    forced = json.loads(durcap('savings', f'{COUNTING}:counted', '--estimate', '--format', 'json').stdout)
    assert forced['agents'][0]['estimated'] is True


def test_savings_falls_back_without_credentials() -> None:
    result = durcap('savings', f'{COUNTING}:unreachable', '--format', 'json',
                    unset=[k for k in os.environ if k.endswith('_API_KEY')])
    assert result.returncode == 0, result.stderr
    [agent] = json.loads(result.stdout)['agents']
    assert agent['estimated'] is True
    assert "openai-responses:gpt-5.4" in agent['fallback_reason']


def test_savings_on_a_broken_definition_exits_1() -> None:
    result = durcap('savings', BAD)
    assert result.returncode == 1
    assert 'durcap check' in result.stderr and 'Traceback' not in result.stderr


def test_catalog_entries_match_what_pydantic_ai_sends() -> None:
    """Each `catalog_entry` is a line of the catalog upstream really puts in the instructions."""
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    sys.path.insert(0, str(ROOT / FIXTURES))
    try:
        import good_agent
    finally:
        sys.path.remove(str(ROOT / FIXTURES))
    from durable_capabilities import DurableAgent
    from durable_capabilities.savings import measure_savings

    seen: list[str] = []

    def capture(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        seen.append(info.instructions or '')
        return ModelResponse(parts=[TextPart('ok')])

    agent = DurableAgent(
        'catalog', FunctionModel(capture), capabilities=[good_agent.orders, good_agent.refunds, good_agent.refund_policy]
    )
    agent.build('local').run_sync('hello')
    sent_lines = seen[0].splitlines()
    report = measure_savings(agent, use_model=False)
    assert [c.id for c in report.capabilities] == ['orders', 'refunds', 'refund-policy']
    for row in report.capabilities:
        assert row.catalog_entry in sent_lines


# ---- unusable input on the run and approval commands (found by the fresh-user trial) ----------


@pytest.mark.parametrize('deps_json', ['{', '[1]', '{"orders": 5}'])
def test_run_with_bad_deps_json_is_unusable_input(deps_json: str, tmp_path: Path) -> None:
    result = durcap('run', str(ROOT / 'examples/support/agent.py') + ':support', 'hi', '--deps-json', deps_json,
                    cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert '--deps-json does not match Store' in result.stderr
    assert 'the run failed' not in result.stderr and 'Traceback' not in result.stderr


@pytest.mark.parametrize(('command', 'model', 'said'), [
    (('demo',), 'nonsense', 'Unknown model: nonsense'),
    (('run', str(ROOT / 'examples/support/agent.py') + ':support', 'hi', '--deps-json', '{"orders": {}}'),
     'openai:gpt-4o', 'OPENAI_API_KEY'),
])
def test_an_unusable_model_is_refused_before_the_run_starts(command: tuple[str, ...], model: str, said: str,
                                                            tmp_path: Path) -> None:
    """`--model` with a name pydantic-ai does not know, or a provider without its key (no --base-url): DC040, exit 2,
    one line, and no DBOS workflow started (before, the run was recorded and failed at its first model request,
    exit 1). Real `durcap` subprocesses on DBOS/SQLite in a temporary folder; no model request is made."""
    result = durcap(*command, '--engine', 'dbos', '--model', model, cwd=tmp_path,
                    unset=['OPENAI_API_KEY', 'OPENAI_BASE_URL', 'DURCAP_DBOS_DB', 'DURCAP_STORE'])
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"DC040 --model {model!r} is not usable here" in result.stderr and said in result.stderr, result.stderr
    assert 'workflow id' not in result.stderr and 'Traceback' not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(('args', 'said'), [
    (('--model', 'openai:gpt-4o', '--base-url', 'notaurl'), "DC040 --base-url must be an http:// or https:// URL, not 'notaurl'"),
    (('--base-url', 'http://127.0.0.1:9/v1'), 'DC040 --base-url needs --model naming an OpenAI or Anthropic model'),
])
def test_a_bad_base_url_is_dc040(args: tuple[str, ...], said: str) -> None:
    """`durcap demo --base-url` that is not http(s), or without an OpenAI/Anthropic --model: one line with DC040, exit 2
    (it had no code). In this process (typer's runner): the check runs before the example is loaded."""
    # The demo sets $SUPPORT_MODEL (and a good --base-url its variable) for its run: restored after the call.
    result = durcap_here('demo', '--engine', 'local', *args,
                         env={'SUPPORT_MODEL': None, 'OPENAI_BASE_URL': None, 'ANTHROPIC_BASE_URL': None})
    assert result.exit_code == 2, result.stdout + result.stderr
    assert said in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_a_bad_stream_setting_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    """`$DURCAP_STREAM_RETENTION=xyz` (or any run-stream setting not a positive number): DC040 naming the variable and
    its default, exit 2, no DBOS workflow started (before, the workflow started and the run failed at its first
    event with exit 1 and a ValueError). A real `durcap run` subprocess on DBOS/SQLite in a temporary folder."""
    result = durcap('run', str(ROOT / 'examples/support/agent.py') + ':support', 'hi', '--deps-json', '{"orders": {}}',
                    '--engine', 'dbos', cwd=tmp_path, env={'DURCAP_STREAM_RETENTION': 'xyz'},
                    unset=['DURCAP_DBOS_DB', 'DURCAP_STORE'])
    assert result.returncode == 2, result.stdout + result.stderr
    assert "DC040 $DURCAP_STREAM_RETENTION: must be a positive number, got 'xyz'" in result.stderr, result.stderr
    assert '(default 604800)' in result.stderr and 'workflow id' not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize('prepare', ['absent', 'not-dbos'])
def test_a_run_handed_to_a_queue_of_a_dbos_database_no_worker_ever_used_is_refused(tmp_path: Path, prepare: str) -> None:
    """`durcap run --engine dbos --queue Q --db URL` where no DBOS worker has ever run (a SQLite file that does not
    exist, or one without DBOS's tables): DC040 naming `--db` and the worker command that creates it, exit 2, one line
    (it printed SQLite's `no such table: main.workflow_status` as a failed run, exit 1; found by h/leftovers).
    A real `durcap run` subprocess in a temporary folder; nothing runs (no model)."""
    import sqlite3

    db = tmp_path / 'system.db'
    if prepare == 'not-dbos':
        with sqlite3.connect(db) as conn:
            conn.execute('create table other (a)')
    result = durcap('run', str(ROOT / 'examples/support/agent.py') + ':support', 'hi', '--deps-json', '{"orders": {}}',
                    '--engine', 'dbos', '--queue', 'q1', '--db', f'sqlite:///{db}', cwd=tmp_path,
                    unset=['DURCAP_DBOS_DB', 'DURCAP_STORE'])
    assert result.returncode == 2, result.stdout + result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith('durcap: error:')]
    assert len(error) == 1 and 'DC040 --db: no DBOS worker has ever run on' in error[0], result.stderr
    assert '`durcap worker dbos TARGET --db URL --queue q1`' in error[0]
    assert 'Traceback' not in result.stderr and 'workflow_status' not in result.stderr
    assert db.exists() == (prepare == 'not-dbos')  # the check creates no file (it left an empty one)
    default = durcap('run', str(ROOT / 'examples/support/agent.py') + ':support', 'hi', '--deps-json', '{"orders": {}}',
                     '--engine', 'dbos', '--queue', 'q1', cwd=tmp_path, unset=['DURCAP_DBOS_DB', 'DURCAP_STORE'])
    assert default.returncode == 2 and 'no DBOS worker has ever run on' in default.stderr, default.stderr
    assert not (tmp_path / '.durcap' / 'dbos.sqlite').exists()


@pytest.mark.parametrize('command', [['approvals', 'list'], ['approve', 'run-x', 'call-y'], ['deny', 'run-x', 'call-y',
                                                                                                '--reason', 'no']])
def test_approval_commands_without_a_temporal_server_say_so_in_one_line(command: list[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    result = durcap(*command, '--engine', 'temporal', '--address', f'127.0.0.1:{port}')
    assert result.returncode == 2, result.stdout + result.stderr
    assert 'cannot reach temporal' in result.stderr
    assert 'Traceback' not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_ui_on_a_taken_port_is_unusable_input(tmp_path: Path) -> None:
    """`durcap ui --port N` while another socket holds N: one line naming the port, exit 2, nothing served."""
    import socket

    with socket.create_server(('127.0.0.1', 0)) as held:
        port = held.getsockname()[1]
        result = durcap('ui', '--port', str(port), '--engine', 'dbos', cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert f'DC040 cannot serve on 127.0.0.1:{port}' in result.stderr and 'Traceback' not in result.stderr


@pytest.mark.parametrize('command', [['serve', 'examples.support.agent:support'], ['wire']])
def test_serve_and_wire_on_a_taken_port_are_one_coded_line(command: list[str], tmp_path: Path) -> None:
    """`durcap serve --port N` / `durcap wire --port N` while another socket holds N: one DC040 line naming the port,
    exit 2 (a fresh-user trial found serve's line, and its other unusable-input lines, without a code)."""
    import socket

    with socket.create_server(('127.0.0.1', 0)) as held:
        port = held.getsockname()[1]
        result = durcap(*command, '--port', str(port), env={'DURCAP_SERVE_TOKEN': 't0ken'})
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stderr.strip().splitlines() if line.startswith('durcap: error: ')]
    assert line.startswith(f'durcap: error: DC040 cannot serve on 127.0.0.1:{port}: Address already in use'), line
    assert 'Traceback' not in result.stderr


def test_store_and_dbos_db_from_the_environment_are_checked_like_the_options(tmp_path: Path) -> None:
    """`$DURCAP_STORE=sqlite://` (an in-memory store: the turn would be gone at exit) is refused as `--store
    sqlite://` is, with DC040 and exit 2, before anything runs; so is a malformed `$DURCAP_DBOS_DB` for `runs`."""
    memory = durcap('run', 'examples/support/agent.py:support', 'hi', '--engine', 'local', cwd=ROOT,
                    env={'DURCAP_STORE': 'sqlite://'}, unset=['DURCAP_DBOS_DB'])
    assert memory.returncode == 2, memory.stdout + memory.stderr
    assert 'DC040 $DURCAP_STORE (the default of --store)' in memory.stderr and 'in-memory' in memory.stderr
    assert 'Traceback' not in memory.stderr and memory.stdout == ''
    bad_db = durcap('runs', 'list', '--engine', 'dbos', env={'DURCAP_DBOS_DB': 'mysql://u@h/db'}, unset=['DURCAP_STORE'])
    assert bad_db.returncode == 2 and 'DC040 $DURCAP_DBOS_DB' in bad_db.stderr, bad_db.stderr


def test_history_repair_reads_its_address_through_the_temporal_setting(tmp_path: Path) -> None:
    """`durcap history repair --address` is the Temporal spec's address setting, as in the other commands: a
    malformed flag, or a malformed `$TEMPORAL_ADDRESS` (the setting's second variable, which a direct read of
    `$DURCAP_TEMPORAL_ADDRESS` missed), exits 2 with DC040 before anything connects."""
    env = {k: v for k, v in os.environ.items() if k not in ('DURCAP_TEMPORAL_ADDRESS', 'TEMPORAL_ADDRESS')}
    store = f'sqlite:///{tmp_path / "c.db"}'
    flag = durcap('history', 'repair', 'wf-1', '--store', store, '--address', 'nohost', env=env)
    assert flag.returncode == 2 and 'DC040 --address' in flag.stderr, flag.stdout + flag.stderr
    from_env = durcap('history', 'repair', 'wf-1', '--store', store, env={**env, 'TEMPORAL_ADDRESS': 'not-an-address'})
    assert from_env.returncode == 2 and 'DC040 $TEMPORAL_ADDRESS' in from_env.stderr, from_env.stdout + from_env.stderr
    assert 'Traceback' not in flag.stderr + from_env.stderr


def test_a_two_slash_sqlite_url_is_refused_with_the_url_meant() -> None:
    """`--db sqlite://relative.db` names a host, so SQLAlchemy would open an in-memory database: refused (DC040, exit
    2) with the three-slash URL the user meant and the DBOS file as the example (not the conversation store's)."""
    result = durcap('runs', 'list', '--engine', 'dbos', '--db', 'sqlite://relative.db')
    assert result.returncode == 2, result.stdout + result.stderr
    assert 'did you mean sqlite:///relative.db?' in result.stderr and 'e.g. sqlite:///.durcap/dbos.sqlite' in result.stderr


@pytest.mark.parametrize('command', [('runs', 'list', '--engine', 'temporal'),
                                     ('run', 'tests/engines/ledger_agent.py:agent', 'x', '--engine', 'temporal'),
                                     ('serve', 'tests/engines/ledger_agent.py:agent', '--engine', 'temporal')])
def test_an_unreachable_temporal_server_is_one_line_and_exit_2(command: tuple[str, ...]) -> None:
    """Nothing listens on the address (a port this test holds closed): one line naming the address, the reason
    and the fix, exit 2, instead of temporalio's Rust transport error (exit 1 for `run` before; `serve` started
    and answered 202 to turns no engine could start)."""
    with socket.socket() as held:  # bound, never listening: connections to it are refused
        held.bind(('127.0.0.1', 0))
        address = f'127.0.0.1:{held.getsockname()[1]}'
        result = durcap(*command, '--address', address, env={'DURCAP_SERVE_TOKEN': 't'})
    assert result.returncode == 2, result.stdout + result.stderr
    assert f'cannot reach the Temporal server at {address} (Connection refused)' in result.stderr, result.stderr
    if command[0] == 'serve':  # one line, and no token printed: it refused before starting
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert 'tonic' not in result.stderr and 'Traceback' not in result.stderr


@pytest.mark.parametrize('command', [('runs', 'list', '--engine', 'temporal'),
                                     ('run', 'tests/engines/ledger_agent.py:agent', 'x', '--engine', 'temporal'),
                                     ('worker', 'temporal', 'tests/engines/ledger_agent.py:agent'),
                                     ('serve', 'tests/engines/ledger_agent.py:agent', '--engine', 'temporal')])
def test_an_address_that_accepts_and_never_answers_times_out_saying_what_it_waits_for(command: tuple[str, ...]) -> None:
    """Something listens on the address but never answers (this test's socket: the kernel completes the handshake,
    nobody reads): the command gives up after `$DURCAP_TEMPORAL_CONNECT_TIMEOUT` (1 s here; 10 s by default) with one
    line saying nothing answers Temporal's gRPC there and how to wait longer, exit 2. Before, temporalio retried for
    ~33 s in silence (issue 29 item 6). A real socket and real `durcap` subprocesses; no model runs."""
    with socket.socket() as listening:
        listening.bind(('127.0.0.1', 0))
        listening.listen(16)
        address = f'127.0.0.1:{listening.getsockname()[1]}'
        result = durcap(*command, '--address', address, env={'DURCAP_TEMPORAL_CONNECT_TIMEOUT': '1',
                                                             'DURCAP_SERVE_TOKEN': 't'})
    assert result.returncode == 2, result.stdout + result.stderr
    assert f'no answer from a Temporal server at {address} within 1 s' in result.stderr, result.stderr
    assert '$DURCAP_TEMPORAL_CONNECT_TIMEOUT' in result.stderr and 'Traceback' not in result.stderr


def test_a_bad_connect_timeout_is_dc040_naming_the_variable() -> None:
    """`$DURCAP_TEMPORAL_CONNECT_TIMEOUT` that is not a number of seconds above 0: DC040 naming it, exit 2, before
    anything connects (a real `durcap` subprocess; the address is never dialled)."""
    for value in ('soon', '0', '-1', 'inf'):
        result = durcap('runs', 'list', '--engine', 'temporal', '--address', '127.0.0.1:1',
                        env={'DURCAP_TEMPORAL_CONNECT_TIMEOUT': value})
        assert result.returncode == 2, (value, result.stdout + result.stderr)
        [line] = result.stderr.strip().splitlines()  # led by its one code, the variable named
        assert line.startswith('durcap: error: DC040 ') and ': $DURCAP_TEMPORAL_CONNECT_TIMEOUT: ' in line, (value, line)
        assert line.count('DC0') == 1 and 'Traceback' not in result.stderr, (value, line)


@pytest.mark.parametrize('args', [
    ('ui', '--port', '99999', '--engine', 'dbos'), ('ui', '--port', '0'), ('ui', '--limit', '0'),
    ('runs', 'list', '--engine', 'dbos', '--limit', '-1'), ('wire', '--port', '70000'),
    ('dev', 'temporal', '--port', '-5'),
])
def test_ports_and_limits_out_of_range_are_refused(args: tuple[str, ...]) -> None:
    """A port outside 1-65535 or a limit below 1: typer's one-line usage error, exit 2, nothing started (in this
    process: an argument check; the same error in a real process is in tests/unit/test_bad_inputs.py)."""
    result = durcap_here(*args)
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert 'Traceback' not in result.stderr and 'Invalid value for' in result.stderr, result.stderr


@pytest.mark.parametrize('address', ['nohost:99999', 'http://127.0.0.1:7233', '127.0.0.1', ':7233', 'h:0'])
@pytest.mark.parametrize('command', [('runs', 'list', '--engine', 'temporal'), ('approvals', 'list', '--engine', 'temporal'),
                                     ('run', 'tests/engines/ledger_agent.py:agent', 'x', '--engine', 'temporal')])
def test_a_malformed_temporal_address_is_bad_input(command: tuple[str, ...], address: str) -> None:
    """`--address` (and `$DURCAP_TEMPORAL_ADDRESS`) must be HOST:PORT with a port in 1-65535: DC040, exit 2, before
    anything connects (temporalio would fail later with a raw transport error, or only warn about a scheme). In this
    process (an argument check, nothing connects); `test_an_unreachable_temporal_server_is_one_line_and_exit_2` runs
    the same commands as real processes."""
    flag = durcap_here(*command, '--address', address, env={'DURCAP_TEMPORAL_ADDRESS': None})
    assert flag.exit_code == 2 and 'DC040 --address' in flag.stderr, (flag.output, flag.exception)
    from_env = durcap_here(*command, env={'DURCAP_TEMPORAL_ADDRESS': address})
    assert from_env.exit_code == 2 and 'DC040 $DURCAP_TEMPORAL_ADDRESS' in from_env.stderr, (from_env.output, from_env.exception)


def test_reading_runs_of_a_dbos_database_where_nothing_ran_creates_nothing_and_says_one_line(tmp_path: Path) -> None:
    """`runs list` of a SQLite system database that does not exist, or holds no DBOS tables, lists no runs (exit 0)
    and creates no file at a mistyped path (a missing file gets one `note:` line saying so); `runs show|resume|cancel`
    of a run there is one line naming the database, exit 2 (before: DBOS's `no such table` error, then a second line,
    and an empty file left behind)."""
    missing, empty = tmp_path / 'typo.sqlite', tmp_path / 'empty.sqlite'
    empty.touch()
    for path in (missing, empty):
        listed = durcap('runs', 'list', '--engine', 'dbos', '--db', f'sqlite:///{path}')
        assert listed.returncode == 0, listed.stdout + listed.stderr
        said = f'note: dbos: no system database at {missing}: nothing has run there' if path == missing else ''
        assert listed.stderr.startswith(said) and listed.stderr.count('\n') == (path == missing), listed.stderr
        assert 'no such table' not in listed.stdout, listed.stdout + listed.stderr
        for command in ('show', 'resume', 'cancel'):
            found = durcap('runs', command, 'nope-1', '--engine', 'dbos', '--db', f'sqlite:///{path}')
            assert found.returncode == 2, found.stdout + found.stderr
            lines = found.stderr.strip().splitlines()
            assert len(lines) == 1 and "no DBOS workflow 'nope-1'" in lines[0], found.stderr
            if path == missing:
                assert f'no system database at {missing}' in lines[0], lines
    assert not missing.exists()


def test_runs_list_keeps_the_id_and_the_short_columns_whole_at_80_columns() -> None:
    """The run id (what `runs show` takes), the engine and the status are never cut, even at 80 columns (before: the
    id column was moved first after the others were added, and rich, padding by the place a column was added at, cut
    the engine header to `engi…` at any width)."""
    from datetime import UTC, datetime

    from rich.console import Console

    from durable_capabilities.cli import runs
    from durable_capabilities.engines import RunInfo

    info = RunInfo('temporal', 'durcap-run-9f2c4e1b7a30', 'support', 'completed', 'COMPLETED',
                   datetime(2026, 12, 1, tzinfo=UTC), ['orders', 'account-security'], 'conv-1234', 10)
    for width in (80, 160):
        console = Console(width=width, record=True, highlight=False, force_terminal=True)
        saved, runs._out = runs._out, console
        try:
            runs._print_runs([info], runs.RunsFormat.text)
        finally:
            runs._out = saved
        text = console.export_text()
        header = text.split('durcap-run')[0]
        assert 'durcap-run-9f2c4e1b7a30  temporal  support  completed' in text, text
        assert 'engine' in header and 'status' in header and 'engi…' not in header, text


def test_runs_list_piped_keeps_each_row_on_one_line() -> None:
    """Piped (`durcap runs list | grep ...`), the table is printed at its own width: each run on one line, no cell
    cut (before: at the piped console's 160 columns a long conversation id came out as `conversation-w…` and the
    start time and the executor folded onto a second line). The console is the one `durcap` makes for a pipe
    (160 columns, not a terminal), writing to a buffer."""
    import io
    from datetime import UTC, datetime

    from rich.console import Console

    from durable_capabilities.cli import runs
    from durable_capabilities.engines import RunInfo

    conversation = 'conversation-with-a-rather-long-name-for-testing-0123456789'
    infos = [RunInfo('dbos', f'input-plain-b0eca810-9947-4194-8890-2f3878cdd8d{n}', 'input-plain', 'completed',
                     'SUCCESS', datetime(2026, 12, 6, 17, 31, 10, tzinfo=UTC), ['orders', 'account-security'],
                     conversation, 3, detail={'executor_id': 'durcap-run-vm-11988-151560'}) for n in range(3)]
    buffer = io.StringIO()
    console = Console(file=buffer, width=160, highlight=False, soft_wrap=True)
    assert not console.is_terminal
    saved, runs._out = runs._out, console
    try:
        runs._print_runs(infos, runs.RunsFormat.text)
    finally:
        runs._out = saved
    lines = buffer.getvalue().splitlines()
    assert len(lines) == 1 + len(infos), lines
    assert lines[0].split() == ['id', 'engine', 'agent', 'status', 'started', '(UTC)', 'capabilities', 'loaded',
                                'conversation', 'units', 'done', 'held', 'by'], lines[0]
    for n, line in enumerate(lines[1:]):
        assert line.split() == [infos[n].run_id, 'dbos', 'input-plain', 'completed', '2026-12-06', '17:31:10',
                                'orders,', 'account-security', conversation, '3', 'executor',
                                'durcap-run-vm-11988-151560'], line
    assert all(line == line.rstrip() for line in lines), lines  # no padding after the last cell
    assert console.width == 160  # the console's width is back for what it prints next


def test_listing_prefect_without_an_api_says_it_reads_the_temporary_server(tmp_path: Path) -> None:
    """`runs list --engine prefect` and `approvals list --engine prefect` with no Prefect API configured read
    Prefect's temporary local server: `listing_note` says so (before: ~10 s, then only "no calls waiting"). With
    `PREFECT_API_URL` set there is no note. Real Prefect settings, resolved in a fresh process (no server started)."""
    code = ('from durable_capabilities.engines import get\n'
            "print(get('prefect').listing_note({}))\n")
    env = subprocess_env({'PREFECT_HOME': str(tmp_path / 'prefect')},
                         unset=[k for k in os.environ if k.startswith('PREFECT_') and k != 'PREFECT_HOME'])
    bare = subprocess.run([sys.executable, '-c', code], env=env, capture_output=True, text=True, timeout=120)
    assert bare.returncode == 0, bare.stderr
    assert bare.stdout.startswith("prefect: no PREFECT_API_URL configured: reading the database of Prefect's "
                                  'temporary local server'), bare.stdout
    configured = subprocess.run([sys.executable, '-c', code], env={**env, 'PREFECT_API_URL': 'http://127.0.0.1:9/api'},
                                capture_output=True, text=True, timeout=120)
    assert configured.returncode == 0 and configured.stdout.strip() == 'None', configured.stdout + configured.stderr


def test_history_release_of_an_id_that_names_nothing_exits_2_with_dc044(tmp_path: Path) -> None:
    """`durcap history release ID` on a real SQLite store: an id neither stored nor held exits 2 with one DC044 line
    naming it and the fix (it exited 0 saying no turn holds it); a held claim of a conversation not stored yet (its
    first turn) is released, exit 0; releasing a stored conversation no turn holds is harmless, exit 0."""
    import asyncio

    from pydantic_ai.messages import ModelRequest, UserPromptPart

    from durable_capabilities.store import SQLConversationStore

    store = f'sqlite:///{tmp_path / "conv.db"}'

    async def seed() -> None:
        async with SQLConversationStore(store) as opened:
            await opened.append('stored', [ModelRequest(parts=[UserPromptPart('hi')])], expected_revision=None)
            await opened.claim_turn('first-turn', 'run-1')

    asyncio.run(seed())
    nope = durcap_here('history', 'release', 'NOPE', '--store', store)
    assert nope.exit_code == 2, (nope.stdout, nope.stderr)
    assert nope.stderr.startswith("durcap: error: DC044 conversation 'NOPE' is not in the store; nothing was released. "
                                  'Fix: '), nope.stderr
    assert nope.stdout == ''
    held = durcap_here('history', 'release', 'first-turn', '--store', store)
    assert held.exit_code == 0 and 'released the turn of run run-1' in held.stdout, held.stdout
    unheld = durcap_here('history', 'release', 'stored', '--store', store)
    assert unheld.exit_code == 0 and unheld.stdout.strip() == 'conversation stored: no turn holds it', unheld.stdout


def test_queue_flags_each_engine_its_own_spelling_and_the_old_one_kept(tmp_path: Path) -> None:
    """`durcap run`'s queue flags (real subprocesses, nothing runs): `--task-queue` given with `--engine dbos` is the
    DBOS queue (the spelling `durcap worker dbos` had first): the run is handed to it, refused here because no worker
    ever ran on the fresh database, naming `--queue q1` (before, the flag was ignored and the run ran in this process);
    `--queue` with `--engine temporal` and two DBOS spellings that disagree exit 2 with DC040 (before: ignored)."""
    support = str(ROOT / 'examples/support/agent.py') + ':support'
    db = f'sqlite:///{tmp_path / "system.db"}'
    common = [support, 'hi', '--deps-json', '{"orders": {}}']
    alias = durcap('run', *common, '--engine', 'dbos', '--task-queue', 'q1', '--db', db, cwd=tmp_path,
                   unset=['DURCAP_DBOS_DB', 'DURCAP_STORE'])
    assert alias.returncode == 2, alias.stdout + alias.stderr
    assert 'no DBOS worker has ever run on' in alias.stderr and '--queue q1`' in alias.stderr, alias.stderr
    both = durcap('run', *common, '--engine', 'dbos', '--queue', 'a', '--task-queue', 'b', '--db', db, cwd=tmp_path)
    assert both.returncode == 2, both.stdout + both.stderr
    assert "durcap: error: DC040 --queue 'a' and --task-queue 'b': a DBOS run is handed to one queue" in both.stderr
    temporal = durcap('run', *common, '--engine', 'temporal', '--queue', 'q1', cwd=tmp_path)
    assert temporal.returncode == 2, temporal.stdout + temporal.stderr
    assert ("durcap: error: DC040 --queue names a DBOS queue; a Temporal run's task queue is --task-queue"
            in temporal.stderr), temporal.stderr
    assert 'Traceback' not in alias.stderr + both.stderr + temporal.stderr
