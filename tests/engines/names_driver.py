"""Subprocess driver: what the support example's lock lists, and what each engine registers and records.

    python -m tests.engines.names_driver ENGINE --out DIR [--address A] [--db URL]

Prints one line `REPORT {json}`: `lock` (the adapter's `durable_names`, what `durcap lock` writes) and, per
engine, what the engine itself holds:
- temporal: the workflow and activity type names of the `Worker` that `make_worker` builds (its active config,
  after pydantic-ai's plugin added the agent's activities).
- dbos: the workflow and step names in DBOS's registry once the agent's workflow is decorated (upstream
  registers its model steps there), the names the built agent's durability (`ToolStepDurability`) gives each
  function leaf's step, and the steps
  of a real run of the support example (SQLite system database in DIR).
- prefect: the flow `agent_flow` creates, and the task run names of a real run of the support example.
Each engine runs in its own process: DBOS's registry and Prefect's settings are process-global.
The model is the example's scripted `FunctionModel`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from durable_capabilities import runner
from durable_capabilities.engines import get
from examples.support.agent import make_store, support

PROMPT = 'Where is my order ABC-123? It should have arrived by now.'


def temporal(args: argparse.Namespace) -> dict[str, Any]:
    from durable_capabilities._upstream import (
        temporal_activity_name,
        temporal_workflow_name,
    )
    from durable_capabilities.engines import temporal as engine

    async def registered() -> dict[str, Any]:
        client = await engine.connect(args.address)
        config = engine.make_worker(client, [support], 'names-probe').config(active_config=True)
        # The worker's own local activity that writes the runs' event streams (one per worker, for every agent; never
        # a task another worker takes): not an agent's durable name.
        from durable_capabilities.engines.temporal._streams import PUBLISH_ACTIVITY

        return {
            'workflows': sorted(temporal_workflow_name(cls) for cls in config.get('workflows', [])),
            'activities': sorted(temporal_activity_name(fn) for fn in config.get('activities', [])
                                 if temporal_activity_name(fn) != PUBLISH_ACTIVITY),
        }

    return {'registered': asyncio.run(registered())}


def dbos(args: argparse.Namespace) -> dict[str, Any]:
    from dbos._dbos import _get_or_create_dbos_registry
    from pydantic_ai.toolsets import CombinedToolset, FunctionToolset

    from durable_capabilities.engines import dbos as engine

    engine.agent_workflow(support)
    names = sorted(_get_or_create_dbos_registry().workflow_info_map)
    # The function-tool steps are named when the built agent's durability capability wraps each function leaf (they
    # run through `DBOS.run_step_async`, not a registered step): wrap one leaf per function toolset id, read the names.
    leaves = [FunctionToolset(id=None)] + [
        FunctionToolset(id=plan.toolset_id)
        for plans in support.leaf_plans().values() for plan in plans if plan.kind == 'FunctionToolset'
    ]
    chains: dict[str, list[Any]] = {'local': [], 'dbos': []}
    for built, chain in chains.items():
        support.build(built).root_capability.apply(chain.append)
    durability = next(c for c in chains['dbos'] if isinstance(c, engine.ToolStepDurability))
    wrapped, again = (durability.get_wrapper_toolset(CombinedToolset(leaves)) for _ in range(2))
    assert isinstance(wrapped, CombinedToolset) and isinstance(again, CombinedToolset)
    tool_steps = sorted(t.step_name for t in wrapped.toolsets if isinstance(t, engine.StepToolset))
    report = asyncio.run(runner.run(support, PROMPT, engine='dbos', deps=make_store(), conversation_id='names-1',
                                    db=f'sqlite:///{args.out / "dbos.sqlite"}'))
    return {
        'registered': {
            'workflows': sorted(n for n in names if not n.startswith('<temp>.')),
            'steps': sorted(n.removeprefix('<temp>.') for n in names if n.startswith('<temp>.')),
        },
        'tool_steps': tool_steps,
        # The capabilities every hook of a run goes through, per build; and whether a second wrap (the next run)
        # hands out the very same step wrappers (built once per leaf).
        'hook_chain': {built: [type(c).__name__ for c in chain] for built, chain in chains.items()},
        'steps_kept': all(a is b for a, b in zip(wrapped.toolsets, again.toolsets, strict=True)),
        'recorded': report.durable_units,
    }


def prefect(args: argparse.Namespace) -> dict[str, Any]:
    from durable_capabilities.engines import prefect as engine

    flow = engine.agent_flow(support)
    report = asyncio.run(runner.run(support, PROMPT, engine='prefect', deps=make_store(), conversation_id='names-1'))
    return {'registered': {'flows': [flow.name]}, 'recorded': report.durable_units, 'model': support.build('prefect').model.model_name}


DRIVERS = {'temporal': temporal, 'dbos': dbos, 'prefect': prefect}
"""Exactly the engines this driver knows what each registers (one function each); `test_durable_names` checks they
are every durable engine."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine', choices=list(DRIVERS))
    parser.add_argument('--out', type=Path, required=True)
    parser.add_argument('--address')
    args = parser.parse_args()
    import os

    os.environ['DURCAP_STORE'] = f'sqlite:///{args.out / "conversations.db"}'
    result = DRIVERS[args.engine](args)
    print('REPORT ' + json.dumps(to_jsonable_python({'lock': get(args.engine).durable_names(support), **result})), flush=True)


if __name__ == '__main__':
    main()
