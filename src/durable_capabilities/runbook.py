"""Read-before-act: bounce a tool call back to the model until its runbook capability is loaded.

The pattern is the seed's `RunbookRequired` (docs: "Enforcing read-before-act"). Keeping it in the
package lets `DurableAgent` validate it: every capability id and tool name it names must exist
(problems DC009 and DC010).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic_ai import ModelRetry
from pydantic_ai.capabilities import AbstractCapability


@dataclass
class RunbookRequired(AbstractCapability[Any]):
    """Always-on capability: a call to tool `T` is retried until capability `requirements[T]` is loaded.

    Args:
        requirements: `{tool name: runbook capability id}`.

    The model receives a `ModelRetry` telling it which `load_capability` call to make; nothing runs
    until then. The check reads `ctx.loaded_capability_ids`, which upstream rebuilds from the message
    history, so it holds across resume and on every engine.
    """

    requirements: dict[str, str] = field(default_factory=dict)

    async def before_tool_execute(self, ctx: Any, *, call: Any, tool_def: Any, args: Any) -> Any:
        required = self.requirements.get(tool_def.name)
        if required and required not in ctx.loaded_capability_ids:
            raise ModelRetry(
                f'Call the `load_capability` tool with `id={required!r}` and follow its '
                f'guidance before calling `{tool_def.name}`.'
            )
        return args


def runbook_requirements(capability: object) -> dict[str, str] | None:
    """The `{tool: capability id}` map of a `RunbookRequired`-like capability, or `None`.

    Recognizes ours and any class named `RunbookRequired` with a `requirements` dict (the seed's own
    copy, pasted into user code).
    """
    if isinstance(capability, RunbookRequired) or type(capability).__name__ == 'RunbookRequired':
        requirements = getattr(capability, 'requirements', None)
        if isinstance(requirements, dict):
            return {str(k): str(v) for k, v in requirements.items()}
    return None
