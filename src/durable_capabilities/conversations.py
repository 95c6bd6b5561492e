"""Load and append a run's conversation: the bodies every engine runs inside its durable units
(the turn itself, load -> run -> append, is `turn.run_turn`).

Engines call these inside an activity (Temporal), a step (DBOS) or a task (Prefect), never in
workflow code: the store is I/O. The append carries an `append_id` derived from the durable run
(workflow id, flow run id), so a retried unit that appends again stores nothing twice.

Messages cross as pydantic-ai's message JSON (`ModelMessagesTypeAdapter`), which every engine can
record and which keeps instruction ids intact.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_ai.usage import RunUsage

from .store import DEFAULT_URL, STORE_ENV, ConversationNotFoundError, SQLConversationStore, drift
from .validation import DurableConfigError, Report

if TYPE_CHECKING:
    from .agent import DurableAgent

logger = logging.getLogger('durable_capabilities.conversations')


def store_url(agent: DurableAgent[Any, Any]) -> str:
    """The store URL for `agent`: `DurableAgent(conversation_store=...)`, else `$DURCAP_STORE`, else SQLite
    at `.durcap/conversations.db` (resolved where the durable unit runs, e.g. on the worker)."""
    return agent.conversation_store or os.environ.get(STORE_ENV) or DEFAULT_URL


@dataclass
class LoadedConversation:
    """A conversation as a run starts from it.

    Attributes:
        messages: The stored messages as pydantic-ai message JSON (empty for a new conversation).
        revision: The stored revision, `None` for a conversation that does not exist yet.
        warnings: Drift problems reported at warning severity, as text.
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    revision: int | None = None
    warnings: list[str] = field(default_factory=list)


async def load_conversation(agent: DurableAgent[Any, Any], conversation_id: str) -> LoadedConversation:
    """Read a conversation for a run of `agent` and check it for drift.

    Returns:
        The stored messages and revision; a new conversation when none is stored.

    Raises:
        DurableConfigError: the history loaded a capability or called a tool the definition no longer
            has (DC018 / DC019) and `DurableAgent(drift='error')` (the default).
        StoreError: the store is unusable (corrupted rows, unknown schema, newer pydantic-ai).
    """
    async with SQLConversationStore(store_url(agent)) as store:
        await store.check_writable()  # refuse a read-only or unreachable store before the run, not after it
        try:
            stored = await store.read(conversation_id)
        except ConversationNotFoundError:
            return LoadedConversation()
    problems = drift(stored.messages, agent, severity=agent.drift, conversation_id=conversation_id)
    report = Report(problems)
    if not report.ok:
        raise DurableConfigError(report, f'conversation {conversation_id!r}')
    warnings = [p.format() for p in problems if p.severity == 'warning']
    for text in warnings:
        logger.warning(text)
    return LoadedConversation(
        ModelMessagesTypeAdapter.dump_python(stored.messages, mode='json'), stored.revision, warnings
    )


async def append_conversation(
    agent: DurableAgent[Any, Any],
    conversation_id: str,
    messages: list[dict[str, Any]],
    *,
    expected_revision: int | None,
    append_id: str,
    usage: dict[str, Any] | None = None,
) -> int:
    """Append a run's new messages (message JSON) and return the new revision.

    A repeated `append_id` (a retried durable unit) stores nothing and returns the earlier revision.

    Raises:
        ConversationConflictError: another run appended since this one loaded (`expected_revision` is stale).
    """
    async with SQLConversationStore(store_url(agent)) as store:
        result = await store.append(
            conversation_id,
            ModelMessagesTypeAdapter.validate_python(messages),
            expected_revision=expected_revision,
            append_id=append_id,
            usage=RunUsage(**usage) if usage else None,
        )
    return result.revision
