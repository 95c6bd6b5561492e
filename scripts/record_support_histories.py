"""Record the support example's Temporal histories (tests/histories/support/*.json) on a real Temporal server.

    .venv/bin/python scripts/record_support_histories.py                  # an in-memory dev server started here
    .venv/bin/python scripts/record_support_histories.py --address HOST:PORT

`tests/unit/test_support_deploy_safety.py` replays these histories against the support definition: a change that would
make an in-flight run nondeterministic fails there. Re-record them (and read the diff) only after an intended change
of the workflow's behaviour, e.g. the approval gate of `account-security` turned on by default.

Each prompt runs once as workflow `support-{name}` on task queue `rec` with an inline worker and the scripted support
model (`examples/support/scripted.py`, a `FunctionModel`); a call waiting for approval (the `security` prompt's
`revoke_sessions`) is approved through `durcap`'s own `runner.decide` by `history-recorder`, as a person would with
`durcap approve`. The history is then exported with the adapter's `export_history` (what `durcap history export`
writes).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from durable_capabilities import runner
from durable_capabilities.engines import get
from durable_capabilities.engines.temporal import start_temporal_dev_server
from examples.support.agent import make_store, support

PROMPTS = {
    'orders': 'Where is my order ABC-123?',
    'refund': 'Please refund $40 for order ABC-123.',
    'returns': 'How do I return the shoes from order DEF-456?',
    'security': 'Someone logged into my account acct-42 from another country!',
}
OUT = ROOT / 'tests' / 'histories' / 'support'


async def record(name: str, prompt: str, address: str) -> Path:
    """Run `prompt`, approving whatever call waits, and export the workflow's history to `OUT/{name}.json`."""
    workflow_id, settings = f'support-{name}', {'address': address, 'task_queue': 'rec', 'inline_worker': True}
    started: list[str] = []
    run = asyncio.create_task(runner.run(support, prompt, engine='temporal', deps=make_store(), run_id=workflow_id,
                                         on_start=started.append, **settings))
    decided: set[str] = set()
    while not run.done():
        await asyncio.sleep(0.3)
        if run.done() or not started:  # ask only once the workflow exists
            continue
        for call in await runner.approvals(workflow_id, engine='temporal', address=address):
            if call.call_id not in decided:
                await runner.decide(workflow_id, call.call_id, approve=True, by='history-recorder', engine='temporal',
                                    address=address)
                decided.add(call.call_id)
                print(f'{name}: approved {call.tool_name}({call.args})')
    report = await run
    print(f'{name}: {report.output}')
    path = OUT / f'{name}.json'
    await get('temporal').export_history(workflow_id, path, {'address': address})
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--address', help='Temporal frontend HOST:PORT (default: start an in-memory dev server)')
    args = parser.parse_args()
    server = None
    if args.address is None:
        server = start_temporal_dev_server(state_dir=tempfile.mkdtemp(prefix='durcap-record-'), persistent=False)
    try:
        for name, prompt in PROMPTS.items():
            print(f'wrote {asyncio.run(record(name, prompt, args.address or server.address))}')
    finally:
        if server is not None:
            server.stop()


if __name__ == '__main__':
    main()
