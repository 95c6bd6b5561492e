"""An agent with a gated tool for approval tests. Model: a scripted `FunctionModel` (no provider).

`revoke_sessions(user)` needs approval (`requires_approval=True`); each execution appends a line to
`$DURCAP_CRASH_DIR/revocations` (the side effect that must happen exactly once). The model calls it once
for the user named in the prompt, then answers with the tool's result text (so a denial's reason shows in
the output). `$DURCAP_APPROVAL_TIMEOUT` (seconds) sets the gate's timeout. With `$DURCAP_RECORD_PIDS=1` each
model request appends its process id to `$DURCAP_CRASH_DIR/model-pids`.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic_ai import ModelResponse, TextPart, Tool, ToolCallPart
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent


def _record(line: str) -> None:
    path = Path(os.environ['DURCAP_CRASH_DIR'])
    path.mkdir(parents=True, exist_ok=True)
    with open(path / 'revocations', 'a', encoding='utf-8') as f:
        f.write(line + '\n')
        f.flush()
        os.fsync(f.fileno())


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    if os.environ.get('DURCAP_RECORD_PIDS') == '1':  # which process made each model request (suspend tests)
        path = Path(os.environ['DURCAP_CRASH_DIR'])
        path.mkdir(parents=True, exist_ok=True)
        with open(path / 'model-pids', 'a', encoding='utf-8') as f:
            f.write(f'{os.getpid()}\n')
    returns = [p for m in messages for p in getattr(m, 'parts', []) if isinstance(p, ToolReturnPart)]
    if returns:
        return ModelResponse(parts=[TextPart(f'result: {returns[-1].content}')])
    prompt = next(p.content for m in messages if isinstance(m, ModelRequest) for p in m.parts
                  if isinstance(p, UserPromptPart))
    return ModelResponse(parts=[ToolCallPart('revoke_sessions', {'user': str(prompt).split()[-1]})])


def revoke_sessions(user: str) -> str:
    """Revoke every session of a user (needs a person's approval)."""
    _record(user)
    return f'revoked sessions of {user}'


_timeout = os.environ.get('DURCAP_APPROVAL_TIMEOUT')

gated = DurableAgent(
    'gated',
    FunctionModel(script),
    tools=[Tool(revoke_sessions, requires_approval=True)],
    approval_timeout=float(_timeout) if _timeout else None,
)
