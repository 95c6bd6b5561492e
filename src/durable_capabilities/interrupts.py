"""Interrupting a turn (`busy='interrupt'`): the check inside the model request unit.

What runs where:
- A newer turn with `busy='interrupt'` asks the run whose turn holds the conversation to stop: its load unit writes
  the request on the holder's claim row (`SQLConversationStore.request_stop`, in `conversations.claim_turn`), then
  waits for the conversation as `'enqueue'` does. The interrupting caller (`runner.run`, outside any durable unit)
  also denies each call of the holder that waits for approval, through the engine's own decision path.
- The holder's safe point is its next model request: `InterruptModel`, the agent's model inside its model request
  unit (a Temporal activity, a DBOS step, a Prefect task, the local run), reads whether its run was asked to stop
  (`SQLConversationStore.stop_requested`, one indexed read); if so the request is not sent and the unit returns a final
  text answer saying the turn was interrupted by run X (`interrupted_text`). That answer is the unit's recorded
  result: replay and recovery see the same, and the turn is stored as any turn is, with what it did before.
- The unit knows its run and store from the `TurnClaim` the engine's container puts in a context variable around the
  turn (`watching`: the local run, the DBOS workflow, the Prefect flow) or around the model request activity
  (Temporal's worker interceptor). Without one (a run without a conversation) the wrapper passes every request on.

Only an agent whose output may be plain text can end that way (`conversations.text_output`); `busy='interrupt'`
is refused for the others where it is chosen (DC053), and their model is not wrapped.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart
from pydantic_ai.models import ModelRequestParameters
from pydantic_ai.models.function import AgentInfo, DeltaToolCalls, FunctionModel
from pydantic_ai.models.wrapper import WrapperModel
from pydantic_ai.settings import ModelSettings

from .conversations import process_store, text_output

if TYPE_CHECKING:
    from .agent import DurableAgent

__all__ = ['INTERRUPTED_PREFIX', 'InterruptModel', 'TurnClaim', 'interrupted_text', 'watching', 'wrap_interrupt']

logger = logging.getLogger('durable_capabilities.interrupts')

INTERRUPTED_PREFIX = 'Interrupted: '
"""How an interrupted turn's answer starts (`interrupted_text`)."""


def interrupted_text(by: str) -> str:
    """The final answer of a turn interrupted by run `by` (a newer turn on its conversation)."""
    return (f'{INTERRUPTED_PREFIX}a newer turn (run {by}) took over this conversation; this turn stopped before its '
            'next model request. What it did before is kept.')


@dataclass(frozen=True)
class TurnClaim:
    """The run whose turn runs in this context and the store holding its claim.

    Attributes:
        run_id: The holder of the turn claim (workflow id, flow run id, the local run's holder id).
        store_url: The conversation store URL.
    """

    run_id: str
    store_url: str


_current: ContextVar[TurnClaim | None] = ContextVar('durcap_turn_claim', default=None)


@contextmanager
def watching(run_id: str | None, store_url: str) -> Iterator[None]:
    """Within this block, the model requests of the turn of `run_id` (its claim in the store at `store_url`) check
    whether it was asked to stop (`InterruptModel`). `run_id` `None`: nothing is checked."""
    token = _current.set(TurnClaim(run_id, store_url) if run_id else None)
    try:
        yield
    finally:
        _current.reset(token)


def current() -> TurnClaim | None:
    """The `TurnClaim` of the turn running in this context, `None` outside `watching`."""
    return _current.get()


def _absent(store_url: str) -> bool:
    """Whether `store_url` is a SQLite file that does not exist: it holds no claim, and reading it would create it (a
    Temporal run without a conversation checks too: its store must stay untouched)."""
    if not store_url.startswith('sqlite:///') or ':memory:' in store_url:
        return False
    return not Path(store_url[len('sqlite:///'):].split('?', 1)[0]).is_file()


async def stopped_by() -> str | None:
    """The run that asked the turn running in this context to stop, else `None` (also outside `watching`, and when
    the store cannot be read: the request is then sent, with one warning; the claim still keeps turns apart)."""
    claim = _current.get()
    if claim is None or _absent(claim.store_url):
        return None
    try:
        return await process_store(claim.store_url).stop_requested(claim.run_id)
    except Exception as error:  # noqa: BLE001 - an unreadable flag never fails the model request
        logger.warning('run %s: could not read whether it was asked to stop (%s: %s); the model request is sent',
                       claim.run_id, type(error).__name__, str(error).splitlines()[0] if str(error) else '')
        return None


class InterruptModel(WrapperModel):
    """The agent's model inside its model request unit: a request of a turn asked to stop is not sent; the unit returns
    `interrupted_text` as the model's final answer instead (see the module docstring).

    Args:
        wrapped: The model (already wrapped for a budget and streams).
    """

    async def request(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                      model_request_parameters: ModelRequestParameters) -> ModelResponse:
        by = await stopped_by()
        if by is not None:
            logger.info('run %s: interrupted by run %s; its model request was not sent', _run(), by)
            return ModelResponse(parts=[TextPart(interrupted_text(by))], model_name=self.model_name)
        return await self.wrapped.request(messages, model_settings, model_request_parameters)

    @asynccontextmanager
    async def request_stream(self, messages: list[ModelMessage], model_settings: ModelSettings | None,
                             model_request_parameters: ModelRequestParameters,
                             run_context: Any = None) -> AsyncIterator[Any]:
        by = await stopped_by()
        if by is None:
            async with self.wrapped.request_stream(messages, model_settings, model_request_parameters,
                                                   run_context) as stream:
                yield stream
            return
        logger.info('run %s: interrupted by run %s; its model request was not sent', _run(), by)
        text = interrupted_text(by)

        async def answer(_: list[ModelMessage], __: AgentInfo) -> AsyncIterator[str | DeltaToolCalls]:
            yield text

        async with FunctionModel(stream_function=answer, model_name=self.model_name).request_stream(
                messages, model_settings, model_request_parameters, run_context) as stream:
            yield stream


def _run() -> str:
    claim = _current.get()
    return claim.run_id if claim is not None else '?'


def wrap_interrupt(model: Any, agent: DurableAgent[Any, Any]) -> Any:
    """`model` wrapped in `InterruptModel` when `agent`'s output may be plain text (`None`, or another agent's model,
    as given)."""
    if model is None or isinstance(model, InterruptModel) or not text_output(agent):
        return model
    return InterruptModel(model)
