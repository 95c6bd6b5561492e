"""`load_skill` / `load_skills`: Markdown skills with YAML front matter as deferred capabilities.

Model: the run-through test uses a scripted `FunctionModel` defined here (`_load_then_answer`);
every other test builds definitions only and calls no model.

A malformed file never raises: it becomes an `InvalidSkill` whose DC016 problem names the file and
the line, and `DurableAgent` reports every one of them at once.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic_ai.capabilities import Capability
from pydantic_ai.messages import (
    InstructionDeltaPart,
    ModelMessage,
    ModelRequest,
    ModelResponse,
    TextPart,
    ToolCallPart,
    ToolReturnPart,
)
from pydantic_ai.models.function import AgentInfo, FunctionModel

from durable_capabilities import (
    DurableAgent,
    DurableConfigError,
    InvalidSkill,
    load_skill,
    load_skills,
)

EXAMPLE_SKILLS = Path(__file__).resolve().parents[2] / 'examples' / 'support' / 'skills'

REFUNDS = """---
id: refunds
description: Use for refund eligibility, refund status, or processing a refund.
---
Always confirm the order ID before issuing a refund.
Never issue refunds over $500 without manager approval.
"""

RETURNS = """---
id: returns
description: >
  Use for returns
  and exchanges.
tags: [support, logistics]
---

Items can be returned within 30 days.

---

A horizontal rule above is part of the body.
"""


def write(directory: Path, name: str, content: str | bytes) -> Path:
    path = directory / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_bytes(content.encode('utf-8'))
    return path


def problem_of(result: Any) -> Any:
    assert isinstance(result, InvalidSkill), f'expected an InvalidSkill, got {result!r}'
    assert result.problem.code == 'DC016'
    assert result.problem.severity == 'error'
    return result.problem


# ---- valid files ------------------------------------------------------------------------------


def test_valid_skills_become_deferred_capabilities(tmp_path: Path) -> None:
    """Model: none."""
    write(tmp_path, 'refunds.md', REFUNDS)
    write(tmp_path, 'returns.md', RETURNS)
    write(tmp_path, 'notes.txt', 'not a skill')
    skills = load_skills(tmp_path)

    assert [type(s) for s in skills] == [Capability, Capability]
    refunds, returns = skills
    assert (refunds.id, refunds.defer_loading) == ('refunds', True)
    assert refunds.description == 'Use for refund eligibility, refund status, or processing a refund.'
    assert refunds.get_instructions() == [
        'Always confirm the order ID before issuing a refund.\nNever issue refunds over $500 without manager approval.'
    ]
    assert returns.id == 'returns'
    assert returns.description == 'Use for returns and exchanges.'
    assert returns.get_instructions() == [
        'Items can be returned within 30 days.\n\n---\n\nA horizontal rule above is part of the body.'
    ]
    agent = DurableAgent('skills', 'test', capabilities=skills)
    assert agent.report().problems == []
    assert agent.capability_ids() == ['refunds', 'returns']
    assert agent.leaf_ids() == {'refunds': ['refunds'], 'returns': ['returns']}  # Capability's own (empty) toolset


def test_files_load_in_name_order(tmp_path: Path) -> None:
    """Model: none. Sorted by file name, whatever the directory order."""
    for name in ('c.md', 'a.md', 'b.md'):
        write(tmp_path, name, f'---\nid: skill-{name[0]}\ndescription: Use for {name[0]}.\n---\nBody {name[0]}.\n')
    assert [s.id for s in load_skills(tmp_path)] == ['skill-a', 'skill-b', 'skill-c']


def test_example_skills_are_valid() -> None:
    """Model: none. The support example's own skill files."""
    skills = load_skills(EXAMPLE_SKILLS)
    assert [s.id for s in skills] == ['returns', 'shipping-delays', 'warranty']
    assert all(isinstance(s, Capability) and s.defer_loading and s.get_instructions() for s in skills)


def test_skill_body_reaches_the_model_only_after_loading(tmp_path: Path) -> None:
    """Model: scripted FunctionModel `_load_then_answer` (loads `refunds`, then answers)."""
    write(tmp_path, 'refunds.md', REFUNDS)
    seen: list[tuple[str | None, list[str]]] = []

    def _load_then_answer(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        texts = [
            str(p.content) for m in messages if isinstance(m, ModelRequest) for p in m.parts if hasattr(p, 'content')
        ]
        seen.append((info.instructions, texts))
        loaded = any(isinstance(p, ToolReturnPart) and p.tool_name == 'load_capability' for m in messages for p in m.parts)
        if not loaded:
            return ModelResponse(parts=[ToolCallPart('load_capability', {'id': 'refunds'}, tool_call_id='load-1')])
        return ModelResponse(parts=[TextPart('ok')])

    agent = DurableAgent('skills-run', FunctionModel(_load_then_answer), capabilities=load_skills(tmp_path))
    result = asyncio.run(agent.run('Can I get a refund?'))
    body = 'Always confirm the order ID before issuing a refund.\nNever issue refunds over $500 without manager approval.'

    (instructions_1, texts_1), (_, texts_2) = seen
    assert '- refunds: Use for refund eligibility, refund status, or processing a refund.' in (instructions_1 or '')
    assert not any(body in t for t in [instructions_1 or '', *texts_1])
    assert any(body in t for t in texts_2)
    deltas = [p for m in result.all_messages() for p in m.parts if isinstance(p, InstructionDeltaPart)]
    assert [(str(d.id), d.content) for d in deltas] == [('capability:refunds', body)]


# ---- malformed files: one DC016 problem each, with file and line --------------------------------

MALFORMED: list[tuple[str, bytes, int, str]] = [
    # (file name, content, expected line, fragment of the message)
    ('bad-yaml.md', b'---\nid: bad\ndescription: Use for: this breaks\n---\nBody.\n', 3, 'not valid YAML'),
    ('bad-yaml-tab.md', b'---\nid: tab\n\tdescription: x\n---\nBody.\n', 3, 'not valid YAML'),
    ('bad-yaml-flow.md', b'---\nid: flow\ndescription: ok\ntags: [a, b\n---\nBody.\n', 4, 'not valid YAML'),
    ('bad-yaml-quote.md', b'---\nid: q\ndescription: "open\nmore: 1\n---\nBody.\n', 4, 'line 3'),
    ('bad-value.md', b'---\nid: date\ndescription: ok\nreviewed: 2026-13-45\n---\nBody.\n', 4, 'cannot build'),
    ('missing-id.md', b'---\ndescription: Use for things.\n---\nBody.\n', 1, 'no `id`'),
    ('empty-id.md', b'---\nid:\ndescription: Use for things.\n---\nBody.\n', 2, 'is empty'),
    ('numeric-id.md', b'---\ndescription: Use for things.\nid: 123\n---\nBody.\n', 3, 'int 123'),
    ('unsafe-id.md', b'---\nid: my skill\ndescription: Use for things.\n---\nBody.\n', 2, 'whitespace'),
    ('missing-description.md', b'---\nid: nodesc\n---\nBody.\n', 1, 'no `description`'),
    ('blank-description.md', b'---\nid: blank\ndescription: "  "\n---\nBody.\n', 3, 'description'),
    ('empty-body.md', b'---\nid: empty\ndescription: Use for nothing.\n---\n\n   \n', 5, 'empty body'),
    ('bom.md', b'\xef\xbb\xbf---\nid: bom\ndescription: Use for BOM.\n---\nBody.\n', 1, 'byte-order mark'),
    ('crlf.md', b'---\r\nid: crlf\r\ndescription: Use for CRLF.\r\n---\r\nBody.\r\n', 1, 'CRLF'),
    ('crlf-late.md', b'---\nid: late\ndescription: Use for it.\n---\nLine one.\r\nLine two.\n', 5, 'CRLF'),
    ('unclosed.md', b'---\nid: open\ndescription: Use for it.\nBody without a closing line.\n', 1, 'never closed'),
    ('no-front-matter.md', b'# Just Markdown\n\nSome text.\n', 1, 'first line must be `---`'),
    ('empty-file.md', b'', 1, 'first line must be `---`'),
    ('not-a-mapping.md', b'---\n- id\n- description\n---\nBody.\n', 2, 'mapping'),
    ('latin1.md', b'---\nid: latin\ndescription: Use for it.\n---\nCaf\xe9.\n', 5, 'UTF-8'),
]


@pytest.mark.parametrize(('name', 'content', 'line', 'fragment'), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_is_one_problem_with_file_and_line(
    tmp_path: Path, name: str, content: bytes, line: int, fragment: str
) -> None:
    """Model: none."""
    path = write(tmp_path, name, content)
    problem = problem_of(load_skill(path))
    assert problem.where == f'{path}:{line}'
    assert fragment in problem.message
    assert problem.fix

    [from_dir] = load_skills(tmp_path)
    assert problem_of(from_dir) == problem


def test_every_malformed_file_is_reported_at_once(tmp_path: Path) -> None:
    """Model: none. N malformed files: N DC016 problems in one DurableConfigError, valid ones kept."""
    for name, content, _, _ in MALFORMED:
        write(tmp_path, name, content)
    write(tmp_path, 'refunds.md', REFUNDS)

    with pytest.raises(DurableConfigError) as caught:
        DurableAgent('skills-bad', 'test', capabilities=load_skills(tmp_path))
    problems = [p for p in caught.value.report if p.code == 'DC016']
    expected = sorted(f'{tmp_path / name}:{line}' for name, _, line, _ in MALFORMED)
    assert sorted(p.where for p in problems) == expected
    assert len(caught.value.report.errors) == len(MALFORMED)
    # The message lists each file; GitHub annotations point at file and line.
    for name, *_ in MALFORMED:
        assert name in str(caught.value)
    github = caught.value.report.to_github()
    assert f'file={tmp_path / "bom.md"},line=1,title=DC016' in github
    assert f'file={tmp_path / "bad-yaml.md"},line=3,title=DC016' in github


def test_report_of_a_definition_with_a_bad_skill(tmp_path: Path) -> None:
    """Model: none. `.report()` of a definition that is only warned about never raises (here: errors raise)."""
    write(tmp_path, 'ok.md', REFUNDS)
    write(tmp_path, 'zz-bad.md', b'---\nid: zz\n---\nBody.\n')
    skills = load_skills(tmp_path)
    assert [type(s).__name__ for s in skills] == ['Capability', 'InvalidSkill']
    with pytest.raises(DurableConfigError) as caught:
        DurableAgent('one-bad', 'test', capabilities=skills)
    assert caught.value.report.codes() == ['DC016']


def test_duplicate_ids_across_files(tmp_path: Path) -> None:
    """Model: none. The second file (by name) is the problem, pointing at its `id` line and naming the first."""
    first = write(tmp_path, 'a-refunds.md', REFUNDS)
    second = write(
        tmp_path, 'b-refunds-v2.md', '---\ndescription: Newer refund rules.\nid: refunds\n---\nUse the new rules.\n'
    )
    skills = load_skills(tmp_path)
    assert isinstance(skills[0], Capability) and skills[0].id == 'refunds'
    problem = problem_of(skills[1])
    assert problem.where == f'{second}:3'
    assert f'{first}:2' in problem.message
    assert 'already used' in problem.message

    with pytest.raises(DurableConfigError) as caught:
        DurableAgent('dupes', 'test', capabilities=skills)
    assert caught.value.report.codes() == ['DC016']


def test_skill_id_colliding_with_a_capability_id(tmp_path: Path) -> None:
    """Model: none. A skill and a hand-written capability with one id: DC003, not a crash."""
    write(tmp_path, 'refunds.md', REFUNDS)
    other = Capability(id='refunds', description='Hand-written.', instructions='x', defer_loading=True)
    with pytest.raises(DurableConfigError) as caught:
        DurableAgent('clash', 'test', capabilities=[other, *load_skills(tmp_path)])
    assert 'DC003' in caught.value.report.codes()


def test_missing_directory_and_missing_file(tmp_path: Path) -> None:
    """Model: none."""
    [missing] = load_skills(tmp_path / 'nope')
    assert problem_of(missing).where == f'{tmp_path / "nope"}:1'
    assert 'does not exist' in missing.problem.message

    a_file = write(tmp_path, 'file.md', REFUNDS)
    [not_dir] = load_skills(a_file)
    assert 'not a directory' in problem_of(not_dir).message

    gone = problem_of(load_skill(tmp_path / 'gone.md'))
    assert gone.where == f'{tmp_path / "gone.md"}:1'
    assert 'cannot read' in gone.message

    (tmp_path / 'dir.md').mkdir()
    assert 'cannot read' in problem_of(load_skill(tmp_path / 'dir.md')).message


# ---- nothing raises -----------------------------------------------------------------------------

_front_line = st.sampled_from(
    ['id: x', 'id: fuzz-skill', 'description: Use for fuzz.', 'description:', 'id:', 'tags: [a, b', '\tbad: tab',
     'key: "open', 'n: !!int abc', 'd: 2026-13-45', '- item', '? complex', '---', '...', '', 'a: &x [*x]', 'id: 12']
)
_text = st.text(alphabet=st.characters(blacklist_categories=('Cs',)), max_size=40)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    opening=st.sampled_from(['---\n', '', '\ufeff---\n', '---\r\n', ' ---\n']),
    front=st.lists(st.one_of(_front_line, _text), max_size=6),
    closing=st.sampled_from(['---\n', '', '--- \n']),
    body=_text,
    raw_tail=st.binary(max_size=8),
)
def test_load_skill_never_raises(
    tmp_path: Path, opening: str, front: list[str], closing: str, body: str, raw_tail: bytes
) -> None:
    """Model: none. Any file content gives a Capability or an InvalidSkill whose line lies inside the file."""
    content = (opening + '\n'.join(front) + ('\n' if front else '') + closing + body).encode('utf-8') + raw_tail
    path = write(tmp_path, 'fuzz.md', content)
    result = load_skill(path)
    if isinstance(result, InvalidSkill):
        match = re.fullmatch(rf'{re.escape(str(path))}:(\d+)', result.problem.where)
        assert match, result.problem.where
        assert 1 <= int(match.group(1)) <= content.count(b'\n') + 2
        assert result.problem.code == 'DC016'
    else:
        assert isinstance(result, Capability)
        assert result.defer_loading is True
        assert result.id and result.description
        [instructions] = result.get_instructions()
        assert instructions and '\r' not in instructions
