"""Budgets (issue 28) in-process: 20 concurrent runs of one tenant key share one ledger, read and reset by `durcap
budgets`; `Budget`'s bad inputs.

Model: a scripted async `FunctionModel` (no provider): each request waits a few milliseconds (so the runs' requests
interleave), then calls a tool, four times, then answers; every response reports 100 tokens (70 input, 30 output).
The store and its ledger: SQLite in the test's folder (real SQL, every check and settle in its own write transaction,
run on the event loop's thread, or in the store's worker threads when another writer holds the lock).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from pydantic_ai import ModelResponse, TextPart, ToolCallPart
from pydantic_ai.messages import ModelMessage
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from durable_capabilities import Budget, BudgetExceededError, DurableAgent, runner
from tests._helpers import durcap_here, sql


def twenty_concurrent_runs(store: str) -> tuple[DurableAgent, int]:
    """A tenant budget of 10 requests' worth (1,000 tokens), 20 runs at once (local engine, this process, the store's
    threads) wanting 5 requests each: at most 10 + 20 requests reach the model (each run at most one in flight past
    the limit), every run that stopped did so with DC060 before a request, and the ledger holds exactly the tokens
    of the requests the model answered. Returns the agent and the requests billed."""
    billed: list[int] = []

    async def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        await asyncio.sleep(0.005)
        billed.append(1)
        usage = RequestUsage(input_tokens=70, output_tokens=30)
        if sum(1 for m in messages if m.kind == 'response') < 4:
            return ModelResponse(parts=[ToolCallPart('work', {})], usage=usage)
        return ModelResponse(parts=[TextPart('done')], usage=usage)

    def work() -> str:
        """Do some work."""
        return 'worked'

    agent = DurableAgent('tenant-budget', FunctionModel(script), deps_type=dict, engines=[], tools=[work],
                         budget=Budget(total_tokens=1_000, scope=lambda deps: f'tenant:{deps["tenant"]}',
                                       prices={'*': (1.0, 2.0)}))

    async def main() -> list[object]:
        return await asyncio.gather(*(runner.run(agent, f'job {n}', deps={'tenant': 'acme'}, store=store,
                                                 notify=lambda line: None) for n in range(20)), return_exceptions=True)

    outcomes = asyncio.run(main())
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert all(isinstance(e, BudgetExceededError) and e.code == 'DC060' and e.key == 'tenant:acme' for e in failed), failed
    assert failed, 'the budget stopped no run'
    print(f'billed {len(billed)} requests, {len(failed)} of 20 runs stopped')
    assert 10 <= len(billed) <= 10 + 20, len(billed)
    assert sql(store, "SELECT total_tokens, input_tokens, output_tokens, requests FROM durcap_budget_ledger") == [
        (100 * len(billed), 70 * len(billed), 30 * len(billed), len(billed))]
    assert sql(store, "SELECT COUNT(*) FROM durcap_budget_reservations WHERE state = 'settled'") == [(len(billed),)]
    # The price table: $1 / $2 per million input / output tokens, in nano-USD.
    assert sql(store, 'SELECT cost_nanos FROM durcap_budget_ledger') == [(130_000 * len(billed),)]
    return agent, len(billed)


def test_twenty_concurrent_runs_of_one_tenant_overspend_by_at_most_one_request_each(tmp_path: Path) -> None:
    """`twenty_concurrent_runs` on SQLite (tests/engines/test_budgets.py runs it on PostgreSQL), then `durcap budgets`
    on its ledger."""
    store = f'sqlite:///{tmp_path / "conversations.db"}'
    agent, billed = twenty_concurrent_runs(store)

    # `durcap budgets list|show|reset` read and reset the same ledger.
    listed = durcap_here('budgets', 'list', '--store', store, '--format', 'json')
    assert listed.exit_code == 0, listed.stdout
    [record] = json.loads(listed.stdout)
    assert record['key'] == 'tenant:acme' and record['spent']['total_tokens'] == 100 * billed
    assert record['limits'] == {'total_tokens': 1000} and record['in_flight'] == 0
    shown = durcap_here('budgets', 'show', 'tenant:acme', '--store', store)
    assert shown.exit_code == 0 and f'total_tokens: {100 * billed:,} / 1,000' in shown.stdout, shown.stdout
    # A key without a ledger has spent nothing: said so, exit 0 (it was exit 1 with an error-like line).
    other = durcap_here('budgets', 'show', 'tenant:other', '--store', store)
    assert other.exit_code == 0 and other.stdout.startswith("budget key 'tenant:other' has spent nothing"), other.stdout
    other_json = json.loads(durcap_here('budgets', 'show', 'tenant:other', '--store', store, '--format', 'json').stdout)
    assert other_json['spent']['total_tokens'] == 0 and other_json['limits'] == {} and other_json['updated_at'] is None
    unknown = durcap_here('budgets', 'reset', 'tenant:other', '--store', store)  # exit 1, no code, no fix before
    assert unknown.exit_code == 2, unknown.stderr
    assert unknown.stderr.startswith(f"durcap: error: DC044 budget key 'tenant:other' is not in the store {store}: "
                                     'nothing was reset. Fix: `durcap budgets list` shows'), unknown.stderr
    assert durcap_here('budgets', 'reset', 'tenant:acme', '--store', store).exit_code == 0
    assert durcap_here('budgets', 'list', '--store', store).stdout.strip() == 'no budget has spent anything in this store'
    after = asyncio.run(runner.run(agent, 'again', deps={'tenant': 'acme'}, store=store, notify=lambda line: None))
    assert after.budget is not None and after.budget['spent']['requests'] == 5  # reset: the next run starts from zero


@pytest.mark.parametrize(('kwargs', 'message'), [
    ({}, 'give at least one limit'),
    ({'total_tokens': -1}, 'a limit is a number >= 0'),
    ({'cost': 1.0, 'scope': 'tenant'}, "'run', 'conversation' or a callable"),
    ({'cost': 1.0, 'on_exceed': 'wait'}, "'error' or 'approval'"),
    ({'total_tokens': 10, 'raise_by': -5}, r'raise_by=\.\.\.\): what an approval adds is a number > 0, not -5'),
    ({'total_tokens': 10, 'raise_by': 0}, 'a number > 0, not 0'),
    ({'cost': 1.0, 'prices': {'*': (-1, 2)}}, r"prices=\{'\*': \.\.\.\}\): a price is .* not \(-1, 2\)"),
    ({'cost': 1.0, 'prices': {'gpt': (1,)}}, 'two numbers >= 0'),
])
def test_budget_refuses_bad_input(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Budget(**kwargs)


def ledger_semantics(store_url: str) -> None:
    """The ledger's writes, one request at a time, on the store at `store_url`: a reservation settled counts once
    (settled again, as a retried unit does, its usage replaces the first); a retried reservation is admitted unchecked
    and a new one refused at the limit; a released reservation is dropped (a settled one is not); a key reset between
    a reservation and its settle starts a new ledger from that settle."""
    from durable_capabilities.store import SQLConversationStore

    def ledger(opened: SQLConversationStore) -> list[tuple]:
        return sql(store_url, 'SELECT budget_key, input_tokens, output_tokens, total_tokens, cost_nanos, requests '
                              'FROM durcap_budget_ledger ORDER BY budget_key')

    def states() -> list[tuple]:
        return sql(store_url, 'SELECT request_id, state, input_tokens, output_tokens FROM durcap_budget_reservations '
                              'ORDER BY request_id')

    async def main() -> None:
        with SQLConversationStore(store_url) as opened:
            limits: dict[str, float] = {'total_tokens': 150}
            assert await opened.budget_reserve('k', 'r#1', 'r', limits) is None
            assert states() == [('r#1', 'reserved', 0, 0)]
            await opened.budget_settle('k', 'r#1', 'r', input_tokens=70, output_tokens=30, cost=0.5)
            assert ledger(opened) == [('k', 70, 30, 100, 500_000_000, 1)]
            await opened.budget_settle('k', 'r#1', 'r', input_tokens=80, output_tokens=40, cost=0.25)  # a retried unit
            assert ledger(opened) == [('k', 80, 40, 120, 250_000_000, 1)]
            await opened.budget_release('k', 'r#1')  # settled: kept
            assert states() == [('r#1', 'settled', 80, 40)]
            assert await opened.budget_reserve('k', 'r#1', 'r', limits) is None  # a retry: admitted unchecked
            assert await opened.budget_reserve('k', 'r#2', 'r', limits) is None  # 120 < 150
            await opened.budget_settle('k', 'r#2', 'r', input_tokens=20, output_tokens=20)
            refused = await opened.budget_reserve('k', 'r#3', 'r', limits)
            assert refused is not None and refused.spent['total_tokens'] == 160 and refused.limits == limits
            assert await opened.budget_reserve('other', 'o#1', 'o', limits) is None
            await opened.budget_release('other', 'o#1')  # failed before the provider answered: dropped
            assert [row[0] for row in states()] == ['r#1', 'r#2']
            assert await opened.budget_reserve('k2', 'q#1', 'q', limits) is None
            assert await opened.budget_reset('k2')
            await opened.budget_settle('k2', 'q#1', 'q', input_tokens=5, output_tokens=5)
            assert ledger(opened)[1:] == [('k2', 5, 5, 10, 0, 1), ('other', 0, 0, 0, 0, 0)]
            [record] = await opened.budgets('k')
            assert record.spent['requests'] == 2 and record.in_flight == 0 and record.limits == limits

    asyncio.run(main())


def test_ledger_counts_a_settled_request_once_releases_and_resets(store_url: str) -> None:
    """`ledger_semantics` on SQLite (tests/engines/test_budgets.py runs it on PostgreSQL). No model: the store's
    budget calls, as `BudgetModel` makes them."""
    ledger_semantics(store_url)


def test_a_ledger_write_that_would_wait_runs_in_a_worker_thread(tmp_path: Path) -> None:
    """On SQLite the ledger's per-request writes run on the event loop's thread, in a transaction that never waits
    (`_SQLBackend._quick_txn`). While another connection holds SQLite's write lock (as another process would), that
    attempt does nothing (`_WouldWait`) and the write waits in the ledger's worker thread until the lock is free, then
    counts once. No model: the store's budget calls, as `BudgetModel` makes them; the other writer is a plain sqlite3
    connection to the same file."""
    import sqlite3

    from durable_capabilities.store import SQLConversationStore, _budgets
    from durable_capabilities.store._sql import _WouldWait

    path = tmp_path / 'conversations.db'
    url = f'sqlite:///{path}'

    async def main() -> None:
        with SQLConversationStore(url) as opened:
            limits: dict[str, float] = {'total_tokens': 1_000}
            assert await opened.budget_reserve('k', 'r#1', 'r', limits) is None
            assert await opened.budget_reserve('k', 'r#2', 'r', limits) is None
            assert getattr(opened._sql._quick, 'raw', None) is not None  # the loop thread's own connection wrote it
            other = sqlite3.connect(path, isolation_level=None)
            other.execute('BEGIN IMMEDIATE')
            try:
                with pytest.raises(_WouldWait):
                    _budgets.settle(opened._sql, 'k', 'r#1', 'r', 70, 30, 0.0, quick=True)
                settling = asyncio.ensure_future(opened.budget_settle('k', 'r#1', 'r', input_tokens=70, output_tokens=30))
                await asyncio.sleep(0)  # the settle has started: it cannot finish while the lock is held
                assert not settling.done()
                assert other.execute("SELECT state FROM durcap_budget_reservations WHERE request_id = 'r#1'"
                                     ).fetchall() == [('reserved',)]
            finally:
                other.execute('COMMIT')
                other.close()
            await settling
            await opened.budget_settle('k', 'r#2', 'r', input_tokens=7, output_tokens=3)  # the loop's again

    asyncio.run(main())
    assert sql(url, 'SELECT input_tokens, output_tokens, total_tokens, requests FROM durcap_budget_ledger') == [
        (77, 33, 110, 2)]


@pytest.mark.parametrize(('decision', 'approved', 'clause'), [
    ({'by': 'alice', 'reason': 'enough for today'}, False, 'the raise by 51 was denied by alice (enough for today)'),
    ({'by': 'bob'}, False, 'the raise by 51 was denied by bob'),
    (None, False, 'the raise by 51 was not decided before its deadline (2026-01-01T00:05:00+00:00), so denied'),
    ({'by': 'carol'}, True, 'the raise by 51 was approved and made, and the spend is still at or over the raised limit'),
])
def test_dc060_after_a_raise_decision_says_what_became_of_the_raise(decision: dict | None, approved: bool, clause: str) -> None:
    """The DC060 line a run fails with right after an operator's decision on `durcap_raise_budget` (`on_exceed=
    'approval'`): "budget B for key K: spent S of limit L; the raise by N was denied by WHO (WHY)" (or not decided in
    time, or approved and still too little). The messages are what upstream builds from `approvals.deferred_results`
    (a denial: `ToolReturnPart(outcome='denied')` with its words); the engine tests (tests/engines/test_budgets.py) show
    the same line from a real `durcap deny`."""
    from pydantic_ai.messages import ModelRequest, ToolReturnPart

    from durable_capabilities.approvals import Decision, PendingCall, deferred_results
    from durable_capabilities.budget import RAISE_TOOL
    from durable_capabilities.budgets import _raise_decided

    args = {'budget': 'total_tokens', 'key': 'conversation:c1', 'by': 51, 'spent': 100, 'limit': 50}
    call = PendingCall('r1', 'durcap-budget-3', RAISE_TOOL, args, 'f', '2026-01-01T00:00:00+00:00', '2026-01-01T00:05:00+00:00')
    decisions = {} if decision is None else {call.call_id: Decision(call.call_id, 'f', approve=approved, **decision)}
    result = deferred_results([call], decisions).approvals[call.call_id]
    part = (ToolReturnPart(RAISE_TOOL, 'raised', tool_call_id=call.call_id) if approved else
            ToolReturnPart(RAISE_TOOL, result.message, tool_call_id=call.call_id, outcome='denied'))
    messages: list[ModelMessage] = [ModelResponse(parts=[ToolCallPart(RAISE_TOOL, args, tool_call_id=call.call_id)]),
                                    ModelRequest(parts=[part])]
    error = BudgetExceededError('total_tokens', 'conversation:c1', 200, 101, decided=_raise_decided(messages) or False)
    assert str(error.message).startswith(f"DC060 budget total_tokens for key 'conversation:c1': spent 200 tokens of limit "
                                         f'101 tokens; {clause}; the model request was not sent. Fix: '), error.message
    assert _raise_decided(messages[:1]) is None


def test_a_reservation_in_one_statement_leaves_raised_changed_and_spent_budgets_to_the_full_check(tmp_path: Path) -> None:
    """On SQLite a reservation is first one statement (`_budgets._admit`), which reserves only while the key's ledger
    row is under every limit, was never raised and holds these limits; every other case goes to the full transaction
    and decides as before: a raise lets a request through past the given limit, changed limits are written for
    `durcap budgets`, a cost spent exactly to its limit refuses, one nano-USD under admits. No model: the store's
    budget calls, as `BudgetModel` makes them; real SQLite in the test's folder."""
    from durable_capabilities.store import SQLConversationStore, _budgets

    url = f'sqlite:///{tmp_path / "conversations.db"}'

    async def main() -> None:
        with SQLConversationStore(url) as opened:
            tokens: dict[str, float] = {'total_tokens': 100}
            assert await opened.budget_reserve('k', 'r#1', 'r', tokens) is None  # a new key: the full transaction
            await opened.budget_settle('k', 'r#1', 'r', input_tokens=60, output_tokens=40)
            statement, params = _budgets._admit('k', 'r#2', 'r', tokens)
            assert opened._sql._quick_run(lambda raw: raw.execute(statement, params).rowcount, begin=False) == 0  # spent
            assert await opened.budget_reserve('k', 'r#2', 'r', tokens) is not None
            await opened.budget_raise('k', 'total_tokens', 50)
            assert await opened.budget_reserve('k', 'r#2', 'r', tokens) is None  # 100 < 100 + 50: the full check
            await opened.budget_settle('k', 'r#2', 'r', input_tokens=30, output_tokens=30)
            assert await opened.budget_reserve('k', 'r#3', 'r', tokens) is not None  # 160 >= 150

            cost: dict[str, float] = {'cost': 0.5, 'total_tokens': 10**6}
            assert await opened.budget_reserve('c', 'q#1', 'q', cost) is None
            await opened.budget_settle('c', 'q#1', 'q', input_tokens=1, output_tokens=1, cost=0.5 - 1e-9)
            assert await opened.budget_reserve('c', 'q#2', 'q', cost) is None  # one nano-USD under: the one statement
            assert sql(url, "SELECT state FROM durcap_budget_reservations WHERE request_id = 'q#2'") == [('reserved',)]
            await opened.budget_settle('c', 'q#2', 'q', input_tokens=1, output_tokens=1, cost=1e-9)
            refused = await opened.budget_reserve('c', 'q#3', 'q', cost)  # 0.5 of 0.5
            assert refused is not None and _budgets.exceeded(refused) == 'cost'
            changed: dict[str, float] = {'cost': 2.0}
            assert await opened.budget_reserve('c', 'q#3', 'q', changed) is None  # other limits: the full transaction
            [record] = await opened.budgets('c')
            assert record.limits == {'cost': 2.0} and record.in_flight == 1 and record.spent['requests'] == 2

    asyncio.run(main())
