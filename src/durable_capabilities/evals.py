"""Evals from recorded turns: `durcap history evals ID... --out FILE` (issue 28 item 5).

Every stored turn of a conversation becomes one case of a pydantic-evals `Dataset`:

- inputs (`TurnInputs`): the turn's user prompt, the message history before it (pydantic-ai message JSON) and the
  capabilities that history loaded (what the agent starts the turn with, rebuilt as on any resume);
- expected output (`TurnOutcome`): the stored answer (the last model response's text, or the arguments of its
  output tool call) and every tool call the model made in the turn (name and arguments, in order; the budget's
  `durcap_raise_budget` calls left out: the model never made them);
- metadata: the conversation, the turn's number, the model that answered, the turn's usage.

A turn starts at each model request that carries a user prompt, so a turn stored in two writes (Temporal's
continue-as-new) is one case, and a fork's kept prefix splits into the turns it holds.

The file is pydantic-evals' own (`Dataset.to_file`: YAML or JSON by the file's suffix, with its JSON schema beside
it) and carries the `EqualsExpected` evaluator, so a team loads it with `Dataset[TurnInputs, TurnOutcome,
dict].from_file(path)` and runs `evaluate` with `turn_task(agent)`, which runs the turn again on a (changed) agent
and returns its `TurnOutcome`. pydantic-evals is imported only here, when a dataset is built
(`EvalsNotInstalledError`, DC070, when it cannot be): it is not a dependency of this package, because the
pydantic-evals releases on the package index pin another pydantic-ai-slim than this package needs (docs/evals.md).
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field
from pydantic_ai.messages import (
    ModelMessage,
    ModelMessagesTypeAdapter,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    UserPromptPart,
)
from pydantic_ai.usage import RequestUsage

from ._limits import InputError
from .budget import RAISE_TOOL
from .errors import DurcapError
from .history import loaded_capability_ids
from .store import SQLConversationStore

if TYPE_CHECKING:
    from .agent import DurableAgent

__all__ = ['EVALS_INSTALL', 'EvalsExport', 'EvalsNotInstalledError', 'RecordedTurn', 'ToolCallRecord', 'TurnInputs',
           'TurnOutcome', 'build_dataset', 'export_evals', 'outcome_of', 'recorded_turns', 'turn_task']

EVALS_INSTALL = "pip install --no-deps 'pydantic-evals==2.62.0'"
"""How to install pydantic-evals beside this package (docs/evals.md says why `--no-deps`; its other dependencies are
this package's or pydantic-ai-slim's)."""


class EvalsNotInstalledError(DurcapError, ImportError, code='DC070'):
    """pydantic-evals cannot be imported, so no `Dataset` can be written or read (problem DC070). The message names
    the import error and the command that installs it (`EVALS_INSTALL`)."""


def pydantic_evals() -> Any:
    """The `pydantic_evals` module, imported now.

    Raises:
        EvalsNotInstalledError: it is not installed, or does not import (DC070).
    """
    try:
        return importlib.import_module('pydantic_evals')
    except ImportError as exc:
        raise EvalsNotInstalledError(
            f'DC070 writing an evals dataset needs pydantic-evals, which does not import here ({type(exc).__name__}: '
            f'{exc}). Fix: {EVALS_INSTALL} (docs/evals.md: its releases pin an older pydantic-ai-slim, so install it '
            'without its dependencies)') from exc


class ToolCallRecord(BaseModel):
    """One tool call the model made: the tool's name and its arguments (a JSON object)."""

    tool_name: str
    args: dict[str, Any] = Field(default_factory=dict)


class TurnInputs(BaseModel):
    """The inputs of a recorded turn (a case's `inputs`).

    Attributes:
        prompt: The turn's user prompt (text; a multimodal prompt's text parts joined), `None` when it had none.
        message_history: The messages before the turn, as pydantic-ai message JSON (`messages()` decodes them).
        capabilities: The capability ids `message_history` loaded: what the turn started with.
    """

    prompt: str | None
    message_history: list[dict[str, Any]] = Field(default_factory=list)
    capabilities: list[str] = Field(default_factory=list)

    def messages(self) -> list[ModelMessage]:
        """`message_history` as pydantic-ai messages (pass it as `message_history=`)."""
        return ModelMessagesTypeAdapter.validate_python(self.message_history)


class TurnOutcome(BaseModel):
    """What a turn produced (a case's `expected_output`, and what `turn_task` returns).

    Attributes:
        output: The answer: the last model response's text, else the arguments of its last tool call (an output
            tool), else `None`.
        tool_calls: Every tool call the model made in the turn, in order (`load_capability` included; the budget's
            `durcap_raise_budget` left out).
    """

    output: Any = None
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)


@dataclass(frozen=True)
class RecordedTurn:
    """One stored turn, ready to become a case.

    Attributes:
        conversation_id: Its conversation. number: 1 for the conversation's first turn.
        inputs: `TurnInputs`. expected: `TurnOutcome` (what was stored).
        model_name: The model of its last response (`None` when unknown). usage: Its responses' usage summed.
    """

    conversation_id: str
    number: int
    inputs: TurnInputs
    expected: TurnOutcome
    model_name: str | None
    usage: dict[str, int]

    @property
    def name(self) -> str:
        """The case name: `{conversation}#turn-{number}`."""
        return f'{self.conversation_id}#turn-{self.number}'

    def metadata(self) -> dict[str, Any]:
        """`{'conversation_id', 'turn', 'model_name', 'usage'}` (a case's metadata)."""
        return {'conversation_id': self.conversation_id, 'turn': self.number, 'model_name': self.model_name,
                'usage': self.usage}


def _prompt(request: ModelRequest) -> str | None:
    for part in request.parts:
        if isinstance(part, UserPromptPart):
            if isinstance(part.content, str):
                return part.content
            return '\n'.join(c for c in part.content if isinstance(c, str)) or None
    return None


def _starts_turn(message: ModelMessage) -> bool:
    return isinstance(message, ModelRequest) and any(isinstance(p, UserPromptPart) for p in message.parts)


def outcome_of(messages: Sequence[ModelMessage]) -> TurnOutcome:
    """The `TurnOutcome` of a turn's messages (a stored turn's, or `RunReport.new_messages` of a run of it)."""
    calls = [ToolCallRecord(tool_name=p.tool_name, args=p.args_as_dict())
             for m in messages if isinstance(m, ModelResponse)
             for p in m.parts if isinstance(p, ToolCallPart) and p.tool_name != RAISE_TOOL]
    last = next((m for m in reversed(messages) if isinstance(m, ModelResponse)
                 and any(getattr(p, 'tool_name', None) != RAISE_TOOL for p in m.parts)), None)
    output: Any = None
    if last is not None:
        text = ''.join(p.content for p in last.parts if isinstance(p, TextPart))
        tools = [p for p in last.parts if isinstance(p, ToolCallPart) and p.tool_name != RAISE_TOOL]
        output = text if text else tools[-1].args_as_dict() if tools else None
    return TurnOutcome(output=output, tool_calls=calls)


def split_turns(messages: Sequence[ModelMessage]) -> list[tuple[int, int]]:
    """`[(start, end)]` (0-based, end exclusive) of each turn of a history: a turn starts at each model request that
    carries a user prompt; messages before the first such request (none, normally) belong to no turn."""
    starts = [i for i, m in enumerate(messages) if _starts_turn(m)]
    return [(start, starts[k + 1] if k + 1 < len(starts) else len(messages)) for k, start in enumerate(starts)]


async def recorded_turns(store: SQLConversationStore, conversation_id: str) -> list[RecordedTurn]:
    """Every stored turn of `conversation_id`, oldest first.

    Raises:
        ConversationNotFoundError: no live conversation `conversation_id`.
        StoreError: a row does not decode (see `SQLConversationStore.read`).
    """
    messages = (await store.read(conversation_id)).messages
    turns = []
    for number, (start, end) in enumerate(split_turns(messages), start=1):
        before, own = messages[:start], messages[start:end]
        usage = RequestUsage()
        for message in own:
            if isinstance(message, ModelResponse):
                usage = usage + message.usage
        last = next((m for m in reversed(own) if isinstance(m, ModelResponse) and m.model_name), None)
        inputs = TurnInputs(prompt=_prompt(own[0]),  # type: ignore[arg-type]  # split_turns: a ModelRequest
                            message_history=ModelMessagesTypeAdapter.dump_python(list(before), mode='json'),
                            capabilities=loaded_capability_ids(before))
        turns.append(RecordedTurn(conversation_id, number, inputs, outcome_of(own),
                                  last.model_name if isinstance(last, ModelResponse) else None,
                                  {'input_tokens': usage.input_tokens, 'output_tokens': usage.output_tokens,
                                   'requests': sum(1 for m in own if isinstance(m, ModelResponse))}))
    return turns


def build_dataset(turns: Sequence[RecordedTurn], *, name: str | None = None) -> Any:
    """A pydantic-evals `Dataset[TurnInputs, TurnOutcome, dict]` of `turns`, one case each, with the
    `EqualsExpected` evaluator (the run's `TurnOutcome` equals the stored one).

    Raises:
        EvalsNotInstalledError: pydantic-evals does not import (DC070).
    """
    module = pydantic_evals()
    evaluators = importlib.import_module('pydantic_evals.evaluators')
    cases = [module.Case(name=t.name, inputs=t.inputs, expected_output=t.expected, metadata=t.metadata())
             for t in turns]
    return module.Dataset[TurnInputs, TurnOutcome, dict](name=name, cases=cases,
                                                         evaluators=[evaluators.EqualsExpected()])


@dataclass(frozen=True)
class EvalsExport:
    """What `export_evals` wrote.

    Attributes:
        path: The dataset file. schema_path: Its JSON schema, beside it (`None` when pydantic-evals wrote none).
        cases: How many cases (turns). per_conversation: `{conversation id: turns}`.
    """

    path: Path
    schema_path: Path | None
    cases: int
    per_conversation: dict[str, int]


_SUFFIXES = ('.yaml', '.yml', '.json')


async def export_evals(store: SQLConversationStore, conversation_ids: Sequence[str], out: str | Path, *,
                       name: str | None = None) -> EvalsExport:
    """Write the recorded turns of `conversation_ids` (in that order) to `out` as a pydantic-evals dataset.

    Args:
        store: The conversation store.
        conversation_ids: One or more conversations (a repeated id counts once).
        out: The file: `.yaml` / `.yml` or `.json` (pydantic-evals' two formats).
        name: The dataset's name (default: the file's stem).

    Returns:
        An `EvalsExport`.

    Raises:
        InputError: no conversation, `out` has another suffix, is a folder or cannot be written (DC040).
        ConversationNotFoundError: a conversation is not stored.
        EvalsNotInstalledError: pydantic-evals does not import (DC070).
    """
    path = Path(out)
    if path.suffix.lower() not in _SUFFIXES:
        raise InputError('--out', f'{str(out)!r} is neither .yaml, .yml nor .json: pydantic-evals writes those; give '
                                  'e.g. --out evals.yaml')
    ids = list(dict.fromkeys(conversation_ids))
    if not ids:
        raise InputError('ID', 'no conversation given: name one or more, e.g. durcap history evals support-1 --out '
                               'evals.yaml')
    turns: list[RecordedTurn] = []
    per: dict[str, int] = {}
    for conversation_id in ids:
        found = await recorded_turns(store, conversation_id)
        per[conversation_id] = len(found)
        turns.extend(found)
    if path.is_dir():
        raise InputError('--out', f'{str(out)!r} is a folder: give a file in it, e.g. --out {str(path / "evals.yaml")!r}')
    dataset = build_dataset(turns, name=name or path.stem)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        dataset.to_file(path)
    except OSError as exc:  # a parent that is a file, no permission, a full disk: the user's path to change
        raise InputError('--out', f'cannot write {str(out)!r} ({type(exc).__name__}: {exc.strerror or exc}): give a '
                                  'writable path') from exc
    schema = path.with_name(f'{path.stem}_schema.json')
    return EvalsExport(path, schema if schema.exists() else None, len(turns), per)


def turn_task(agent: DurableAgent[Any, Any], *, engine: str = 'local', deps: Any = None,
              **settings: Any) -> Callable[[TurnInputs], Awaitable[TurnOutcome]]:
    """A task for `Dataset.evaluate`: runs a recorded turn again on `agent` (the same or a changed definition or
    model) with `runner.run(agent, inputs.prompt, message_history=inputs.messages(), engine=...)`, no conversation
    (nothing is stored), and returns the run's `TurnOutcome`.

    Args:
        agent: The definition to evaluate.
        engine: The engine each case runs on (default `local`; a durable one takes its `settings`).
        deps: The run deps of every case.
        settings: Engine settings (`address`, `db`, ...), as for `runner.run`.

    Returns:
        `async (TurnInputs) -> TurnOutcome`. A run that fails raises, and pydantic-evals reports the case as failed.
    """

    async def task(inputs: TurnInputs) -> TurnOutcome:
        from . import runner

        report = await runner.run(agent, inputs.prompt, engine=engine, deps=deps, message_history=inputs.messages(),
                                  notify=lambda line: None, **settings)
        return outcome_of(report.new_messages)

    task.__name__ = f'turn_task[{agent.name}]'
    return task
