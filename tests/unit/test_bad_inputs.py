"""Bad inputs across every command and loader (issue 12, items 1 and the file/terminal part of 4).

Every row of the tables below is one bad input: the command line (or the loader call), the exit code it must
give (2: unusable input, 1: the definition has errors) and a fragment of the one line it must print. Each
case runs under a time limit (pytest-timeout, `CASE_SECONDS`); none may print a traceback or raise anything
but the exit. Most run in-process with typer's `CliRunner` (the same code path as the console script, minus
the interpreter start); the ones that need a real process run as subprocesses: a FIFO (a read would block the
process forever), the replay timeout (the replayer's thread is left behind, so the command leaves with
`os._exit`), DBOS runs, and the console script itself.

The agents are in tests/fixtures/input_agents.py; their model is a scripted `FunctionModel` (no provider).
Parsers (JSON, YAML lockfiles, histories, the escaping of output) are also driven by Hypothesis.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from durable_capabilities._limits import (
    MAX_DEPTH,
    InputError,
    load_json,
    load_yaml,
    printable,
    private_dir,
    private_file,
)
from durable_capabilities.cli import app
from durable_capabilities.engines import DURABLE_ENGINES
from durable_capabilities.lockfile import LockfileError, read_lock
from durable_capabilities.replay import read_history
from durable_capabilities.skills import InvalidSkill, load_skill, load_skills
from tests import _helpers
from tests._helpers import ROOT

FIXTURES = ROOT / 'tests' / 'fixtures'
AGENTS = FIXTURES / 'input_agents.py'
DEPS = f'{AGENTS}:with_deps'
PLAIN = f'{AGENTS}:no_deps'
ENGINE_REFUSED = "durcap: error: DC040 Invalid value for '--engine' / '-e': "  # typer's refusal, one coded line
HISTORY = ROOT / 'tests' / 'histories' / 'support' / 'returns.json'
SUPPORT = f'{ROOT / "examples" / "support" / "agent.py"}:support'
CASE_SECONDS = 30

pytestmark = pytest.mark.timeout(CASE_SECONDS)


@dataclass
class Case:
    """One bad input: `argv` (or files built by `files`), the exit code, and a fragment of the message."""

    id: str
    argv: list[str]
    code: int
    fragment: str
    files: dict[str, Any] = field(default_factory=dict)  # name -> text | bytes | callable(path) making it
    env: dict[str, str] = field(default_factory=dict)


def _deep(n: int, open_: str = '[', close: str = ']') -> str:
    return open_ * n + close * n


def _alias_bomb(levels: int = 12) -> str:
    lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        lines.append(f'a{i}: &a{i} [' + ','.join([f'*a{i - 1}'] * 9) + ']')
    return '\n'.join(lines) + f'\nlock_version: *a{levels - 1}\nagents: {{}}\n'


GOOD_LOCK_HEAD = 'lock_version: 1\n'

# ---- lockfiles: contents that must be refused (in `check --lock` and `worker temporal --lock`) --------------------

BAD_LOCKS: list[tuple[str, str | bytes, str]] = [
    ('alias-bomb', _alias_bomb(), 'aliases'),
    ('alias-in-agents', 'x: &x [a]\nlock_version: 1\nagents: {input-plain: {capabilities: *x}}\n', 'aliases'),
    ('merge-key', 'base: &b {tools: []}\nlock_version: 1\nagents: {input-plain: {<<: *b}}\n', 'aliases'),
    ('deep-lists', 'lock_version: 1\nagents: {}\nx: ' + _deep(5000) + '\n', 'nests deeper'),
    ('deep-maps', 'lock_version: 1\nagents: {}\nx: ' + '{a: ' * 5000 + '1' + '}' * 5000 + '\n', 'nests deeper'),
    ('deep-block', 'lock_version: 1\nagents: {}\n' + ''.join(f'{"  " * i}k{i}:\n' for i in range(200)) + '  ' * 200 + 'v\n',
     'nests deeper'),
    ('scalar', '5\n', 'no `agents` mapping'),
    ('list-top', '- 1\n- 2\n', 'no `agents` mapping'),
    ('empty', '', 'no `agents` mapping'),
    ('agents-int', 'lock_version: 1\nagents: 5\n', 'no `agents` mapping'),
    ('agents-list', 'lock_version: 1\nagents: [a]\n', 'no `agents` mapping'),
    ('agent-int', 'lock_version: 1\nagents: {a: 5}\n', 'agents.a'),
    ('agent-list', 'lock_version: 1\nagents: {a: [1]}\n', 'agents.a'),
    ('engine-int', 'lock_version: 1\nagents: {a: {temporal: 5}}\n', 'agents.a.temporal'),
    ('activities-dicts', 'lock_version: 1\nagents: {a: {temporal: {activities: [{a: 1}]}}}\n', 'activities.0'),
    ('activities-str', 'lock_version: 1\nagents: {a: {temporal: {activities: x}}}\n', 'activities'),
    ('steps-ints', 'lock_version: 1\nagents: {a: {dbos: {steps: [1, 2]}}}\n', 'steps.0'),
    ('capabilities-int', 'lock_version: 1\nagents: {a: {capabilities: 5}}\n', 'capabilities'),
    ('capabilities-ints', 'lock_version: 1\nagents: {a: {capabilities: [1]}}\n', 'capabilities.0'),
    ('leaf-toolsets-list', 'lock_version: 1\nagents: {a: {leaf_toolsets: [a]}}\n', 'leaf_toolsets'),
    ('leaf-toolsets-nested', 'lock_version: 1\nagents: {a: {leaf_toolsets: {c: [[x]]}}}\n', 'leaf_toolsets.c.0'),
    ('aliases-list', 'lock_version: 1\nagents: {a: {aliases: {n: [1]}}}\n', 'aliases.n'),
    ('previous-names-str', 'lock_version: 1\nagents: {a: {previous_names: x}}\n', 'previous_names'),
    ('agent-name-int', 'lock_version: 1\nagents: {5: {tools: []}}\n', 'agents.5'),
    ('generated-by-list', 'lock_version: 1\ngenerated_by: [1]\nagents: {}\n', 'generated_by'),
    ('version-true', 'lock_version: true\nagents: {}\n', 'lock_version True'),
    ('version-negative', 'lock_version: -5\nagents: {}\n', 'lock_version -5'),
    ('version-zero', 'lock_version: 0\nagents: {}\n', 'lock_version 0'),
    ('version-newer', 'lock_version: 2\nagents: {}\n', 'lock_version 2'),
    ('version-string', "lock_version: '1'\nagents: {}\n", "lock_version '1'"),
    ('version-float', 'lock_version: 1.0\nagents: {}\n', 'lock_version 1.0'),
    ('version-missing', 'agents: {}\n', 'lock_version None'),
    ('version-huge', f'lock_version: {10 ** 400}\nagents: {{}}\n', 'lock_version'),
    ('yaml-unclosed', 'lock_version: 1\nagents: {a: [\n', 'not valid YAML'),
    ('yaml-tab', 'lock_version: 1\nagents:\n\t- a\n', 'not valid YAML'),
    ('yaml-python-tag', 'lock_version: 1\nagents: !!python/object:os.system {}\n', 'not valid YAML'),
    ('yaml-bad-int', 'lock_version: !!int abc\nagents: {}\n', 'not valid YAML'),
    ('two-documents', 'lock_version: 1\nagents: {}\n---\nx: 1\n', 'not valid YAML'),
    ('not-utf8', b'lock_version: 1\nagents: {\xff\xfe: 1}\n', 'UnicodeDecodeError'),
    ('too-large', 'lock_version: 1\nagents: {}\n#' + 'x' * (4 * 1024 * 1024) + '\n', 'over the limit'),
    ('control-chars-name', 'lock_version: 1\nagents: {"a\\e[31m": 5}\n', '\\x1b[31m'),
]


def _lock_cases() -> list[Case]:
    cases = []
    for name, content, fragment in BAD_LOCKS:
        for command in (['check', PLAIN], ['worker', 'temporal', PLAIN]):
            cases.append(Case(f'lock-{command[0]}-{name}', [*command, '--lock', '{tmp}/durable.lock'], 2, fragment,
                              {'durable.lock': content}))
    return cases


# ---- TARGET: malformed, missing, wrong type, in every command that takes one ---------------------------------------

BAD_TARGETS: list[tuple[str, str, str]] = [
    ('empty', '', 'must be `pkg.module:attr`'),
    ('colon', ':', 'must be `pkg.module:attr`'),
    ('no-attr', f'{AGENTS}:', 'must be `pkg.module:attr`'),
    ('no-module', 'no_such_module_xyz:agent', "DC040 no module named 'no_such_module_xyz'"),
    ('no-file', 'no/such/file.py:agent', 'DC040 no such file'),
    ('folder', f'{FIXTURES}/:agent', 'is a folder, not a module file'),
    ('dev-null', '/dev/null:agent', 'is not a regular file (a FIFO, socket or device)'),
    ('no-such-attr', f'{AGENTS}:nope', f"has no attribute 'nope': name one of its DurableAgents: {AGENTS}:failing, "
                                        f'{AGENTS}:no_deps, {AGENTS}:with_deps'),
    ('attr-str', f'{AGENTS}:with_deps.name', 'is a str, not a DurableAgent'),
    ('attr-type', f'{AGENTS}:Shop', 'is a type, not a DurableAgent'),
    ('attr-dunder', f'{AGENTS}:__class__', 'not a DurableAgent'),
    ('module-without-agents', 'json', "module 'json' defines no DurableAgent"),
    ('escape', 'x\x1b[31m:y', '\\x1b[31m'),
    ('bidi', 'x\u202eyz:a', '\\u202e'),
    ('nul', 'a\x00b:c', '\\x00'),
    ('newline', 'a\nb:c', '\\n'),
    ('long', 'a' * 5000 + ':b', 'at most 1024 characters'),
    ('no-such-attr-no-agents', 'json:nope', "DC040 'json' has no attribute 'nope': it binds no DurableAgent"),
]


def _target_cases() -> list[Case]:
    cases = []
    commands: list[tuple[str, Callable[[str], list[str]]]] = [
        ('check', lambda t: ['check', t]),
        ('savings', lambda t: ['savings', t, '--estimate']),
        ('lock', lambda t: ['lock', t, '-o', '{tmp}/out.lock']),
        ('run', lambda t: ['run', t, 'hi']),
        ('worker', lambda t: ['worker', 'temporal', t]),
        ('schedule', lambda t: ['schedule', 'prefect', t, '--prompt', 'p', '--cron', '0 9 * * *']),
    ]
    for name, target, fragment in BAD_TARGETS:
        cases.append(Case(f'target-check-{name}', ['check', target], 2, fragment))
    # The same loader behind every other command: a sample of the bad targets in each.
    for command, argv in commands[1:]:
        for name, target, fragment in BAD_TARGETS[3:9:2] + BAD_TARGETS[12:14]:
            cases.append(Case(f'target-{command}-{name}', argv(target), 2, fragment))
    cases += [
        Case('target-syntax-error', ['check', '{tmp}/broken.py:x'], 2, 'syntax error in', {'broken.py': 'def (:\n'}),
        Case('target-raises', ['check', '{tmp}/raises.py:x'], 2, "raised RuntimeError: boom",
             {'raises.py': 'raise RuntimeError("boom")\n'}),
        Case('target-exits', ['check', '{tmp}/exits.py:x'], 2, 'raised SystemExit', {'exits.py': 'import sys\nsys.exit(3)\n'}),
        Case('target-recursion', ['check', '{tmp}/recurses.py:x'], 2, 'raised RecursionError',
             {'recurses.py': 'def f():\n    return f()\nf()\n'}),
        Case('target-folder-module', ['check', '{tmp}/pkg'], 2, 'is a folder, not a module file',
             {'pkg': lambda p: p.mkdir()}),
        Case('target-empty-list', ['check', '{tmp}/empty.py:agents'], 2, 'is an empty list', {'empty.py': 'agents = []\n'}),
        Case('target-import-missing', ['check', '{tmp}/imp.py:x'], 2, 'does not import',
             {'imp.py': 'import no_such_dependency_xyz\n'}),
    ]
    return cases


# ---- --deps-json (run, schedule prefect) ----------------------------------------------------------------------------

BAD_DEPS: list[tuple[str, str, str]] = [
    ('open-brace', '{', 'not valid JSON'),
    ('list', '[]', 'Input should be a dictionary'),
    ('null', 'null', 'Input should be a dictionary'),
    ('number', '1', 'Input should be a dictionary'),
    ('string', '"x"', 'Input should be a dictionary'),
    ('wrong-field-type', '{"name": 1, "limit": 2}', 'name: Input should be a valid string'),
    ('missing-field', '{"name": "a"}', 'limit: Field required'),
    ('wrong-int', '{"name": "a", "limit": "x"}', 'limit: Input should be a valid integer'),
    ('nan', '{"name": "a", "limit": NaN}', 'limit'),
    ('deep', _deep(5000), 'nests deeper than'),
    ('deep-objects', '{"a":' * 100 + '1' + '}' * 100, 'nests deeper than'),
    ('huge', '"' + 'x' * (1024 * 1024 + 10) + '"', 'over the limit'),
    ('trailing', '{"name": "a", "limit": 1} x', 'not valid JSON'),
    ('empty', '', 'not valid JSON'),
]


def _deps_cases() -> list[Case]:
    cases = []
    for name, value, fragment in BAD_DEPS:
        cases.append(Case(f'deps-run-{name}', ['run', DEPS, 'hi', '--deps-json', value], 2, fragment))
    for name, value, fragment in BAD_DEPS[:8] + BAD_DEPS[9:10]:
        cases.append(Case(f'deps-schedule-{name}', ['schedule', 'prefect', DEPS, '--prompt', 'p', '--cron', '0 9 * * *',
                                                    '--deps-json', value], 2, fragment))
    for value in ('{}', 'null', '[1]'):
        cases.append(Case(f'deps-for-no-deps-{value}', ['run', PLAIN, 'hi', '--deps-json', value], 2, 'takes no deps'))
    cases.append(Case('deps-missing', ['run', DEPS, 'hi'], 2, 'pass them with --deps-json'))
    return cases


# ---- URLs: --store, --db ----------------------------------------------------------------------------------------------

MISSING_PG_NAME = 'durcap_no_such_store_db'
MISSING_PG = f'postgresql://postgres@127.0.0.1:5432/{MISSING_PG_NAME}'
"""A database the test server does not have (nothing here creates it: see `test_no_case_created_a_database`)."""

BAD_URLS: list[tuple[str, str, str]] = [
    ('empty', '', 'is empty'),
    ('blank', '   ', 'is empty'),
    ('sqlite-memory', 'sqlite://', 'in-memory SQLite'),
    ('sqlite-memory-explicit', 'sqlite:///:memory:', 'in-memory SQLite'),
    ('mysql', 'mysql://u@h/db', "scheme 'mysql' is not supported"),
    ('http', 'http://example.com/x', "scheme 'http' is not supported"),
    ('not-a-url', 'not a url', 'is not a database URL'),
    ('sqlite-unwritable-folder', 'sqlite:////proc/x.db', 'cannot create a file in /proc'),
    ('bidi', 'sqlite:///\u202eevil.db', None),  # a valid file name: must not be refused; checked below
]


def _url_cases() -> list[Case]:
    cases = []
    for name, value, fragment in BAD_URLS:
        if fragment is None:
            continue
        cases.append(Case(f'store-run-{name}', ['run', PLAIN, 'hi', '--store', value], 2, fragment))
        cases.append(Case(f'store-worker-{name}', ['worker', 'temporal', PLAIN, '--store', value], 2, fragment))
        cases.append(Case(f'store-replay-{name}', ['replay', str(HISTORY), '--target', SUPPORT, '--store', value], 2,
                          fragment))
        cases.append(Case(f'db-run-{name}', ['run', PLAIN, 'hi', '--engine', 'dbos', '--db', value], 2, fragment))
    cases += [
        Case('db-demo-memory', ['demo', '--db', 'sqlite://'], 2, 'in-memory SQLite'),
        Case('db-demo-unreachable', ['demo', '--db', 'postgresql://x@127.0.0.1:1/nope'], 2, 'cannot connect'),
        Case('db-run-unreachable', ['run', PLAIN, 'hi', '--engine', 'dbos', '--db', 'postgresql://x@127.0.0.1:1/nope'],
             2, 'cannot connect'),
        Case('db-worker-unreachable', ['worker', 'dbos', PLAIN, '--db', 'postgresql://x@127.0.0.1:1/nope'], 2,
             'cannot connect'),
        Case('db-demo-query-password', ['demo', '--db', 'postgresql://x@127.0.0.1:1/nope?password=secret'], 2,
             'nope?password=***: cannot connect'),
        Case('db-demo-unsupported-scheme-password', ['demo', '--db', 'mysql://u:secret@h/x'], 2,
             "'mysql://u:***@h/x': scheme 'mysql' is not supported"),
        Case('db-run-no-database', ['run', PLAIN, 'hi', '--engine', 'dbos', '--db',
                                    'postgresql://postgres@127.0.0.1:5432/no_such_db_xyz'], 2, '`createdb no_such_db_xyz`'),
        # Only `durcap worker dbos` starts on a PostgreSQL database the server does not have yet (DBOS creates it:
        # engines/test_waiting_client.py); a client handing a run to a queue there refuses it, creating nothing.
        Case('db-run-queue-no-database', ['run', PLAIN, 'hi', '--engine', 'dbos', '--queue', 'q', '--db',
                                          'postgresql://postgres@127.0.0.1:5432/no_such_db_xyz'], 2,
             'does not exist); create the database (`createdb no_such_db_xyz` on that server) or fix the URL'),
        # `--queue` followed by another flag took the flag as the queue's name (a trial: `run --queue --db URL`).
        Case('run-queue-named-by-a-flag', ['run', PLAIN, 'hi', '--engine', 'dbos', '--queue', '--no-stream'], 2,
             "DC040 --queue '--no-stream': expected a queue name, got a flag"),
        Case('run-task-queue-named-by-a-flag', ['run', PLAIN, 'hi', '--engine', 'temporal', '--task-queue', '--no-stream'],
             2, "DC040 --task-queue '--no-stream': expected a queue name, got a flag"),
        Case('db-demo-no-database', ['demo', '--engine', 'dbos', '--db', 'postgresql://postgres@127.0.0.1:5432/no_such_db_xyz'],
             2, '`createdb no_such_db_xyz`'),
        # A PostgreSQL conversation store: a database the server does not have is named with the fix (createdb; no
        # test creates it), a server that is down says to start it (a local run without a conversation: PROCESS_CASES).
        Case('store-run-pg-database-missing', ['run', PLAIN, 'hi', '--store', MISSING_PG, '--conversation', 'c1'], 2,
             f'database "{MISSING_PG_NAME}" does not exist; create the database (`createdb {MISSING_PG_NAME}` on that '
             'server) or fix the URL'),
        Case('store-history-pg-database-missing', ['history', 'show', 'c1', '--store', MISSING_PG], 2,
             f'`createdb {MISSING_PG_NAME}`'),
        Case('store-run-pg-unreachable', ['run', PLAIN, 'hi', '--store', 'postgresql://x:secret@127.0.0.1:1/nope',
                                          '--conversation', 'c1'], 2, 'Connection refused; start the database or fix the URL'),
        # `runs watch` on a PostgreSQL store that is down or missing: one line, exit 2 (it printed the
        # StoreUnavailableError's traceback and exited 1).
        Case('store-runs-watch-pg-unreachable', ['runs', 'watch', 'r1', '--no-follow', '--store',
                                                 'postgresql://x:secret@127.0.0.1:1/nope'], 2,
             'Connection refused; start the database or fix the URL'),
        Case('store-runs-watch-pg-database-missing', ['runs', 'watch', 'r1', '--store', MISSING_PG], 2,
             f'`createdb {MISSING_PG_NAME}`'),
    ]
    # The operator commands on a DBOS system database that is down, refused by DBOS, or not a database: one line
    # naming the database (password as ***), exit 2, never SQLAlchemy's traceback or "nothing waits".
    operator = {'runs-list': ['runs', 'list', '--engine', 'dbos'], 'runs-show': ['runs', 'show', 'r1', '--engine', 'dbos'],
                'approvals-list': ['approvals', 'list', '--engine', 'dbos'],
                'approve': ['approve', 'r1', 'c1', '--engine', 'dbos'], 'deny': ['deny', 'r1', 'c1', '--engine', 'dbos', '--reason', 'no']}
    for name, argv in operator.items():
        cases += [
            Case(f'db-{name}-unreachable', [*argv, '--db', 'postgresql://x:secret@127.0.0.1:1/nope'], 2,
                 'cannot connect to the DBOS system database postgresql://x:***@127.0.0.1:1/nope'),
            Case(f'db-{name}-query-password', [*argv, '--db', 'postgresql://x@127.0.0.1:1/nope?password=secret'], 2,
                 'postgresql://x@127.0.0.1:1/nope?password=***'),
            Case(f'db-{name}-database-missing', [*argv, '--db', 'postgresql://postgres@127.0.0.1:5432/no_such_db_xyz'],
                 2, 'database "no_such_db_xyz" does not exist; create the database (`createdb no_such_db_xyz` on that '
                 'server) or fix the URL'),
            Case(f'db-{name}-no-database-name', [*argv, '--db', 'postgresql://:x@/'], 2, 'Database name must be specified'),
            Case(f'db-{name}-not-a-database', [*argv, '--db', 'sqlite:///{tmp}/x.db'], 2, 'is not a SQLite database',
                 {'x.db': 'this is not a database'}),
        ]
    for name, argv in {'runs-list': operator['runs-list'], 'approvals-list': operator['approvals-list']}.items():
        # A mistyped SQLite path: the listing is empty, and a note says no system database is there (exit 0; the
        # file is not created).
        cases.append(Case(f'db-{name}-missing-sqlite', [*argv, '--db', 'sqlite:///{tmp}/typo/dbos.sqlite'], 0,
                          'note: dbos: no system database at '))
    # An id that names nothing: DC044, as `durcap serve` answers it (404).
    cases += [Case(f'{verb}-unknown-run', [verb, 'nosuch', 'c1', '--engine', 'dbos', *extra], 2,
                   "durcap: error: DC044 no DBOS workflow 'nosuch'")
              for verb, extra in (('approve', []), ('deny', ['--reason', 'no']))]
    cases += [Case(f'runs-{verb}-unknown-run', ['runs', verb, 'nosuch', '--engine', 'dbos'], 2,
                   "durcap: error: DC044 no DBOS workflow 'nosuch'") for verb in ('show', 'resume', 'cancel')]
    return cases


# ---- history show: stores and ids ----------------------------------------------------------------------------------


def _store_with(tmp: Path, conversation_id: str, text: str = 'hi', name: str = 'conv.db') -> Path:
    """A real SQLite conversation store holding one conversation (a user prompt and an answer)."""
    from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart

    from durable_capabilities.store import SQLConversationStore

    path = tmp / name
    with SQLConversationStore(f'sqlite:///{path}') as store:
        asyncio.run(store.append(conversation_id, [ModelRequest(parts=[UserPromptPart(text)]),
                                                   ModelResponse(parts=[TextPart(text)])], expected_revision=None))
    return path


def _damaged(sql: str) -> Callable[[Path], None]:
    def make(path: Path) -> None:
        import sqlite3

        store = _store_with(path.parent, 'c1', name=path.name)
        conn = sqlite3.connect(store)
        try:
            with conn:
                conn.execute(sql)
        finally:
            conn.close()

    return make


def _history_cases() -> list[Case]:
    show = ['history', 'show']
    return [
        Case('history-missing-store', [*show, 'c1', '--store', 'sqlite:///{tmp}/none.db'], 2, 'no conversation store'),
        Case('history-store-folder', [*show, 'c1', '--store', 'sqlite:///{tmp}'], 2, 'error:'),
        Case('history-store-not-sqlite', [*show, 'c1', '--store', 'sqlite:///{tmp}/x.db'], 2, 'error:',
             {'x.db': 'this is not a database'}),
        Case('history-store-empty-file', [*show, 'c1', '--store', 'sqlite:///{tmp}/e.db'], 2, 'holds no conversation store',
             {'e.db': b''}),
        Case('history-table-gone', [*show, 'c1', '--store', 'sqlite:///{tmp}/d.db'], 2, 'no such table',
             {'d.db': _damaged('DROP TABLE durcap_conversations')}),
        Case('history-revision-text', [*show, 'c1', '--store', 'sqlite:///{tmp}/d.db'], 2, 'column revision',
             {'d.db': _damaged("UPDATE durcap_conversations SET revision = 'abc'")}),
        Case('history-usage-garbage', [*show, 'c1', '--store', 'sqlite:///{tmp}/d.db'], 2, 'column usage',
             {'d.db': _damaged("UPDATE durcap_conversations SET usage = '{{'")}),
        Case('history-timestamp-garbage', [*show, 'c1', '--store', 'sqlite:///{tmp}/d.db'], 2, 'column updated_at',
             {'d.db': _damaged("UPDATE durcap_conversations SET updated_at = 'yesterday'")}),
        Case('history-message-garbage', [*show, 'c1', '--store', 'sqlite:///{tmp}/d.db'], 2, 'is not valid JSON',
             {'d.db': _damaged("UPDATE durcap_entries SET message = 'not json'")}),
        Case('history-unknown-id', [*show, 'nope', '--store', 'sqlite:///{tmp}/d.db'], 2,
             "error: DC044 conversation 'nope'", {'d.db': _damaged('SELECT 1')}),
        Case('history-delete-unknown-id', ['history', 'delete', 'nope', '--yes', '--store', 'sqlite:///{tmp}/d.db'], 2,
             "error: DC044 conversation 'nope'", {'d.db': _damaged('SELECT 1')}),
        Case('history-fork-unknown-id', ['history', 'fork', 'nope', '--at-turn', '1', '--to', 'new', '--store',
                                            'sqlite:///{tmp}/d.db'],
             2, "error: DC044 conversation 'nope'", {'d.db': _damaged('SELECT 1')}),
        # A run that published nothing: DC044 as for any id that names nothing; `--no-follow` waited for nothing, so
        # its line says no wait (it said 'waited 30 s').
        Case('runs-watch-unknown-run-no-follow', ['runs', 'watch', 'nope', '--no-follow', '--store',
                                                  'sqlite:///{tmp}/d.db'], 2,
             "d.db; check the run id and --store", {'d.db': _damaged('SELECT 1')}),
        Case('runs-watch-unknown-run-waited', ['runs', 'watch', 'nope', '--wait', '0.2', '--store',
                                               'sqlite:///{tmp}/d.db'], 2,
             "error: DC044 run 'nope' has published no events to sqlite:///", {'d.db': _damaged('SELECT 1')}),
        Case('history-unknown-id-escaped', [*show, 'n\x1b]0;pwned\x07', '--store', 'sqlite:///{tmp}/d.db'], 2,
             '\\x1b]0;pwned\\x07', {'d.db': _damaged('SELECT 1')}),
        Case('history-store-empty', [*show, 'c1', '--store', ''], 2, 'non-empty'),
        Case('history-store-memory', [*show, 'c1', '--store', 'sqlite://'], 2, 'holds no conversation store'),
        Case('history-store-scheme', [*show, 'c1', '--store', 'redis://x'], 2, 'not supported'),
    ]


# ---- replay: history files (read_history refuses them before any replayer runs) ------------------------------------


def _events(mutate: Callable[[list[dict[str, Any]]], Any]) -> str:
    raw = json.loads(HISTORY.read_text())
    events = raw['history']['events']
    result = mutate(events)
    raw['history']['events'] = events if result is None else result
    return json.dumps(raw)


def _set(index: int, key: str, value: Any) -> Callable[[list[dict[str, Any]]], None]:
    def mutate(events: list[dict[str, Any]]) -> None:
        events[index][key] = value

    return mutate


BAD_HISTORIES: list[tuple[str, str | bytes, str]] = [
    ('empty-file', '', 'not valid JSON'),
    ('not-json', '{', 'not valid JSON'),
    ('list', '[]', 'no `events` list'),
    ('null', 'null', 'no `events` list'),
    ('no-events', '{"history": {}}', 'no `events` list'),
    ('events-empty', '{"history": {"events": []}}', 'no `events` list'),
    ('events-dict', '{"history": {"events": {}}}', 'no `events` list'),
    ('first-event-only', _events(lambda e: e[:1]), 'no started workflow task'),
    ('empty-event', _events(lambda e: [{}]), 'eventId None'),
    ('event-not-object', _events(lambda e: [1, *e[1:]]), 'event 1 is not a JSON object'),
    ('event-id-text', _events(_set(0, 'eventId', 'abc')), "eventId 'abc'"),
    ('event-id-bool', _events(_set(0, 'eventId', True)), 'eventId True'),
    ('event-id-negative', _events(_set(0, 'eventId', '-1')), "eventId '-1'"),
    ('event-id-gap', _events(_set(3, 'eventId', '9')), 'without gaps'),
    ('first-not-started', _events(lambda e: e[1:]), 'eventId'),
    ('started-type-changed', _events(_set(0, 'eventType', 'EVENT_TYPE_TIMER_FIRED')), 'first event is not'),
    ('no-run-ids', _events(lambda e: e[0]['workflowExecutionStartedEventAttributes'].pop('originalExecutionRunId')
                           and None), 'run ids'),
    ('deep', '{"history": {"events": ' + _deep(5000) + '}}', 'nests deeper'),
    ('workflow-id-number', _events(lambda e: None).replace('"workflowId": "support-returns"', '"workflowId": 5'),
     'workflowId is not a string'),
    ('not-utf8', b'\xff\xfe{}', 'not valid JSON'),
    ('bad-event-type-value', _events(_set(4, 'eventType', 'EVENT_TYPE_NOPE')), "eventType 'EVENT_TYPE_NOPE'"),
]


def _replay_cases() -> list[Case]:
    return [Case(f'replay-{name}', ['replay', '{tmp}/h.json', '--target', SUPPORT], 2, fragment, {'h.json': content})
            for name, content, fragment in BAD_HISTORIES] + [
        Case('replay-missing-file', ['replay', '{tmp}/none.json', '--target', SUPPORT], 2, 'No such file'),
        Case('replay-folder', ['replay', '{tmp}', '--target', SUPPORT], 2, 'Is a directory'),
    ]


# ---- other options -------------------------------------------------------------------------------------------------


def _option_cases() -> list[Case]:
    schedule = ['schedule', 'prefect', PLAIN, '--prompt', 'p']
    return [
        Case('cron-words', [*schedule, '--cron', 'not a cron'], 2, 'not a cron expression'),
        Case('cron-three-fields', [*schedule, '--cron', '* * *'], 2, 'not a cron expression'),
        Case('cron-minute-61', [*schedule, '--cron', '61 * * * *'], 2, 'not a cron expression'),
        Case('cron-empty', [*schedule, '--cron', ''], 2, 'not a cron expression'),
        Case('cron-escape', [*schedule, '--cron', '\x1b[2J'], 2, '\\x1b[2J'),
        Case('cron-and-interval', [*schedule, '--cron', '* * * * *', '--interval', '5'], 2, 'exactly one of'),
        Case('neither', schedule, 2, 'exactly one of'),
        Case('interval-zero', [*schedule, '--interval', '0'], 2, 'positive number'),
        Case('interval-negative', [*schedule, '--interval', '-1'], 2, 'positive number'),
        Case('interval-text', [*schedule, '--interval', 'x'], 2, "'--interval'"),
        Case('prefect-beat-not-a-number', [*schedule, '--interval', '60'], 2,
             '$DURCAP_PREFECT_BEAT_SECONDS: must be a number of seconds above 0', env={'DURCAP_PREFECT_BEAT_SECONDS': 'x'}),
        Case('prefect-stale-negative', [*schedule, '--interval', '60'], 2,
             '$DURCAP_PREFECT_STALE_SECONDS: must be a number of seconds above 0',
             env={'DURCAP_PREFECT_STALE_SECONDS': '-5'}),
        # An engine no command knows: the same coded line everywhere (`runs watch` had its own, uncoded).
        # The parser's refusal is one line led by the code (the option's parser wrote it after the flag's name).
        Case('engine-unknown-check', ['check', PLAIN, '--engine', 'nope'], 2, f"{ENGINE_REFUSED}'nope' is not one of"),
        Case('engine-unknown-run', ['run', PLAIN, 'hi', '--engine', 'nope'], 2, f"{ENGINE_REFUSED}'nope' is not one of"),
        Case('engine-unknown-runs-show', ['runs', 'show', 'r1', '--engine', 'nope'], 2,
             f"{ENGINE_REFUSED}'nope' is not one of"),
        Case('engine-unknown-runs-watch', ['runs', 'watch', 'r1', '--engine', 'bogus'], 2,
             f"{ENGINE_REFUSED}'bogus' is not one of 'local',"),
        Case('format-unknown', ['check', PLAIN, '--format', 'xml'], 2, "'xml' is not one of"),
        Case('conversation-empty', ['run', PLAIN, 'hi', '--conversation', ' '], 2, '--conversation must not be empty'),
        Case('lock-output-missing-folder', ['lock', PLAIN, '-o', '{tmp}/no/such/dir/durable.lock'], 2, 'cannot write'),
        Case('lock-output-folder', ['lock', PLAIN, '-o', '{tmp}'], 2, 'cannot write'),
        Case('lock-missing', ['check', PLAIN, '--lock', '{tmp}/none.lock'], 2, 'no such lockfile'),
        Case('lock-folder', ['check', PLAIN, '--lock', '{tmp}'], 2, 'IsADirectoryError'),
        Case('approve-args-not-json', ['approve', 'r', 'c', '--args', '{'], 2, 'not valid JSON'),
        Case('approve-args-list', ['approve', 'r', 'c', '--args', '[1]'], 2, 'must be a JSON object'),
        Case('approve-args-deep', ['approve', 'r', 'c', '--args', _deep(5000)], 2, 'nests deeper'),
        Case('approve-args-huge', ['approve', 'r', 'c', '--args', '"' + 'x' * (1024 * 1024 + 1) + '"'], 2, 'over the limit'),
        Case('approve-decision-wait-not-a-number', ['approve', 'r', 'c', '--engine', 'temporal'], 2,
             '$DURCAP_DECISION_WAIT: must be a number of seconds above 0', env={'DURCAP_DECISION_WAIT': 'soon'}),
        Case('deny-decision-wait-zero', ['deny', 'r', 'c', '--reason', 'no'], 2,
             '$DURCAP_DECISION_WAIT: must be a number of seconds above 0', env={'DURCAP_DECISION_WAIT': '0'}),
        Case('runs-status-unknown', ['runs', 'list', '--status', 'nope'], 2, '--status must be one of'),
        Case('serve-engine-unknown', ['serve', PLAIN, '--engine', 'nope'], 2, 'publish event streams'),
        # Prefect's flow run ids are the server's: the API could not name the run it answers with (a trial found
        # runs that stayed `queued` with no events): refused before anything starts.
        Case('serve-engine-prefect', ['serve', PLAIN, '--engine', 'prefect'], 2,
             f'{ENGINE_REFUSED}durcap serve does not run turns'),
        # `durcap ui` on a SQLite database in a folder that does not exist started and showed empty pages for a
        # mistyped path: refused at start (a missing file in an existing folder still starts).
        Case('ui-db-missing-folder', ['ui', '--engine', 'dbos', '--db', 'sqlite:///{tmp}/missing/folder/x.db'], 2,
             "DC040 --db 'sqlite:///"),
        Case('ui-store-missing-folder', ['ui', '--engine', 'dbos', '--store', 'sqlite:///{tmp}/missing/x.db'], 2,
             '/missing does not exist, so nothing has run there'),
        Case('ui-store-env-missing-folder', ['ui', '--engine', 'dbos'], 2, 'folder missing does not exist',
             env={'DURCAP_STORE': 'sqlite:///missing/x.db'}),  # relative: the case runs in {tmp}
        # `durcap serve --engine dbos` on a system database it cannot reach: one line at start, exit 2 (it started and
        # every turn failed), the password never printed.
        Case('serve-dbos-db-unreachable', ['serve', PLAIN, '--engine', 'dbos', '--db',
                                           'postgresql://x:secret@127.0.0.1:1/nope'], 2,
             'DC040 cannot serve dbos: cannot connect to the DBOS system database postgresql://x:***@127.0.0.1:1/nope',
             env={'DURCAP_SERVE_TOKEN': 't'}),
        Case('serve-deps-not-json', ['serve', DEPS, '--deps-json', '{'], 2, 'not valid JSON'),
        Case('serve-deps-for-no-deps', ['serve', PLAIN, '--deps-json', '{}'], 2, 'takes no deps'),
        Case('serve-port-zero', ['serve', PLAIN, '--port', '0'], 2, "'--port'"),
        Case('serve-token-pairs-empty', ['serve', PLAIN], 2, 'DC040 DURCAP_SERVE_TOKEN: expected one token, or '
             'principal=token pairs', env={'DURCAP_SERVE_TOKEN': 'alice=,bob=x'}),
        # Two principals given one token: refused (the last pair won, so alice's requests were served as bob), the
        # token not printed.
        Case('serve-token-shared-by-two-principals', ['serve', PLAIN], 2, "DC040 DURCAP_SERVE_TOKEN: principals 'alice' and 'bob' have the same "
             'token', env={'DURCAP_SERVE_TOKEN': 'alice=s3cret-shared,bob=s3cret-shared'}),
        # A trial's `--cors-origin 'not a url'` was accepted, leaving CORS silently off for the app it was meant for.
        Case('serve-cors-origin-not-a-url', ['serve', PLAIN, '--cors-origin', 'not a url'], 2,
             "DC040 --cors-origin: CORS origin 'not a url' is not an origin: expected scheme://host[:port]",
             env={'DURCAP_SERVE_TOKEN': 't0ken'}),
        Case('serve-cors-origin-with-a-path', ['serve', PLAIN, '--cors-origin', 'https://app.example.com/'], 2,
             'durcap: error: DC040 --cors-origin: CORS origin', env={'DURCAP_SERVE_TOKEN': 't0ken'}),
        Case('replay-no-target', ['replay', str(HISTORY)], 2, "Missing option '--target'"),
        # Issue 29, item 6: a 3,000-level wire script was a RecursionError traceback.
        Case('wire-script-deep', ['wire', '--script', '{tmp}/deep.yaml'], 2, 'nests deeper than',
             {'deep.yaml': _deep(3000) + '\n'}),
        Case('wire-script-deep-block', ['wire', '--script', '{tmp}/deep.yaml'], 2, 'nests deeper than',
             {'deep.yaml': ''.join(f'{"  " * i}k{i}:\n' for i in range(3000)) + '  ' * 3000 + 'v\n'}),
    ]


CASES = _lock_cases() + _target_cases() + _deps_cases() + _url_cases() + _history_cases() + _replay_cases() + _option_cases()


def _materialize(case: Case, tmp: Path) -> list[str]:
    for name, content in case.files.items():
        path = tmp / name
        if callable(content):
            content(path)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content, encoding='utf-8')
    return [arg.replace('{tmp}', str(tmp)) for arg in case.argv]


def _assert_one_clean_failure(case: Case, code: int, output: str) -> None:
    assert 'Traceback' not in output, output[-3000:]
    if any('secret' in arg for arg in case.argv):  # a password given in a URL is never printed
        assert 'secret' not in output, output[-2000:]
    assert code == case.code, f'exit {code}, expected {case.code}: {output[-2000:]}'
    assert case.fragment in output, f'{case.fragment!r} not in: {output[-2000:]}'
    for char in ('\x1b', '\u202e', '\x00', '\x07'):
        assert char not in output, f'raw {char!r} echoed: {output[-500:]!r}'


def test_no_case_created_a_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The commands given a PostgreSQL database the server does not have refuse it and leave it missing: as a store, a
    run with a conversation, a local run without one, `history show`; as DBOS's system database, `run`, `runs list`,
    `approve` (only `durcap worker dbos` creates one, through DBOS) (real PostgreSQL at 127.0.0.1:5432, its
    `pg_database`)."""
    import psycopg

    pg_missing = 'postgresql://postgres@127.0.0.1:5432/no_such_db_xyz'
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('DURCAP_STORE', raising=False)
    for argv in (['run', PLAIN, 'hi', '--store', MISSING_PG, '--conversation', 'c1'], ['run', PLAIN, 'hi', '--store', MISSING_PG],
                 ['history', 'show', 'c1', '--store', MISSING_PG]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == (0 if '--conversation' not in argv and argv[0] == 'run' else 2), result.output
    for argv in (['run', PLAIN, 'hi', '--engine', 'dbos', '--db', pg_missing], ['runs', 'list', '--engine', 'dbos', '--db', pg_missing],
                 ['approve', 'r1', 'c1', '--engine', 'dbos', '--db', pg_missing]):
        assert CliRunner().invoke(app, argv).exit_code == 2
    with psycopg.connect(_helpers.PG_ADMIN_URL) as conn:
        for name in (MISSING_PG_NAME, 'no_such_db_xyz'):
            assert conn.execute('SELECT 1 FROM pg_database WHERE datname = %s', (name,)).fetchone() is None, name


def test_the_table_is_large_enough() -> None:
    ids = [case.id for case in CASES]
    assert len(set(ids)) == len(ids), sorted({i for i in ids if ids.count(i) > 1})
    assert len(CASES) >= 150, len(CASES)


@pytest.mark.parametrize('case', CASES, ids=lambda c: c.id)
def test_bad_input(case: Case, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process (`CliRunner`): the exit code, the fragment, no traceback, no raw control character."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv('DURCAP_STORE', raising=False)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    argv = _materialize(case, tmp_path)
    result = CliRunner().invoke(app, argv, catch_exceptions=True)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        import traceback

        raise AssertionError(''.join(traceback.format_exception(result.exception))) from None
    _assert_one_clean_failure(case, result.exit_code, result.output)


# ---- cases that need a real process --------------------------------------------------------------------------------


def durcap(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = CASE_SECONDS) -> tuple[int, str]:
    """The console module in a subprocess (killed by `subprocess.run` on timeout); (exit code, stdout + stderr)."""
    result = _helpers.durcap(*args, cwd=cwd, env=env, unset=['DURCAP_STORE'], timeout=timeout)
    return result.returncode, result.stdout + result.stderr


def _fifo(path: Path) -> None:
    os.mkfifo(path)


PROCESS_CASES = [
    Case('fifo-lockfile', ['check', PLAIN, '--lock', '{tmp}/durable.lock'], 2, 'not a regular file',
         {'durable.lock': _fifo}),
    Case('fifo-history', ['replay', '{tmp}/h.json', '--target', SUPPORT], 2, 'not a regular file', {'h.json': _fifo}),
    Case('fifo-skill', ['check', '{tmp}/skilled.py:agent'], 1, 'not a regular file', {
        'skills': lambda p: (p.mkdir(), os.mkfifo(p / 'blocking.md')),
        'skilled.py': 'from pathlib import Path\nfrom durable_capabilities import DurableAgent, load_skills\n'
                      "agent = DurableAgent('skilled', 'test', capabilities=load_skills(Path(__file__).parent / 'skills'))\n",
    }),
    Case('replay-timeout', ['replay', str(HISTORY), '--target', SUPPORT], 2, 'did not replay within 0.001 s',
         env={'DURCAP_REPLAY_TIMEOUT': '0.001'}),
    Case('dbos-run-unreachable-db', ['run', PLAIN, 'hi', '--engine', 'dbos', '--db', 'postgresql://x@127.0.0.1:1/nope'],
         2, 'cannot connect'),
    # A file that is not a SQLite database is refused before DBOS opens it (DBOS itself would log a traceback from its
    # failed event read, dbos `get_event_check`): a real process shows no such line.
    *(Case(f'{verb}-not-a-database', [verb, 'r1', 'c1', '--engine', 'dbos', '--db', 'sqlite:///{tmp}/x.db', *extra],
           2, 'is not a SQLite database', {'x.db': 'this is not a database'})
      for verb, extra in (('approve', []), ('deny', ['--reason', 'no']))),
    # Issue 29, item 6: a file that is not a SQLite database, as DBOS's system database, is one line before DBOS starts.
    Case('dbos-db-not-sqlite', ['demo', '--engine', 'dbos', '--db', 'sqlite:///{tmp}/passwd'], 2,
         'is not a SQLite database', {'passwd': 'root:x:0:0:root:/root:/bin/bash\n'}),
    Case('target-fifo', ['check', '{tmp}/pipe.py:x'], 2, 'is not a regular file (a FIFO', {'pipe.py': _fifo}),
    # A Prefect API nobody answers at: a trial's `schedule prefect` said it was serving, started its fork server, then
    # died with two tracebacks (exit 1); now one line before anything starts.
    Case('schedule-prefect-api-unreachable', ['schedule', 'prefect', PLAIN, '--prompt', 'p', '--cron', '0 9 * * *'], 2,
         'DC040 cannot reach the Prefect API at http://127.0.0.1:1/api', env={'PREFECT_API_URL': 'http://127.0.0.1:1/api'}),
    # A Prefect API nobody answers at, for the operator commands: one line naming it (a fresh-user trial: httpx's
    # ConnectError traceback, exit 1, for both).
    Case('approvals-list-prefect-api-unreachable', ['approvals', 'list', '--engine', 'prefect'], 2,
         'durcap: error: DC040 cannot reach prefect: cannot reach the Prefect API at http://127.0.0.1:1/api (ConnectError',
         env={'PREFECT_API_URL': 'http://127.0.0.1:1/api'}),
    Case('approve-prefect-api-unreachable', ['approve', '00000000-0000-0000-0000-000000000000', 'c1', '--engine',
                                            'prefect'], 2,
         'durcap: error: DC040 cannot reach prefect: cannot reach the Prefect API at http://127.0.0.1:1/api (ConnectError',
         env={'PREFECT_API_URL': 'http://127.0.0.1:1/api'}),
    # docs/tracing.md: an OTEL_* value durcap cannot export with is one DC040 line naming the variable, before the command.
    Case('otel-exporter-unknown', ['check', PLAIN], 2, "DC040 OTEL_TRACES_EXPORTER: 'zipkin' is not an exporter",
         env={'OTEL_TRACES_EXPORTER': 'zipkin'}),
    Case('otel-protocol-grpc', ['check', PLAIN], 2, 'DC040 OTEL_EXPORTER_OTLP_PROTOCOL: \'grpc\': durcap exports OTLP over '
         'http/protobuf only', env={'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://127.0.0.1:1', 'OTEL_EXPORTER_OTLP_PROTOCOL': 'grpc'}),
    Case('otel-endpoint-not-url', ['check', PLAIN], 2, "DC040 OTEL_EXPORTER_OTLP_ENDPOINT: 'not-a-url' is not an "
         'http(s) URL: set it to the OTLP/HTTP address of your collector', env={'OTEL_EXPORTER_OTLP_ENDPOINT': 'not-a-url'}),
    Case('otel-traces-endpoint-no-host', ['check', PLAIN], 2, "DC040 OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: 'http://' is "
         'not an http(s) URL', env={'OTEL_EXPORTER_OTLP_TRACES_ENDPOINT': 'http://'}),
    Case('otel-export-timeout-not-number', ['check', PLAIN], 2, "DC040 OTEL_BSP_EXPORT_TIMEOUT: 'soon' is not a number of "
         'milliseconds above 0', env={'OTEL_EXPORTER_OTLP_ENDPOINT': 'http://127.0.0.1:1', 'OTEL_BSP_EXPORT_TIMEOUT': 'soon'}),
    # A local run without a conversation on a PostgreSQL store the server does not have: the run goes on, and its event
    # stream's last line (a log warning) names the database and the fix.
    Case('store-run-pg-database-missing-no-conversation', ['run', PLAIN, 'hi', '--store', MISSING_PG], 0,
         f'its event stream stops here (the store could not be written: StoreUnavailableError: cannot use the '
         f'conversation store postgresql+psycopg://postgres@127.0.0.1:5432/{MISSING_PG_NAME}: connection failed'),
    Case('store-run-pg-database-missing-stream-fix', ['run', PLAIN, 'hi', '--store', MISSING_PG], 0,
         f'database "{MISSING_PG_NAME}" does not exist; create the database (`createdb {MISSING_PG_NAME}` on that server) or fix the URL); the run goes on'),
    Case('local-failing-tool', ['run', f'{AGENTS}:failing', 'hi'], 1,
         "agent 'input-failing' failed on local in capability 'broken' (tool 'explode')"),
]


@pytest.mark.parametrize('case', PROCESS_CASES, ids=lambda c: c.id)
def test_bad_input_in_a_process(case: Case, tmp_path: Path) -> None:
    """A real `durcap` process: it must finish (subprocess timeout) with one coded line and no traceback."""
    argv = _materialize(case, tmp_path)
    code, output = durcap(*argv, cwd=tmp_path, env=case.env)
    _assert_one_clean_failure(case, code, output)


def test_failing_run_leads_with_our_words(tmp_path: Path) -> None:
    """A tool that always fails on DBOS (real SQLite system database): one line, our words (agent, engine,
    capability) first, DBOS's error, then the innermost cause; no DBOS traceback per retry."""
    code, output = durcap('run', f'{AGENTS}:failing', 'hi', '--engine', 'dbos', cwd=tmp_path)
    assert code == 1 and 'Traceback' not in output, output
    line = next(line for line in output.splitlines() if line.startswith('durcap: error:'))
    assert line.startswith("durcap: error: agent 'input-failing' failed on dbos in capability 'broken': "
                           'DBOSMaxStepRetriesExceeded'), line
    assert line.index("capability 'broken'") < line.index('cause: RuntimeError: tool exploded on 1'), line


# ---- loaders called as a library ---------------------------------------------------------------------------------


def test_load_skills_never_raises(tmp_path: Path) -> None:
    """Every kind of bad skills folder gives `InvalidSkill` entries (DC016), never an exception, never a block."""
    folder = tmp_path / 'skills'
    folder.mkdir()
    os.mkfifo(folder / 'fifo.md')
    (folder / 'dir.md').mkdir()
    (folder / 'big.md').write_text('---\nid: big\ndescription: d\n---\n' + 'x' * (1024 * 1024 + 1))
    (folder / 'bomb.md').write_text('---\n' + _alias_bomb().replace('lock_version', 'id') + '---\nbody\n')
    (folder / 'deep.md').write_text('---\nid: deep\ndescription: ' + _deep(5000) + '\n---\nbody\n')
    (folder / 'binary.md').write_bytes(b'---\nid: \xff\n---\n')
    cases = {
        'fifo.md': 'not a regular file', 'dir.md': 'cannot read the file', 'big.md': 'over the limit',
        'bomb.md': 'aliases', 'deep.md': 'nests deeper', 'binary.md': 'not valid UTF-8',
    }
    loaded = load_skills(folder)
    by_file = {Path(s.problem.where.rsplit(':', 1)[0]).name: s.problem for s in loaded if isinstance(s, InvalidSkill)}
    for name, fragment in cases.items():
        assert by_file[name].code == 'DC016' and fragment in by_file[name].message, (name, by_file[name])
    for directory, pattern, fragment in [
        (folder, '/absolute/*.md', 'cannot list'), (folder, '', 'cannot list'), (tmp_path / 'none', '*.md', 'does not exist'),
        (folder / 'big.md', '*.md', 'is a file'),
    ]:
        [invalid] = load_skills(directory, pattern)
        assert isinstance(invalid, InvalidSkill) and fragment in invalid.problem.message, invalid
    assert isinstance(load_skill(folder / 'fifo.md'), InvalidSkill)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300))
def test_load_json_raises_only_input_errors(text: str) -> None:
    try:
        load_json(text, where='--x')
    except InputError as exc:
        assert str(exc).startswith('DC040 --x: ') and '\n' not in str(exc)


@settings(max_examples=100, deadline=None)
@given(st.recursive(st.none() | st.integers() | st.text(max_size=5),
                    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3),
                    max_leaves=30))
def test_load_json_bounds_depth_exactly(value: Any) -> None:
    """JSON nested at most MAX_DEPTH levels loads; one level deeper is refused."""
    def wrap(v: Any, n: int) -> Any:
        for _ in range(n):
            v = [v]
        return v

    assert load_json(json.dumps(wrap(value, 0)), where='x') == value
    with pytest.raises(InputError, match='nests deeper'):
        load_json(json.dumps(wrap([], MAX_DEPTH)), where='x')
    assert load_json(json.dumps(wrap([], MAX_DEPTH - 1)), where='x') == wrap([], MAX_DEPTH - 1)


_YAML_ALPHABET = st.sampled_from([*'ab:-[]{}&*!|>\'"#,? \n\t0123', '!!python/object', '<<: *a', '&a ', '*a'])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_YAML_ALPHABET, max_size=60).map(''.join))
def test_read_lock_raises_only_lockfile_errors(tmp_path: Path, text: str) -> None:
    """Any text: a lockfile or one `LockfileError` line, never another exception (PyYAML's included)."""
    path = tmp_path / 'durable.lock'
    path.write_text(GOOD_LOCK_HEAD + 'agents:\n  a:\n    tools: ' + text if text.startswith(' ') else text)
    try:
        data = read_lock(path)
    except LockfileError as exc:
        assert '\n' not in str(exc)
    else:
        assert isinstance(data['agents'], dict) and type(data['lock_version']) is int


def _yaml_aliases(text: str) -> bool:
    """Whether PyYAML's own parser sees an alias in `text` (`False` when it cannot parse it)."""
    try:
        return any(isinstance(event, yaml.AliasEvent) for event in yaml.parse(text, Loader=yaml.SafeLoader))
    except yaml.YAMLError:
        return False


LAUGHS = 'a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: [*c, *c]\n'


@pytest.mark.parametrize('text', ['a: &x 1\nb: *x\n', '- &a [1]\n- *a\n', '{x: &y {}, z: *y}\n', LAUGHS])
def test_load_yaml_refuses_aliases_and_depth(text: str) -> None:
    """An alias is refused (a `yaml.YAMLError` naming it), however small; so is nesting past `MAX_DEPTH`, in flow
    and in block style, while `MAX_DEPTH` levels load."""
    assert _yaml_aliases(text) and yaml.safe_load(text) is not None  # plain PyYAML takes it
    with pytest.raises(yaml.YAMLError, match='aliases'):
        load_yaml(text, where='x')
    for deep in ('[' * (MAX_DEPTH + 1) + ']' * (MAX_DEPTH + 1),
                 ''.join(f'{"  " * i}k{i}:\n' for i in range(MAX_DEPTH)) + '  ' * MAX_DEPTH + 'v\n'):
        with pytest.raises(yaml.YAMLError, match=f'deeper than {MAX_DEPTH}'):
            load_yaml(deep, where='x')
    assert load_yaml('[' * MAX_DEPTH + ']' * MAX_DEPTH, where='x') is not None


@settings(max_examples=300, deadline=None)
@given(st.lists(_YAML_ALPHABET, max_size=60).map(''.join))
def test_load_yaml_raises_only_yaml_errors_and_never_loads_an_alias(text: str) -> None:
    try:
        load_yaml(text, where='x')
    except (yaml.YAMLError, ValueError, TypeError):
        pass  # the errors read_lock and load_skill word; nothing else may escape
    else:
        assert not _yaml_aliases(text), f'{text!r} loaded although it holds an alias'


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.none(), st.integers(-3, 30), st.text(max_size=4), st.booleans(),
                          st.dictionaries(st.sampled_from(['eventId', 'eventType', 'x']), st.text(max_size=4), max_size=3)),
                max_size=6))
def test_read_history_raises_only_input_errors(tmp_path: Path, events: list[Any]) -> None:
    path = tmp_path / 'h.json'
    path.write_text(json.dumps({'history': {'events': events}}))
    with pytest.raises(InputError) as info:
        read_history(path)
    assert str(info.value).startswith('DC040 ') and '\n' not in str(info.value)


# ---- output escaping (issue 12 item 4) -------------------------------------------------------------------------------

UNSAFE = [chr(c) for c in [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), 0x061C, 0x200E, 0x200F,
                           *range(0x202A, 0x202F), *range(0x2066, 0x206A)]]


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_printable_leaves_no_control_or_bidi_character(text: str) -> None:
    shown = printable(text)
    assert not any(char in shown for char in UNSAFE)
    safe = ''.join(char for char in text if char not in UNSAFE and char != '\\')
    assert printable(safe) == safe  # everything else is left as it is


def test_printable_escapes_visibly() -> None:
    assert printable('a\x1b[31mb\u202ec\x00\n\x9b') == 'a\\x1b[31mb\\u202ec\\x00\\n\\x9b'
    assert printable('line1\nline2\x1b', keep_newlines=True) == 'line1\nline2\\x1b'


def test_history_show_escapes_ids_and_stored_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversation whose id and messages hold an escape sequence and a bidi override, in a real SQLite store."""
    evil_id = 'c\x1b]0;owned\x07-\u202eevil'
    store = _store_with(tmp_path, evil_id, text='answer \x1b[2J\u2066hidden\u2069 \x9b')
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ['history', 'show', evil_id, '--store', f'sqlite:///{store}'])
    assert result.exit_code == 0, result.output
    for char in ('\x1b', '\x07', '\u202e', '\u2066', '\u2069', '\x9b'):
        assert char not in result.output
    assert 'c\\x1b]0;owned\\x07-\\u202eevil' in result.output
    assert 'answer \\x1b[2J\\u2066hidden\\u2069 \\x9b' in result.output
    as_json = CliRunner().invoke(app, ['history', 'show', evil_id, '--store', f'sqlite:///{store}', '--format', 'json'])
    assert json.loads(as_json.output)['conversation_id'] == evil_id  # JSON keeps the value, escaped by JSON itself
    assert '\x1b' not in as_json.output and '\u202e' not in as_json.output


def test_check_json_lists_the_engines_it_checked() -> None:
    result = CliRunner().invoke(app, ['check', PLAIN, '--format', 'json'])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)['engines'] == list(DURABLE_ENGINES)  # every durable engine, `local` not
    result = CliRunner().invoke(app, ['check', PLAIN, '--format', 'json', '--engine', 'dbos'])
    assert json.loads(result.output)['engines'] == ['dbos']


# ---- files we create (issue 12 item 4) ---------------------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_private_helpers(tmp_path: Path) -> None:
    os.umask(0o022)
    file = private_file(tmp_path / 'a' / 'b' / 'x.db')
    assert _mode(file) == 0o600 and _mode(file.parent) == 0o700 and _mode(file.parent.parent) == 0o700
    existing = tmp_path / 'mine.db'
    existing.write_text('x')
    existing.chmod(0o644)
    assert _mode(private_file(existing)) == 0o644  # a user's own file is left alone
    ours = tmp_path / '.durcap'
    ours.mkdir(mode=0o755)
    ours.chmod(0o755)
    assert _mode(private_dir(ours)) == 0o700  # the folder we own is tightened


def test_run_creates_private_files(tmp_path: Path) -> None:
    """A real `durcap run --engine dbos --conversation` in a fresh folder: .durcap 0700, its databases 0600."""
    code, output = durcap('run', PLAIN, 'hi', '--engine', 'dbos', '--conversation', 'c1', cwd=tmp_path, timeout=120)
    assert code == 0, output
    folder = tmp_path / '.durcap'
    assert _mode(folder) == 0o700
    files = sorted(p.name for p in folder.iterdir())
    assert {'conversations.db', 'dbos.sqlite'} <= set(files), files
    for path in folder.iterdir():
        assert _mode(path) == 0o600, (path.name, oct(_mode(path)))


@pytest.mark.timeout(400)  # four DBOS processes in turn (~10-40 s each on a loaded 2-core machine)
def test_runs_resume_of_a_run_whose_turn_is_in_another_store_is_one_line(tmp_path: Path) -> None:
    """A real `durcap run --engine dbos --conversation` (DBOS and the store on SQLite in a fresh folder), then `durcap
    runs resume` of that completed run with a `--store` that does not hold its turn (another store, a missing file):
    one line (DC044 naming the conversation and the other store; the missing store named), exit 2. A fresh-user trial
    got the store's `ConversationNotFoundError` traceback and exit 1. Without `--store` it prints the answer."""
    code, output = durcap('run', PLAIN, 'hi', '--engine', 'dbos', '--conversation', 'c1', cwd=tmp_path, timeout=120)
    assert code == 0, output
    [run_id] = {line.split()[-1] for line in output.splitlines() if line.startswith('workflow id: ')}
    other = _store_with(tmp_path, 'someone-else', name='other.db')
    for store, fragment in ((f'sqlite:///{other}', "DC044 conversation 'c1' is not in the store"),
                            (f'sqlite:///{tmp_path / "typo.db"}', 'no conversation store at')):
        code, output = durcap('runs', 'resume', run_id, '--engine', 'dbos', '--target', PLAIN, '--store', store,
                              cwd=tmp_path, timeout=120)
        assert 'Traceback' not in output and code == 2, (code, output[-3000:])
        [line] = [line for line in output.splitlines() if line.startswith('durcap: error: ')]
        assert fragment in line, output
    code, output = durcap('runs', 'resume', run_id, '--engine', 'dbos', '--target', PLAIN, cwd=tmp_path, timeout=120)
    assert code == 0 and 'had already completed' in output, output
