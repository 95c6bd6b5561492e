"""`RunReport`: what one run produced, on any engine (every adapter's `run` returns it, `durcap run` prints it).

Core: it imports nothing of the package, so engines, the runner and the CLI all read it from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import TypeAdapter
from pydantic_ai.messages import ModelMessage, ModelMessagesTypeAdapter, ToolCallPart
from pydantic_ai.usage import RunUsage

__all__ = ['RunReport', 'usage_from_json']


_USAGE: TypeAdapter[RunUsage] = TypeAdapter(RunUsage)


def usage_from_json(data: dict[str, Any]) -> RunUsage:
    """A `RunUsage` from its JSON form (`to_jsonable_python(usage)`): validated, so a priced run's `cost` (a `Decimal`,
    dumped as a string) is a number again; `RunUsage(**data)` kept the string, and adding two usages then failed."""
    return _USAGE.validate_python(data)


@dataclass
class RunReport:
    """What one run produced, on any engine (returned by every runner path, printed by `durcap run`).

    Attributes:
        engine: The engine it ran on.
        run_id: The engine's id of the run (workflow id, flow run id); `None` locally.
        output: The agent's output.
        new_messages: Messages the run added.
        usage: Tokens and requests (`RunUsage`).
        durable_units: Names of the durable units the engine recorded, in order (activity types,
            step names, task run names).
        budget: With a `Budget` on the definition: the budget key's spend after the run, as stored
            (`{'key', 'spent': {'input_tokens', 'output_tokens', 'total_tokens', 'cost' (USD), 'requests'},
            'limits', 'raised', 'in_flight', 'updated_at'}`, see `store.SQLConversationStore.budgets`); else `None`.
    """

    engine: str
    run_id: str | None
    output: Any
    new_messages: list[ModelMessage]
    usage: RunUsage
    durable_units: list[str] = field(default_factory=list)
    budget: dict[str, Any] | None = None

    @classmethod
    def from_payload(cls, engine: str, run_id: str | None, payload: dict[str, Any], units: list[str] | None = None) -> RunReport:
        """A report from a container's `{'output', 'new_messages', 'usage'}` JSON payload (see `Turn.payload`;
        `new_messages` a list of message JSON, or one JSON string of it)."""
        messages = payload['new_messages']
        decoded = (ModelMessagesTypeAdapter.validate_json(messages) if isinstance(messages, str | bytes)
                   else ModelMessagesTypeAdapter.validate_python(messages))
        return cls(engine, run_id, payload['output'], decoded, usage_from_json(payload['usage']), list(units or []))

    def loaded_capabilities(self) -> list[str]:
        """Capability ids the run loaded with `load_capability`, in order."""
        loaded: list[str] = []
        for message in self.new_messages:
            for part in getattr(message, 'parts', []):
                if isinstance(part, ToolCallPart) and part.tool_name == 'load_capability':
                    cap = part.args_as_dict().get('id')
                    if cap and cap not in loaded:
                        loaded.append(cap)
        return loaded
