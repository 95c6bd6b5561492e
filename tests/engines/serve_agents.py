"""The agents the `durcap serve` tests serve (one TARGET, so one `durcap worker dbos` runs them all). Models: scripted
`FunctionModel`s, no provider: `streamer` (tests/engines/stream_agent.py: a tool call, then the answer streamed word
by word), `gated` (tests/engines/approval_agent.py: `revoke_sessions(user)` waits for a person's approval), the
support example's `support` (its `SupportScript`; `account-security` waits for approval) and `ledgered` (below)."""

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, DeltaToolCall, DeltaToolCalls, FunctionModel

from durable_capabilities import DurableAgent
from examples.support.agent import support
from tests.engines.approval_agent import gated
from tests.engines.stream_agent import agent as streamer

agents = [streamer, gated, support]


# `ledgered`: a tool with a side effect recorded once per execution, then an answer streamed slowly enough (0.1 s a
# word, 30 words) for a test to kill the serve process a client streams from while the run goes on elsewhere.
LEDGER_WORDS = [f'part{n:02d} ' for n in range(30)]
LEDGER_ANSWER = 'Charged order Q-1: ' + ''.join(LEDGER_WORDS).strip()


async def _slow(messages: list[ModelMessage], info: AgentInfo) -> AsyncIterator[str | DeltaToolCalls]:
    if not any(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, 'parts', [])):
        yield {0: DeltaToolCall(name='charge', json_args='{"order_id": "Q-1"}', tool_call_id='charge-1')}
        return
    yield 'Charged order Q-1: '
    for index, word in enumerate(LEDGER_WORDS):
        await asyncio.sleep(0.1)
        yield word if index < len(LEDGER_WORDS) - 1 else word.strip()


def charge(order_id: str) -> str:
    """Charge an order (appends one line to `$DURCAP_CRASH_DIR/ledger` per execution)."""
    folder = Path(os.environ['DURCAP_CRASH_DIR'])
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / 'ledger', 'a', encoding='utf-8') as f:
        f.write(order_id + '\n')
    return f'charged {order_id}'


ledgered = DurableAgent('ledgered', FunctionModel(stream_function=_slow), tools=[charge])
agents.append(ledgered)
