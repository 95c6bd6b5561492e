"""The engine-neutral approval model: fingerprints, decision checks, results, audit, timeouts (no engine)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from pydantic_ai.messages import ToolCallPart
from pydantic_ai.tools import DeferredToolRequests, ToolApproved, ToolDenied

from durable_capabilities import DurableAgent
from durable_capabilities.approvals import (
    DEFAULT_APPROVAL_TIMEOUT,
    ApprovalError,
    Decision,
    already_decided,
    audit_records,
    check_decision,
    deferred_results,
    fingerprint,
    pending_calls,
    timeout_seconds,
)

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def _pending() -> list:
    requests = DeferredToolRequests(approvals=[
        ToolCallPart('revoke_sessions', {'account_id': 'acct-42', 'all': True}, tool_call_id='c1'),
        ToolCallPart('issue_refund', '{"order_id": "A-1", "amount": 10}', tool_call_id='c2'),
    ])
    return pending_calls(requests, run_id='r1', agent='support', conversation_id='t-1', now=NOW, timeout=60)


def test_fingerprint_is_canonical_and_binds_name_and_arguments() -> None:
    a = fingerprint('revoke_sessions', {'account_id': 'acct-42', 'all': True})
    assert a == fingerprint('revoke_sessions', {'all': True, 'account_id': 'acct-42'})  # key order does not matter
    assert a == fingerprint('revoke_sessions', '{"all": true, "account_id": "acct-42"}')  # JSON text as the model gave it
    assert len(a) == 64
    assert a != fingerprint('revoke_sessions', {'account_id': 'acct-43', 'all': True})
    assert a != fingerprint('other_tool', {'account_id': 'acct-42', 'all': True})


def test_pending_calls_carry_fingerprint_and_deadline() -> None:
    first, second = _pending()
    assert (first.call_id, first.tool_name, first.args) == ('c1', 'revoke_sessions', {'account_id': 'acct-42', 'all': True})
    assert second.args == {'order_id': 'A-1', 'amount': 10}
    assert first.fingerprint == fingerprint('revoke_sessions', first.args)
    assert first.deadline == (NOW + timedelta(seconds=60)).isoformat()
    assert (first.agent, first.conversation_id, first.run_id) == ('support', 't-1', 'r1')


def test_check_decision_refuses_stale_fingerprint_and_unknown_call() -> None:
    pending = _pending()
    assert check_decision(pending, Decision('c1', pending[0].fingerprint, True), 'r1') is pending[0]
    with pytest.raises(ApprovalError) as stale:
        check_decision(pending, Decision('c1', pending[1].fingerprint, True), 'r1')
    assert stale.value.kind == 'stale-fingerprint'
    with pytest.raises(ApprovalError) as unknown:
        check_decision(pending, Decision('c9', pending[0].fingerprint, True), 'r1')
    assert unknown.value.kind == 'unknown-call'
    # A second decision on a decided call (issue 13): its own kind and code (DC054, not `unknown-call`), naming the
    # run, the call and the first decision, with a fix.
    first = Decision('c1', pending[0].fingerprint, False, reason='no', by='dana', at='2026-05-01T12:00:00+00:00')
    refused = already_decided('r1', 'c1', first, received=False)
    assert (refused.kind, refused.code) == ('already-decided', 'DC054')
    assert str(refused).startswith("DC054 run 'r1': call 'c1' was already denied by dana at 2026-05-01T12:00:00+00:00 "
                                   '(sent; the run takes it at its next step, or when it runs again if its process is '
                                   'down); a call is decided once'), str(refused)
    assert 'Fix: nothing to send, the first decision stands' in str(refused) and '\n' not in str(refused)


def test_results_approve_with_override_deny_with_reason_and_time_out() -> None:
    pending = _pending()
    one = {'c1': Decision('c1', pending[0].fingerprint, True, override_args={'account_id': 'acct-1'}, by='dana')}
    results = deferred_results(pending, one)
    assert results.approvals['c1'] == ToolApproved(override_args={'account_id': 'acct-1'})
    timed_out = results.approvals['c2']
    assert isinstance(timed_out, ToolDenied) and 'before its deadline' in timed_out.message
    denied = deferred_results(pending, {'c2': Decision('c2', pending[1].fingerprint, False, reason='Too much.')})
    assert denied.approvals['c2'] == ToolDenied('Too much.')
    audit = audit_records(pending, one)
    assert [(a['call_id'], a['decision'], a['by']) for a in audit] == [('c1', 'approved', 'dana'), ('c2', 'timed out', None)]
    assert audit[0]['fingerprint'] == pending[0].fingerprint


def test_timeout_default_and_per_agent() -> None:
    assert timeout_seconds(None) == DEFAULT_APPROVAL_TIMEOUT.total_seconds() == 86400
    assert timeout_seconds(timedelta(minutes=2)) == 120
    with pytest.raises(ValueError, match='approval_timeout must be positive'):
        timeout_seconds(0)
    assert DurableAgent('gate-timeouts', 'test', approval_timeout=5).approval_timeout == 5
