"""Durable human approval: what a pending call is, what a decision is, and how decisions become results.

When a durable run of a `DurableAgent` ends with `DeferredToolRequests` (a tool raised `ApprovalRequired`,
was declared with `requires_approval=True`, or a capability hook asked for approval), `turn.run_turn` turns
each approval request into a `PendingCall`, asks the engine's `ApprovalGate` to wait for decisions (a
Temporal update, a DBOS message, a Prefect pause) and continues the same run with `DeferredToolResults`.

Everything here is engine-neutral and deterministic; the waiting itself lives in each engine's adapter.
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .errors import NOT_FOUND_CODE, DurcapError, with_code

DEFAULT_APPROVAL_TIMEOUT = timedelta(hours=24)
"""How long a gated call waits for a decision unless `DurableAgent(approval_timeout=...)` says otherwise."""

AUDIT_METADATA_KEY = 'durcap_approvals'
"""Key of the audit records in the `metadata` of the request that carries the decided calls' results."""

EXIT_UNKNOWN = 2
"""CLI exit code for an unknown run or call, or a stale fingerprint (nothing changes)."""


def fingerprint(tool_name: str, args: dict[str, Any] | str | None) -> str:
    """`sha256` hex digest of the tool name and the canonical JSON of its arguments (sorted keys, no spaces).

    Args:
        tool_name: The tool's name.
        args: The call's arguments as a dict, or as the JSON text the model produced (`None`: no arguments).

    Returns:
        64 hex characters; equal for equal name and arguments whatever their key order.
    """
    if isinstance(args, str):
        args = json.loads(args) if args.strip() else {}
    canonical = json.dumps({'tool': tool_name, 'args': args or {}}, sort_keys=True, separators=(',', ':'),
                           ensure_ascii=False, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def timeout_seconds(value: timedelta | float | None) -> float:
    """A gate's timeout in seconds: `value` (a `timedelta` or seconds), default 24 hours.

    Raises:
        ValueError: `value` is not positive.
    """
    if value is None:
        return DEFAULT_APPROVAL_TIMEOUT.total_seconds()
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds <= 0:
        raise ValueError(f'approval_timeout must be positive, got {value!r}')
    return seconds


@dataclass
class PendingCall:
    """A tool call waiting for a person's decision.

    Attributes:
        run_id: The engine's id of the run that waits (workflow id, flow run id).
        call_id: The model's tool call id.
        tool_name: The tool.
        args: The arguments the model gave (JSON object).
        fingerprint: `fingerprint(tool_name, args)`: a decision must quote it.
        requested_at / deadline: ISO 8601 UTC times; at the deadline the call is denied (`timeout_reason`).
        agent: The agent's name.
        conversation_id: The conversation the run appends to, or `None`.
        engine: The engine the run is on (filled by the listing).
        decided: A decision already sent on this call that the run has not received yet (its process is down, or
            it has not reached the wait), as `'approved by alice at 2026-12-01T06:40:00+00:00'`; `None` when none
            was sent. DBOS reports it (there a decision waits in the system database for the run to read it, and the
            call stays published as pending until then: `durcap runs resume` the run if it is orphaned), and Prefect
            for a Crashed flow run (its decision input waits for `durcap runs resume`).
        schema: The tool's parameters JSON schema when the definition knows it (function tools; not MCP tools):
            arguments a decider edits (`override_args`, `--args`) are validated against it before they are sent
            (`ApprovalArgsError`, DC051). `None` in calls published before this field.
    """

    run_id: str
    call_id: str
    tool_name: str
    args: dict[str, Any]
    fingerprint: str
    requested_at: str
    deadline: str
    agent: str = ''
    conversation_id: str | None = None
    engine: str = ''
    decided: str | None = None
    schema: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The call as JSON-compatible data (what engines record and `durcap approvals list --format json` prints)."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PendingCall:
        """The inverse of `to_json`."""
        return cls(**data)


@dataclass
class Decision:
    """A person's decision on one pending call.

    Attributes:
        call_id: The call decided.
        fingerprint: The fingerprint of the call the person reviewed (refused when it is not the pending one's).
        approve: Run the call (`True`) or deny it (`False`).
        reason: Why (denials: returned to the model as the tool's result).
        override_args: Arguments to run the call with instead of the model's (approvals only).
        by: Who decided (a user name; default the OS user).
        at: When, ISO 8601 UTC.
        not_after: ISO 8601 UTC time after which the run refuses the decision (`check_not_expired`), `None`: no
            limit. Temporal sets it (`DURCAP_DECISION_WAIT`): a decision no worker accepted while its command waited is
            never delivered later, when nobody is watching.
    """

    call_id: str
    fingerprint: str
    approve: bool
    reason: str | None = None
    override_args: dict[str, Any] | None = None
    by: str = ''
    at: str = field(default_factory=lambda: utc_now().isoformat())
    not_after: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The decision as JSON-compatible data (the payload sent to the waiting run); `not_after` only when set, so
        a decision without one is the same JSON as before the field existed."""
        data = asdict(self)
        if data['not_after'] is None:
            del data['not_after']
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Decision:
        """The inverse of `to_json`. Keys this version does not know are ignored (a decision sent by a newer
        client to an older run)."""
        known = cls.__dataclass_fields__
        return cls(**{key: value for key, value in data.items() if key in known})


class ApprovalError(LookupError, DurcapError, code='approval'):
    """A decision that cannot be applied: unknown run, unknown call, a call already decided, or stale fingerprint.

    Attributes:
        kind: `'unknown-run' | 'unknown-call' | 'already-decided' | 'stale-fingerprint'` (and the kinds of the
            subclasses: `'invalid-args'`, `'no-worker'`, `'not-delivered'`, `'expired'`). An `'unknown-run'` message
            (no such run, or it waits for no approval) is led by `DC044`, as `durcap serve` answers it (404).
    """

    def __init__(self, kind: str, message: str):
        super().__init__(with_code(NOT_FOUND_CODE, message) if kind == 'unknown-run' else message)
        self.kind = kind

    def __reduce__(self) -> tuple[Any, ...]:  # pickled by DBOS and Prefect when a step or task raises it
        return (_restore, (type(self), self.kind, self.args[0] if self.args else ''))


def _restore(cls: type[ApprovalError], kind: str, message: str) -> ApprovalError:
    error = cls.__new__(cls)
    ApprovalError.__init__(error, kind, message)
    return error


class ApprovalArgsError(ApprovalError, code='DC051'):
    """Arguments a decider edited (`override_args`, `durcap approve --args`) do not fit the tool's JSON schema:
    refused before anything is sent (kind `'invalid-args'`); the message names the field and what the schema
    wants."""

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message)


class DecisionNotDeliveredError(ApprovalError, code='DC052'):
    """DC052: a decision that no run received: no worker serves the run (refused before it is sent, kind
    `'no-worker'`), no worker accepted it while its command waited (kind `'not-delivered'`), or the run received it
    after its `Decision.not_after` and refused it (kind `'expired'`). Either way the call is still pending and
    nothing ran: decide again once a worker serves the run."""

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message)


class StaleFingerprintError(ApprovalError, code='DC055'):
    """DC055: a decision quoting another fingerprint than the pending call's: the person reviewed other arguments
    (or a stale copy of the call). Refused, nothing sent (kind `'stale-fingerprint'`); the call is still pending.
    Build it with `stale_fingerprint`."""

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message)


STALE_FINGERPRINT = 'stale-fingerprint'
"""The `ApprovalError.kind` of a decision for other arguments (`StaleFingerprintError`, DC055)."""


def stale_fingerprint(call: PendingCall, quoted: str, run_id: str, *,
                      review: str = '`durcap approvals list`') -> StaleFingerprintError:
    """The refusal of a decision quoting fingerprint `quoted` for `call`, whose fingerprint differs.

    Args:
        review: Where the decider reads the call again (the CLI's command; the API names its endpoint).

    Returns:
        A `StaleFingerprintError` (DC055), naming both fingerprints (their first 12 characters) and the fix.
    """
    return StaleFingerprintError(STALE_FINGERPRINT, (
        f'DC055 run {run_id!r}: call {call.call_id!r} ({call.tool_name}) has fingerprint {call.fingerprint[:12]}..., '
        f'the decision quotes {quoted[:12]}...: it was made for other arguments than the call has; nothing was sent '
        f'and the call is still pending. Fix: review the call again ({review}) and decide with its fingerprint'))


DECISION_WAIT_ENV = 'DURCAP_DECISION_WAIT'
DEFAULT_DECISION_WAIT = 30.0
"""How long (seconds) a Temporal decision waits for a worker to accept it (`$DURCAP_DECISION_WAIT`) before its
command gives up with DC052; the decision's `not_after` is that much after it was sent."""


def decision_wait() -> float:
    """Seconds a decision waits for a worker to accept it: `$DURCAP_DECISION_WAIT`, else `DEFAULT_DECISION_WAIT`.

    Raises:
        InputError: DC040, the variable is not a number of seconds above 0 (nothing is sent).
    """
    from ._limits import env_seconds

    return env_seconds(DECISION_WAIT_ENV, DEFAULT_DECISION_WAIT, 60)


def check_not_expired(decision: Decision, now: datetime, run_id: str) -> None:
    """Refuse `decision` when `now` (an aware datetime: the run's clock) is past its `not_after`.

    Raises:
        DecisionNotDeliveredError: DC052, kind `'expired'`: the command that sent the decision gave up on it, so the
            run must not act on it.
    """
    if decision.not_after is None:
        return
    limit = datetime.fromisoformat(decision.not_after)
    if now > limit:
        raise DecisionNotDeliveredError('expired', (
            f'DC052 run {run_id!r}: the decision on call {decision.call_id!r} by {decision.by or "?"} arrived after '
            f'{decision.not_after}, when its command had given up waiting for a worker: refused, the call is still '
            'pending. Fix: decide again.'))


class AlreadyDecidedError(ApprovalError, code='DC054'):
    """DC054: a second decision on a call that was decided already (its first decision delivered or not): refused,
    nothing sent (kind `'already-decided'`); the message names the first decision (approved or denied, by whom,
    when) and says the first decision stands."""

    def __init__(self, kind: str, message: str):
        super().__init__(kind, message)


def utc_now() -> datetime:
    """The current UTC time (outside durable containers only: engines give their own deterministic clock)."""
    return datetime.now(UTC)


def default_user() -> str:
    """Who decides when `--by` is not given: `$USER`, `$USERNAME`, else the login name, else `'unknown'`."""
    for name in ('USER', 'USERNAME', 'LOGNAME'):
        if os.environ.get(name):
            return os.environ[name]
    try:
        import getpass

        return getpass.getuser()
    except (KeyError, OSError):  # pragma: no cover - no user database
        return 'unknown'


def check_decision(pending: list[PendingCall], decision: Decision, run_id: str, *,
                   validate_args: bool = True) -> PendingCall:
    """The pending call `decision` applies to.

    Args:
        validate_args: Check `decision.override_args` against the call's `schema` (`check_args`); Temporal's update
            validator, workflow code, passes `False` (its client checked them before sending).

    Raises:
        ApprovalError: no pending call has `decision.call_id` (`unknown-call`).
        StaleFingerprintError: DC055, the call's fingerprint differs (`stale-fingerprint`: the person reviewed other
            arguments).
        ApprovalArgsError: DC051, `override_args` do not fit the tool's schema.
    """
    for call in pending:
        if call.call_id == decision.call_id:
            if call.fingerprint != decision.fingerprint:
                raise stale_fingerprint(call, decision.fingerprint, run_id)
            if decision.override_args is not None and not decision.approve:
                raise ApprovalError('unknown-call', 'override_args is only allowed when approving')
            if validate_args and decision.override_args is not None:
                check_args(call, decision.override_args, run_id)
            return call
    raise ApprovalError('unknown-call', (
        f'{NOT_FOUND_CODE} run {run_id!r} has no pending call {decision.call_id!r} (pending: '
        f'{", ".join(c.call_id for c in pending) or "none"}); it may have been decided already'))


ALREADY_DECIDED = 'already-decided'
"""The `ApprovalError.kind` of a second decision on a call (`AlreadyDecidedError`, DC054)."""


def already_decided(run_id: str, call_id: str, earlier: Decision, *, received: bool | None = None) -> ApprovalError:
    """The refusal of a second decision on a call: a call is decided once, and the first decision stands even while
    the run has not received it yet (its process is down, or it has not reached its next wait).

    Args:
        run_id / call_id: The run and the call the second decision was for.
        earlier: The decision already made.
        received: Whether the run has taken `earlier` (`False`: not yet; `None`: not known).

    Returns:
        An `AlreadyDecidedError` (DC054, kind `'already-decided'`), one line naming the run, the call and the earlier
        decision (approved or denied, by whom, when), with a fix line; the caller raises it, and sends nothing.
    """
    # Not yet taken is the usual state of a decision a moment old (a double click): say when the run takes it, not
    # that it is down.
    state = (' (sent; the run takes it at its next step, or when it runs again if its process is down)'
             if received is False else '')
    return AlreadyDecidedError(ALREADY_DECIDED, (
        f'DC054 run {run_id!r}: call {call_id!r} was already {describe_decision(earlier)}{state}; a call is decided '
        'once: this decision was refused and nothing was sent. Fix: nothing to send, the first decision stands '
        f'(see the run with `durcap runs show {run_id}`)'))


def check_args(call: PendingCall, args: Any, run_id: str, *, edited: str = '--args (`override_args`)') -> None:
    """Refuse edited arguments `args` for `call` that do not fit the tool's JSON schema (`PendingCall.schema`).

    Args:
        edited: What the decider fixes, named in the message's fix (the CLI's `--args`; the API's `args` field).

    Raises:
        ApprovalArgsError: DC051: `args` is not a JSON object, or the schema refuses it; the message names the
            field (a JSON path, `$` for the object itself) and the schema's own reason. Nothing was sent.
    """
    where = f'run {run_id!r}: call {call.call_id!r} ({call.tool_name})'
    if not isinstance(args, dict):
        raise ApprovalArgsError('invalid-args', f'DC051 {where}: edited arguments must be a JSON object of the '
                                f'tool\'s parameters, not {type(args).__name__}; nothing was sent')
    if call.schema is None:
        return
    import jsonschema

    errors = sorted(jsonschema.Draft202012Validator(call.schema).iter_errors(args),
                    key=lambda e: ([str(p) for p in e.absolute_path], e.message))
    if not errors:
        return
    found = '; '.join(f'at {_json_path(e.absolute_path)}: {e.message}' for e in errors[:3])
    properties = sorted(call.schema.get('properties') or {})
    raise ApprovalArgsError('invalid-args', (
        f'DC051 {where}: the edited arguments do not fit the tool\'s schema {found}; nothing was '
        f'sent. The tool takes {", ".join(properties) or "no arguments"} (required: '
        f'{", ".join(call.schema.get("required") or []) or "none"}): fix {edited}, or approve '
        'without editing'))


def _json_path(path: Any) -> str:
    """`$`, `$.user`, `$.items[0]`: where in the arguments a schema error is."""
    return '$' + ''.join(f'[{p}]' if isinstance(p, int) else f'.{p}' for p in path)


def describe_decision(decision: Decision) -> str:
    """`'approved by alice at 2026-12-01T06:40:00+00:00'` (or `denied`; `someone` when `by` is empty)."""
    return f'{"approved" if decision.approve else "denied"} by {decision.by or "someone"} at {decision.at}'


def pending_calls(
    requests: Any, *, run_id: str, agent: str, conversation_id: str | None, now: datetime, timeout: float,
    schemas: Any = None,
) -> list[PendingCall]:
    """One `PendingCall` per approval request of `requests` (a `DeferredToolRequests`).

    Args:
        requests: The run's `DeferredToolRequests` output.
        run_id / agent / conversation_id: Where the calls wait.
        now: The engine's deterministic current time (UTC).
        timeout: Seconds until the calls are denied.
        schemas: `schemas(tool name) -> JSON schema | None` (`DurableAgent.tool_schema`), or `None`.
    """
    deadline = now + timedelta(seconds=timeout)
    return [
        PendingCall(run_id, part.tool_call_id, part.tool_name, part.args_as_dict(),
                    fingerprint(part.tool_name, part.args_as_dict()), now.isoformat(), deadline.isoformat(),
                    agent, conversation_id, schema=schemas(part.tool_name) if schemas is not None else None)
        for part in requests.approvals
    ]


def timeout_reason(call: PendingCall) -> str:
    """The denial the model sees when nobody decided on `call` before its deadline."""
    return (f'No one approved the call to {call.tool_name} before its deadline ({call.deadline}); '
            'it was denied and did not run.')


def deferred_results(pending: list[PendingCall], decisions: dict[str, Decision]) -> Any:
    """`DeferredToolResults` for `pending`: approved calls with their `override_args`, denied ones with the
    reason; calls without a decision are denied with `timeout_reason`."""
    from pydantic_ai.tools import DeferredToolResults, ToolApproved, ToolDenied

    from .budget import RAISE_TOOL

    approvals: dict[str, Any] = {}
    for call in pending:
        decision = decisions.get(call.call_id)
        if call.tool_name == RAISE_TOOL and (decision is None or not decision.approve):
            # A budget raise: never shown to the model (`budgets._without_raises`); its DC060 line says "the raise by N
            # was <this>", naming who denied it and why.
            approvals[call.call_id] = ToolDenied(
                f'not decided before its deadline ({call.deadline}), so denied' if decision is None else
                f'denied by {decision.by or "a reviewer"}' + (f' ({decision.reason})' if decision.reason else ''))
        elif decision is None:
            approvals[call.call_id] = ToolDenied(timeout_reason(call))
        elif decision.approve:
            approvals[call.call_id] = ToolApproved(override_args=decision.override_args)
        else:
            approvals[call.call_id] = ToolDenied(decision.reason or f'{decision.by or "A reviewer"} denied the call.')
    return DeferredToolResults(approvals=approvals, answered_by={k: d.by for k, d in decisions.items() if d.by})


def audit_records(pending: list[PendingCall], decisions: dict[str, Decision]) -> list[dict[str, Any]]:
    """One audit record per pending call: the request and its decision (`'approved' | 'denied' | 'timed out'`),
    who decided and when, the fingerprint reviewed. Stored in the conversation (see `AUDIT_METADATA_KEY`)."""
    records = []
    for call in pending:
        decision = decisions.get(call.call_id)
        records.append({
            'call_id': call.call_id, 'tool': call.tool_name, 'args': call.args, 'fingerprint': call.fingerprint,
            'requested_at': call.requested_at, 'deadline': call.deadline,
            'decision': 'timed out' if decision is None else ('approved' if decision.approve else 'denied'),
            'by': decision.by if decision else None, 'at': decision.at if decision else call.deadline,
            'reason': (decision.reason if decision else timeout_reason(call)),
            'override_args': decision.override_args if decision else None,
        })
    return records


class ApprovalGate(ABC):
    """How one engine's durable container waits for decisions (implemented in each engine's adapter module).

    `turn.run_turn` calls `now()` once per pause, publishes the pending calls with `wait(...)`, and continues
    the run with the decisions `wait` returns. Both run inside the durable container, so they must be
    replay-safe: engine clocks, durable timers, recorded messages.
    """

    run_id: str = ''

    @abstractmethod
    async def now(self) -> datetime:
        """The current UTC time as the engine records it (the same value when the run recovers)."""

    def bounds_rounds(self) -> bool:
        """Whether the turn stops at its request limit, counted across approval rounds (`turn.TurnRequestLimitError`,
        DC061), before it asks for decisions again. Asked only when the limit is reached, in the durable container:
        an engine whose replays must not change (Temporal) answers through a patch marker, so a history recorded
        before the limit existed replays as it ran. Default: yes."""
        return True

    @abstractmethod
    async def wait(self, pending: list[PendingCall], timeout: float) -> dict[str, Decision]:
        """Publish `pending`, wait up to `timeout` seconds (a durable timer) for a decision on each, and return
        the valid decisions by call id (calls missing from the result timed out). Must not hold a worker slot
        or a process while waiting."""
