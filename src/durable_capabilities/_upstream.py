"""The only module that touches private pydantic-ai names (and the private names of the engines' SDKs).

pydantic-ai-slim 2.68 exposes no public way to ask whether a toolset's `id` was chosen or derived,
to give an existing `FunctionToolset` an `id` without rebuilding it, or to read the source an `MCP`
capability derived its `id` from. Each of those is wrapped here, once, and
`tests/test_upstream_contract.py` fails loudly when upstream renames or changes one of them.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, TypeGuard

from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.toolsets import AbstractToolset, DynamicToolset, FunctionToolset
from pydantic_ai.toolsets._deferred_capability_loader import LOAD_CAPABILITY_TOOL_NAME

if TYPE_CHECKING:
    from pydantic_ai.mcp import MCPToolset

__all__ = [
    'LOAD_CAPABILITY_TOOL_NAME',
    'DynamicToolset',
    'capability_url_derived_id',
    'dbos_active_workflow_ids',
    'dbos_application_version',
    'dbos_error_classes',
    'dbos_recover_pending_workflows',
    'dbos_stop_taking_work',
    'derived_id_source',
    'explicit_toolset_id',
    'interchangeable_leaves',
    'is_mcp_toolset',
    'prefect_engine_run_process',
    'prefect_server_settings',
    'prefect_share_tls_contexts',
    'runtime_rejected_kinds',
    'temporal_activity_name',
    'temporal_set_deadlock_timeout',
    'temporal_worker_registrations',
    'temporal_workflow_name',
    'toolset_with_id',
    'typer_usage_errors',
]


def is_mcp_toolset(toolset: object) -> TypeGuard[MCPToolset]:
    """Whether `toolset` is a pydantic-ai `MCPToolset`, without importing `pydantic_ai.mcp`.

    Importing it loads the MCP client stack (fastmcp, mcp, starlette, httpx, cryptography: about 900
    modules and 40 MiB). A program that built an `MCPToolset` has imported the module already, so when it is
    not in `sys.modules` no object can be one, and nothing is imported to find that out (issue 14, item 5).
    """
    module = sys.modules.get('pydantic_ai.mcp')
    return module is not None and isinstance(toolset, module.MCPToolset)


def explicit_toolset_id(toolset: AbstractToolset[Any]) -> str | None:
    """The `id` chosen for `toolset`, or `None` when it has none or only a URL-derived one.

    Upstream's durability capabilities name durable units only after this value
    (`BaseDurabilityCapability._wrap_and_register_leaf` reads `_explicit_id`).
    """
    return toolset._explicit_id  # pyright: ignore[reportPrivateUsage]


def toolset_with_id(toolset: AbstractToolset[Any], new_id: str) -> AbstractToolset[Any] | None:
    """A copy of leaf `toolset` carrying the explicit id `new_id`; the original is left untouched.

    Returns `None` for a leaf kind we do not know how to copy (the caller reports it).
    The copy of a `FunctionToolset` shares the original's `tools` dict, so tools registered on a
    module-level toolset after the agent was defined stay visible through every copy.
    """
    if isinstance(toolset, FunctionToolset):
        clone = copy.copy(toolset)
        clone._id = new_id  # pyright: ignore[reportPrivateUsage]
        return clone
    if isinstance(toolset, DynamicToolset):
        return DynamicToolset(toolset.toolset_func, per_run_step=toolset.per_run_step, id=new_id)
    if is_mcp_toolset(toolset):
        clone = copy.copy(toolset)
        clone.id = new_id  # public setter; marks the id explicit
        return clone
    return None


def interchangeable_leaves(first: AbstractToolset[Any], second: AbstractToolset[Any]) -> bool:
    """Whether two leaf toolsets behave the same in every run, so one may stand in for the other.

    `DynamicToolset`: upstream's own `__eq__` (the same function object, `per_run_step` and id).
    `FunctionToolset` (exactly that class): the same `Tool` objects under the same names and equal settings
    otherwise (id, retries, timeout, ...); `WebSearch(local=func)` and its kin build such a toolset around the
    same `Tool` on every `get_toolset()` call. Anything else: only the same object.
    """
    if first is second:
        return True
    if type(first) is not type(second):
        return False
    if isinstance(first, DynamicToolset):
        return first == second
    if type(first) is not FunctionToolset:
        return False
    assert isinstance(second, FunctionToolset)
    mine, theirs = vars(first), vars(second)
    if mine.keys() != theirs.keys() or first.tools.keys() != second.tools.keys():
        return False
    if any(tool is not second.tools[name] for name, tool in first.tools.items()):
        return False
    try:
        return all(value == theirs[key] for key, value in mine.items() if key != 'tools')
    except Exception:  # noqa: BLE001 - an attribute whose `==` raises is not known to be equal
        return False


def derived_id_source(capability: AbstractCapability[Any]) -> str | None:
    """The normalized server URL an `MCP` capability derived its id from, or `None` when the id was chosen.

    Upstream compares these to tell two servers that derive the same host id apart from the same
    server listed twice (`AbstractCapability._derived_id_source`).
    """
    return capability._derived_id_source()  # pyright: ignore[reportPrivateUsage]


def capability_url_derived_id(capability: AbstractCapability[Any]) -> str | None:
    """The id an `MCP(url=...)` capability derived from its URL (the hostname in 2.68), or `None`.

    Set even for a deferred `MCP`, whose `id` upstream leaves `None`: it is what the id *would* be.
    """
    return getattr(capability, '_telemetry_url_derived_id', None)


def temporal_activity_name(fn: Any) -> str:
    """The activity type name temporalio registers `fn` under (`@activity.defn(name=...)`).

    temporalio has no public accessor; its worker reads the same private definition.
    """
    from temporalio import activity  # lazily: only Temporal code asks, and temporalio is an optional extra

    name = activity._Definition.must_from_callable(fn).name  # pyright: ignore[reportPrivateUsage]
    if name is None:
        raise ValueError(f'{fn!r} is a dynamic activity: it has no fixed activity type name')
    return name


def temporal_workflow_name(cls: type) -> str:
    """The workflow type name temporalio registers a `@workflow.defn` class under.

    temporalio has no public accessor; its worker and replayer read the same private definition. Used to
    read back what a worker registered (tests compare it with `durable.lock`).
    """
    from temporalio import workflow  # lazily: only Temporal code asks, and temporalio is an optional extra

    name = workflow._Definition.must_from_class(cls).name  # pyright: ignore[reportPrivateUsage]
    if name is None:
        raise ValueError(f'{cls!r} is a dynamic workflow: it has no fixed workflow type name')
    return name


def temporal_worker_registrations(durability: Any) -> tuple[list[Any], list[type]]:
    """`(activities, workflow classes)` upstream's plugin registers on a worker for a `TemporalDurability`.

    `worker_registrations` is importable from `pydantic_ai.durable_exec.temporal` but not exported (not in
    its `__all__`); upstream's own plugin calls it, so its answer is what a worker registers.
    """
    from pydantic_ai.durable_exec.temporal import (  # lazily: temporalio is an optional extra
        worker_registrations,  # pyright: ignore[reportPrivateImportUsage]
    )

    return worker_registrations(durability)


def temporal_set_deadlock_timeout(worker: Any, seconds: float) -> None:
    """Give `worker`'s workflow activations `seconds` (wall clock) before temporalio fails them as deadlocked.

    temporalio 1.x fixes its deadlock detector at 2 s (`_WorkflowWorker._deadlock_timeout_seconds`, switchable only
    off, with `debug_mode`); its Go and Java SDKs make it a worker option (`DeadlockDetectionTimeout`), and
    sdk-python#1050 / #1614 ask the same for Python. An activation that carries a long message history (the model
    request's input serialized, pydantic-ai's own scans of the history) takes a fraction of a second on a quiet
    machine, but more than 2 s on a busy one: the workflow task then fails, is retried with the same work, and
    can fail again for as long as the load lasts. Set after `Worker(...)` and before it runs.

    Raises:
        RuntimeError: temporalio no longer has the attribute (the contract test fails first).
    """
    workflow_worker = getattr(worker, '_workflow_worker', None)
    if workflow_worker is None:
        return  # a worker without workflows
    if not hasattr(workflow_worker, '_deadlock_timeout_seconds'):
        raise RuntimeError('temporalio changed: _WorkflowWorker._deadlock_timeout_seconds is gone; see _upstream.py')
    if workflow_worker._deadlock_timeout_seconds is not None:  # None: debug mode, detection off; keep it off
        workflow_worker._deadlock_timeout_seconds = seconds


def dbos_application_version(app_name: str, excluded: Collection[str]) -> str:
    """DBOS's own application version for `app_name`, computed over the registered workflows except `excluded`.

    DBOS computes it at launch unless one is configured (`DBOSRegistry.compute_app_version`: an MD5 of the sorted
    sources of every registered workflow, the dbos version and the app name) and recovers only pending workflows
    recorded under the version it runs as. Its registry is private (`dbos._dbos._get_or_create_dbos_registry`); the
    same method runs here on a copy that leaves out `excluded`, so the answer is DBOS's own whenever `excluded`
    names nothing registered.

    Args:
        app_name: The DBOS application name (`DBOSConfig['name']`).
        excluded: Workflow names to leave out.

    Raises:
        ImportError: the `dbos` extra is not installed.
    """
    from dbos._dbos import _get_or_create_dbos_registry  # lazily: dbos is an optional extra

    view = copy.copy(_get_or_create_dbos_registry())
    view.workflow_info_map = {n: f for n, f in view.workflow_info_map.items() if n not in excluded}
    return view.compute_app_version(app_name)


def dbos_error_classes() -> tuple[type[BaseException], type[BaseException]]:
    """`(DBOSException, DBOSMaxStepRetriesExceeded)`: DBOS's base error (its control flow, e.g. a cancelled or
    conflicting workflow) and the one raised when a step's retries are exhausted (a real failure).

    dbos exports neither; both live in its private `dbos._error` module.

    Raises:
        ImportError: the `dbos` extra is not installed.
    """
    from dbos._error import DBOSException, DBOSMaxStepRetriesExceeded  # lazily: dbos is an optional extra

    return DBOSException, DBOSMaxStepRetriesExceeded


def typer_usage_errors() -> tuple[type[Exception], type[Exception]]:
    """`(UsageError, NoArgsIsHelpError)`: the error typer raises for a command line it cannot parse (an unknown option,
    a bad or missing value; exit code 2) and its subclass for a group given no arguments (it shows the help).

    typer (0.29) vendors click as its private `typer._click` and exports only their base, `typer.TyperException`;
    `durcap`'s command group turns the first into one coded line (`cli._OneLineUsageGroup`) and lets the second
    print its help.
    """
    from typer._click.exceptions import NoArgsIsHelpError, UsageError  # lazily: only the CLI asks

    return UsageError, NoArgsIsHelpError


def dbos_recover_pending_workflows(executor_ids: list[str]) -> list[str]:
    """Ask the launched DBOS of this process to recover the PENDING workflows of `executor_ids` (of this process's
    application version); returns their workflow ids.

    DBOS's own recovery, as its launch runs for its own executor id and as its admin API's workflow-recovery
    endpoint runs for the ids it is given (`DBOS._recover_pending_workflows`, a private classmethod): each
    workflow is re-enqueued on DBOS's internal queue, whose ENQUEUED -> PENDING hand-off admits one runner, so a
    recovery asked twice runs each workflow once.

    Raises:
        ImportError: the `dbos` extra is not installed.
        AttributeError: DBOS renamed it (tests/unit/test_upstream_contract.py says which).
    """
    from dbos import DBOS  # lazily: dbos is an optional extra

    return [handle.workflow_id for handle in DBOS._recover_pending_workflows(list(executor_ids))]


def dbos_active_workflow_ids() -> list[str]:
    """The ids of the workflows the launched DBOS of this process runs now: what `DBOS.destroy`'s drain waits for
    (`DBOS._active_workflows_set.activeList()`, private: the drain counts them there and nowhere public).

    Raises:
        ImportError: the `dbos` extra is not installed.
        DBOSException: no DBOS was created in this process.
        AttributeError: DBOS renamed it (the worker then drains as DBOS does, parked runs included, and
            tests/engines/test_dbos_drain.py::test_a_run_parked_on_an_approval_does_not_hold_the_drain_and_resumes_on_a_peer
            fails).
    """
    from dbos._dbos import _get_dbos_instance  # lazily: dbos is an optional extra

    return list(_get_dbos_instance()._active_workflows_set.activeList())


def dbos_stop_taking_work() -> None:
    """Stop the launched DBOS of this process from starting workflows: set the stop events of its background threads
    (the queue poller, recovery, the scheduler, the event receivers), as `DBOS.destroy` does first, before it waits
    for the running workflows. Setting them again in `DBOS.destroy` changes nothing.

    Raises:
        ImportError: the `dbos` extra is not installed.
        DBOSException: no DBOS was created in this process.
        AttributeError: DBOS renamed it (as `dbos_active_workflow_ids`).
    """
    from dbos._dbos import _get_dbos_instance  # lazily: dbos is an optional extra

    for event in _get_dbos_instance().background_thread_stop_events:
        event.set()


def runtime_rejected_kinds(durability_class: type) -> frozenset[str]:
    """The leaf toolset kinds (`'function' | 'mcp' | 'dynamic'`) upstream's durability capability `durability_class`
    (`TemporalDurability`, `DBOSDurability`, `PrefectDurability`, or a subclass) refuses inside a durable run unless
    they are the objects it wrapped at build time: its `engine_spec.unsupported_runtime_toolset_kinds`
    (`pydantic_ai.durable_exec._spec.DurabilityEngineSpec`, a private module; the attribute is read, never copied).

    Raises:
        AttributeError: upstream renamed the spec or the field (tests/test_upstream_contract.py says which).
    """
    spec = durability_class.engine_spec  # type: ignore[attr-defined]
    return frozenset(str(kind) for kind in spec.unsupported_runtime_toolset_kinds)


PREFECT_ENGINE_MODULE = 'prefect.engine'
"""The module Prefect's runner runs as a flow run's process (`python -m prefect.engine`, the flow run's id in
`$PREFECT__FLOW_RUN_ID`)."""


def prefect_engine_run_process(replacement: Any | None = None) -> Any:
    """Prefect's function that starts a served deployment's flow-run processes; with `replacement`, install it.

    Prefect 3's runner starts a flow run of a deployment added with `Runner.add_deployment` (what `prefect.serve`
    does) with `EngineCommandStarter` (private `prefect.runner._starter_engine`), which calls that module's
    `run_process(command, *, stream_output, task_status, task_status_handler, env, cwd)` with command
    `[python, '-m', 'prefect.engine']`; its docstring names the module attribute as the override point ("patch the
    module to override"). `replacement` must accept the same call (it may hand other calls to the function
    returned).

    Returns:
        The function installed before (Prefect's `prefect.utilities.processutils.run_process` unless replaced).

    Raises:
        RuntimeError: Prefect moved the override point (tests/unit/test_upstream_contract.py says which).
    """
    from prefect.runner import _starter_engine  # lazily: prefect is an optional extra

    current = getattr(_starter_engine, 'run_process', None)
    if current is None or 'run_process' not in _starter_engine.EngineCommandStarter.start.__code__.co_names:
        raise RuntimeError('prefect changed: EngineCommandStarter no longer calls prefect.runner._starter_engine.'
                           'run_process; see durable_capabilities/_upstream.py')
    if replacement is not None:
        setattr(_starter_engine, 'run_process', replacement)  # noqa: B010 - a module attribute Prefect reads at each call
    return current


async def prefect_server_settings(client: Any) -> Any:
    """The Prefect server's settings (`GET /admin/settings`, the JSON the server answers), read through `client`'s
    own HTTP session (private `PrefectClient._client`: no public client method reads them; the session carries the
    client's API URL, auth and retries).

    Args:
        client: an open `prefect.client.orchestration.PrefectClient`.

    Returns:
        The decoded JSON (a dict: `server.services.db_vacuum...`).

    Raises:
        Whatever the session raises (`httpx.HTTPError`, `PrefectHTTPStatusError`) or a JSON decode error: callers
        treat any as "the server did not say".
    """
    response = await client._client.get('/admin/settings')  # pyright: ignore[reportPrivateUsage]
    return response.json()


class _SharedVerifiedContexts:
    """What `prefect.client.orchestration` sees as its `ssl` module once `prefect_share_tls_contexts` installed it:
    the real `ssl` (every other name is looked up there), but `create_default_context(cafile=FILE)`, the one call of
    Prefect's clients that verifies TLS, returns one context per CA file (its path, size, change time, inode) and
    process instead of building a new one per client (loading certifi's bundle: ~20 ms of CPU each). Every other
    call, the insecure one included (Prefect turns its verification off on the context it gets), builds a new one.
    """

    def __init__(self, real: Any) -> None:
        import threading

        self.real = real
        self.contexts: dict[tuple[str, int, int, int], Any] = {}
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def create_default_context(self, purpose: Any = None, *, cafile: Any = None, capath: Any = None,
                               cadata: Any = None) -> Any:
        """`ssl.create_default_context`, shared for a CA file (see the class); raises what it raises."""
        import os

        if purpose is None:
            purpose = self.real.Purpose.SERVER_AUTH
        if cafile is None or capath is not None or cadata is not None or purpose != self.real.Purpose.SERVER_AUTH:
            return self.real.create_default_context(purpose, cafile=cafile, capath=capath, cadata=cadata)
        stat = os.stat(cafile)  # a missing file raises here as it would in `load_verify_locations`
        key = (os.fspath(cafile), stat.st_size, stat.st_mtime_ns, stat.st_ino)
        with self.lock:
            context = self.contexts.get(key)
            if context is None:
                context = self.contexts[key] = self.real.create_default_context(purpose, cafile=cafile)
        return context


def prefect_share_tls_contexts() -> Any:
    """Make Prefect's API clients (`PrefectClient`, `SyncPrefectClient`) in this process share one verifying TLS
    context per CA file instead of each building its own (issue 29: a flow run's process built 7, ~20 ms of CPU each,
    most of them for an http:// API that never uses it). Idempotent; returns the shim installed.

    Prefect builds the context in the clients' `__init__` with `ssl.create_default_context(cafile=...)` (the CA
    file: `PREFECT_API_SSL_CERT_FILE`, else certifi's) unless `httpx_settings` gives one, through its module's `ssl`
    name, which is replaced here (`_SharedVerifiedContexts`). The context is the same one Prefect would build;
    nothing changes it afterwards but httpcore's ALPN list, which every client of a process sets alike
    (`PREFECT_API_ENABLE_HTTP2`).

    Raises:
        RuntimeError: Prefect no longer builds the context there (tests/unit/test_upstream_contract.py says which).
    """
    import ssl

    from prefect.client import orchestration

    current = getattr(orchestration, 'ssl', None)
    if isinstance(current, _SharedVerifiedContexts):
        return current
    if current is not ssl or not all('create_default_context' in cls.__init__.__code__.co_names
                                     for cls in (orchestration.PrefectClient, orchestration.SyncPrefectClient)):
        raise RuntimeError('prefect changed: its clients no longer build their TLS context with '
                           'ssl.create_default_context; see durable_capabilities/_upstream.py')
    shim = _SharedVerifiedContexts(ssl)
    setattr(orchestration, 'ssl', shim)  # noqa: B010 - the module's name for `ssl`, read at each client's creation
    return shim
