"""The Prefect adapter: what `durcap` asks of Prefect (run, schedule, the operator side), each answered by a module
of this package."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from prefect import get_client
from prefect.exceptions import PrefectException
from pydantic_ai.durable_exec.prefect import PrefectDurability
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_core import to_jsonable_python

from ...conversations import store_url
from ...report import RunReport
from .._adapter import EngineAdapter, RunOptions
from .._specs import PREFECT as SPEC
from . import _runs
from ._client import run_flow_run
from ._durability import durability_parts, durable_names
from ._flow import agent_flow, run_store
from ._server import _TEMPORARY_SERVER, configured_api, ensure_api, server_line, warm_up
from ._worker import serve_schedule

if TYPE_CHECKING:
    from ...agent import DurableAgent


class PrefectAdapter(EngineAdapter, spec=SPEC):
    """Prefect: a flow per agent (`agent_flow`), tasks for model requests, tools, MCP and the store.

    Runs go to `PREFECT_API_URL` when set, else to Prefect's ephemeral local server.
    """

    operator = _runs  # `durcap runs` / `durcap approvals`: the base class's methods over `_runs`

    def durability_class(self) -> Any:
        return PrefectDurability

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return durability_parts(agent, options)

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        """The flow, task and cache toolset names (`_durability.durable_names`)."""
        return durable_names(agent)

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        """None: the flow's own code loads and appends (`_conversation`), no task does."""
        return []

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        return "DurableAgent(engine_options={'prefect': {'mcp_task_config': {'retries': ...}}})"

    def mcp_passes_through(self, error: BaseException) -> bool:
        return isinstance(error, PrefectException)

    def unconfigured(self, settings: Mapping[str, Any]) -> str | None:
        if configured_api() or _TEMPORARY_SERVER:
            return None
        return ('prefect: skipped, no PREFECT_API_URL configured (`--engine prefect` reads the database of Prefect\'s '
                'temporary local server)')

    def warm_up(self, settings: Mapping[str, Any], notify: Callable[[str], None]) -> None:
        """Launch Prefect's temporary local server now when no API is configured (`_server.warm_up`)."""
        warm_up(notify)

    def listing_note(self, settings: Mapping[str, Any]) -> str | None:
        """When no Prefect API is configured: the listing reads the database of Prefect's temporary local server, which
        holds only the runs made here without a server (a command asking every engine skips Prefect instead)."""
        if configured_api() or _TEMPORARY_SERVER:
            return None
        return ('prefect: no PREFECT_API_URL configured: reading the database of Prefect\'s temporary local server (set '
                'PREFECT_API_URL to read your server)')

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        os.environ.setdefault('PREFECT_SERVER_ANALYTICS_ENABLED', 'false')
        options.notify(server_line())

        history = options.message_history
        parameters = {
            'prompt': prompt, 'deps': to_jsonable_python(options.deps) if options.deps is not None else None,
            'message_history': ModelMessagesTypeAdapter.dump_python(list(history), mode='json') if history else None,
            'conversation_id': options.conversation_id,
        }
        if options.setting('busy') is not None:  # a parameter only when given: deployments made before it still run
            parameters['busy'] = options.setting('busy')
        flow_ = agent_flow(agent)
        async with get_client() as client:
            flow_run = await client.create_flow_run(flow_, parameters=parameters)
        options.started(str(flow_run.id), f'prefect flow run id: {flow_run.id} (at {ensure_api()[0]})')
        with run_store(options.setting('store')):
            return await run_flow_run(flow_, flow_run.id, parameters, store_url(agent, options.setting('store')))

    def serve_schedule(
        self, agent: DurableAgent[Any, Any], *, target: str, prompt: str, cron: str | None, interval_seconds: float | None,
        deps: Any, deployment_name: str | None, notify: Callable[[str], None], limit: int | None = None,
        spawn: bool = False,
    ) -> None:
        """`durcap schedule prefect` (`_worker.serve_schedule`).

        Raises:
            RuntimeError: no Prefect API is configured.
            ValueError: `cron` is not a cron expression Prefect accepts (code DC040).
        """
        serve_schedule(agent, target=target, prompt=prompt, cron=cron, interval_seconds=interval_seconds, deps=deps,
                       deployment_name=deployment_name, notify=notify, limit=limit, spawn=spawn)


ADAPTER = PrefectAdapter()
