"""A DBOS user's own app: their workflow, decorated with `durable_capabilities.engines.dbos.workflow`.

Model: the scripted support `FunctionModel`; the gated `revoke_sessions` is approved with `runner.decide`. Run as `python -m tests.engines.dbos_user_app DB_URL`; prints
`REPORT {json}` with the answer and the steps DBOS recorded for the workflow.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

from dbos import DBOS, SetWorkflowID

from durable_capabilities import runner
from durable_capabilities.engines import dbos as durcap_dbos
from examples.support.agent import make_store, make_support

support = make_support(name=f'support-user-{uuid.uuid4().hex[:6]}')


@durcap_dbos.workflow(support)
async def handle_ticket(agent, ticket: str) -> str:
    """The user's workflow: one agent run per ticket, checkpointed step by step."""
    result = await agent.run(ticket, deps=make_store())
    return result.output


async def main(db: str) -> None:
    durcap_dbos.launch('support-user-app', system_database_url_=db)
    try:
        workflow_id = f'ticket-{uuid.uuid4()}'
        with SetWorkflowID(workflow_id):  # the task copies this context: the workflow gets the id
            ticket = asyncio.create_task(handle_ticket('Someone logged into my account acct-42 from another country!'))
        # account-security's gate (on by default): revoke_sessions waits for a person; approve it as `durcap approve`.
        while not (pending := await runner.approvals(workflow_id, engine='dbos', db=db)):
            await asyncio.sleep(0.2)
        await runner.decide(workflow_id, pending[0].call_id, approve=True, by='ticket-desk', engine='dbos', db=db)
        answer = await ticket
        steps = [s['function_name'] for s in await DBOS.list_workflow_steps_async(workflow_id)]
        status = await DBOS.get_workflow_status_async(workflow_id)
        print('REPORT ' + json.dumps({'answer': answer, 'steps': steps, 'name': support.name,
                                      'workflow': status.name if status else None}), flush=True)
    finally:
        DBOS.destroy()


if __name__ == '__main__':
    asyncio.run(main(sys.argv[1]))
