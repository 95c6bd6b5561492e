"""Markdown skills (YAML front matter `id`, `description`; body = instructions) as deferred capabilities.

The format is the one Anthropic Agent Skills use and the seed's "Loading skills from Markdown files"
shows. A malformed file never raises: it becomes an `InvalidSkill` placeholder that `DurableAgent`
reports as problem DC016 with the file name and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic_ai.capabilities import AbstractCapability, Capability

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


def load_skill(path: str | Path) -> Capability[Any] | InvalidSkill:
    """Load one skill file.

    Args:
        path: A UTF-8 Markdown file with LF line endings and no byte-order mark: `---`, YAML with
            `id` and `description`, `---`, then the body (the instructions).

    Returns:
        A deferred `Capability(id=..., description=..., instructions=body)`, or an `InvalidSkill`.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        return _invalid(path, 1, f'cannot read the file: {exc.strerror}.', 'Check the path and permissions.')
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
    if '\r\n' in text:
        return _invalid(
            path, 1, 'the file has CRLF (Windows) line endings; the body would carry `\\r` into the instructions.',
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
        meta = yaml.safe_load('\n'.join(lines[1:end]))
    except yaml.YAMLError as exc:
        mark = getattr(exc, 'problem_mark', None)
        line = (mark.line + 2) if mark is not None else 2
        reason = getattr(exc, 'problem', None) or str(exc).splitlines()[0]
        return _invalid(path, line, f'the front matter is not valid YAML: {reason}.', 'Fix the YAML between the `---` lines.')
    if not isinstance(meta, dict):
        return _invalid(path, 2, 'the front matter must be a mapping with `id` and `description`.', 'Write `id: ...` and `description: ...`.')
    id_line = next((i + 1 for i in range(1, end) if lines[i].lstrip().startswith('id:')), 2)
    skill_id = meta.get('id')
    if not isinstance(skill_id, str) or not skill_id.strip():
        return _invalid(path, 2, 'the front matter has no `id` (a non-empty string).', 'Add `id: <stable-id>`; it names the skill in message histories.')
    description = meta.get('description')
    if not isinstance(description, str) or not description.strip():
        return _invalid(path, id_line, f'skill {skill_id!r} has no `description`; the model picks skills by it.', 'Add `description: Use for ...`.')
    body = '\n'.join(lines[end + 1 :]).strip()
    if not body:
        return _invalid(path, end + 2, f'skill {skill_id!r} has an empty body; there are no instructions to load.', 'Write the instructions below the closing `---`.')
    from .ids import id_syntax_error

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
        A missing directory yields one `InvalidSkill`.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return [_invalid(directory, 1, 'the skills directory does not exist.', 'Create it or fix the path.')]
    result: list[Capability[Any] | InvalidSkill] = []
    seen: dict[str, str] = {}
    for path in sorted(directory.glob(pattern)):
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
