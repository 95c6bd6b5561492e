"""Prefect container code: the flow per agent (`agent_flow`), run in this process, by a deployment's flow-run
process (`_entry`) or by `durcap runs resume`."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from prefect import flow
from prefect.context import FlowRunContext
from prefect.runtime import flow_run

from ... import _registry, interrupts, streams
from ...conversations import store_url
from ...turn import deps_from_json, run_turn
from .._conversation_unit import read_back
from ._approvals import PrefectApprovalGate
from ._conversation import conversation_units, release
from ._liveness import beating
from ._results import result_store, settle
from ._spec import ENGINE, flow_name

if TYPE_CHECKING:
    from ...agent import DurableAgent

_FLOWS: dict[str, Any] = {}

_RUN_STORE: ContextVar[str | None] = ContextVar('durcap_prefect_run_store', default=None)


@contextmanager
def run_store(url: str | None) -> Iterator[None]:
    """Within this block (this task and the tasks it starts), a flow run of `agent_flow` in this process loads and
    appends its conversation on `url` (the run's `--store`; `None`: `$DURCAP_STORE`, else the default store).

    A value of the run, not a flow parameter: a store URL may carry a password, and Prefect records parameters. A
    flow run a deployment starts in its own process has none: it resolves `$DURCAP_STORE` there."""
    token = _RUN_STORE.set(url)
    try:
        yield
    finally:
        _RUN_STORE.reset(token)


def agent_flow(agent: DurableAgent[Any, Any]) -> Any:
    """The Prefect flow that runs `agent` (one per agent name and process).

    Flow parameters (JSON, so deployments and schedules can carry them): `prompt: str | None`,
    `deps: dict | None` (validated into `deps_type`), `message_history: list[dict] | None`
    (pydantic-ai's message JSON), `conversation_id: str | None`, `busy: str | None` (what the turn does when another
    run's turn holds the conversation: `'reject'` | `'enqueue'`, `None`: the agent's `busy`). Returns
    `{'output': ..., 'new_messages': '[...]', 'usage': {...}}` as JSON-compatible data, `new_messages` being the new
    messages as one JSON string (`ModelMessagesTypeAdapter.validate_json` reads it; see `Turn.payload` for why); with
    a conversation, `{'output', 'usage', 'appended'}` naming the append instead (`conversations.resolve_payload`).
    """
    _registry.claim('Prefect flow', agent.name, agent, 'given Prefect flows in this process')  # DC011 on a clash
    existing = _FLOWS.get(agent.name)
    if existing is not None and existing.__durcap_agent__ is agent:
        return existing
    built = agent.build(ENGINE)
    # In the flow's code, not tasks: no task run and no persisted result per turn (`_conversation`).
    load_unit, append_unit = conversation_units(agent, _RUN_STORE.get)
    release_claim = release(agent, _RUN_STORE.get)
    read = read_back(agent, store=_RUN_STORE.get, release=release_claim)

    async def load(conversation_id: str, busy: str | None = None) -> Any:
        return await read(conversation_id, await load_unit(conversation_id, busy))  # a head names the rows: read them

    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> Any:
        append_id = f'prefect:{flow_run.id}'
        appended = await append_unit(conversation_id, messages, revision, append_id, usage)
        # The tool results' texts are in the conversation now: their pieces point there (`_results.settle`).
        await asyncio.to_thread(settle, conversation_id, append_id)
        return appended

    async def run_agent(
        prompt: str | None = None,
        deps: dict[str, Any] | None = None,
        message_history: list[dict[str, Any]] | None = None,
        conversation_id: str | None = None,
        busy: str | None = None,
    ) -> dict[str, Any]:
        # The run's events go to the flow run's stream (a retried flow run keeps its id: the finished tasks are not
        # run again, and the events the flow's own code publishes again are keys the log already has).
        # Every flow run beats while it runs (`_liveness`): a deployment's that dies with its serving process is found
        # and marked CRASHED; one outside a deployment (`durcap run`) killed with its process is told apart from a live
        # one by `durcap store gc` (abandoned: `_runs.run_states`), however long a tool of a live one runs.
        context = FlowRunContext.get()
        in_flow = context is not None and context.flow_run is not None
        url = store_url(agent, _RUN_STORE.get())
        # The model request tasks check whether a newer turn asked this flow run's turn to stop (`interrupts`).
        with beating(str(flow_run.id)) if in_flow else nullcontext(), result_store(url), \
                streams.publishing(str(flow_run.id), ENGINE, url, conversation_id=conversation_id), \
                interrupts.watching(str(flow_run.id) if conversation_id is not None else None, url):
            turn = await run_turn(agent, built.run, prompt, deps=deps_from_json(agent, deps),
                                  message_history=message_history, conversation_id=conversation_id, load=load,
                                  append=append, release=release_claim, gate=PrefectApprovalGate(agent), busy=busy)
        # A turn appended to its conversation names its append instead of carrying its messages again in the flow
        # run's persisted result (`conversations.resolve_payload` reads them back).
        return turn.payload(messages_as_json=True, append_id=f'prefect:{flow_run.id}')

    run_agent.__name__ = re.sub(r'\W', '_', f'run_{agent.name}')
    decorated = flow(name=flow_name(agent), persist_result=True)(run_agent)
    decorated.__durcap_agent__ = agent  # type: ignore[attr-defined]
    _FLOWS[agent.name] = decorated
    return decorated
