"""`DurableAgent`: one engine-neutral definition of an agent built from (deferred) capabilities."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any, Generic, TypeVar

from pydantic_ai import Agent
from pydantic_ai.capabilities import MCP, AbstractCapability
from pydantic_ai.toolsets import AbstractToolset, CombinedToolset, FunctionToolset

from . import _registry, _upstream
from .aliases import CapabilityAliases
from .engines import ALL_ENGINES, DURABLE_ENGINES, ENGINES
from .ids import LeafPlan, StableIdCapability, id_syntax_error, redact_url, stabilize
from .runbook import runbook_requirements
from .skills import InvalidSkill
from .validation import DurableConfigError, Problem, Report, describe_capability

DepsT = TypeVar('DepsT')
OutputT = TypeVar('OutputT')

_AGENT_TOOLS = '<agent>'


class DurableAgent(Generic[DepsT, OutputT]):
    """An agent definition that runs on any engine, with stable leaf ids and every problem reported at once.

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
        engines: Engines the definition must be valid for, among `'temporal' | 'dbos' | 'prefect'`.
        engine_options: Per engine, keyword arguments for upstream's durability capability
            (`{'temporal': {'toolset_activity_config': {...}}}`), plus ours: `{'dbos': {'tool_steps':
            ToolStepConfig(...) | False}}`.
        aliases: `{current capability or MCP id: previous id}` for renamed capabilities: their leaf
            toolsets keep the ids, and so the durable unit names, they had, so runs recorded under the
            old names still recover (see docs/concepts/lockfile.md).
        previous_names: Earlier names of this agent, newest first. Durable units keep the first one's
            names, and the Temporal and DBOS workflows are also registered under each, so runs in flight
            recover (a Prefect flow run is identified by its cache keys, which the kept names preserve).
        conversation_store: Store URL for runs given a `conversation_id` (default: `$DURCAP_STORE`,
            else SQLite at `.durcap/conversations.db`, resolved where the durable unit runs).
        drift: `'error'` (refuse to resume a conversation whose history loaded a capability or called a
            tool this definition no longer has: DC018 / DC019) or `'warning'` (resume and log it).
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
        deps_type: type[DepsT] = type(None),  # type: ignore[assignment]
        capabilities: Sequence[AbstractCapability[Any]] = (),
        tools: Sequence[Any] = (),
        output_type: Any = str,
        engines: Iterable[str] = DURABLE_ENGINES,
        engine_options: dict[str, dict[str, Any]] | None = None,
        aliases: dict[str, str] | None = None,
        previous_names: Sequence[str] = (),
        conversation_store: str | None = None,
        drift: str = 'error',
        **agent_kwargs: Any,
    ) -> None:
        self.name = name
        self.defined_in, self.defined_at = _registry.defined_in(__name__)  # module name, 'file:line' (for DC011)
        self.model = model
        self.instructions = instructions
        self.deps_type = deps_type
        self.output_type = output_type
        self.tools = list(tools)
        self.engines = tuple(engines)
        self.agent_kwargs = agent_kwargs
        self.engine_options = {k: dict(v) for k, v in (engine_options or {}).items()}
        self.aliases = dict(aliases or {})
        if isinstance(previous_names, str):
            raise TypeError(f'previous_names must be a list of names, not the string {previous_names!r}')
        self.previous_names = list(previous_names)
        self.conversation_store = conversation_store
        if drift not in ('error', 'warning'):
            raise ValueError(f"drift must be 'error' or 'warning', not {drift!r}")
        self.drift = drift
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
        result: dict[str, list[str]] = {}
        for _, scope, plans in self._stabilized.leaves:
            if scope is not None and plans:
                result.setdefault(scope, []).extend(p.toolset_id for p in plans)
        return result

    def leaf_plans(self) -> dict[str, list[LeafPlan]]:
        """Like `leaf_ids`, with how each id was chosen (`explicit`, `capability`, `name`, `position`)."""
        result: dict[str, list[LeafPlan]] = {}
        for _, scope, plans in self._stabilized.leaves:
            if scope is not None and plans:
                result.setdefault(scope, []).extend(plans)
        return result

    @property
    def durable_name(self) -> str:
        """The name durable units are named after: the oldest-kept previous name if any, else `name`."""
        return self.previous_names[0] if self.previous_names else self.name

    def static_tool_names(self) -> list[str]:
        """Tool names known without running anything (agent tools and function toolsets), sorted."""
        names = set(FunctionToolset(self.tools).tools)
        for _, user in self._registered():
            toolset = user.get_toolset()
            if isinstance(toolset, AbstractToolset):
                names.update(_static_tool_names(toolset) or [])
        return sorted(names)

    def tool_names_by_capability(self) -> tuple[dict[str, set[str]], set[str]]:
        """`({tool name: ids of the capabilities defining it}, ids of capabilities whose tools are only known at run time)`.

        Tool names as `static_tool_names` finds them, per registered capability that has an id; agent-level
        tools are not listed. A capability without a toolset (or whose `get_toolset()` raises) is in neither.
        """
        tools: dict[str, set[str]] = {}
        unknown: set[str] = set()
        for cap_id, user in self._registered():
            if cap_id is None:
                continue
            try:
                toolset = user.get_toolset()
            except Exception:  # noqa: BLE001 - reported as DC023 by stabilize
                continue
            if toolset is None:
                continue
            names = _static_tool_names(toolset) if isinstance(toolset, AbstractToolset) else None
            if names is None:  # MCP, a toolset function or another dynamic toolset
                unknown.add(cap_id)
                continue
            for name in names:
                tools.setdefault(name, set()).add(cap_id)
        return tools, unknown

    def capability_ids(self) -> list[str]:
        """Ids of every registered capability (groups and members), in definition order."""
        return [cid for cid, _ in self._registered() if cid is not None]

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
        if engine not in ENGINES:
            raise ValueError(f'unknown engine {engine!r}; expected one of {", ".join(ALL_ENGINES)}')
        if engine in self._built:
            return self._built[engine]
        adapter = ENGINES[engine]
        durability_cls = adapter.durability_class()
        capabilities: list[Any] = list(self._stabilized.capabilities)
        if self.aliases:
            capabilities.append(CapabilityAliases(aliases=self.aliases))
        kwargs, extra = adapter.durability_parts(self, self.engine_options.get(engine, {}))
        capabilities.extend(extra)
        if durability_cls is not None:
            kwargs.setdefault('name', self.durable_name)
            capabilities.append(durability_cls(**kwargs))
        agent: Agent[Any, Any] = Agent(
            self.model,
            name=self.name,
            instructions=self.instructions,
            deps_type=self.deps_type,
            output_type=self.output_type,
            tools=self.tools,
            capabilities=capabilities,
            **self.agent_kwargs,
        )
        self._built[engine] = agent
        return agent

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
        report = Report(
            [
                Problem(
                    'DC012',
                    'error',
                    f'agent {self.name!r}',
                    f'capabilities {names} were passed per run; durable engines register activities, steps '
                    'and tasks when the agent is built, so a per-run capability has none.',
                    f'Attach {names} at construction: `DurableAgent(..., capabilities=[...])`.',
                    self.engines,
                )
            ]
        )
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

        With `conversation_id`, the stored history is loaded first (and checked for drift) and the new
        messages are appended after the run; `message_history` is then ignored.

        Raises:
            DurableConfigError: capabilities passed per run (DC012); drift in the stored history (DC018/DC019).
            ConversationConflictError: another run appended to the conversation meanwhile.
        """
        from .turn import run_turn

        turn = await run_turn(self, self.build('local').run, prompt, deps=deps, message_history=message_history,
                              conversation_id=conversation_id, capabilities=capabilities, **kwargs)
        return turn.result

    # ---- validation -------------------------------------------------------------------------

    def _registered(self) -> list[tuple[str | None, AbstractCapability[Any]]]:
        """Every registered capability of the user's tree as `(id, user capability)`."""
        seen: list[tuple[str | None, AbstractCapability[Any]]] = []

        def visit(capability: AbstractCapability[Any]) -> None:
            user = capability.wrapped if isinstance(capability, StableIdCapability) else capability
            seen.append((capability.id, user))

        for capability in self._stabilized.capabilities:
            capability.apply(visit)
        return seen

    def _validate(self) -> Report:
        report = Report()
        durable = tuple(e for e in self.engines if e in DURABLE_ENGINES)
        for engine in self.engines:
            spec = ENGINES.get(engine)
            if spec is None or engine == 'local':
                if spec is None:
                    report.add(
                        Problem(
                            'DC017',
                            'error',
                            f'agent {self.name!r}',
                            f'engines lists unknown engine {engine!r}.',
                            f'Use engines from {", ".join(DURABLE_ENGINES)}.',
                        )
                    )
                continue
            if not spec.available():
                report.add(
                    Problem(
                        'DC017',
                        'error',
                        f'agent {self.name!r}',
                        f'engine {engine!r} is listed but its packages are not installed.',
                        f'pip install "durable-capabilities[{spec.extra}]", or drop {engine!r} from `engines=`.',
                        (engine,),
                    )
                )
        if (reason := id_syntax_error(self.name)) is not None:
            report.add(
                Problem(
                    'DC002',
                    'error',
                    f'agent {self.name!r}',
                    f'the agent name {reason}; it is part of every durable unit name.',
                    "Use letters, digits, '.', '_' or '-' (no '__'), at most 100 characters.",
                    durable,
                )
            )
        for skill in self._invalid_skills:
            report.add(skill.problem)
        # A deferred capability without an id gets DC001 below; its DC015 (no id for its leaves) is the same fix.
        deferred_without_id = {
            describe_capability(user, None) for cid, user in self._registered() if user.defer_loading and cid is None
        }
        report.extend(
            p if p.engines else _with_engines(p, durable)
            for p in self._stabilized.problems
            if not (p.code == 'DC015' and p.where in deferred_without_id)
        )

        registered = self._registered()
        by_id: dict[str, list[AbstractCapability[Any]]] = defaultdict(list)
        derived: dict[str, list[AbstractCapability[Any]]] = defaultdict(list)
        for cap_id, user in registered:
            where = describe_capability(user, cap_id)
            if user.defer_loading and cap_id is None:
                url_hint = ''
                if isinstance(user, MCP) and user.url:
                    would = _upstream.capability_url_derived_id(user)
                    url_hint = f' (its URL {redact_url(user.url)} would derive {would!r}, which changes with the host)'
                report.add(
                    Problem(
                        'DC001',
                        'error',
                        where,
                        f'`defer_loading=True` but `id` is not set{url_hint}; the message history records loaded '
                        'capabilities by id, so resume and durable units need a stable one.',
                        f"Construct it as `{type(user).__name__}(id='...', defer_loading=True, ...)`.",
                        durable,
                    )
                )
            if cap_id is None:
                continue
            url_derived = isinstance(user, MCP) and _upstream.derived_id_source(user) is not None
            if (reason := id_syntax_error(cap_id)) is not None:
                report.add(
                    Problem(
                        'DC002',
                        'error',
                        where,
                        f'capability id {cap_id!r} {reason}.',
                        "Set `id=` to letters, digits, '.', '_' or '-' (no '__'), at most 100 characters.",
                        durable,
                    )
                )
            if url_derived:
                derived[cap_id].append(user)
                report.add(
                    Problem(
                        'DC006',
                        'warning',
                        where,
                        f'id {cap_id!r} is derived from the URL {redact_url(user.url or "")} and embeds its host; '
                        'moving the server to another host renames its durable units and strands in-flight runs.',
                        f"Pass an explicit id: `MCP(url=..., id='{cap_id.replace('.', '-')}')`.",
                        durable,
                    )
                )
            else:
                by_id[cap_id].append(user)

        collided: set[str] = set()
        for cap_id, users in derived.items():
            if len(users) > 1 or cap_id in by_id:
                collided.add(cap_id)
                urls = ', '.join(sorted({redact_url(u.url or '') for u in users}))  # type: ignore[attr-defined]
                report.add(
                    Problem(
                        'DC005',
                        'error',
                        f'capability {cap_id!r} (MCP)',
                        f'{len(users)} MCP capabilities derive the id {cap_id!r} from their URLs ({urls}); pydantic-ai '
                        '2.68 derives the hostname only, so servers on one host collide.',
                        "Pass a distinct explicit `id=` to each MCP capability.",
                        durable,
                    )
                )
        duplicated_ids: set[str] = set()
        for cap_id, users in by_id.items():
            distinct = list({id(u): u for u in users}.values())
            if len(distinct) > 1:
                duplicated_ids.add(cap_id)
                classes = ', '.join(type(u).__name__ for u in distinct)
                report.add(
                    Problem(
                        'DC003',
                        'error',
                        f'capability {cap_id!r}',
                        f'{len(distinct)} capabilities ({classes}) share the id {cap_id!r}.',
                        'Give each capability a distinct `id=`.',
                        durable,
                    )
                )

        leaf_owner: dict[str, list[str]] = defaultdict(list)
        for user, scope, plans in self._stabilized.leaves:
            for plan in plans:
                leaf_owner[plan.toolset_id].append(describe_capability(user, scope))
                # A leaf named after its capability repeats the capability id's DC002; report it once.
                if (reason := id_syntax_error(plan.toolset_id)) is not None and plan.toolset_id != scope:
                    report.add(
                        Problem(
                            'DC002',
                            'error',
                            describe_capability(user, scope),
                            f'leaf toolset id {plan.toolset_id!r} ({plan.kind}) {reason}.',
                            'Set a safe `id=` on the toolset, or a shorter capability id.',
                            durable,
                        )
                    )
        for toolset_id, owners in leaf_owner.items():
            # Leaves named after a duplicated capability id repeat DC003; report it once.
            if len(owners) > 1 and toolset_id not in duplicated_ids and toolset_id not in collided:
                report.add(
                    Problem(
                        'DC004',
                        'error',
                        f'leaf toolset {toolset_id!r}',
                        f'{len(owners)} leaf toolsets have the id {toolset_id!r} ({"; ".join(owners)}); they would '
                        'share one set of durable units.',
                        'Give the toolsets (or their capabilities) distinct ids.',
                        durable,
                    )
                )

        report.extend(self._tool_checks(registered, durable))
        return report

    def _tool_checks(self, registered: list[tuple[str | None, AbstractCapability[Any]]], durable: tuple[str, ...]) -> list[Problem]:
        problems: list[Problem] = []
        # First owner per tool name; a list only for names seen twice (10,000 tools stay linear).
        first: dict[str, tuple[str | None, AbstractCapability[Any] | None]] = {}
        owners: dict[str, list[str]] = {}
        all_static = True
        for tool_name in FunctionToolset(self.tools).tools:
            first[tool_name] = (_AGENT_TOOLS, None)
        for cap_id, user in registered:
            try:
                toolset = user.get_toolset()
            except Exception:  # noqa: BLE001 - reported as DC023 by stabilize
                toolset = None
            if toolset is None:
                continue
            names = _static_tool_names(toolset) if isinstance(toolset, AbstractToolset) else None
            if names is None:
                all_static = False
                continue
            for tool_name in names:
                seen = first.get(tool_name)
                if seen is None:
                    first[tool_name] = (cap_id, user)
                elif seen[1] is not user:
                    label = describe_capability(user, cap_id)
                    shown = owners.setdefault(tool_name, [_label(seen, self.name)])
                    if label not in shown:
                        shown.append(label)
        reserved = _upstream.LOAD_CAPABILITY_TOOL_NAME
        if reserved in first:
            problems.append(
                Problem(
                    'DC008',
                    'error',
                    _label(first[reserved], self.name),
                    '`load_capability` is reserved: pydantic-ai adds it whenever a capability is deferred.',
                    'Rename the tool (`@toolset.tool(name=...)` or rename the function).',
                    durable,
                )
            )
        for tool_name, labels in owners.items():
            if len(labels) > 1:
                shown = ', '.join(labels)
                problems.append(
                    Problem(
                        'DC007',
                        'error',
                        f'tool {tool_name!r}',
                        f'the tool name {tool_name!r} is exposed by {shown}; the model cannot tell them apart.',
                        'Rename one of the tools, or prefix a capability\'s tools (`PrefixTools`).',
                        durable,
                    )
                )
        known_caps = {cid for cid, _ in registered if cid is not None}
        for cap_id, user in registered:
            requirements = runbook_requirements(user)
            if requirements is None:
                continue
            where = describe_capability(user, cap_id)
            for tool_name, required in sorted(requirements.items()):
                if required not in known_caps:
                    problems.append(
                        Problem(
                            'DC009',
                            'error',
                            where,
                            f'requirements[{tool_name!r}] names capability {required!r}, which this agent does not have.',
                            f'Add the runbook capability with id {required!r}, or fix the id '
                            f'(known: {", ".join(sorted(known_caps)) or "none"}).',
                            durable,
                        )
                    )
                if tool_name not in first:
                    problems.append(
                        Problem(
                            'DC010',
                            'error' if all_static else 'warning',
                            where,
                            f'requirements names tool {tool_name!r}, which no capability or agent tool defines'
                            + ('' if all_static else ' statically (MCP or dynamic toolsets may still provide it)')
                            + '.',
                            'Fix the tool name, or add the tool.',
                            durable,
                        )
                    )
        return problems


def _label(seen: tuple[str | None, AbstractCapability[Any] | None], agent_name: str) -> str:
    cap_id, user = seen
    return f'agent {agent_name!r} tools' if user is None else describe_capability(user, cap_id)


def _with_engines(problem: Problem, engines: tuple[str, ...]) -> Problem:
    return Problem(problem.code, problem.severity, problem.where, problem.message, problem.fix, engines)


def _static_tool_names(toolset: AbstractToolset[Any]) -> list[str] | None:
    """Tool names known without running anything, or `None` when some part is dynamic (MCP, functions)."""
    if isinstance(toolset, FunctionToolset):
        return list(toolset.tools)
    if isinstance(toolset, CombinedToolset):
        names: list[str] = []
        for child in toolset.toolsets:
            child_names = _static_tool_names(child)
            if child_names is None:
                return None
            names.extend(child_names)
        return names
    return None


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
