"""Driver of tests/engines/test_budgets.py: `python -m tests.engines.budget_driver ENGINE CONVERSATION STORE`.

Runs three turns of `tests.engines.budget_agent:agent` on ENGINE (through `runner.run`, as `durcap run` does; Temporal
with an inline worker on `$DURCAP_TEST_TEMPORAL_ADDRESS`, Prefect on `$PREFECT_API_URL`, DBOS on a SQLite system
database beside the store) in conversation CONVERSATION, and prints one `REPORT {json}` line: per turn either
`{'ok': True, 'budget': RunReport.budget}` or `{'ok': False, 'error': type, 'message': the error and its causes}`.
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
    turns = []
    for n in (1, 2, 3):
        try:
            report = await runner.run(agent, f'{conversation} turn {n}', engine=engine, conversation_id=conversation,
                                      notify=lambda line: None, **settings)
            turns.append({'ok': True, 'budget': report.budget})
        except Exception as exc:  # noqa: BLE001 - reported to the test
            turns.append({'ok': False, 'error': type(exc).__name__, 'message': _chain(exc)})
    print('REPORT ' + json.dumps(turns), flush=True)


if __name__ == '__main__':
    asyncio.run(main(*sys.argv[1:4]))
