"""An agent whose deps hold a `WorkerSecret`, for the secrets-stay-out-of-engine-records tests.

Model: a scripted `FunctionModel`: load `payments`, call `charge(order)`, answer with its result. `charge` reads
`ctx.deps.api_key.get_secret_value()` in the process that runs the tool and appends the SHA-256 of the value to
`$DURCAP_CRASH_DIR/resolved` (the test compares it with the value it put in the worker's environment, which the
caller never had). The agent name is `$DURCAP_SECRET_AGENT`.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from pydantic_ai import ModelResponse, RunContext, TextPart, ToolCallPart
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import ModelMessage, ToolReturnPart
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent, WorkerSecret


@dataclass
class Payments:
    account: str
    api_key: WorkerSecret


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    returned = {p.tool_name: p.content for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)}
    if 'load_capability' not in returned:
        return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'payments'})])
    if 'charge' not in returned:
        return ModelResponse(parts=[ToolCallPart('charge', {'order': 'A-1'})])
    return ModelResponse(parts=[TextPart(str(returned['charge']))])


payments = Capability(id='payments', description='Charge orders.', defer_loading=True)


@payments.tool
async def charge(ctx: RunContext[Payments], order: str) -> str:
    """Charge an order with the payment provider's key."""
    key = ctx.deps.api_key.get_secret_value()
    directory = Path(os.environ['DURCAP_CRASH_DIR'])
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / 'resolved', 'a', encoding='utf-8') as f:
        f.write(hashlib.sha256(key.encode()).hexdigest() + '\n')
    return f'charged {order} on {ctx.deps.account}'


agent = DurableAgent(os.environ.get('DURCAP_SECRET_AGENT', 'payer'), FunctionModel(script), deps_type=Payments,
                     capabilities=[payments])
