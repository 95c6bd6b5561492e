"""Run one turn of `tests/engines/size_agent.py` on an engine: `python -m tests.engines.size_driver ENGINE
--conversation ID --prompt P [--address A] [--db URL]`. The store is `$DURCAP_STORE`.

Prints `REPORT {"output", "new_messages", "seconds"}` or `FAILED {"error", "seconds"}` (the error chain as text).
Temporal: an inline worker in this process, the client through `temporal.connect` (claim-check codec).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid

from durable_capabilities import runner
from tests.engines.size_agent import agent


def _chain(error: BaseException) -> str:
    parts, current, seen = [], error, set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f'{type(current).__name__}: {current}')
        current = getattr(current, 'cause', None) or current.__cause__ or current.__context__
    return ' <- '.join(parts)


async def turn(args: argparse.Namespace) -> runner.RunReport:
    settings: dict[str, object] = {}
    if args.engine == 'temporal':
        settings = {'address': args.address, 'task_queue': f'sizes-{uuid.uuid4().hex[:12]}', 'inline_worker': True}
    elif args.engine == 'dbos':
        settings = {'db': args.db}
    run_id = args.workflow_id if args.engine in ('temporal', 'dbos') else None
    return await runner.run(agent, args.prompt, engine=args.engine, conversation_id=args.conversation, run_id=run_id,
                            **settings)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine')
    parser.add_argument('--conversation', required=True)
    parser.add_argument('--prompt', required=True)
    parser.add_argument('--address')
    parser.add_argument('--db')
    parser.add_argument('--workflow-id')
    args = parser.parse_args()
    started = time.monotonic()
    try:
        report = asyncio.run(turn(args))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        print('FAILED ' + json.dumps({'error': _chain(exc), 'seconds': time.monotonic() - started}), flush=True)
        return
    print('REPORT ' + json.dumps({'output': report.output, 'new_messages': len(report.new_messages),
                                  'seconds': time.monotonic() - started}), flush=True)


if __name__ == '__main__':
    sys.exit(main())
