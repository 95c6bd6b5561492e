"""Run turns of one conversation on DBOS or Prefect in this process and report what the engine recorded of each
turn's conversation load unit, as JSON (`test_conversation_heads.py`).

    HEADS_OUT=DIR [HEADS_CRASH_AT=TURN] python -m tests.engines.heads_driver ENGINE --store URL --out DIR
        --turns N [--db URL] [--old-form] [--recover RUN_ID]

ENGINE is `dbos` or `prefect` (Prefect: against `PREFECT_API_URL`, results in `PREFECT_LOCAL_STORAGE_PATH`). Each
turn is one `runner.run(..., conversation_id='heads')`: the prompt, a tool call returning `$HEADS_RESULT_BYTES`
(default 20,000) characters that differ every turn, the answer. The model is a scripted `FunctionModel`.

- `--old-form`: the load unit returns the rows, as it did before heads existed (`load_unit(by_head=False)`): what a
  workflow or flow run recorded by an earlier version holds (on Prefect with `--task-units`: that version's flow).
- `--task-units` (Prefect): the flow loads and appends through the `Load Conversation` / `Append Conversation` tasks,
  as the flow of earlier versions did (`engines.prefect._conversation.conversation_tasks`): a flow run recorded
  by that version.
- `$HEADS_CRASH_AT`: the tool of that turn SIGKILLs this process (once: a marker file in DIR), after the turn's load
  unit was recorded. Each run's id is written to `DIR/run-id` when it starts.
- `$HEADS_CRASH_AFTER_APPEND`: the append of that turn SIGKILLs this process (once) right after the store committed
  it, before the engine recorded it done.
- `--old-result`: the workflow / flow returns the turn's messages inline, as it did before results named their append
  (`Turn.payload` without `append_id`).
- `--delete-after`: delete the conversation from the store (`durcap history delete`) after the turns, then read the
  runs again (`runs show`).
- `--recover RUN_ID`: finish that run (DBOS: resumed on a queue of this process, as `durcap runs resume` does, its
  recorded steps returned; Prefect:
  the flow run set back to Scheduled and run again, its finished tasks from the cache) and report it.

The report is one line, `REPORT {json}`: `{'outputs': [...], 'calls': {'model': n, 'tool': n}, 'loads': [{'run_id',
'type', 'bytes', 'rows'}],
'results': [{'run_id', 'bytes', 'appended', 'messages', 'tool_return_chars', 'shown_capabilities', 'shown_notes'}]}`,
one load and one result per run (the recorded workflow output / flow result: its size, whether it names its append,
the `RunReport`'s messages and tool return characters, and `runs show`'s capabilities and notes); load per run: the class of the load unit's recorded result, its recorded size (DBOS: the `operation_outputs.output`
text; Prefect: the flow run input `durcap-loaded`'s JSON, else the `Load Conversation` task's persisted result
file), and how many message rows it holds (`None` for a head); on Prefect also `task`, the same of the run's
`Load Conversation` task (`None` when it has none) and `conversation_task_runs`, how many conversation task runs the
run has. `calls`: the model requests and tool calls this process made.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ModelRequest, ToolReturnPart, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent, runner

OUT = Path(os.environ.get('HEADS_OUT', '.'))
CRASH_AT = int(os.environ.get('HEADS_CRASH_AT') or 0)
CRASH_AFTER_APPEND = int(os.environ.get('HEADS_CRASH_AFTER_APPEND') or 0)
CALLS = {'model': 0, 'tool': 0}


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    """Call `fetch(turn)` once after each prompt, then answer with the result's size."""
    CALLS['model'] += 1
    last = messages[-1]
    if isinstance(last, ModelRequest) and any(isinstance(p, UserPromptPart) for p in last.parts):
        turn = sum(1 for m in messages if isinstance(m, ModelRequest) and any(isinstance(p, UserPromptPart) for p in m.parts))
        return ModelResponse(parts=[ToolCallPart('fetch', {'turn': turn}, tool_call_id=f'call-{turn}')])
    size = sum(len(str(p.content)) for p in getattr(last, 'parts', ()) if isinstance(p, ToolReturnPart))
    return ModelResponse(parts=[TextPart(f'read {size} characters')])


reports = Capability(id='reports', description='Fetches long reports.')


@reports.tool_plain
def fetch(turn: int) -> str:
    """~$HEADS_RESULT_BYTES characters of hex, different every turn; SIGKILLs the process at turn `$HEADS_CRASH_AT`
    (once)."""
    CALLS['tool'] += 1
    marker = OUT / 'crashed'
    if turn == CRASH_AT and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    size = int(os.environ.get('HEADS_RESULT_BYTES') or 20_000)
    seed, lines, total = str(turn), [], 0
    while total < size:
        seed = hashlib.sha256(seed.encode()).hexdigest()
        lines.append(seed)
        total += len(seed) + 1
    return '\n'.join(lines)


agent = DurableAgent('heads', FunctionModel(script), capabilities=[reports])
CID = 'heads'


def _old_form() -> None:
    """The load unit as before heads existed: it returns the rows (what an earlier version's records hold)."""
    from durable_capabilities.engines import _conversation_unit
    from durable_capabilities.engines.dbos import _conversation as dbos_conversation
    from durable_capabilities.engines.prefect import _conversation as prefect_conversation

    original = _conversation_unit.load_unit

    def rows_form(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, 'by_head': False})

    dbos_conversation.load_unit = rows_form  # type: ignore[assignment]
    prefect_conversation.load_unit = rows_form  # type: ignore[assignment]


def _task_units() -> None:
    """The Prefect flow loads and appends through the tasks of earlier versions, as their flow did."""
    from durable_capabilities.engines.prefect import _conversation, _flow

    def units(agent: Any, store: Any = None) -> tuple[Any, Any]:
        load_task, append_task = _conversation.conversation_tasks(agent, store)

        async def load(conversation_id: str, busy: str | None = None) -> Any:
            return await (load_task(conversation_id) if busy is None else load_task(conversation_id, busy))

        return load, append_task

    _flow.conversation_units = units  # type: ignore[assignment]


def _crash_after_append() -> None:
    """SIGKILL this process right after the store committed turn `$HEADS_CRASH_AFTER_APPEND`'s append (once)."""
    from durable_capabilities.engines import _conversation_unit

    real = _conversation_unit.append_conversation

    async def append(agent: Any, conversation_id: str, messages: list[dict[str, Any]], **kwargs: Any) -> int:
        revision = await real(agent, conversation_id, messages, **kwargs)
        marker = OUT / 'crashed-after-append'
        if revision == CRASH_AFTER_APPEND and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        return revision

    _conversation_unit.append_conversation = append  # type: ignore[assignment]


def _dbos_load(run_id: str, db: str) -> dict[str, Any]:
    import base64
    import pickle
    import sqlite3

    with sqlite3.connect(db.removeprefix('sqlite:///')) as conn:
        (output,) = conn.execute("SELECT output FROM operation_outputs WHERE workflow_uuid = ? AND function_name LIKE "
                                 "'%conversation.load'", (run_id,)).fetchone()
    value = pickle.loads(base64.b64decode(output))  # DBOS's default serializer: pickle, then base64
    return {'run_id': run_id, 'type': type(value).__name__, 'bytes': len(output), 'rows': _rows(value)}


async def _prefect_load(run_id: str) -> dict[str, Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from durable_capabilities.engines.prefect._conversation import from_recorded
    from durable_capabilities.engines.prefect._spec import LOADED_INPUT

    async with get_client() as client:
        tasks = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)])))
        try:
            recorded: str | None = await client.read_flow_run_input(uuid.UUID(run_id), LOADED_INPUT)
        except Exception:  # noqa: BLE001 - 404: the run recorded none
            recorded = None
    task: dict[str, Any] | None = None
    loads = [t for t in tasks if t.name.startswith('Load Conversation')]
    if loads:  # a resumed flow run has a second load task run, its result the cached one of the first
        load = max(loads, key=lambda t: t.created or 0)
        assert load.state is not None
        value = await load.state.result()
        key = Path(load.state.data.storage_key)  # type: ignore[union-attr]
        path = key if key.is_absolute() else Path(os.environ['PREFECT_LOCAL_STORAGE_PATH']) / key
        task = {'type': type(value).__name__, 'bytes': path.stat().st_size, 'rows': _rows(value)}
    conversation_tasks = sum(1 for t in tasks if 'Conversation' in t.name)
    if recorded is None:
        assert task is not None, [t.name for t in tasks]
        return {'run_id': run_id, **task, 'task': task, 'conversation_task_runs': conversation_tasks}
    value = from_recorded(json.loads(recorded))
    return {'run_id': run_id, 'type': type(value).__name__, 'bytes': len(recorded), 'rows': _rows(value), 'task': task,
            'conversation_task_runs': conversation_tasks}


def _dbos_result(run_id: str, db: str) -> tuple[int, bool]:
    import base64
    import pickle
    import sqlite3

    with sqlite3.connect(db.removeprefix('sqlite:///')) as conn:
        (output,) = conn.execute('SELECT output FROM workflow_output WHERE workflow_uuid = ?', (run_id,)).fetchone()
    value = pickle.loads(base64.b64decode(output))
    return len(output), 'appended' in value and 'new_messages' not in value


async def _prefect_result(run_id: str) -> tuple[int, bool]:
    from prefect import get_client

    async with get_client() as client:
        flow_run = await client.read_flow_run(uuid.UUID(run_id))
    assert flow_run.state is not None
    value = await flow_run.state.result()
    key = Path(flow_run.state.data.storage_key)  # type: ignore[union-attr]
    path = key if key.is_absolute() else Path(os.environ['PREFECT_LOCAL_STORAGE_PATH']) / key
    return path.stat().st_size, 'appended' in value and 'new_messages' not in value


async def _show(engine: str, run_id: str, settings: dict[str, Any]) -> Any:
    from durable_capabilities.engines import get

    return await get(engine).show_run(run_id, settings)


def _old_result() -> None:
    """The workflow / flow returns the messages inline, as before results named their append."""
    from durable_capabilities.turn import Turn

    original = Turn.payload

    def inline(self: Turn, *, messages_as_json: bool = False, append_id: str | None = None) -> dict[str, Any]:
        return original(self, messages_as_json=messages_as_json)

    Turn.payload = inline  # type: ignore[method-assign]


def _rows(value: Any) -> int | None:
    rows = getattr(value, 'rows', None)
    return len(rows) if rows is not None else None


async def _recover_dbos(run_id: str, db: str) -> Any:
    """As `durcap runs resume`: this process's own queue, the workflow resumed on it, its result."""
    from dbos import DBOS

    from durable_capabilities.engines.dbos import agent_workflow
    from durable_capabilities.engines.dbos._server import launch

    agent_workflow(agent, store=os.environ['DURCAP_STORE'])
    queue = f'heads-resume-{uuid.uuid4().hex[:8]}'
    # As the version the run was started as (`runner.run` on DBOS runs as its agent's worker version, `serving`;
    # `durcap runs resume` launches as the run's recorded one): DBOS hands a workflow only to a process of its version
    launch(system_database_url_=db, one_shot=True, listen=[queue], serving=[agent])
    try:
        await DBOS.register_queue_async(queue)
        handle = await DBOS.resume_workflow_async(run_id, queue_name=queue)
        return await handle.get_result()
    finally:
        DBOS.destroy()


async def _recover_prefect(run_id: str) -> Any:
    from prefect import get_client
    from prefect.states import Scheduled

    from durable_capabilities.engines.prefect import agent_flow
    from durable_capabilities.engines.prefect._client import run_flow_run
    from durable_capabilities.engines.prefect._flow import run_store

    async with get_client() as client:
        flow_run = await client.read_flow_run(uuid.UUID(run_id))
        await client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
    with run_store(os.environ['DURCAP_STORE']):
        return await run_flow_run(agent_flow(agent), flow_run.id, dict(flow_run.parameters))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine', choices=['dbos', 'prefect'])
    parser.add_argument('--store', required=True)
    parser.add_argument('--out', required=True)
    parser.add_argument('--turns', type=int, default=1)
    parser.add_argument('--db')
    parser.add_argument('--old-form', action='store_true')
    parser.add_argument('--recover')
    parser.add_argument('--old-result', action='store_true')
    parser.add_argument('--delete-after', action='store_true')
    parser.add_argument('--task-units', action='store_true')
    args = parser.parse_args()
    os.environ['DURCAP_STORE'] = args.store
    if args.task_units:
        _task_units()
    if CRASH_AFTER_APPEND:
        _crash_after_append()
    if args.old_form:
        _old_form()
    if args.old_result:
        _old_result()
    reports: list[Any] = []
    settings: dict[str, Any] = {'db': args.db} if args.engine == 'dbos' else {}
    run_ids: list[str] = []
    outputs: list[Any] = []

    def started(run_id: str) -> None:
        run_ids.append(run_id)
        (Path(args.out) / 'run-id').write_text(run_id)

    if args.recover:
        run_ids.append(args.recover)
        if args.engine == 'dbos':
            outputs.append(asyncio.run(_recover_dbos(args.recover, args.db))['output'])
        else:
            outputs.append(asyncio.run(_recover_prefect(args.recover)).output)
    for n in range(1, args.turns + 1):
        report = asyncio.run(runner.run(agent, f'turn {n}: fetch', engine=args.engine, conversation_id=CID,
                                        run_id=f'heads-{uuid.uuid4().hex[:10]}' if args.engine == 'dbos' else None,
                                        notify=lambda line: None, on_start=started, **settings))
        outputs.append(report.output)
        reports.append(report)
    if args.delete_after:
        from durable_capabilities.store import SQLConversationStore

        async def delete() -> None:
            with SQLConversationStore(args.store) as store:
                await store.purge(CID)

        asyncio.run(delete())
    results = []
    for run_id, report in zip(run_ids[-len(reports):] if reports else [], reports, strict=True):
        size, appended = _dbos_result(run_id, args.db) if args.engine == 'dbos' else asyncio.run(_prefect_result(run_id))
        shown = asyncio.run(_show(args.engine, run_id, settings))
        results.append({'run_id': run_id, 'bytes': size, 'appended': appended, 'messages': len(report.new_messages),
                        'tool_return_chars': sum(len(str(p.content)) for m in report.new_messages for p in m.parts
                                                 if isinstance(p, ToolReturnPart)),
                        'shown_capabilities': shown.capabilities, 'shown_notes': shown.notes})
    loads = [_dbos_load(run_id, args.db) if args.engine == 'dbos' else asyncio.run(_prefect_load(run_id))
             for run_id in run_ids]
    print('REPORT ' + json.dumps({'outputs': outputs, 'calls': CALLS, 'loads': loads, 'results': results}), flush=True)


if __name__ == '__main__':
    main()
