"""The one conversation turn: load the stored history, run the agent, append what the run added.

Every engine's durable container calls `run_turn` (the Temporal workflow body, the DBOS workflow and
`@dbos.workflow` functions through `BoundAgent`, the Prefect flow) and so does a local run; only the
two store units differ (an activity, a step, a task, or a plain call in-process). What a run returns,
`report.RunReport`, is built from a turn's payload.

Messages cross engine boundaries as pydantic-ai's message JSON (`ModelMessagesTypeAdapter`), which
every engine can record and which keeps instruction ids intact.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import TypeAdapter
from pydantic_ai.exceptions import AgentRunError, UsageLimitExceeded
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter
from pydantic_core import to_json, to_jsonable_python

from . import interrupts, telemetry
from ._limits import one_line
from ._turn_log import TurnLog, recording
from .aliases import rewrite_history
from .conversations import (  # noqa: F401 - _DECODED and DECODED_CACHE_SIZE re-exported (tests, bench)
    _DECODED,
    DECODED_CACHE_SIZE,
    _remember,
    append_conversation,
    claim_turn,
    decode_history,
    load_conversation,
    release_turn,
    store_url,
)
from .errors import DurcapError

if TYPE_CHECKING:
    from .agent import DurableAgent
    from .approvals import ApprovalGate
    from .conversations import LoadedConversation


class TurnRequestLimitError(UsageLimitExceeded, DurcapError, code='DC061'):
    """A turn made its request limit of model requests across its approval rounds and its model asked for approval
    again (problem DC061): each round is a new `Agent.run`, whose own limit starts at 0, so a model that keeps calling
    a tool needing approval (on a local run each call is denied at once) looped without end. Raised before the calls
    are put to a person; a pydantic-ai `UsageLimitExceeded` (an `AgentRunError`: Temporal fails the workflow, no
    engine retries it).

    Attributes:
        requests: The turn's model requests so far.
        limit: The request limit: the `usage_limits` the turn's runs were given (none of durcap's engines passes
            one), else pydantic-ai's default `UsageLimits().request_limit`, 50.
        tools: The tools the model asked for again.
    """

    def __init__(self, requests: int, limit: int, tools: Sequence[str]):
        self.requests, self.limit, self.tools = requests, limit, list(tools)
        # `AgentRunError`'s own init: `UsageLimitExceeded`'s appends pydantic-ai's "Consider raising the limit" hint,
        # and durcap passes no limit a user could raise
        message = (f'DC061 the turn made {requests} model requests, its request limit ({limit}), and its model asked '
                   f'again for approval of {", ".join(sorted(set(self.tools)))}: stopped before another round (the '
                   'limit counts every approval round of the turn); tell the model what to do when a call is denied '
                   '(a local run denies each call at once; on a durable engine a person decides each)')
        AgentRunError.__init__(self, message)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.requests, self.limit, self.tools))


LoadUnit = Callable[..., Awaitable['LoadedConversation']]
"""`load(conversation_id, busy) -> LoadedConversation`: the engine's durable unit that claims the conversation for
the run's turn (`busy`: `'reject'` | `'enqueue'` | `None`, see `conversations.claim_turn`) and reads it."""

AppendUnit = Callable[[str, list[dict[str, Any]], 'int | None', dict[str, Any]], Awaitable[Any]]
"""`append(conversation_id, new messages JSON, expected revision, usage JSON)`: the engine's unit that appends."""


@dataclass
class TurnState:
    """What a turn knows while its agent runs (read by engine hooks such as Temporal's continue-as-new).

    Attributes:
        conversation_id: The conversation the turn appends to, or `None`.
        revision: The stored revision the turn loaded (`None`: new conversation or none).
        messages: The starting history (stored, or given by the caller), decoded once.
        log: The messages the run added so far, identified by run (`_turn_log.TurnLog`): complete even
            when a history processor compacted the run's message list.
        history: `messages` as message JSON (dumped on first use).
    """

    conversation_id: str | None
    revision: int | None
    messages: list[ModelMessage] = field(default_factory=list)
    log: TurnLog = field(default_factory=TurnLog)
    _history: list[dict[str, Any]] | None = field(default=None, repr=False)

    @property
    def history(self) -> list[dict[str, Any]]:
        history = self._history
        if history is None:
            history = self._history = ModelMessagesTypeAdapter.dump_python(self.messages, mode='json')
        return history


_current: ContextVar[TurnState | None] = ContextVar('durcap_turn', default=None)

_claimed: ContextVar[str | None] = ContextVar('durcap_turn_claimed', default=None)
"""The run id whose conversation claim the caller already took (`claimed_by_caller`)."""


@contextmanager
def claimed_by_caller(run_id: str) -> Iterator[None]:
    """Within the block (and the tasks it starts), the in-process load of run `run_id`'s turn (`run_turn` with the
    default units, `run_id` its claim's holder) does not claim the conversation again: the caller took the claim for
    `run_id` itself (`durcap serve`'s local turn: in the transaction recording the run, before its 202), and holds it
    from there until the turn's append releases it, as the load's own claim would be held. Saves the load's write
    transaction and its trip to a worker thread; a turn of any other run id claims as before."""
    token = _claimed.set(run_id)
    try:
        yield
    finally:
        _claimed.reset(token)


def _streams() -> Any:
    """The `streams` package when this process imported it (every container that publishes does, before its turn),
    else `None`: a Temporal workflow's sandbox never imports it (the schemas of its event types cost a workflow task
    seconds on a loaded machine), and its turns publish nothing."""
    return sys.modules.get(f'{__package__}.streams')


async def _publish(kind: str, data: dict[str, Any], *more: tuple[str, dict[str, Any]], close: bool = False,
                   carry: str | None = None) -> None:
    """`streams.publish_run` when the package is imported (a no-op outside a publishing container)."""
    module = _streams()
    if module is not None:
        await module.publish_run(kind, data, *more, close=close, carry=carry)


def _jsonable(value: Any) -> Any:
    module = _streams()
    return module.jsonable(value) if module is not None else repr(value)


def current_turn() -> TurnState | None:
    """The `TurnState` of the turn running in this context (`None` outside `run_turn`)."""
    return _current.get()


class Turn:
    """What one turn produced.

    Attributes:
        result: Upstream's `AgentRunResult`.
        state: The turn's `TurnState` (starting history, loaded revision).
        new_messages: The messages the run added, as message JSON, in the order they were created: the
            prompt, every response and tool return, and any message a history processor introduced (a
            compaction), even when the processor dropped earlier ones from the run's list. Built from the
            message objects on first read, once (a run whose caller never reads them, e.g. a DBOS workflow that
            returns only the output and stores nothing, never pays for it).
        usage: The run's usage as JSON-compatible data.
        appended: The conversation's revision after the turn's append (`None`: no conversation, nothing appended).
    """

    def __init__(self, result: Any, state: TurnState, messages: Sequence[ModelMessage],
                 usage: dict[str, Any], added: Sequence[dict[str, Any]] = ()):
        self.result, self.state, self.usage = result, state, usage
        self._messages, self._added = list(messages), list(added)
        self._json: list[dict[str, Any]] | None = None
        self.appended: int | None = None

    @property
    def new_messages(self) -> list[dict[str, Any]]:
        if self._json is None:
            self._json = [*ModelMessagesTypeAdapter.dump_python(self._messages, mode='json'), *self._added]
        return self._json

    def __repr__(self) -> str:
        return f'Turn(result={self.result!r}, new_messages={len(self._messages) + len(self._added)})'

    def payload(self, *, messages_as_json: bool = False, append_id: str | None = None) -> dict[str, Any]:
        """`{'output', 'new_messages', 'usage'}` as JSON-compatible data (what DBOS and Prefect containers return).

        When the turn was appended to a conversation and `append_id` names that append (`dbos:{workflow id}`,
        `prefect:{flow run id}`), the payload names the append instead of carrying the messages:
        `{'output', 'usage', 'appended': {'conversation_id', 'append_id', 'revision', 'messages'}}` (`revision`: the
        conversation's after the append; `messages`: how many it wrote). The engine records a few hundred bytes
        whatever the turn's size; `conversations.resolve_payload` reads the messages back from the store.

        Args:
            append_id: The append's id in the store (see above); `None`: the messages inline.
            messages_as_json: `new_messages` as one JSON string (a JSON array of message JSON) instead of a list:
                the Prefect flow returns it so, as Prefect walks every item of a flow's return value (looking for
                futures and states) before persisting it: about 18,000 calls for the 11 messages of a 6-request run,
                against a handful for one string. Written from the message objects in one pass when the list was
                not built. `RunReport.from_payload` reads either form.
        """
        messages: Any
        if append_id is not None and self.appended is not None and self.state.conversation_id is not None:
            return {'output': to_jsonable_python(self.result.output), 'usage': self.usage,
                    'appended': {'conversation_id': self.state.conversation_id, 'append_id': append_id,
                                 'revision': self.appended, 'messages': len(self.new_messages)}}
        if not messages_as_json:
            messages = self.new_messages
        elif self._json is None and not self._added:
            messages = ModelMessagesTypeAdapter.dump_json(self._messages).decode()
        else:
            messages = to_json(self.new_messages).decode()
        return {'output': to_jsonable_python(self.result.output), 'new_messages': messages, 'usage': self.usage}


async def run_turn(
    agent: DurableAgent[Any, Any],
    run: Callable[..., Awaitable[Any]],
    prompt: str | None,
    *,
    deps: Any = None,
    message_history: Sequence[Any] | None = None,
    conversation_id: str | None = None,
    load: LoadUnit | None = None,
    append: AppendUnit | None = None,
    gate: ApprovalGate | None = None,
    store: str | None = None,
    carried: Sequence[dict[str, Any]] | None = None,
    busy: str | None = None,
    release: Callable[[str], Awaitable[Any]] | None = None,
    run_id: str | None = None,
    **run_kwargs: Any,
) -> Turn:
    """One turn of `agent`: load the conversation, run, append the new messages.

    Args:
        agent: The definition (its aliases rewrite old capability ids in the history).
        run: The built agent's `run` (called with `prompt`, `deps=`, `message_history=`, `run_kwargs`).
        prompt: The user prompt (`None` to continue from the history alone).
        deps: The run's deps, already of `deps_type` (see `deps_from_json`).
        message_history: Prior messages (objects or message JSON); replaced by the stored history when
            `conversation_id` is given.
        conversation_id: Conversation to load from and append to, or `None`.
        load / append: The engine's durable units around the store (an activity, a step, a task);
            default: in-process calls (`load_conversation`, `append_conversation` with a fresh append id) on `store`.
        gate: The engine's `approvals.ApprovalGate`: when given, a run that ends with `DeferredToolRequests`
            (tool calls needing approval) waits on it for decisions and continues with `DeferredToolResults`
            until the agent produces its final output; the audit of each pause is stored in the `metadata`
            of the request carrying the decided results (`approvals.AUDIT_METADATA_KEY`).
        store: The store URL of the default `load` / `append` (the run's `--store`; `None`: `$DURCAP_STORE`, else
            the default store; `DurableAgent(conversation_store=...)` wins, see `conversations.store_url`).
        carried: Compaction summaries (message JSON) an earlier part of this agent run wrote and did not store
            (Temporal's continue-as-new: `TurnLog.split`); stored with this part's messages where they fit.
        busy: What to do when another run's turn holds the conversation: `'reject'` (DC050 before any side effect)
            or `'enqueue'` (wait for it); `None`: `DurableAgent(busy=...)`. Passed to `load`, which claims the
            conversation for this run (one turn at a time per conversation); the append releases the claim.
        release: The engine's call that frees this run's claim when the turn fails before its append
            (`release(conversation_id)`, idempotent); default with the default units: in-process.
        run_id: The run's id for the reservations of a `Budget` (default: the run's stream id, else the approval
            gate's run id, else a fresh `local-{uuid}`); with the default in-process units also the holder of the
            conversation's turn claim (default a fresh `local:{uuid}`).

    Returns:
        The `Turn`.

    Raises:
        DurableConfigError: drift in the stored history (DC018/DC019), raised by `load`.
        ConversationBusyError: DC050, another run's turn holds the conversation and the strategy is `'reject'`.
    """
    agent.check_run_capabilities(run_kwargs.pop('capabilities', None))
    if getattr(agent, 'budget', None) is not None:
        run_kwargs['model_settings'] = _budget_settings(agent, run_kwargs.get('model_settings'), run_id, gate, store,
                                                        conversation_id, deps)
    messages = _as_messages(message_history)
    cache_key = (agent.durable_name, conversation_id) if conversation_id is not None else None
    holder: str | None = None
    if conversation_id is not None and load is None:
        # The in-process run's id when the caller gives one (the local engine: its stream's id, which a `durcap serve`
        # claimed the conversation for before starting the turn), else a fresh one.
        holder = run_id or f'local:{uuid.uuid4()}'
        load, append, release = _local_load(agent, store, holder), _local_append(agent, store, holder), _local_release(
            agent, store, holder)
    elif conversation_id is not None and append is None:
        append = _local_append(agent, store, f'local:{uuid.uuid4()}')
    # The in-process units' claim: its model requests check whether a newer turn asked it to stop (`interrupts`).
    with telemetry.turn_span(agent.name, conversation_id), \
            interrupts.watching(holder, store_url(agent, store)) if holder is not None else nullcontext():
        return await _turn(agent, run, prompt, deps, messages, conversation_id, cache_key, load, append, gate, carried,
                           busy, release, run_kwargs)


async def _turn(agent: DurableAgent[Any, Any], run: Callable[..., Awaitable[Any]], prompt: str | None, deps: Any,
                messages: list[ModelMessage], conversation_id: str | None, cache_key: tuple[str, str] | None,
                load: LoadUnit | None, append: AppendUnit | None, gate: ApprovalGate | None,
                carried: Sequence[dict[str, Any]] | None, busy: str | None,
                release: Callable[[str], Awaitable[Any]] | None, run_kwargs: dict[str, Any]) -> Turn:
    """`run_turn` after its units are chosen: load, run, append."""
    revision: int | None = None
    if conversation_id is None:
        return await _run(agent, run, prompt, deps, messages, conversation_id, revision, cache_key, None, gate,
                          carried, run_kwargs)
    assert load is not None
    loaded = await (load(conversation_id, busy) if busy is not None else load(conversation_id))  # type: ignore[misc]
    try:
        revision = loaded.revision
        if loaded.rows is not None:
            messages = decode_history(cache_key, loaded.rows, conversation_id)  # type: ignore[arg-type]
        else:
            messages = ModelMessagesTypeAdapter.validate_python(loaded.messages) if loaded.messages else []
        return await _run(agent, run, prompt, deps, messages, conversation_id, revision, cache_key, append, gate,
                          carried, run_kwargs)
    except Exception:
        if release is not None:  # the turn ends without its append: the conversation is free again
            await release(conversation_id)
        raise


async def _run(agent: DurableAgent[Any, Any], run: Callable[..., Awaitable[Any]], prompt: str | None, deps: Any,
               messages: list[ModelMessage], conversation_id: str | None, revision: int | None,
               cache_key: tuple[str, str] | None, append: AppendUnit | None, gate: ApprovalGate | None,
               carried: Sequence[dict[str, Any]] | None, run_kwargs: dict[str, Any]) -> Turn:
    """The turn after its load: run the agent (waiting on `gate` for decisions), then `append` what it added."""
    history = rewrite_history(messages or None, agent.aliases)
    state = TurnState(conversation_id, revision, messages)
    module = _streams()
    stream = module.current_stream() if module is not None else None
    if stream is not None:
        stream.conversation_id = conversation_id
        # With the run's first durable unit where the stream defers (a Temporal workflow: its first model request
        # activity stores them before its own events).
        await _publish('run_started', {'agent': agent.name, 'engine': stream.engine,
                                       'conversation_id': conversation_id, 'prompt': prompt},
                       ('capability_catalog', {'capabilities': agent.capability_ids()}), carry='next')
    token = _current.set(state)
    try:
        if gate is not None:
            run_kwargs.setdefault('output_type', _with_deferred(agent.output_type))
        with recording(history, _as_messages(carried)) as state.log:
            result = await run(prompt, deps=deps, message_history=history, **run_kwargs)
            state.log.observe(result.all_messages(), result.run_id)
        # The run's messages by run, not by index: a history processor may have rewritten the list (_turn_log),
        # with its summaries where the stored conversation's post-compaction window stays whole.
        logged = state.log.stored()
        added: list[dict[str, Any]] = []
        pending: list[ModelMessage] = []
        if gate is not None and _approval_requests(result) is not None:
            # Written now: the continuation runs on these message objects. Summaries with no place before the
            # calls waiting for approval go after the continuation (which returns them).
            placed, pending = state.log.split()
            added, logged = ModelMessagesTypeAdapter.dump_python(placed, mode='json'), []
        usage = result.usage
        limit = _request_limit(run_kwargs)
        while gate is not None and _approval_requests(result) is not None:
            if limit is not None and usage.requests >= limit and gate.bounds_rounds():  # before anyone is asked
                raise TurnRequestLimitError(usage.requests, limit, [c.tool_name for c in result.output.approvals])
            result, more = await _await_decisions(agent, gate, run, result, conversation_id, deps, run_kwargs)
            added += more
            usage = usage + result.usage
            if _approval_requests(result) is None and pending:
                added += ModelMessagesTypeAdapter.dump_python(pending, mode='json')
    except BaseException as error:
        if stream is not None and isinstance(error, Exception):
            await _publish('run_failed', _failed_data(error), close=True)
        raise
    finally:
        _current.reset(token)
    turn = Turn(result, state, logged, to_jsonable_python(usage), added)
    # A stream that defers (a Temporal workflow's) has the append unit store the turn's closing events once the
    # append succeeded: no unit of their own.
    closing = stream is not None and stream.defers and conversation_id is not None and append is not None
    if closing:
        await _publish('turn_stored', {'conversation_id': conversation_id, 'messages': len(turn.new_messages)},
                       ('run_completed', {'output': _jsonable(result.output), 'usage': turn.usage,
                                          'new_messages': len(turn.new_messages)}), close=True, carry='after')
    if conversation_id is not None and append is not None:
        try:
            appended = await append(conversation_id, turn.new_messages, revision, turn.usage)
        except Exception as error:
            # The append failed for good (its unit's retries are spent): the stream ends with the failure, not open
            # (a deferring stream's closing events rode with the failed unit and were not stored).
            if stream is not None:
                await _publish('run_failed', {'error': _failure_text(error)}, close=True)
            raise
        if isinstance(appended, int) and not isinstance(appended, bool):
            turn.appended = appended
        # Not after a rebased append (another turn went in between): the history is no longer `messages + logged`.
        if isinstance(appended, int) and not isinstance(appended, bool) and appended == (revision or 0) + 1 \
                and logged and not added:
            # As the store gives them back (decoded from their JSON), not the run's own objects: the next turn's
            # history must be the same values whether this process or another one (a resumed Prefect flow run)
            # loads it. A run's objects differ from their JSON round trip (`RequestUsage.audio_seconds` is `0`, read
            # back `0.0`), and Prefect hashes a model request's history into its cache key: a flow run resumed
            # elsewhere then missed its cache and ran its model requests and tools again.
            _remember(cache_key, [*messages, *ModelMessagesTypeAdapter.validate_python(turn.new_messages)])  # type: ignore[arg-type]
        if stream is not None and not closing:
            await _publish('turn_stored', {'conversation_id': conversation_id,
                                                      'messages': len(turn.new_messages)})
    if stream is not None and not closing:
        await _publish('run_completed', {'output': _jsonable(result.output), 'usage': turn.usage,
                                                    'new_messages': len(turn.new_messages)}, close=True)
    return turn


def coded_failure_data(error: BaseException) -> dict[str, Any] | None:
    """The `run_failed` data `{'error', 'code'}` of an error with a DC code (e.g. DC061): its one line led by that code,
    as `durcap serve` documents a failed run's `error`; `None` for an error without one (each caller words those:
    `_failed_data` here, `serve._app.failure_data` for a turn that failed in the serve process)."""
    code = getattr(error, 'code', None)
    if isinstance(code, str) and code.startswith('DC'):
        text = one_line(str(error))
        return {'error': text if text.startswith(code) else f'{code} {text}', 'code': code}
    return None


def _failed_data(error: BaseException) -> dict[str, Any]:
    """The `run_failed` data of a run's own error: `coded_failure_data`, else `{'error': 'Type: message'}`."""
    return coded_failure_data(error) or {'error': f'{type(error).__name__}: {error}'}


def _failure_text(error: BaseException) -> str:
    """`'Type: message'` of `error`, followed by its root cause's when it wraps one (a Temporal `ActivityError` says
    only 'Activity task failed'; its cause, an `ApplicationError`, carries the activity's own error type and text)."""
    text = f'{type(error).__name__}: {error}'
    cause = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is not error:
        text += f' ({getattr(cause, "type", None) or type(cause).__name__}: {cause})'
    return text


def _budget_settings(agent: DurableAgent[Any, Any], settings: Any, run_id: str | None, gate: ApprovalGate | None,
                     store: str | None, conversation_id: str | None, deps: Any) -> dict[str, Any]:
    """The run's `model_settings` plus its budget's entry (`budgets.context`): what the model request unit reads."""
    from .budget import BUDGET_SETTING

    module = _streams()
    stream = module.current_stream() if module is not None else None
    run = run_id or (stream.run_id if stream is not None else None) or (gate.run_id if gate is not None else None) \
        or f'local-{uuid.uuid4().hex}'
    if store is None and stream is not None and stream.log is not None:  # a Temporal workflow's stream has no log:
        store = stream.log.store_url  # its model request activity uses the worker's store (`budgets.set_worker_store`)
    budget = agent.budget
    assert budget is not None
    key = budget.key(run_id=run, conversation_id=conversation_id, deps=deps)
    return {**(settings or {}), BUDGET_SETTING: {'key': key, 'run': run, 'store': store}}


def _as_messages(messages: Sequence[Any] | None) -> list[ModelMessage]:
    if not messages:
        return []
    if all(isinstance(m, dict) for m in messages):
        return ModelMessagesTypeAdapter.validate_python(list(messages))
    return list(messages)


def _with_deferred(output_type: Any) -> Any:
    """`output_type` plus `DeferredToolRequests` (a durable run loops until the final output)."""
    from pydantic_ai.tools import DeferredToolRequests

    types = list(output_type) if isinstance(output_type, (list, tuple)) else [output_type]
    return types if DeferredToolRequests in types else [*types, DeferredToolRequests]


def _approval_requests(result: Any) -> Any:
    from pydantic_ai.tools import DeferredToolRequests

    output = result.output
    return output if isinstance(output, DeferredToolRequests) and output.approvals else None


def _request_limit(run_kwargs: dict[str, Any]) -> int | None:
    """The request limit of the whole turn: `usage_limits.request_limit` of the run's keyword arguments (a caller of
    `run_turn` that passes them), else pydantic-ai's default (`UsageLimits().request_limit`, 50, what every engine's
    runs get); `None`: no limit."""
    from pydantic_ai.usage import UsageLimits

    limits = run_kwargs.get('usage_limits') or UsageLimits()
    return limits.request_limit


async def _await_decisions(
    agent: DurableAgent[Any, Any], gate: ApprovalGate, run: Callable[..., Awaitable[Any]], result: Any,
    conversation_id: str | None, deps: Any, run_kwargs: dict[str, Any],
) -> tuple[Any, list[dict[str, Any]]]:
    """Wait on `gate` for decisions on `result`'s approval requests, then continue the run with them; returns
    the continued result and the messages it added (the first request carrying the audit records)."""
    from . import approvals

    timeout = approvals.timeout_seconds(getattr(agent, 'approval_timeout', None))
    pending = approvals.pending_calls(_approval_requests(result), run_id=gate.run_id, agent=agent.name,
                                      conversation_id=conversation_id, now=await gate.now(), timeout=timeout,
                                      schemas=getattr(agent, 'tool_schema', None))
    await _publish('approval_waiting', {'calls': [_jsonable(c) for c in pending]})
    with telemetry.approvals_waiting(gate.run_id, [c.call_id for c in pending], agent.name):
        decisions = await gate.wait(pending, timeout)
    await _publish('approval_decided', {'decisions': [_jsonable(d) for d in decisions.values()]})
    results = approvals.deferred_results(pending, decisions)
    continued = await run(None, deps=deps, message_history=result.all_messages(), deferred_tool_results=results,
                          **run_kwargs)
    added = ModelMessagesTypeAdapter.dump_python(continued.new_messages(), mode='json')
    audit = approvals.audit_records(pending, decisions)
    for message in added:
        if message.get('kind') == 'request':
            message['metadata'] = {**(message.get('metadata') or {}), approvals.AUDIT_METADATA_KEY: audit}
            break
    else:  # pragma: no cover - upstream always starts a continuation with the tool results request
        added.insert(0, {'kind': 'request', 'parts': [], 'metadata': {approvals.AUDIT_METADATA_KEY: audit}})
    return continued, added


def deps_from_json(agent: DurableAgent[Any, Any], deps: Any) -> Any:
    """JSON deps validated into the agent's `deps_type` (`None` stays `None`).

    Raises:
        pydantic.ValidationError: `deps` does not match `deps_type`.
    """
    return TypeAdapter(agent.deps_type).validate_python(deps) if deps is not None else None


def _local_load(agent: DurableAgent[Any, Any], store: str | None, holder: str) -> LoadUnit:
    async def load(conversation_id: str, busy: str | None = None) -> LoadedConversation:
        with telemetry.unit_span('store.load', agent=agent.name, conversation_id=conversation_id):
            if _claimed.get() != holder:  # not already claimed for this run by its caller (`claimed_by_caller`)
                await claim_turn(agent, conversation_id, holder, busy or agent.busy, store=store)
            try:
                return await load_conversation(agent, conversation_id, store=store)
            except BaseException:
                await release_turn(agent, conversation_id, holder, store=store)
                raise

    return load


def _local_append(agent: DurableAgent[Any, Any], store: str | None, holder: str) -> AppendUnit:
    async def append(conversation_id: str, messages: list[dict[str, Any]], revision: int | None, usage: Any) -> int:
        with telemetry.unit_span('store.append', agent=agent.name, conversation_id=conversation_id,
                                 messages=len(messages)):
            return await append_conversation(agent, conversation_id, messages, expected_revision=revision,
                                             append_id=holder if holder.startswith('local:') else f'local:{holder}',
                                             usage=usage, store=store, rebase=True,
                                             release_claim=holder)

    return append


def _local_release(agent: DurableAgent[Any, Any], store: str | None, holder: str) -> Callable[[str], Awaitable[bool]]:
    return lambda conversation_id: release_turn(agent, conversation_id, holder, store=store)
