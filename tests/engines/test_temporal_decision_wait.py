"""A Temporal decision no worker takes gives up within `$DURCAP_DECISION_WAIT` (docs/errors.md DC052), not after the
wait plus a grace on top (issue 26/29 loose end: ~40 s at the default 30 s, after the worker got SIGTERM under load).

Model: the scripted `FunctionModel` of tests/engines/approval_agent.py (it calls the gated `revoke_sessions`). Real
parts: the Temporal dev server at `$DURCAP_TEST_TEMPORAL_ADDRESS` (else one started for the session), a `durcap worker`
driver subprocess on a task queue of its own, stopped with SIGTERM while its run waits for the approval (a stopped
worker stays listed as a poller for minutes, so the decision is sent), and `runner.decide` in this process.

Before the fix the decision's `not_after` was the whole wait after the command's reads, and the command waited that
plus `DECISION_GRACE_SECONDS` (10 s): a 6 s wait gave up after ~16 s with a `not_after` past the 6 s.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from durable_capabilities import runner
from durable_capabilities.approvals import DecisionNotDeliveredError
from tests.engines.test_approvals import TARGET, env_for, pending, revocations, start_gated_temporal

WAIT = 6.0


def test_a_decision_no_worker_takes_gives_up_within_the_decision_wait(temporal_address: str, spawn, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's only worker stopped with SIGTERM: `runner.decide` raises DC052 `not-delivered` within the wait (plus
    a second for the answer's cancellation), and the decision expires before the wait ends, so a worker that takes it
    later refuses it; nothing ran."""
    env, crash_dir = env_for(tmp_path)
    queue = f'wait-{uuid.uuid4().hex[:8]}'
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', temporal_address, '--task-queue', queue, env=env)
    worker.wait_for('WORKER READY', 90)
    run_id = f'decision-wait-{uuid.uuid4().hex[:8]}'
    start_gated_temporal(temporal_address, run_id, queue, 'revoke erin')
    [call] = pending(['--engine', 'temporal', '--address', temporal_address], run_id)
    worker.stop()  # SIGTERM: the worker drains and exits
    assert worker.popen.poll() is not None
    monkeypatch.setenv('DURCAP_DECISION_WAIT', str(WAIT))
    began, began_at = time.monotonic(), datetime.now(UTC)
    with pytest.raises(DecisionNotDeliveredError) as refused:
        asyncio.run(runner.decide(run_id, call['call_id'], approve=True, by='ops', engine='temporal',
                                  address=temporal_address))
    took = time.monotonic() - began
    assert refused.value.kind == 'not-delivered', refused.value
    not_after = datetime.fromisoformat(str(refused.value).split('it expires at ', 1)[1].split(' ')[0])
    assert not_after <= began_at + timedelta(seconds=WAIT), (not_after, began_at)
    assert took < WAIT + 1, took
    assert revocations(crash_dir) == []
