"""Driver of tests/engines/test_budgets.py: `python -m tests.engines.budget_driver ENGINE CONVERSATION STORE`.

Runs three turns of `tests.engines.budget_agent:agent` on ENGINE (through `runner.run`, as `durcap run` does; Temporal
with an inline worker on `$DURCAP_TEST_TEMPORAL_ADDRESS`, Prefect on `$PREFECT_API_URL`, DBOS on a SQLite system
database beside the store) in conversation CONVERSATION, and prints one `REPORT {json}` line: per turn either
`{'ok': True, 'budget': RunReport.budget}` or `{'ok': False, 'error': type, 'message': the error and its causes}`.
As each turn goes, it prints `TURN N STARTED RUN_ID` the moment the engine has the run, `TURN N {json}` when it
ended (the same per-turn object), and with `$DURCAP_BUDGET_ON_EXCEED=approval`, `TURN N WAITING {call}` when the run
waits for a person (`runner.approvals` of the run, polled from this process: the engine's client is loaded here
already, where a `durcap approvals list` process costs seconds each on a busy machine).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from durable_capabilities import runner
from tests.engines.budget_agent import agent


def _chain(error: BaseException | None) -> str:
    parts = []
    while error is not None:
        parts.append(f'{type(error).__name__}: {error}')
        error = error.__cause__ or getattr(error, 'cause', None)
    return ' <- '.join(parts)


async def main(engine: str, conversation: str, store: str) -> None:
    settings: dict[str, Any] = {'store': store}
    if engine == 'temporal':
        settings.update(address=os.environ['DURCAP_TEST_TEMPORAL_ADDRESS'], inline_worker=True,
                        task_queue=f'budget-{conversation}')
    if engine == 'dbos':
        settings['db'] = f'sqlite:///{Path(store.removeprefix("sqlite:///")).parent / f"dbos-{conversation}.sqlite"}'
    watch = os.environ.get('DURCAP_BUDGET_ON_EXCEED') == 'approval'
    where = {'address': settings['address']} if engine == 'temporal' else {'db': settings['db']} if engine == 'dbos' else {}
    watchers: list[asyncio.Task[None]] = []
    loop = asyncio.get_running_loop()

    async def waiting(n: int, run_id: str) -> None:
        while not (calls := await runner.approvals(run_id, engine=engine, **where)):
            await asyncio.sleep(0.2)
        print(f'TURN {n} WAITING ' + json.dumps(calls[0].to_json()), flush=True)

    turns = []
    for n in (1, 2, 3):
        def started(run_id: str, n: int = n) -> None:
            print(f'TURN {n} STARTED {run_id}', flush=True)
            if watch:
                loop.call_soon_threadsafe(lambda: watchers.append(loop.create_task(waiting(n, run_id))))

        try:
            report = await runner.run(agent, f'{conversation} turn {n}', engine=engine, conversation_id=conversation,
                                      notify=lambda line: None, on_start=started, **settings)
            turns.append({'ok': True, 'budget': report.budget, 'output': report.output})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            turns.append({'ok': False, 'error': type(exc).__name__, 'message': _chain(exc)})
        for task in watchers:
            task.cancel()
        watchers.clear()
        print(f'TURN {n} ' + json.dumps(turns[-1]), flush=True)
    print('REPORT ' + json.dumps(turns), flush=True)


if __name__ == '__main__':
    asyncio.run(main(*sys.argv[1:4]))
