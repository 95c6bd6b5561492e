"""Temporal's approval wait, in workflow code: the gate, and the update and query handlers of the workflow class.

Decisions arrive by the `DECIDE_UPDATE` update (its validator rejects an unknown call id or a stale fingerprint before
anything is recorded); the pending calls are readable by the `PENDING_QUERY` query and the `PENDING_MEMO` memo.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

from temporalio import workflow

from ...approvals import ApprovalGate, Decision, PendingCall, check_decision, check_not_expired
from ._patches import patched
from ._spec import DECIDE_UPDATE, PENDING_MEMO, PENDING_QUERY, TURN_REQUEST_LIMIT_PATCH_ID


def _pending_of(instance: Any) -> list[PendingCall]:
    return getattr(instance, '_durcap_pending', [])


def _publish_pending(pending: list[PendingCall]) -> None:
    workflow.upsert_memo({PENDING_MEMO: [c.to_json() for c in pending] or None})


class TemporalApprovalGate(ApprovalGate):
    """Waits in the workflow with `workflow.wait_condition(..., timeout=)` (a durable timer: no worker slot is
    held, and another worker continues the run); decisions arrive by the `DECIDE_UPDATE` update, the pending
    calls are readable by the `PENDING_QUERY` query and the `PENDING_MEMO` memo."""

    def __init__(self, instance: Any):
        self.instance = instance
        self.run_id = workflow.info().workflow_id

    async def now(self) -> Any:
        return workflow.now()

    def bounds_rounds(self) -> bool:
        """Behind the patch marker `TURN_REQUEST_LIMIT_PATCH_ID`: a history recorded before the turn-wide request
        limit went on past it, and replays so."""
        return patched(TURN_REQUEST_LIMIT_PATCH_ID)

    async def wait(self, pending: list[PendingCall], timeout: float) -> dict[str, Decision]:
        instance = self.instance
        instance._durcap_pending, instance._durcap_decisions = list(pending), {}
        _publish_pending(instance._durcap_pending)
        left = (datetime.fromisoformat(pending[0].deadline) - workflow.now()).total_seconds()
        try:
            await workflow.wait_condition(lambda: not instance._durcap_pending, timeout=max(left, 0.001))
        except TimeoutError:
            pass  # the remaining calls are denied with the timeout reason
        decisions = dict(instance._durcap_decisions)
        instance._durcap_pending = []
        _publish_pending([])
        return decisions


def approval_handlers(class_name: str, module: str) -> dict[str, Any]:
    """The workflow class's `decide` update (with its validator) and `pending` query, as class attributes.

    Made anew for each class: Temporal looks handlers up by qualified name, so each gets `{class_name}.{method}`
    and `module` as its own."""

    def validate_decision(self: Any, decision: dict[str, Any]) -> None:
        parsed = Decision.from_json(decision)
        check_decision(_pending_of(self), parsed, workflow.info().workflow_id,
                       validate_args=False)  # workflow code: the client checked them (no jsonschema here)
        # A decision its command gave up on (not accepted before `not_after`) is refused: validators do not run on
        # replay and a refused update leaves no event, so this changes no recorded history.
        check_not_expired(parsed, workflow.now(), workflow.info().workflow_id)

    async def decide(self: Any, decision: dict[str, Any]) -> dict[str, Any]:
        parsed = Decision.from_json(decision)
        call = check_decision(_pending_of(self), parsed, workflow.info().workflow_id, validate_args=False)
        self._durcap_decisions[call.call_id] = parsed
        self._durcap_pending = [c for c in self._durcap_pending if c.call_id != call.call_id]
        _publish_pending(self._durcap_pending)
        return call.to_json()

    def pending(self: Any) -> list[dict[str, Any]]:
        return [c.to_json() for c in _pending_of(self)]

    methods: tuple[tuple[Callable[..., Any], str], ...] = (
        (decide, 'decide'), (validate_decision, 'validate_decision'), (pending, 'pending'))
    for method, method_name in methods:
        method.__qualname__, method.__module__ = f'{class_name}.{method_name}', module
    decide_update = workflow.update(name=DECIDE_UPDATE)(decide)
    decide_update.validator(validate_decision)
    return {'decide': decide_update, 'pending': workflow.query(name=PENDING_QUERY)(pending)}
