"""The DBOS adapter: what `durcap` asks of DBOS (run, worker, the operator side), each answered by a module of this
package."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dbos import DBOS, SetWorkflowID
from pydantic_ai.messages import ModelMessagesTypeAdapter
from pydantic_core import to_jsonable_python

from ... import _upstream
from ..._limits import redact_database_url
from ...conversations import resolve_payload, store_url
from ...report import RunReport
from .._adapter import EngineAdapter, RunOptions
from .._specs import DBOS as SPEC
from . import _runs
from ._durability import ToolStepDurability, durability_parts, durable_names
from ._runs import _missing_sqlite_file
from ._server import launch, system_database_url
from ._spec import APP_NAME, ENGINE, conversation_step_names
from ._worker import check_serving, enqueue_and_wait, serve_worker
from ._workflow import agent_workflow

if TYPE_CHECKING:
    from ...agent import DurableAgent


class DBOSAdapter(EngineAdapter, spec=SPEC):
    """DBOS: a workflow per agent (`agent_workflow`), steps for model requests, tools, MCP and the store.

    Run settings: `db` (system database URL; default SQLite at `.durcap/dbos.sqlite`), `store` (conversation store
    URL of the run's steps).
    """

    operator = _runs  # `durcap runs` / `durcap approvals`: the base class's methods over `_runs`

    def listing_note(self, settings: Mapping[str, Any]) -> str | None:
        """A note when `--db` names a SQLite file that does not exist (the listings then show nothing, and reading
        does not create the file); the default system database, absent before the first run, gets none."""
        if not settings.get('db') or (missing := _missing_sqlite_file(settings)) is None:
            return None
        return f'dbos: no system database at {missing}: nothing has run there (check the path: pass the --db the runs used)'

    async def check_serving(self, settings: Mapping[str, Any]) -> list[str]:
        """A DC040 line when no DBOS worker has ever run on the system database (`_worker.check_serving`); raises
        `EngineUnreachableError` when it cannot be reached."""
        return await check_serving(settings)

    def durability_class(self) -> Any:
        return ToolStepDurability

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return durability_parts(agent, options)

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        """The workflow and step names (`_durability.durable_names`)."""
        return durable_names(agent)

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        return list(conversation_step_names(agent))

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        return "DurableAgent(engine_options={'dbos': {'mcp_step_config': {'max_attempts': ...}}})"

    def mcp_passes_through(self, error: BaseException) -> bool:
        dbos_error, retries_exceeded = _upstream.dbos_error_classes()
        return isinstance(error, dbos_error) and not isinstance(error, retries_exceeded)

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        workflow_fn = agent_workflow(agent, store=options.setting('store'))
        # Handed to a queue: the workers create the system database, this process creates no file.
        url = system_database_url(options.setting('db'), create=not options.setting('queue'))
        options.notify(f'dbos system database: {redact_database_url(url)}')
        workflow_id = options.run_id or f'{agent.name}-{uuid.uuid4()}'
        history = options.message_history
        history_json = ModelMessagesTypeAdapter.dump_python(list(history), mode='json') if history else None
        deps = to_jsonable_python(options.deps) if options.deps is not None else None
        args = (prompt, deps, history_json, options.conversation_id)
        if options.setting('queue'):
            # The turn's busy strategy travels as the workflow's fifth argument, as the inline call below passes it.
            return await enqueue_and_wait(agent, url, options.setting('queue'), workflow_id,
                                          (*args, options.setting('busy')), options)
        # A step retry logs one WARNING line (`_retry_log.ModelRetryLogLine` drops its traceback); the run's failure is reported
        # once, in `durcap run`'s own line (capability, error, innermost cause).
        # As the version a worker serving this agent runs as (`_server.application_version`): `durcap worker dbos
        # --executor-id THIS_ID` recovers the run if this process dies.
        launch(APP_NAME, system_database_url_=url, one_shot=True, executor_id=options.setting('executor_id'),
               serving=[agent])
        try:
            options.started(workflow_id, f'dbos workflow id: {workflow_id} (executor {DBOS.executor_id})')
            with SetWorkflowID(workflow_id):
                payload = await workflow_fn(*args, options.setting('busy'))
            steps = await DBOS.list_workflow_steps_async(workflow_id)
            # Before `DBOS.destroy`, which shuts the loop's default executor down (the store reads run in it).
            payload = await resolve_payload(payload, store=store_url(agent, options.setting('store')))
        finally:
            DBOS.destroy()
        return RunReport.from_payload(ENGINE, workflow_id, payload, [step['function_name'] for step in steps])

    def serve_worker(self, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
        """`durcap worker dbos` (`_worker.serve_worker`)."""
        serve_worker(agents, options)


ADAPTER = DBOSAdapter()
