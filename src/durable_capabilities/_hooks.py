"""What core asks of the layers above it, as hooks those layers fill once, at package import.

`DurableAgent` is a definition (core): it validates against the registered engines and builds upstream's `Agent`
with an engine's durability capability, and `DurableAgent.run` runs one in-process turn. The engine registry lives
in the engines layer and the turn in `turn.py`, both above core, so core does not import them: it reads them here,
and `durable_capabilities/__init__.py` (the composition root, which every import of the package runs first) installs
`engines.ENGINES` and `runner.run_in_process`. Core therefore imports nothing above itself, with no import hidden
in a function to dodge a cycle.

An engine's quirks reach core as data of its registry entry, never as its name: `FIXED_MODEL` in `features` says
the engine registers the built agent's model process-wide, so `DurableAgent.replace_model` refuses once it is built.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

FIXED_MODEL = 'fixed-model'
STREAMS = 'streams'
"""Feature of an engine whose runs publish their events to the run's stream: its built agent's model is wrapped by the
installed `wrap_model` (`streams.StreamingModel`, which publishes from inside the model request unit)."""
"""Feature of an engine whose built agent registers its model process-wide (DBOS registers its steps when the agent
is constructed): the model cannot change afterwards."""


class EngineEntry(Protocol):
    """What core reads of a registered engine (`engines.EngineAdapter` and `LazyAdapter` satisfy it)."""

    @property
    def name(self) -> str: ...
    @property
    def durable(self) -> bool: ...
    @property
    def extra(self) -> str | None: ...
    @property
    def features(self) -> frozenset[str]: ...
    @property
    def spec(self) -> Any: ...  # engines._protocol.EngineSpec (checks read what they need of it)

    def available(self) -> bool: ...

    def durability_class(self) -> Callable[..., Any] | None: ...

    def durability_parts(self, agent: Any, options: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]: ...


RunInProcess = Callable[..., Awaitable[Any]]
"""`run_in_process(agent, prompt, **kwargs) -> AgentRunResult`: one local turn (`runner.run_in_process`)."""

_engines: Mapping[str, EngineEntry] | None = None
_run_in_process: RunInProcess | None = None
_wrap_model: Callable[[Any], Any] | None = None
_wrap_budget: Callable[[Any, Any], Any] | None = None
_budget_tools: Callable[[Any], list[Any]] | None = None
_wrap_interrupt: Callable[[Any, Any], Any] | None = None


def install(*, engines: Mapping[str, EngineEntry], run_in_process: RunInProcess,
            wrap_model: Callable[[Any], Any] | None = None, wrap_budget: Callable[[Any, Any], Any] | None = None,
            budget_tools: Callable[[Any], list[Any]] | None = None,
            wrap_interrupt: Callable[[Any, Any], Any] | None = None) -> None:
    """Fill the hooks (called once, by `durable_capabilities/__init__.py`; calling again replaces them).

    Args:
        engines: The live engine registry, `{name: entry}` (`engines.ENGINES`; `engines.register` adds to it later).
        run_in_process: The in-process turn `DurableAgent.run` calls.
        wrap_model: Wraps the model of an agent built for an engine with the `STREAMS` feature (`None`: not wrapped).
        wrap_budget: `(model, definition) -> model` enforcing the definition's `Budget` inside the model request
            unit (`budgets.wrap_budget`).
        budget_tools: `definition -> [Tool]` the built agent gets for its `Budget` (`budgets.budget_tools`).
        wrap_interrupt: `(model, definition) -> model` checking inside the model request unit whether a newer turn
            asked the run's turn to stop (`interrupts.wrap_interrupt`, `busy='interrupt'`).
    """
    global _engines, _run_in_process, _wrap_model, _wrap_budget, _budget_tools, _wrap_interrupt
    _engines, _run_in_process, _wrap_model, _wrap_budget = engines, run_in_process, wrap_model, wrap_budget
    _budget_tools, _wrap_interrupt = budget_tools, wrap_interrupt


def budget_tools(agent: Any) -> list[Any]:
    """The tools the agent built for `agent` (a `DurableAgent`) gets for its `budget` (none without one)."""
    if _budget_tools is None or getattr(agent, 'budget', None) is None:
        return []
    return _budget_tools(agent)


def wrap_budget(model: Any, agent: Any) -> Any:
    """`model` as the agent built for `agent` (a `DurableAgent`) gets it: wrapped by the installed `wrap_budget` when
    the definition has a `budget`, else as given."""
    if _wrap_budget is None or getattr(agent, 'budget', None) is None or model is None:
        return model
    return _wrap_budget(model, agent)


def wrap_interrupt(model: Any, agent: Any) -> Any:
    """`model` as the agent built for `agent` (a `DurableAgent`) gets it: wrapped by the installed `wrap_interrupt`
    (which leaves the model of an agent whose output cannot be text as given)."""
    if _wrap_interrupt is None or model is None:
        return model
    return _wrap_interrupt(model, agent)


def wrap_model(model: Any, features: frozenset[str]) -> Any:
    """`model` as the agent built for an engine with `features` gets it: wrapped by the installed `wrap_model` when
    the engine has the `STREAMS` feature, else as given."""
    if _wrap_model is None or STREAMS not in features or model is None:
        return model
    return _wrap_model(model)


def engines() -> Mapping[str, EngineEntry]:
    """The engine registry installed by the package (live).

    Raises:
        RuntimeError: nothing was installed (only when `durable_capabilities/__init__.py` did not run, which an
            import of any module of the package prevents).
    """
    if _engines is None:
        raise RuntimeError('durable_capabilities: the engine registry is not installed (import durable_capabilities)')
    return _engines


def durable_engines() -> tuple[str, ...]:
    """Names of the registered durable engines, in registration order."""
    return tuple(name for name, entry in engines().items() if entry.durable)


def installed_durable_engines() -> tuple[str, ...]:
    """Names of the registered durable engines whose extra is installed here (`DurableAgent(engines=...)`'s default)."""
    return tuple(name for name, entry in engines().items() if entry.durable and entry.available())


def run_in_process() -> RunInProcess:
    """The in-process turn installed by the package.

    Raises:
        RuntimeError: nothing was installed (see `engines`).
    """
    if _run_in_process is None:
        raise RuntimeError('durable_capabilities: the in-process runner is not installed (import durable_capabilities)')
    return _run_in_process
