"""The documentation site never drifts from the code: every Python block runs, the site builds strictly.

What runs, per page of `docs/` (in a temporary working directory of its own, blocks in page order):

- every ```` ```python ```` block, in a fresh namespace (or a fresh interpreter with `subprocess`), unless
  the HTML comment right before it says `<!-- docs-test: skip reason="..." -->` (a reason is required);
- a ```` ```text title="Output" ```` block right after a Python block is what the block must print
  (compared with whitespace collapsed, so the page may wrap long lines);
- ```` ```console ```` blocks marked `run` (each `$ ` line is a command that must exit 0, or `exit="N"`;
  with `output`, the lines after a command are what it must print) or `background ready="..."` (started,
  awaited until its output shows the text, or until the command `ready-cmd="..."` exits 0, and stopped by
  process id when the page is done).

Directives (an HTML comment right before the block, words and `key="value"` pairs):

- `skip reason="..."`: not run;
- `file="NAME"`: also written to NAME in the page's directory (for `import` and `durcap` targets);
- `subprocess`: run with `python -c` in a fresh interpreter (DBOS, Temporal, Prefect global state);
- `continue`: reuse the namespace of the previous in-process block of the page;
- `cwd="root"`: run (`subprocess` or `console`) in the repository root instead of the page's directory;
- `expect="DC001"`: a wrong example: it must raise `DurableConfigError` whose report has that code, or
  print a line holding it; `ok`: a right example: it must not raise, and print no `error DC...` line.

Page-level: `<!-- docs-test-page: needs="temporal" -->` (or `prefect`) starts that server for the page
and exports `DURCAP_TEMPORAL_ADDRESS` / `PREFECT_API_URL`.

Also here: every code of `durable_capabilities.validation.CODES` has a section in `docs/errors.md` with a
wrong and a right example; `docs/cli.md` is what `scripts/gen_cli_reference.py` generates now; and
`mkdocs build --strict` succeeds.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from durable_capabilities import CODES, DurableConfigError
from tests._helpers import ROOT, pythonpath, subprocess_env

DOCS = ROOT / 'docs'
BIN = Path(sys.executable).parent

FENCE_RE = re.compile(r'^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^\n`]*)$')
DIRECTIVE_RE = re.compile(r'^<!--\s*docs-test:(?P<body>.*?)-->\s*$')
PAGE_DIRECTIVE_RE = re.compile(r'<!--\s*docs-test-page:(?P<body>.*?)-->')
PAIR_RE = re.compile(r'(?P<key>[\w-]+)(?:="(?P<value>[^"]*)")?')
SNIPPET_RE = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')
KNOWN_WORDS = {'skip', 'reason', 'file', 'subprocess', 'continue', 'expect', 'ok', 'run', 'output', 'exit', 'background', 'ready', 'ready-cmd', 'cwd'}


# ---- reading pages --------------------------------------------------------------------------------------------------


def parse_directive(body: str) -> dict[str, str]:
    return {m['key']: (m['value'] if m['value'] is not None else '') for m in PAIR_RE.finditer(body)}


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    info: str
    code: str
    directive: dict[str, str] = field(default_factory=dict)
    output: str | None = None  # the `text title="Output"` block right after, if any

    @property
    def where(self) -> str:
        return f'{self.page.relative_to(ROOT)}:{self.line}'


def resolve_snippets(text: str) -> str:
    """Inline `--8<-- "path"` lines (pymdownx.snippets, base path: the repository root)."""
    lines = []
    for line in text.splitlines():
        match = SNIPPET_RE.match(line)
        lines.append((ROOT / match['path']).read_text(encoding='utf-8').rstrip('\n') if match else line)
    return '\n'.join(lines)


def read_blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, with the directive right before it and the output block right after."""
    lines = page.read_text(encoding='utf-8').splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE_RE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, info = match['fence'], match['info'].strip()
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        i += 1  # closing fence
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        directive = {}
        if j >= 0 and (d := DIRECTIVE_RE.match(lines[j].strip())):
            directive = parse_directive(d['body'])
        lang = info.split()[0] if info else ''
        blocks.append(Block(page, start + 1, lang, info, resolve_snippets('\n'.join(body)), directive))
    # Attach output blocks to the Python block they follow (only blank lines between).
    for previous, block in itertools.pairwise(blocks):
        if previous.lang == 'python' and block.lang == 'text' and 'title="Output"' in block.info:
            between = lines[previous.line : block.line - 1]
            closing = next(k for k, line in enumerate(between) if line.strip().startswith('```'))
            if not any(line.strip() for line in between[closing + 1 :]):
                previous.output = block.code
    return blocks


def pages() -> list[Path]:
    """The site's pages (`docs/snippets/` holds files pages include, not pages)."""
    return sorted(p for p in DOCS.rglob('*.md') if 'snippets' not in p.relative_to(DOCS).parts)


README = ROOT / 'README.md'
"""Not a page of the site, but its Python blocks run like a page's (the "Using it" snippet defines every name)."""


def page_id(page: Path) -> str:
    return str(page.relative_to(DOCS)) if page.is_relative_to(DOCS) else page.name


def normalized(text: str) -> str:
    return ' '.join(text.split())


# ---- structure: checked without running anything ----------------------------------------------------------------------


def test_every_python_block_runs_or_says_why_not() -> None:
    seen = 0
    for page in [*pages(), README]:
        for block in read_blocks(page):
            unknown = set(block.directive) - KNOWN_WORDS
            assert not unknown, f'{block.where}: unknown docs-test words {sorted(unknown)}'
            if block.lang in ('py', 'python3', 'pycon'):
                pytest.fail(f'{block.where}: write ```python so the block is run')
            if block.lang != 'python':
                continue
            seen += 1
            if 'skip' in block.directive:
                assert block.directive.get('reason', '').strip(), f'{block.where}: a skipped block needs reason="..."'
            assert not ('expect' in block.directive and 'ok' in block.directive), block.where
    assert seen > 40, f'only {seen} Python blocks found under docs/'


ERRORS_PAGE = DOCS / 'errors.md'


def error_sections() -> dict[str, list[Block]]:
    """`{code: blocks of its section}` of docs/errors.md (sections are `## DC001 ...` headings)."""
    text = ERRORS_PAGE.read_text(encoding='utf-8').splitlines()
    headings = [(n + 1, m[1]) for n, line in enumerate(text) if (m := re.match(r'^## (DC\d{3})\b', line))]
    blocks = read_blocks(ERRORS_PAGE)
    sections: dict[str, list[Block]] = {}
    for index, (line, code) in enumerate(headings):
        end = headings[index + 1][0] if index + 1 < len(headings) else len(text) + 1
        sections[code] = [b for b in blocks if line < b.line < end]
    return sections


def test_every_error_code_has_a_section_with_a_wrong_and_a_right_example() -> None:
    sections = error_sections()
    assert sorted(sections) == sorted(CODES), f'sections {sorted(sections)} != CODES {sorted(CODES)}'
    for code, blocks in sections.items():
        python = [b for b in blocks if b.lang == 'python']
        wrong = [b for b in python if b.directive.get('expect') == code]
        right = [b for b in python if 'ok' in b.directive]
        assert wrong, f'{code}: no wrong example (a python block marked expect="{code}")'
        assert right, f'{code}: no right example (a python block marked ok)'
        assert all('skip' not in b.directive for b in wrong + right), f'{code}: its examples must run'
        section = ERRORS_PAGE.read_text(encoding='utf-8').split(f'\n## {code}\n', 1)[1].split('\n## ', 1)[0]
        assert f'**{CODES[code]}**' in section, f'{code}: the section does not state CODES[{code!r}] in bold'


# ---- running pages ------------------------------------------------------------------------------------------------------


@dataclass
class PageRun:
    """The working directory, environment and background processes of one page."""

    page: Path
    cwd: Path
    env: dict[str, str]
    background: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)
    namespace: dict[str, object] | None = None

    def stop(self) -> None:
        for popen, _ in self.background:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(popen.pid, signal.SIGTERM)
                try:
                    popen.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(popen.pid, signal.SIGKILL)
                    popen.wait(timeout=30)


def check_result(block: Block, stdout: str, error: BaseException | str | None) -> None:
    """Apply `expect` / `ok` and the output block to what a Python block did."""
    expected_code = block.directive.get('expect')
    if expected_code:
        codes: list[str] = []
        if isinstance(error, DurableConfigError):
            codes = error.report.codes()
        elif isinstance(error, str):  # a subprocess: its stderr
            codes = re.findall(r'\bDC\d{3}\b', error)
        elif error is not None:
            raise AssertionError(f'{block.where}: raised {type(error).__name__}: {error}') from error
        codes += re.findall(r'\bDC\d{3}\b', stdout)
        assert expected_code in codes, f'{block.where}: expected {expected_code}, got {codes}\n{stdout}'
    elif error is not None:
        detail = error if isinstance(error, str) else f'{type(error).__name__}: {error}'
        raise AssertionError(f'{block.where}: the block failed:\n{detail}\n{stdout}')
    if 'ok' in block.directive:
        assert not re.search(r'\berror DC\d{3}\b', stdout), f'{block.where}: a right example reported an error:\n{stdout}'
    if block.output is not None:
        assert normalized(stdout) == normalized(block.output), (
            f'{block.where}: the output differs from the page.\n--- page ---\n{block.output}\n--- printed ---\n{stdout}'
        )


def run_in_process(block: Block, run: PageRun) -> None:
    if 'continue' in block.directive and run.namespace is not None:
        namespace = run.namespace
    else:
        namespace = {'__name__': '__main__'}
    run.namespace = namespace
    stdout = io.StringIO()
    error: BaseException | None = None
    code = compile(block.code, block.where, 'exec')
    with contextlib.redirect_stdout(stdout):
        try:
            exec(code, namespace)  # noqa: S102 - the point of this test
        except Exception as exc:  # noqa: BLE001 - judged by check_result
            error = exc
    check_result(block, stdout.getvalue(), error)


def block_cwd(block: Block, run: PageRun) -> Path:
    """The page's directory, or the repository root for `cwd="root"` (examples that read repository files)."""
    return ROOT if block.directive.get('cwd') == 'root' else run.cwd


def run_in_subprocess(block: Block, run: PageRun) -> None:
    result = subprocess.run(
        [sys.executable, '-c', block.code], cwd=block_cwd(block, run), env=run.env, capture_output=True, text=True, timeout=300, check=False,
    )
    error = None if result.returncode == 0 or _aborted_at_exit(result) else f'exit {result.returncode}\n{result.stderr[-6000:]}'
    check_result(block, result.stdout, error)


def _aborted_at_exit(result: subprocess.CompletedProcess[str]) -> bool:
    """Whether the block ran to its end and the interpreter then aborted while finalizing, in temporalio's native
    threads (SIGABRT, `Fatal Python error: PyGILState_Release ... Python runtime state: finalizing`: an open upstream
    bug, temporalio/sdk-python#300; seen here once, with two test workers loading the machine). Such a block is
    judged on its output alone, which `check_result` still compares; `durcap` itself leaves with `os._exit`."""
    return (result.returncode == -signal.SIGABRT and 'Fatal Python error: PyGILState_Release' in result.stderr
            and 'Python runtime state: finalizing' in result.stderr)


def console_commands(block: Block) -> list[tuple[str, str]]:
    """`[(command, expected output)]` of a console block (`$ ` lines are commands)."""
    commands: list[tuple[str, list[str]]] = []
    for line in block.code.splitlines():
        if line.startswith('$ '):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
    return [(command, '\n'.join(out)) for command, out in commands]


def run_console(block: Block, run: PageRun) -> None:
    expected_exit = int(block.directive.get('exit') or 0)
    for command, expected in console_commands(block):
        result = subprocess.run(
            ['bash', '-c', command], cwd=block_cwd(block, run), env=run.env, capture_output=True, text=True, timeout=300, check=False,
        )
        assert result.returncode == expected_exit, (
            f'{block.where}: `{command}` exited {result.returncode}\n{result.stdout}\n{result.stderr[-6000:]}'
        )
        if 'output' in block.directive:
            assert normalized(result.stdout) == normalized(expected), (
                f'{block.where}: `{command}` printed\n{result.stdout}\nthe page shows\n{expected}'
            )


def start_background(block: Block, run: PageRun) -> None:
    """Start the block's one command; wait until its output shows `ready`, or until `ready-cmd` exits 0."""
    [(command, _)] = console_commands(block)
    ready, ready_cmd = block.directive.get('ready'), block.directive.get('ready-cmd')
    assert ready or ready_cmd, f'{block.where}: a background block needs ready="..." or ready-cmd="..."'
    log = run.cwd / f'background-{len(run.background)}.log'
    with open(log, 'wb') as handle:
        popen = subprocess.Popen(
            ['bash', '-c', f'exec {command}'], cwd=run.cwd, env=run.env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    run.background.append((popen, log))
    deadline = time.monotonic() + 240
    probe = ''
    while time.monotonic() < deadline:
        if ready and ready in log.read_text(errors='replace'):
            return
        if ready_cmd:
            result = subprocess.run(
                ['bash', '-c', ready_cmd], cwd=run.cwd, env=run.env, capture_output=True, text=True, timeout=120,
                check=False,
            )
            if result.returncode == 0:
                return
            probe = result.stdout[-2000:] + result.stderr[-2000:]
        if popen.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(
        f'{block.where}: not ready (exit {popen.poll()}):\n{log.read_text(errors="replace")[-6000:]}\n{probe}'
    )


@contextlib.contextmanager
def page_servers(page: Path, tmp: Path) -> Iterator[dict[str, str]]:
    """Start the servers the page needs; yields the environment variables that point at them. The servers `.ci/run`
    started for the session (`$DURCAP_TEST_TEMPORAL_ADDRESS`, `$DURCAP_TEST_PREFECT_API_URL`) are used when set, as
    tests/engines/conftest.py does (the pages' task queue and deployment names are used by no other test)."""
    needs = set()
    for match in PAGE_DIRECTIVE_RE.finditer(page.read_text(encoding='utf-8')):
        needs.update(filter(None, parse_directive(match['body']).get('needs', '').split(',')))
    from durable_capabilities import testing

    with contextlib.ExitStack() as stack:
        env: dict[str, str] = {}
        if 'temporal' in needs:
            env['DURCAP_TEMPORAL_ADDRESS'] = os.environ.get('DURCAP_TEST_TEMPORAL_ADDRESS') or stack.enter_context(
                testing.temporal_dev_server(tmp / '.temporal')).address
        if 'prefect' in needs:
            env['PREFECT_API_URL'] = os.environ.get('DURCAP_TEST_PREFECT_API_URL') or stack.enter_context(
                testing.prefect_server(tmp / '.prefect-server')).address
        yield env


def needs_servers(page: Path) -> bool:
    return bool(PAGE_DIRECTIVE_RE.search(page.read_text(encoding='utf-8')))


RUNNABLE_PAGES = [p for p in [*pages(), README] if any(b.lang in ('python', 'console') for b in read_blocks(p))]
SERVER_PAGES = [p for p in RUNNABLE_PAGES if needs_servers(p)]
"""Pages that start a Temporal or Prefect server (`docs-test-page: needs=...`): run by tests/engines/test_docs_servers.py."""


@pytest.mark.parametrize('page', [pytest.param(p, id=page_id(p)) for p in RUNNABLE_PAGES if p not in SERVER_PAGES])
def test_page_code_runs(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_page(page, tmp_path, monkeypatch)


def run_page(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run every block of `page` in `tmp_path` (the servers it needs started first); fails on the first block that does
    not do what the page says."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    with page_servers(page, tmp_path) as server_env:
        env = {
            **os.environ,
            **server_env,
            'PATH': f'{BIN}{os.pathsep}{os.environ.get("PATH", "")}',
            'PYTHONPATH': pythonpath(tmp_path),  # the page's folder, then this checkout
            'PREFECT_HOME': str(tmp_path / '.prefect-home'),
            'PREFECT_SERVER_ANALYTICS_ENABLED': 'false',
            'NO_COLOR': '1',
            'COLUMNS': '160',
            'PYTHONUNBUFFERED': '1',
        }
        run = PageRun(page, tmp_path, env)
        try:
            for block in read_blocks(page):
                directive = block.directive
                if block.lang == 'python':
                    if 'file' in directive:
                        (tmp_path / directive['file']).write_text(block.code + '\n', encoding='utf-8')
                    if 'skip' in directive:
                        continue
                    if 'subprocess' in directive:
                        run_in_subprocess(block, run)
                    else:
                        run_in_process(block, run)
                elif block.lang == 'console':
                    if 'background' in directive:
                        start_background(block, run)
                    elif 'run' in directive:
                        run_console(block, run)
        finally:
            run.stop()
            for name in set(sys.modules) - before:  # modules the page wrote (agents.py, ...)
                module = sys.modules.get(name)
                if module is not None and str(getattr(module, '__file__', '') or '').startswith(str(tmp_path)):
                    del sys.modules[name]


# ---- generated pages and the site -------------------------------------------------------------------------------------


def test_cli_reference_matches_the_cli() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / 'scripts' / 'gen_cli_reference.py'), '--check'],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, f'docs/cli.md is stale; run scripts/gen_cli_reference.py\n{result.stdout[-6000:]}{result.stderr}'


def test_benchmarks_page_includes_the_bench_figures() -> None:
    text = (DOCS / 'benchmarks.md').read_text(encoding='utf-8')
    assert '--8<-- "bench/README.md"' in text


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    env = subprocess_env({'NO_MKDOCS_2_WARNING': '1', 'NO_COLOR': '1'})
    result = subprocess.run(
        [str(BIN / 'mkdocs'), 'build', '--strict', '--config-file', str(ROOT / 'mkdocs.yml'), '--site-dir', str(tmp_path / 'site')],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, f'mkdocs build --strict failed:\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}'
    built = tmp_path / 'site'
    for page in pages():
        rel = page.relative_to(DOCS).with_suffix('')
        target = built / (rel.parent if rel.name == 'index' else rel) / 'index.html'  # use_directory_urls
        assert target.is_file(), f'{page_id(page)} was not built ({target})'
    html = (built / 'errors' / 'index.html').read_text(encoding='utf-8')
    for code in CODES:
        assert f'id="{code.lower()}"' in html, f'no anchor for {code} in the built errors page'


def test_readme_wire_demo_is_the_one_docs_providers_runs() -> None:
    """README's no-key instructions (`durcap wire`, then `durcap demo ... --base-url`) are the commands the
    docs/providers.md console blocks run against the wire server (test_page_code_runs[providers.md])."""
    readme = (ROOT / 'README.md').read_text()
    page = (DOCS / 'providers.md').read_text()
    wire = 'durcap wire --port 18766'
    demo = 'durcap demo --engine dbos --model openai:gpt-4o --base-url http://127.0.0.1:18766/v1'
    assert f'.venv/bin/{wire}\n' in readme and f'.venv/bin/{demo}\n' in readme
    assert f'$ {wire}\n' in page and f'$ {demo} |' in page
