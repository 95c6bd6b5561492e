"""`durcap ui` in a real browser, on real engines.

Real parts: one `durcap ui` subprocess per module (free port, stopped by process id), reading the session's
Temporal dev server, a DBOS system database (SQLite) and a conversation store of the module; Debian's headless
`/usr/bin/chromium` driven by `/usr/bin/chromedriver` through Selenium (selenium-manager is never asked: both
paths are given and `SE_OFFLINE` is set); `durcap run` subprocesses of the support example; the gated agent's
DBOS runs from `tests/engines/drive.py` (the approval tests' helpers). Models: the scripted `FunctionModel`s of
`examples/support/scripted.py` and `tests/engines/approval_agent.py` (its `revoke_sessions` writes one ledger
line per execution).

Screenshots of the three pages are written to `.durcap/artifacts/ui/` (gitignored; see docs/ui.md).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from durable_capabilities import telemetry
from durable_capabilities._servers import free_port
from tests._helpers import ROOT, subprocess_env
from tests.engines.test_approvals import TARGET, env_for, pending, revocations, start_gated_temporal

# One worker runs this module's tests (pytest-xdist `loadgroup`): they share a module-scoped fixture.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group('ui')]


ARTIFACTS = ROOT / '.durcap' / 'artifacts' / 'ui'
CHROMIUM, CHROMEDRIVER = Path('/usr/bin/chromium'), Path('/usr/bin/chromedriver')
SUPPORT = 'examples.support.agent:support'
ORDERS = json.dumps({'orders': {'ABC-123': 'Blue denim jacket: shipped'}})


@dataclass
class UI:
    """The running `durcap ui`: its URL, token and the settings it reads."""

    url: str
    token: str
    db: str
    store: str
    address: str
    proc: subprocess.Popen[bytes]
    log: Path


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)


@pytest.fixture(scope='module')
def ui(tmp_path_factory: pytest.TempPathFactory, temporal_address: str) -> Iterator[UI]:
    """`durcap ui --engine dbos --engine temporal` on a free port; stopped by process id after the module."""
    home = tmp_path_factory.mktemp('ui')
    port = free_port()
    token = secrets.token_urlsafe(16)
    db, store = f'sqlite:///{home / "dbos.sqlite"}', f'sqlite:///{home / "conversations.db"}'
    log = home / 'ui.log'
    with open(log, 'wb') as handle:
        proc = subprocess.Popen(
            [sys.executable, '-m', 'durable_capabilities.cli', 'ui', '--port', str(port), '--engine', 'dbos',
             '--engine', 'temporal', '--db', db, '--address', temporal_address, '--store', store,
             '--limit', '300'],  # past the 50 newest: the Temporal server is shared with tests running meanwhile
            cwd=home, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
            env=subprocess_env({'DURCAP_UI_TOKEN': token}),
        )
    server = UI(f'http://127.0.0.1:{port}', token, db, store, temporal_address, proc, log)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if _get(server.url + '/approvals') == 200:
                    break
            except OSError:
                time.sleep(0.2)  # not listening yet
        assert _get(server.url + '/approvals') == 200, log.read_text()
        assert 'decision token from $DURCAP_UI_TOKEN' in log.read_text() and token not in log.read_text()
        yield server
    finally:
        _stop(proc)
    assert proc.poll() is not None


@pytest.fixture(scope='module')
def browser() -> Iterator[object]:
    """Headless Chromium from Debian's packages, through its chromedriver; quit (both processes end) after the module."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    assert CHROMIUM.exists() and CHROMEDRIVER.exists(), 'apt-get install -y chromium chromium-driver'
    os.environ['SE_OFFLINE'] = 'true'  # selenium-manager, if ever asked, must not download anything
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ('--headless=new', '--no-sandbox', '--disable-dev-shm-usage', '--window-size=1400,1000'):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver, name: str) -> None:
    """Save a full-page screenshot as `.durcap/artifacts/ui/NAME.png`."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script('return document.documentElement.scrollHeight')
    driver.set_window_size(1400, max(1000, min(int(height) + 50, 6000)))
    path = ARTIFACTS / f'{name}.png'
    assert driver.save_screenshot(str(path)), path
    driver.set_window_size(1400, 1000)
    assert path.stat().st_size > 10_000


def durcap_run(ui: UI, engine: str, conversation: str, tmp_path: Path) -> str:
    """`durcap run` of the support example on `engine` (Temporal: an inline worker on a fresh task queue) into the
    UI's database and store; returns the run id it printed."""
    extra = ['--db', ui.db] if engine == 'dbos' else ['--address', ui.address, '--inline-worker', '--task-queue',
                                                       f'ui-{uuid.uuid4().hex[:8]}']
    result = subprocess.run(
        [sys.executable, '-m', 'durable_capabilities.cli', 'run', SUPPORT, 'Where is order ABC-123?', '--engine', engine,
         '--deps-json', ORDERS, '--conversation', conversation, '--store', ui.store, *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
        env=subprocess_env(),
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f'answer ({engine}):' in result.stdout and 'ABC-123' in result.stdout
    label = f'{engine} workflow id: '
    return next(line for line in (result.stderr + result.stdout).splitlines() if label in line).split(label)[1].split()[0]


def settle(driver, condition, timeout: float = 30) -> None:
    """Wait until `condition(driver)` holds: a click that submits a form returns before the next page has loaded
    (seen on a loaded CI machine)."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition)


def row(driver, run_id: str):
    from selenium.webdriver.common.by import By

    rows = [r for r in driver.find_elements(By.CSS_SELECTOR, '#runs tbody tr') if r.get_attribute('data-run-id') == run_id]
    return rows[0] if rows else None


def test_runs_list_shows_a_dbos_and_a_temporal_support_run_with_capabilities_and_the_run_page(ui: UI, browser,
                                                                                              tmp_path: Path) -> None:
    """The support example runs once on DBOS and once on Temporal ("Where is order ABC-123?": it loads `orders`).
    The runs page lists both with engine, agent, status and the loaded capability; the engine/capability filter
    narrows it; the DBOS run's page shows its durable units as a timeline (the model request that loaded
    `orders`, the tool call) and its conversation (messages, usage)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    dbos_conv, temporal_conv = f'ui-dbos-{uuid.uuid4().hex[:6]}', f'ui-temporal-{uuid.uuid4().hex[:6]}'
    dbos_id = durcap_run(ui, 'dbos', dbos_conv, tmp_path)
    temporal_id = durcap_run(ui, 'temporal', temporal_conv, tmp_path)
    browser.get(ui.url + '/')
    for run_id, engine, conversation in ((dbos_id, 'dbos', dbos_conv), (temporal_id, 'temporal', temporal_conv)):
        found = row(browser, run_id)
        assert found is not None, f'{engine} run {run_id} not listed:\n' + browser.page_source[-3000:]
        cells = [c.text for c in found.find_elements(By.TAG_NAME, 'td')]
        assert cells[1:4] == [engine, 'support', 'completed'], cells
        assert cells[5] == 'orders' and cells[6] == conversation, cells
    shot(browser, 'runs')

    Select(browser.find_element(By.NAME, 'engine')).select_by_value('temporal')
    Select(browser.find_element(By.NAME, 'capability')).select_by_value('orders')
    browser.find_element(By.CSS_SELECTOR, '#filters button').click()
    settle(browser, lambda d: 'engine=temporal' in d.current_url)  # the click submits; the page loads after it
    assert 'engine=temporal' in browser.current_url and 'capability=orders' in browser.current_url
    assert row(browser, temporal_id) is not None and row(browser, dbos_id) is None
    assert {r.get_attribute('data-engine') for r in browser.find_elements(By.CSS_SELECTOR, '#runs tbody tr[data-engine]')} \
        == {'temporal'}

    browser.get(ui.url + '/')
    row(browser, dbos_id).find_element(By.TAG_NAME, 'a').click()
    settle(browser, lambda d: d.find_elements(By.ID, 'run-id'))
    assert browser.find_element(By.ID, 'run-id').text == dbos_id
    assert browser.find_element(By.ID, 'trace-id').text == telemetry.trace_id(dbos_id)  # docs/tracing.md
    units = [[c.text for c in r.find_elements(By.TAG_NAME, 'td')] for r in browser.find_elements(By.CSS_SELECTOR, '#timeline tr.unit')]
    kinds = [u[2] for u in units]
    assert kinds[0] == 'conversation' and kinds[-1] == 'conversation', units
    assert kinds.count('model request') == 3 and kinds.count('tool call') == 1, units
    assert [u[5] for u in units if u[5]] == ['load_capability(orders)'], units  # the request that loaded it
    assert all(u[4] == 'done' for u in units), units
    messages = browser.find_element(By.ID, 'messages').text
    assert 'Where is order ABC-123?' in messages and 'order_status' in messages and 'Blue denim jacket: shipped' in messages
    assert 'requests 3' in browser.find_element(By.ID, 'usage').text
    shot(browser, 'run')

    browser.get(f'{ui.url}/runs/temporal/{temporal_id}')
    units = [[c.text for c in r.find_elements(By.TAG_NAME, 'td')] for r in browser.find_elements(By.CSS_SELECTOR, '#timeline tr.unit')]
    assert [u[2] for u in units].count('model request') == 3, units
    assert 'load_capability(orders)' in [u[5] for u in units], units
    assert browser.find_element(By.CSS_SELECTOR, '#run-info .capabilities').text == 'orders'


def start_gated(ui: UI, spawn, tmp_path: Path, prompt: str, conversation: str | None = None) -> tuple[object, str, dict, Path]:
    """A DBOS run of the gated agent (tests/engines/approval_agent.py) in the UI's database and store, waiting
    for a decision; returns (process, run id, pending call, ledger dir)."""
    env, crash_dir = env_for(tmp_path)
    env['DURCAP_STORE'] = ui.store
    run_id = f'ui-gate-{uuid.uuid4().hex[:8]}'
    extra = ['--conversation', conversation] if conversation else []
    proc = spawn('dbos', 'run', '--target', TARGET, '--db', ui.db, '--workflow-id', run_id, '--prompt', prompt, *extra,
                 env=env)
    [call] = pending(['--engine', 'dbos', '--db', ui.db], run_id)
    return proc, run_id, call, crash_dir


def call_box(driver, run_id: str):
    from selenium.webdriver.common.by import By

    boxes = [b for b in driver.find_elements(By.CSS_SELECTOR, '.call') if b.get_attribute('data-run-id') == run_id]
    assert len(boxes) == 1, driver.page_source[-3000:]
    return boxes[0]


def test_approve_from_the_page_with_edited_arguments_runs_the_tool_once(ui: UI, browser, spawn, tmp_path: Path) -> None:
    """The approvals page shows the waiting call (tool, arguments, requester run, deadline); approving it with
    edited arguments, a name and the token runs the tool once with those arguments; the audit records `ui:<name>`."""
    from selenium.webdriver.common.by import By

    proc, run_id, call, crash_dir = start_gated(ui, spawn, tmp_path, 'revoke alice')
    browser.get(ui.url + '/approvals')
    box = call_box(browser, run_id)
    assert box.find_element(By.CSS_SELECTOR, '.tool').text == 'revoke_sessions'
    assert json.loads(box.find_element(By.CSS_SELECTOR, '.args').text) == {'user': 'alice'}
    assert box.find_element(By.CSS_SELECTOR, '.deadline').text == call['deadline']
    assert box.find_element(By.LINK_TEXT, run_id).get_attribute('href').endswith(f'/runs/dbos/{run_id}')
    shot(browser, 'approvals')
    form = box.find_element(By.CSS_SELECTOR, 'form.approve')
    args = form.find_element(By.NAME, 'args')
    args.clear()
    args.send_keys('{"user": "alice-2"}')
    form.find_element(By.NAME, 'by').send_keys('ops-anna')
    form.find_element(By.NAME, 'token').send_keys(ui.token)
    form.find_element(By.CSS_SELECTOR, 'button').click()
    settle(browser, lambda d: d.find_elements(By.ID, 'decided'))
    assert browser.find_element(By.ID, 'decided').text == f'approved call {call["call_id"]} of run {run_id} by ui:ops-anna'
    report = proc.report(timeout=120)
    assert report['output'] == 'result: revoked sessions of alice-2'
    assert revocations(crash_dir) == ['alice-2']  # once, with the edited arguments
    audit = [m['metadata']['durcap_approvals'] for m in report['new_messages'] if (m.get('metadata') or {}).get('durcap_approvals')]
    assert audit[0][0]['decision'] == 'approved' and audit[0][0]['by'] == 'ui:ops-anna'
    assert audit[0][0]['override_args'] == {'user': 'alice-2'} and audit[0][0]['fingerprint'] == call['fingerprint']
    browser.get(f'{ui.url}/runs/dbos/{run_id}')
    assert browser.find_element(By.ID, 'status').text == 'completed'


def test_temporal_call_approved_from_the_page_runs_once(ui: UI, browser, spawn, tmp_path: Path) -> None:
    """A Temporal workflow of the gated agent waits (the pending call read from its memo); approving it from the
    approvals page delivers the update: the workflow completes and the tool ran once."""
    import asyncio

    from selenium.webdriver.common.by import By

    from durable_capabilities.engines.temporal import AgentRunOutput, connect

    env, crash_dir = env_for(tmp_path)
    queue, run_id = f'ui-gate-{uuid.uuid4().hex[:8]}', f'ui-gate-{uuid.uuid4().hex[:8]}'
    worker = spawn('temporal', 'worker', '--target', TARGET, '--address', ui.address, '--task-queue', queue, env=env)
    worker.wait_for('WORKER READY', 90)
    start_gated_temporal(ui.address, run_id, queue)
    [call] = pending(['--engine', 'temporal', '--address', ui.address], run_id)
    browser.get(ui.url + '/approvals')
    box = call_box(browser, run_id)
    assert '(temporal, agent gated)' in box.text and box.find_element(By.CSS_SELECTOR, '.deadline').text == call['deadline']
    form = box.find_element(By.CSS_SELECTOR, 'form.approve')
    form.find_element(By.NAME, 'token').send_keys(ui.token)
    form.find_element(By.CSS_SELECTOR, 'button').click()
    settle(browser, lambda d: d.find_elements(By.ID, 'decided'))
    assert browser.find_element(By.ID, 'decided').text.startswith(f'approved call {call["call_id"]} of run {run_id} by ui:')

    async def result() -> AgentRunOutput:
        client = await connect(ui.address)
        return await asyncio.wait_for(client.get_workflow_handle(run_id, result_type=AgentRunOutput).result(), 90)

    assert asyncio.run(result()).output == 'result: revoked sessions of dave'
    assert revocations(crash_dir) == ['dave']  # exactly once, with the model's arguments


def test_deny_shows_its_reason_in_the_conversation_view(ui: UI, browser, spawn, tmp_path: Path) -> None:
    """Denying from the run's own page with a reason: the tool never runs, the run completes, and its conversation
    view shows the reason (the tool's result the model saw, and the audit row by `ui:<OS user>`)."""
    from selenium.webdriver.common.by import By

    from durable_capabilities.approvals import default_user

    conversation = f'ui-deny-{uuid.uuid4().hex[:6]}'
    proc, run_id, _, crash_dir = start_gated(ui, spawn, tmp_path, 'revoke bob', conversation)
    browser.get(f'{ui.url}/runs/dbos/{run_id}')
    form = call_box(browser, run_id).find_element(By.CSS_SELECTOR, 'form.deny')
    form.find_element(By.NAME, 'reason').send_keys('bob is the CEO: open a ticket first')
    form.find_element(By.NAME, 'token').send_keys(ui.token)
    form.find_element(By.CSS_SELECTOR, 'button').click()
    settle(browser, lambda d: d.find_elements(By.ID, 'decided'))
    assert browser.find_element(By.ID, 'decided').text.startswith('denied call')
    assert proc.report(timeout=120)['output'] == 'result: bob is the CEO: open a ticket first'
    assert revocations(crash_dir) == []
    browser.get(f'{ui.url}/runs/dbos/{run_id}')
    returns = [r.text for r in browser.find_elements(By.CSS_SELECTOR, '#messages tr.part-tool-return')]
    assert any('revoke_sessions' in r and 'bob is the CEO: open a ticket first' in r for r in returns), returns
    audit = browser.find_element(By.CSS_SELECTOR, '#audit tbody tr')
    assert audit.find_element(By.CSS_SELECTOR, '.decision').text == 'denied'
    assert audit.find_element(By.CSS_SELECTOR, '.by').text == f'ui:{default_user()}'
    assert audit.find_element(By.CSS_SELECTOR, '.reason').text == 'bob is the CEO: open a ticket first'


def test_a_decision_without_the_token_or_csrf_is_refused_and_changes_nothing(ui: UI, browser, spawn, tmp_path: Path) -> None:
    """From the page without the token: 403, nothing delivered. Posted directly (httpx): the right token without
    the CSRF cookie, or with a wrong CSRF field, is 403 too, and so is a wrong non-empty token; edited arguments that
    do not fit the tool's schema are 409 (DC051); the call still waits unchanged and the tool never ran.
    Then the call is denied with the token, and the run completes."""
    import httpx
    from selenium.webdriver.common.by import By

    proc, run_id, call, crash_dir = start_gated(ui, spawn, tmp_path, 'revoke carol')
    browser.get(ui.url + '/approvals')
    call_box(browser, run_id).find_element(By.CSS_SELECTOR, 'form.approve button').click()
    settle(browser, lambda d: d.find_elements(By.ID, 'error-title'))  # the refusal page loads after the click returns
    assert browser.find_element(By.ID, 'error-title').text == 'Refused'
    assert 'decision token' in browser.find_element(By.ID, 'error').text
    form = {'engine': 'dbos', 'run_id': run_id, 'call_id': call['call_id'], 'fingerprint': call['fingerprint'],
            'decision': 'approve', 'args': '', 'token': ui.token}
    with httpx.Client(base_url=ui.url) as client:
        no_cookie = client.post('/decide', data={**form, 'csrf': 'x' * 32})
        assert no_cookie.status_code == 403 and 'CSRF' in no_cookie.text
        csrf = client.get('/approvals').cookies['durcap_csrf']
        wrong = client.post('/decide', data={**form, 'csrf': csrf[:-1] + ('a' if csrf[-1] != 'a' else 'b')})
        assert wrong.status_code == 403
        no_token = client.post('/decide', data={**form, 'csrf': csrf, 'token': ''})
        assert no_token.status_code == 403 and 'token' in no_token.text
        wrong_token = client.post('/decide', data={**form, 'csrf': csrf, 'token': ui.token[::-1] + 'x'})
        assert wrong_token.status_code == 403 and 'wrong or missing decision token' in wrong_token.text
        # Edited arguments the tool does not take: refused before anything is sent (DC051, naming the field).
        bad_args = client.post('/decide', data={**form, 'csrf': csrf, 'args': '{"nope": 1}'})
        assert bad_args.status_code == 409 and 'DC051' in bad_args.text and 'nope' in bad_args.text, bad_args.text
        assert pending(['--engine', 'dbos', '--db', ui.db], run_id) == [call]  # nothing changed
        assert revocations(crash_dir) == []
        denied = client.post('/decide', data={**form, 'csrf': csrf, 'decision': 'deny', 'reason': 'not today'})
        assert denied.status_code == 303 and denied.headers['location'].startswith('/approvals?verb=denied')
    assert proc.report(timeout=120)['output'] == 'result: not today'
    assert revocations(crash_dir) == []


def test_html_and_script_in_a_tool_argument_and_a_conversation_id_render_as_text(ui: UI, browser, spawn,
                                                                                 tmp_path: Path) -> None:
    """A tool argument and a conversation id made of HTML and script: on the approvals, runs, run and conversation
    pages no injected element exists in the DOM, nothing ran, and the payload is visible as text."""
    from selenium.webdriver.common.by import By

    arg = '<script>window.__pwned=1</script><img/src=x/onerror=window.__pwned=2><b/id=inj-arg>x</b>'
    conversation = '<b id="inj-conv">c</b><script>window.__pwned=3</script>'
    proc, run_id, call, crash_dir = start_gated(ui, spawn, tmp_path, f'revoke {arg}', conversation)
    assert call['args'] == {'user': arg}

    def clean() -> None:
        for selector in ('script', 'img', '#inj-arg', '#inj-conv'):
            assert browser.find_elements(By.CSS_SELECTOR, selector) == [], (selector, browser.current_url)
        assert browser.execute_script('return window.__pwned === undefined')

    browser.get(ui.url + '/approvals')
    clean()
    box = call_box(browser, run_id)
    assert json.loads(box.find_element(By.CSS_SELECTOR, '.args').text) == {'user': arg}
    assert f'conversation {conversation}' in box.text
    browser.get(f'{ui.url}/?engine=dbos')
    clean()
    assert row(browser, run_id).find_element(By.CSS_SELECTOR, '.conversation').text == conversation
    form = call_box_on_run_page(browser, ui, run_id)
    clean()
    form.find_element(By.NAME, 'reason').send_keys('no')
    form.find_element(By.NAME, 'token').send_keys(ui.token)
    form.find_element(By.CSS_SELECTOR, 'button').click()
    assert proc.report(timeout=120)['output'] == 'result: no'
    browser.get(f'{ui.url}/runs/dbos/{run_id}')
    clean()
    conversation_link = browser.find_element(By.CSS_SELECTOR, '#run-info a')
    assert conversation_link.text == conversation
    conversation_link.click()
    settle(browser, lambda d: d.find_elements(By.CSS_SELECTOR, '#conversation h2 .mono'))
    clean()
    assert browser.find_element(By.CSS_SELECTOR, '#conversation h2 .mono').text == conversation
    calls = [r.text for r in browser.find_elements(By.CSS_SELECTOR, '#messages tr.part-tool-call')]
    assert any(json.dumps({'user': arg}, ensure_ascii=False) in r for r in calls), calls
    assert revocations(crash_dir) == []


def call_box_on_run_page(driver, ui: UI, run_id: str):
    from selenium.webdriver.common.by import By

    driver.get(f'{ui.url}/runs/dbos/{run_id}')
    return call_box(driver, run_id).find_element(By.CSS_SELECTOR, 'form.deny')
