"""Run one turn of `tests/engines/compaction_agent.py`: `python -m tests.engines.compaction_driver ENGINE --prompt P
[--conversation ID] [--address A] [--db URL] [--workflow-id W]`. The store is `$DURCAP_STORE`.

Prints `REPORT {"output", "new_messages" (message JSON), "run_id"}` or `FAILED {"error"}`.
Temporal: an inline worker in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import traceback
import uuid

from pydantic_ai.messages import ModelMessagesTypeAdapter

from durable_capabilities import runner
from tests.engines.compaction_agent import agent


async def turn(args: argparse.Namespace) -> runner.RunReport:
    settings = {'address': args.address, 'task_queue': f'compact-{uuid.uuid4().hex[:12]}', 'inline_worker': True, 'db': args.db}
    return await runner.run(agent, args.prompt, engine=args.engine, conversation_id=args.conversation,
                            run_id=args.workflow_id, **settings)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine')
    parser.add_argument('--prompt', required=True)
    parser.add_argument('--conversation')
    parser.add_argument('--address')
    parser.add_argument('--db')
    parser.add_argument('--workflow-id')
    args = parser.parse_args()
    try:
        report = asyncio.run(turn(args))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        print('FAILED ' + json.dumps({'error': ''.join(traceback.format_exception(exc))}), flush=True)
        return
    messages = ModelMessagesTypeAdapter.dump_python(report.new_messages, mode='json')
    print('REPORT ' + json.dumps({'output': report.output, 'new_messages': messages, 'run_id': report.run_id}), flush=True)


if __name__ == '__main__':
    sys.exit(main())
