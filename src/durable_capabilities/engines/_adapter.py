"""The engine adapter protocol: everything the rest of the package asks of an engine.

One module per engine implements it (`local.py`, `temporal.py`, `dbos.py`, `prefect.py`) and
exposes the instance as `ADAPTER`; `engines/__init__.py` registers each one with one line. The CLI,
the runner, the lockfile, replay and the MCP guard look engines up by name and never name one.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..agent import DurableAgent
    from ..approvals import Decision, PendingCall
    from ..turn import RunReport


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


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
    """

    deps: Any = None
    message_history: Sequence[Any] | None = None
    conversation_id: str | None = None
    run_id: str | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
    notify: Callable[[str], None] = _stderr

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
            and `replayer` for `durcap replay`).
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

    def durability_class(self) -> Callable[..., Any] | None:
        """Upstream's durability capability class (`None`: the agent is built without one, as locally).

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

    def run_notes(self, options: RunOptions) -> list[str]:
        """Lines `durcap run` prints before the run (e.g. which store a remote worker uses)."""
        return []

    def serve_worker(self, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
        """Serve `agents` (already validated and checked against the lock) until SIGTERM / SIGINT, then drain.

        `options.settings`: `address`, `task_queue`, `namespace`, `graceful_shutdown` (seconds); `options.notify`
        gets the ready line. Only for engines with the `'worker'` feature.

        Raises:
            OSError / RuntimeError: the worker cannot reach its server.
        """
        raise NotImplementedError(f'engine {self.name!r} has no worker')

    def serve_dev_server(self, port: int, state_dir: Any, notify: Callable[[str], None]) -> None:
        """Run the engine's local development server on `port` (state in `state_dir`) until SIGTERM / Ctrl-C.

        Raises:
            FileNotFoundError / RuntimeError / TimeoutError: the server cannot start or exited (message: one line).
        """
        raise NotImplementedError(f'engine {self.name!r} has no dev server')

    def serve_schedule(
        self, agent: DurableAgent[Any, Any], *, target: str, prompt: str, cron: str | None, interval_seconds: float | None,
        deps: Any, deployment_name: str | None, notify: Callable[[str], None],
    ) -> None:
        """Serve scheduled runs of `agent` (loaded in each run's process from `target`) until interrupted.

        `deps` is JSON data; exactly one of `cron` and `interval_seconds` is set.
        """
        raise NotImplementedError(f'engine {self.name!r} has no schedules')

    async def export_history(self, run_id: str, output: Any, settings: Mapping[str, Any]) -> Any:
        """Write a recorded run's history to `output` (for `durcap replay`); returns the path written."""
        raise NotImplementedError(f'engine {self.name!r} records no history to export')

    def replayer(self, agents: Sequence[DurableAgent[Any, Any]], *, store: str | None = None) -> Any | None:
        """For engines whose recorded histories can be replayed against the code (payloads stored by reference
        read from the conversation store `store`), an object with
        `async replay(history_json: dict, workflow_id: str) -> str | None` (the engine's failure text, `None` when
        it replays) and `explain(failure_text) -> str` (what changed, naming the capability or agent, and the fix);
        `None` otherwise."""
        return None

    async def pending_approvals(self, settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
        """Tool calls waiting for a person in the engine's runs (only `run_id`'s when given), from outside the
        runs (a client). `settings` as `RunOptions.settings` (`address`, `namespace`, `db`). Durable runs wait in
        the engine's `approvals.ApprovalGate`, which the engine's container passes to `turn.run_turn`."""
        return []

    async def decide(self, run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
        """Deliver `decision` to the waiting run `run_id`, after checking it against the run's pending calls.

        Returns:
            The pending call decided.

        Raises:
            approvals.ApprovalError: unknown run, unknown call, stale fingerprint (nothing was delivered).
        """
        from ..approvals import ApprovalError

        raise ApprovalError('unknown-run', f'engine {self.name!r} runs do not wait for approval')

    @abstractmethod
    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        """Run one turn of `agent` on the engine and report what it recorded.

        Raises:
            DurableConfigError: the definition or the stored history has errors.
            Exception: whatever the engine raised when the run failed.
        """


class LazyAdapter(EngineAdapter):
    """A registry entry that imports its engine module (and SDK) only when something beyond the name is asked.

    Args:
        name: The engine's name.
        module: The module holding the adapter as `ADAPTER`.
        extra / requires / durable / features: As `EngineAdapter` (known without importing `module`).
    """

    def __init__(
        self, name: str, module: str, *, extra: str | None = None, requires: str | None = None, durable: bool = True,
        features: frozenset[str] = frozenset(),
    ):
        self.name, self.module, self.extra, self.requires = name, module, extra, requires
        self.durable, self.features = durable, frozenset(features)

    @property
    def loaded(self) -> EngineAdapter:
        """The engine module's `ADAPTER`.

        Raises:
            ImportError: the engine's extra is not installed.
        """
        return importlib.import_module(self.module).ADAPTER

    # The engine's words and lock sections live in its module: read them there (the base class has defaults).
    unit = property(lambda self: self.loaded.unit)  # type: ignore[assignment]
    units = property(lambda self: self.loaded.units)  # type: ignore[assignment]
    container = property(lambda self: self.loaded.container)  # type: ignore[assignment]
    run_id_label = property(lambda self: self.loaded.run_id_label)  # type: ignore[assignment]
    lock_sections = property(lambda self: self.loaded.lock_sections)  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f'LazyAdapter({self.name!r}, {self.module!r})'

    def durability_class(self) -> Callable[..., Any] | None:
        return self.loaded.durability_class()

    def durability_parts(self, agent: DurableAgent[Any, Any], options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
        return self.loaded.durability_parts(agent, options)

    def durable_names(self, agent: DurableAgent[Any, Any]) -> dict[str, list[str]]:
        return self.loaded.durable_names(agent)

    def conversation_units(self, agent: DurableAgent[Any, Any]) -> list[str]:
        return self.loaded.conversation_units(agent)

    def mcp_retry_hint(self, leaf_id: str) -> str | None:
        return self.loaded.mcp_retry_hint(leaf_id)

    def mcp_passes_through(self, error: BaseException) -> bool:
        return self.loaded.mcp_passes_through(error)

    def mcp_upstream_schedule(self) -> bool:
        return self.loaded.mcp_upstream_schedule()

    def run_notes(self, options: RunOptions) -> list[str]:
        return self.loaded.run_notes(options)

    def serve_worker(self, agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
        return self.loaded.serve_worker(agents, options)

    def serve_dev_server(self, port: int, state_dir: Any, notify: Callable[[str], None]) -> None:
        return self.loaded.serve_dev_server(port, state_dir, notify)

    def serve_schedule(self, agent: DurableAgent[Any, Any], **kwargs: Any) -> None:
        return self.loaded.serve_schedule(agent, **kwargs)

    async def export_history(self, run_id: str, output: Any, settings: Mapping[str, Any]) -> Any:
        return await self.loaded.export_history(run_id, output, settings)

    def replayer(self, agents: Sequence[DurableAgent[Any, Any]], *, store: str | None = None) -> Any | None:
        return self.loaded.replayer(agents, store=store)

    async def pending_approvals(self, settings: Mapping[str, Any], run_id: str | None = None) -> list[PendingCall]:
        return await self.loaded.pending_approvals(settings, run_id)

    async def decide(self, run_id: str, decision: Decision, settings: Mapping[str, Any]) -> PendingCall:
        return await self.loaded.decide(run_id, decision, settings)

    async def run(self, agent: DurableAgent[Any, Any], prompt: str | None, options: RunOptions) -> RunReport:
        return await self.loaded.run(agent, prompt, options)


_KIND_BY_CLASS = {'FunctionToolset': 'function', 'MCPToolset': 'mcp', 'DynamicToolset': 'dynamic'}


def leaf_kinds(agent: DurableAgent[Any, Any]) -> list[tuple[str, str]]:
    """`(kind, toolset id)` for every leaf toolset of the definition (kind: `function | mcp | dynamic`), the
    vocabulary of upstream's operation ids."""
    return [
        (_KIND_BY_CLASS.get(plan.kind, 'function'), plan.toolset_id)
        for plans in agent.leaf_plans().values()
        for plan in plans
    ]
