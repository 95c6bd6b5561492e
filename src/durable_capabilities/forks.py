"""Forks of stored conversations by turn: `durcap history fork ID --at-turn N --to NEW_ID` (issue 28 item 4).

A turn is one write of the conversation's write log that stored messages (an `append` of a durable run, or an
upstream `save`): the first N turns are the messages up to the end of the N-th such write. The fork is upstream's
`ConversationStore.fork(at=...)`: the new conversation's record points into the source's entries, which are shared,
not copied (nor their claim checks), so it costs one row until its own next turn. Its loaded capabilities are rebuilt
from the kept messages on its next run, as on any resume; that run may be on any engine. Its conversation-scoped
budget starts with what the kept turns spent (`SQLConversationStore.fork`; docs/budgets.md).

Bad input is refused before anything is written: an unknown source, a turn outside 1..turns, a new id that is
already a conversation. The source is never changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic_ai.exceptions import UserError
from pydantic_ai.messages import ModelRequest, UserPromptPart

from .budget import conversation_key
from .history import loaded_capability_ids
from .store import ConversationConflictError, ConversationNotFoundError, SQLConversationStore, StoreError

__all__ = ['ForkError', 'ForkResult', 'RunTurn', 'fork_at_turn', 'run_turn_of', 'turn_ends']


class ForkError(StoreError, code='fork'):
    """A fork refused before anything was written: the turn is out of range, the source has no turns, or the new id
    is taken. The message names the field and the fix."""


@dataclass(frozen=True)
class ForkResult:
    """What `fork_at_turn` stored.

    Attributes:
        source_id: The conversation forked. new_id: The new conversation.
        turns: The turns kept (N). messages: The messages kept (the first N turns').
        source_turns: How many turns the source has.
        capabilities: The capability ids the kept messages loaded (what the next run starts with).
        budget: The fork's conversation budget key as stored after the fork (`BudgetRecord.to_json()`: what it
            inherited), `None` when the kept turns spent nothing the ledger recorded.
    """

    source_id: str
    new_id: str
    turns: int
    messages: int
    source_turns: int
    capabilities: list[str]
    budget: dict[str, Any] | None = None


async def turn_ends(store: SQLConversationStore, conversation_id: str) -> list[int]:
    """The message count at the end of each turn of the conversation, oldest first (`[3, 7, 12]`: turn 1 ends at
    message 3). Writes that stored no message (a delete) are not turns. A conversation that was itself forked
    counts the kept prefix's turns as its source counts them (the prefix as one turn when the source is gone), then
    its own turns after the fork point.

    Raises:
        ConversationNotFoundError: no live conversation `conversation_id`.
    """
    record = await store.read_record(conversation_id)
    if record is None:
        raise ConversationNotFoundError(conversation_id)
    ends = [w.first_position + len(w.entry_ids) - 1 for w in await store.writes(conversation_id)
            if w.entry_ids and w.first_position is not None]
    if record.forked_from is not None:
        prefix = len(await store.read_history(record.forked_at)) if record.forked_at else 0
        kept = [prefix] if prefix else []
        if prefix and await store.read_record(record.forked_from) is not None:  # the source's turns in the prefix
            kept = [end for end in await turn_ends(store, record.forked_from) if end < prefix] + kept
        ends = kept + [end for end in ends if end > prefix]
    return sorted(set(ends))


async def fork_at_turn(store: SQLConversationStore, conversation_id: str, turns: int, new_id: str) -> ForkResult:
    """Copy the first `turns` turns of `conversation_id` into a new conversation `new_id` (entries shared).

    Args:
        store: The conversation store.
        conversation_id: The source conversation (unchanged).
        turns: How many turns to keep, 1..the source's turns.
        new_id: The new conversation's id (must not exist).

    Returns:
        A `ForkResult`.

    Raises:
        ConversationNotFoundError: no live conversation `conversation_id`.
        ForkError: `turns` out of range, no turns, `new_id` empty, the same as the source, or already stored.
    """
    if not new_id.strip():
        raise ForkError('--to: the new conversation id is empty: give one, e.g. --to support-retry-1')
    if new_id == conversation_id:
        raise ForkError(f'--to {new_id!r} is the conversation being forked: give the fork another id')
    ends = await turn_ends(store, conversation_id)
    if not ends:
        raise ForkError(f'conversation {conversation_id!r} has no stored turn to fork')
    if not 1 <= turns <= len(ends):
        raise ForkError(f'--at-turn {turns}: conversation {conversation_id!r} has {len(ends)} turn(s): give 1 to '
                        f'{len(ends)}')
    if await store.read_record(new_id) is not None:
        raise ForkError(f'--to {new_id!r}: a conversation with that id is already stored: give another id')
    try:
        forked = await store.fork(conversation_id, at=ends[turns - 1], new_conversation_id=new_id)
    except ConversationConflictError as exc:  # written between the check above and the fork
        raise ForkError(f'--to {new_id!r}: a conversation with that id was stored meanwhile: give another id') from exc
    except UserError as exc:
        raise ForkError(f'cannot fork {conversation_id!r} at turn {turns}: {exc}') from exc
    inherited = await store.budgets(conversation_key(new_id))
    return ForkResult(conversation_id, new_id, turns, len(forked.messages), len(ends),
                      loaded_capability_ids(forked.messages), inherited[0].to_json() if inherited else None)


@dataclass(frozen=True)
class RunTurn:
    """Where a run's turn is in its conversation (`run_turn_of`; `durcap runs fork`).

    Attributes:
        before: The turns stored before the run's turn (what a fork of the run keeps).
        stored: Whether the run's own turn was stored (a finished run), or not (a failed one).
        prompt: The prompt of the run's stored turn (its first user prompt), `None` when not stored or none.
    """

    before: int
    stored: bool
    prompt: str | None


async def run_turn_of(store: SQLConversationStore, conversation_id: str, run_id: str,
                      started_at: datetime | None = None) -> RunTurn:
    """The place of run `run_id`'s turn in `conversation_id`: the turn its append stored (the write whose append id
    names the run), else, for a run whose turn was not stored (it failed), the turns written before it started
    (`started_at`; `None`: every turn).

    Raises:
        ConversationNotFoundError: no live conversation `conversation_id`.
    """
    ends = await turn_ends(store, conversation_id)
    writes = [w for w in await store.writes(conversation_id) if w.entry_ids and w.first_position is not None]
    for write in writes:
        if write.append_id and run_id in write.append_id.split(':'):
            end = write.first_position + len(write.entry_ids) - 1  # type: ignore[operator]
            before = sum(1 for e in ends if e < write.first_position)  # type: ignore[operator]
            if end not in ends:  # pragma: no cover - a write inside the fork's kept prefix
                break
            history = await store.read_history((await store.read_record(conversation_id)).head_id)  # type: ignore[union-attr]
            first = history[write.first_position - 1].message if len(history) >= write.first_position else None  # type: ignore[operator]
            return RunTurn(before, True, _prompt(first))
    if started_at is None:
        return RunTurn(len(ends), False, None)
    earlier = [w for w in writes if w.written_at < started_at]
    last = max((w.first_position + len(w.entry_ids) - 1 for w in earlier), default=0)  # type: ignore[operator]
    return RunTurn(sum(1 for e in ends if e <= last), False, None)


def _prompt(message: object) -> str | None:
    if isinstance(message, ModelRequest):
        for part in message.parts:
            if isinstance(part, UserPromptPart) and isinstance(part.content, str):
                return part.content
    return None
