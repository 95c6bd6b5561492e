"""DBOS approvals, workflow side: the gate a `durcap.*` workflow waits in for decisions (`DBOSApprovalGate`), the
event it publishes its pending calls under and the message topic decisions arrive on. The client side (list,
decide) is `_runs`.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any

from dbos import DBOS

from ...approvals import ApprovalError, ApprovalGate, Decision, PendingCall, check_decision, utc_now
from ._spec import DECISION_TOPIC, PENDING_EVENT, approval_step_name

if TYPE_CHECKING:
    from ...agent import DurableAgent


_PARKED: set[str] = set()
"""Ids of the workflows of this process waiting in `DBOSApprovalGate.wait` for a decision (in `DBOS.recv_async`)."""


def parked_workflow_ids() -> set[str]:
    """The workflows of this process parked on an approval now: each waits for a decision in the system database, so
    a worker's drain does not wait for them (another process resumes them, `_worker._drain`)."""
    return set(_PARKED)


def _clock() -> str:
    return utc_now().isoformat()


class DBOSApprovalGate(ApprovalGate):
    """Waits in the workflow: pending calls published as event `PENDING_EVENT`, decisions received with
    `DBOS.recv_async(DECISION_TOPIC, timeout_seconds=...)` (a durable sleep: no step or thread is held, and a
    recovered workflow waits until the same deadline); the clock is a recorded step."""

    def __init__(self, agent: DurableAgent[Any, Any]):
        self.agent = agent
        self.run_id = DBOS.workflow_id or ''

    async def now(self) -> Any:
        stamp = await DBOS.run_step_async({'name': approval_step_name(self.agent)}, _clock)  # type: ignore[arg-type]
        return datetime.fromisoformat(stamp)

    async def wait(self, pending: list[PendingCall], timeout: float) -> dict[str, Decision]:
        deadline = datetime.fromisoformat(pending[0].deadline)
        remaining, decisions = list(pending), {}
        await DBOS.set_event_async(PENDING_EVENT, [call.to_json() for call in remaining])
        while remaining:
            left = (deadline - await self.now()).total_seconds()
            if left <= 0:
                break
            _PARKED.add(self.run_id)
            try:
                message = await DBOS.recv_async(DECISION_TOPIC, timeout_seconds=left)
            finally:
                _PARKED.discard(self.run_id)
            if message is None:
                break  # the deadline passed: the remaining calls are denied
            decision = Decision.from_json(message)
            try:
                call = check_decision(remaining, decision, self.run_id)
            except ApprovalError:
                continue  # refused by `decide` already; a late duplicate changes nothing
            decisions[call.call_id] = decision
            remaining.remove(call)
            await DBOS.set_event_async(PENDING_EVENT, [call.to_json() for call in remaining])
        if remaining:
            await DBOS.set_event_async(PENDING_EVENT, [])
        return decisions
