"""Rewrite the `text title="Output"` blocks of docs pages with what their Python blocks print now.

    .venv/bin/python scripts/refresh_docs_output.py docs/errors.md docs/concepts/ids.md
    .venv/bin/python scripts/refresh_docs_output.py            # every page that needs no server

`tests/unit/test_docs.py` fails when a page's output block differs from what its example prints (compared
with whitespace collapsed). After an intended change to a message, run this, read the diff, and commit
it. Blocks run exactly as the test runs them (same directives, a fresh temporary directory per page);
lines longer than 100 characters are wrapped at spaces. Pages that need a server
(`<!-- docs-test-page: needs=... -->`) and `console` blocks with `output` are left to edit by hand.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / 'tests'))

import test_docs as harness  # the test's own parser and directives

WIDTH = 100


def wrap(text: str) -> list[str]:
    lines: list[str] = []
    for line in text.rstrip('\n').splitlines():
        if len(line) <= WIDTH:
            lines.append(line)
            continue
        indent = ' ' * (len(line) - len(line.lstrip()) + 4)
        lines.extend(textwrap.wrap(line, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False))
    return lines


def refresh(page: Path) -> int:
    """Rewrite `page`'s output blocks; returns how many changed."""
    tmp = Path(tempfile.mkdtemp(prefix='docs-refresh-'))
    env = {
        **os.environ, 'PYTHONPATH': os.pathsep.join([str(tmp), str(ROOT)]),
        'PATH': f'{harness.BIN}{os.pathsep}{os.environ.get("PATH", "")}', 'NO_COLOR': '1', 'COLUMNS': '160',
    }
    old_cwd = Path.cwd()
    os.chdir(tmp)
    sys.path.insert(0, str(tmp))
    lines = page.read_text(encoding='utf-8').splitlines()
    blocks = harness.read_blocks(page)
    namespace: dict[str, object] | None = None
    replacements: list[tuple[int, int, list[str]]] = []
    try:
        for index, block in enumerate(blocks):
            directive = block.directive
            cwd = ROOT if directive.get('cwd') == 'root' else tmp
            if block.lang == 'console' and 'run' in directive:
                for command, _ in harness.console_commands(block):
                    subprocess.run(['bash', '-c', command], cwd=cwd, env=env, capture_output=True, text=True, check=False)
                continue
            if block.lang != 'python':
                continue
            if 'file' in directive:
                (tmp / directive['file']).write_text(block.code + '\n', encoding='utf-8')
            if 'skip' in directive:
                continue
            if 'subprocess' in directive:
                result = subprocess.run(
                    [sys.executable, '-c', block.code], cwd=cwd, env=env, capture_output=True, text=True, check=False
                )
                printed = result.stdout
                if result.returncode:
                    print(f'{block.where}: exit {result.returncode}\n{result.stderr[-3000:]}', file=sys.stderr)
            else:
                if not ('continue' in directive and namespace is not None):
                    namespace = {'__name__': '__main__'}
                buffer = io.StringIO()
                with contextlib.redirect_stdout(buffer):
                    try:
                        exec(compile(block.code, block.where, 'exec'), namespace)  # noqa: S102
                    except Exception as exc:  # noqa: BLE001 - shown, and the test will fail on it
                        print(f'{block.where}: {type(exc).__name__}: {exc}', file=sys.stderr)
                printed = buffer.getvalue()
            if block.output is None:
                continue
            output_block = blocks[index + 1]
            start = output_block.line  # 0-based index of the first body line
            end = start
            while not lines[end].lstrip().startswith('```'):
                end += 1
            new = wrap(printed)
            if lines[start:end] != new:
                replacements.append((start, end, new))
    finally:
        os.chdir(old_cwd)
        sys.path.remove(str(tmp))
    for start, end, new in sorted(replacements, reverse=True):
        lines[start:end] = new
    if replacements:
        page.write_text('\n'.join(lines) + '\n', encoding='utf-8')
    return len(replacements)


def main() -> int:
    pages = [Path(p).resolve() for p in sys.argv[1:]] or [
        p for p in harness.pages() if not harness.needs_servers(p) and 'snippets' not in p.parts
    ]
    for page in pages:
        changed = refresh(page)
        print(f'{page.relative_to(ROOT)}: {changed} output block(s) rewritten', file=sys.stderr)
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
