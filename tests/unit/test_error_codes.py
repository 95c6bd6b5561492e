"""Every `durcap: error:` line leads with one stable code (docs/errors.md): DC040 for unusable input, or the more
specific code the failure has (DC044 for an id that names nothing).

A fresh-user trial counted about 55 such lines without a code ("give exactly one of --cron or --interval", "--status
must be one of ...", "store URL scheme 'mysql' is not supported", "no conversation store at ...", ...). The table
below runs a sample of those commands as real `durcap` subprocesses, each refused before any server is reached: exit
2, exactly one line on stderr, led by `durcap: error: DCnnn `. No model runs (the agents of
tests/fixtures/input_agents.py are scripted `FunctionModel`s and none is called).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from durable_capabilities.errors import one_code
from tests import _helpers
from tests._helpers import ROOT

AGENTS = ROOT / 'tests' / 'fixtures' / 'input_agents.py'
PLAIN = f'{AGENTS}:no_deps'
DEPS = f'{AGENTS}:with_deps'
NONE_DB = 'sqlite:///{tmp}/none.db'  # a store file that does not exist
LINE = re.compile(r'^durcap: error: DC\d{3} ')

# (id, argv ({tmp}: the test's folder), the code the line leads with, a fragment of the line, extra environment)
CASES: list[tuple[str, list[str], str, str, dict[str, str]]] = [
    ('runs-list-status', ['runs', 'list', '--status', 'bogus'], 'DC040', '--status must be one of', {}),
    ('store-scheme', ['history', 'show', 'x', '--store', 'mysql://h/db'], 'DC040',
     "store URL scheme 'mysql' is not supported", {}),
    ('history-show-no-store', ['history', 'show', 'x', '--store', NONE_DB], 'DC040', 'no conversation store at', {}),
    ('history-delete-no-store', ['history', 'delete', 'x', '--store', NONE_DB, '--yes'], 'DC040',
     'no conversation store at', {}),
    ('history-release-no-store', ['history', 'release', 'x', '--store', NONE_DB], 'DC040', 'no conversation store at',
     {}),
    ('store-stats-no-store', ['store', 'stats', '--store', NONE_DB], 'DC040', 'no conversation store at', {}),
    ('budgets-list-no-store', ['budgets', 'list', '--store', NONE_DB], 'DC040', 'no conversation store at', {}),
    ('budgets-reset-no-store', ['budgets', 'reset', 'k', '--store', NONE_DB], 'DC040', 'no conversation store at', {}),
    ('schedule-neither', ['schedule', 'prefect', PLAIN, '--prompt', 'hi'], 'DC040',
     'give exactly one of --cron or --interval', {}),
    ('schedule-both', ['schedule', 'prefect', PLAIN, '--prompt', 'hi', '--cron', '0 9 * * *', '--interval', '5'],
     'DC040', 'give exactly one of --cron or --interval', {}),
    ('schedule-interval', ['schedule', 'prefect', PLAIN, '--prompt', 'hi', '--interval', '-1'], 'DC040',
     '--interval must be a positive number of seconds', {}),
    ('schedule-no-prefect-api', ['schedule', 'prefect', PLAIN, '--prompt', 'hi', '--interval', '5'], 'DC040',
     'no Prefect API configured', {}),
    ('run-empty-conversation', ['run', PLAIN, 'hi', '--conversation', ''], 'DC040', '--conversation must not be empty',
     {}),
    ('run-missing-deps', ['run', DEPS, 'hi'], 'DC040', "'input-deps' takes deps of type Shop: pass them with --deps-json",
     {}),
    ('run-two-agents', ['run', str(AGENTS), 'hi'], 'DC040', 'agents; name one', {}),
    ('wire-script', ['wire', '--script', '{tmp}/nope.yaml'], 'DC040', 'cannot read the wire script', {}),
    ('approve-args-not-object', ['approve', 'r1', 'c1', '--args', '[1]'], 'DC040',
     '--args must be a JSON object', {}),
    ('lock-cannot-write', ['lock', PLAIN, '--output', '{tmp}/no/such/dir/durable.lock'], 'DC040', 'cannot write', {}),
    ('demo-gate-local', ['demo', '--approve', '--engine', 'local'], 'DC040',
     '--approve/--deny needs a durable engine', {}),
    # the code its message carried after `--cors-origin: ` leads the line (it was `--cors-origin: DC040 CORS ...`)
    ('serve-cors-origin', ['serve', PLAIN, '--cors-origin', 'https://app.example.com/'], 'DC040',
     "--cors-origin: CORS origin 'https://app.example.com/' is not an origin", {'DURCAP_SERVE_TOKEN': 't0ken'}),
    # '¹' is a digit to str.isdigit but not to int(): it was a ValueError traceback
    ('address-superscript-port', ['runs', 'list', '--engine', 'temporal', '--address', '127.0.0.1:\u00b9'], 'DC040',
     'is not HOST:PORT with a port in 1-65535', {}),
    # typer's own refusals of a command line (a fresh-user trial: the usage text and a boxed message, five lines, most
    # without a code): one line, DC040, the command's --help named
    ('usage-bad-value', ['serve', PLAIN, '--keepalive', '-3'], 'DC040',
     "Invalid value for '--keepalive': Input should be greater than or equal to 0 (see `", {}),
    ('usage-not-a-number', ['ui', '--port', 'abc'], 'DC040', "Invalid value for '--port'", {}),
    ('usage-engine-choice', ['run', PLAIN, 'hi', '--engine', 'nope'], 'DC040',
     "Invalid value for '--engine' / '-e': 'nope' is not one of", {}),  # the parser's DC040 moved to the front
    ('usage-missing-option', ['deny', 'r1', 'c1'], 'DC040', "Missing option '--reason'. (see `", {}),
    ('usage-missing-argument', ['approve'], 'DC040', "Missing argument 'run_id'.", {}),
    ('usage-unknown-option', ['savings', PLAIN, '--wat'], 'DC040', 'No such option: --wat', {}),
    ('usage-unknown-command', ['runs', 'bogus'], 'DC040', "No such command 'bogus'. (see `", {}),
    ('usage-unknown-top-option', ['--bogus'], 'DC040', 'No such option: --bogus (see `', {}),
    # an empty queue or executor name: a worker started on task queue '' (or DBOS executor ''), and a Temporal run on
    # it failed after it started with an uncoded "RPCError: missing task queue name" (exit 1)
    ('run-empty-task-queue', ['run', PLAIN, 'hi', '--engine', 'temporal', '--task-queue', ''], 'DC040',
     "--task-queue '': expected a queue name, got an empty one", {}),
    ('run-empty-dbos-queue', ['run', PLAIN, 'hi', '--engine', 'dbos', '--queue', ' '], 'DC040',
     "--queue ' ': expected a queue name, got an empty one", {}),
    ('worker-temporal-empty-task-queue', ['worker', 'temporal', PLAIN, '--task-queue', ''], 'DC040',
     "--task-queue '': expected a name, got an empty one", {}),
    ('worker-dbos-empty-executor-id', ['worker', 'dbos', PLAIN, '--executor-id', ''], 'DC040',
     "--executor-id '': expected a name, got an empty one", {}),
    # a negative drain time reached the Temporal SDK (a TypeError traceback, exit 1)
    ('worker-graceful-shutdown-negative', ['worker', 'temporal', PLAIN, '--graceful-shutdown', '-1'], 'DC040',
     "Invalid value for '--graceful-shutdown': Input should be greater than or equal to 0", {}),
    # a more specific code than DC040: an id that names nothing
    ('runs-show-unknown', ['runs', 'show', 'nope', '--engine', 'dbos', '--db', 'sqlite:///{tmp}/dbos.sqlite'], 'DC044',
     "no DBOS workflow 'nope'", {}),
]


@pytest.mark.parametrize(('argv', 'code', 'fragment', 'env'), [pytest.param(*case[1:], id=case[0]) for case in CASES])
def test_every_error_line_leads_with_one_code(tmp_path: Path, argv: list[str], code: str, fragment: str,
                                              env: dict[str, str]) -> None:
    """One formerly uncoded refusal as a real `durcap` subprocess: exit 2, one stderr line led by its one code, nothing
    on stdout, no traceback (no server is reached; no model runs)."""
    args = [arg.replace('{tmp}', str(tmp_path)) for arg in argv]
    done = _helpers.durcap(*args, cwd=tmp_path, env=env, unset=['DURCAP_STORE', 'PREFECT_API_URL'], timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(lines) == 1 and LINE.match(lines[0]), done.stderr
    assert lines[0].startswith(f'durcap: error: {code} ') and fragment in lines[0], lines[0]
    assert len(re.findall(r'\bDC\d{3}\b', lines[0])) == 1, lines[0]  # never two codes in one line
    assert done.stdout == '' and 'Traceback' not in done.stderr


def test_a_usage_error_names_the_commands_help() -> None:
    """In process (typer's `CliRunner`, prog name `durcap`): typer's refusal of a sub-subcommand's flag is one coded
    line naming that command's `--help`; a group given nothing still prints its help (no model, no server)."""
    from typer.testing import CliRunner

    from durable_capabilities.cli import app

    result = CliRunner().invoke(app, ['runs', 'watch', 'r1', '--format', 'xml'], prog_name='durcap')
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == ("durcap: error: DC040 Invalid value for '--format': Value error, 'xml' is not one "
                                     "of 'text', 'jsonl'. (see `durcap runs watch --help`)"), result.stderr
    helped = CliRunner().invoke(app, ['runs'], prog_name='durcap')
    assert 'Usage: durcap runs' in helped.output and 'durcap: error' not in helped.output, helped.output


@pytest.mark.parametrize(('message', 'line'), [
    ('give exactly one of --cron or --interval', 'DC040 give exactly one of --cron or --interval'),
    ("DC044 conversation 'x' is not in the store", "DC044 conversation 'x' is not in the store"),
    ('DC040 DC044 no run', 'DC044 no run'),  # a call site's code before the wrapped error's own: the latter
    ("cannot repair 'w': DC044 conversation 'x'", "DC044 cannot repair 'w': conversation 'x'"),
    ('DC040 --cors-origin: DC040 CORS origin', 'DC040 --cors-origin: CORS origin'),
    ('--busy reject refuses the turn (DC050): pass enqueue', 'DC040 --busy reject refuses the turn (DC050): pass enqueue'),
    ('DC0401 is not a code', 'DC040 DC0401 is not a code'),
])
def test_one_code_leads_every_line(message: str, line: str) -> None:
    """`errors.one_code`: a line keeps its own leading code, takes a wrapped error's (after `': '`) to the front, else
    `DC040`; a code named in passing stays where it is (no model, no process)."""
    assert one_code(message, 'DC040') == line


def test_a_failed_run_line_leads_with_its_own_code_only() -> None:
    """A run that failed in its engine (exit 1, `default=None`): the failure's own code leads, once, even when the
    error and its cause both carry it; a failure without one stays uncoded (no model, no process)."""
    failed = "agent 'a' failed on dbos: BudgetExceededError: DC060 key 'k' spent; cause: BudgetExceededError: DC060 key"
    assert one_code(failed, None) == ("DC060 agent 'a' failed on dbos: BudgetExceededError: key 'k' spent; cause: "
                                      'BudgetExceededError: key')
    assert one_code("agent 'a' failed on dbos: ModelHTTPError: 500", None) == "agent 'a' failed on dbos: ModelHTTPError: 500"


def test_a_local_run_whose_model_keeps_asking_for_a_denied_call_stops_at_the_request_limit(tmp_path: Path) -> None:
    """`durcap run` (local engine, a real subprocess) of a scripted `FunctionModel` that calls a tool needing approval
    after every denial: it looped without end (each approval round a new `Agent.run` with its own request limit);
    now the turn stops once its model requests reach pydantic-ai's default request limit (50, the same on every
    engine), exit 1, the failure line led by DC061 naming the tool, and the model was asked exactly 50 times."""
    target = f'{ROOT / "tests" / "fixtures" / "stubborn_agent.py"}:agent'
    done = _helpers.durcap('run', target, 'revoke bob', cwd=tmp_path, env={'DURCAP_CRASH_DIR': str(tmp_path)},
                           unset=['DURCAP_STORE'], timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith('durcap: error:')]
    assert line.startswith("durcap: error: DC061 agent 'stubborn' failed on local: TurnRequestLimitError: the turn "
                           'made 50 model requests, its request limit (50), and its model asked again for approval of '
                           'revoke_sessions'), line
    assert 'Consider raising the limit' not in line, line  # pydantic-ai's hint: durcap passes no limit to raise
    assert (tmp_path / 'requests').read_text().count('request') == 50
    assert done.stderr.count('revoke_sessions needs approval') == 49 and 'Traceback' not in done.stderr
