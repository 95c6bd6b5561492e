"""Run the seed's examples on one engine in this process and print what the model saw, as JSON.

    python -m tests.engines.seed_driver ENGINE --out-dir DIR [--examples a,b] [--prefix NAME]
        [--address HOST:PORT] [--db URL] [--prefect-event-delay SECONDS]

ENGINE is `local`, `temporal`, `dbos` or `prefect`. The seed (docs "On-Demand Capabilities") examples:

- `capability`: a deferred `Capability` with a `tool_plain` and a `tool(ctx)` (the seed's `refunds`);
- `account-security`: the `AccountSecurity` subclass of examples/support (model settings, approval hook);
- `orders-security`: orders + account-security over `Store` deps, two turns of one conversation;
- `runbook`: `refund-policy` + `RunbookRequired` + the always-on `issue_refund` agent tool;
- `skills`: skills loaded from Markdown files (the seed's `refunds.md` and examples/support's three).

Every run goes through `durable_capabilities.runner` (what `durcap run` uses): Temporal with the worker
inline in this process (`inline_worker=True`), so the model-request activities run here and the
scripted model's records (`SupportScript.requests`, plus the message parts it received, see
`Recorder`) are this process's; DBOS launched on the URL given
(`--db`) and destroyed after each run; Prefect against `PREFECT_API_URL`. Each example also runs on the
local engine (no durability) in this process, as the baseline the engine run must match.

Tools defined here append one JSON line per execution to a ledger file under `--out-dir`, so a
tool's side effects are counted wherever it ran (a Temporal activity gets a serialized copy of the
deps, so nothing a tool records in the deps comes back). Hooks run in workflow code on Temporal and
DBOS and in flow code on Prefect; their evidence is what the model saw (a `ModelRetry` from the hook).

The report is one line, `REPORT {json}`: `{'engine', 'startup_seconds', 'examples': {example:
{'name', 'engine': [run...], 'local': [run...], 'error'}}}` with, per run, `label`, `prompt`,
`output`, `units` (what the runner reported: activity types / step names / task run names, in
order), `settled_units` (Prefect: the flow run's task runs once the server has recorded them all; the
same as `units` elsewhere), `requests` (one `SeenRequest` per model request: tools, instructions, model
settings, capability instructions delivered, response, plus `parts`), `new_messages` (pydantic-ai
JSON), `loaded`, `ledger` and `seconds`. Agent names are `{prefix}-{example}`.

`--prefect-event-delay` makes Prefect's client emit each event late (a loaded events pipeline), which
shows deterministically that `runner.run(engine='prefect')` lists task runs before the server has recorded them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import shutil
import sys
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_STARTED = time.monotonic()

from pydantic_ai import RunContext
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    TextPart,
    ToolCallPart,
)
from pydantic_core import to_jsonable_python

from durable_capabilities import (
    DurableAgent,
    RunbookRequired,
    load_skills,
    runner,
)
from examples.support.agent import (
    SKILLS_DIR,
    Store,
    make_store,
    make_support,
    refund_policy,
)
from examples.support.scripted import LOAD, SupportScript

EXAMPLES: tuple[str, ...] = ('capability', 'account-security', 'orders-security', 'runbook', 'skills')
ENGINES: tuple[str, ...] = ('local', 'temporal', 'dbos', 'prefect')

# ---- what the model saw, beyond `SeenRequest`: the message parts it received -------------------


def _part_label(part: Any) -> str:
    label = part.part_kind
    if getattr(part, 'tool_name', None):
        label += f':{part.tool_name}'
    if 'instruction' in part.part_kind and getattr(part, 'id', None) is not None:
        label += f'@{part.id}'
    return label


@dataclass
class Recorder(SupportScript):
    """`SupportScript` that also records, per request, the kinds of the message parts the model received
    (`user-prompt`, `tool-return:order_status`, `instruction-delta@capability:orders`, ...)."""

    parts: list[list[str]] = field(default_factory=list)

    def respond(self, messages: list[ModelMessage], info: Any) -> Any:
        self.parts.append([_part_label(p) for m in messages for p in m.parts])
        return super().respond(messages, info)


# ---- the ledger: one JSON line per tool execution, wherever the tool ran ----------------------

_LEDGER: dict[str, Path | None] = {'path': None}


def _record(tool: str, **args: Any) -> None:
    path = _LEDGER['path']
    if path is None:
        return
    with open(path, 'a', encoding='utf-8') as f:
        f.write(json.dumps({'tool': tool, **args}) + '\n')


def _read_ledger(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---- example 1: a deferred Capability with `tool_plain` and `tool(ctx)` (the seed's `refunds`) ----

refunds = Capability(
    id='refunds',
    description='Use for refund eligibility, refund status, or processing a refund.',
    instructions='Always confirm the order ID before issuing a refund.',
    defer_loading=True,
)


@refunds.tool_plain
def refund_status(order_id: str) -> str:
    """Look up the refund status for an order."""
    _record('refund_status', order_id=order_id)
    return f'Order {order_id}: refund issued on 2026-05-01.'


@refunds.tool
def refund_eligibility(ctx: RunContext[None], order_id: str) -> str:
    """Check whether an order is still eligible for a refund."""
    loaded = sorted(ctx.loaded_capability_ids)
    _record('refund_eligibility', order_id=order_id, run_step=ctx.run_step, loaded=loaded)
    return f'Order {order_id} is eligible for a refund (step {ctx.run_step}, loaded: {", ".join(loaded)}).'


@dataclass
class RefundsScript(Recorder):
    """The support script's recorder with its own plan: load `refunds`, call both tools, answer."""

    def _decide(self, turn: Any, tools: list[str]) -> list[TextPart | ToolCallPart]:
        def call(tool: str, **args: Any) -> list[TextPart | ToolCallPart]:
            return [ToolCallPart(tool, args, tool_call_id=f'scripted-{turn.step}-{tool}')]

        if (failed := turn.load_failed('refunds')) is not None:
            return [TextPart(f'could not load refunds: {failed.content}')]
        if 'refunds' not in turn.loaded:
            return call(LOAD, id='refunds')
        answers = []
        for tool in ('refund_status', 'refund_eligibility'):
            if done := turn.returns(tool):
                answers.append(str(done[-1].content))
                continue
            if tool not in tools:
                return [TextPart(f'{tool} is not offered after loading refunds')]
            return call(tool, order_id='ABC-123')
        return [TextPart(' '.join(answers))]


def _capability_agent(name: str, script: SupportScript) -> DurableAgent[Any, Any]:
    return DurableAgent(name, script.model, instructions='You are a customer support assistant.', capabilities=[refunds])


# ---- example 4: read-before-act (`refund-policy` + `RunbookRequired` + the agent's `issue_refund`) ----


def issue_refund(order_id: str, amount: float) -> str:
    """Issue a refund for an order."""
    _record('issue_refund', order_id=order_id, amount=amount)
    return f'Refund of ${amount} issued for {order_id}.'


def _runbook_agent(name: str, script: SupportScript) -> DurableAgent[Any, Any]:
    return DurableAgent(
        name, script.model,
        instructions='You are a customer support assistant.',
        capabilities=[refund_policy, RunbookRequired(requirements={'issue_refund': 'refund-policy'})],
        tools=[issue_refund],
    )


# ---- example 5: skills from Markdown ------------------------------------------------------------

SEED_SKILL = (
    '---\nid: refunds\ndescription: Use for refund eligibility, refund status, or processing a refund.\n---\n'
    'Always confirm the order ID before issuing a refund.\nNever issue refunds over $500 without manager approval.\n'
)


def skills_dir(out_dir: Path) -> Path:
    """The seed's `skills/refunds.md` plus examples/support's three skill files, in one folder."""
    directory = out_dir / 'skills'
    directory.mkdir(parents=True, exist_ok=True)
    (directory / 'refunds.md').write_text(SEED_SKILL, encoding='utf-8', newline='\n')
    for path in SKILLS_DIR.glob('*.md'):
        shutil.copyfile(path, directory / path.name)
    return directory


def _skills_agent(name: str, script: SupportScript, out_dir: Path) -> DurableAgent[Any, Any]:
    return DurableAgent(
        name, script.model, instructions='You are a customer support assistant.', capabilities=load_skills(skills_dir(out_dir))
    )


# ---- the plan of each example -------------------------------------------------------------------

ORDER_LINE = 'Ceramic teapot (1.2 l): out for delivery today, driver M. Okafor.'
SECURITY_PROMPT = 'Someone logged into my account acct-42 from abroad, please help.'


def orders_store() -> Store:
    """Deps of `orders-security`: an order only these deps know, and an approval hook that would block `order_status`."""
    return Store(orders={'XYZ-321': ORDER_LINE}, denied_tools={'order_status'})


@dataclass
class Step:
    """One agent run of an example. `history_from`: the label of an earlier run whose messages continue."""

    label: str
    prompt: str
    deps: Callable[[], Any] = lambda: None
    history_from: str | None = None


@dataclass
class Example:
    build: Callable[[str, Recorder, Path], DurableAgent[Any, Any]]
    script: Callable[[], Recorder]
    steps: list[Step] = field(default_factory=list)


def _denied_store() -> Store:
    store = make_store()
    store.denied_tools = {'revoke_sessions'}
    return store


PLANS: dict[str, Example] = {
    'capability': Example(
        lambda name, script, _: _capability_agent(name, script), RefundsScript,
        [Step('main', 'Has the refund for order ABC-123 gone through, and is it still eligible?')],
    ),
    # The seed's examples exercise the hook's own record-and-block path (`Store.denied_tools`), as the seed writes it:
    # the person's approval gate (on by default in examples/support) is off here; tests/engines/test_approvals.py
    # runs the gate on every engine.
    'account-security': Example(
        lambda name, script, _: make_support(script, name=name, require_approval=False), Recorder,
        [Step('approved', SECURITY_PROMPT, make_store), Step('denied', SECURITY_PROMPT, _denied_store)],
    ),
    'orders-security': Example(
        lambda name, script, _: make_support(script, name=name, require_approval=False), Recorder,
        [
            Step('order', 'Where is order XYZ-321?', orders_store),
            Step('security', SECURITY_PROMPT, orders_store, history_from='order'),
        ],
    ),
    'runbook': Example(
        lambda name, script, _: _runbook_agent(name, script), Recorder,
        [Step('refund', 'Please refund $40 for order ABC-123.'), Step('over-limit', 'Please refund $900 for order ABC-123.')],
    ),
    'skills': Example(
        _skills_agent, Recorder,
        [Step('warranty', 'The espresso machine from order GHI-789 stopped working.')],
    ),
}


# ---- running ------------------------------------------------------------------------------------


@dataclass
class Options:
    out_dir: Path
    address: str | None = None
    db: str | None = None


async def run_step(engine: str, agent: DurableAgent[Any, Any], prompt: str, deps: Any, history: list[ModelMessage] | None, options: Options) -> runner.RunReport:
    if engine == 'local':
        return await runner.run(agent, prompt, engine='local', deps=deps, message_history=history)
    if engine == 'temporal':
        assert options.address, '--address is required for temporal'
        return await runner.run(
            agent, prompt, engine='temporal', address=options.address, task_queue=f'seed-{uuid.uuid4().hex[:12]}', deps=deps,
            message_history=history, inline_worker=True,
        )
    if engine == 'dbos':
        return await runner.run(agent, prompt, engine='dbos', deps=deps, message_history=history, db=options.db)
    if engine == 'prefect':
        return await runner.run(agent, prompt, engine='prefect', deps=deps, message_history=history)
    raise ValueError(f'unknown engine {engine!r}')


async def prefect_task_runs(flow_run_id: str, responses: int, timeout: float = 60.0) -> list[str]:
    """The flow run's task run names once the server has recorded them all.

    Prefect 3 records task runs from the events a flow run emits, asynchronously: right after the
    flow returns, the server may not list its last task runs yet. Wait until it lists one model-request
    task per model response, every task run is in a final state, and the list has not changed for 1 s.
    """
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + timeout
    previous: list[str] | None = None
    stable_since = time.monotonic()
    async with get_client() as client:
        while True:
            task_runs = await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            ordered = sorted(task_runs, key=lambda t: (t.expected_start_time or t.created, t.name))
            names = [t.name for t in ordered]
            final = all(t.state is not None and t.state.is_final() for t in ordered)
            if names != previous:
                previous, stable_since = names, time.monotonic()
            requests = sum(n.startswith('Model Request: ') for n in names)
            if (final and requests >= responses and time.monotonic() - stable_since >= 1.0) or time.monotonic() > deadline:
                return names
            await asyncio.sleep(0.2)


def delay_prefect_events(seconds: float) -> None:
    """Make Prefect's client emit each event `seconds` late: a slow events pipeline, as under load."""
    from prefect.events.worker import EventsWorker

    original = EventsWorker._handle

    async def handle(self: Any, event: Any) -> None:
        await asyncio.sleep(seconds)
        await original(self, event)

    EventsWorker._handle = handle  # type: ignore[method-assign]


async def run_example(
    engine: str, example: str, agent: DurableAgent[Any, Any], script: Recorder, options: Options, tag: str
) -> list[dict[str, Any]]:
    """Run every step of `example` on `engine`; one dict per run. `tag` names its ledger files."""
    runs: list[dict[str, Any]] = []
    messages: dict[str, list[ModelMessage]] = {}
    for step in PLANS[example].steps:
        ledger = options.out_dir / f'ledger-{tag}-{example}-{step.label}.jsonl'
        _LEDGER['path'] = ledger
        history = None
        if step.history_from is not None:
            history = messages[step.history_from]
        seen_before = len(script.requests)
        started = time.monotonic()
        try:
            report = await run_step(engine, agent, step.prompt, step.deps(), history, options)
        finally:
            _LEDGER['path'] = None
        seconds = time.monotonic() - started
        messages[step.label] = [*(history or []), *report.new_messages]
        settled = report.durable_units
        if engine == 'prefect':
            responses = sum(m.kind == 'response' for m in report.new_messages)
            settled = await prefect_task_runs(str(report.run_id), responses)
        runs.append(
            {
                'label': step.label,
                'prompt': step.prompt,
                'output': to_jsonable_python(report.output),
                'units': report.durable_units,
                'settled_units': settled,
                'run_id': report.run_id,
                'requests': [
                    {**dataclasses.asdict(r), 'parts': parts}
                    for r, parts in zip(script.requests[seen_before:], script.parts[seen_before:], strict=True)
                ],
                'new_messages': ModelMessagesTypeAdapter.dump_python(report.new_messages, mode='json'),
                'loaded': report.loaded_capabilities(),
                'ledger': _read_ledger(ledger),
                'seconds': round(seconds, 3),
            }
        )
    return runs


async def run_all(engine: str, examples: list[str], prefix: str, options: Options) -> dict[str, Any]:
    """Build every example's agent first (DBOS needs every workflow registered before `DBOS.launch()`),
    then run each on `engine` and on the local engine."""
    options.out_dir.mkdir(parents=True, exist_ok=True)
    built: dict[str, tuple[DurableAgent[Any, Any], Recorder, DurableAgent[Any, Any], Recorder]] = {}
    for example in examples:
        plan = PLANS[example]
        name = f'{prefix}-{example}'
        script, local_script = plan.script(), plan.script()
        built[example] = (
            plan.build(name, script, options.out_dir), script, plan.build(name, local_script, options.out_dir), local_script,
        )
    if engine == 'dbos':
        from durable_capabilities.engines import dbos as dbos_engine

        for agent, *_ in built.values():
            dbos_engine.agent_workflow(agent)
    if engine == 'prefect':
        from durable_capabilities.engines import prefect as prefect_engine

        for agent, *_ in built.values():
            prefect_engine.agent_flow(agent)
    results: dict[str, Any] = {}
    for example, (agent, script, local_agent, local_script) in built.items():
        entry: dict[str, Any] = {'name': agent.name, 'engine': [], 'local': [], 'error': None}
        try:
            entry['local'] = await run_example('local', example, local_agent, local_script, options, 'baseline')
            entry['engine'] = await run_example(engine, example, agent, script, options, engine)
        except BaseException:  # noqa: BLE001 - one failing example must not hide the others' reports
            entry['error'] = traceback.format_exc()
        results[example] = entry
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument('engine', choices=ENGINES)
    parser.add_argument('--out-dir', required=True, type=Path)
    parser.add_argument('--examples', default=','.join(EXAMPLES))
    parser.add_argument('--prefix', default=None, help='agent name prefix (default: seed-<random>)')
    parser.add_argument('--address', help='Temporal frontend address')
    parser.add_argument('--db', help='DBOS system database URL')
    parser.add_argument('--prefect-event-delay', type=float, default=0.0, help='emit each Prefect event this late')
    args = parser.parse_args(argv)
    examples = [e for e in args.examples.split(',') if e]
    unknown = set(examples) - set(PLANS)
    if unknown:
        parser.error(f'unknown examples: {", ".join(sorted(unknown))}')
    prefix = args.prefix or f'seed-{uuid.uuid4().hex[:8]}'
    startup = time.monotonic() - _STARTED
    options = Options(args.out_dir, args.address, args.db)
    if args.prefect_event_delay:
        delay_prefect_events(args.prefect_event_delay)
    results = asyncio.run(run_all(args.engine, examples, prefix, options))
    report = {'engine': args.engine, 'startup_seconds': round(startup, 3),
              'total_seconds': round(time.monotonic() - _STARTED, 3), 'examples': results}
    print('REPORT ' + json.dumps(to_jsonable_python(report)), flush=True)


if __name__ == '__main__':
    sys.exit(main())
