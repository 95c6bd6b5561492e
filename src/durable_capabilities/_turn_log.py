"""Which messages a run added, identified by run rather than by index into the run's message list.

A history processor (upstream `ProcessHistory`, e.g. one writing a `CompactionPart`) rewrites the run's
message list in place before a model request: messages before an index move or disappear, so
`result.new_messages()` (an index) can start in the middle of the turn, without its prompt and with a
tool return whose call was compacted away. `TurnRecorder`, the outermost capability of every built agent
that has a capability able to rewrite the list (`may_rewrite_history`), watches the run's message list at
every model request and node and records, in the order they first appear, every message the run created
(upstream stamps them with the run's `run_id`) and every message a capability introduced (the
compaction), before any processor can drop them. The conversation store then keeps the whole turn plus
the compaction, and grows only, as upstream's `ConversationStore` contract asks of a history a capability
rewrote. Each summary is stored once, after the messages it summarizes and where no tool call waits for its
return, so upstream's `post_compaction_window` of the stored conversation opens on it (`TurnLog.split`).
An agent with no such capability gets no recorder (it would be one more capability on every hook
call); its run's list only grows, and the log is read from it once, after the run.

`turn.run_turn` opens a `TurnLog` with `recording()` around the run; outside one the recorder does
nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from typing import Any

from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.capabilities.abstract import CapabilityOrdering
from pydantic_ai.messages import CompactionPart, ModelMessage, ModelResponse, ToolCallPart

from .aliases import CapabilityAliases


@dataclass
class TurnLog:
    """The messages one agent run added, in the order they were created, and the summaries it wrote.

    A summary a capability introduced (a compaction: an unstamped request holding a `CompactionPart`) is kept
    apart from the run's own messages and placed only when the stored conversation is built (`split`,
    `stored`): at the first point at or after the messages it summarizes where no tool call waits for its
    return, i.e. after a response without tool calls (or at the start when the history before it ends so).
    There upstream's `post_compaction_window` of the stored conversation opens on the summary itself: placed
    right after a tool return it would open on that return, whose call it leaves out, and placed between a
    call and its return it would split them. A summary equal to one the history or this log already holds
    (the same compaction written again after Temporal's continue-as-new reloaded the conversation) is
    recorded once.

    Attributes:
        prior: The starting history (message objects the run was given); never recorded as new.
        messages: The run's own messages so far (its prompt request, every response and tool return
            request), oldest first; without the summaries (see `stored`).
        run_id: Upstream's id of the agent run (set at the first observation).
        carried: Summaries an earlier part of the same agent run wrote and could not place yet (carried
            across Temporal's continue-as-new); placed like the run's own, from the start of `messages`.
    """

    prior: list[Any] = field(default_factory=list)
    messages: list[ModelMessage] = field(default_factory=list)
    run_id: str | None = None
    started: bool = False
    carried: list[ModelMessage] = field(default_factory=list)
    _seen: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        self._keep: list[Any] = []  # every object whose id() is in the seen sets, so no id is reused
        self._seen_parts: set[int] = set()
        self._logged: dict[int, ModelMessage] = {}  # id of a message seen in the run's list -> what the log holds
        self._summary_parts: list[Any] = []  # every CompactionPart of the history and of the recorded summaries
        # (index into `messages` the summary follows, summary), in the order written
        self._summaries: list[tuple[int, ModelMessage]] = [(0, m) for m in self.carried]
        for message in [*self.prior, *self.carried]:
            self._see(message)

    def _see(self, message: Any) -> None:
        self._seen.add(id(message))
        self._keep.append(message)
        for part in getattr(message, 'parts', ()):
            self._seen_parts.add(id(part))
            self._keep.append(part)
            if isinstance(part, CompactionPart):
                self._summary_parts.append(part)

    def start(self, messages: Iterable[ModelMessage], run_id: str | None) -> None:
        """At the run's first observation (its history prepared, before any history processor ran): every
        message the run holds that is not stamped with `run_id` is history (upstream may have merged or
        repaired the given history into new objects), then `observe`."""
        if self.started:
            return
        self.started, self.run_id = True, run_id or self.run_id
        messages = list(messages)
        for message in messages:
            if self.run_id is None or getattr(message, 'run_id', None) != self.run_id:
                self._see(message)
        self.observe(messages)

    def observe(self, messages: Iterable[ModelMessage], run_id: str | None = None) -> None:
        """Record what `messages` (the run's current list) holds that was not seen before, in list order.

        A message stamped with another run's id came from the history and is skipped. Any other message
        not seen before is recorded with its parts not seen before: a request a processor or upstream's
        normalization assembled from parts already seen (consecutive requests merged) adds nothing, a
        compaction adds its new part, and a copy equal by value to a recorded message is skipped. The run's
        own messages are appended in the order they appear; an unstamped one (a summary) is kept apart with
        the position of the first recorded message that follows it in `messages` (see `split`), unless every
        new part of it equals a summary part already held. The first observation with a `run_id` starts the
        log (`start`) when nothing observed the run before.
        """
        if not self.started and run_id is not None:
            # No `TurnRecorder` saw the run (none was needed: `may_rewrite_history`): this first observation
            # separates the history (messages not stamped with `run_id`) from what the run added.
            self.start(messages, run_id)
            return
        if run_id is not None and self.run_id is None:
            self.run_id = run_id
        messages = list(messages)
        for index, message in enumerate(messages):
            if id(message) in self._seen:
                continue
            stamped = getattr(message, 'run_id', None)
            new_parts = [p for p in getattr(message, 'parts', ()) if id(p) not in self._seen_parts]
            known = self._summary_parts
            repeated = bool(new_parts) and all(isinstance(p, CompactionPart) and p in known for p in new_parts)
            self._see(message)
            if stamped is not None and self.run_id is not None and stamped != self.run_id:
                continue  # an earlier run's message (the history, or a copy of it)
            if not new_parts or repeated or any(m == message for m in self.messages if m.kind == message.kind):
                continue  # re-packaged parts already recorded, a summary written again, or a copy of a recorded message
            recorded = replace(message, parts=new_parts) if len(new_parts) < len(message.parts) else message
            self._logged[id(message)] = recorded
            if stamped is None:
                follower = next((self._logged[id(m)] for m in messages[index + 1:] if id(m) in self._logged), None)
                self._summaries.append((self._position(follower), recorded))
            else:
                self.messages.append(recorded)

    def _position(self, follower: ModelMessage | None) -> int:
        """Index into `messages` a summary followed by `follower` (a recorded message or summary) comes at."""
        for k, m in enumerate(self.messages):
            if m is follower:
                return k
        for after, summary in self._summaries:
            if summary is follower:
                return after
        return len(self.messages)

    def _boundary(self, position: int) -> bool:
        """Whether a summary may open the post-compaction window before `messages[position]`: the message
        before it is a response with no tool call waiting for its return (or nothing)."""
        if position:
            before = self.messages[position - 1]
        else:  # the history, past the summaries it ends with
            before = next((m for m in reversed(self.prior)
                           if not all(isinstance(p, CompactionPart) for p in getattr(m, 'parts', ()))), None)
        if before is None:
            return True
        return isinstance(before, ModelResponse) and not any(isinstance(p, ToolCallPart) for p in before.parts)

    def split(self) -> tuple[list[ModelMessage], list[ModelMessage]]:
        """(the run's messages with each summary placed, the summaries with no place yet), see the class docstring.

        Returns:
            The messages to store now, oldest first, and the summaries to place later (the run has tool calls
            waiting at every point after them: carry them, or store them after the calls' returns).
        """
        placed: dict[int, list[ModelMessage]] = {}
        pending: list[ModelMessage] = []
        for after, summary in self._summaries:
            at = next((k for k in range(after, len(self.messages) + 1) if self._boundary(k)), None)
            if at is None:
                pending.append(summary)
            else:
                placed.setdefault(at, []).append(summary)
        ordered: list[ModelMessage] = []
        for k, message in enumerate(self.messages):
            ordered += placed.get(k, [])
            ordered.append(message)
        ordered += placed.get(len(self.messages), [])
        return ordered, pending

    def stored(self) -> list[ModelMessage]:
        """Every message the run added, summaries placed (`split`), the ones with no place yet last."""
        ordered, pending = self.split()
        return [*ordered, *pending]


_current: ContextVar[TurnLog | None] = ContextVar('durcap_turn_log', default=None)


@contextmanager
def recording(prior: Iterable[Any] | None = None, carried: Iterable[ModelMessage] | None = None) -> Iterator[TurnLog]:
    """Record the messages the agent run inside the block adds (see the module docstring).

    Args:
        prior: The history the run starts from (message objects), never recorded.
        carried: Summaries an earlier part of the same agent run wrote and did not store (`TurnLog.carried`).

    Yields:
        The `TurnLog`, complete once the run returned (`observe` its `all_messages()` last).
    """
    log = TurnLog(list(prior or []), carried=list(carried or []))
    token = _current.set(log)
    try:
        yield log
    finally:
        _current.reset(token)


def current_log() -> TurnLog | None:
    """The `TurnLog` of the run in this context (`None` outside `recording`)."""
    return _current.get()


def _observe(ctx: Any) -> None:
    log = _current.get()
    if log is None:
        return
    if log.started:
        log.observe(ctx.messages, getattr(ctx, 'run_id', None))
    else:
        log.start(ctx.messages, getattr(ctx, 'run_id', None))


@dataclass
class TurnRecorder(AbstractCapability[Any]):
    """Records the run's messages into the current `TurnLog` before a history processor can rewrite them.

    Outermost, so its `before_model_request` runs before any processor's; it also observes after every
    model request and node. Adds no tools, instructions or durable units.
    """

    def get_ordering(self) -> CapabilityOrdering | None:
        return CapabilityOrdering(position='outermost')

    async def before_model_request(self, ctx: Any, request_context: Any) -> Any:
        _observe(ctx)
        return request_context

    async def after_model_request(self, ctx: Any, *, request_context: Any, response: Any) -> Any:
        _observe(ctx)
        return response

    async def after_node_run(self, ctx: Any, *, node: Any, result: Any) -> Any:
        _observe(ctx)
        return result

    @classmethod
    def get_serialization_name(cls) -> str | None:
        return None


MESSAGE_HOOKS = ('before_run', 'wrap_run', 'after_run', 'before_node_run', 'wrap_node_run', 'after_node_run',
                 'before_model_request', 'prepare_model_request', 'wrap_model_request', 'after_model_request')
"""The capability hooks that see the run's message list (`ctx.messages`, `request_context.messages`) and so could
rewrite it, as a history processor does (upstream `ProcessHistory` works from `before_model_request`)."""


def may_rewrite_history(capability: AbstractCapability[Any]) -> bool:
    """Whether `capability` (or one it wraps or combines) implements a hook that could rewrite the run's message list
    (`MESSAGE_HOOKS`). Without one in the agent, and without `history_processors`, the run's list only grows, so its
    final `all_messages()` is the whole turn and `TurnRecorder` (one more capability on every hook call: pydantic-ai
    copies the `RunContext` for each capability on each call) is left out.

    Conservative: a hook counts when the class overrides it, whatever it does; a wrapper counts for its own
    overrides and for what it wraps. durcap's `CapabilityAliases` (it renames ids in the response only) does not
    count.
    """
    from pydantic_ai.capabilities import CombinedCapability, WrapperCapability

    if isinstance(capability, CapabilityAliases):
        return False
    if isinstance(capability, CombinedCapability):
        return any(may_rewrite_history(c) for c in capability.capabilities)
    base: type[Any] = WrapperCapability if isinstance(capability, WrapperCapability) else AbstractCapability
    cls = type(capability)
    if any(getattr(cls, name) is not getattr(base, name) for name in MESSAGE_HOOKS):
        return True
    return isinstance(capability, WrapperCapability) and may_rewrite_history(capability.wrapped)
