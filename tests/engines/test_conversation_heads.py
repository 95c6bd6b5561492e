"""What DBOS and Prefect record of a turn's conversation load (issue 24): the conversation's head (revision, head entry
id, count), a few hundred bytes whatever the history's length, not the history again; and runs recorded before heads
existed (a load unit's result holding the rows) still finish.

Real servers: DBOS on a SQLite system database, the session's Prefect server. The turns run in subprocesses
(`heads_driver.py`; the model is a scripted `FunctionModel`); the recorded results are read back from DBOS's system
database (`operation_outputs`) and from Prefect's result storage.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from durable_capabilities.store import SQLConversationStore
from tests._helpers import ROOT, subprocess_env

HEAD_BYTES = 1_000
"""A recorded head's size is bounded by this (pickled, base64 on DBOS): ids and a revision, no message."""


def drive(engine: str, tmp_path: Path, env: dict[str, str], *args: str, crash: bool = False) -> dict[str, Any]:
    """Run `heads_driver.py` and return its report (with `crash`: expect the process to be killed, return `{}`)."""
    out = tmp_path / 'out'
    out.mkdir(exist_ok=True)
    command = [sys.executable, '-m', 'tests.engines.heads_driver', engine, '--store', env['DURCAP_STORE'],
               '--out', str(out), *args]
    done = subprocess.run(command, cwd=ROOT, env=subprocess_env({**env, 'HEADS_OUT': str(out)}), capture_output=True,
                          text=True, timeout=240)
    if crash:
        assert done.returncode == -9, done.stderr[-3000:]
        return {}
    assert done.returncode == 0, done.stderr[-3000:]
    line = [x for x in done.stdout.splitlines() if x.startswith('REPORT ')][-1]
    return json.loads(line.removeprefix('REPORT '))


def engine_env(engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[dict[str, str], list[str]]:
    env = {'DURCAP_STORE': f'sqlite:///{tmp_path / "conversations.db"}', 'HEADS_RESULT_BYTES': '20000'}
    if engine == 'dbos':
        return env, ['--db', f'sqlite:///{tmp_path / "dbos.sqlite"}']
    env |= {'PREFECT_API_URL': request.getfixturevalue('prefect_api_url'), 'PREFECT_HOME': str(tmp_path / 'prefect-home'),
            'PREFECT_LOCAL_STORAGE_PATH': str(tmp_path / 'prefect-results'), 'PREFECT_LOGGING_LEVEL': 'WARNING'}
    return env, []


def stored_prompts(env: dict[str, str]) -> list[str]:
    async def read() -> list[str]:
        with SQLConversationStore(env['DURCAP_STORE']) as store:
            stored = await store.read('heads')
        return [str(part.content) for m in stored.messages for part in m.parts if part.part_kind == 'user-prompt']

    return asyncio.run(read())


@pytest.mark.parametrize('engine', ['dbos', 'prefect'])
def test_the_recorded_load_is_a_head_of_constant_size_whatever_the_history(
        engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    env, args = engine_env(engine, tmp_path, request)
    report = drive(engine, tmp_path, env, '--turns', '4', *args)
    assert report['outputs'] == ['read 20019 characters'] * 4
    loads = report['loads']
    # Turn 1 loads a new conversation (nothing stored); turns 2-4 load 4, 8, 12 messages (~20 KB each turn).
    assert [load['type'] for load in loads] == ['LoadedConversation', 'LoadedHead', 'LoadedHead', 'LoadedHead']
    assert all(load['rows'] in (None, 0) for load in loads), loads
    assert all(load['bytes'] < HEAD_BYTES for load in loads), loads
    assert max(load['bytes'] for load in loads[1:]) - min(load['bytes'] for load in loads[1:]) < 16, loads
    assert stored_prompts(env) == [f'turn {n}: fetch' for n in range(1, 5)]
    if engine == 'prefect':  # recorded as flow run input by the flow's code: no conversation task run, no result file
        assert [(load['task'], load['conversation_task_runs']) for load in loads] == [(None, 0)] * 4, loads


@pytest.mark.parametrize('engine', ['dbos', 'prefect'])
def test_a_run_whose_load_recorded_the_rows_recovers_with_them(
        engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The first process runs the load unit as before heads existed (its recorded result holds the rows; on Prefect,
    the flow of that version, whose load and append were tasks) and is killed in turn 2's tool, after that load was
    recorded; the second (this version) finishes the run, then runs a turn of its own, which records a head. Turn 2's
    first model request is not made again (1 model request and the killed tool call to finish it, 2 and 1 for the new
    turn)."""
    env, args = engine_env(engine, tmp_path, request)
    old = ['--old-form', '--task-units'] if engine == 'prefect' else ['--old-form']
    drive(engine, tmp_path, env | {'HEADS_CRASH_AT': '2'}, '--turns', '2', *old, *args, crash=True)
    run_id = (tmp_path / 'out' / 'run-id').read_text()
    report = drive(engine, tmp_path, env, '--recover', run_id, '--turns', '1', *args)
    assert report['outputs'] == ['read 20019 characters'] * 2
    assert report['calls'] == {'model': 3, 'tool': 2}, report['calls']
    recovered, new = report['loads']
    # The old form, as recorded: DBOS replays it; Prefect's flow code loads again (the run still holds the turn's
    # claim: the same history) and records a head.
    old_load = recovered if engine == 'dbos' else recovered['task']
    assert (old_load['type'], old_load['rows']) == ('LoadedConversation', 4)
    assert old_load['bytes'] > 20_000  # turn 1's tool result among them
    if engine == 'prefect':
        assert recovered['type'] == 'LoadedHead' and recovered['bytes'] < HEAD_BYTES, recovered
    assert new['type'] == 'LoadedHead' and new['bytes'] < HEAD_BYTES
    assert stored_prompts(env) == ['turn 1: fetch', 'turn 2: fetch', 'turn 1: fetch']  # the driver's new turn counts from 1


@pytest.mark.parametrize('units', ['tasks', 'flow'])
def test_a_prefect_flow_run_killed_after_its_append_finishes_without_running_anything_again(
        units: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Killed right after the store committed turn 2's append, before Prefect recorded it done; run again by this
    version (as `durcap runs resume` does), the flow run finishes with no model request, no tool call and no second
    append. `tasks`: the run was recorded by an earlier version, its load and append tasks (the `Load Conversation`
    task is called again and returns its cached result, the history before the append); `flow`: by this one (its load
    recorded as flow run input). Turn 1 ran in the killed process, so turn 2 started from that process's cached
    history (`turn._remember`): decoded as another process decodes it, or the resumed run's model request keys differ
    (`usage.audio_seconds` 0 against 0.0) and everything runs again. Real Prefect server; the model is a scripted
    `FunctionModel`."""
    env, args = engine_env('prefect', tmp_path, request)
    recorded_by = ['--task-units'] if units == 'tasks' else []
    drive('prefect', tmp_path, env | {'HEADS_CRASH_AFTER_APPEND': '2'}, '--turns', '2', *recorded_by, *args, crash=True)
    assert stored_prompts(env) == ['turn 1: fetch', 'turn 2: fetch']
    run_id = (tmp_path / 'out' / 'run-id').read_text()
    report = drive('prefect', tmp_path, env, '--recover', run_id, *args, '--turns', '0')
    assert report['outputs'] == ['read 20019 characters']
    assert report['calls'] == {'model': 0, 'tool': 0}, report['calls']
    assert stored_prompts(env) == ['turn 1: fetch', 'turn 2: fetch']  # the turn once
    [load] = report['loads']
    assert load['type'] == 'LoadedHead', load
    if units == 'tasks':
        assert load['task'] is not None and load['task']['type'] == 'LoadedHead', load
    else:
        assert (load['task'], load['conversation_task_runs']) == (None, 0), load


RESULT_BYTES = 1_000
"""A recorded workflow output / flow result naming its append is bounded by this: output, usage and the append's ids."""


@pytest.mark.parametrize('engine', ['dbos', 'prefect'])
def test_the_recorded_result_names_its_append_and_the_report_reads_the_messages_back(
        engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Turns with a 20 KB and a 2 KB tool result record results of the same size (no message in them); the
    `RunReport` and `runs show` still have each turn's messages, read from the store. Once the conversation is
    deleted, `runs show` says its messages are not readable (no crash). The model is a scripted `FunctionModel`."""
    env, args = engine_env(engine, tmp_path, request)
    big = drive(engine, tmp_path, env, '--turns', '1', *args)
    small = drive(engine, tmp_path, env | {'HEADS_RESULT_BYTES': '2000'}, '--turns', '1', '--delete-after', *args)
    (first,), (second,) = big['results'], small['results']
    assert first['appended'] and second['appended']
    assert first['bytes'] < RESULT_BYTES and abs(first['bytes'] - second['bytes']) < 16, (first, second)
    assert (first['messages'], first['tool_return_chars']) == (4, 20019)
    assert (second['messages'], second['tool_return_chars']) == (4, 2014)
    assert first['shown_notes'] == []  # read before the delete
    assert len(second['shown_notes']) == 1 and 'not readable' in second['shown_notes'][0] \
        and "conversation 'heads' is not in the store" in second['shown_notes'][0], second['shown_notes']


@pytest.mark.parametrize('engine', ['dbos', 'prefect'])
def test_a_result_with_its_messages_inline_is_still_read(
        engine: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A workflow / flow returning the messages inline (as before results named their append) reports them as
    before, and `runs show` reads it, even once the conversation is deleted. The model is a scripted `FunctionModel`."""
    env, args = engine_env(engine, tmp_path, request)
    report = drive(engine, tmp_path, env, '--turns', '1', '--old-result', '--delete-after', *args)
    (result,) = report['results']
    assert not result['appended'] and result['bytes'] > 20_000  # the form before: the messages in the result
    assert (result['messages'], result['tool_return_chars']) == (4, 20019)
    assert result['shown_notes'] == []
