"""`DurableAgent`: one engine-neutral definition of an agent built from (deferred) capabilities."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, Generic, Literal, TypeVar

from pydantic_ai import Agent
from pydantic_ai.capabilities import AbstractCapability
from pydantic_ai.toolsets import FunctionToolset

from . import _hooks, _registry, telemetry
from ._limits import InputError
from ._turn_log import TurnRecorder, may_rewrite_history
from .aliases import CapabilityAliases
from .approvals import timeout_seconds
from .budget import RAISE_TOOL, Budget
from .checks import CheckContext, run_checks
from .ids import LeafPlan, stabilize
from .skills import InvalidSkill
from .validation import DurableConfigError, Report, problem

DepsT = TypeVar('DepsT')
OutputT = TypeVar('OutputT')


def text_output_type(output_type: Any) -> bool:
    """Whether an agent with `output_type` may end with plain text (`str`, or a list of output types holding `str`):
    the agents a turn can interrupt (`busy='interrupt'`), since an interrupted turn ends with a text answer."""
    return output_type is str or (isinstance(output_type, list | tuple) and str in output_type)


class DurableAgent(Generic[DepsT, OutputT]):
    """An agent definition that runs on any engine, with stable leaf ids and every problem reported at once.

    A definition, in the core layer: it imports no engine and no runner. What it needs of them, the engine registry
    (for `build` and the checks) and the in-process turn (for `run`), it reads from `_hooks`, which the package fills
    when it is imported (`durable_capabilities/__init__.py`); an engine's quirks arrive as data of its registry entry.

    Args:
        name: Agent name. It is part of every durable unit name (`agent__{name}__...` on Temporal,
            `{name}__...` on DBOS), so it follows the id syntax (see `ids.id_syntax_error`).
        model: A pydantic-ai model name (`'openai-responses:gpt-5.4'`) or `Model` instance.
        instructions: The agent's always-on instructions.
        deps_type: Type of the run dependencies (`ctx.deps`).
        capabilities: Capability instances; deferred ones (`defer_loading=True`) need an explicit id.
            Outputs of `load_skills()` may be mixed in; a malformed skill file becomes problem DC016.
        tools: Agent-level tools (functions or `Tool`s), always visible.
        output_type: Passed through to `pydantic_ai.Agent`.
        engines: Engines the definition must be valid for, among the registered durable engines (`'temporal' |
            'dbos' | 'prefect'`). Default: those whose extra is installed here, so `pip install
            'durable-capabilities[dbos]'` alone gives valid definitions; an engine listed explicitly whose extra is
            missing is DC017.
        engine_options: Per engine, keyword arguments for upstream's durability capability
            (`{'temporal': {'toolset_activity_config': {...}}}`), plus ours: `{'dbos': {'tool_steps':
            ToolStepConfig(...) | False}}`.
        aliases: `{current capability or MCP id: previous id}` for renamed capabilities: their leaf
            toolsets keep the ids, and so the durable unit names, they had, so runs recorded under the
            old names still recover (see docs/concepts/lockfile.md).
        previous_names: Earlier names of this agent, newest first. Durable units keep the first one's
            names (so does the `pydantic_ai.Agent` built for a durable engine: Prefect's task cache keys hash
            its name), and the Temporal and DBOS workflows are also registered under each, so runs in flight
            recover; DBOS's application version does not change (`engines.dbos.application_version`).
        conversation_store: Store URL for runs given a `conversation_id` (default: `$DURCAP_STORE`,
            else SQLite at `.durcap/conversations.db`, resolved where the durable unit runs).
        drift: `'error'` (refuse to resume a conversation whose history loaded a capability or called a
            tool this definition no longer has: DC018 / DC019) or `'warning'` (resume and log it).
        approval_timeout: How long a tool call that needs approval (`ApprovalRequired`, `requires_approval=True`)
            waits for a person in a durable run, as a `timedelta` or seconds (default 24 hours); then it is
            denied with a reason the model sees (see `approvals`).
        busy: What a turn does when another run's turn holds its conversation (one turn at a time per
            conversation): `'reject'` (the default: refused before any side effect, `ConversationBusyError`, DC050,
            naming the run that holds it), `'enqueue'` (waits until that turn is stored, then runs on top of it) or
            `'interrupt'` (asks that turn to stop at its next safe point, then waits for it as `'enqueue'` does; only
            for an agent whose output may be text, else `InputError` DC053). A run's own `busy=` (`durcap run
            --busy`) wins.
        budget: Spend limits checked before every model request on every engine, counted in the conversation store
            (`Budget`, docs/budgets.md); `None`: none.
        agent_kwargs: Any other `pydantic_ai.Agent` keyword argument (`retries`, `model_settings`, ...).

    Raises:
        DurableConfigError: when the report holds at least one error; `.report` holds every problem.
    """

    def __init__(
        self,
        name: str,
        model: Any,
        *,
        instructions: Any = None,
        deps_type: type[DepsT] = type(None),  # type: ignore[assignment]  # noqa: B008 - the NoneType class itself
        capabilities: Sequence[AbstractCapability[Any]] = (),
        tools: Sequence[Any] = (),
        output_type: Any = str,
        engines: Iterable[str] | None = None,
        engine_options: dict[str, dict[str, Any]] | None = None,
        aliases: dict[str, str] | None = None,
        previous_names: Sequence[str] = (),
        conversation_store: str | None = None,
        drift: Literal['error', 'warning'] = 'error',
        approval_timeout: Any = None,
        busy: Literal['reject', 'enqueue', 'interrupt'] = 'reject',
        budget: Budget | None = None,
        **agent_kwargs: Any,
    ) -> None:
        self.name = name
        self.defined_in, self.defined_at = _registry.defined_in(__name__)  # module name, 'file:line' (for DC011)
        self.model = model
        self.instructions = instructions
        self.deps_type = deps_type
        self.output_type = output_type
        self.tools = list(tools)
        self.engines = tuple(engines) if engines is not None else _hooks.installed_durable_engines()
        self.agent_kwargs = agent_kwargs
        self.engine_options = {k: dict(v) for k, v in (engine_options or {}).items()}
        self.aliases = dict(aliases or {})
        if isinstance(previous_names, str):
            raise TypeError(f'previous_names must be a list of names, not the string {previous_names!r}')
        self.previous_names = list(previous_names)
        self.conversation_store = conversation_store
        if drift not in ('error', 'warning'):
            raise ValueError(f"drift must be 'error' or 'warning', not {drift!r}")
        self.drift: Literal['error', 'warning'] = drift
        self.approval_timeout = timeout_seconds(approval_timeout)
        if busy not in ('reject', 'enqueue', 'interrupt'):
            raise ValueError(f"busy must be 'reject', 'enqueue' or 'interrupt', not {busy!r}")
        if busy == 'interrupt' and not text_output_type(output_type):
            raise InputError('busy', f"'interrupt' cannot be used for agent {name!r}: its output type is "
                             f"{getattr(output_type, '__name__', None) or output_type!r}, and an interrupted turn ends "
                             "with a text answer saying so. Use busy='enqueue' (wait for the turn that holds the "
                             "conversation) or 'reject', or an output type that allows text (output_type=[YourType, str])",
                             code='DC053')
        self.busy: Literal['reject', 'enqueue', 'interrupt'] = busy
        if budget is not None and not isinstance(budget, Budget):
            raise TypeError(f'budget must be a durable_capabilities.Budget, not {type(budget).__name__}')
        self.budget = budget
        self._invalid_skills = [c for c in capabilities if isinstance(c, InvalidSkill)]
        self.user_capabilities = [c for c in capabilities if not isinstance(c, InvalidSkill)]
        self._stabilized = stabilize(self.user_capabilities, self.aliases)
        self._built: dict[str, Agent[Any, Any]] = {}
        self._report = self._validate()
        if not _registry.collect(self) and not self._report.ok:  # `targets.load` collects instead of raising
            raise DurableConfigError(self._report, f'DurableAgent {name!r}')

    def __repr__(self) -> str:
        return f'DurableAgent({self.name!r}, engines={self.engines!r})'

    # ---- public API -------------------------------------------------------------------------

    @property
    def capabilities(self) -> list[AbstractCapability[Any]]:
        """The capabilities handed to `pydantic_ai.Agent`: the user's, wrapped so every leaf has a stable id."""
        return list(self._stabilized.capabilities)

    def report(self) -> Report:
        """Every problem found at construction (warnings included). Never raises."""
        return Report(list(self._report.problems))

    def leaf_ids(self) -> dict[str, list[str]]:
        """`{capability id: [leaf toolset ids]}` in definition order; agent-level tools are not listed."""
        return {cap_id: [p.toolset_id for p in plans] for cap_id, plans in self.leaf_plans().items()}

    def leaf_plans(self) -> dict[str, list[LeafPlan]]:
        """Like `leaf_ids`, with how each id was chosen (`explicit`, `capability`, `name`, `position`)."""
        result: dict[str, list[LeafPlan]] = {}
        for planned in self._stabilized.planned:
            if planned.owner is not None and planned.plans:
                result.setdefault(planned.owner, []).extend(planned.plans)
        return result

    @property
    def durable_name(self) -> str:
        """The name durable units are named after: the oldest-kept previous name if any, else `name`."""
        return self.previous_names[0] if self.previous_names else self.name

    def static_tool_names(self) -> list[str]:
        """Tool names known without running anything (agent tools and function toolsets), sorted."""
        names = set(FunctionToolset(self.tools).tools)
        if self.budget is not None:  # its approvals' calls are stored in the history (`budget.RAISE_TOOL`)
            names.add(RAISE_TOOL)
        for walk in self._stabilized.registered:
            names.update(walk.tool_names or [])
        return sorted(names)

    def tool_schema(self, name: str) -> dict[str, Any] | None:
        """The parameters JSON schema of tool `name` when the definition knows it without running anything (agent
        tools and function toolsets of capabilities), else `None` (MCP and other dynamic toolsets)."""
        toolsets = [FunctionToolset(self.tools), *(leaf for walk in self._stabilized.registered for leaf in walk.leaves)]
        for toolset in toolsets:
            if isinstance(toolset, FunctionToolset) and name in toolset.tools:
                return dict(toolset.tools[name].function_schema.json_schema)
        return None

    def tool_names_by_capability(self) -> tuple[dict[str, set[str]], set[str]]:
        """`({tool name: ids of the capabilities defining it}, ids of capabilities whose tools are only known at run time)`.

        Tool names as `static_tool_names` finds them, per registered capability that has an id; agent-level
        tools are not listed. A capability without a toolset (or whose `get_toolset()` raised) is in neither.
        """
        tools: dict[str, set[str]] = {}
        unknown: set[str] = set()
        for walk in self._stabilized.registered:
            if walk.cap_id is None or walk.toolset is None:
                continue
            names = walk.tool_names
            if names is None:  # MCP, a toolset function or another dynamic toolset
                unknown.add(walk.cap_id)
                continue
            for name in names:
                tools.setdefault(name, set()).add(walk.cap_id)
        return tools, unknown

    def capability_ids(self) -> list[str]:
        """Ids of every registered capability (groups and members), in definition order."""
        return [walk.cap_id for walk in self._stabilized.registered if walk.cap_id is not None]

    @property
    def records_turn(self) -> bool:
        """Whether built agents carry `TurnRecorder`: when a capability could rewrite the run's message list
        (`_turn_log.may_rewrite_history`) or `history_processors` are given. Otherwise the run's final
        `all_messages()` already holds every message the turn added."""
        return bool(self.agent_kwargs.get('history_processors')) or any(
            may_rewrite_history(c) for c in self._stabilized.capabilities)

    def build(self, engine: str = 'local') -> Agent[Any, Any]:
        """The `pydantic_ai.Agent` for `engine`, with upstream's durability capability attached.

        Args:
            engine: `'local'` (no durability) or one of `'temporal' | 'dbos' | 'prefect'`.

        Returns:
            The same `Agent` on every call for one engine: DBOS registers its steps globally when the
            agent is constructed, so building twice would register them twice.

        Raises:
            ValueError: unknown engine.
            ImportError: the engine's extra (`durable-capabilities[temporal]`, ...) is not installed.
        """
        entries = _hooks.engines()
        if engine not in entries:
            raise ValueError(f'unknown engine {engine!r}; expected one of {", ".join(entries)}')
        if engine in self._built:
            return self._built[engine]
        adapter = entries[engine]
        durability_cls = adapter.durability_class()
        # Outermost: records each message the run adds before a history processor can rewrite the list; left out
        # when nothing in the agent could rewrite it (the run's final messages are then the whole turn).
        capabilities: list[Any] = list(self._stabilized.capabilities)
        if self.records_turn:
            capabilities.insert(0, TurnRecorder())
        if self.aliases:
            capabilities.append(CapabilityAliases(aliases=self.aliases))
        kwargs, extra = adapter.durability_parts(self, self.engine_options.get(engine, {}))
        capabilities.extend(extra)
        if durability_cls is not None:
            kwargs.setdefault('name', self.durable_name)
            capabilities.append(durability_cls(**kwargs))
        traced = telemetry.enabled()  # spans where the units execute (telemetry.py); nothing added when off
        # Outside the budget: a turn asked to stop sends no request and reserves nothing (`interrupts`).
        model = _hooks.wrap_interrupt(_hooks.wrap_budget(_hooks.wrap_model(self.model, adapter.features), self), self)
        agent: Agent[Any, Any] = Agent(
            telemetry.wrap_model(model, self.name) if traced else model,
            # Durable engines see the kept name: Prefect's task cache keys hash the agent name (`ctx.agent.name`),
            # so a renamed agent with `previous_names` replays the finished tasks of a run in flight.
            name=self.durable_name if durability_cls is not None else self.name,
            instructions=self.instructions,
            deps_type=self.deps_type,
            output_type=self.output_type,
            tools=[*self.tools, *_hooks.budget_tools(self)],
            capabilities=capabilities,
            **self.agent_kwargs,
        )
        if traced:
            telemetry.trace_agent_tools(agent, capabilities, self.name)
        self._built[engine] = agent
        return agent

    def replace_model(self, model: Any) -> None:
        """Use `model` (a pydantic-ai model name or `Model`) from now on, e.g. `durcap run --model`; agents already built
        are dropped and built again on their next use.

        Raises:
            RuntimeError: the agent was already built for an engine that registers its model process-wide (its
                registry entry has the `_hooks.FIXED_MODEL` feature: DBOS registers its steps with the first model).
        """
        entries = _hooks.engines()
        fixed = [e for e in self._built if e in entries and _hooks.FIXED_MODEL in entries[e].features]
        if fixed:
            raise RuntimeError(f'{self.name!r}: the model cannot change after the {fixed[0]} agent was built')
        self.model = model
        self._built.clear()

    def check_run_capabilities(self, capabilities: Sequence[Any] | None) -> None:
        """Reject capabilities passed per run (problem DC012), naming their ids.

        Raises:
            DurableConfigError: when `capabilities` is non-empty.
        """
        if not capabilities:
            return
        names = ', '.join(
            repr(getattr(c, 'id', None)) if getattr(c, 'id', None) else f'<{type(c).__name__} without id>'
            for c in capabilities
        )
        report = Report([problem('DC012', f'agent {self.name!r}', self.engines, names=names)])
        raise DurableConfigError(report, f'run of {self.name!r}')

    async def run(
        self,
        prompt: str | None = None,
        *,
        deps: Any = None,
        message_history: Any = None,
        conversation_id: str | None = None,
        capabilities: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run in-process on the local engine (no durability); returns upstream's `AgentRunResult`.

        A thin call into `runner.run_in_process` (through `_hooks`): the turn lives above core. With
        `conversation_id`, the stored history is loaded first (and checked for drift) and the new messages are
        appended after the run; `message_history` is then ignored.

        Raises:
            DurableConfigError: capabilities passed per run (DC012); drift in the stored history (DC018/DC019).
            ConversationConflictError: another run appended to the conversation meanwhile.
        """
        return await _hooks.run_in_process()(self, prompt, deps=deps, message_history=message_history,
                                             conversation_id=conversation_id, capabilities=capabilities, **kwargs)

    # ---- validation -------------------------------------------------------------------------

    def _validate(self) -> Report:
        """Every problem of this definition: each check of `checks.CHECKS` over one shared context."""
        return run_checks(
            CheckContext(
                self.name, self.engines, _hooks.engines(), _hooks.durable_engines(), self.tools, self._invalid_skills,
                self._stabilized,
            )
        )


def validate_together(agents: Sequence[DurableAgent[Any, Any]]) -> Report:
    """The problems of several definitions registered in one worker or app, plus duplicate names (DC011).

    Different objects sharing a name are DC011, naming the module each was defined in; the same object
    listed twice is not. Upstream notices duplicate agent names only at Temporal `Worker(...)`, logs a
    warning on DBOS and never on Prefect; here it is an error for every engine.
    """
    report = Report()
    by_name: dict[str, dict[int, DurableAgent[Any, Any]]] = defaultdict(dict)
    for agent in agents:
        if id(agent) not in by_name[agent.name]:
            report.extend(agent.report())
        by_name[agent.name][id(agent)] = agent
    for name, distinct in by_name.items():
        if len(distinct) > 1:
            report.add(_registry.duplicate_name_problem(name, list(distinct.values()), 'registered together'))
    return report
