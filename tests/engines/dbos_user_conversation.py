"""A DBOS user's workflow that keeps a conversation: `agent.run(..., conversation_id=...)` inside it.

Model: the scripted support `FunctionModel`. Run as `python -m tests.engines.dbos_user_conversation DB_URL STORE_URL`;
runs two tickets of one conversation, each in its own workflow, and prints `REPORT {json}` with both answers,
the steps DBOS recorded for each, and what the store holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

from dbos import DBOS, SetWorkflowID

from durable_capabilities.engines import dbos as durcap_dbos
from examples.support.agent import make_store, make_support

support = make_support(name=f'support-conv-{uuid.uuid4().hex[:6]}')


@durcap_dbos.workflow(support)
async def handle_message(agent, conversation_id: str, text: str) -> str:
    """The user's workflow: one turn of the conversation, the store read and appended in DBOS steps."""
    result = await agent.run(text, deps=make_store(), conversation_id=conversation_id)
    return result.output


async def main(db: str) -> None:
    from durable_capabilities.store import SQLConversationStore

    durcap_dbos.launch('support-conversation-app', system_database_url_=db)
    conversation = f'c-{uuid.uuid4().hex[:8]}'
    runs = []
    try:
        for text in ('Where is my order ABC-123?', 'And order DEF-456?'):
            workflow_id = f'msg-{uuid.uuid4()}'
            with SetWorkflowID(workflow_id):
                answer = await handle_message(conversation, text)
            steps = [s['function_name'] for s in await DBOS.list_workflow_steps_async(workflow_id)]
            runs.append({'answer': answer, 'steps': steps})
        # Before `DBOS.destroy()`, which shuts down the event loop's executor the store's I/O runs on.
        async with SQLConversationStore(os.environ['DURCAP_STORE']) as store:
            stored = await store.read(conversation)
    finally:
        DBOS.destroy()
    print('REPORT ' + json.dumps({'name': support.name, 'runs': runs, 'revision': stored.revision,
                                  'messages': len(stored.messages)}), flush=True)


if __name__ == '__main__':
    asyncio.run(main(sys.argv[1]))
