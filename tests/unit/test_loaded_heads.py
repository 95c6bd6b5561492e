"""A conversation named by its head (`conversations.LoadedHead`, what DBOS's load step and Prefect's load task record,
issue 24) reads back as the same rows whatever happened to the conversation since: more turns, a rebased append, a
fork (its history running through the source's entries), and not at all once the conversation was deleted.

Real SQLite files and PostgreSQL databases (the `store_url` fixture); no model runs (messages are written directly).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from pydantic_ai.messages import ModelRequest, ModelResponse, TextPart, UserPromptPart
from pydantic_ai.models.function import FunctionModel

from durable_capabilities import DurableAgent, conversations
from durable_capabilities.conversations import LoadedConversation, LoadedHead, load_conversation, read_loaded_head
from durable_capabilities.forks import fork_at_turn
from durable_capabilities.store import ConversationNotFoundError, CorruptedRowError, SQLConversationStore


def turn(n: int) -> list[Any]:
    return [ModelRequest(parts=[UserPromptPart(f'question {n}')]), ModelResponse(parts=[TextPart(f'answer {n}')])]


def test_a_head_reads_back_the_same_rows_after_more_turns_a_rebase_and_in_a_fork(store_url: str) -> None:
    async def go() -> None:
        with SQLConversationStore(store_url) as store:
            for n in (1, 2):
                await store.append('source', turn(n), expected_revision=(await store.read('source')).revision if n > 1 else None)
            at_two = await store.read_json('source')
            head = (at_two.entry_ids[-1], 4)
            await store.append('source', turn(3), expected_revision=at_two.revision)
            rebased = await store.append('source', turn(4), expected_revision=at_two.revision, rebase=True)  # stale
            assert rebased.rebased
            assert await store.read_json_at('source', *head) == at_two.messages
            await fork_at_turn(store, 'source', 2, 'forked')
            fork = await store.read_json('forked')
            assert await store.read_json_at('forked', fork.entry_ids[-1], 4) == at_two.messages  # the source's entries
            await store.append('forked', turn(9), expected_revision=fork.revision)
            grown = await store.read_json('forked')
            assert await store.read_json_at('forked', grown.entry_ids[-1], 6) == grown.messages
            assert await store.read_json_at('forked', fork.entry_ids[-1], 4) == at_two.messages
            with pytest.raises(CorruptedRowError, match='is message 6, not message 5'):
                await store.read_json_at('forked', grown.entry_ids[-1], 5)
            await store.purge('forked')
            with pytest.raises(ConversationNotFoundError, match='conversation was deleted'):
                await store.read_json_at('forked', grown.entry_ids[-1], 6)

    asyncio.run(go())


def test_a_loaded_head_reads_back_as_the_rows_from_the_cache_and_from_the_store(store_url: str) -> None:
    """`load_conversation(by_head=True)` returns a `LoadedHead`; `read_loaded_head` gives the rows the plain load
    gives, from this process's load cache and, once it is gone (another process), from the store, after the
    conversation grew."""
    agent = DurableAgent('heads-unit', FunctionModel(lambda messages, info: ModelResponse(parts=[TextPart('x')])),
                         conversation_store=store_url)

    async def go() -> None:
        with SQLConversationStore(store_url) as store:
            await store.append('c', [*turn(1), *turn(2)], expected_revision=None)
            plain = await load_conversation(agent, 'c')
            head = await load_conversation(agent, 'c', by_head=True)
            assert isinstance(plain, LoadedConversation) and isinstance(head, LoadedHead)
            assert (head.revision, head.count) == (plain.revision, 4)
            assert (await read_loaded_head(agent, 'c', head)).rows == plain.rows
            await store.append('c', turn(3), expected_revision=head.revision)
            conversations._LOAD_CACHE.clear()
            again = await read_loaded_head(agent, 'c', head)
            assert (again.rows, again.revision) == (plain.rows, plain.revision)
            assert isinstance(await load_conversation(agent, 'new', by_head=True), LoadedConversation)  # nothing stored

    asyncio.run(go())


def test_a_result_naming_its_append_reads_back_its_messages_even_rebased_and_not_once_deleted(store_url: str) -> None:
    """`conversations.resolve_payload`: a DBOS / Prefect result naming its append (`Turn.payload(append_id=...)`) gets
    that append's messages from the write log, also when it was rebased after another writer's; a result with its
    messages inline (the form before, or a run without a conversation) is returned as it is; once the conversation
    is purged, `ConversationNotFoundError` names the run's append and revision."""
    async def go() -> None:
        with SQLConversationStore(store_url) as store:
            await store.append('named', turn(1), expected_revision=None, append_id='dbos:first')
            await store.append('named', turn(2), expected_revision=1, append_id='other')
            second = await store.append('named', turn(3), expected_revision=1, append_id='prefect:third', rebase=True)
            assert second.rebased
            named = {'output': 'answer 3', 'usage': {}, 'appended': {
                'conversation_id': 'named', 'append_id': 'prefect:third', 'revision': second.revision, 'messages': 2}}
            resolved = await conversations.resolve_payload(named, store=store_url)
            assert [m['parts'][0]['content'] for m in resolved['new_messages']] == ['question 3', 'answer 3']
            assert resolved['output'] == 'answer 3' and resolved['appended'] == named['appended']
            inline = {'output': 'x', 'usage': {}, 'new_messages': '[]'}
            assert await conversations.resolve_payload(inline, store=store_url) is inline
            await store.purge('named')
            with pytest.raises(ConversationNotFoundError, match=r"prefect:third appended at revision 3: its messages "
                                                                r"were deleted"):
                await conversations.resolve_payload(named, store=store_url)

    asyncio.run(go())


def test_reading_a_named_append_from_a_store_that_does_not_exist_creates_none(tmp_path: Any) -> None:
    """`runs show` / `runs list` read results naming their append: from a store URL with no file behind it the read
    fails (`StoreUnavailableError`, a note in `runs show`) and no store is created."""
    from durable_capabilities.store import StoreUnavailableError

    missing = tmp_path / 'nothing' / 'conversations.db'
    named = {'output': 'x', 'usage': {}, 'appended': {'conversation_id': 'c', 'append_id': 'dbos:w', 'revision': 1,
                                                      'messages': 2}}
    with pytest.raises(StoreUnavailableError, match='no conversation store at'):
        asyncio.run(conversations.resolve_payload(named, store=f'sqlite:///{missing}'))
    assert not missing.exists() and not missing.parent.exists()
