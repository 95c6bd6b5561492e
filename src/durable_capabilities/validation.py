"""Problems, reports and the error users catch.

Every check in the package yields `Problem`s; nothing raises half-way. A `DurableAgent` collects
them into one `Report` and raises a single `DurableConfigError` carrying every error at once.
Codes are stable: a code is never reused for another check, and `CODES` documents each one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal['error', 'warning', 'info']

CODES: dict[str, str] = {
    'DC001': 'A deferred capability has no explicit id.',
    'DC002': 'An id (capability, leaf toolset or agent name) is not safe to use in durable unit names.',
    'DC003': 'Two capabilities share one id.',
    'DC004': 'Two leaf toolsets share one id.',
    'DC005': 'Two MCP capabilities derive the same id from their URLs (upstream derives the hostname only).',
    'DC006': 'An id is derived from a server URL and embeds its host.',
    'DC007': 'One tool name is exposed by two capabilities.',
    'DC008': 'A tool uses the reserved name `load_capability`.',
    'DC009': '`RunbookRequired` names a capability the agent does not have.',
    'DC010': '`RunbookRequired` names a tool the agent does not have.',
    'DC011': 'Two agent definitions registered together share one name.',
    'DC012': 'Capabilities were passed per run; durable engines need them at construction.',
    'DC013': 'A leaf toolset id depends on its position in a list.',
    'DC014': 'A leaf toolset has no id and is of a kind that cannot be given one.',
    'DC015': 'A capability owns leaf toolsets but has no id to derive theirs from.',
    'DC016': 'A skill file is malformed.',
    'DC017': 'An engine name is unknown or its extra is not installed.',
    'DC018': 'A stored history loaded a capability id the definition no longer has.',
    'DC019': 'A stored history called a tool the definition no longer has.',
    'DC020': 'Durable unit names in the lockfile are no longer produced (a rename or removal).',
    'DC021': 'An agent in the lockfile is no longer defined.',
    'DC022': 'A durable unit name is new since the lockfile.',
    'DC023': "A capability's `get_toolset()` raised while the agent was being built.",
    'DC030': 'A Temporal payload is over the configured maximum (a tool result, a message, a history).',
    'DC031': 'A large Temporal payload could not be stored by reference (the conversation store is down).',
}
"""Every code with a one-line summary. `docs/errors.md` gives a wrong and a right example of each."""


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


class DurableConfigError(ValueError):
    """Raised when a definition has at least one error-severity problem.

    `.report` holds every problem found (errors and warnings), not only the first.
    """

    def __init__(self, report: Report, subject: str = 'definition'):
        self.report = report
        self.subject = subject
        errors = report.errors
        head = f'{subject} has {len(errors)} error(s):'
        super().__init__('\n'.join([head, *(f'  {p.format()}' for p in errors)]))

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by engines that record failures (DBOS): rebuild from the report, not the message.
        return (type(self), (self.report, self.subject))


def describe_capability(capability: object, cap_id: str | None) -> str:
    """`"capability 'orders' (Capability)"`, or `"capability without id (AccountSecurity)"`."""
    cls = type(capability).__name__
    return f'capability {cap_id!r} ({cls})' if cap_id is not None else f'capability without id ({cls})'
