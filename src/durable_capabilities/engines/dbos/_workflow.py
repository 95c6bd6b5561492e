"""DBOS container code: the workflow per agent (`agent_workflow`), the decorator for the user's own workflows
(`workflow`), and `BoundAgent`, what such a workflow receives to run the agent durably."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from dbos import DBOS

from ... import _registry, interrupts, streams
from ...conversations import store_url
from ...turn import Turn, deps_from_json, run_turn
from ._approvals import DBOSApprovalGate
from ._conversation import conversation_steps
from ._spec import ENGINE, workflow_names

if TYPE_CHECKING:
    from ...agent import DurableAgent

P = ParamSpec('P')
R = TypeVar('R')


def _claim(definition: DurableAgent[Any, Any]) -> None:
    """Claim the agent's names in this process; its steps are global by name (DC011 on a clash)."""
    for name in (definition.name, *definition.previous_names):
        _registry.claim('DBOS agent', name, definition, 'registered with DBOS in this process')


class BoundAgent:
    """What a `@workflow(agent)` function receives as its first argument: `run()` durably inside the workflow.

    Attributes:
        store: The conversation store URL of its steps (`None`: `$DURCAP_STORE`, else the default store;
            `DurableAgent(conversation_store=...)` wins). DBOS runs one executor per process, so this is the
            process's value: `agent_workflow(store=...)` sets it for the one-shot run or the worker.
    """

    def __init__(self, definition: DurableAgent[Any, Any], store: str | None = None):
        _claim(definition)
        self.definition = definition
        self.agent = definition.build(ENGINE)
        self.store = store

    async def run(self, prompt: str | None = None, *, conversation_id: str | None = None, **kwargs: Any) -> Any:
        """One turn (`turn.run_turn`) on the DBOS-built agent; returns upstream's `AgentRunResult`.

        With `conversation_id`, the stored history is loaded and the new messages appended in DBOS steps
        (`durcap__{name}__conversation.load` / `.append`, the append idempotent by workflow id).

        Raises:
            DurableConfigError: capabilities passed per run (DC012); drift in the stored history.
        """
        return (await self.turn(prompt, conversation_id=conversation_id, **kwargs)).result

    async def turn(self, prompt: str | None = None, *, conversation_id: str | None = None, **kwargs: Any) -> Turn:
        """As `run`, returning the whole `turn.Turn`."""
        load, append, release = conversation_steps(self.definition, self.store)
        workflow_id = DBOS.workflow_id
        if workflow_id is None:  # not in a workflow: nothing durable to stream
            return await run_turn(self.definition, self.agent.run, prompt, conversation_id=conversation_id, load=load,
                                  append=append, release=release, gate=DBOSApprovalGate(self.definition), **kwargs)
        url = store_url(self.definition, self.store)
        # The model request steps check whether a newer turn asked this workflow's turn to stop (`interrupts`).
        with streams.publishing(_stream_id(workflow_id), ENGINE, url, conversation_id=conversation_id), \
                interrupts.watching(workflow_id if conversation_id is not None else None, url):
            return await run_turn(self.definition, self.agent.run, prompt, conversation_id=conversation_id, load=load,
                                  append=append, release=release, gate=DBOSApprovalGate(self.definition), **kwargs)


_TURNS: dict[str, int] = {}
"""Turns each workflow of this process has run so far (a workflow may run the agent more than once)."""


def _stream_id(workflow_id: str) -> str:
    """The stream of the workflow's next turn: the workflow id for its first, `{workflow id}.{n}` for its n-th
    (the same ids when a recovered workflow runs again: its turns run in the same order)."""
    count = _TURNS[workflow_id] = _TURNS.get(workflow_id, 0) + 1
    if len(_TURNS) > 10_000:
        _TURNS.pop(next(iter(_TURNS)))
    return workflow_id if count == 1 else f'{workflow_id}.{count}'



def workflow(agent: DurableAgent[Any, Any], *, name: str | None = None, **dbos_workflow_kwargs: Any) -> Callable[
    [Callable[..., Awaitable[R]]], Callable[..., Awaitable[R]]
]:
    """Decorate an async function as a `@DBOS.workflow` that receives the agent first.

    ```python
    @durable_capabilities.dbos.workflow(support)
    async def handle_ticket(agent, ticket_id: str) -> str:
        return (await agent.run(f'Ticket {ticket_id}')).output
    ```

    The agent is built (its steps registered with DBOS) when the decorator runs, so decorate at
    import time, before `DBOS.launch()`, as DBOS requires for every workflow and step. Call the
    decorated function without the agent argument: `await handle_ticket('T-1')`.

    Args:
        agent: The definition to run.
        name: DBOS workflow name (default: the function's qualified name, as `@DBOS.workflow`).
        dbos_workflow_kwargs: Passed to `DBOS.workflow` (e.g. `max_recovery_attempts`).
    """
    bound = BoundAgent(agent)

    def decorate(func: Callable[..., Awaitable[R]]) -> Callable[..., Awaitable[R]]:
        async def body(*args: Any, **kwargs: Any) -> R:
            return await func(bound, *args, **kwargs)

        # Not `functools.wraps`: its `__wrapped__` would show the agent parameter to callers.
        for attr in ('__module__', '__name__', '__qualname__', '__doc__'):
            setattr(body, attr, getattr(func, attr))
        return DBOS.workflow(name=name or func.__qualname__, **dbos_workflow_kwargs)(body)

    return decorate


_WORKFLOWS: dict[str, Any] = {}
_BOUND: dict[str, BoundAgent] = {}
_PREVIOUS_NAME_WORKFLOWS: set[str] = set()
"""DBOS workflow names `agent_workflow` registered only for an agent's previous names (see `application_version`)."""


def agent_workflow(agent: DurableAgent[Any, Any], *, store: str | None = None) -> Callable[..., Awaitable[dict[str, Any]]]:
    """A DBOS workflow named `durcap.{agent name}` that runs `agent` once (registered on first call).

    `store`: the conversation store URL its steps use from now on in this process (the run's or the worker's
    `--store`; `None`: `$DURCAP_STORE`, else the default store). Not a workflow input: a store URL may carry a
    password, and a recovered workflow uses the store of the process that recovers it.

    Call before `DBOS.launch()`. Arguments: `prompt: str | None`, `deps: dict | None` (validated into
    `deps_type`), `message_history: list[dict] | None` (pydantic-ai message JSON), `conversation_id`
    (load the stored history in step `durcap__{name}__conversation.load`, append the new messages in
    step `...append`, idempotent by workflow id), `busy: str | None` (what the turn does when another run's turn
    holds the conversation: `'reject'` | `'enqueue'`, `None`: the agent's `busy`). Returns
    `{'output', 'new_messages', 'usage'}` as JSON-compatible data; with a conversation, `{'output', 'usage',
    'appended'}` naming the append instead of the messages (`Turn.payload`; `conversations.resolve_payload` reads
    either form).
    """
    existing = _WORKFLOWS.get(agent.name)
    if existing is not None:
        _claim(agent)  # DC011 when another definition has one of the agent's names
        _BOUND[agent.name].store = store
        return existing
    bound = _BOUND[agent.name] = BoundAgent(agent, store)  # claims the agent's names first

    async def run_agent(
        prompt: str | None, deps: Any = None, message_history: Any = None, conversation_id: str | None = None,
        busy: str | None = None,
    ) -> dict[str, Any]:
        turn = await bound.turn(prompt, deps=deps_from_json(agent, deps), message_history=message_history,
                                conversation_id=conversation_id, busy=busy)
        # A turn appended to its conversation names its append (`dbos:{workflow id}`, as the append step wrote it)
        # instead of recording its messages again as the workflow's output (`conversations.resolve_payload`).
        return turn.payload(append_id=f'dbos:{DBOS.workflow_id}')

    name, *previous_names = workflow_names(agent)
    registered = DBOS.workflow(name=name)(run_agent)
    for previous in previous_names:
        # Workflows recorded under an earlier agent name recover through the same body.
        async def run_previous(
            prompt: str | None, deps: Any = None, message_history: Any = None, conversation_id: str | None = None,
            busy: str | None = None,
        ) -> dict[str, Any]:
            return await run_agent(prompt, deps, message_history, conversation_id, busy)

        DBOS.workflow(name=previous)(run_previous)
        _PREVIOUS_NAME_WORKFLOWS.add(previous)
    _WORKFLOWS[agent.name] = registered
    return registered
