"""Problems, reports and the error users catch.

Every check in the package yields `Problem`s; nothing raises half-way. A `DurableAgent` collects
them into one `Report` and raises a single `DurableConfigError` carrying every error at once.
Codes are stable: a code is never reused for another check, and `CODES` documents each one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Self

from .errors import DurcapError

Severity = Literal['error', 'warning', 'info']


@dataclass(frozen=True)
class Text:
    """The message and fix of one problem, as `str.format` templates (`'{cap_id!r}'`), filled by `problem()`.

    Attributes:
        message: What is wrong.
        fix: What to change.
        severity: This variant's severity when it differs from its code's (DC010 is a warning when some
            tools are only known at run time).
    """

    message: str
    fix: str
    severity: Severity | None = None


class Code(str):
    """One entry of `CODES`: the code's one-line summary (the string itself), plus its severity and texts.

    Attributes:
        severity: The severity its problems have unless a variant says otherwise.
        texts: `{variant: Text}`; `''` is the default variant. Empty for codes whose messages are written
            where they are found (`written_by`).
        written_by: The module that builds its problems: `checks` for the definition checks, else the
            module that writes its own messages (skill files, history drift, the lockfile).
    """

    severity: Severity
    texts: dict[str, Text]
    written_by: str

    def __new__(
        cls, summary: str, severity: Severity, text: Text | None = None, /, *, written_by: str = 'checks', **variants: Text
    ) -> Self:
        self = super().__new__(cls, summary)
        self.severity = severity
        self.texts = ({'': text} if text is not None else {}) | variants
        self.written_by = written_by
        return self


_ID_RULE = "letters, digits, '.', '_' or '-' (no '__'), at most 100 characters"

CODES: dict[str, Code] = {
    'DC001': Code(
        'A deferred capability has no explicit id.',
        'error',
        Text(
            '`defer_loading=True` but `id` is not set; the message history records loaded capabilities by id, so '
            'resume and durable units need a stable one.',
            "Construct it as `{cls}(id='...', defer_loading=True, ...)`.",
        ),
        url=Text(
            '`defer_loading=True` but `id` is not set (its URL {url} would derive {derived!r}, which changes with the '
            'host); the message history records loaded capabilities by id, so resume and durable units need a stable '
            'one.',
            "Construct it as `{cls}(id='...', defer_loading=True, ...)`.",
        ),
    ),
    'DC002': Code(
        'An id (capability, leaf toolset or agent name) is not safe to use in durable unit names.',
        'error',
        agent=Text(
            'the agent name {reason}; it is part of every durable unit name.', f'Use {_ID_RULE}.'
        ),
        capability=Text('capability id {cap_id!r} {reason}.', f'Set `id=` to {_ID_RULE}.'),
        leaf=Text(
            'leaf toolset id {toolset_id!r} ({kind}) {reason}.',
            'Set a safe `id=` on the toolset, or a shorter capability id.',
        ),
    ),
    'DC003': Code(
        'Two capabilities share one id.',
        'error',
        Text('{count} capabilities ({classes}) share the id {cap_id!r}.', 'Give each capability a distinct `id=`.'),
    ),
    'DC004': Code(
        'Two leaf toolsets share one id.',
        'error',
        Text(
            '{count} leaf toolsets have the id {toolset_id!r} ({owners}); they would share one set of durable units.',
            'Give the toolsets (or their capabilities) distinct ids.',
        ),
    ),
    'DC005': Code(
        'Two MCP capabilities derive the same id from their URLs (upstream derives the hostname only).',
        'error',
        Text(
            '{count} MCP capabilities derive the id {cap_id!r} from their URLs ({urls}); pydantic-ai 2.68 derives the '
            'hostname only, so servers on one host collide.',
            'Pass a distinct explicit `id=` to each MCP capability.',
        ),
    ),
    'DC006': Code(
        'An id is derived from a server URL and embeds its host.',
        'warning',
        Text(
            'id {cap_id!r} is derived from the URL {url} and embeds its host; moving the server to another host '
            'renames its durable units and strands in-flight runs.',
            "Pass an explicit id: `MCP(url=..., id='{suggested}')`.",
        ),
    ),
    'DC007': Code(
        'One tool name is exposed by two capabilities.',
        'error',
        Text(
            'the tool name {tool!r} is exposed by {owners}; the model cannot tell them apart.',
            "Rename one of the tools, or prefix a capability's tools (`PrefixTools`).",
        ),
    ),
    'DC008': Code(
        'A tool uses the reserved name `load_capability`.',
        'error',
        Text(
            '`load_capability` is reserved: pydantic-ai adds it whenever a capability is deferred.',
            'Rename the tool (`@toolset.tool(name=...)` or rename the function).',
        ),
    ),
    'DC009': Code(
        '`RunbookRequired` names a capability the agent does not have.',
        'error',
        Text(
            'requirements[{tool!r}] names capability {required!r}, which this agent does not have.',
            'Add the runbook capability with id {required!r}, or fix the id (known: {known}).',
        ),
    ),
    'DC010': Code(
        '`RunbookRequired` names a tool the agent does not have.',
        'error',
        Text(
            'requirements names tool {tool!r}, which no capability or agent tool defines.',
            'Fix the tool name, or add the tool.',
        ),
        dynamic=Text(
            'requirements names tool {tool!r}, which no capability or agent tool defines statically (MCP or dynamic '
            'toolsets may still provide it).',
            'Fix the tool name, or add the tool.',
            'warning',
        ),
    ),
    'DC011': Code('Two agent definitions registered together share one name.', 'error', written_by='agent'),
    'DC012': Code(
        'Capabilities were passed per run; durable engines need them at construction.',
        'error',
        Text(
            'capabilities {names} were passed per run; durable engines register activities, steps and tasks when '
            'the agent is built, so a per-run capability has none.',
            'Attach {names} at construction: `DurableAgent(..., capabilities=[...])`.',
        ),
    ),
    'DC013': Code(
        'A leaf toolset id depends on its position in a list.',
        'warning',
        leaf=Text(
            '{kind} at position {position} gets id {toolset_id!r} from its position in the toolsets list; reordering '
            'the list renames its durable units and strands in-flight runs.',
            'Give the toolset its own id (`FunctionToolset(id=...)`) or keep the list order fixed.',
        ),
        group=Text(
            '{cls} has no id, so its leaf toolsets take the id {scope!r} from its position among the id-less members '
            'of its group; reordering the group renames its durable units.',
            'Give this {cls} its own `id=`.',
        ),
        callables=Text(
            "toolset functions in `toolsets=` get the ids '{scope}_<position>' from pydantic-ai; reordering the list "
            'renames their durable units and strands in-flight runs.',
            "Wrap each function with its own id: `DynamicToolset(func, id='...')`.",
        ),
    ),
    'DC014': Code(
        'A leaf toolset has no id and is of a kind that cannot be given one.',
        'error',
        Text(
            'leaf toolset {kind} has no id and durable-capabilities cannot copy it to give it one.',
            'Construct the {kind} with an explicit `id=`.',
        ),
    ),
    'DC015': Code(
        'A capability owns leaf toolsets but has no id to derive theirs from.',
        'error',
        Text(
            'the capability contributes a leaf toolset ({kind}) but has no `id`, so durable engines cannot name its '
            'activities, steps or tasks.',
            'Construct it as `{cls}(id=...)`.',
        ),
    ),
    'DC016': Code('A skill file is malformed.', 'error', written_by='skills'),
    'DC017': Code(
        'An engine name is unknown or its extra is not installed.',
        'error',
        unknown=Text("engines lists unknown engine {engine!r}.", 'Use engines from {known}.'),
        missing=Text(
            'engine {engine!r} is listed but its packages are not installed.',
            'pip install "durable-capabilities[{extra}]", or drop {engine!r} from `engines=`.',
        ),
    ),
    'DC018': Code('A stored history loaded a capability id the definition no longer has.', 'error', written_by='history'),
    'DC019': Code('A stored history called a tool the definition no longer has.', 'error', written_by='history'),
    'DC020': Code(
        'Durable unit names in the lockfile are no longer produced (a rename or removal).', 'error', written_by='lockfile'
    ),
    'DC021': Code('An agent in the lockfile is no longer defined.', 'error', written_by='lockfile'),
    'DC022': Code('A durable unit name is new since the lockfile.', 'info', written_by='lockfile'),
    'DC023': Code(
        "A capability's `get_toolset()` raised while the agent was being built.",
        'error',
        Text(
            '`get_toolset()` raised {error_type}: {error}',
            "Fix the capability's `get_toolset()`; it is called once when the agent is built.",
        ),
    ),
    'DC024': Code(
        "A deferred capability's `get_toolset()` returns new leaf toolsets on every call.",
        'error',
        Text(
            '`get_toolset()` returns a new {kind} {toolset_id!r} on every call. The model loads a deferred capability '
            'by fetching its toolset again, and durable engines run only the leaf toolset objects they wrapped when '
            "the agent was built, so every run that loads it would fail ('cannot be added at runtime').",
            'Build the toolset once (in `__init__`) and return that same object from `get_toolset()`; for a toolset '
            'function, return the same function object every time, or pass it as `Capability(toolsets=[func])`.',
        ),
    ),
    'DC030': Code(
        'A Temporal payload is over the configured maximum (a tool result, a message, a history).',
        'error',
        written_by='engines.temporal._payloads',
    ),
    'DC031': Code(
        'A large Temporal payload could not be stored by reference (the conversation store is down).',
        'error',
        written_by='engines.temporal._payloads',
    ),
    'DC040': Code(
        'An input is unusable: over a size, nesting, expansion or time bound, not a regular file, of the wrong '
        'shape, or an unusable option value.',
        'error',
        written_by='_limits',
    ),
    'DC041': Code("An HTTP request to `durcap serve` is refused: its body is over the server's bound.", 'error',
                  written_by='serve'),
    'DC042': Code('An HTTP request to `durcap serve` is refused: its body or a header is unusable (not JSON, the wrong '
                  'shape, deps that do not fit).', 'error', written_by='serve'),
    'DC043': Code('An HTTP request to `durcap serve` is refused: no credentials, or ones the server does not accept.',
                  'error', written_by='serve'),
    'DC044': Code('A request names no agent, run, conversation or pending call: an HTTP request to `durcap serve` '
                  "none of this principal's, a `durcap` command none at all.", 'error', written_by='serve'),
    'DC045': Code('An `Idempotency-Key` was sent again with a different request.', 'error', written_by='serve'),
    'DC050': Code(
        "A turn was refused: another run's turn holds the conversation (one turn at a time per conversation).",
        'error',
        written_by='conversations',
    ),
    'DC051': Code(
        "Arguments edited in an approval do not fit the tool's schema.",
        'error',
        written_by='approvals',
    ),
    'DC052': Code(
        'A decision reached no run: no worker serves the run, or none accepted the decision in time.',
        'error',
        written_by='approvals',
    ),
    'DC053': Code(
        "`busy='interrupt'` was chosen for an agent whose output is not plain text (an interrupted turn ends with a "
        'text answer).',
        'error',
        written_by='conversations',
    ),
    'DC054': Code(
        'A decision was refused: the call was already decided (a call is decided once).',
        'error',
        written_by='approvals',
    ),
    'DC055': Code(
        'A decision was refused: it quotes another fingerprint than the pending call (it was made for other arguments).',
        'error',
        written_by='approvals',
    ),
    'DC060': Code(
        "A model request was refused before it was sent: its budget's key already spent a limit.",
        'error',
        written_by='budget',
    ),
    'DC061': Code(
        'A turn made its request limit of model requests across its approval rounds, and its model asked for '
        'approval again.',
        'error',
        written_by='turn',
    ),
    'DC070': Code(
        'An evals dataset was asked for, but pydantic-evals does not import here.',
        'error',
        written_by='evals',
    ),
}
"""Every code: its one-line summary (each value is that string), severity, and message and fix templates.

`docs/errors.md` gives a wrong and a right example of each. Checks build problems with `problem()`, so a
code's wording lives here and nowhere else; codes with `written_by` other than `'checks'` have messages
that depend on what was found (a skill file's line, a history's message) and are written by that module.
"""



@dataclass(frozen=True)
class Problem:
    """One finding of a check.

    Attributes:
        code: Stable code such as `'DC001'` (see `CODES`).
        severity: `'error'` blocks construction and worker start; `'warning'` and `'info'` do not.
        where: What the problem is about: `"capability 'orders' (Capability)"`, `"skills/refunds.md:3"`.
        message: What is wrong, naming the capability (id and class) and the field.
        fix: What to change.
        engines: The engines the problem affects; empty means every engine.
    """

    code: str
    severity: Severity
    where: str
    message: str
    fix: str
    engines: tuple[str, ...] = ()

    def format(self) -> str:
        """One line: `error DC001 capability 'x' (Capability): message Fix: fix`."""
        scope = f' [{", ".join(self.engines)}]' if self.engines else ''
        return f'{self.severity} {self.code} {self.where}{scope}: {self.message} Fix: {self.fix}'



def problem(code: str, where: str, engines: tuple[str, ...] = (), variant: str = '', **fields: Any) -> Problem:
    """The `Problem` `code` about `where`, its message and fix rendered from `CODES[code]` with `fields`.

    Args:
        code: A key of `CODES` that has texts.
        where: What the problem is about (see `Problem.where`).
        engines: The engines it affects; empty means every engine.
        variant: Which of the code's texts (`''`, the default, or a name such as `'leaf'`).
        fields: Values for the templates' `{placeholders}`; extra ones are ignored.

    Raises:
        KeyError: `code` is unknown or has no such variant (a programming error, not a user's).
    """
    spec = CODES[code]
    text = spec.texts[variant]
    return Problem(
        code, text.severity or spec.severity, where, text.message.format(**fields), text.fix.format(**fields), engines
    )


@dataclass
class Report:
    """The problems found for one definition (or several checked together), in the order found."""

    problems: list[Problem] = field(default_factory=list)

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)

    def __len__(self) -> int:
        return len(self.problems)

    def add(self, problem: Problem) -> None:
        self.problems.append(problem)

    def extend(self, problems: Iterable[Problem]) -> None:
        self.problems.extend(problems)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == 'error']

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == 'warning']

    @property
    def ok(self) -> bool:
        """True when the report holds no error (warnings and info allowed)."""
        return not self.errors

    def codes(self) -> list[str]:
        return [p.code for p in self.problems]

    def to_text(self) -> str:
        if not self.problems:
            return 'no problems found'
        return '\n'.join(p.format() for p in self.problems)

    def to_json(self) -> str:
        return json.dumps(
            {
                'ok': self.ok,
                'errors': len(self.errors),
                'warnings': len(self.warnings),
                'problems': [asdict(p) | {'engines': list(p.engines)} for p in self.problems],
            },
            indent=2,
        )

    def to_github(self) -> str:
        """GitHub Actions workflow commands (`::error title=DC001::...`), one per problem."""
        level = {'error': 'error', 'warning': 'warning', 'info': 'notice'}
        lines = []
        for p in self.problems:
            file_part = ''
            if ':' in p.where and p.where.split(':')[-1].isdigit() and p.where.endswith(tuple('0123456789')):
                path, _, line = p.where.rpartition(':')
                file_part = f'file={_escape_property(path)},line={line},'
            text = f'{p.where}: {p.message} Fix: {p.fix}'.replace('%', '%25').replace('\r', '%0D').replace('\n', '%0A')
            lines.append(f'::{level[p.severity]} {file_part}title={p.code}::{text}')
        return '\n'.join(lines)


def _escape_property(value: str) -> str:
    """Escape a GitHub workflow-command property value (`%`, CR, LF, `:` and `,`)."""
    return (
        value.replace('%', '%25').replace('\r', '%0D').replace('\n', '%0A').replace(':', '%3A').replace(',', '%2C')
    )


class DurableConfigError(ValueError, DurcapError, code='config'):
    """Raised when a definition has at least one error-severity problem.

    `.report` holds every problem found (errors and warnings), not only the first. `.code` is the first error's
    code (`'DC001'`, ...), or `'config'` for a report without errors.
    """

    def __init__(self, report: Report, subject: str = 'definition'):
        self.report = report
        self.subject = subject
        errors = report.errors
        if errors:
            self.code = errors[0].code
        head = f'{subject} has {len(errors)} error(s):'
        super().__init__('\n'.join([head, *(f'  {p.format()}' for p in errors)]))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by engines that record failures (DBOS): rebuild from the report, not the message.
        return (type(self), (self.report, self.subject))


def describe_capability(capability: object, cap_id: str | None) -> str:
    """`"capability 'orders' (Capability)"`, or `"capability without id (AccountSecurity)"`."""
    cls = type(capability).__name__
    return f'capability {cap_id!r} ({cls})' if cap_id is not None else f'capability without id ({cls})'
