"""Run a `DurableAgent` once on any registered engine and report what the engine recorded.

Used by `durcap run` and `durcap demo`. The engine is looked up in the registry (`engines.get`); each
adapter runs the path its users know (see `engines/<name>.py`) and returns a `report.RunReport`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from . import telemetry
from .agent import DurableAgent
from .approvals import ApprovalError, Decision, PendingCall, default_user, fingerprint
from .conversations import check_busy, process_store, store_url
from .engines import DEFAULT_ENGINE, RunOptions, get
from .engines._adapter import _stderr
from .report import RunReport
from .turn import run_turn

__all__ = ['RunReport', 'approvals', 'decide', 'run', 'run_in_process']

_logger = logging.getLogger('durable_capabilities.runner')


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
            that holds it), `'enqueue'` (waits until that turn is stored, then runs on top of it) or `'interrupt'`
            (asks that turn to stop at its next safe point, durably in the store: before its next model request it
            ends with an answer saying so; on a durable engine, each of its calls waiting for approval is denied here
            through `decide`, reason `interrupted by a newer turn (run X)`; then waits as `'enqueue'` does); `None`:
            the agent's `DurableAgent(busy=...)` (default `'reject'`).
        settings: Engine settings (`address`, `task_queue`, `inline_worker`, `namespace`, `db`, ...); an engine
            ignores those it does not use. Not `event_stream_handler`: a run streams through the handler given to the
            engine's durability capability, `DurableAgent(engine_options={engine: {'event_stream_handler': h}})`,
            which runs inside the model request unit (docs/providers.md).

    Returns:
        The `RunReport`.

    Raises:
        ValueError: unknown engine.
        InputError: DC040, `busy` is not a strategy; DC053, `'interrupt'` for an agent whose output is not text.
        ConversationBusyError: DC050 (see `busy`).
        TypeError: `event_stream_handler` passed here (see `settings`).
        DurableConfigError: the definition or the stored history has errors.
        Exception: whatever the engine raised when the run failed.
    """
    if 'event_stream_handler' in settings:
        raise TypeError(f"runner.run() takes no event_stream_handler: give it to the engine's durability capability, "
                        f"DurableAgent(..., engine_options={{{engine!r}: {{'event_stream_handler': handler}}}}), where it "
                        'runs inside the model request unit (docs/providers.md, "Streaming")')
    # The agent's own strategy travels with the run when it waits (as `durcap serve` passes it): an engine that picks
    # the load unit's options from it (Temporal: the heartbeating 48-hour load) must see it.
    if check_busy(busy, agent=agent) is not None or agent.busy != 'reject':
        settings = {**settings, 'busy': busy or agent.busy}
    adapter = get(engine)
    if agent.budget is not None and run_id is None and not adapter.durable:  # the run's key needs its id
        run_id = f'local-{uuid.uuid4().hex}'
    options = RunOptions(deps, message_history, conversation_id, run_id, settings, notify, on_start)
    if (busy or agent.busy) == 'interrupt' and conversation_id is not None and adapter.durable:
        report = await _interrupting(agent, prompt, engine, options, conversation_id)
    elif telemetry.enabled():
        report = await _traced_run(agent, prompt, engine, options)
    else:
        report = await adapter.run(agent, prompt, options)
    if agent.budget is not None:
        report.budget = await _spend(agent, report.run_id or run_id or '', conversation_id, deps, settings.get('store'))
    return report


INTERRUPT_POLL_SECONDS = (0.1, 1.0)
"""How often an interrupting caller looks at the conversation's claim: from the first value, doubling, up to the
second (`_deny_interrupted`)."""


async def _interrupting(agent: DurableAgent[Any, Any], prompt: str | None, engine: str, options: RunOptions,
                        conversation_id: str) -> RunReport:
    """The run of a turn with `busy='interrupt'` on a durable engine, with `_deny_interrupted` beside it until the
    turn holds its conversation (or the run ends)."""
    ours: list[str] = []
    user_on_start = options.on_start

    def on_start(run_id: str) -> None:
        ours.append(run_id)
        if user_on_start is not None:
            user_on_start(run_id)

    options.on_start = on_start
    watcher = asyncio.create_task(_deny_interrupted(agent, engine, conversation_id, options, ours))
    try:
        if telemetry.enabled():
            return await _traced_run(agent, prompt, engine, options)
        return await get(engine).run(agent, prompt, options)
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def _deny_interrupted(agent: DurableAgent[Any, Any], engine: str, conversation_id: str, options: RunOptions,
                            ours: list[str]) -> None:
    """The interrupted turn's first safe point: while the run holding `conversation_id` was asked to stop by our run
    (`ours[0]`, once the engine has it) and waits for approvals, deny each of its pending calls through the engine's
    own decision path (`decide`), reason `interrupted by a newer turn (run X)`: the run goes on with the denial as the
    call's result, and its next model request ends the turn (`interrupts`). Ends when our run holds the conversation.

    Errors reading the store or the engine are logged and tried again at the next look; a call already decided is
    left as it is."""
    settings = options.settings
    store = process_store(store_url(agent, settings.get('store')))
    denied: set[tuple[str, str]] = set()
    delay, cap = INTERRUPT_POLL_SECONDS
    while True:
        await asyncio.sleep(delay)
        delay = min(delay * 2, cap)
        if not ours:
            continue
        try:
            claim = await store.turn_stop(conversation_id)
        except Exception as error:  # noqa: BLE001 - looked at again next time
            _logger.debug('interrupt: reading the claim of %r failed: %s', conversation_id, error)
            continue
        if claim is not None and claim[0] == ours[0]:
            return  # our turn holds the conversation: the interrupted turn is stored
        if claim is None or claim[1] != ours[0]:
            continue
        holder = claim[0]
        try:
            calls = await get(engine).pending_approvals(settings, holder)
        except Exception as error:  # noqa: BLE001 - a holder on another engine, or the engine is away: next time
            _logger.debug('interrupt: listing the pending calls of %s failed: %s', holder, error)
            continue
        for call in calls:
            if (holder, call.call_id) in denied or call.decided:
                continue
            reason = f'interrupted by a newer turn (run {ours[0]})'
            try:
                await decide(holder, call.call_id, approve=False, reason=reason, by='durcap (interrupt)',
                             fingerprint_=call.fingerprint, engine=engine, **settings)
            except ApprovalError as error:  # decided meanwhile, or the run stopped waiting
                _logger.debug('interrupt: denying %s of %s: %s', call.call_id, holder, error)
            except Exception as error:  # noqa: BLE001 - tried again at the next look
                _logger.debug('interrupt: denying %s of %s failed: %s', call.call_id, holder, error)
                continue
            else:
                options.notify(f'run {holder}: its call {call.tool_name} ({call.call_id}) waiting for approval was '
                               f'denied: {reason}')
            denied.add((holder, call.call_id))


async def _spend(agent: DurableAgent[Any, Any], run_id: str, conversation_id: str | None, deps: Any,
                 store: str | None) -> dict[str, Any] | None:
    """The spend of the run's budget key as stored (`RunReport.budget`), `None` when the key has none yet."""
    from .conversations import process_store, store_url

    budget = agent.budget
    assert budget is not None
    key = budget.key(run_id=run_id, conversation_id=conversation_id, deps=deps)
    from .store._budgets import record

    # Read here, not in a thread: DBOS's one-shot run shuts this loop's default executor down when it ends.
    found = record(process_store(store_url(agent, budget.store or store))._sql, key)
    return found.to_json() if found is not None else None


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
    at: str | None = None,
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
        at: When the person decided, ISO 8601 UTC (default: now). The one value the run stores in its audit and every
            refusal of a later decision names (DC054): `durcap serve` passes the time it claimed the decision at.
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
    if at is not None:
        decision.at = at
    await adapter.decide(run_id, decision, settings)
    if call is not None:  # the wait ends where the person decides (the engine's wait replays: no span there)
        telemetry.record_approval(run_id, engine=engine, agent=call.agent, tool=call.tool_name, call_id=call_id,
                                  requested_at=call.requested_at, approved=approve, by=decision.by, reason=reason)
    return decision
