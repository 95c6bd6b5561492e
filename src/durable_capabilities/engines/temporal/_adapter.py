"""The Temporal adapter: what `durcap` asks of Temporal (run, worker, dev server, history, replay, the operator
side), each answered by a module of this package."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, TemporalError
from temporalio.service import RPCError

from ...report import RunReport
from .. import _mcp
from .._adapter import EngineAdapter, EngineUnreachableError, RunOptions
from .._specs import TEMPORAL as SPEC
from .._stall import wait_notice
from . import _patches, _runs
from ._client import (
    await_result,
    connect,
    notice_no_poller,
    notice_no_progress,
    start_run,
    task_queue_pollers,
    worker_command,
)
from ._conversation import conversation_activity_names
from ._durability import GuardedTemporalDurability, durability_parts, durable_names, sandbox_runner
from ._history import HistoryReplayer, export_history, units_recorded
from ._server import run_server, serve_dev_server
from ._spec import DEFAULT_ADDRESS, DEFAULT_NAMESPACE, DEFAULT_TASK_QUEUE, ENGINE
from ._worker import LocalToolActivities, local_tool_activities, make_worker, serve_worker
from ._workflow import workflow_classes

if TYPE_CHECKING:
    from ...agent import DurableAgent


class TemporalAdapter(EngineAdapter, spec=SPEC):
    """Temporal: a workflow per agent, activities for model requests, tools, MCP and the store.

    Run settings: `address` (HOST:PORT; none: 127.0.0.1:7233 when it serves, else an embedded in-memory dev
    server with an inline worker), `task_queue` (default `durcap`), `inline_worker` (serve the queue from this
    process for the run), `namespace`, `store` (the claim-check codec's store, and an inline worker's conversation
    store; a separate worker uses its own).
    """

    operator = _runs  # `durcap runs` / `durcap approvals`: the base class's methods over `_runs`

    def durability_class(self) -> Any:
        return GuardedTemporalDurability

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return durability_parts(agent, options)

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        """What `make_worker` registers for `agent` (`_durability.durable_names`)."""
        return durable_names(agent)

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        return list(conversation_activity_names(agent))

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        return f"DurableAgent(engine_options={{'temporal': {{'toolset_activity_config': {{{leaf_id!r}: {{'retry_policy': ...}}}}}}}})"

    def mcp_passes_through(self, error: BaseException) -> bool:
        return isinstance(error, TemporalError) and not isinstance(error, ActivityError)

    def mcp_upstream_schedule(self) -> bool:
        return workflow.in_workflow() and not _patches.patched(_mcp.TEMPORAL_PATCH_ID)

    def run_notes(self, options: RunOptions) -> list[str]:
        if options.settings.get('store') and not options.setting('inline_worker', False):
            return [("note: --store applies to this process only; on Temporal the worker's store is used "
                     '(`durcap worker temporal --store`, or $DURCAP_STORE where the worker runs)')]
        return []

    def replayer(self, agents: Sequence[DurableAgent[Any, Any]], *, store: str | None = None) -> Any:
        local = {name: config for agent in agents for name, config in local_tool_activities(agent).items()}
        return HistoryReplayer(agents, [cls for agent in agents for cls in workflow_classes(agent)], sandbox_runner(),
                               store, [LocalToolActivities(local)] if local else [])

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        address, inline_worker, server = run_server(options)
        try:
            return await self._run(agent, prompt, options, address, inline_worker)
        finally:
            if server is not None:
                server.stop()

    async def _run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions, address: str,
                   inline_worker: bool) -> RunReport:
        namespace = options.setting('namespace', DEFAULT_NAMESPACE)
        store = options.setting('store')  # the claim-check codec's store; an inline worker's conversation store too
        client = await connect(address, namespace, store=store)
        task_queue = options.setting('task_queue', DEFAULT_TASK_QUEUE)
        workflow_id = options.run_id or f'{agent.name}-{uuid.uuid4()}'
        notice = wait_notice()  # DC040 on a bad $DURCAP_WAIT_NOTICE, before the run starts
        async with AsyncExitStack() as stack:
            if inline_worker:
                await stack.enter_async_context(make_worker(client, [agent], task_queue, store=store))
            await start_run(
                client, agent, prompt, task_queue=task_queue, workflow_id=workflow_id, deps=options.deps,
                message_history=list(options.message_history) if options.message_history else None,
                conversation_id=options.conversation_id, namespace=namespace, eager=inline_worker,
                busy=options.setting('busy'),
            )
            options.started(workflow_id, f'temporal workflow id: {workflow_id} (task queue {task_queue!r} at {address})')
            command = worker_command(task_queue, address, store)
            watches = [] if inline_worker else [
                asyncio.create_task(notice_no_poller(client, namespace, task_queue, options.notify, command)),
                asyncio.create_task(notice_no_progress(client, workflow_id, task_queue, options.notify, notice, command))]
            try:
                client, result = await await_result(client, address, namespace, workflow_id, options.notify)
                units = await units_recorded(client, workflow_id, None)
            finally:
                for watch in watches:
                    watch.cancel()
        return RunReport(ENGINE, workflow_id, result.output, result.messages(), result.usage, units)

    def serve_worker(self, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
        """Serve `agents` on a task queue until SIGTERM / SIGINT (`_worker.serve_worker`)."""
        serve_worker(agents, options)

    def serve_dev_server(self, port: int, state_dir: Any, notify: Callable[[str], None], ui_port: int | None = None) -> None:
        """`durcap dev temporal` (`_server.serve_dev_server`).

        Raises:
            OSError: `port` or `ui_port` is held by another process.
        """
        serve_dev_server(port, state_dir, notify, ui_port)

    async def check_serving(self, settings: Mapping[str, Any]) -> list[str]:
        """Connect to the Temporal server `settings['address']` names (default 127.0.0.1:7233) as `durcap worker
        temporal` does (`_client.connect`: at most `$DURCAP_TEMPORAL_CONNECT_TIMEOUT` seconds, default 10); raises
        `EngineUnreachableError` when it does not answer, or refuses to describe the task queue (no such namespace);
        a warning line when no worker polls `settings['task_queue']` (default `durcap`) yet."""
        address, namespace = settings.get('address') or DEFAULT_ADDRESS, settings.get('namespace') or DEFAULT_NAMESPACE
        client = await connect(address, namespace, store=settings.get('store'))
        task_queue = settings.get('task_queue') or DEFAULT_TASK_QUEUE
        try:
            pollers = await task_queue_pollers(client, namespace, task_queue)
        except RPCError as exc:  # e.g. no such namespace: every turn would fail to start
            raise EngineUnreachableError(f'the Temporal server at {address} refused to describe task queue '
                                         f'{task_queue!r} in namespace {namespace!r}: {exc.message}') from None
        if pollers:
            return []
        return [f'no worker polls task queue {task_queue!r} at {address} yet: turns wait until one does (start '
                f'`{worker_command(task_queue, address, settings.get("store"))}`)']

    async def export_history(self, run_id: str, output: Any, settings: Mapping[str, Any]) -> Any:
        """The workflow's history as JSON (`_history.export_history`); settings `address`, `namespace`."""
        client = await connect(settings.get('address') or DEFAULT_ADDRESS, settings.get('namespace') or DEFAULT_NAMESPACE,
                               store=settings.get('store'))
        return await export_history(client, run_id, output)


    async def measure_tool_calls(self, agents: Sequence[DurableAgent[Any, Any]], settings: Mapping[str, Any],
                                 runs: int) -> dict[str, dict[str, Any]]:
        """`{agent: {leaf: ToolTiming}}` from the agents' most recent closed runs (`_measure.measure_tool_calls`);
        settings `address`, `namespace`. Raises `EngineUnreachableError` when no server answers."""
        from ._measure import measure_tool_calls

        client = await connect(settings.get('address') or DEFAULT_ADDRESS, settings.get('namespace') or DEFAULT_NAMESPACE,
                               store=settings.get('store'))
        return await measure_tool_calls(client, agents, runs=runs)


ADAPTER = TemporalAdapter()
