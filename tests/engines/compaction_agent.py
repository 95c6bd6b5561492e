"""An agent whose history processor compacts (upstream `ProcessHistory` writing a `CompactionPart`), for the
compaction tests. Model: a scripted `FunctionModel` (no provider).

Prompt `Count to N.`: the model calls `tick(n)` for n = 1..N, one call per response, then answers
`counted: 1,2,...,N`. It decides from the messages it is sent alone, reading them in order: a user prompt
starts a count, a tick return adds its number, and a compaction summary (`count-state {json}`) restores the
count it summarized (its prompt and ticks), so the model counts right whether it is sent the compacted view
or the whole stored log with summaries inside it.

`compact` (the processor): above `COMPACT_ABOVE` messages it replaces all but the last two with one request
holding a `CompactionPart` that summarizes them, so a turn's prompt and early calls leave `ctx.messages`.
`tick` appends one line per execution to `$DURCAP_LEDGER` when set (a test counts executions).
"""


import json
import os
import re
from typing import Any

from pydantic_ai.capabilities import ProcessHistory
from pydantic_ai.messages import (
    CompactionPart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import DurableAgent

COMPACT_ABOVE = 6
SUMMARY = 'count-state '


def count_state(messages: list[ModelMessage]) -> "tuple[str | None, set[int]]":
    """(the prompt being answered, the ticks returned for it), read in order (see the module docstring)."""
    prompt: str | None = None
    ticks: set[int] = set()
    for message in messages:
        for part in message.parts:
            if isinstance(part, UserPromptPart):
                prompt, ticks = str(part.content), set()
            elif isinstance(part, CompactionPart) and (part.content or '').startswith(SUMMARY):
                summary = json.loads(part.content[len(SUMMARY):])  # type: ignore[index]
                if summary['prompt'] != prompt:
                    prompt, ticks = summary['prompt'], set(summary['ticks'])
                else:
                    ticks |= set(summary['ticks'])
            elif isinstance(part, ToolReturnPart) and part.tool_name == 'tick':
                ticks.add(int(part.content))
    return prompt, ticks


def compact(messages: list[ModelMessage]) -> list[ModelMessage]:
    if len(messages) <= COMPACT_ABOVE:
        return messages
    prompt, ticks = count_state(messages[:-2])
    summary = CompactionPart(SUMMARY + json.dumps({'prompt': prompt, 'ticks': sorted(ticks)}))
    return [ModelRequest(parts=[summary]), *messages[-2:]]


def script(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
    prompt, ticks = count_state(messages)
    target = int(re.search(r'\d+', prompt or '0').group())  # type: ignore[union-attr]
    if len(ticks) < target:
        n = len(ticks) + 1
        return ModelResponse(parts=[ToolCallPart('tick', {'n': n}, tool_call_id=f'tick-{target}-{n}')])
    return ModelResponse(parts=[TextPart('counted: ' + ','.join(str(n) for n in sorted(ticks)))])


def tick(n: int) -> str:
    """Count one."""
    if ledger := os.environ.get('DURCAP_LEDGER'):
        with open(ledger, 'a') as handle:
            handle.write(f'{n}\n')
    return str(n)


def make_agent(name: str = 'compacting-counter', store: str | None = None) -> DurableAgent[Any, Any]:
    """The agent (store: `store`, else `$DURCAP_STORE`)."""
    return DurableAgent(name, FunctionModel(script, model_name='count-script'), tools=[tick],
                        capabilities=[ProcessHistory(compact)], conversation_store=store)


agent = make_agent()
