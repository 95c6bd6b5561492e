"""local: the same definition in-process, no durability (tests, notebooks, `durcap run` by default)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..turn import RunReport, run_turn
from . import _mcp
from ._adapter import EngineAdapter, RunOptions

if TYPE_CHECKING:
    from ..agent import DurableAgent


class LocalAdapter(EngineAdapter):
    """In-process runs: `Agent.run` inside one turn; the store is read and appended in-process."""

    name = 'local'
    durable = False

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """No durability; the MCP guard still keeps deferred MCP servers unlisted until they are loaded."""
        guard = _mcp.guard(agent, self.name, lambda leaf: None)
        return dict(options), [guard] if guard is not None else []

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        turn = await run_turn(agent, agent.build(self.name).run, prompt, deps=options.deps,
                              message_history=options.message_history, conversation_id=options.conversation_id)
        return RunReport(self.name, None, turn.result.output, list(turn.state.log.messages), turn.result.usage)


ADAPTER = LocalAdapter()
