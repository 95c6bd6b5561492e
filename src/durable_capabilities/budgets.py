"""Enforcing a `Budget` inside the model request unit, and reading the ledger (`durcap budgets`).

What runs where:
- The turn (`turn.py`, the engine's container code) computes the budget key of the run (`Budget.key`) and puts
  `{key, run, store}` into the run's `model_settings` under `budget.BUDGET_SETTING`, which every engine carries into
  its model request unit with the request (a Temporal activity's input, a DBOS step's or Prefect task's arguments).
- `BudgetModel` is the agent's model there: it takes the key out of the settings, reserves the request in the store
  (`SQLConversationStore.budget_reserve`, refused: `BudgetExceededError`, DC060, before anything is sent), sends it,
  and settles the reservation with the provider's usage. The reservation is keyed by the run and the request's place
  in it (`{run}#{number of messages sent}`), the same when the unit is retried, so a request is counted once.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic_ai import Tool
from pydantic_ai.messages import ModelMessage, ModelRequest, ModelResponse, RetryPromptPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings

from ._limits import printable
from .budget import BUDGET_SETTING, RAISE_TOOL, Budget, BudgetExceededError
from .conversations import process_store, store_url

if TYPE_CHECKING:
    from .agent import DurableAgent
    from .store import SQLConversationStore

__all__ = ['RAISE_TOOL', 'BudgetModel', 'budget_tools', 'set_worker_store', 'wrap_budget']

_WORKER_STORES: dict[str, str | None] = {}
"""`{agent durable name: store URL}` of the workers of this process (a Temporal worker's `--store`): where a model
request activity, which receives no store from its workflow, keeps the ledger."""


def set_worker_store(agent: DurableAgent[Any, Any], store: str | None) -> None:
    """Make `store` (a worker's `--store`) the ledger of `agent`'s model requests run in this process when the turn
    named none (Temporal: the workflow does not know the worker's store)."""
    _WORKER_STORES[agent.durable_name] = store


class BudgetModel(WrapperModel):
    """The agent's model inside its model request unit, when its definition has a `Budget` (see the module docstring).

    Args:
        wrapped: The model (already wrapped for streams where the engine publishes).
        agent: The definition (its `budget`, its conversation store).
    """

    def __init__(self, wrapped: Any, agent: DurableAgent[Any, Any]):
        super().__init__(wrapped)
        self.agent = agent
        assert agent.budget is not None
        self.budget: Budget = agent.budget

    def _store(self, given: str | None) -> SQLConversationStore:
        url = self.budget.store or given or _WORKER_STORES.get(self.agent.durable_name)
        return process_store(store_url(self.agent, url))

    async def _admit(self, messages: list[ModelMessage], settings: dict[str, Any]) -> tuple[Any, str, str, str]:
        """Reserve the request; refused: `BudgetExceededError`. Returns `(store, key, request id, run id)`."""
        store = self._store(settings.get('store'))
        key, run = str(settings['key']), str(settings['run'])
        request_id = f'{run}#{len(messages)}'
        refused = await store.budget_reserve(key, request_id, run, self.budget.limits())
        if refused is not None:
            from .store._budgets import exceeded

            name = exceeded(refused) or 'total_tokens'
            limit = refused.limit(name)
            raise BudgetExceededError(name, key, refused.spent.get(name, 0), limit if limit is not None else 0,
                                      self.model_name)
        return store, key, request_id, run

    def _ask(self, error: BudgetExceededError, messages: list[ModelMessage], settings: dict[str, Any]) -> ModelResponse:
        """With `on_exceed='approval'`: instead of the request, a call of `RAISE_TOOL` (which needs approval), so the
        run waits durably for an operator; refused again right after a decision (denied, or raised too little): the
        error."""
        if self.budget.on_exceed != 'approval':
            raise error
        if (decided := _raise_decided(messages)) is not None:
            raise BudgetExceededError(error.budget, error.key, error.spent, error.limit, error.model_name, decided=decided)
        by = self.budget.raise_by if self.budget.raise_by is not None else max(error.limit, error.spent - error.limit + 1)
        args = {'budget': error.budget, 'key': error.key, 'by': by, 'spent': error.spent, 'limit': error.limit,
                'store': settings.get('store')}
        return ModelResponse(parts=[ToolCallPart(RAISE_TOOL, args, tool_call_id=f'durcap-budget-{len(messages)}')],
                             model_name=self.model_name)

    async def _settle(self, admitted: tuple[Any, str, str, str], response: ModelResponse) -> None:
        store, key, request_id, run = admitted
        usage = response.usage
        await store.budget_settle(key, request_id, run, input_tokens=usage.input_tokens,
                                  output_tokens=usage.output_tokens, cost=self.budget.price(response))

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        settings, budget = _split(model_settings)
        if budget is None:
            return await self.wrapped.request(messages, settings, model_request_parameters)
        try:
            admitted = await self._admit(messages, budget)
        except BudgetExceededError as error:
            return self._ask(error, messages, budget)
        try:
            response = await self.wrapped.request(_without_raises(messages), settings, model_request_parameters)
        except BaseException:
            await admitted[0].budget_release(admitted[1], admitted[2])
            raise
        await self._settle(admitted, response)
        return response

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: Any = None) -> AsyncIterator[Any]:
        settings, budget = _split(model_settings)
        if budget is None:
            async with self.wrapped.request_stream(messages, settings, model_request_parameters, run_context) as stream:
                yield stream
            return
        admitted = await self._admit(messages, budget)  # a stream cannot be answered by a call: no approval here
        try:
            async with self.wrapped.request_stream(_without_raises(messages), settings, model_request_parameters,
                                                   run_context) as stream:
                yield stream
        except BaseException:
            await admitted[0].budget_release(admitted[1], admitted[2])
            raise
        await self._settle(admitted, stream.get())


def _raise_decided(messages: list[ModelMessage]) -> str | None:
    """What became of the `RAISE_TOOL` call whose result the last request carries, as a clause of the DC060 line
    (`'the raise by 51 was denied by alice (enough for today)'`); `None` when the last request carries none."""
    last = messages[-1] if messages else None
    if not isinstance(last, ModelRequest):
        return None
    results = [p for p in last.parts if isinstance(p, ToolReturnPart | RetryPromptPart) and p.tool_name == RAISE_TOOL]
    if not results:
        return None
    result = results[0]
    calls = [p for m in messages if isinstance(m, ModelResponse) for p in m.parts
             if isinstance(p, ToolCallPart) and p.tool_call_id == result.tool_call_id]
    by = calls[-1].args_as_dict().get('by') if calls else None
    the_raise = 'the raise' if by is None else f'the raise by {by:g}' if isinstance(by, float) else f'the raise by {by}'
    if isinstance(result, RetryPromptPart):
        return f'{the_raise} was not made ({printable(str(result.content))[:200]})'
    if result.outcome == 'denied':  # `approvals.deferred_results`' words: "denied by alice (reason)", or the deadline
        return f'{the_raise} was {printable(str(result.content))[:300]}'
    if result.outcome == 'success':
        return f'{the_raise} was approved and made, and the spend is still at or over the raised limit'
    return f'{the_raise} failed ({printable(str(result.content))[:200]})'


def _without_raises(messages: list[ModelMessage]) -> list[ModelMessage]:
    """`messages` without the `RAISE_TOOL` calls and their results (the model never made them): what it is sent."""
    if not any(isinstance(p, ToolCallPart) and p.tool_name == RAISE_TOOL
               for m in messages if isinstance(m, ModelResponse) for p in m.parts):
        return messages
    kept: list[ModelMessage] = []
    for message in messages:
        parts = [p for p in message.parts if getattr(p, 'tool_name', None) != RAISE_TOOL]
        if parts:
            kept.append(replace(message, parts=parts))  # type: ignore[type-var]
    return kept


def raise_tool(agent: DurableAgent[Any, Any]) -> Tool[Any]:
    """The `RAISE_TOOL` of `agent` (`on_exceed='approval'`): approved by an operator, it raises the budget's limit by
    the amount the call names, in the ledger (run as the engine's tool unit)."""

    async def durcap_raise_budget(budget: str, key: str, by: float, spent: float = 0, limit: float = 0,
                                  store: str | None = None) -> str:
        """Raise a spent budget (an operator approves every call; the model is never asked to call this)."""
        budget_def = agent.budget
        assert budget_def is not None
        url = budget_def.store or store or _WORKER_STORES.get(agent.durable_name)
        record = await process_store(store_url(agent, url)).budget_raise(key, budget, by)
        return f'budget {budget} of {key} raised by {by:g}: the limit is now {record.limit(budget):g}'

    return Tool(durcap_raise_budget, name=RAISE_TOOL, requires_approval=True)


def budget_tools(agent: DurableAgent[Any, Any]) -> list[Tool[Any]]:
    """The tools `agent`'s built agents get for its budget: `RAISE_TOOL` with `on_exceed='approval'`, else none."""
    return [raise_tool(agent)] if agent.budget is not None and agent.budget.on_exceed == 'approval' else []


def _split(model_settings: ModelSettings | None) -> tuple[ModelSettings | None, dict[str, Any] | None]:
    """`(the settings without the budget entry, the entry)`; settings without one as given."""
    if not model_settings or BUDGET_SETTING not in model_settings:
        return model_settings, None
    rest = dict(model_settings)
    entry = rest.pop(BUDGET_SETTING)
    return (rest or None), entry  # type: ignore[return-value]


def wrap_budget(model: Any, agent: DurableAgent[Any, Any]) -> Any:
    """`model` wrapped in `BudgetModel` for `agent` (`None` as given)."""
    if model is None or isinstance(model, BudgetModel):
        return model
    return BudgetModel(model, agent)
