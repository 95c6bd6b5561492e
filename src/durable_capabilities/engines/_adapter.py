"""The engine adapter protocol: everything the rest of the package asks of an engine.

One module per engine implements it (`local.py`, `temporal.py`, `dbos.py`, `prefect.py`) and
exposes the instance as `ADAPTER`; what the rest of the package knows of an engine without importing it is its
`_protocol.EngineSpec`, and `engines/__init__.py` registers each one with one line, `LazyAdapter(spec)`. The CLI,
the runner, the lockfile, replay and the MCP guard look engines up by name and never name one.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from ..approvals import ApprovalError
from ..errors import NOT_FOUND_CODE, DurcapError, with_code
from ._protocol import ConnectionSetting, EngineSpec

if TYPE_CHECKING:
    from ..agent import DurableAgent
    from ..approvals import Decision, PendingCall
    from ..report import RunReport


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


RUN_STATUSES = ('running', 'queued', 'orphaned', 'completed', 'failed', 'cancelled')
"""The common run statuses `durcap runs --status` filters on (each engine maps its own onto these). `orphaned`: the
engine still records the run as in flight, but the process that ran it is gone and nothing will pick it up until
`durcap runs resume` (or a worker) does; an engine that cannot tell says `running`."""


@dataclass
class RunUnit:
    """One durable unit (activity, step, task) a run scheduled, as `durcap runs show` / `durcap ui` list them.

    Attributes:
        name: The engine's name of the unit (`agent__support__model_request`, `support__model.request`, `Model Request`).
        kind: `unit_kind(name)`: `'model request' | 'tool call' | 'conversation' | 'approval' | 'other'`.
        status: `'done' | 'failed' | 'started'`.
        started_at: When the engine recorded it (UTC), if known.
        capabilities: Capability ids whose `load_capability` call this unit's recorded output holds (a model
            request that asked to load them), where the engine keeps outputs readable (DBOS steps, Temporal
            activity results not stored by reference).
    """

    name: str
    kind: str
    status: str
    started_at: datetime | None = None
    capabilities: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The unit as JSON-compatible data (`started_at` as ISO 8601)."""
        return {**self.__dict__, 'started_at': self.started_at.isoformat() if self.started_at else None}


def unit_kind(name: str) -> str:
    """What a durable unit does, from its name on any engine (the operation names of DESIGN section 1):
    `'model request'`, `'tool call'`, `'conversation'` (load/append), `'approval'` (the approval clock) or `'other'`."""
    low = name.lower()
    if 'model' in low and 'request' in low:
        return 'model request'
    if 'call_tool' in low or low.startswith('call tool'):
        return 'tool call'
    if 'conversation' in low:
        return 'conversation'
    if 'approval' in low:
        return 'approval'
    return 'other'


@dataclass
class RunInfo:
    """One run as an engine recorded it (`durcap runs list|show`).

    Attributes:
        engine: The engine's name.
        run_id: The engine's id of the run (workflow id, flow run id).
        agent: The agent's name (from the workflow/flow name), `None` when not a durcap run.
        status: One of `RUN_STATUSES`.
        engine_status: The engine's own word for the status (`PENDING`, `RUNNING`, `CRASHED`, ...).
        started_at: When the run started (UTC), if known.
        capabilities: Capability ids the run loaded so far, in order.
        conversation_id: The conversation it appends to, if any.
        units_done: Durable units (steps, activities, tasks) completed so far.
        notes: Operator hints (e.g. "its process is gone: resume it").
        detail: Engine-specific facts (executor id, task queue, ...), JSON-compatible.
        units: The durable units in the order the engine scheduled them (`show_run` only; `list_runs` leaves
            it empty to stay cheap).
    """

    engine: str
    run_id: str
    agent: str | None
    status: str
    engine_status: str
    started_at: datetime | None = None
    capabilities: list[str] = field(default_factory=list)
    conversation_id: str | None = None
    units_done: int | None = None
    notes: list[str] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    units: list[RunUnit] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """The run as JSON-compatible data (`started_at` as ISO 8601; `units` only when filled)."""
        data = dict(self.__dict__)
        data['started_at'] = self.started_at.isoformat() if self.started_at else None
        data['units'] = [unit.to_json() for unit in self.units]
        if not data['units']:
            del data['units']
        return data


@dataclass(frozen=True)
class RunState:
    """Whether one run is still open on its engine, or when it closed (`EngineAdapter.run_states`).

    Attributes:
        run_id: The engine's id of the run (a Temporal workflow id: its latest execution is meant).
        open: The run is still running (or waiting); a continued-as-new workflow is open while its latest run is.
        closed_at: When it closed (UTC), `None` while open. For a run counted as abandoned (`abandoned`), its last
            sign of life.
        abandoned: Why the engine counts a run it shows as running as closed: its process is gone (Prefect: a RUNNING
            flow run with no beat, state change or task run update for longer than the abandoned-after time), e.g.
            `'RUNNING, no sign of life for 2h (since 2026-12-06T01:02:03+00:00)'`; `None` for a run that is open or
            really closed.
    """

    run_id: str
    open: bool
    closed_at: datetime | None = None
    abandoned: str | None = None


@dataclass(frozen=True)
class RunStates:
    """What an engine says of a set of runs (`EngineAdapter.run_states`).

    Attributes:
        engine: The engine's name.
        where: Where it was asked (`namespace 'default' at 127.0.0.1:7233`), for messages.
        retention: How long the engine keeps a closed run's records (a Temporal namespace's retention period),
            `None` when it cannot tell (or keeps them until deleted: `keeps_forever`).
        states: `{run id: RunState}` of the runs it knows; a run it does not know is absent.
        keeps_forever: The engine keeps closed runs until someone deletes them (a Prefect server without flow run
            vacuum): with no retention given, gc keeps its runs' claim checks instead of refusing.
    """

    engine: str
    where: str
    retention: timedelta | None
    states: dict[str, RunState] = field(default_factory=dict)
    keeps_forever: bool = False


class RunNotFoundError(LookupError, DurcapError, code='run-not-found'):
    """The engine has no run with that id (message, `args[0]`: led by `DC044`, names the id and where it looked; more
    args are kept as given, e.g. `reading.find_run`'s list of each engine's answer)."""

    def __init__(self, message: str, *details: Any) -> None:
        super().__init__(with_code(NOT_FOUND_CODE, message), *details)


class EngineUnreachableError(RuntimeError, DurcapError, code='engine-unreachable'):
    """The engine's server cannot be reached (message: one line naming the address, the reason and the fix).

    A `RuntimeError`, as the SDK's own connection error it replaces (temporalio raises `RuntimeError('Failed client
    connect: ...')` with the Rust transport error inside), so code that caught that still catches this. The CLI
    prints it as one line and exits 2, as it does for a database it cannot connect to.
    """


class DrainCutShortError(DurcapError, code='drain-cut-short'):
    """A worker stopped (SIGTERM / SIGINT) before the runs it was running ended: its drain time
    (`--graceful-shutdown`) passed with runs still going. They are not lost (each engine hands them on: the message
    says how), but the worker did not drain: `durcap worker` exits 1 with this one line instead of saying "drained".

    Attributes:
        engine: The engine's name.
        run_ids: The runs left, as the engine names them (workflow ids).
    """

    def __init__(self, engine: str, run_ids: Sequence[str], message: str):
        super().__init__(message)
        self.engine, self.run_ids = engine, list(run_ids)


def loaded_capabilities_in(values: Iterable[Any]) -> list[str]:
    """Capability ids of every `load_capability` tool call found in `values` (model responses, message lists,
    or their JSON, as data or as one JSON string), in order, each once.

    A message (object or message JSON: `kind` and `parts`) is read part by part, its tool-call parts only: what a
    part holds (a tool's return value, arguments, metadata) is never walked, so a value that merely looks like a
    `load_capability` call inside a tool's result is not counted, and a long history costs one pass over its
    parts (in Temporal workflow code, where the sandbox intercepts every `isinstance`, the generic walk of a 6-request
    run's messages cost ~25 ms of CPU).
    """
    found: list[str] = []

    def add(args: Any) -> None:
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {}
        cap = args.get('id') if isinstance(args, Mapping) else None
        if cap and cap not in found:
            found.append(cap)

    def visit(value: Any) -> None:
        if isinstance(value, Mapping):
            parts = value.get('parts')
            if value.get('kind') in ('request', 'response') and isinstance(parts, list):
                for part in parts:
                    if isinstance(part, Mapping) and part.get('part_kind') == 'tool-call' \
                            and part.get('tool_name') == 'load_capability':
                        add(part.get('args'))
                return
            if value.get('tool_name') == 'load_capability' and value.get('part_kind') == 'tool-call':
                add(value.get('args'))
                return
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, str):
            # A message list as one JSON string (the Prefect flow's `new_messages`): decoded only when it names the tool.
            if value.startswith('[') and '"load_capability"' in value:
                try:
                    visit(json.loads(value))
                except ValueError:
                    pass
        elif isinstance(getattr(value, 'parts', None), (list, tuple)):  # a message object
            for part in value.parts:
                if getattr(part, 'part_kind', None) == 'tool-call' and getattr(part, 'tool_name', None) == 'load_capability':
                    add(part.args)
        elif getattr(value, 'part_kind', None) == 'tool-call':  # a part object
            if getattr(value, 'tool_name', None) == 'load_capability':
                add(value.args)

    for value in values:
        visit(value)
    return found


@dataclass
class RunOptions:
    """How to run one turn (`EngineAdapter.run`).

    Attributes:
        deps: The run's deps, of the agent's `deps_type` (or `None`).
        message_history: Prior messages (ignored when `conversation_id` is given: the store's history is used).
        conversation_id: Conversation to load from and append to.
        run_id: The engine's id for the run (workflow id); default `{agent name}-{uuid4}`.
        settings: Engine settings by name, e.g. `address`, `task_queue`, `inline_worker`, `namespace` (Temporal)
            or `db` (DBOS); an engine ignores the ones it does not know.
        notify: Where an engine reports what it does on the user's behalf (one line; default stderr).
        on_start: Called with the run id the moment the engine has the run (before any of its work), so a caller
            interrupted later can say how to find, resume or cancel it.
    """

    deps: Any = None
    message_history: Sequence[Any] | None = None
    conversation_id: str | None = None
    run_id: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    notify: Callable[[str], None] = _stderr
    on_start: Callable[[str], None] | None = None

    def started(self, run_id: str, line: str) -> None:
        """An adapter reports its run's id: `on_start(run_id)`, then `line` (naming the id) to `notify`."""
        if self.on_start is not None:
            self.on_start(run_id)
        self.notify(line)

    def setting(self, name: str, default: Any = None) -> Any:
        """`settings[name]`, or `default` when absent or `None`."""
        value = self.settings.get(name)
        return default if value is None else value


class EngineAdapter(ABC):
    """One engine, as the package sees it.

    Attributes:
        name: The engine's name (`--engine NAME`, `DurableAgent(engines=[NAME])`, `durable.lock` section).
        unit / units: The engine's word for a durable unit, singular and plural (activity, step, task).
        container: The engine's word for the durable container (workflow, flow).
        run_id_label: What the engine calls a run's id (`'workflow id'`, `'flow run id'`).
        extra: The `durable-capabilities[...]` extra that installs the engine (`None`: nothing to install).
        requires: Top-level module of the engine's SDK, checked without importing it.
        durable: Whether runs survive a crash (False for local, which `engines=` never lists).
        features: What else the engine offers, each a CLI command: `'worker'` (`durcap worker NAME`,
            `serve_worker`), `'dev-server'` (`durcap dev NAME`, `serve_dev_server`), `'schedule'`
            (`durcap schedule NAME`, `serve_schedule`), `'history'` (`durcap history export`, `export_history`,
            and `replayer` for `durcap replay`), `'claim-checks'` (its runs store claim checks: `run_states` for
            `durcap store gc`).
        lock_sections: Section names of the engine's `durable.lock` entry, mapped to the singular word
            used in messages (`{'workflows': 'workflow', 'activities': 'activity'}`).
    """

    name: str = ''
    unit: str = 'call'
    units: str = 'calls'
    container: str = 'run'
    run_id_label: str = 'run id'
    extra: str | None = None
    requires: str | None = None
    durable: bool = True
    features: frozenset[str] = frozenset()
    lock_sections: Mapping[str, str] = {}

    def available(self) -> bool:
        """Whether the engine's SDK is installed, without importing it (importing Prefect alone takes ~1.4 s)."""
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    _declared: EngineSpec | None = None

    def __init_subclass__(cls, spec: EngineSpec | None = None, **kwargs: Any) -> None:
        """`class XAdapter(EngineAdapter, spec=SPEC)`: the adapter's name, nouns, extra, requirement, durability,
        features and lock sections are read from `SPEC`, so an engine states them once (its spec)."""
        super().__init_subclass__(**kwargs)
        if spec is not None:
            cls._declared = spec
            cls.name, cls.durable, cls.extra, cls.requires = spec.name, spec.durable, spec.extra, spec.requires
            cls.unit, cls.units, cls.container, cls.run_id_label = spec.unit, spec.units, spec.container, spec.run_id_label
            cls.features, cls.lock_sections = spec.features, spec.lock_sections

    @property
    def spec(self) -> EngineSpec:
        """The engine's `EngineSpec`: the one the adapter class declares (`spec=` in its class line), else, for an
        adapter registered directly, one built from its attributes, with no connection settings (override
        `connection_settings` to declare some)."""
        if self._declared is not None:
            return self._declared
        return EngineSpec(
            name=self.name, module=type(self).__module__, durable=self.durable, extra=self.extra, requires=self.requires,
            label=self.name, settings=tuple(self.connection_settings), lock_sections=self.lock_sections, unit=self.unit,
            units=self.units, container=self.container, run_id_label=self.run_id_label, features=self.features,
        )

    connection_settings: Sequence[ConnectionSetting] = ()
    """Connection settings of an adapter registered without a spec (see `spec`)."""

    def durability_class(self) -> Callable[..., Any] | None:
        """Upstream's durability capability class, or a subclass of it (`None`: the agent is built without one, as locally).

        Raises:
            ImportError: the engine's extra is not installed.
        """
        return None

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        """Keyword arguments for `durability_class()` (our defaults merged with the user's `options`, which win)
        and the extra capabilities to attach (the MCP guard, DBOS tool steps, ...)."""
        return dict(options), []

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        """Every durable name the engine registers for `agent`, per `lock_sections` key, sorted.

        The one source of these names: worker registration, `durable.lock`, replay and the demo use it.
        """
        return {}

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        """Names of the durable units that load and append the agent's conversations (load first)."""
        return []

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        """Where a user sets the attempts of an MCP leaf's units (quoted in `MCPCapabilityError`)."""
        return None

    def mcp_passes_through(self, error: BaseException) -> bool:
        """Whether an error from an MCP unit is engine control flow the MCP guard must re-raise unchanged."""
        return False

    def mcp_upstream_schedule(self) -> bool:
        """True while replaying a history recorded before the MCP guard existed (list tools as upstream did)."""
        return False

    def unconfigured(self, settings: Mapping[str, Any]) -> str | None:
        """Why a command that asks every engine (`durcap runs list` without `--engine`) skips this one: `None` when it
        is configured; else one line saying what is missing (the engine would start a server of its own)."""
        return None

    def listing_note(self, settings: Mapping[str, Any]) -> str | None:
        """A note the listing commands (`runs list`, `approvals list`) print before reading this engine when the place
        they read may not be the one the user means (DBOS: a `--db` SQLite file that does not exist, so nothing has run
        there or the path is mistyped; Prefect: no API configured, so Prefect's temporary server is read); `None`
        otherwise. An empty answer from the wrong place is then never silent."""
        return None

    def warm_up(self, settings: Mapping[str, Any], notify: Callable[[str], None]) -> None:
        """Start, without waiting, what a run on this engine will need and can start early (Prefect: its temporary
        local server when no API is configured), so it overlaps loading TARGET; say so on `notify`. Called by
        `durcap run` and `durcap demo` once the flags are checked. Default: nothing."""
        return None

    async def check_serving(self, settings: Mapping[str, Any]) -> list[str]:
        """What `durcap serve --engine NAME` checks once before it takes turns (`settings`: the run settings it hands
        every turn: `address`, `db`, `queue`, `task_queue`, `store`, ...).

        Returns:
            Warning lines for what makes turns wait or fail until something else is started (no worker serves the
            queue yet; a system database no worker has created): serve starts anyway, as a worker may come later.
            Default: none.

        Raises:
            EngineUnreachableError: the engine's server cannot be reached within a bounded wait (Temporal: the
                connect timeout, 10 s): no turn could be started; `durcap serve` exits 2 with the line.
        """
        return []

    def run_notes(self, options: RunOptions) -> list[str]:
        """Lines `durcap run` prints before the run (e.g. which store a remote worker uses)."""
        return []

    def serve_worker(self, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
        """Serve `agents` (already validated and checked against the lock) until SIGTERM / SIGINT, then drain.

        `options.settings`: `address`, `task_queue`, `namespace`, `graceful_shutdown` (seconds); `options.notify`
        gets the ready line. Only for engines with the `'worker'` feature.

        Raises:
            OSError / RuntimeError: the worker cannot reach its server.
            DrainCutShortError: stopped, but runs were still going when the drain time ended (DBOS); the message says
                which and what becomes of them.
        """
        raise NotImplementedError(f'engine {self.name!r} has no worker')

    def serve_dev_server(self, port: int, state_dir: Any, notify: Callable[[str], None], ui_port: int | None = None) -> None:
        """Run the engine's local development server on `port` (state in `state_dir`, web UI on `ui_port` if the
        engine has one) until SIGTERM / Ctrl-C; the server dies with this process.

        Raises:
            OSError: the port is held by another process; the server cannot start (FileNotFoundError: not installed).
            RuntimeError / TimeoutError: the server cannot start or exited (message: one line).
        """
        raise NotImplementedError(f'engine {self.name!r} has no dev server')

    def serve_schedule(
        self, agent: DurableAgent[Any, Any], *, target: str, prompt: str, cron: str | None, interval_seconds: float | None,
        deps: Any, deployment_name: str | None, notify: Callable[[str], None], limit: int | None = None,
        spawn: bool = False,
    ) -> None:
        """Serve scheduled runs of `agent` (loaded in each run's process from `target`) until interrupted.

        `deps` is JSON data; exactly one of `cron` and `interval_seconds` is set; `limit`: runs this process runs at
        once (`None`: the engine's default); `spawn`: each run in a new Python process, not one forked from a
        preloaded fork server (engines that start a process per run).
        """
        raise NotImplementedError(f'engine {self.name!r} has no schedules')

    async def export_history(self, run_id: str, output: Any, settings: Mapping[str, Any]) -> Any:
        """Write a recorded run's history to `output` (for `durcap replay`); returns the path written."""
        raise NotImplementedError(f'engine {self.name!r} records no history to export')

    async def measure_tool_calls(self, agents: Sequence[DurableAgent[Any, Any]], settings: Mapping[str, Any],
                                 runs: int) -> dict[str, dict[str, Any]]:
        """`{agent name: {leaf id: timing}}` of the tool calls in the agents' most recent `runs` closed runs, for
        `durcap lock --measure` (`lockfile.decide_local_tools`); only engines with local tool units have it."""
        raise NotImplementedError(f'engine {self.name!r} has no tool timings to measure')

    def replayer(self, agents: Sequence[DurableAgent[Any, Any]], *, store: str | None = None) -> Any | None:
        """For engines whose recorded histories can be replayed against the code (payloads stored by reference
        read from the conversation store `store`), an object with
        `async replay(history_json: dict, workflow_id: str) -> str | None` (the engine's failure text, `None` when
        it replays) and `explain(failure_text) -> str` (what changed, naming the capability or agent, and the fix);
        `None` otherwise."""
        return None

    # ---- runs the engine recorded (`durcap runs`) ---------------------------------------------------
    # Written once here over the engine's operator primitives: `operator` is the engine's `_runs` module (or any
    # object) with `list_runs`, `show_run`, `cancel`, `resume`, `pending_approvals` and `decide` functions of the
    # signatures below minus `self`; `None` (the local engine): no runs, nothing to approve.

    operator: Any = None

    async def list_runs(self, settings: Mapping[str, Any], *, status: str | None = None, limit: int = 50) -> list[RunInfo]:
        """The engine's durcap runs, newest first (at most `limit`), with `status` one of `RUN_STATUSES` or `None`.

        `settings`: the engine's connection settings (`address`/`namespace`, `db`, ...).

        Raises:
            NotImplementedError: the engine keeps no runs (local).
            OSError / RuntimeError: the engine's server or database cannot be reached.
        """
        if self.operator is None:
            raise NotImplementedError(f'engine {self.name!r} keeps no runs')
        return await self.operator.list_runs(settings, status=status, limit=limit)

    async def show_run(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        """One run by id.

        Raises:
            RunNotFoundError: no run has that id.
            NotImplementedError: the engine keeps no runs.
        """
        if self.operator is None:
            raise NotImplementedError(f'engine {self.name!r} keeps no runs')
        return await self.operator.show_run(run_id, settings)

    async def resume(self, run_id: str, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> RunReport:
        """Finish a run whose process died, in this process, without repeating a completed durable unit.

        `agents`: the definitions loaded from the run's TARGET (the engine needs their code to run).

        Raises:
            RunNotFoundError: no run has that id.
            RuntimeError: the run cannot be resumed here (message says why and what to do).
        """
        if self.operator is None:
            raise NotImplementedError(f'engine {self.name!r} cannot resume runs')
        return await self.operator.resume(run_id, agents, options)

    async def cancel(self, run_id: str, settings: Mapping[str, Any]) -> RunInfo:
        """Cancel a run on the engine; returns it as recorded after the cancellation.

        Raises:
            RunNotFoundError: no run has that id.
        """
        if self.operator is None:
            raise NotImplementedError(f'engine {self.name!r} cannot cancel runs')
        return await self.operator.cancel(run_id, settings)

    async def delete_run(self, run_id: str, settings: Mapping[str, Any]) -> None:
        """Delete the engine's records of one run (its history, step outputs, results): `durcap history delete
        --engines`.

        Raises:
            RunNotFoundError: no run has that id.
            NotImplementedError: the engine keeps no runs, or cannot delete one.
        """
        if self.operator is None or not hasattr(self.operator, 'delete_run'):
            raise NotImplementedError(f'engine {self.name!r} cannot delete runs')
        await self.operator.delete_run(run_id, settings)

    async def run_states(self, run_ids: Sequence[str], settings: Mapping[str, Any]) -> RunStates:
        """Whether each of `run_ids` is open or when it closed, and the engine's retention of closed runs: what
        `durcap store gc` needs to tell which claim checks no run can read any more. Asked of the engines whose
        runs record claim checks (Temporal; Prefect, whose tool results keep their texts in the store), each about the
        owners of its runs (an engine with an `append_prefix` about the owners that begin with it, the others about
        the rest); the answer must be current (not an eventually consistent listing). `settings` may carry
        `abandoned_after` (seconds): how long a run shown as running must show no sign of life to count as abandoned
        (`RunState.abandoned`), on engines that can tell.

        Raises:
            NotImplementedError: the engine records no claim checks.
            OSError / RuntimeError: the engine's server cannot be reached.
        """
        if self.operator is None or not hasattr(self.operator, 'run_states'):
            raise NotImplementedError(f'engine {self.name!r} records no claim checks')
        return await self.operator.run_states(run_ids, settings)

    # ---- approvals (`durcap approvals`) -------------------------------------------------------------

    async def pending_approvals(self, settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
        """Tool calls waiting for a person in the engine's runs (only `run_id`'s when given), from outside the
        runs (a client). `settings` as `RunOptions.settings` (`address`, `namespace`, `db`). Durable runs wait in
        the engine's `approvals.ApprovalGate`, which the engine's container passes to `turn.run_turn`."""
        if self.operator is None:
            return []
        return await self.operator.pending_approvals(settings, run_id)

    async def decide(self, run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
        """Deliver `decision` to the waiting run `run_id`, after checking it against the run's pending calls.

        Returns:
            The pending call decided.

        Raises:
            approvals.ApprovalError: unknown run, unknown call, stale fingerprint (nothing was delivered).
        """
        if self.operator is not None:
            return await self.operator.decide(run_id, decision, settings)
        raise ApprovalError('unknown-run', f'engine {self.name!r} runs do not wait for approval')

    @abstractmethod
    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        """Run one turn of `agent` on the engine and report what it recorded.

        Raises:
            DurableConfigError: the definition or the stored history has errors.
            Exception: whatever the engine raised when the run failed.
        """


if TYPE_CHECKING:
    _Forwarding = EngineAdapter  # what a type checker sees: every member of the adapter protocol
else:
    _Forwarding = object


class LazyAdapter(_Forwarding):
    """A registry entry built from an `EngineSpec`: answers what the spec declares (name, extra, availability,
    durable, features, nouns, lock sections) without importing anything, and forwards every other member of
    `EngineAdapter` to the engine module's `ADAPTER`, imported (with the engine's SDK) on first use.

    Args:
        spec: The engine's spec (`spec.module` holds the adapter as `ADAPTER`).
    """

    def __init__(self, spec: EngineSpec):
        self._spec = spec

    @property
    def spec(self) -> EngineSpec:
        return self._spec

    # What the spec answers (no import).
    name = property(lambda self: self.spec.name)  # type: ignore[assignment]
    extra = property(lambda self: self.spec.extra)  # type: ignore[assignment]
    requires = property(lambda self: self.spec.requires)  # type: ignore[assignment]
    durable = property(lambda self: self.spec.durable)  # type: ignore[assignment]
    features = property(lambda self: self.spec.features)  # type: ignore[assignment]
    unit = property(lambda self: self.spec.unit)  # type: ignore[assignment]
    units = property(lambda self: self.spec.units)  # type: ignore[assignment]
    container = property(lambda self: self.spec.container)  # type: ignore[assignment]
    run_id_label = property(lambda self: self.spec.run_id_label)  # type: ignore[assignment]
    lock_sections = property(lambda self: self.spec.lock_sections)  # type: ignore[assignment]
    module = property(lambda self: self.spec.module)

    def available(self) -> bool:
        """Whether the engine's SDK is installed, without importing it."""
        return self.spec.available()

    @property
    def loaded(self) -> EngineAdapter:
        """The engine module's `ADAPTER`.

        Raises:
            ImportError: the engine's extra is not installed.
        """
        return importlib.import_module(self.spec.module).ADAPTER

    def __repr__(self) -> str:
        return f'LazyAdapter({self.spec.name!r}, {self.spec.module!r})'

    if TYPE_CHECKING:
        async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport: ...
    else:
        def __getattr__(self, member: str) -> Any:
            """Every other member of the adapter protocol, from the loaded adapter (private names are not forwarded)."""
            if member.startswith('_'):
                raise AttributeError(member)
            return getattr(self.loaded, member)


_KIND_BY_CLASS = {'FunctionToolset': 'function', 'MCPToolset': 'mcp', 'DynamicToolset': 'dynamic'}


def leaf_kinds(agent: DurableAgent[Any, Any]) -> list[tuple[str, str]]:
    """`(kind, toolset id)` for every leaf toolset of the definition (kind: `function | mcp | dynamic`), the
    vocabulary of upstream's operation ids."""
    return [
        (_KIND_BY_CLASS.get(plan.kind, 'function'), plan.toolset_id)
        for plans in agent.leaf_plans().values()
        for plan in plans
    ]
