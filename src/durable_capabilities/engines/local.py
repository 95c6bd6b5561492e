"""local: the same definition in-process, no durability (tests, notebooks, `durcap run` by default)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic_ai.messages import ModelMessagesTypeAdapter

from .. import streams
from ..approvals import ApprovalGate, Decision, PendingCall, utc_now
from ..conversations import store_url
from ..report import RunReport
from ..turn import run_turn
from . import _mcp
from ._adapter import EngineAdapter, RunOptions

if TYPE_CHECKING:
    from ..agent import DurableAgent


LOCAL_DENIAL = ('Denied: this run is local and cannot wait for a person to approve the call. Tell the customer it '
                'needs a person\'s approval and escalate.')
"""The reason the model gets for a call needing approval in a local run (`LocalApprovalGate`)."""


class LocalApprovalGate(ApprovalGate):
    """A local run has no durable wait: each call needing approval is denied at once, with `LOCAL_DENIAL` as the
    tool's result (the model sees it) and one line to `notify` naming the call and what to do instead. Without a
    gate, pydantic-ai ends such a run with `UserError` (no `DeferredToolRequests` output type)."""

    run_id = 'local'

    def __init__(self, notify: Callable[[str], None]):
        self.notify = notify

    async def now(self) -> Any:
        return utc_now()

    async def wait(self, pending: list[PendingCall], timeout: float) -> dict[str, Decision]:
        for call in pending:
            self.notify(f'local run: {call.tool_name} needs approval, which only a durable engine waits for: denied '
                        '(run it with --engine dbos, temporal or prefect, then `durcap approve`)')
        return {c.call_id: Decision(c.call_id, c.fingerprint, False, LOCAL_DENIAL, by='durcap (local run)') for c in pending}


class LocalAdapter(EngineAdapter):
    """In-process runs: `Agent.run` inside one turn; the store is read and appended in-process."""

    name = 'local'
    durable = False

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """No durability; the MCP guard still keeps deferred MCP servers unlisted until they are loaded."""
        guard = _mcp.guard(agent, self.name, lambda leaf: None)
        return dict(options), [guard] if guard is not None else []

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        """One in-process turn; its events go to the stream of `options.run_id` (default `local-{uuid4 hex}`) in the
        conversation store (`durable_capabilities.watch`). The report's `run_id` stays `None` (nothing durable)."""
        store = options.setting('store')
        run_id = options.run_id or f'local-{uuid.uuid4().hex}'
        with streams.publishing(run_id, self.name, store_url(agent, store), conversation_id=options.conversation_id,
                                durable=False):
            turn = await run_turn(agent, agent.build(self.name).run, prompt, deps=options.deps,
                                  message_history=options.message_history, conversation_id=options.conversation_id,
                                  gate=LocalApprovalGate(options.notify), store=store,
                                  busy=options.setting('busy'), run_id=run_id)
        # The turn's messages, the ones after an approval pause included (`turn.new_messages`, message JSON).
        messages = ModelMessagesTypeAdapter.validate_python(turn.new_messages)
        return RunReport(self.name, None, turn.result.output, messages, turn.result.usage)


ADAPTER = LocalAdapter()
