"""Markdown skills (YAML front matter `id`, `description`; body = instructions) as deferred capabilities.

The format is the one Anthropic Agent Skills use and the seed's "Loading skills from Markdown files"
shows. Loading never raises: a malformed file, one that is not a regular file (a FIFO would block a read
forever), one over `_limits.MAX_SKILL_BYTES`, or a folder that cannot be listed becomes an `InvalidSkill`
placeholder that `DurableAgent` reports as problem DC016 with the file name and line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic_ai.capabilities import AbstractCapability, Capability

from ._limits import MAX_SKILL_BYTES, InputError, load_yaml, printable, read_bytes
from .ids import id_syntax_error
from .validation import Problem


@dataclass
class InvalidSkill(AbstractCapability[Any]):
    """Stands in for a skill file that could not be loaded; contributes nothing to a run.

    Attributes:
        problem: The DC016 problem (where = `path:line`).
    """

    problem: Problem = field(default=None)  # type: ignore[assignment]


def _invalid(path: Path, line: int, message: str, fix: str) -> InvalidSkill:
    return InvalidSkill(problem=Problem('DC016', 'error', f'{path}:{line}', message, fix))


def _key_line(lines: list[str], end: int, key: str) -> int | None:
    """The 1-based file line of the top-level `key:` in the front matter (`lines[1:end]`), or `None`."""
    pattern = re.compile(rf'''^(?:{re.escape(key)}|'{re.escape(key)}'|"{re.escape(key)}")\s*:''')
    return next((i + 1 for i in range(1, end) if pattern.match(lines[i])), None)


def _unbuildable_value_line(front: str) -> int:
    """The file line of the first top-level value of `front` that PyYAML parses but cannot construct (else 2)."""
    try:
        root = yaml.compose(front, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return 2
    pairs = root.value if isinstance(root, yaml.MappingNode) else [(root, root)] if root is not None else []
    for _, value_node in pairs:
        try:
            yaml.SafeLoader('').construct_document(value_node)
        except Exception:  # noqa: BLE001 - any failure here locates the value
            return value_node.start_mark.line + 2
    return 2


def load_skill(path: str | Path) -> Capability[Any] | InvalidSkill:
    """Load one skill file.

    Args:
        path: A UTF-8 Markdown file with LF line endings and no byte-order mark: `---`, YAML with
            `id` and `description`, `---`, then the body (the instructions).

    Returns:
        A deferred `Capability(id=..., description=..., instructions=body)`, or an `InvalidSkill`.

    Where a problem points: the opening `---` (line 1) for the file as a whole and for a missing
    `id` or `description`; the offending line for a YAML error, a bad value, a CRLF line ending; the
    line after the closing `---` for an empty body.
    """
    path = Path(path)
    try:
        raw = read_bytes(path, limit=MAX_SKILL_BYTES, what='skill file')
    except InputError as exc:
        return _invalid(path, 1, f'{exc.reason}', 'Keep skill files as regular Markdown files of at most 1 MiB.')
    except OSError as exc:
        return _invalid(path, 1, f'cannot read the file: {exc.strerror or type(exc).__name__}.', 'Check the path and permissions.')
    if raw.startswith(b'\xef\xbb\xbf'):
        return _invalid(
            path, 1, 'the file starts with a UTF-8 byte-order mark, which hides the opening `---`.',
            'Save the file as UTF-8 without BOM.',
        )
    try:
        text = raw.decode('utf-8')
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b'\n') + 1
        return _invalid(path, line, 'the file is not valid UTF-8.', 'Save the file as UTF-8.')
    if '\r' in text:
        line = text[: text.index('\r')].count('\n') + 1
        kind = 'CRLF (Windows)' if '\r\n' in text else 'CR'
        return _invalid(
            path, line, f'the file has {kind} line endings; the body would carry `\\r` into the instructions.',
            'Convert the file to LF line endings (`dos2unix`, or your editor\'s line-ending setting).',
        )
    lines = text.split('\n')
    if not lines or lines[0].strip() != '---':
        return _invalid(path, 1, 'no YAML front matter: the first line must be `---`.', 'Start the file with `---`, `id: ...`, `description: ...`, `---`.')
    try:
        end = next(i for i in range(1, len(lines)) if lines[i].strip() == '---')
    except StopIteration:
        return _invalid(path, 1, 'the front matter opened with `---` is never closed.', 'Add a `---` line after the YAML.')
    try:
        meta = load_yaml('\n'.join(lines[1:end]), where=str(path))
    except yaml.YAMLError as exc:
        # Marks count lines from 0 inside the front matter, which starts on file line 2.
        mark = getattr(exc, 'problem_mark', None)
        line = (mark.line + 2) if mark is not None else 2
        reason = getattr(exc, 'problem', None) or str(exc).splitlines()[0]
        context = getattr(exc, 'context_mark', None)
        if context is not None and context.line + 2 != line and getattr(exc, 'context', None):
            reason = f'{reason} ({exc.context} on line {context.line + 2})'  # type: ignore[attr-defined]
        return _invalid(path, line, f'the front matter is not valid YAML: {reason}.', 'Fix the YAML between the `---` lines.')
    except (ValueError, TypeError, RecursionError) as exc:
        # PyYAML's safe constructors raise plain errors for values that parse but cannot be built
        # (`date: 2026-13-45`, `n: !!int abc`), without a line.
        line = _unbuildable_value_line('\n'.join(lines[1:end]))
        return _invalid(path, line, f'the front matter has a value YAML cannot build: {exc}.', 'Quote the value or fix it.')
    if not isinstance(meta, dict):
        return _invalid(path, 2, 'the front matter must be a mapping with `id` and `description`.', 'Write `id: ...` and `description: ...`.')
    id_line = _key_line(lines, end, 'id') or 2  # 2: a key written in a form we do not scan (flow style)
    skill_id = meta.get('id')
    if 'id' not in meta:
        return _invalid(path, 1, 'the front matter has no `id`.', 'Add `id: <stable-id>`; it names the skill in message histories.')
    if not isinstance(skill_id, str) or not skill_id.strip():
        shown = 'is empty' if skill_id is None or skill_id == '' else f'is {type(skill_id).__name__} {skill_id!r}'
        return _invalid(path, id_line, f'the `id` {shown}; it must be a non-empty string.', "Write `id: <stable-id>` (quote it if it looks like a number: `id: '123'`).")
    description = meta.get('description')
    description_line = _key_line(lines, end, 'description') or 2
    if 'description' not in meta:
        return _invalid(path, 1, f'skill {skill_id!r} has no `description`; the model picks skills by it.', 'Add `description: Use for ...`.')
    if not isinstance(description, str) or not description.strip():
        return _invalid(path, description_line, f'skill {skill_id!r} has an empty or non-text `description`; the model picks skills by it.', 'Write `description: Use for ...`.')
    body = '\n'.join(lines[end + 1 :]).strip()
    if not body:
        return _invalid(path, end + 2, f'skill {skill_id!r} has an empty body; there are no instructions to load.', 'Write the instructions below the closing `---`.')
    if (reason := id_syntax_error(skill_id)) is not None:
        return _invalid(path, id_line, f'skill id {skill_id!r} {reason}.', "Use letters, digits, '.', '_' or '-'.")
    capability: Capability[Any] = Capability(id=skill_id, description=description.strip(), instructions=body, defer_loading=True)
    capability._durcap_skill_source = f'{path}:{id_line}'  # type: ignore[attr-defined]
    return capability


def load_skills(directory: str | Path, pattern: str = '*.md') -> list[Capability[Any] | InvalidSkill]:
    """Load every skill file in `directory` (sorted by file name, so the order is the same everywhere).

    Args:
        directory: Folder of Markdown skill files.
        pattern: Glob for skill files inside `directory`.

    Returns:
        One entry per file: a deferred `Capability`, or an `InvalidSkill` (problem DC016) for a malformed
        file or a second file with an id already taken. Pass them to `DurableAgent(capabilities=[...])`.
        A missing directory, or one that cannot be listed, yields one `InvalidSkill`.

    Never raises (for any directory, pattern or file content): every problem is an `InvalidSkill`.
    """
    directory = Path(directory)
    try:
        if not directory.is_dir():
            what = 'is a file, not a directory' if directory.exists() else 'does not exist'
            return [_invalid(directory, 1, f'the skills directory {what}.', 'Create it or fix the path.')]
        paths = sorted(directory.glob(pattern))
    except (OSError, ValueError, NotImplementedError) as exc:
        return [_invalid(directory, 1, f'cannot list the skills directory with pattern {printable(repr(pattern))}: '
                         f'{printable(getattr(exc, "strerror", None) or exc)}.', 'Check the path, its permissions and the pattern.')]
    result: list[Capability[Any] | InvalidSkill] = []
    seen: dict[str, str] = {}
    for path in paths:
        skill = load_skill(path)
        if isinstance(skill, Capability):
            source = skill._durcap_skill_source  # type: ignore[attr-defined]
            assert skill.id is not None
            if skill.id in seen:
                skill = _invalid(
                    path, int(source.rsplit(':', 1)[1]),
                    f'skill id {skill.id!r} is already used by {seen[skill.id]}.',
                    'Give each skill file a distinct `id`.',
                )
            else:
                seen[skill.id] = source
        result.append(skill)
    return result
