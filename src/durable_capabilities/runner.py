"""Run a `DurableAgent` once on any engine and report what the engine recorded.

Used by `durcap run` and `durcap demo`; each engine's path is the one its users know:
- local: `Agent.run` in-process, nothing durable.
- temporal: start the agent's workflow on a task queue (a worker must serve it; `inline_worker`
  runs one in this process for the duration of the run) and read the activity types from the
  workflow history.
- dbos: register a workflow per agent, `DBOS.launch()`, run it under a workflow id, list its steps.
- prefect: call the agent's flow (against `PREFECT_API_URL` if set, else Prefect's ephemeral
  server) and list its task runs.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_ai.usage import RunUsage
from pydantic_core import to_jsonable_python

from .agent import DurableAgent


@dataclass
class RunReport:
    """What one run produced.

    Attributes:
        engine: The engine it ran on.
        run_id: Workflow id (Temporal, DBOS) or flow run id (Prefect); `None` locally.
        output: The agent's output.
        new_messages: Messages the run added.
        usage: Tokens and requests (`RunUsage`).
        durable_units: Names of the durable units the engine recorded, in order (activity types,
            step names, task run names).
    """

    engine: str
    run_id: str | None
    output: Any
    new_messages: list[ModelMessage]
    usage: RunUsage
    durable_units: list[str] = field(default_factory=list)

    def loaded_capabilities(self) -> list[str]:
        """Capability ids the run loaded with `load_capability`, in order."""
        from pydantic_ai.messages import ToolCallPart

        loaded: list[str] = []
        for message in self.new_messages:
            for part in getattr(message, 'parts', []):
                if isinstance(part, ToolCallPart) and part.tool_name == 'load_capability':
                    cap = part.args_as_dict().get('id')
                    if cap and cap not in loaded:
                        loaded.append(cap)
        return loaded


async def run_local(
    agent: DurableAgent[Any, Any], prompt: str, *, deps: Any = None, message_history: Any = None,
    conversation_id: str | None = None,
) -> RunReport:
    result = await agent.run(prompt, deps=deps, message_history=message_history, conversation_id=conversation_id)
    return RunReport('local', None, result.output, result.new_messages(), result.usage)


async def run_temporal(
    agent: DurableAgent[Any, Any],
    prompt: str,
    *,
    address: str,
    task_queue: str,
    deps: Any = None,
    message_history: Any = None,
    inline_worker: bool = False,
    workflow_id: str | None = None,
    conversation_id: str | None = None,
) -> RunReport:
    from contextlib import AsyncExitStack

    from temporalio.api.enums.v1 import EventType

    from .engines import temporal

    client = await temporal.connect(address)
    workflow_id = workflow_id or f'{agent.name}-{uuid.uuid4()}'
    async with AsyncExitStack() as stack:
        if inline_worker:
            await stack.enter_async_context(temporal.make_worker(client, [agent], task_queue))
        handle = await temporal.start_run(
            client, agent, prompt, task_queue=task_queue, workflow_id=workflow_id, deps=deps,
            message_history=message_history, conversation_id=conversation_id,
        )
        result = await handle.result()
        # Walk every run of the chain: continue-as-new starts a new run with its own history.
        units: list[str] = []
        run_id: str | None = handle.first_execution_run_id or handle.result_run_id
        while run_id:
            run_handle = client.get_workflow_handle(workflow_id, run_id=run_id)
            run_id = None
            async for event in run_handle.fetch_history_events():
                if event.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
                    units.append(event.activity_task_scheduled_event_attributes.activity_type.name)
                elif event.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_CONTINUED_AS_NEW:
                    run_id = event.workflow_execution_continued_as_new_event_attributes.new_execution_run_id
    return RunReport('temporal', workflow_id, result.output, result.messages(), result.usage, units)


async def run_dbos(
    agent: DurableAgent[Any, Any],
    prompt: str,
    *,
    deps: Any = None,
    message_history: Any = None,
    system_database_url: str | None = None,
    workflow_id: str | None = None,
    conversation_id: str | None = None,
) -> RunReport:
    from dbos import DBOS, SetWorkflowID

    from .engines import dbos as dbos_engine

    workflow = dbos_engine.agent_workflow(agent)
    dbos_engine.launch('durcap', system_database_url_=system_database_url)
    try:
        workflow_id = workflow_id or f'{agent.name}-{uuid.uuid4()}'
        history = ModelMessagesTypeAdapter.dump_python(message_history, mode='json') if message_history else None
        with SetWorkflowID(workflow_id):
            payload = await workflow(prompt, to_jsonable_python(deps) if deps is not None else None, history, conversation_id)
        steps = await DBOS.list_workflow_steps_async(workflow_id)
        units = [step['function_name'] for step in steps]
    finally:
        DBOS.destroy()
    return RunReport(
        'dbos', workflow_id, payload['output'], ModelMessagesTypeAdapter.validate_python(payload['new_messages']),
        RunUsage(**payload['usage']), units,
    )


async def _settled_task_runs(flow_run_id: Any, model_requests: int, timeout: float = 30.0) -> list[Any]:
    """The flow run's task runs once Prefect has recorded them all.

    Prefect 3 records task runs from events, asynchronously: listed right after the flow returns, the
    last ones can be missing. Poll (up to `timeout` seconds) until every task run is final, there is a
    `Model Request` task per model response, and the list has not changed for a second.
    """
    import asyncio
    import time

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    previous: list[tuple[str, str]] = []
    stable_since = time.monotonic()
    async with get_client() as client:
        while True:
            runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            snapshot = sorted((str(r.id), str(r.state_type)) for r in runs)
            if snapshot != previous:
                previous, stable_since = snapshot, time.monotonic()
            done = all(r.state is not None and r.state.is_final() for r in runs)
            enough = sum(1 for r in runs if r.name.startswith('Model Request')) >= model_requests
            if (done and enough and time.monotonic() - stable_since >= 1.0) or time.monotonic() > deadline:
                return list(runs)
            await asyncio.sleep(0.2)


async def run_prefect(
    agent: DurableAgent[Any, Any], prompt: str, *, deps: Any = None, message_history: Any = None,
    conversation_id: str | None = None,
) -> RunReport:
    from .engines import prefect as prefect_engine

    flow = prefect_engine.agent_flow(agent)
    history = ModelMessagesTypeAdapter.dump_python(message_history, mode='json') if message_history else None
    state = await flow(
        prompt=prompt, deps=to_jsonable_python(deps) if deps is not None else None, message_history=history,
        conversation_id=conversation_id, return_state=True,
    )
    payload = await state.result()
    flow_run_id = state.state_details.flow_run_id
    model_requests = sum(1 for m in payload['new_messages'] if m.get('kind') == 'response')
    task_runs = await _settled_task_runs(flow_run_id, model_requests)
    units = [t.name for t in sorted(task_runs, key=lambda t: (t.expected_start_time or t.created, t.name))]
    return RunReport(
        'prefect', str(flow_run_id), payload['output'], ModelMessagesTypeAdapter.validate_python(payload['new_messages']),
        RunUsage(**payload['usage']), units,
    )
