"""Capability renames that keep recorded runs recoverable.

`DurableAgent(aliases={'refunds-v2': 'refunds'})` says capability `refunds-v2` was `refunds`:
- its leaf toolsets keep the ids they had (`ids.plan_leaf_ids`), so activity / step names and Prefect
  cache keys do not change;
- a `load_capability(id='refunds')` recorded in a history (a Temporal activity result being replayed,
  a DBOS step output being recovered, a stored conversation being resumed) loads `refunds-v2`:
  `CapabilityAliases` rewrites it in every model response before the agent acts on it, and
  `rewrite_history` rewrites a message history handed to a run.
Both rewrites are pure functions of the messages, so they are safe in Temporal workflow code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.messages import ModelMessage, ModelResponse, ToolCallPart

from ._upstream import LOAD_CAPABILITY_TOOL_NAME


def _rewrite_part(part: Any, old_to_new: Mapping[str, str]) -> Any:
    if not isinstance(part, ToolCallPart) or part.tool_name != LOAD_CAPABILITY_TOOL_NAME:
        return part
    args = part.args_as_dict()
    old = args.get('id')
    if not isinstance(old, str) or old not in old_to_new:
        return part
    return dataclasses.replace(part, args={**args, 'id': old_to_new[old]})


def rewrite_response(response: ModelResponse, old_to_new: Mapping[str, str]) -> ModelResponse:
    parts = [_rewrite_part(p, old_to_new) for p in response.parts]
    if all(new is old for new, old in zip(parts, response.parts, strict=True)):
        return response
    return dataclasses.replace(response, parts=parts)


def rewrite_history(messages: Sequence[ModelMessage] | None, aliases: Mapping[str, str]) -> list[ModelMessage] | None:
    """`messages` with every `load_capability(id=<previous id>)` turned into the current id.

    Args:
        messages: A message history (not modified).
        aliases: `{current id: previous id}` as given to `DurableAgent(aliases=...)`.
    """
    if messages is None or not aliases:
        return list(messages) if messages is not None else None
    old_to_new = {old: new for new, old in aliases.items()}
    return [rewrite_response(m, old_to_new) if isinstance(m, ModelResponse) else m for m in messages]


@dataclasses.dataclass
class CapabilityAliases(AbstractCapability[Any]):
    """Always-on capability: model responses that load a capability by a previous id load it by its current id.

    Attributes:
        aliases: `{current id: previous id}`.
    """

    aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    async def after_model_request(self, ctx: Any, *, request_context: Any, response: ModelResponse) -> ModelResponse:
        return rewrite_response(response, {old: new for new, old in self.aliases.items()})
