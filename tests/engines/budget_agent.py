"""An agent with a conversation-scoped token budget, for tests/engines/test_budgets.py. Model: a scripted
`FunctionModel` (no provider) that answers every request with text and reports a fixed usage (60 input and 40 output
tokens, `USAGE`); each request it receives is logged as one line (the conversation's prompt) to
`$DURCAP_BUDGET_LOG` when set, so a test can tell that a refused turn sent no request.

`$DURCAP_BUDGET_AGENT` names the agent (unique per test run); `$DURCAP_BUDGET_SCOPE=tenant` scopes the budget to
the deps' `tenant` key instead of the conversation, with `$DURCAP_BUDGET_LIMIT` total tokens (default 150);
`$DURCAP_BUDGET_ON_EXCEED=approval` makes a spent budget wait for an operator.
"""

from __future__ import annotations

import os

from pydantic_ai import ModelResponse, TextPart
from pydantic_ai.messages import ModelMessage, UserPromptPart
from pydantic_ai.models.function import AgentInfo, FunctionModel
from pydantic_ai.usage import RequestUsage

from durable_capabilities import Budget, DurableAgent

USAGE = (60, 40)


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompt = next((p.content for m in reversed(messages) for p in getattr(m, 'parts', [])
                   if isinstance(p, UserPromptPart)), '?')
    path = os.environ.get('DURCAP_BUDGET_LOG')
    if path:
        with open(path, 'a', encoding='utf-8') as f:
            f.write(f'{prompt}\n')
    return ModelResponse(parts=[TextPart(f'answer to {prompt}')],
                         usage=RequestUsage(input_tokens=USAGE[0], output_tokens=USAGE[1]))


def _tenant(deps: object) -> str:
    return f'tenant:{deps["tenant"]}' if isinstance(deps, dict) else 'tenant:?'


_scope = _tenant if os.environ.get('DURCAP_BUDGET_SCOPE') == 'tenant' else 'conversation'
agent = DurableAgent(
    os.environ.get('DURCAP_BUDGET_AGENT', 'budgeted'), FunctionModel(script, model_name='scripted-budget'),
    deps_type=dict, budget=Budget(total_tokens=int(os.environ.get('DURCAP_BUDGET_LIMIT', '150')), scope=_scope,
                                  on_exceed=os.environ.get('DURCAP_BUDGET_ON_EXCEED', 'error')),  # type: ignore[arg-type]
)
