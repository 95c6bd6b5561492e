"""`durcap worker dbos`: a long-lived DBOS executor serving agents' workflows and a queue until SIGTERM / SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dbos import DBOS
from sqlalchemy.exc import OperationalError, ProgrammingError

from ... import _upstream
from ..._limits import InputError, postgres_database_missing, redact_database_url
from ...conversations import resolve_payload, store_url
from ...report import RunReport
from .._adapter import DrainCutShortError, RunOptions
from .._stall import Progress, WaitingForWorker, notice_stalls, wait_notice
from ._approvals import parked_workflow_ids
from ._client import client as dbos_client
from ._client import database_error_line, quiet_dbos_log
from ._peers import DEFAULT_PEER_TIMEOUT, HEARTBEAT_SECONDS, Peers
from ._server import launch, system_database_url, version_serving
from ._spec import APP_NAME, DEFAULT_WORKER_CONCURRENCY, ENGINE, WORKER_EXECUTOR, WORKER_QUEUE
from ._workflow import agent_workflow

if TYPE_CHECKING:
    from ...agent import DurableAgent


def serve_worker(agents: Sequence[DurableAgent[Any, Any]], options: RunOptions) -> None:
    """Serve `agents`' workflows as a long-lived DBOS executor until SIGTERM / SIGINT.

    Settings: `db` (system database URL), `executor_id` (default `local`, DBOS's own default: launch
    recovers that executor's pending workflows), `task_queue` (the DBOS queue served, default `durcap`,
    where `durcap runs resume` and `durcap run --queue` hand runs), `concurrency` (runs this worker takes from the
    queue at once: DBOS's `worker_concurrency`, default `DEFAULT_WORKER_CONCURRENCY`), `peer_timeout` (seconds of
    silence after which a peer worker's pending workflows are recovered here, `_peers`; 0: off; default
    `DEFAULT_PEER_TIMEOUT`), `graceful_shutdown` (seconds running workflows get to finish), `store`
    (conversation store URL of the steps this worker runs), `ready` (a callable without arguments, called once the
    worker serves, right after its ready line: `workers/dbos_app.py` writes its ready file there).

    Raises:
        OSError / RuntimeError: the system database cannot be served.
        DrainCutShortError: stopped with workflows of this executor still PENDING after the drain (`_drain`): the
            message names them and who finishes them.
    """
    for agent in agents:
        agent_workflow(agent, store=options.setting('store'))
    executor = options.setting('executor_id', WORKER_EXECUTOR)
    queue = options.setting('task_queue', WORKER_QUEUE)
    url = system_database_url(options.setting('db'))
    pending: list[Any] = []
    if (missing := postgres_database_missing(url)) is not None:  # nothing to recover: DBOS creates it at launch
        options.notify(f'dbos worker: the server has no database {missing!r} yet: DBOS creates it')
    else:
        client = dbos_client({'db': url})
        try:
            pending = client.list_workflows(status='PENDING', executor_id=executor, load_input=False, load_output=False)
        except (OperationalError, ProgrammingError):  # a new system database: DBOS creates its tables at launch
            pending = []
        finally:
            client.destroy()
    # A progress line before DBOS launches (creating a new system database's tables and recovering pending workflows
    # take seconds), and the stop handlers before it too: a SIGTERM while launching is reported, not silent.
    options.notify(f'dbos worker starting: executor {executor!r}, system database {redact_database_url(url)}, '
                   f'{len(pending)} pending workflows to recover ...')
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    launched = False
    peers: Peers | None = None
    watch: threading.Thread | None = None
    left: list[str] | None = []
    seconds = int(options.setting('graceful_shutdown', 30))
    try:
        launch(APP_NAME, system_database_url_=url, executor_id=executor, serving=agents)  # its version names them
        launched = True
        if stop.is_set():
            options.notify('dbos worker: stop requested while launching; stopping before ready')
            return
        concurrency = int(options.setting('concurrency') or DEFAULT_WORKER_CONCURRENCY)
        DBOS.register_queue(queue, worker_concurrency=concurrency)
        timeout = float(options.setting('peer_timeout', DEFAULT_PEER_TIMEOUT) or 0)
        if timeout > 0:
            peers = Peers(url, executor, queue, timeout, options.notify)
            shared = peers.shared_with()
            if shared:
                options.notify(f'dbos worker: another live worker beats as executor {executor!r} ({shared}): if either '
                               'dies, the other cannot notice; give each worker its own --executor-id')
            peers.beat()
            watch = threading.Thread(target=peers.watch, args=(stop,), name='durcap-dbos-peers', daemon=True)
            watch.start()
        watching = (f'recovers peers silent for {timeout:g} s' if timeout > 0 else 'peer recovery off')
        options.notify(f'dbos worker ready: executor {executor!r} (recovering {len(pending)} pending '
                       f'workflows), queue {queue!r} (at most {concurrency} runs at once here; {watching}), system '
                       f'database {redact_database_url(url)}, application version {DBOS.application_version}; '
                       'Ctrl-C or SIGTERM to stop')
        ready = options.setting('ready')
        if ready is not None:
            ready()
        stop.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if watch is not None:
            watch.join(timeout=HEARTBEAT_SECONDS * 2)
        if launched:
            left = _drain(peers, url, executor, seconds, options.notify)
    if left:
        raise DrainCutShortError(ENGINE, left, _left_line(executor, left, seconds, peers, queue))


_LISTED = 10
"""Workflow ids a cut-short drain names; the rest are counted."""


def _left_line(executor: str, left: list[str], seconds: int, peers: Peers | None, queue: str) -> str:
    """One line: how many of `executor`'s workflows the drain of `seconds` left PENDING, their ids (the first
    `_LISTED`), and who finishes them (a peer after its timeout when peer recovery is on; else this executor id
    launching again, or `durcap runs resume`)."""
    ids = ', '.join(left[:_LISTED]) + (f' and {len(left) - _LISTED} more' if len(left) > _LISTED else '')
    if peers is not None:
        then = (f'a peer recovers them after {peers.timeout:g} s without this heartbeat (or this executor id '
                'launching again)')
    else:
        then = (f'peer recovery is off (--peer-timeout 0): a worker launched as this executor id recovers them '
                f'(`durcap worker dbos TARGET --queue {queue} --executor-id {executor}`), or `durcap runs resume '
                'ID` one by one')
    return (f'dbos worker {executor!r}: {len(left)} workflows still running when the {seconds} s drain ended stay '
            f'PENDING ({ids}); {then}')


CANCELLED_LOG = 'Asyncio task cancelled for workflow or step'
"""The start of the warning DBOS logs (`dbos._outcome`) for each workflow and step task cancelled by its shutdown."""


def _who_resumes(peers: Peers | None, executor: str) -> str:
    """Who runs this executor's workflows left PENDING by a drain: a peer after its timeout, else this executor id."""
    if peers is not None:
        return f'a peer resumes them after {peers.timeout:g} s without this heartbeat (or this executor id launching again)'
    return f'a worker launched as executor {executor!r} resumes them (peer recovery is off), or `durcap runs resume ID`'


def _ids(ids: Sequence[str]) -> str:
    return ', '.join(ids[:_LISTED]) + (f' and {len(ids) - _LISTED} more' if len(ids) > _LISTED else '')


def _wait_for_running(peers: Peers | None, executor: str, seconds: int, notify: Callable[[str], None]) -> set[str]:
    """The drain's wait: take no new workflow (`_upstream.dbos_stop_taking_work`), say what is waited for, then wait
    up to `seconds` for the workflows running here, not for those parked on an approval (`parked_workflow_ids`: each
    waits for a decision in the system database, and another process resumes it; DBOS's own drain waited its whole
    time for them). A parked workflow that gets its decision meanwhile runs again and is waited for.

    Returns:
        The workflows parked when the wait ended.
    """
    _upstream.dbos_stop_taking_work()
    deadline = time.monotonic() + seconds
    active, parked = _upstream.dbos_active_workflow_ids(), parked_workflow_ids()
    running, held = [w for w in active if w not in parked], [w for w in active if w in parked]
    waiting = (f'waiting up to {seconds} s for {len(running)} running workflow(s) ({_ids(running)})' if running else
               'no workflow is running here')
    notify(f'dbos worker {executor!r}: draining: {waiting}' + (
        f'; not waiting for {len(held)} parked on an approval ({_ids(held)}): their decisions wait in the system '
        f'database and {_who_resumes(peers, executor)}' if held else ''))
    while running and time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
        parked = parked_workflow_ids()
        running = [w for w in _upstream.dbos_active_workflow_ids() if w not in parked]
    return parked


def _drain(peers: Peers | None, url: str, executor: str, seconds: int, notify: Callable[[str], None]) -> list[str] | None:
    """Stop a launched worker: the running workflows get `seconds` to finish (`_wait_for_running`; those parked on an
    approval are not waited for), then DBOS stops (`DBOS.destroy`), then this worker's heartbeat row (`_peers`).

    The row is kept fresh while DBOS drains (a peer must not recover workflows that still run here), deleted when
    none of this executor's workflows is left PENDING, and otherwise left to go stale, so that a peer recovers what
    the drain did not finish after its peer timeout: with an executor id per pod, no later process would ever
    launch under this id and recover them itself (a process that does, e.g. a compose service restarted under its
    fixed id, recovers them at launch; DBOS runs each recovered workflow once either way).

    Returns:
        The ids of this executor's workflows left PENDING (empty: drained) but those parked on an approval (said on
        `notify`: they keep the heartbeat row stale all the same, so a peer resumes them), `None` when they cannot be
        read (said on `notify`).
    """
    drained = threading.Event()
    beating: threading.Thread | None = None
    if peers is not None:
        def beat() -> None:
            while True:
                with contextlib.suppress(Exception):  # a missed beat while draining: the next one may land
                    peers.beat()
                if drained.wait(HEARTBEAT_SECONDS):
                    return

        beating = threading.Thread(target=beat, name='durcap-dbos-drain-beat', daemon=True)
        beating.start()
    parked: set[str] = set()
    try:
        # DBOS warns once per workflow and step the drain cancels ("Asyncio task cancelled for workflow or step <function
        # ...>", with an address): what was left is said in our own line after it (`DrainCutShortError`).
        with quiet_dbos_log(CANCELLED_LOG):
            try:
                parked, left_to_dbos = _wait_for_running(peers, executor, seconds, notify), 0  # waited: stop now
            except (AttributeError, ImportError) as exc:  # DBOS changed its private parts: its own drain, as before
                notify(f'dbos worker {executor!r}: draining as DBOS does (up to {seconds} s, parked runs included): '
                       f'{type(exc).__name__}: {exc}')
                left_to_dbos = seconds
            DBOS.destroy(workflow_completion_timeout_sec=left_to_dbos)
    finally:
        drained.set()
        if beating is not None:
            beating.join(timeout=HEARTBEAT_SECONDS * 2)
    left = _pending_ids(url, executor)
    if peers is not None:
        if left == []:
            peers.leave()
        else:
            peers.close()
    if left is None:
        notify(f'dbos worker {executor!r}: could not read the workflows left PENDING after the {seconds} s drain'
               + (f'; a peer recovers any after {peers.timeout:g} s without this heartbeat' if peers is not None else ''))
        return None
    waiting = [w for w in left if w in parked]
    if waiting:
        notify(f'dbos worker {executor!r}: {len(waiting)} workflow(s) parked on an approval stay PENDING '
               f'({_ids(waiting)}): {_who_resumes(peers, executor)}')
    return [w for w in left if w not in parked]


def _pending_ids(url: str, executor: str) -> list[str] | None:
    """The ids of `executor`'s workflows PENDING in the system database at `url` (`None`: it cannot be read)."""
    try:
        client = dbos_client({'db': url})
    except Exception:  # noqa: BLE001 - unknown is reported as such; the row stays, and a peer's recovery is harmless
        return None
    try:
        return [w.workflow_id for w in client.list_workflows(status='PENDING', executor_id=executor, load_input=False,
                                                             load_output=False)]
    except Exception:  # noqa: BLE001 - as above
        return None
    finally:
        client.destroy()


def worker_command(queue: str, db: str | None = None, store: str | None = None) -> str:
    """The `durcap worker dbos` command line that serves `queue`: `--db` (the system database the run was handed to)
    and `--store` named when given, each shown without its password, since a worker on another system database never
    sees the run and one on another conversation store writes its events where `durcap serve` never reads them."""
    where = f' --db {redact_database_url(db)}' if db else ''
    stored = f' --store {redact_database_url(store)}' if store else ''
    return f'durcap worker dbos TARGET{where} --queue {queue}{stored}'


def no_worker_seen(queue: str, db: str | None = None, store: str | None = None) -> str:
    """The line for a queue no live `durcap worker dbos` serves (no heartbeat row of one in `DEFAULT_PEER_TIMEOUT`);
    `db`, `store`: as `worker_command`."""
    return (f'no `durcap worker dbos` serving queue {queue!r} was seen in the last {DEFAULT_PEER_TIMEOUT:g} s: the run '
            f'waits on the queue until one does (start `{worker_command(queue, db, store)}`)')


def never_served(url: str, queue: str) -> str:
    """The line (DC040, naming `--db` and the fix) for a system database no DBOS worker has ever run on: runs handed to
    `queue` there cannot be enqueued (DBOS's tables are missing) until a worker has created them."""
    return (f'no DBOS worker has ever run on {redact_database_url(url)}: start `durcap worker dbos TARGET --db URL '
            f'--queue {queue}` first (it creates the system database), then hand runs to its queue')


async def check_serving(settings: Any) -> list[str]:
    """`durcap serve --engine dbos`'s start check of the system database `settings['db']` (default SQLite at
    `.durcap/dbos.sqlite`): a line (DC040 `--db`, naming the fix) when no DBOS worker has ever run there (a SQLite
    file that does not exist, or a database without DBOS's tables; PostgreSQL: a database the server does not have
    yet): every turn fails until one has. Nothing is created or written.

    Returns:
        The warning lines (`[]`: a worker has run there).

    Raises:
        EngineUnreachableError: the system database cannot be reached (the server is down, the URL refused).
    """
    from .._adapter import EngineUnreachableError
    from ._runs import _missing_sqlite_file, _no_dbos_tables

    url = system_database_url(settings.get('db'), create=False)
    queue = settings.get('queue') or WORKER_QUEUE
    never = [str(InputError('--db', f'no DBOS worker has ever run on {redact_database_url(url)}: every turn fails '
                            f'until one has; start `durcap worker dbos TARGET --db URL --queue {queue}` (it creates '
                            'the system database)'))]
    if _missing_sqlite_file({'db': url}) is not None:
        return never
    if await asyncio.to_thread(postgres_database_missing, url) is not None:
        return never
    try:
        client = await asyncio.to_thread(dbos_client, {'db': url})
    except RuntimeError as exc:  # one line naming the database and the driver's reason
        raise EngineUnreachableError(str(exc)) from None
    try:
        await asyncio.to_thread(client.list_application_versions)
    except (OperationalError, ProgrammingError) as exc:
        if _no_dbos_tables(exc):
            return never
        raise EngineUnreachableError(f'the DBOS system database {redact_database_url(url)} cannot be read: '
                                     f'{database_error_line(exc)}') from None
    finally:
        client.destroy()
    from ._peers import live_executors

    serving = [e for e in await asyncio.to_thread(live_executors, url) if e['queue'] == queue
               and e['age'] < DEFAULT_PEER_TIMEOUT]
    return [] if serving else [no_worker_seen(queue, url, settings.get('store')).replace('the run waits', 'turns wait')]


async def enqueue_and_wait(agent: DurableAgent[Any, Any], url: str, queue: str, workflow_id: str,
                           args: tuple[Any, ...], options: RunOptions) -> RunReport:
    """`durcap run --engine dbos --queue QUEUE`: hand one run of `agent` to the workers serving `queue` and wait.

    The run is enqueued through a `DBOSClient` (DBOS's own way to start a workflow from outside the application)
    with the newest application version whose workers serve `agent` (`_server.version_serving`), so a worker of
    another agent on the same queue never takes it (without one, DBOS gives it to the latest version's workers), and
    this process runs nothing. Says so when no worker serving `queue` has beaten in the last
    `DEFAULT_PEER_TIMEOUT` seconds (`_peers`): the run waits on the queue until one does. While it waits, says once
    per stall when the run has waited `_stall.wait_notice()` seconds for a worker without progress
    (`_notice_no_progress`), and keeps waiting.

    Args:
        agent: The agent (its workflow `durcap.{name}` must be served by the workers).
        url: The system database URL.
        queue: The DBOS queue.
        workflow_id: The run's workflow id.
        args: The workflow's arguments `(prompt, deps JSON, message history JSON, conversation id[, busy])`.
        options: The run's options (`started`, `notify`).

    Returns:
        The run's `RunReport` (steps as DBOS recorded them).

    Raises:
        RuntimeError: the system database cannot be reached (one line).
        InputError: DC040 naming `--db`, when no DBOS application has ever run on the system database (a SQLite file
            that does not exist, a PostgreSQL database the server does not have, or a database without DBOS's
            tables): no worker can be serving the queue, and the
            tables a worker creates are missing; checked before anything is written (the file is not created).
        Exception: the workflow's own error, as DBOS re-raises it.
    """
    from dbos import EnqueueOptions

    from ._peers import live_executors
    from ._runs import _missing_sqlite_file, _no_dbos_tables
    from ._spec import workflow_names

    seconds = wait_notice()  # DC040 on a bad $DURCAP_WAIT_NOTICE, before the run is enqueued
    no_worker_yet = never_served(url, queue)
    if _missing_sqlite_file({'db': url}) is not None:
        raise InputError('--db', no_worker_yet)
    try:
        client = dbos_client({'db': url})
    except RuntimeError as exc:  # a PostgreSQL database no worker has created yet: the same coded line
        if await asyncio.to_thread(postgres_database_missing, url, str(exc)) is not None:
            raise InputError('--db', no_worker_yet) from None
        raise
    try:
        enqueue: EnqueueOptions = {'queue_name': queue, 'workflow_name': workflow_names(agent)[0],
                                   'workflow_id': workflow_id}
        try:  # the newest workers serving this agent take it, never another agent's (`application_version`)
            version = version_serving([v['version_name'] for v in await asyncio.to_thread(
                client.list_application_versions)], agent)
        except (OperationalError, ProgrammingError):  # no DBOS tables yet: the enqueue below says so
            version = None
        if version is not None:
            enqueue['app_version'] = version
        try:
            handle = await client.enqueue_async(enqueue, *args)
        except (OperationalError, ProgrammingError) as exc:
            if _no_dbos_tables(exc):
                raise InputError('--db', no_worker_yet) from None
            raise
        options.started(workflow_id, f'dbos workflow id: {workflow_id} (handed to queue {queue!r}: a '
                        '`durcap worker dbos` serving it runs it)')
        serving = [e for e in live_executors(url) if e['queue'] == queue and e['age'] < DEFAULT_PEER_TIMEOUT]
        if not serving:
            options.notify(WaitingForWorker(no_worker_seen(queue, url, options.setting('store'))))
        notice = asyncio.create_task(_notice_no_progress(client, url, queue, workflow_id, options.notify, seconds,
                                                        options.setting('store')))
        try:
            payload = await handle.get_result()
        finally:
            notice.cancel()
        steps = await client.list_workflow_steps_async(workflow_id)
    finally:
        client.destroy()
    payload = await resolve_payload(payload, store=store_url(agent, options.setting('store')))
    return RunReport.from_payload(ENGINE, workflow_id, payload, [step['function_name'] for step in steps])


async def _notice_no_progress(client: Any, url: str, queue: str, workflow_id: str, notify: Callable[[str], None],
                              seconds: float, store: str | None = None) -> None:
    """Say once per stall, on `notify`, when run `workflow_id` has waited `seconds` for a worker without progress
    (`_stall.notice_stalls`), until it ends or this task is cancelled.

    Progress is the workflow's status, its executor and its number of recorded steps. It waits for a worker while it
    is ENQUEUED (no worker took it from `queue`), or PENDING under an executor whose heartbeat row (`_peers`) is
    missing or older than `seconds` (its worker died: a worker launched as that executor id, or a peer after its
    `--peer-timeout`, takes it over). A worker running with `--peer-timeout 0` beats no row, so a long step of its
    runs is reported too.
    """
    from ._peers import live_executors

    async def probe() -> Progress:
        [status] = await client.list_workflows_async(workflow_ids=[workflow_id], load_input=False, load_output=False)
        if status.status not in ('ENQUEUED', 'PENDING'):
            return Progress(None, None, done=True)
        steps = await client.list_workflow_steps_async(workflow_id)
        waiting = None
        if status.status == 'ENQUEUED':
            waiting = 'it is ENQUEUED: no worker took it'
        else:
            beats = {e['executor_id']: e['age'] for e in await asyncio.to_thread(live_executors, url)}
            if beats.get(status.executor_id, seconds) >= seconds:
                waiting = f'its worker, executor {status.executor_id!r}, sends no heartbeat'
        return Progress((status.status, status.executor_id, len(steps)), waiting)

    async def line(waiting: str, waited: float) -> str:
        return (f'still waiting: no worker has picked up run {workflow_id} on queue {queue!r} for {waited:g} s '
                f'({waiting}; no step recorded meanwhile): is a worker running? '
                f'`{worker_command(queue, url, store)}` (the run is durable: a worker launched as its executor id, or a live peer after '
                'its --peer-timeout, finishes it)')

    await notice_stalls(probe, line, notify, seconds)
