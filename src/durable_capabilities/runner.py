"""Run a `DurableAgent` once on any registered engine and report what the engine recorded.

Used by `durcap run` and `durcap demo`. The engine is looked up in the registry (`engines.get`); each
adapter runs the path its users know (see `engines/<name>.py`) and returns a `report.RunReport`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from . import telemetry
from .agent import DurableAgent
from .approvals import Decision, PendingCall, default_user, fingerprint
from .conversations import check_busy
from .engines import DEFAULT_ENGINE, RunOptions, get
from .engines._adapter import _stderr
from .report import RunReport
from .turn import run_turn

__all__ = ['RunReport', 'approvals', 'decide', 'run', 'run_in_process']


async def run_in_process(
    agent: DurableAgent[Any, Any],
    prompt: str | None,
    *,
    deps: Any = None,
    message_history: Sequence[Any] | None = None,
    conversation_id: str | None = None,
    capabilities: Sequence[Any] | None = None,
    **kwargs: Any,
) -> Any:
    """One turn of `agent` in this process on the local engine (no durability): what `DurableAgent.run` calls.

    Args:
        agent: The definition.
        prompt: The user prompt (`None` to continue from the history alone).
        deps / message_history / conversation_id: As for `run`.
        capabilities: Refused (DC012): a durable definition takes no capabilities per run.
        kwargs: Passed to upstream's `Agent.run` (`model_settings`, `usage_limits`, ...).

    Returns:
        Upstream's `AgentRunResult`.

    Raises:
        DurableConfigError: capabilities passed per run (DC012); drift in the stored history (DC018/DC019).
        ConversationConflictError: another run appended to the conversation meanwhile.
    """
    if not telemetry.enabled():
        turn = await run_turn(agent, agent.build('local').run, prompt, deps=deps, message_history=message_history,
                              conversation_id=conversation_id, capabilities=capabilities, **kwargs)
        return turn.result
    run_id, start, error = f'local-{uuid.uuid4().hex}', telemetry.run_started(), None
    telemetry.run_started_metric(agent.name, 'local')
    try:
        with telemetry.in_run(run_id, 'local', agent.name):
            turn = await run_turn(agent, agent.build('local').run, prompt, deps=deps, message_history=message_history,
                                  conversation_id=conversation_id, capabilities=capabilities, **kwargs)
        return turn.result
    except BaseException as exc:
        error = exc
        raise
    finally:
        telemetry.record_run(run_id, agent=agent.name, engine='local', conversation_id=conversation_id,
                             start_ns=start, error=error)


async def run(
    agent: DurableAgent[Any, Any],
    prompt: str | None,
    *,
    engine: str = 'local',
    deps: Any = None,
    message_history: Sequence[Any] | None = None,
    conversation_id: str | None = None,
    run_id: str | None = None,
    notify: Callable[[str], None] = _stderr,
    on_start: Callable[[str], None] | None = None,
    busy: str | None = None,
    **settings: Any,
) -> RunReport:
    """Run one turn of `agent` on `engine`.

    Args:
        agent: The definition (valid for `engine`).
        prompt: The user prompt.
        engine: A registered engine's name (`engines.ENGINES`).
        deps: The run's deps, of the agent's `deps_type`.
        message_history: Prior messages (ignored with `conversation_id`: the stored history is used).
        conversation_id: Conversation to load from and append to (any engine, the same store).
        run_id: The engine's id for the run (workflow id); default `{agent name}-{uuid4}` where the engine takes one.
        notify: Where the engine reports what it does on the user's behalf (default: stderr); the run's id among the
            first lines, the moment the engine has the run.
        on_start: Called with the run's id the moment the engine has the run (durable engines).
        busy: What the turn does when another run's turn holds `conversation_id` (one turn at a time per
            conversation): `'reject'` (refused before any side effect: `ConversationBusyError`, DC050, naming the run
            that holds it) or `'enqueue'` (waits until that turn is stored, then runs on top of it); `None`: the
            agent's `DurableAgent(busy=...)` (default `'reject'`).
        settings: Engine settings (`address`, `task_queue`, `inline_worker`, `namespace`, `db`, ...); an engine
            ignores those it does not use. Not `event_stream_handler`: a run streams through the handler given to the
            engine's durability capability, `DurableAgent(engine_options={engine: {'event_stream_handler': h}})`,
            which runs inside the model request unit (docs/providers.md).

    Returns:
        The `RunReport`.

    Raises:
        ValueError: unknown engine.
        InputError: DC040, `busy` is not a strategy.
        ConversationBusyError: DC050 (see `busy`).
        TypeError: `event_stream_handler` passed here (see `settings`).
        DurableConfigError: the definition or the stored history has errors.
        Exception: whatever the engine raised when the run failed.
    """
    if 'event_stream_handler' in settings:
        raise TypeError(f"runner.run() takes no event_stream_handler: give it to the engine's durability capability, "
                        f"DurableAgent(..., engine_options={{{engine!r}: {{'event_stream_handler': handler}}}}), where it "
                        'runs inside the model request unit (docs/providers.md, "Streaming")')
    if check_busy(busy) is not None:
        settings = {**settings, 'busy': busy}
    adapter = get(engine)
    if agent.budget is not None and run_id is None and not adapter.durable:  # the run's key needs its id
        run_id = f'local-{uuid.uuid4().hex}'
    options = RunOptions(deps, message_history, conversation_id, run_id, settings, notify, on_start)
    if telemetry.enabled():
        report = await _traced_run(agent, prompt, engine, options)
    else:
        report = await adapter.run(agent, prompt, options)
    if agent.budget is not None:
        report.budget = await _spend(agent, report.run_id or run_id or '', conversation_id, deps, settings.get('store'))
    return report


async def _spend(agent: DurableAgent[Any, Any], run_id: str, conversation_id: str | None, deps: Any,
                 store: str | None) -> dict[str, Any] | None:
    """The spend of the run's budget key as stored (`RunReport.budget`), `None` when the key has none yet."""
    from .conversations import process_store, store_url

    budget = agent.budget
    assert budget is not None
    key = budget.key(run_id=run_id, conversation_id=conversation_id, deps=deps)
    from .store._budgets import records

    # Read here, not in a thread: DBOS's one-shot run shuts this loop's default executor down when it ends.
    found = records(process_store(store_url(agent, budget.store or store))._sql, key)
    return found[0].to_json() if found else None


async def _traced_run(agent: DurableAgent[Any, Any], prompt: str | None, engine: str, options: RunOptions) -> RunReport:
    """`get(engine).run` with the run's root span (`telemetry.record_run`, emitted when the run ends, from this
    call's start), its metrics, and, on the local engine, the run's id around its in-process units."""
    start, started, error = telemetry.run_started(), [options.run_id], None
    adapter = get(engine)
    if not adapter.durable and options.run_id is None:
        options.run_id = started[0] = f'local-{uuid.uuid4().hex}'
    user_on_start = options.on_start

    def on_start(run_id: str) -> None:
        started[0] = run_id
        if user_on_start is not None:
            user_on_start(run_id)

    options.on_start = on_start
    telemetry.run_started_metric(agent.name, engine)
    try:
        if adapter.durable:
            report = await adapter.run(agent, prompt, options)
        else:
            with telemetry.in_run(started[0] or '', engine, agent.name):
                report = await adapter.run(agent, prompt, options)
        started[0] = report.run_id or started[0]
        return report
    except BaseException as exc:
        error = exc
        raise
    finally:
        if started[0]:
            telemetry.record_run(started[0], agent=agent.name, engine=engine, conversation_id=options.conversation_id,
                                 start_ns=start, error=error)


async def approvals(run_id: str | None = None, *, engine: str = DEFAULT_ENGINE, **settings: Any) -> list[PendingCall]:
    """Tool calls waiting for a person on `engine` (only those of run `run_id` when given).

    Args:
        run_id: The waiting run (workflow id, flow run id), or `None` for every waiting run.
        engine: A durable engine's name.
        settings: Engine settings (`address`, `namespace` for Temporal, `db` for DBOS).

    Returns:
        One `approvals.PendingCall` per waiting call (tool, arguments, fingerprint, requested at, deadline).
    """
    return await get(engine).pending_approvals(settings, run_id)


async def decide(
    run_id: str,
    call_id: str,
    *,
    approve: bool,
    reason: str | None = None,
    override_args: dict[str, Any] | None = None,
    by: str | None = None,
    fingerprint_: str | None = None,
    engine: str = DEFAULT_ENGINE,
    **settings: Any,
) -> Decision:
    """Approve or deny one waiting call; the run continues once all its pending calls are decided.

    Args:
        run_id / call_id: The waiting run and the call (see `approvals`).
        approve: Run the call (`True`) or deny it (`False`, the model receives `reason`).
        reason: Why (shown to the model on denial, stored in the audit).
        override_args: Arguments to run the approved call with instead of the model's.
        by: Who decides (default: the OS user).
        fingerprint_: The fingerprint the person reviewed (default: the pending call's current one).
        engine / settings: As for `approvals`.

    Returns:
        The `Decision` delivered.

    Raises:
        approvals.ApprovalError: unknown run or call, or `fingerprint_` is not the pending call's (nothing changes).
    """
    adapter = get(engine)
    call = None
    if fingerprint_ is None or telemetry.enabled():
        pending = {c.call_id: c for c in await adapter.pending_approvals(settings, run_id)}
        call = pending.get(call_id)
    if fingerprint_ is None:
        fingerprint_ = call.fingerprint if call is not None else fingerprint('', {})
    decision = Decision(call_id, fingerprint_, approve, reason, override_args, by or default_user())
    await adapter.decide(run_id, decision, settings)
    if call is not None:  # the wait ends where the person decides (the engine's wait replays: no span there)
        telemetry.record_approval(run_id, engine=engine, agent=call.agent, tool=call.tool_name, call_id=call_id,
                                  requested_at=call.requested_at, approved=approve, by=decision.by, reason=reason)
    return decision
